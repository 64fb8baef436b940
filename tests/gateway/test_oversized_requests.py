"""A gateway request whose text cannot fit the model's context is refused before it is rendered or tokenized.

An agent in a sandbox posted ~1 MB of chat content per request: each cost ~1.6 s of tokenizing before the
context check refused it, and eight in parallel kept ``/health`` waiting 5.75 s (red-team case A13). The
scripted policy (tests/conftest.py) stands in for vLLM with a 16,384-token context.
"""
from __future__ import annotations

import time

import openai
import pytest

from prorl_server.gateway.sessions import MAX_BYTES_PER_TOKEN


async def test_a_request_far_past_the_context_is_refused_unread(gateway_server, open_session, scripted_policy):
    client, _ = await gateway_server([await scripted_policy(lambda p, t: "ok")])
    _, sdk = await open_session(client)
    huge = "word " * (16384 * MAX_BYTES_PER_TOKEN // 5 + 1000)  # ~0.7 MB
    t0 = time.perf_counter()
    with pytest.raises(openai.BadRequestError) as e:
        await sdk.chat.completions.create(model="m", max_tokens=8, messages=[{"role": "user", "content": huge}])
    assert time.perf_counter() - t0 < 1.0  # tokenizing it took ~2 s
    assert e.value.body["code"] == "context_length_exceeded" and "bytes of text" in e.value.body["message"]
    ok = await sdk.chat.completions.create(model="m", max_tokens=8,
                                           messages=[{"role": "user", "content": "word " * 1000}])
    assert ok.choices[0].message.content == "ok"  # a request that may fit is still served


@pytest.mark.parametrize("where", ["tool_schema_key", "tool_call_argument_key", "cjk", "escapes", "numbers"])
async def test_text_in_keys_and_multibyte_text_count_too(gateway_server, open_session, scripted_policy, where):
    """A 990 KB dictionary key in a tool schema or in a tool call's arguments is rendered and tokenized like any
    text (second red-team pass: counted as 0, 1.6 s of tokenizing each); CJK text is 3 bytes a character and
    may be 3 tokens."""
    client, _ = await gateway_server([await scripted_policy(lambda p, t: "ok")])
    _, sdk = await open_session(client)
    key = "k" * 990_000
    messages = [{"role": "user", "content": "hi"}]
    tools = None
    if where == "tool_schema_key":
        tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {
            "type": "object", "properties": {key: {"type": "string"}}}}}]
    elif where == "tool_call_argument_key":
        messages += [{"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "f", "arguments": "{\"" + key + "\": 1}"}}]}, {"role": "tool", "tool_call_id": "c1", "content": "x"}]
    elif where == "cjk":
        messages = [{"role": "user", "content": "\u4e00" * (16384 * MAX_BYTES_PER_TOKEN // 3 + 100)}]
    elif where == "escapes":  # each control character is rendered as six (third red-team pass)
        tools = [{"type": "function", "function": {"name": "f", "description": "\x01\x02\x03\x1f" * 31000,
                                                   "parameters": {"type": "object", "properties": {}}}}]
    else:  # numbers are rendered too (third red-team pass)
        tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer", "enum": [10 ** 29 + k for k in range(30000)]}}}}}]
    t0 = time.perf_counter()
    with pytest.raises(openai.BadRequestError) as e:
        await sdk.chat.completions.create(model="m", max_tokens=8, messages=messages,
                                          **({"tools": tools} if tools else {}))
    assert time.perf_counter() - t0 < 1.0, e.value.body
    assert e.value.body["code"] == "context_length_exceeded", e.value.body
