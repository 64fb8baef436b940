"""Per-turn credit in the verl 0.9.1 plugin (issue #35 part 4): what verl's trainer sees in ``rm_scores`` (the
row verl's V1 worker stores, ``AgentLoopOutput.as_dict``), the ``prorl_rtg`` advantage estimator through verl's
own registry, and the reward components a row carries for the per-step metrics."""
from __future__ import annotations

import pytest

pytest.importorskip("verl")
import torch  # noqa: E402
from hydra.utils import instantiate  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl.experimental.agent_loop import agent_loop as verl_agent_loop  # noqa: E402
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap  # noqa: E402
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, get_adv_estimator_fn  # noqa: E402
from verl.utils.dataset.rl_dataset import RLHFDataset  # noqa: E402
from verl.utils.import_utils import resolve_config_path  # noqa: E402

import trainer_plugins.verl.cpu_platform  # noqa: E402,F401  (registers prorl_rtg, as verl's hook loads it)
from prorl_server.types import JobResult, RewardComponent, Trajectory, TurnRecord  # noqa: E402

MASK = [1, 1, 0, 0, 1, 1]  # two turns of 2 sampled tokens, a 2-token tool observation between them


@pytest.fixture
def loop(compose_verl, tokenizer, monkeypatch):
    cfg = compose_verl("prorl_dapo", prompt_length=64, response_length=16)
    monkeypatch.setenv("PRORL_SERVERS", "http://127.0.0.1:9")  # never contacted: to_outputs only
    rollout = cfg.actor_rollout_ref.rollout
    for entry in OmegaConf.load(resolve_config_path(rollout.agent.agent_loop_config_path)):
        monkeypatch.setitem(verl_agent_loop._agent_loop_registry, entry.name, entry)
    return instantiate(config=verl_agent_loop._agent_loop_registry["prorl"], trainer_config=DictConfigWrap(config=cfg),
                       server_manager=None, tokenizer=tokenizer, processor=None, hf_model_type="qwen2",
                       dataset_cls=RLHFDataset, data_config=DictConfigWrap(cfg.data), tools=ToolListWrap([]))


def result(shares, components=None):
    """A finished job of one trajectory whose two turns carry ``shares`` of the reward."""
    turns = [TurnRecord(trajectory_index=0, response_start=0, response_end=2, reward=shares[0]),
             TurnRecord(trajectory_index=0, response_start=4, response_end=6, reward=shares[1])]
    return JobResult(job_id="j", trajectory_id="t", handler="shout", reward=sum(shares), resolved=True,
                     trajectories=[Trajectory(prompt_ids=[1, 2], response_ids=[5, 6, 7, 8, 9, 10],
                                              response_logprobs=[-0.1] * 6, loss_mask=MASK, num_turns=2)],
                     turns=turns, reward_components=components or {})


ROW = {"data_source": "shout", "extra_info": {"instance": {"data_source": "shout", "id": "p"}}}


async def test_split_reward_sits_on_each_turns_last_token(loop):
    (out,) = await loop.to_outputs(result([0.25, 0.75]), ROW)
    rm = out.as_dict()["rm_scores"]
    assert rm.tolist() == [0.0, 0.25, 0.0, 0.0, 0.0, 0.75]
    assert out.extra_fields["prorl"]["credit"] == "turns"
    # GRPO reduces rm_scores to one score per row: the same score as before the split
    assert float(rm.sum()) == out.reward_score == 1.0


async def test_no_split_keeps_verls_last_token_placement(loop):
    (out,) = await loop.to_outputs(result([0.0, 1.0]), ROW)
    assert out.as_dict()["rm_scores"].tolist() == [0.0] * 5 + [1.0]
    assert out.extra_fields["prorl"]["credit"] == "last_token"


async def test_components_travel_with_the_row(loop):
    comps = {"outcome": RewardComponent(value=1.0), "tool_call_errors": RewardComponent(value=-2.0, weight=0.1)}
    (out,) = await loop.to_outputs(result([0.0, 0.8], comps), ROW)
    assert out.extra_fields["prorl"]["reward_components"] == pytest.approx({"outcome": 1.0,
                                                                           "tool_call_errors": -0.2})


def test_prorl_rtg_gives_each_turn_its_reward_to_go_minus_the_others_return():
    rewards = torch.tensor([[0.0, 0.25, 0.0, 0.0, 0.0, 0.75], [0.0] * 5 + [0.5]])
    mask = torch.tensor([MASK, MASK])
    adv, ret = get_adv_estimator_fn("prorl_rtg")(token_level_rewards=rewards, response_mask=mask,
                                                 index=["u", "u"], config=AlgoConfig(gamma=0.5))
    # row 0: turn 2 returns 0.75, turn 1 0.25 + 0.5 * 0.75; row 1: 0.5 * 0.5 at turn 1, 0.5 at turn 2
    torch.testing.assert_close(ret, torch.tensor([[0.625, 0.625, 0, 0, 0.75, 0.75], [0.25, 0.25, 0, 0, 0.5, 0.5]]))
    torch.testing.assert_close(adv, torch.tensor([[0.375, 0.375, 0, 0, 0.5, 0.5],
                                                [-0.375, -0.375, 0, 0, -0.125, -0.125]]))
    # GRPO, the shipped default, sees one score per row: turn placement does not change its advantages
    grpo, _ = compute_grpo_outcome_advantage(rewards, mask, index=["u", "u"])
    flat = torch.tensor([[0.0] * 5 + [1.0], [0.0] * 5 + [0.5]])
    assert torch.equal(grpo, compute_grpo_outcome_advantage(flat, mask, index=["u", "u"])[0])


def test_reward_components_are_step_metrics(compose_verl, monkeypatch):
    """``training/prorl_reward/{name}``: the mean weighted component over the samples completed since the last
    step (the V1 replay buffer reads the rows' ``extra_fields`` from TransferQueue; stand-in: tests' KV store)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("_prorl_verl_async", Path(__file__).with_name("test_verl_async.py"))
    steps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(steps)
    store = steps.StepStore()
    buf, _ = steps.shipped_buffer(compose_verl, monkeypatch, "prorl_dapo", store)
    uids = store.submit(steps.B, 1, status="running")
    for i, uid in enumerate(uids):
        store.finish(uid, version=0, extra={"reward_components": {"outcome": float(i), "tool_call_errors": -0.2}})
    _, metrics = steps.train_step(buf, store, 1)
    assert metrics["training/prorl_reward/outcome"] == pytest.approx(sum(range(steps.B)) / steps.B)
    assert metrics["training/prorl_reward/tool_call_errors"] == pytest.approx(-0.2)
