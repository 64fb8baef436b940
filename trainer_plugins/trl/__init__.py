"""TRL (trl 1.16) plugin: ``GRPOTrainer`` rollouts on ProRL rollout servers and the weight push that keeps the
servers' vLLM backends on the trainer's weights. See README.md "Training with TRL" and trainer_plugins/trl/README.md.

Importing this package does not import trl; :class:`WeightPushCallback` subclasses
``transformers.TrainerCallback`` when transformers is installed.
"""
from trainer_plugins.jobs import InvalidInstanceError, RolloutAuthError
from trainer_plugins.trl.rollout import ProRLRollout, RolloutStats, UnknownPromptError, ratio_deviation, server_reward
from trainer_plugins.trl.weights import PushReport, WeightPushCallback, WeightPushError, push_weights, save_weights

__all__ = ["InvalidInstanceError", "ProRLRollout", "PushReport", "RolloutAuthError", "RolloutStats",
           "UnknownPromptError", "WeightPushCallback", "WeightPushError", "push_weights", "ratio_deviation",
           "save_weights", "server_reward"]
