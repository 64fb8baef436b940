"""Per-turn credit in the TRL plugin's rows (issue #35 part 4): ``prorl_token_rewards`` (each turn's share on its
last sampled token, else the whole reward on the last token), ``prorl_token_returns`` with ``reward_to_go``
(absent by default), and the reward components TRL logs per step (``prorl/reward/{name}``).

The rollout servers are not involved: the job outcomes a call would collect are handed to the call directly
(``ProRLRollout._start`` returns them as a finished batch), since what is tested is how a result becomes TRL's
row."""
from __future__ import annotations

import concurrent.futures
from types import SimpleNamespace

import pytest

from prorl_server.types import JobResult, RewardComponent, Trajectory, TurnRecord
from trainer_plugins.jobs import JobOutcome
from trainer_plugins.trl import ProRLRollout

MASK = [1, 1, 0, 0, 1, 1]


def outcome(shares, components=None, job="j"):
    turns = [TurnRecord(trajectory_index=0, response_start=0, response_end=2, reward=shares[0]),
             TurnRecord(trajectory_index=0, response_start=4, response_end=6, reward=shares[1])]
    r = JobResult(job_id=job, trajectory_id=job, handler="shout", reward=sum(shares), resolved=True,
                  trajectories=[Trajectory(prompt_ids=[1, 2], response_ids=[5, 6, 7, 8, 9, 10],
                                           response_logprobs=[-0.1] * 6, loss_mask=MASK, num_turns=2,
                                           weight_versions=[0])],
                  turns=turns, reward_components=components or {"outcome": RewardComponent(value=sum(shares))})
    return JobOutcome(result=r, server="http://127.0.0.1:9")


def run(rollout, outcomes):
    """One call of TRL's rollout function whose jobs ended with ``outcomes``; returns (rows, trainer)."""
    prompts = ["say a"] * len(outcomes)
    done = concurrent.futures.Future()
    done.set_result(outcomes)

    async def no_check(trainer):
        return None

    rollout._start = lambda prompts, instances, sp, n, step: SimpleNamespace(future=done, prompts=prompts,
                                                                              call=0, groups={})
    rollout.check_tokenizers = no_check
    trainer = SimpleNamespace(num_generations=len(outcomes), temperature=1.0, state=SimpleNamespace(global_step=0),
                              args=SimpleNamespace(temperature=1.0, top_p=1.0, top_k=None, max_completion_length=12),
                              processing_class=SimpleNamespace(eos_token_id=7, pad_token_id=0),
                              _metrics={"train": {}})
    try:
        return rollout(prompts, trainer), trainer
    finally:
        rollout.close()


def make(**kw):
    return ProRLRollout(["http://127.0.0.1:9"], [{"data_source": "shout", "prompt": "say a"}],
                        max_sample_retries=0, **kw)


def test_rows_carry_each_turns_share_on_its_last_token_and_no_returns_by_default():
    rows, _ = run(make(), [outcome([0.25, 0.75], job="a"), outcome([0.0, 1.0], job="b")])
    assert rows["prorl_token_rewards"] == [[0, 0.25, 0, 0, 0, 0.75], [0, 0, 0, 0, 0, 1.0]]
    assert "prorl_token_returns" not in rows
    assert rows["prorl_reward"] == [1.0, 1.0]  # what GRPOTrainer trains on is unchanged


def test_reward_to_go_rows_carry_discounted_returns_per_turn():
    rows, _ = run(make(reward_to_go=True, gamma=0.5), [outcome([0.25, 0.75], job="a"), outcome([0.0, 1.0], job="b")])
    assert rows["prorl_token_returns"] == [[0.625, 0.625, 0, 0, 0.75, 0.75], [0.5, 0.5, 0, 0, 1.0, 1.0]]


def test_reward_components_are_logged_per_step():
    comps = {"outcome": RewardComponent(value=1.0), "tool_call_errors": RewardComponent(value=-2.0, weight=0.1)}
    no_errors = {"outcome": RewardComponent(value=0.0), "tool_call_errors": RewardComponent(value=0.0, weight=0.1)}
    rollout = make()
    _, trainer = run(rollout, [outcome([0.0, 0.8], comps, job="a"), outcome([0.0, 0.0], no_errors, job="b")])
    assert trainer._metrics["train"]["prorl/reward/outcome"] == [pytest.approx(0.5)]
    assert trainer._metrics["train"]["prorl/reward/tool_call_errors"] == [pytest.approx(-0.1)]
    assert rollout.history[-1].reward_components == pytest.approx({"outcome": 0.5, "tool_call_errors": -0.1})


@pytest.mark.parametrize("gamma", [-0.1, 1.5, float("nan"), True])
def test_a_discount_outside_0_1_is_refused(gamma):
    with pytest.raises(ValueError, match="gamma"):
        make(reward_to_go=True, gamma=gamma)
