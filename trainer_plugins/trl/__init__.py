"""TRL (trl 1.16) plugin: ``GRPOTrainer`` rollouts on ProRL rollout servers and the weight push that keeps the
servers' vLLM backends on the trainer's weights. See docs/training-trl.md and trainer_plugins/trl/README.md.

Importing this package does not import trl; :class:`WeightPushCallback` subclasses
``transformers.TrainerCallback`` when transformers is installed.
"""
from trainer_plugins.jobs import InvalidInstanceError, RolloutAuthError
from trainer_plugins.trl.rollout import (ProRLRollout, RolloutStats, UnknownPromptError, enable_importance_sampling,
                                      per_token_versions, ratio_deviation, server_reward)
from trainer_plugins.trl.weights import (PushReport, SwapRefusedError, WeightPushCallback, WeightPushError,
                                      checkpoint_state_dict, gather_full_state_dict, push_weights, save_weights,
                                      swap_weights)

__all__ = ["InvalidInstanceError", "ProRLRollout", "PushReport", "RolloutAuthError", "RolloutStats", "SwapRefusedError",
           "UnknownPromptError", "WeightPushCallback", "WeightPushError", "checkpoint_state_dict",
           "enable_importance_sampling", "gather_full_state_dict", "per_token_versions", "push_weights",
           "ratio_deviation", "save_weights", "server_reward", "swap_weights"]
