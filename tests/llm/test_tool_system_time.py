"""The agent loop moves the seconds a sandbox charges to the system (its shell or kernel starting, issue #35 R6)
from a tool call's time to the turn's ``t_wait_s``, one call at a time and with calls run side by side.

Fast tier. The backend is the scripted policy of tests/conftest.py (a labelled test double for a capable model in
vLLM's token-in/token-out dialect). The tools are in-process stand-ins for a sandbox's first call: each sleeps
:data:`START_S` and charges it with :func:`sandbox.system_time.charge_system`, as
:class:`sandbox.runtime.SandboxHandle` does around its lazy kernel start (the real tier's
tests/core/test_sandbox_start_charge.py runs the real one), then sleeps :data:`WORK_S` of the model's work.
"""
from __future__ import annotations

import asyncio
import json
import math

import pytest

from prorl_server.llm.agent_loop import AgentConfig, AgentLoop, parallel_safe
from prorl_server.llm.client import LLMClient
from sandbox.system_time import charge_system

START_S = 0.3  # the stand-in start-up, seconds (the system's)
WORK_S = 0.05  # the stand-in command, seconds (the model's)


def call(name: str, **args) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def script(n_calls: int):
    def s(prompt: str, turn: int) -> str:
        if turn == 0:
            return "".join(call("tool", i=i) for i in range(n_calls))
        return call("finish", answer="done")
    return s


async def first_call_starts(args: dict) -> str:
    await asyncio.sleep(START_S)
    charge_system(START_S)
    await asyncio.sleep(WORK_S)
    return "ok"


async def run(tokenizer, url: str, fn, parallel: bool):
    loop = AgentLoop(tokenizer, LLMClient(), {"tool": ({"type": "object", "properties": {}}, fn)},
                     AgentConfig(parallel_tool_calls=parallel))
    try:
        return await loop.run([{"role": "user", "content": "Go."}], backend=url, sampling_params={"max_tokens": 256})
    finally:
        await loop.llm.close()


def partitions(r) -> float:
    return math.fsum(t.t_llm_s + t.t_tool_critical_s + t.t_wait_s for t in r.turns)


async def test_a_calls_charged_start_up_goes_to_wait_not_tool_time(tokenizer, scripted_policy):
    r = await run(tokenizer, await scripted_policy(script(1)), first_call_starts, parallel=False)
    first = r.turns[0]
    assert WORK_S <= first.t_tool_s < WORK_S + 0.1, first
    assert first.t_tool_critical_s == pytest.approx(first.t_tool_s)
    assert first.t_wait_s >= START_S, first
    assert r.metrics["tool_system_s"] == pytest.approx(START_S, abs=0.01)


async def test_parallel_calls_each_charge_their_own_start_up(tokenizer, scripted_policy):
    r = await run(tokenizer, await scripted_policy(script(3)), parallel_safe(first_call_starts), parallel=True)
    first = r.turns[0]
    assert first.tool_calls == 3
    # three calls side by side: the model's work is 3 x WORK_S summed and WORK_S on the critical path; the start-up
    # ran side by side too and counts once, in t_wait_s
    assert 3 * WORK_S <= first.t_tool_s < 3 * WORK_S + 0.1, first
    assert WORK_S <= first.t_tool_critical_s < WORK_S + 0.05, first
    assert first.t_wait_s >= START_S, first
    assert r.metrics["tool_system_s"] == pytest.approx(START_S, abs=0.03)
    assert r.metrics["tool_s"] == pytest.approx(START_S + WORK_S, abs=0.05)
