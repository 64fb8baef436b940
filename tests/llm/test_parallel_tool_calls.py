"""Parallel tool calls (issue #35: an agent gains from independent calls in one turn only if they run side by
side): with ``AgentConfig.parallel_tool_calls``, calls to tools marked ``parallel_safe`` run concurrently, their
observations come back in the calls' order, and the turn record's ``t_tool_critical_s`` is the batch's wall time
while ``t_tool_s`` sums the calls; a tool sharing a sandbox's state stays one call at a time.

Fast tier. The backend is the scripted policy of tests/conftest.py (a labelled test double for a capable model in
vLLM's token-in/token-out dialect) behind the real server and LLM client; tools are in-process sleeps. The
sandbox handle below is a labelled stand-in for :class:`sandbox.client` handles (its ``bash`` sleeps and counts
how many of its commands run at once), so the rule under test needs no bubblewrap.
"""
from __future__ import annotations

import asyncio
import json
import math

import pytest

from prorl_server.app import create_app
from prorl_server.config import ServerSettings
from prorl_server.llm.agent_loop import AgentConfig, AgentLoop, parallel_safe
from prorl_server.llm.client import LLMClient
from prorl_server.plugin import AgentHandler
from prorl_server.plugin.registry import HandlerRegistry
from prorl_server.plugin.toolkit import run_agent, sandbox_tools
from prorl_server.types import JobResult
from sandbox.errors import SandboxDeadError

CALL_S = 0.2  # what each tool call takes, seconds


def call(name: str, **args) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def three_calls_then_finish(tool: str):
    """The scripted model: turn 0 makes three calls to ``tool`` (``i`` 0, 1, 2; ``command`` c0, c1, c2), turn 1
    calls finish."""
    def script(prompt: str, turn: int) -> str:
        if turn == 0:
            return "".join(call(tool, i=i, command=f"c{i}") for i in range(3))
        return call("finish", answer="done")
    return script


async def nap(args: dict) -> str:
    """Sleeps :data:`CALL_S` minus 50 ms per index, so the calls finish in the reverse of their order."""
    await asyncio.sleep(CALL_S - 0.05 * int(args["i"]))
    return f"nap {args['i']}"


class FakeSandboxHandle:
    """Stands for a sandbox client handle (one persistent shell): ``bash`` sleeps :data:`CALL_S` and records
    the most commands it ever ran at once."""

    def __init__(self) -> None:
        self.running = 0
        self.most = 0

    async def bash(self, command: str, timeout_s: float):
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await asyncio.sleep(CALL_S)
        finally:
            self.running -= 1

        class R:
            output, timed_out, exit_code = command, False, 0
        return R()


class NapHandler(AgentHandler):
    """Runs the agent loop with parallel calls on and the parallel-safe tool ``nap``."""

    name = "nap"
    needs_llm = True

    async def run(self, job) -> None:
        await run_agent(job, [{"role": "user", "content": "Nap thrice."}],
                        {"nap": ({"type": "object", "properties": {"i": {"type": "integer"}}}, parallel_safe(nap))},
                        AgentConfig(parallel_tool_calls=True))

    async def eval(self, job) -> None:
        job.resolved, job.reward = True, 1.0


async def test_three_parallel_calls_take_one_call_s_and_answer_in_call_order(aiohttp_client, scripted_policy):
    registry = HandlerRegistry()
    registry.register(NapHandler)
    app = create_app(ServerSettings(backends=[await scripted_policy(three_calls_then_finish("nap"))],
                                    health_interval_s=3600), registry=registry)
    client = await aiohttp_client(app)
    r = JobResult(**await (await client.post("/process", json={"instance": {"data_source": "nap"},
                                                                 "sampling_params": {"max_tokens": 256}})).json())
    assert r.failure_kind is None, r.error
    obs = [m["content"] for m in r.messages if m["role"] == "tool"]
    assert obs == ["nap 0", "nap 1", "nap 2"]  # the calls' order, though nap 2 finished first
    first = r.turns[0]
    assert first.tool_calls == 3
    assert CALL_S <= first.t_tool_critical_s < CALL_S + 0.1, first  # one call's time, not three
    assert first.t_tool_s == pytest.approx(3 * CALL_S - 0.15, abs=0.08)  # 0.2 + 0.15 + 0.1: the calls' sum
    # the turns' times still partition the run stage (the critical path, not the sum, is wall time)
    total = math.fsum(t.t_llm_s + t.t_tool_critical_s + t.t_wait_s for t in r.turns)
    assert abs(total - r.timing.run_s) < 1e-6


async def run_loop(tokenizer, url: str, tools: dict, **cfg):
    loop = AgentLoop(tokenizer, LLMClient(), tools, AgentConfig(**cfg))
    try:
        return await loop.run([{"role": "user", "content": "Go."}], backend=url,
                              sampling_params={"max_tokens": 256})
    finally:
        await loop.llm.close()


async def test_a_sandbox_sharing_tool_stays_sequential_with_parallel_calls_on(tokenizer, scripted_policy):
    handle = FakeSandboxHandle()
    url = await scripted_policy(three_calls_then_finish("bash"))
    r = await run_loop(tokenizer, url, sandbox_tools(handle, names=("bash",)), parallel_tool_calls=True)
    assert handle.most == 1  # one shell: its commands never interleave
    first = r.turns[0]
    assert first.t_tool_critical_s >= 3 * CALL_S and first.t_tool_critical_s == first.t_tool_s
    assert [m["content"] for m in r.messages if m["role"] == "tool"] == [f"c{i}\n[exit code 0]" for i in range(3)]
    assert r.metrics["parallel_tool_batches"] == 0


async def test_a_parallel_safe_tool_runs_one_by_one_unless_the_loop_opts_in(tokenizer, scripted_policy):
    url = await scripted_policy(three_calls_then_finish("nap"))
    tools = {"nap": ({"type": "object", "properties": {}}, parallel_safe(nap))}
    r = await run_loop(tokenizer, url, tools)
    assert r.turns[0].t_tool_critical_s == r.turns[0].t_tool_s >= 3 * CALL_S - 0.15


async def test_a_failing_parallel_call_fails_only_itself_and_an_infrastructure_fault_cancels_the_rest(
        tokenizer, scripted_policy):
    finished: list[int] = []

    @parallel_safe
    async def mixed(args: dict) -> str:
        i = int(args["i"])
        if i == 1:
            raise ValueError("bad argument")  # the model's doing: its observation only
        await asyncio.sleep(CALL_S)
        finished.append(i)
        return f"ok {i}"

    url = await scripted_policy(three_calls_then_finish("mixed"))
    r = await run_loop(tokenizer, url, {"mixed": ({"type": "object", "properties": {}}, mixed)},
                       parallel_tool_calls=True)
    assert [m["content"] for m in r.messages if m["role"] == "tool"] == [
        "ok 0", "Error: tool 'mixed' failed: ValueError: bad argument", "ok 2"]

    finished.clear()

    @parallel_safe
    async def dying(args: dict) -> str:
        i = int(args["i"])
        if i == 2:
            await asyncio.sleep(0.02)
            raise SandboxDeadError("the sandbox died")  # the system's doing: the rollout fails
        await asyncio.sleep(CALL_S)
        finished.append(i)
        return "late"

    url = await scripted_policy(three_calls_then_finish("dying"))
    with pytest.raises(SandboxDeadError):
        await run_loop(tokenizer, url, {"dying": ({"type": "object", "properties": {}}, dying)},
                       parallel_tool_calls=True)
    await asyncio.sleep(CALL_S + 0.05)
    assert finished == []  # the other calls were cancelled, not left running
