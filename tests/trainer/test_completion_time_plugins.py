"""Both trainer plugins and the trainer-agnostic ``RolloutClient`` opt in to the relative completion time reward
(issue #35): ``completion_time_weight``.

Off (0, the default): no ``completion_time`` / ``group_size`` / ``reward_weights`` on the wire (a server from
before #35 refuses unknown fields) and the reward is the outcome. On (w > 0): every job goes with the three
fields and ``reward_weights: {"speed": w}``, the row's reward is the server's outcome + w * speed, and the speed is
logged. A weight that is not a number in [0, 10] is a ValueError naming the setting.

The rollout servers are real (the project's app on loopback) serving ``TimedHandler``, a
test double standing for an LLM agent: it returns the instance's fixed two-turn trajectory with turn records
whose generation time is the instance's ``model_s`` for the k-th job of the instance, so each member's model
time (what ``speed`` compares) is set exactly, with no LLM backend. Requests are seen through an aiohttp
middleware on the server.
"""
from __future__ import annotations

import asyncio
import json
import math
from collections import Counter
from types import SimpleNamespace

import pytest
from aiohttp import web

from prorl_server.app import create_app
from prorl_server.config import ServerSettings
from prorl_server.plugin import AgentHandler, InfrastructureError
from prorl_server.plugin.registry import HandlerRegistry
from prorl_server.types import Trajectory, TurnRecord
from trainer_plugins.client import RolloutClient
from trainer_plugins.jobs import process_request
from trainer_plugins.trl import ProRLRollout

MODEL_S = [1.0, 1.0, 2.0, 4.0]  # resolved median 1.5: speeds 1/3, 1/3, -1/3, -1 (clipped)
SPEEDS = [1 / 3, 1 / 3, -1 / 3, -1.0]
TRAJ = {"prompt_ids": [1, 2, 3], "response_ids": [10, 11, 20, 21, 12, 13],
        "response_logprobs": [-0.5, -0.5, 0.0, 0.0, -0.25, -0.25], "loss_mask": [1, 1, 0, 0, 1, 1],
        "weight_versions": [0], "num_turns": 2}
BAD_WEIGHTS = [-0.1, math.nan, math.inf, True, "0.5", 10.5]


class TimedHandler(AgentHandler):
    """See the module docstring. Always resolved with reward 1, so every member's speed is its model time's."""

    name = "timed"
    needs_llm = False

    def __init__(self) -> None:
        self.jobs: Counter = Counter()

    async def run(self, job):
        key = str(job.instance.get("id"))
        k = self.jobs[key]
        self.jobs[key] += 1
        if k in job.instance.get("fail_jobs", ()):  # fault injection: the system's failure, a filtered result
            raise InfrastructureError("harness", f"injected fault in job {k} of {key}")
        t = float(job.instance["model_s"][k % len(job.instance["model_s"])])
        job.trajectories = [Trajectory(**TRAJ)]
        job.turns = [TurnRecord(response_start=0, response_end=2, t_llm_s=t / 2),
                     TurnRecord(response_start=4, response_end=6, t_llm_s=t / 2)]

    async def eval(self, job):
        job.reward, job.resolved = 1.0, True


def instance(name: str = "a") -> dict:
    return {"data_source": "timed", "id": name, "prompt": f"say {name}", "model_s": MODEL_S}


@pytest.fixture
def bodies() -> list[dict]:
    return []


@pytest.fixture
def start(aiohttp_server, bodies):
    """``await start()`` -> URL of a real rollout server (no sandbox runtime: the handler needs none) serving
    :class:`TimedHandler`; every job body it is sent is appended to ``bodies``."""

    @web.middleware
    async def record(request, handler):
        if request.path in ("/process", "/jobs"):
            bodies.append(json.loads(await request.read()))
        return await handler(request)

    async def start_(**settings):
        registry = HandlerRegistry()
        registry.register(TimedHandler())
        app = create_app(ServerSettings(backends=[], health_interval_s=3600, sandbox_runtime="none", **settings),
                         registry=registry)
        app.middlewares.insert(0, record)
        server = await aiohttp_server(app)
        return str(server.make_url("")).rstrip("/")

    return start_


