"""``math``: tool-using math agent (IPython + think), answer in ``\\boxed{}``. See README.md here."""
from handlers.math.handler import MathHandler

__all__ = ["MathHandler"]
