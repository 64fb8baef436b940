"""Turn records (issue #35 part 1): every model turn of a result carries its token span, weight version, finish
reason, tool-call counts and times; the spans tile the sampled (``loss_mask`` 1) tokens exactly; the times add up
to the run stage's wall time; the turn rewards sum to ``reward``.

Fast tier. The backend is the scripted policy of tests/conftest.py (a labelled test double for a capable model in
vLLM's token-in/token-out dialect). The jobs are shout episodes (the handler drives the conversation itself),
agent-loop episodes with in-process tools (the loop the code and math handlers run; their sandboxes are the real
tier's) and gateway sessions through the Chat Completions API (n = 1, with a history split). The real tier runs
the shipped code and math handlers in bubblewrap.
"""
from __future__ import annotations

import asyncio
import math
import random

import pytest

from handlers.shout import ShoutHandler
from prorl_server.app import create_app
from prorl_server.config import ServerSettings
from prorl_server.plugin import AgentHandler
from prorl_server.plugin.registry import HandlerRegistry
from prorl_server.plugin.toolkit import run_agent
from prorl_server.types import JobResult, Trajectory, TurnRecord

TOOL_S = 0.02  # what the test's tool takes, seconds


def _sampled_runs(traj: Trajectory) -> list[int]:
    return [i for i, m in enumerate(traj.loss_mask) if m]


def assert_turns_tile(trajectories: list[Trajectory], turns: list[TurnRecord]) -> None:
    """The spans of ``turns`` tile the sampled tokens of ``trajectories`` exactly, once each, in order, one record
    per turn; every time is finite and >= 0 and a turn's critical tool path is at most its tool time. Shared by
    the tests of turn records (here, the 1,000-job target, gateway branches)."""
    covered: dict[int, list[int]] = {i: [] for i in range(len(trajectories))}
    last = (-1, -1)
    for t in turns:
        assert 0 <= t.trajectory_index < len(trajectories)
        assert t.response_start <= t.response_end <= len(trajectories[t.trajectory_index].response_ids)
        assert (t.trajectory_index, t.response_start) > last, "turns out of order or overlapping"
        last = (t.trajectory_index, t.response_end - 1)
        covered[t.trajectory_index].extend(range(t.response_start, t.response_end))
        for v in (t.t_llm_s, t.t_tool_s, t.t_tool_critical_s, t.t_wait_s):
            assert math.isfinite(v) and v >= 0
        assert t.t_tool_critical_s <= t.t_tool_s + 1e-12
    for i, traj in enumerate(trajectories):
        assert covered[i] == _sampled_runs(traj), f"trajectory {i}: spans do not tile its sampled tokens"
        assert len([t for t in turns if t.trajectory_index == i]) == traj.num_turns
    assert len(turns) == sum(t.num_turns for t in trajectories)


def check_records(trajectories: list[Trajectory], turns: list[TurnRecord]) -> None:
    """:func:`assert_turns_tile`, and every turn generated (``t_llm_s`` > 0) and ended by stop or length."""
    assert_turns_tile(trajectories, turns)
    for t in turns:
        assert t.t_llm_s > 0 and t.finish_reason in ("stop", "length")


def check_result(r: JobResult) -> None:
    assert r.failure_kind is None, r.error
    assert r.turns, "a result with generated turns has turn records"
    check_records(r.trajectories, r.turns)
    total = math.fsum(t.t_llm_s + t.t_tool_s + t.t_wait_s for t in r.turns)
    assert abs(total - r.timing.run_s) < 1e-6, (total, r.timing.run_s)
    assert math.fsum(t.reward for t in r.turns) == r.reward


class ToolLoopHandler(AgentHandler):
    """A test handler on the agent loop the code and math handlers run, with in-process tools (``wait``:
    sleeps :data:`TOOL_S`) instead of a sandbox's: the reward is 1.0 when the finish tool's answer is "42"."""

    name = "tool_loop"
    needs_llm = True

    async def run(self, job) -> None:
        async def wait(args: dict) -> str:
            await asyncio.sleep(TOOL_S)
            return "waited"

        tools = {"wait": ({"type": "object", "properties": {}}, wait)}
        res = await run_agent(job, [{"role": "user", "content": f"Task {job.instance['k']}."}], tools)
        job.state = res.answer

    async def eval(self, job) -> None:
        job.resolved = isinstance(job.state, dict) and job.state.get("answer") == "42"
        job.reward = 1.0 if job.resolved else 0.0


def _tool_script(prompt: str, turn: int) -> str:
    k = int(prompt.split("Task ")[1].split(".")[0])
    if turn < k % 3:
        return 'I wait.\n<tool_call>\n{"name": "wait", "arguments": {}}\n</tool_call>'
    if turn == k % 3 and k % 2:
        return '<tool_call>\n{"name": "wait", "arguments": {not json}\n</tool_call>'  # a parse error
    return '<tool_call>\n{"name": "finish", "arguments": {"answer": "42"}}\n</tool_call>'