def trainer(n: int) -> SimpleNamespace:
    """Stand-in for ``trl.GRPOTrainer``: the attributes the rollout function reads, and its metrics dict."""
    return SimpleNamespace(num_generations=n, temperature=1.0, state=SimpleNamespace(global_step=0),
                           args=SimpleNamespace(temperature=1.0, top_p=1.0, top_k=None, max_completion_length=12),
                           processing_class=SimpleNamespace(eos_token_id=7, pad_token_id=0),
                           _metrics={"train": {}})


async def trl_call(start, **kw):
    url = await start()
    rollout = ProRLRollout([url], [instance()], max_sample_retries=0, **kw)
    t = trainer(len(MODEL_S))
    try:
        rows = await asyncio.to_thread(rollout, ["say a"] * len(MODEL_S), t)
    finally:
        rollout.close()
    return rows, t


async def test_trl_off_sends_no_completion_time_field_and_trains_on_the_outcome(start, bodies):
    rows, t = await trl_call(start, completion_time_weight=0.0)
    assert len(bodies) == len(MODEL_S)
    for b in bodies:
        assert not {"completion_time", "group_size", "reward_weights"} & set(b), b
    assert rows["prorl_reward"] == [1.0] * len(MODEL_S)
    assert "prorl/reward/speed" not in t._metrics["train"]


async def test_trl_on_sends_the_group_and_speed_weight_and_trains_on_outcome_plus_weighted_speed(start, bodies):
    w = 0.5
    rows, t = await trl_call(start, completion_time_weight=w)
    assert len(bodies) == len(MODEL_S)
    assert {b["group_id"] for b in bodies} == {bodies[0]["group_id"]}  # one prompt: one group
    for b in bodies:
        assert b["completion_time"] is True and b["group_size"] == len(MODEL_S)
        assert b["reward_weights"] == {"speed": w}
    assert sorted(rows["prorl_reward"]) == pytest.approx(sorted(1.0 + w * s for s in SPEEDS), abs=1e-9)
    for reward, credit in zip(rows["prorl_reward"], rows["prorl_token_rewards"]):
        assert credit[-1] == pytest.approx(reward, abs=1e-12)  # outcome and speed both on the last turn's token
    assert t._metrics["train"]["prorl/reward/speed"] == [pytest.approx(sum(SPEEDS) / len(SPEEDS), abs=1e-9)]


@pytest.mark.parametrize("bad", BAD_WEIGHTS)
def test_trl_refuses_a_weight_that_is_no_number_in_range(bad):
    with pytest.raises(ValueError, match="completion_time_weight"):
        ProRLRollout(["http://127.0.0.1:9"], [instance()], completion_time_weight=bad)


def test_a_request_with_speed_needs_its_group():
    with pytest.raises(ValueError, match="group"):
        process_request(instance(), group_id=None, group_size=4, speed_weight=0.5)


# ---------------------------------------------------------------------------------------------------- verl
def verl_loop(compose_verl, tokenizer, monkeypatch, url: str, *overrides: str, **settings):
    """The shipped ``prorl`` agent loop, instantiated from its YAML entry as verl's worker does."""
    pytest.importorskip("verl")
    from hydra.utils import instantiate
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop import agent_loop as verl_agent_loop
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.utils.import_utils import resolve_config_path

    cfg = compose_verl("prorl_dapo", "actor_rollout_ref.rollout.n=4", *overrides, prompt_length=64,
                       response_length=16)
    monkeypatch.setenv("PRORL_SERVERS", url)
    for entry in OmegaConf.load(resolve_config_path(cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path)):
        monkeypatch.setitem(verl_agent_loop._agent_loop_registry, entry.name, entry)
    return instantiate(config=verl_agent_loop._agent_loop_registry["prorl"], trainer_config=DictConfigWrap(config=cfg),
                       server_manager=None, tokenizer=tokenizer, processor=None, hf_model_type="qwen2",
                       dataset_cls=RLHFDataset, data_config=DictConfigWrap(cfg.data), tools=ToolListWrap([]),
                       backends="external", **settings), cfg


