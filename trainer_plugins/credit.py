"""Per-turn credit for multi-turn rollouts (issue #35 part 4): what each sampled token is credited with.

A job result splits its reward over its model turns (``JobResult.turns``: each turn's ``trajectory_index``,
its sampled tokens as the span ``[response_start, response_end)`` of that trajectory's ``response_ids``, and
its ``reward`` share; the shares sum to ``result.reward``). Two layouts come out of it, used by both trainer
plugins (verl's ``rm_scores``, TRL's rows):

- **per-token rewards** (:func:`token_rewards`): each turn's reward on its last sampled token, 0 elsewhere, as
  SkyRL and verl's own ``rm_scores`` place a step's reward. Summed over a row they give the row's share of the
  reward, so a trainer that reduces ``rm_scores`` to one score per row (GRPO, RLOO) sees what it saw before.
- **reward-to-go** (:func:`turn_returns`, :func:`token_returns`): every token of turn ``k`` carries
  ``G_k = r_k + gamma * G_{k+1}`` (the return from its turn on; REINFORCE with reward-to-go, Sutton & Barto,
  *Reinforcement Learning: An Introduction*, 2nd ed., section 13.3; Williams 1992), the discount counted in
  turns, not tokens. A turn's action cannot change the rewards earned before it, so dropping them keeps the
  policy-gradient estimate unbiased and lowers its variance; with a baseline that does not depend on the
  trajectory's own actions (a leave-one-out group mean, :func:`rloo_baseline`) it stays unbiased when the
  policy decides when to stop. Per-turn-index normalisation (MT-GRPO's, verl issue #7244) subtracts one
  group mean per turn the trajectory took, so the number of terms is the trajectory's own choice: biased;
  ``tests/trainer/test_turn_credit_mdp.py`` measures both.

numpy only: the plugins import this without torch, verl or TRL.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import numpy as np

__all__ = ["turn_returns", "token_rewards", "token_returns", "fit_spans", "mask_returns", "rloo_baseline", "row_turns", "turn_split",
           "row_token_credit", "row_token_returns"]


def turn_returns(turn_rewards: np.ndarray | Sequence[float], gamma: float = 1.0) -> np.ndarray:
    """Discounted reward-to-go per turn: ``G_k = r_k + gamma * G_{k+1}``, ``G_{K-1} = r_{K-1}``.

    ``turn_rewards``: shape ``(..., K)`` (K turns on the last axis; an episode that ended earlier is padded
    with zeros after its last turn, which leaves its returns unchanged). ``gamma``: discount per turn, in
    ``[0, 1]``. Returns float64 of the same shape.

    Raises: ValueError: ``gamma`` outside ``[0, 1]`` or not finite, or a non-finite reward.
    """
    gamma = float(gamma)
    if not (0.0 <= gamma <= 1.0):
        raise ValueError(f"gamma must be in [0, 1], got {gamma!r}")
    r = np.asarray(turn_rewards, dtype=np.float64)
    if not np.all(np.isfinite(r)):
        raise ValueError("turn rewards must be finite")
    out = np.empty_like(r)
    acc = np.zeros(r.shape[:-1], dtype=np.float64)
    for k in range(r.shape[-1] - 1, -1, -1):
        acc = r[..., k] + gamma * acc
        out[..., k] = acc
    return out


def _check_spans(response_length: int, spans: Sequence[tuple[int, int]], n_rewards: int) -> None:
    if len(spans) != n_rewards:
        raise ValueError(f"{len(spans)} turn spans for {n_rewards} turn rewards")
    prev_end = 0
    for start, end in spans:
        if not (prev_end <= start < end <= response_length):
            raise ValueError(f"turn span [{start}, {end}) is empty, overlaps the previous turn or lies outside "
                             f"the {response_length} response tokens")
        prev_end = end


def fit_spans(response_length: int, spans: Sequence[tuple[int, int]],
              rewards: Sequence[float]) -> tuple[list[tuple[int, int]], list[float]]:
    """The turns of a row as :func:`token_rewards` takes them, the rewards' sum kept: spans cut to the row's
    ``response_length`` (a trainer truncates long rows), and a turn left with no token (it sampled nothing, or
    lies past the cut) gives its reward to the nearest earlier turn that has tokens (the next one when none
    does). Returns ``([], [])`` when no turn has a token. Spans must be in order and not overlap.

    Raises: ValueError: spans and rewards differ in number, or spans overlap or go backwards.
    """
    if len(spans) != len(rewards):
        raise ValueError(f"{len(spans)} turn spans for {len(rewards)} turn rewards")
    out_spans: list[tuple[int, int]] = []
    out_rewards: list[float] = []
    carry = 0.0  # rewards of tokenless turns before the first turn with tokens
    prev_end = 0
    for (start, end), r in zip(spans, rewards):
        start, end = int(start), int(end)
        if start < prev_end or end < start:
            raise ValueError(f"turn span [{start}, {end}) goes backwards or overlaps the previous turn")
        prev_end = end
        end = min(end, response_length)
        if start < end:
            out_spans.append((start, end))
            out_rewards.append(float(r) + carry)
            carry = 0.0
        elif out_rewards:
            out_rewards[-1] += float(r)
        else:
            carry += float(r)
    if carry and out_rewards:
        out_rewards[0] += carry
    return out_spans, out_rewards


def mask_returns(token_rewards: np.ndarray, mask: np.ndarray, gamma: float = 1.0) -> np.ndarray:
    """Per-token reward-to-go of a batch whose turns are the runs of ``mask`` 1 (a turn's sampled tokens; the
    observations between turns are ``mask`` 0), rewards on each turn's last token (:func:`token_rewards`):
    every token of a turn gets ``G_k = r_k + gamma * G_{k+1}``, a masked token the return of the turn after it.
    What verl's trainer sees, where rows carry no turn spans (``rm_scores`` and ``response_mask``).

    ``token_rewards``, ``mask``: shape ``(B, L)``. ``gamma``: per-turn discount in ``[0, 1]``. Returns float64
    ``(B, L)``; with ``gamma`` 1 each row's first sampled token carries the row's summed reward.

    Raises: ValueError: shapes differ or ``gamma`` is outside ``[0, 1]``.
    """
    gamma = float(gamma)
    if not (0.0 <= gamma <= 1.0):
        raise ValueError(f"gamma must be in [0, 1], got {gamma!r}")
    r = np.asarray(token_rewards, dtype=np.float64)
    m = np.asarray(mask).astype(bool)
    if r.shape != m.shape or r.ndim != 2:
        raise ValueError(f"token rewards {r.shape} and mask {m.shape} must be the same (B, L)")
    out = np.zeros_like(r)
    acc = np.zeros(r.shape[0], dtype=np.float64)
    after = np.zeros(r.shape[0], dtype=bool)  # the token after this one is masked out (or the row ends)
    after[:] = True
    for t in range(r.shape[1] - 1, -1, -1):
        turn_end = m[:, t] & after
        # crossing into an earlier turn discounts what follows it; rewards off a turn's last token count as-is
        acc = np.where(turn_end, gamma * acc, acc) + r[:, t]
        out[:, t] = acc
        after = ~m[:, t]
    return out


def token_rewards(response_length: int, spans: Sequence[tuple[int, int]],
                  rewards: Sequence[float]) -> list[float]:
    """Per-token rewards of one row: turn ``k``'s reward on token ``spans[k][1] - 1`` (its last sampled token),
    0.0 elsewhere.

    ``response_length``: the row's number of response tokens R. ``spans``: the row's turns in order, each
    ``(response_start, response_end)`` (token indices, end exclusive, non-empty, non-overlapping, within R).
    ``rewards``: one per span. Returns a list of R floats summing to ``sum(rewards)``.

    Raises: ValueError: spans and rewards differ in number, or a span is empty, out of order or out of range.
    """
    _check_spans(response_length, spans, len(rewards))
    out = [0.0] * response_length
    for (_, end), r in zip(spans, rewards):
        out[end - 1] += float(r)
    return out


def token_returns(response_length: int, spans: Sequence[tuple[int, int]], rewards: Sequence[float],
                  gamma: float = 1.0, tail: float = 0.0) -> list[float]:
    """Per-token reward-to-go of one row: every token of turn ``k``'s span carries ``G_k``
    (:func:`turn_returns` over ``rewards``, plus ``gamma ** (K - k) * tail``); tokens outside every span
    (prompt-side observations, tool output: ``loss_mask`` 0) carry 0.0.

    ``tail``: the return of the turns after this row (a trajectory split into several rows: the later rows'
    return, so a row's last turn is credited with what followed it). Other arguments as :func:`token_rewards`.
    Returns a list of R floats.

    Raises: ValueError: as :func:`token_rewards` and :func:`turn_returns`.
    """
    _check_spans(response_length, spans, len(rewards))
    g = turn_returns(list(rewards) + [float(tail)], gamma)[:-1] if rewards else []
    out = [0.0] * response_length
    for (start, end), value in zip(spans, g):
        out[start:end] = [float(value)] * (end - start)
    return out


def rloo_baseline(values: np.ndarray, group_size: int) -> np.ndarray:
    """Leave-one-out group mean (RLOO, Kool et al. 2019; Ahmadian et al. 2024): for each sample, the mean of
    the other ``group_size - 1`` members of its group. It does not depend on the sample's own actions, so
    subtracting it keeps a policy-gradient estimate unbiased.

    ``values``: shape ``(B, ...)`` with ``B`` a multiple of ``group_size`` and groups contiguous
    (``values[g * group_size:(g + 1) * group_size]``). Returns float64 of the same shape.

    Raises: ValueError: ``group_size < 2`` or ``B`` not a multiple of it.
    """
    v = np.asarray(values, dtype=np.float64)
    if group_size < 2 or v.shape[0] % group_size:
        raise ValueError(f"{v.shape[0]} samples do not form groups of {group_size} (>= 2)")
    g = v.reshape(v.shape[0] // group_size, group_size, *v.shape[1:])
    loo = (g.sum(axis=1, keepdims=True) - g) / (group_size - 1)
    return loo.reshape(v.shape)


def row_turns(turns: Iterable[object], trajectory_index: int) -> tuple[list[tuple[int, int]], list[float]]:
    """The spans and rewards of the turns of one trajectory row, in order, from a job result's ``turns``
    (objects or dicts with ``trajectory_index``, ``response_start``, ``response_end``, ``reward``)."""
    spans, rewards = [], []
    for t in turns:
        get = t.get if isinstance(t, dict) else (lambda k, _t=t: getattr(_t, k))
        if int(get("trajectory_index")) == trajectory_index:
            spans.append((int(get("response_start")), int(get("response_end"))))
            rewards.append(float(get("reward")))
    order = sorted(range(len(spans)), key=lambda i: spans[i][0])
    return [spans[i] for i in order], [rewards[i] for i in order]


def turn_split(turns: Sequence[object], reward: float,
               trajectory_index: int) -> Optional[tuple[list[tuple[int, int]], list[float]]]:
    """The spans and rewards of a job's turns (``JobResult.turns``) when the handler split ``reward`` over them
    (a turn before the last carries a non-zero share) and every turn lies in trajectory ``trajectory_index``;
    None otherwise: the whole reward stays on the row's last token (verl's placement). Shares that do not sum
    to ``reward`` within 1e-9 are not used either (None)."""
    turns = list(turns)
    get = [(t.get if isinstance(t, dict) else (lambda k, _t=t: getattr(_t, k))) for t in turns]
    shares = [float(g("reward")) for g in get]
    if len(turns) < 2 or not any(shares[:-1]):
        return None
    if any(int(g("trajectory_index")) != trajectory_index for g in get):
        return None
    if abs(math.fsum(shares) - float(reward)) > 1e-9:
        return None
    return row_turns(turns, trajectory_index)


def row_token_credit(response_length: int, reward: float,
                     split: Optional[tuple[list[tuple[int, int]], list[float]]]) -> list[float]:
    """Per-token rewards of one row of ``response_length`` tokens (> 0): the turns' shares on their last tokens
    when ``split`` (:func:`turn_split`) is given and some turn has a token within the row
    (:func:`fit_spans`), else the whole ``reward`` on the last token."""
    if split is not None:
        spans, shares = fit_spans(response_length, *split)
        if spans:
            return token_rewards(response_length, spans, shares)
    out = [0.0] * response_length
    out[-1] = float(reward)
    return out


def row_token_returns(response_length: int, reward: float, turns: Sequence[object], trajectory_index: int,
                      mask: Sequence[int], gamma: float = 1.0) -> list[float]:
    """Per-token reward-to-go of one row (:func:`token_returns`): the turns of trajectory ``trajectory_index``
    with their shares when the handler split the reward (:func:`turn_split`), else with the whole ``reward``
    on the last of them; a row with no turn records (an older server) is one turn: every token with ``mask``
    1 carries ``reward``. Tokens outside every turn carry 0.0. Returns a list of ``response_length`` floats.

    Raises: ValueError: ``gamma`` outside ``[0, 1]``, or turn spans that overlap or go backwards.
    """
    split = turn_split(turns, reward, trajectory_index)
    if split is None:
        spans, _ = row_turns(turns, trajectory_index)
        split = (spans, [0.0] * (len(spans) - 1) + [float(reward)]) if spans else None
    if split is not None:
        spans, shares = fit_spans(response_length, *split)
        if spans:
            return token_returns(response_length, spans, shares, gamma)
    return [float(reward) if m else 0.0 for m in list(mask)[:response_length]] + \
        [0.0] * max(0, response_length - len(mask))
