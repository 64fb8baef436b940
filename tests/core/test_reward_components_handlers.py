"""The shipped handlers' reward components (issue #35 part 2): host-computed process terms (tool-call parse
errors, language mixing, shout's per-turn scores), weight 0 unless the request opts in, reproduced byte for byte
by ``prorl-journal regrade``, and never a credit that a constant, empty or wrong answer gets and a right one does
not.

Shout jobs run through a real rollout server whose backend is the scripted policy of tests/conftest.py (a
labelled test double for a capable model); math results are built by hand around real reasoning-gym problems and
graded by the real math handler through :class:`~prorl_server.journal.regrade.Regrader` (a real math rollout
needs a sandbox).
"""
from __future__ import annotations

import json
import math

import pytest

from handlers.math import MathHandler
from handlers.shout import ShoutHandler
from prorl_server.app import create_app
from prorl_server.config import ServerSettings
from prorl_server.journal.cli import main
from prorl_server.journal.regrade import Regrader
from prorl_server.journal.store import Journal
from prorl_server.plugin import AgentHandler
from prorl_server.plugin.registry import HandlerRegistry
from prorl_server.types import JobResult, ProcessRequest, Trajectory

#: shout's last turns: right (all capitals), wrong (mostly lower case) and empty of letters
SHOUT = {"sea": ("calm words", "SHIP AHOY"), "city": ("Привет world", "Hello"), "night": ("", "1234 !!")}
OPT_IN = {"turn_scores": 0.5, "language_mixing": 0.5}


def _weighted(components: dict) -> float:
    return math.fsum(c["weight"] * c["value"] for c in components.values())


async def _shout_results(aiohttp_client, scripted_policy, reward_weights):
    def script(prompt: str, turn: int) -> str:
        return SHOUT[next(k for k in SHOUT if k in prompt)][turn]

    registry = HandlerRegistry()
    registry.register(ShoutHandler)
    app = create_app(ServerSettings(backends=[await scripted_policy(script)], health_interval_s=3600),
                     registry=registry)
    client = await aiohttp_client(app)
    jobs = []
    for i, topic in enumerate(SHOUT):
        req = ProcessRequest(instance={"data_source": "shout", "prompt": f"Say something about the {topic}."},
                             sampling_params={"max_tokens": 32}, job_id=f"shout-{topic}",
                             reward_weights=reward_weights)
        r = await client.post("/process", json=req.model_dump(exclude_none=True))
        assert r.status == 200, await r.text()
        jobs.append((req, await r.json()))
    return jobs


async def test_shout_components_sum_to_the_reward_and_weigh_0_by_default(aiohttp_client, scripted_policy):
    default = dict((req.job_id, res) for req, res in await _shout_results(aiohttp_client, scripted_policy, None))
    # existing training is unchanged: the reward is the outcome (the last turn's capital share) exactly
    assert [default[f"shout-{t}"]["reward"] for t in SHOUT] == [1.0, 0.2, 0.0]
    for res in default.values():
        comps = res["reward_components"]
        assert set(comps) == {"outcome", "turn_scores", "language_mixing"}
        assert comps["turn_scores"]["weight"] == comps["language_mixing"]["weight"] == 0.0
        assert res["reward"] == comps["outcome"]["value"] == _weighted(comps)


async def test_shout_process_terms_give_the_empty_answer_no_credit_the_right_one_lacks(aiohttp_client,
                                                                                        scripted_policy):
    res = dict((req.job_id, r) for req, r in await _shout_results(aiohttp_client, scripted_policy, OPT_IN))
    right, wrong, empty = res["shout-sea"], res["shout-city"], res["shout-night"]
    for r in res.values():
        assert r["failure_kind"] is None and r["reward"] == pytest.approx(_weighted(r["reward_components"]), abs=1e-12)
    # the Cyrillic-and-Latin first turn costs the city rollout: 6 of 11 letters Cyrillic, mean over its 2 turns
    assert wrong["reward_components"]["language_mixing"]["value"] == pytest.approx(-(5 / 11) / 2)
    assert right["reward_components"]["language_mixing"]["value"] == 0.0
    # a turn with no letter earns no per-turn score; the right answer's does
    assert empty["reward_components"]["turn_scores"]["value"] == 0.0 == empty["reward"]
    assert right["reward_components"]["turn_scores"]["value"] == 1.0 and right["reward"] == 1.5
    assert right["reward"] > wrong["reward"] and right["reward"] > empty["reward"]
    # each turn record carries its share: the outcome and the turn scores on the turn that earned them, the
    # mixing penalty on the turn that mixed; the turns add up to the reward
    for r in res.values():
        assert len(r["turns"]) == 2 and math.fsum(t["reward"] for t in r["turns"]) == pytest.approx(r["reward"],
                                                                                                  abs=1e-12)
    assert [t["reward"] for t in wrong["turns"]] == pytest.approx([0.5 * -(5 / 11) / 2, 0.2 + 0.5 * 0.2])
    assert [t["reward"] for t in right["turns"]] == [0.0, 1.5]


