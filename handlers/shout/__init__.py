"""``shout``: a learnable two-turn task with an environment message between the model's turns (see README.md)."""
from handlers.shout.handler import ShoutHandler, ShoutInstance, capital_share, load_dataset

__all__ = ["ShoutHandler", "ShoutInstance", "capital_share", "load_dataset"]