def verl_row(uid: str = "u1") -> dict:
    import numpy as np

    return {"raw_prompt": np.array([{"role": "user", "content": "hi"}], dtype=object), "data_source": "timed",
            "extra_info": {"index": 7, "instance": instance()}, "index": 7, "uid": uid}


async def verl_group(loop, cfg) -> list:
    r = cfg.actor_rollout_ref.rollout
    sp = {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k, "logprobs": True}
    return await asyncio.gather(*(loop.run(sp, **verl_row()) for _ in range(len(MODEL_S))))  # legacy worker


async def test_verl_off_sends_no_completion_time_field(compose_verl, tokenizer, monkeypatch, start, bodies):
    loop, cfg = verl_loop(compose_verl, tokenizer, monkeypatch, await start(), "prorl.completion_time_weight=0")
    outs = await verl_group(loop, cfg)
    assert len(bodies) == len(MODEL_S)
    for b in bodies:
        assert not {"completion_time", "group_size", "reward_weights"} & set(b), b
    assert [o.reward_score for o in outs] == [1.0] * len(MODEL_S)
    assert all("speed" not in o.extra_fields["prorl"]["reward_components"] for o in outs)


async def test_verl_on_sends_the_group_and_speed_weight_and_logs_speed(compose_verl, tokenizer, monkeypatch, start,
                                                                       bodies):
    w = 0.25
    loop, cfg = verl_loop(compose_verl, tokenizer, monkeypatch, await start(),
                          f"prorl.completion_time_weight={w}")
    outs = await verl_group(loop, cfg)
    assert len(bodies) == len(MODEL_S)
    for b in bodies:
        assert b["completion_time"] is True and b["group_size"] == 4 and b["group_id"] == "verl-u1"
        assert b["reward_weights"] == {"speed": w}
    speeds = [o.extra_fields["prorl"]["reward_components"]["speed"] for o in outs]
    assert sorted(speeds) == pytest.approx(sorted(SPEEDS), abs=1e-9)  # what training/prorl_reward/speed averages
    for o, s in zip(outs, speeds):
        assert o.reward_score == pytest.approx(1.0 + w * s, abs=1e-12)
        # outcome and speed both on the last turn: verl's own layout, the whole reward_score on the last token
        assert o.extra_fields["prorl"]["credit"] == "last_token" and o.token_rewards is None


async def test_verl_validation_rows_go_without_completion_time(compose_verl, tokenizer, monkeypatch, start, bodies):
    loop, cfg = verl_loop(compose_verl, tokenizer, monkeypatch, await start(), "prorl.completion_time_weight=0.5",
                          "actor_rollout_ref.rollout.val_kwargs.temperature=0.0")
    val = cfg.actor_rollout_ref.rollout.val_kwargs
    await loop.run({"temperature": val.temperature, "top_p": val.top_p, "top_k": val.top_k, "logprobs": True},
                   **verl_row("v1"))  # a validation group of 1 (val_kwargs.n) must not wait for 4 members
    assert len(bodies) == 1 and "completion_time" not in bodies[0]


@pytest.mark.parametrize("bad", BAD_WEIGHTS)
def test_verl_refuses_a_weight_that_is_no_number_in_range(compose_verl, tokenizer, monkeypatch, bad):
    with pytest.raises(Exception, match="completion_time_weight"):
        verl_loop(compose_verl, tokenizer, monkeypatch, "http://127.0.0.1:9", completion_time_weight=bad)


