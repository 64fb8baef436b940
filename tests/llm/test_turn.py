"""The turn engine both the agent loop and the gateway generate through (prorl_server.llm.turn): the context-limit
rule, one turn through a job (failover source, recorded backend and weight version, parsed tool calls), a
turn its caller refuses, and a full context. Generation goes through the real LLM client to the scripted
policy (tests/conftest.py: a labelled stand-in for a model that writes tool calls) with the tiny model's real
tokenizer."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from prorl_server.balancer import BackendPool
from prorl_server.job import Job
from prorl_server.llm.client import LLMClient
from prorl_server.llm.turn import ContextFullError, ContextUnknownError, TurnEngine, context_limit

START = [{"role": "user", "content": "Say it with a tool."}]
CALL = '<tool_call>\n{"name": "echo", "arguments": {"text": "hi"}}\n</tool_call>'


def test_context_limit_is_the_smallest_known_limit():
    # stand-ins for tokenizers: only their model_max_length is read
    assert context_limit(SimpleNamespace(model_max_length=4096), 2048, None) == 2048
    assert context_limit(SimpleNamespace(model_max_length=1024), 2048) == 1024
    assert context_limit(SimpleNamespace(model_max_length=int(1e30)), None, 512) == 512  # transformers' "none"
    assert context_limit(object(), 300) == 300
    with pytest.raises(ContextUnknownError):
        context_limit(SimpleNamespace(model_max_length=int(1e30)), None)


def job_on(pool: BackendPool) -> Job:
    return Job(job_id="t", instance={}, sampling_params={}, handler=None, handler_name="t", timeout_s=None,
               pool=pool)


async def test_a_turn_through_a_job_is_recorded_on_it_and_its_tool_calls_parsed(scripted_policy, tokenizer):
    url = await scripted_policy(lambda prompt, turn: "calling " + CALL)
    pool = BackendPool()
    pool.add(url, weight_version=3)
    job = job_on(pool)
    async with LLMClient(pool=pool) as client:
        engine = TurnEngine(client, "hermes")
        max_len = await engine.served_max_len(job)
        assert max_len == 16384
        conv = await engine.start(tokenizer, START, caps=(max_len,))
        prompt = list(conv.token_ids)
        turn = await engine.turn(conv, job, max_tokens=64)
    assert [c.name for c in turn.parsed.calls] == ["echo"] and turn.parsed.calls[0].arguments == {"text": "hi"}
    assert turn.message["content"].startswith("calling <tool_call>")
    assert conv.token_ids[:len(prompt)] == prompt and conv.num_turns == 1
    assert turn.completion.token_ids == scripted_policy.returned[0][0]
    result = job.build_result()
    assert (result.backend, result.weight_version) == (url, 3)
    assert pool.holder("t").address == url


async def test_a_turn_the_caller_refuses_is_not_appended(scripted_policy, tokenizer):
    url = await scripted_policy(lambda prompt, turn: "hello")

    def refuse(completion):
        raise RuntimeError("the session ended meanwhile")

    async with LLMClient() as client:
        engine = TurnEngine(client)
        conv = await engine.start(tokenizer, START, caps=(4096,))
        before = list(conv.token_ids)
        with pytest.raises(RuntimeError, match="ended meanwhile"):
            await engine.turn(conv, url, accept=refuse)
        assert conv.token_ids == before and conv.num_turns == 0
        turn = await engine.turn(conv, url, parse=False)  # the same prompt again
    assert turn.parsed is None and conv.num_turns == 1 and len(scripted_policy.returned) == 2


async def test_a_full_context_ends_without_a_request(scripted_policy, tokenizer):
    url = await scripted_policy(lambda prompt, turn: json.dumps({"long": "answer " * 20}))
    async with LLMClient() as client:
        engine = TurnEngine(client)
        probe = await engine.start(tokenizer, START, caps=(4096,))
        conv = await engine.start(tokenizer, START, caps=(probe.num_tokens + 3,))  # room for 3 tokens
        turn = await engine.turn(conv, url, max_tokens=100)
        assert len(turn.completion.token_ids) == 3 and turn.completion.finish_reason == "length"
        with pytest.raises(ContextFullError, match="fills the model's context"):
            await engine.turn(conv, url)
    assert len(scripted_policy.returned) == 1
