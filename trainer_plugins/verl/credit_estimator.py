"""verl advantage estimator ``prorl_rtg``: per-turn reward-to-go with a leave-one-out group baseline (issue #35
part 4; the credit of :mod:`trainer_plugins.credit`).

Chosen with ``algorithm.adv_estimator=prorl_rtg`` (registered in verl's ``ADV_ESTIMATOR_REGISTRY`` when this
module is imported: :mod:`trainer_plugins.verl.cpu_platform` imports it, and verl loads that module in the
driver and every worker through ``VERL_USE_EXTERNAL_MODULES``). Default off: the shipped configs keep
``grpo``, which sums ``rm_scores`` to one score per row and so sees exactly what it saw before turn rewards.

What it computes from verl's ``token_level_rewards`` (the rows' ``rm_scores``: each turn's reward on its last
sampled token, :class:`trainer_plugins.verl.agent_loop.ProRLAgentLoopOutput`) and ``response_mask`` (a turn =
a run of mask 1):

- ``returns[b, t]`` = the reward-to-go of token t's turn, discounted per turn by ``algorithm.gamma``
  (:func:`trainer_plugins.credit.mask_returns`);
- ``advantages[b, t]`` = ``returns[b, t]`` minus the mean row return (the return at the row's first sampled
  token) of the other rows of the same prompt group (``uid``; RLOO), times the mask. Not divided by a group
  standard deviation (``norm_adv_by_std_in_grpo`` is ignored): the later turns' returns differ from the row
  return even when every row of a group has the same return, so a std near 0 would blow them up (and the
  division biases the gradient, Liu et al. 2025, "Understanding R1-Zero-Like Training", Dr. GRPO).

Why not per-turn-index normalisation: it is biased when the policy chooses when to stop (verl issue #7244;
``tests/trainer/test_turn_credit_mdp.py``).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional

import numpy as np
import torch
from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, register_adv_est

from trainer_plugins.credit import mask_returns

NAME = "prorl_rtg"


def compute_prorl_rtg_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                index: Optional[np.ndarray] = None, config: Any = None,
                                **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)``, each ``(B, L)`` float32 like ``token_level_rewards`` (see the module doc).

    ``token_level_rewards``, ``response_mask``: ``(B, L)``. ``index``: the rows' prompt-group ids (verl's
    ``uid``), length B; None: every row its own group (baseline 0). ``config``: verl's ``AlgoConfig`` (its
    ``gamma``, the discount per turn); None: gamma 1.
    """
    gamma = float(getattr(config, "gamma", 1.0)) if config is not None else 1.0
    mask = response_mask.detach().cpu().numpy().astype(bool)
    g = mask_returns(token_level_rewards.detach().float().cpu().numpy(), mask, gamma)
    first = np.where(mask.any(axis=1), mask.argmax(axis=1), 0)
    row_return = g[np.arange(g.shape[0]), first]
    groups: dict[Any, list[int]] = defaultdict(list)
    for i, uid in enumerate(index if index is not None else range(g.shape[0])):
        groups[uid].append(i)
    baseline = np.zeros(g.shape[0])
    for rows in groups.values():
        values = row_return[rows]
        n = len(rows)
        if n > 1:
            baseline[rows] = (values.sum() - values) / (n - 1)
    adv = (g - baseline[:, None]) * mask
    dtype, device = token_level_rewards.dtype, token_level_rewards.device
    return (torch.as_tensor(adv, dtype=dtype, device=device),
            torch.as_tensor(g * mask, dtype=dtype, device=device))


if ADV_ESTIMATOR_REGISTRY.get(NAME) is None:  # importing twice (reload, two module paths) registers once
    register_adv_est(NAME)(compute_prorl_rtg_advantage)