async def test_regrade_reproduces_the_components_byte_for_byte(aiohttp_client, scripted_policy, tmp_path):
    import asyncio

    jobs = await _shout_results(aiohttp_client, scripted_policy, OPT_IN)
    path = tmp_path / "journal.sqlite"
    j = Journal(str(path))
    j.start()
    for req, result in jobs:
        j.job_submitted(req.job_id, "shout", req.model_dump_json().encode())
        j.job_result(req.job_id, json.dumps(result).encode())
    assert j.flush()
    j.close()
    out = tmp_path / "regrade.jsonl"
    assert await asyncio.to_thread(main, ["regrade", str(path), "--out", str(out), "--quiet"]) == 0
    rows = {r["job_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    for req, result in jobs:
        row = rows[req.job_id]
        assert row["status"] == "regraded" and row["changed"] is False, row
        assert json.dumps(row["new_reward_components"]) == json.dumps(result["reward_components"])
        assert json.dumps(row["new_reward"]) == json.dumps(result["reward"])


def _math(job_id: str, problem: dict, answer: str, turns: list[str]) -> tuple[str, str, bytes, bytes]:
    """A math job as the handler records it (the finish tool's arguments in extra.agent.answer), opted in to both
    process terms; ``turns``: the assistant messages' text."""
    req = ProcessRequest(instance=problem, sampling_params={"max_tokens": 64}, job_id=job_id,
                         reward_weights={"tool_call_errors": 1.0, "language_mixing": 1.0})
    res = JobResult(job_id=job_id, trajectory_id=f"t-{job_id}", handler="math",
                    messages=[{"role": "user", "content": problem["question"]},
                              *({"role": "assistant", "content": t} for t in turns)],
                    trajectories=[Trajectory(prompt_ids=[1, 2], response_ids=[7], response_logprobs=[-0.1],
                                             loss_mask=[1], num_turns=1)],
                    extra={"agent": {"finish_reason": "stop", "num_turns": len(turns), "answer": {"answer": answer}}})
    return job_id, "math", req.model_dump_json().encode(), res.model_dump_json().encode()


async def test_math_wrong_constant_and_empty_answers_get_no_process_credit():
    from handlers.math.data import load_reasoning_gym

    (p,) = load_reasoning_gym("basic_arithmetic", limit=1, seed=11)
    assert str(p["answer"]) not in ("0", "1")  # the constants below are wrong answers to it
    clean = ["I add the numbers", "calling finish"]
    answers = {"right": f"\\boxed{{{p['answer']}}}", "empty": "", "zero": "\\boxed{0}", "nan": "\\boxed{nan}",
               "constant": "\\boxed{1}", "unboxed": str(p["answer"])}
    registry = HandlerRegistry()
    registry.register(MathHandler)
    async with Regrader(registry, sandbox_runtime="none") as r:
        got = {name: (await r.regrade(*_math(name, p, a, clean))).result for name, a in answers.items()}
        mixed_right = (await r.regrade(*_math("mixed", p, answers["right"], ["Я складываю numbers", "готово"]))).result
    assert got["right"].reward == 1.0 and got["right"].resolved
    for name, res in got.items():
        comps = res.reward_components
        assert set(comps) == {"outcome", "tool_call_errors", "language_mixing"}, name
        assert res.reward == math.fsum(c.weight * c.value for c in comps.values()), name
        assert all(c.value <= 0.0 for n, c in comps.items() if n != "outcome"), name  # penalties only
        if name != "right":
            assert res.reward <= 0.0 < got["right"].reward and not res.resolved, name
    # a right answer that mixes scripts pays for it, and still beats every wrong answer with clean turns
    assert mixed_right.reward_components["language_mixing"].value < 0.0
    assert max(res.reward for n, res in got.items() if n != "right") < mixed_right.reward < 1.0


class ToolAgentHandler(AgentHandler):
    """The shipped tool handlers' reward path (math, code, swe: the generic agent loop, then
    ``compose_reward(job, outcome, await process_terms_async(job))``) with one host tool, ``probe``, instead of a
    sandbox (a real sandbox makes this the real tier): the outcome is 1.0 when the finish tool's answer is
    ``"42"``."""

    name = "tool_agent_terms"
    needs_llm = True
    reward_terms = ("tool_call_errors", "language_mixing")

    async def run(self, job):
        from prorl_server.plugin import AgentConfig
        from prorl_server.plugin.toolkit import run_agent

        async def probe(args):
            return "ok"

        tools = {"probe": ({"type": "object", "properties": {}}, probe)}
        await run_agent(job, [{"role": "user", "content": "Probe, then finish with 42."}], tools,
                        AgentConfig(max_turns=4))

    def restore_for_eval(self, job, result):
        pass  # eval reads the recorded extra.agent, which the re-grader restores itself

    async def eval(self, job):
        from prorl_server.plugin import compose_reward, process_terms_async

        answer = (job.extra["agent"].get("answer") or {}).get("answer")
        job.resolved = answer == "42"
        compose_reward(job, 1.0 if job.resolved else 0.0, await process_terms_async(job))


def _call(name, **arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@pytest.mark.parametrize("first, answer, outcome, errors", [
    ('<tool_call>\n{"name": "probe", "arguments": {\n</tool_call>', "42", 1.0, 1),  # right, after a malformed call
    (_call("probe"), "42", 1.0, 0),                                                   # right, clean
    ("", "", 0.0, 0), (_call("probe"), "0", 0.0, 0)])                                 # empty, wrong constant
async def test_tool_call_parse_errors_cost_only_the_turn_that_made_them(aiohttp_client, scripted_policy, first,
                                                                        answer, outcome, errors):
    def script(prompt: str, turn: int) -> str:
        return first if turn == 0 else _call("finish", answer=answer)

    registry = HandlerRegistry()
    registry.register(ToolAgentHandler)
    app = create_app(ServerSettings(backends=[await scripted_policy(script)], health_interval_s=3600),
                     registry=registry)
    client = await aiohttp_client(app)
    r = await client.post("/process", json={"instance": {"data_source": "tool_agent_terms"},
                                            "sampling_params": {"max_tokens": 256},
                                            "reward_weights": {"tool_call_errors": 1.0}})
    res = await r.json()
    assert res["failure_kind"] is None, res["error"]
    term = res["reward_components"]["tool_call_errors"]
    n = len(res["turns"])
    assert n >= 1 and [t["tool_call_errors"] > 0 for t in res["turns"]].count(True) == errors
    assert term["value"] == pytest.approx(-errors / n) and term["weight"] == 1.0 and term["value"] <= 0.0
    assert res["reward"] == pytest.approx(outcome - errors / n, abs=1e-12)
    assert math.fsum(t["reward"] for t in res["turns"]) == pytest.approx(res["reward"], abs=1e-12)
    if errors:  # the penalty sits on the turn that made the malformed call
        assert res["turns"][0]["reward"] == pytest.approx(-1 / n)

    # re-graded from the record (its turn records and the request's weights), the components come out the same
    req = ProcessRequest(instance={"data_source": "tool_agent_terms"}, sampling_params={"max_tokens": 256},
                         job_id=res["job_id"], reward_weights={"tool_call_errors": 1.0})
    async with Regrader(registry, sandbox_runtime="none") as g:
        out = await g.regrade(res["job_id"], "tool_agent_terms", req.model_dump_json().encode(),
                              json.dumps(res).encode())
    assert out.status == "regraded" and out.changed is False, out
    assert json.dumps(out.row()["new_reward_components"]) == json.dumps(res["reward_components"])