def test_verl_refuses_speed_when_validation_groups_cannot_be_told_apart(compose_verl, tokenizer, monkeypatch):
    r = "actor_rollout_ref.rollout"
    with pytest.raises(Exception, match="val_kwargs.n"):
        verl_loop(compose_verl, tokenizer, monkeypatch, "http://127.0.0.1:9", "prorl.completion_time_weight=1",
                  f"{r}.val_kwargs.n=1", f"{r}.val_kwargs.temperature=1.0", f"{r}.val_kwargs.top_p=1.0",
                  f"{r}.val_kwargs.top_k=-1", f"{r}.temperature=1.0", f"{r}.top_p=1.0", f"{r}.top_k=-1")


# ------------------------------------------------------------------ the trainer-agnostic RolloutClient


async def client_batch(urls: list[str], inst: dict, **kw):
    async with RolloutClient(urls, [inst], groups_per_step=1, n_samples=len(MODEL_S), max_staleness=None,
                             max_epochs=1, **kw) as client:
        return await asyncio.wait_for(client.next_batch(), 60)


async def test_client_off_sends_no_completion_time_field(start, bodies):
    batch = await client_batch([await start()], instance(), completion_time_weight=0.0, dynamic_sampling=False)
    assert len(bodies) == len(MODEL_S)
    for b in bodies:
        assert not {"completion_time", "group_size", "reward_weights"} & set(b), b
    assert batch.groups[0].rewards == [1.0] * len(MODEL_S)
    assert all(r.speed is None for r in batch.groups[0].results)


async def test_client_on_sends_the_group_and_speed_weight_and_gets_outcome_plus_weighted_speed(start, bodies):
    w = 0.5
    batch = await client_batch([await start()], instance(), completion_time_weight=w)
    assert len(bodies) == len(MODEL_S)
    assert {b["group_id"] for b in bodies} == {bodies[0]["group_id"]}  # one dataset item: one group
    for b in bodies:
        assert b["completion_time"] is True and b["group_size"] == len(MODEL_S)
        assert b["reward_weights"] == {"speed": w}
    (group,) = batch.groups
    assert sorted(r.speed for r in group.results) == pytest.approx(sorted(SPEEDS), abs=1e-9)
    # the rewards DAPO's dynamic sampling compares (all outcomes 1.0) differ by speed alone: the group is kept
    assert sorted(group.rewards) == pytest.approx(sorted(1.0 + w * s for s in SPEEDS), abs=1e-9)
    # the step's metrics carry each component's mean, as the TRL plugin logs prorl/reward/{name}
    means = batch.metrics.mean_reward_components
    assert means["speed"] == pytest.approx(sum(SPEEDS) / len(SPEEDS), abs=1e-9)
    assert batch.metrics.as_dict()["mean_reward_components"] == means


async def test_client_sends_a_filtered_members_replacement_back_to_its_groups_server(start, bodies):
    # the group's first job fails (the system's fault): its replacement must join the group on the server that
    # holds it, or that group waits for it in vain and the replacement is a group of its own elsewhere
    urls = [await start(completion_time_wait_s=3.0), await start(completion_time_wait_s=3.0)]
    batch = await client_batch(urls, {**instance(), "fail_jobs": [0]}, completion_time_weight=0.5)
    (group,) = batch.groups
    assert len({s.server for s in group.samples}) == 1
    assert len(bodies) == len(MODEL_S) + 1 and len({b["group_id"] for b in bodies}) == 1
    # the replacement ran as the group's 5th job (model time MODEL_S[0] again): the speeds of the full group
    assert sorted(r.speed for r in group.results) == pytest.approx(sorted(SPEEDS), abs=1e-9)


@pytest.mark.parametrize("bad", BAD_WEIGHTS)
def test_client_refuses_a_weight_that_is_no_number_in_range(bad):
    with pytest.raises(ValueError, match="completion_time_weight"):
        RolloutClient(["http://127.0.0.1:9"], [instance()], groups_per_step=1, n_samples=4,
                      completion_time_weight=bad)
