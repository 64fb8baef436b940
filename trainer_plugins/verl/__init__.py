"""verl 0.9.1 adapter: :class:`trainer_plugins.verl.agent_loop.ProRLAgentLoop` (an ``AgentLoopBase`` that runs
each row as a job on a ProRL rollout server) and Hydra configs for async DAPO and CISPO in ``config/``.

Importing this package does not import verl; ``trainer_plugins.verl.agent_loop`` does.
"""
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent / "config"
"""Hydra config directory: ``prorl_dapo.yaml``, ``prorl_cispo.yaml`` and the agent loop registry
``agent_loop.yaml``."""
