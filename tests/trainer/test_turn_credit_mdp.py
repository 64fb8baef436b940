"""Per-turn credit on a small MDP where the policy decides when to stop (issue #35 part 4; verl issue #7244).

The MDP stands for a tool-using agent: at each of turns 1 and 2 the policy either calls a tool (``continue``,
probability ``p_t = sigmoid(theta_t)``; a process reward ``Bernoulli(C)``, e.g. the call parsed) or answers
(``stop``; an outcome reward ``Bernoulli(Q[t])``); turn 3 must answer. Each turn's reward sits on its last
token; the exact policy gradient dJ/dtheta comes from enumerating the three stopping turns.

Two estimators of the gradient over 10^6 episodes in groups of 8 (a GRPO group), both with leave-one-out
group baselines (independent of the episode's own actions):

- ours (:mod:`trainer_plugins.credit`): reward-to-go per turn minus the leave-one-out mean return;
- per-turn-index normalisation (MT-GRPO as ported in verl #7244): the trajectory's advantage is the sum over
  the turns it took of (turn-k reward - the group's mean turn-k reward), so the number of baseline terms is
  the trajectory's own stopping turn. Its bias has the closed form ``-d/dtheta sum_k P(reach k) * m_k`` with
  the baselines ``m_k`` held fixed: a hidden charge for every turn taken.

Ours must be within 3 standard errors of the exact gradient; the per-index one must be off by more than 10,
and by what the closed form says (within 3 standard errors), so the test can tell the two apart.
"""
from __future__ import annotations

import time

import numpy as np

from trainer_plugins.credit import rloo_baseline, turn_returns

THETA = np.array([0.0, 0.5])  # logits of "continue" at turns 1 and 2
C = 0.5  # mean process reward of a tool call
Q = np.array([0.3, 0.5, 0.6])  # success probability of an answer at turn 1, 2, 3
GROUP = 8
EPISODES = 1_000_000


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def exact_gradient() -> np.ndarray:
    """dJ/dtheta of J = E[sum of turn rewards], by enumerating the stopping turn T in {1, 2, 3}."""
    p1, p2 = sigmoid(THETA)
    ret = [Q[0], C + Q[1], 2 * C + Q[2]]  # E[return | T]
    d1 = p1 * (1 - p1) * (-ret[0] + (1 - p2) * ret[1] + p2 * ret[2])
    d2 = p1 * p2 * (1 - p2) * (ret[2] - ret[1])
    return np.array([d1, d2])


def per_index_bias() -> np.ndarray:
    """Closed form of the per-turn-index estimator's bias: ``-d/dtheta sum_k P(reach k) E[m_k]`` with the
    leave-one-out baselines held fixed; ``E[m_k]`` = the mean turn-k reward of those who reach turn k, times
    the chance that another group member reached it (else the baseline is 0)."""
    p1, p2 = sigmoid(THETA)
    reach = np.array([1.0, p1, p1 * p2])
    mu = np.array([p1 * C + (1 - p1) * Q[0], p2 * C + (1 - p2) * Q[1], Q[2]])
    m = mu * (1 - (1 - reach) ** (GROUP - 1))
    return -np.array([p1 * (1 - p1) * (m[1] + p2 * m[2]), p1 * p2 * (1 - p2) * m[2]])


def simulate(rng: np.random.Generator):
    """Returns (turn rewards (N, 3) padded with 0 after the stop, reached (N, 3) bool, scores (N, 2)):
    ``scores[:, t]`` = d log pi(a_t) / d theta_t (``a_t - p_t``; 0 where turn t was not reached)."""
    p = sigmoid(THETA)
    u = rng.random((EPISODES, 3))
    cont = u[:, :2] < p  # the action at turns 1, 2 (turn 3 always stops)
    reached = np.ones((EPISODES, 3), dtype=bool)
    reached[:, 1] = cont[:, 0]
    reached[:, 2] = cont[:, 0] & cont[:, 1]
    stops = np.column_stack([~cont[:, 0], cont[:, 0] & ~cont[:, 1], reached[:, 2]])
    v = rng.random((EPISODES, 3))
    process = np.column_stack([v[:, :2] < C, np.zeros(EPISODES, dtype=bool)])
    outcome = v < Q
    rewards = np.where(stops, outcome, np.where(reached, process, False)).astype(np.float64)
    scores = np.where(reached[:, :2], cont - p, 0.0)
    return rewards, reached, scores


def group_mean_and_se(g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean of per-episode gradient estimates (N, 2) and its standard error, over groups (members of a group
    share baselines, so groups are the independent units)."""
    per_group = g.reshape(-1, GROUP, g.shape[1]).mean(axis=1)
    return per_group.mean(axis=0), per_group.std(axis=0, ddof=1) / np.sqrt(per_group.shape[0])


def test_reward_to_go_is_unbiased_and_per_turn_index_normalisation_is_not():
    t0 = time.perf_counter()
    rewards, reached, scores = simulate(np.random.default_rng(7244))
    true = exact_gradient()

    # ours: the plugins' reward-to-go (gamma 1) minus a leave-one-out baseline of the whole return
    returns = turn_returns(rewards, gamma=1.0)
    adv = returns[:, :2] - rloo_baseline(returns[:, 0], GROUP)[:, None]
    ours, ours_se = group_mean_and_se(scores * adv)

    # per-turn-index normalisation: leave-one-out mean of turn-k rewards among the others that reached turn k
    n_reach = reached.reshape(-1, GROUP, 3).sum(axis=1, keepdims=True) - reached.reshape(-1, GROUP, 3)
    r_sum = (rewards * reached).reshape(-1, GROUP, 3).sum(axis=1, keepdims=True) - rewards.reshape(-1, GROUP, 3)
    m = np.where(n_reach > 0, r_sum / np.maximum(n_reach, 1), 0.0).reshape(-1, 3)
    traj_adv = ((rewards - m) * reached).sum(axis=1)
    naive, naive_se = group_mean_and_se(scores * traj_adv[:, None])
    elapsed = time.perf_counter() - t0

    z_ours = (ours - true) / ours_se
    z_naive = (naive - true) / naive_se
    z_closed = (naive - true - per_index_bias()) / naive_se
    report = (f"exact {true}, reward-to-go {ours} (z {z_ours}), per-index {naive} (z {z_naive}; closed-form bias "
              f"{per_index_bias()}, z against it {z_closed}), {elapsed:.1f} s")
    assert np.all(np.abs(z_ours) < 3), report
    assert np.all(np.abs(z_naive) > 10), report
    assert np.all(np.abs(z_closed) < 3), report
    assert elapsed < 30, report


def test_discount_counts_turns():
    """gamma discounts per turn: G = r_k + gamma * G_{k+1}; zero padding after the stop changes nothing."""
    got = turn_returns(np.array([[1.0, 0.0, 2.0, 0.0]]), gamma=0.5)
    assert np.allclose(got, [[1.5, 1.0, 2.0, 0.0]])
    assert np.allclose(turn_returns([1.0, 0.0, 2.0], gamma=1.0), [3.0, 2.0, 2.0])
