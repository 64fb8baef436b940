"""Named reward components (issue #35 part 2): ``reward`` is the weighted sum of the result's
``reward_components``, checked by the server before it answers; a handler whose components do not make its reward
(or are not finite, or not declared) fails the job as a handler fault, filtered, with the component named; a
handler that sets only a scalar reward gets one ``outcome`` component of weight 1; process terms weigh 0 unless
the request opts in through ``reward_weights``, which may name only terms the handler declares.

The server is real (create_app, pipeline, HTTP); ``ComposedHandler`` is a test double for a task handler that
reports components, told by its instance what to report (including the faults a buggy handler makes).
"""
from __future__ import annotations

import math

import pytest

from handlers.arithmetic import ArithmeticHandler
from prorl_server.app import create_app
from prorl_server.config import ServerSettings
from prorl_server.plugin.handler import AgentHandler
from prorl_server.plugin.registry import HandlerRegistry
from prorl_server.rewards import compose_reward, mixing_share
from prorl_server.types import RewardComponent


class ComposedHandler(AgentHandler):
    """Reports ``outcome`` plus the process terms ``instance["terms"]`` (name -> value), weighted by the request's
    ``reward_weights``; ``instance["fault"]`` makes it report what a buggy handler would: ``"off_by"`` (a reward
    that is not the weighted sum), ``"nan"`` (a non-finite term), ``"undeclared"`` (a term it never declared),
    ``"no_outcome"`` (no outcome component)."""

    name = "composed"
    needs_llm = False
    reward_terms = ("brevity", "politeness")

    async def eval(self, job) -> None:
        inst = job.instance
        terms = {n: RewardComponent(value=v, weight=job.reward_weights.get(n, 0.0))
                 for n, v in inst.get("terms", {}).items()}
        job.resolved = inst["outcome"] == 1.0
        compose_reward(job, inst["outcome"], terms)
        fault = inst.get("fault")
        if fault == "off_by":
            job.reward += 0.25
        elif fault == "nan":
            job.reward_components["brevity"] = {"value": float("nan"), "weight": 0.0}
        elif fault == "undeclared":
            job.reward_components["sneaky"] = RewardComponent(value=1.0, weight=0.0)
        elif fault == "no_outcome":
            del job.reward_components["outcome"]
            job.reward = 0.0


@pytest.fixture
async def client(aiohttp_client):
    registry = HandlerRegistry()
    registry.register(ComposedHandler)
    registry.register(ArithmeticHandler)
    return await aiohttp_client(create_app(ServerSettings(health_interval_s=3600), registry=registry))


async def _process(client, instance: dict, **body) -> dict:
    r = await client.post("/process", json={"instance": instance, **body})
    assert r.status == 200, await r.text()
    return await r.json()


def _weighted(components: dict) -> float:
    return math.fsum(c["weight"] * c["value"] for c in components.values())


async def test_the_reward_is_the_weighted_sum_of_the_components_and_process_terms_weigh_0_unless_asked(client):
    inst = {"data_source": "composed", "outcome": 1.0, "terms": {"brevity": -0.5, "politeness": -0.25}}
    default = await _process(client, inst)
    # default: existing training unchanged, the reward is the outcome bit for bit
    assert default["reward"] == 1.0 and default["resolved"] is True and default["filter"] is False
    assert default["reward_components"] == {
        "outcome": {"value": 1.0, "weight": 1.0, "per_turn": None},
        "brevity": {"value": -0.5, "weight": 0.0, "per_turn": None},
        "politeness": {"value": -0.25, "weight": 0.0, "per_turn": None}}

    opted = await _process(client, inst, reward_weights={"brevity": 0.2, "politeness": 0.1})
    assert opted["failure_kind"] is None and opted["filter"] is False
    assert opted["reward"] == _weighted(opted["reward_components"]) == math.fsum([1.0, 0.2 * -0.5, 0.1 * -0.25])
    assert opted["reward_components"]["brevity"]["weight"] == 0.2
    # what each component did shows in the metrics, per handler and name, weighted or not
    metrics = await (await client.get("/metrics")).text()
    assert 'prorl_reward_component_count{component="brevity",handler="composed"} 2.0' in metrics
    assert 'prorl_reward_component_bucket{component="brevity",handler="composed",le="-0.5"} 2.0' in metrics
    assert 'prorl_reward_component_bucket{component="brevity",handler="composed",le="-1.0"} 0.0' in metrics


async def test_a_handler_that_sets_only_a_scalar_reward_gets_one_outcome_component_of_weight_1(client):
    res = await _process(client, {"data_source": "arithmetic", "expression": "6*7", "answer": 42})
    assert res["failure_kind"] is None
    assert res["reward_components"] == {"outcome": {"value": res["reward"], "weight": 1.0, "per_turn": None}}


@pytest.mark.parametrize("fault, names", [("off_by", "not the weighted sum"), ("nan", "'brevity'"),
                                          ("undeclared", "'sneaky'"), ("no_outcome", "'outcome'")])