async def test_every_turn_of_many_jobs_carries_a_span_and_times_that_tile_and_add_up(aiohttp_client,
                                                                                    scripted_policy):
    def script(prompt: str, turn: int) -> str:
        return _tool_script(prompt, turn) if "Task " in prompt else ("quiet words" if turn % 2 else "LOUD WORDS")

    registry = HandlerRegistry()
    registry.register(ShoutHandler)
    registry.register(ToolLoopHandler)
    app = create_app(ServerSettings(backends=[await scripted_policy(script)], health_interval_s=3600),
                     registry=registry)
    client = await aiohttp_client(app)
    rng = random.Random(5)
    bodies = [{"instance": {"data_source": "shout", "prompt": f"Talk {i}.", "turns": rng.randint(2, 8)},
               "sampling_params": {"max_tokens": rng.choice([3, 32])}} for i in range(40)]
    bodies += [{"instance": {"data_source": "tool_loop", "k": k}, "sampling_params": {"max_tokens": 64}}
               for k in range(30)]
    answers = await asyncio.gather(*(client.post("/process", json=b) for b in bodies))
    results = [JobResult(**await a.json()) for a in answers]
    turns = 0
    for r in results:
        check_result(r)
        turns += len(r.turns)
    assert turns > 150
    loops = [r for r in results if r.handler == "tool_loop"]
    for r, k in zip(loops, range(30)):
        assert r.resolved
        # the tool turns: one call each, timed on the host around the call; the parse error is counted
        waits = k % 3
        assert [t.tool_calls for t in r.turns[:waits]] == [1] * waits
        assert all(TOOL_S <= t.t_tool_s == t.t_tool_critical_s for t in r.turns[:waits])
        assert sum(t.tool_call_errors for t in r.turns) == k % 2
        assert r.turns[-1].tool_calls == 1  # the finish call


async def test_gateway_session_turns_tile_its_trajectories_across_a_split(aiohttp_client, scripted_policy):
    import openai

    app = create_app(ServerSettings(backends=[await scripted_policy(lambda p, t: f"answer {t}")],
                                    health_interval_s=3600, token="server-secret"), registry=HandlerRegistry())
    client = await aiohttp_client(app)
    auth = {"Authorization": "Bearer server-secret"}
    s = await (await client.post("/sessions", json={}, headers=auth)).json()
    sdk = openai.AsyncOpenAI(base_url=s["base_url"], api_key="x", max_retries=0, timeout=60)
    try:
        messages = [{"role": "user", "content": "Hi."}]
        for i in range(4):
            r = await sdk.chat.completions.create(model="m", messages=messages)
            await asyncio.sleep(0.01)  # the agent program's own time between answer and next request
            content = r.choices[0].message.content + (" " if i == 1 else "")  # turn 1 resent changed: a split
            messages += [{"role": "assistant", "content": content}, {"role": "user", "content": f"more {i}"}]
    finally:
        await sdk.close()
    result = await (await client.post(f"/sessions/{s['session_id']}/finalize", headers=auth)).json()
    trajectories = [Trajectory(**t) for t in result["trajectories"]]
    turns = [TurnRecord(**t) for t in result["turns"]]
    assert len(trajectories) == 2 and len(turns) == 4
    check_records(trajectories, turns)
    # the agent's time after each answer it continued from is its own (tool) time, never the system's
    assert turns[0].t_tool_s >= 0.01 and turns[2].t_tool_s >= 0.01


@pytest.mark.real
async def test_code_and_math_jobs_in_bubblewrap_carry_tiling_turn_records(aiohttp_client, scripted_policy,
                                                                          bwrap_runtime, sandbox_procs):
    """The shipped code and math handlers in real bubblewrap sandboxes: their tool turns (bash, ipython) are
    timed on the host and every turn's span tiles the sampled tokens."""
    from handlers.math.data import load_reasoning_gym

    def script(prompt: str, turn: int) -> str:
        tool = "bash" if "HumanEval" in prompt or "def " in prompt else "ipython"
        args = '{"command": "echo hi"}' if tool == "bash" else '{"code": "print(6 * 7)"}'
        if turn < 2:
            return f'Step {turn}.\n<tool_call>\n{{"name": "{tool}", "arguments": {args}}}\n</tool_call>'
        return '<tool_call>\n{"name": "finish", "arguments": {"answer": "42"}}\n</tool_call>'

    registry = HandlerRegistry()
    registry.load_entry_points()
    app = create_app(ServerSettings(backends=[await scripted_policy(script)], health_interval_s=3600),
                     registry=registry, sandbox_runtime=bwrap_runtime)
    client = await aiohttp_client(app)
    bodies = [{"instance": {"data_source": "code", "instance_id": f"HumanEval/{i}"},
               "sampling_params": {"max_tokens": 64}} for i in range(3)]
    bodies += [{"instance": {**inst, "max_turns": 4}, "sampling_params": {"max_tokens": 64}}
               for inst in load_reasoning_gym("basic_arithmetic", limit=3, seed=3)]
    answers = await asyncio.gather(*(client.post("/process", json=b) for b in bodies))
    for a in answers:
        r = JobResult(**await a.json())
        check_result(r)
        assert len(r.turns) == 3 and all(t.tool_calls == 1 and t.t_tool_s > 0 for t in r.turns[:2])
    await bwrap_runtime.close_all()
    assert not sandbox_procs()