async def test_components_that_do_not_make_the_reward_are_a_filtered_handler_fault_naming_them(client, fault,
                                                                                               names):
    res = await _process(client, {"data_source": "composed", "outcome": 1.0, "terms": {"brevity": -0.5},
                                  "fault": fault}, reward_weights={"brevity": 0.5})
    assert res["failure_kind"] == "handler" and res["filter"] is True, res
    assert res["reward"] == 0.0 and res["resolved"] is False and res["critical_error"] == "eval"
    assert res["error"].startswith("reward components:") and names in res["error"], res["error"]
    assert res["reward_components"] == {"outcome": {"value": 0.0, "weight": 1.0, "per_turn": None}}


async def test_weights_for_terms_the_handler_does_not_declare_are_refused_at_submit(client):
    r = await client.post("/process", json={"instance": {"data_source": "composed", "outcome": 1.0},
                                            "reward_weights": {"outcome_bonus": 1.0}})
    assert r.status == 422
    body = await r.json()
    assert body["error"]["field"] == "reward_weights" and "outcome_bonus" in body["error"]["message"]
    for bad in ({"Brevity": 1.0}, {"brevity": 1e9}, {"brevity": "1"}):  # a name, a bound, a type
        r = await client.post("/process", json={"instance": {"data_source": "composed", "outcome": 1.0},
                                                "reward_weights": bad})
        assert r.status == 422 and (await r.json())["error"]["field"].startswith("reward_weights"), bad

def test_language_mixing_share_counts_letters_outside_the_main_script():
    assert mixing_share("") == 0.0 and mixing_share("plain English, 123 !") == 0.0
    assert mixing_share("日本語のテキスト") == 0.0  # Han and kana are one script group
    assert mixing_share("Привет world") == pytest.approx(5 / 11)  # 6 Cyrillic letters, 5 Latin
    assert mixing_share("café naïve") == 0.0  # accented Latin is Latin
    assert 0.0 < mixing_share("hello 你好") < 0.5


def _result(reward: float, n_turns: int):
    from prorl_server.types import JobResult, TurnRecord

    return JobResult(job_id="j", trajectory_id="t", handler="composed", reward=reward,
                     turns=[TurnRecord(response_start=i, response_end=i + 1) for i in range(n_turns)])


def test_turn_rewards_carry_the_per_turn_components_and_sum_to_the_reward():
    from prorl_server.rewards import finalize

    comps = {"outcome": RewardComponent(value=1.0, weight=1.0),  # no split: the last turn's
             "brevity": RewardComponent(value=-0.6, weight=0.5, per_turn=[-0.1, -0.2, -0.3])}
    res = finalize(_result(math.fsum([1.0, 0.5 * -0.6]), 3), comps, ("brevity",))
    assert res.failure_kind is None
    assert [t.reward for t in res.turns] == pytest.approx([-0.05, -0.1, 1.0 - 0.15], abs=1e-15)
    assert math.fsum(t.reward for t in res.turns) == pytest.approx(res.reward, abs=1e-15)
    # a scalar-only handler: the last turn carries the whole reward
    plain = finalize(_result(0.75, 2), None)
    assert [t.reward for t in plain.turns] == [0.0, 0.75]


def test_a_per_turn_split_that_does_not_fit_the_turns_is_a_handler_fault():
    from prorl_server.rewards import finalize

    wrong_len = {"outcome": RewardComponent(value=1.0, weight=1.0, per_turn=[0.5, 0.5])}
    res = finalize(_result(1.0, 3), wrong_len)
    assert res.failure_kind == "handler" and res.filter and "'outcome' has 2 per-turn values for 3 turns" in res.error
    assert [t.reward for t in res.turns] == [0.0, 0.0, 0.0]
    wrong_sum = {"outcome": RewardComponent(value=1.0, weight=1.0, per_turn=[0.5, 0.25, 0.0])}
    res = finalize(_result(1.0, 3), wrong_sum)
    assert res.failure_kind == "handler" and "per-turn values sum to 0.75" in res.error


def test_tool_call_errors_penalise_the_turns_whose_calls_did_not_parse():
    from prorl_server.rewards import tool_call_error_share
    from prorl_server.types import TurnRecord

    turns = [TurnRecord(tool_calls=1), TurnRecord(tool_calls=0, tool_call_errors=2), TurnRecord(tool_calls=1)]
    assert tool_call_error_share(turns) == (-1 / 3, [0.0, -1 / 3, 0.0])
    assert tool_call_error_share([TurnRecord(), TurnRecord()]) == (0.0, [0.0, 0.0])  # silence earns nothing
    assert tool_call_error_share([]) == (0.0, None)


@pytest.mark.parametrize("terms", [("outcome",), ("Bad Name",), ("a", "a"), tuple(f"t{i}" for i in range(32))])
def test_a_handler_declaring_unusable_reward_terms_is_refused_at_registration(terms):
    class Bad(ComposedHandler):
        name = "bad_terms"
        reward_terms = terms

    with pytest.raises(ValueError, match="reward_terms"):
        HandlerRegistry().register(Bad)
