"""The Anthropic Messages API on gateway sessions (prorl_server.gateway.anthropic, ``POST {base}/v1/messages``):
every block type of a request becomes the Chat Completions body the gateway accepts, answers become
``anthropic.types.Message`` objects the real SDK reads (whole and streamed, event order checked), bad input
and gateway errors are Anthropic-format errors, and a multi-turn tool-use conversation of the real SDK on a
real server stays one trajectory."""
from __future__ import annotations

import json

import anthropic
import pytest
from anthropic.types import ErrorResponse, Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from prorl_server.gateway import GATEWAY, describe_divergence, normalize_message, parse_chat_request
from prorl_server.gateway.anthropic import (AnthropicError, from_gateway_error, sse, stream_events,
                                            to_chat_request, to_message)
from prorl_server.gateway.protocol import answer_choice, assistant_message, chat_completion
from prorl_server.llm.tool_parser import ParsedTurn, ToolCall

AUTH = {"Authorization": "Bearer server-secret"}
EVENTS = TypeAdapter(RawMessageStreamEvent)
TOOL = {"name": "read", "description": "Read a file.",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}


def answer(content, calls=(), finish="stop", stop_reason=None):
    """A ``chat.completion`` built by the gateway's own builders (what Gateway.chat answers), id fixed."""
    parsed = ParsedTurn(content=content, calls=[ToolCall(n, a, cid) for cid, n, a in calls]) if calls else None
    msg, finish = assistant_message(content, parsed, finish)
    choice = answer_choice(0, msg, finish, stop_reason=stop_reason)
    return {**chat_completion([choice], model="tiny", prompt_tokens=40, completion_tokens=7), "id": "chatcmpl-abc123"}


# ------------------------------------------------------------------------------------------ requests


def test_every_block_type_becomes_the_chat_body_the_gateway_accepts():
    body = {  # temperature, top_p, top_k: sent by older clients (the current SDK's parameters lack them)
        "model": "claude-anything", "max_tokens": 256, "temperature": 0.5, "top_p": 0.9, "top_k": 20,
        "stop_sequences": ["END"], "metadata": {"user_id": "u1"}, "thinking": {"type": "enabled", "budget_tokens": 1024},
        "speed": "standard", "inference_geo": "us", "cache_control": {"type": "ephemeral"},
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=deadbeef;"},
                   {"type": "text", "text": "You read files."}, {"type": "text", "text": " Be brief.",
                                                                  "cache_control": {"type": "ephemeral"}}],
        "tools": [TOOL, {"name": "ls", "input_schema": {"type": "object"}, "type": "custom"}],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "<reminder/>"}, {"type": "text", "text": "Read a.txt"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I should read it.", "signature": "sig"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"path": "a.txt"}},
                {"type": "tool_use", "id": "toolu_2", "name": "read", "input": {"path": "b.txt"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "hello"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": [{"type": "text", "text": "no such "}, {"type": "text", "text": "file"}]},
                {"type": "text", "text": "Now summarise."}]},
            {"role": "assistant", "content": "Both read."},
            {"role": "user", "content": "Thanks."},
        ]}
    req = to_chat_request(body)
    assert req.stream is False and req.stop_sequences == ["END"]
    assert req.chat == {
        "messages": [
            {"role": "system", "content": "You read files. Be brief."},
            {"role": "user", "content": "<reminder/>Read a.txt"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.txt"}'}},
                {"id": "toolu_2", "type": "function", "function": {"name": "read", "arguments": '{"path": "b.txt"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "hello"},
            {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no such file"},
            {"role": "user", "content": "Now summarise."},
            {"role": "assistant", "content": "Both read."},
            {"role": "user", "content": "Thanks."}],
        "max_tokens": 256, "temperature": 0.5, "top_p": 0.9, "top_k": 20, "stop": ["END"],
        "tools": [{"type": "function", "function": {"name": "read", "description": "Read a file.",
                                                    "parameters": TOOL["input_schema"]}},
                  {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}],
        "tool_choice": "auto", "parallel_tool_calls": False}
    parsed = parse_chat_request(req.chat)  # the gateway's own validation accepts it as it is
    assert [m["role"] for m in parsed.messages] == ["system", "user", "assistant", "tool", "tool", "user",
                                                    "assistant", "user"]
    assert parsed.sampling == {"temperature": 0.5, "top_p": 0.9, "top_k": 20, "stop": ["END"]}
    assert parsed.max_tokens == 256 and parsed.parse_tools


@pytest.mark.parametrize("choice, expected", [
    ({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "read"}, {"type": "function", "function": {"name": "read"}})])
def test_tool_choice_maps_to_its_chat_completions_form(choice, expected):
    req = to_chat_request({"max_tokens": 8, "tools": [TOOL], "tool_choice": choice,
                           "messages": [{"role": "user", "content": "hi"}]})
    assert req.chat["tool_choice"] == expected


def test_output_config_format_becomes_response_format_and_effort_is_ignored():
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}}
    req = to_chat_request({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                           "output_config": {"effort": "low", "format": {"type": "json_schema", "schema": schema}}})
    assert req.chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    assert "response_format" not in to_chat_request({"max_tokens": 8, "output_config": {"effort": "high"},
                                                     "messages": [{"role": "user", "content": "hi"}]}).chat


def test_inline_system_messages_and_string_system():
    req = to_chat_request({"max_tokens": 8, "system": "Be brief.", "stream": True, "messages": [
        {"role": "user", "content": "hi"}, {"role": "system", "content": [{"type": "text", "text": "Reminder."}]},
        {"role": "user", "content": "again"}]})
    assert req.stream is True and "stream" not in req.chat
    assert req.chat["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                                    {"role": "system", "content": "Reminder."}, {"role": "user", "content": "again"}]


@pytest.mark.parametrize("body, where", [
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
     "messages.0.content.0: image blocks are not supported"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}]},
     "messages.0.content.0.content.0: only text blocks"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]},
     "messages.0.content.0: document blocks are not supported"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "read", "input": {}}]}]},
     "messages.0.content.0: a user message cannot carry a 'tool_use' block"),
    ({"max_tokens": 8, "messages": [{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]},
     "messages.0.content.0: an assistant message cannot carry a 'tool_result' block"),
    ({"max_tokens": 8, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "read", "input": "a.txt"}]}]},
     "messages.0.content.0: a tool_use block needs id"),
    ({"max_tokens": 8, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"max_tokens": 8, "messages": []}, "messages: a non-empty list is required"),
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens: a positive integer is required"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "x"}], "mcp_servers": []},
     "unsupported field(s): mcp_servers"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type: server tool"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "read"}]},
     "tools.0.input_schema"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "some"}},
     "tool_choice.type"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "x"}], "output_config": {"format": {"type": "xml"}}},
     "output_config.format: must be"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "x"}], "stop_sequences": "END"},
     "stop_sequences: must be a list"),
    ([1, 2], "the request body must be a JSON object"),
])
def test_bad_requests_are_anthropic_format_400s(body, where):
    with pytest.raises(AnthropicError) as e:
        to_chat_request(body)
    assert e.value.status == 400 and e.value.message.startswith(where), e.value.message
    err = ErrorResponse.model_validate(e.value.body())
    assert err.error.type == "invalid_request_error" and err.error.message == e.value.message


def test_gateway_errors_keep_their_status_with_the_anthropic_type():
    from prorl_server.gateway import GatewayError

    cases = {400: "invalid_request_error", 403: "permission_error", 404: "not_found_error",
             409: "invalid_request_error", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}
    for status, kind in cases.items():
        e = from_gateway_error(GatewayError(status, "why", "some_code"))
        assert e.status == status
        assert ErrorResponse.model_validate(e.body()).error.type == kind
        assert e.message == "why (some_code)"


# ------------------------------------------------------------------------------------------ answers


@pytest.mark.parametrize("ans, stops, content, stop_reason, stop_sequence", [
    (answer("Hello."), None, [{"type": "text", "text": "Hello."}], "end_turn", None),
    (answer("Let me look.", [("call_1", "read", {"path": "a.txt"}), ("call_2", "read", {"path": "b"})],
            "tool_calls"), None,
     [{"type": "text", "text": "Let me look."},
      {"type": "tool_use", "id": "call_1", "name": "read", "input": {"path": "a.txt"}},
      {"type": "tool_use", "id": "call_2", "name": "read", "input": {"path": "b"}}], "tool_use", None),
    (answer(None, [("call_1", "read", {"path": "a.txt"})], "tool_calls"), None,
     [{"type": "tool_use", "id": "call_1", "name": "read", "input": {"path": "a.txt"}}], "tool_use", None),
    (answer("Hel", finish="length"), None, [{"type": "text", "text": "Hel"}], "max_tokens", None),
    (answer(""), None, [{"type": "text", "text": ""}], "end_turn", None),
    (answer("1, 2", stop_reason="END"), ["END"], [{"type": "text", "text": "1, 2"}], "stop_sequence", "END"),
    (answer("1, 2", stop_reason=151645), ["END"], [{"type": "text", "text": "1, 2"}], "end_turn", None),
])
def test_answers_become_sdk_messages(ans, stops, content, stop_reason, stop_sequence):
    msg = to_message(ans, stops)
    m = Message.model_validate(msg)
    assert m.id == "msg_abc123" and m.role == "assistant" and m.model == "tiny"
    assert [b.model_dump(exclude_none=True) for b in m.content] == content
    assert (m.stop_reason, m.stop_sequence) == (stop_reason, stop_sequence)
    assert (m.usage.input_tokens, m.usage.output_tokens) == (40, 7)


def test_stream_events_are_in_order_and_typed():
    msg = to_message(answer("Let me look.", [("call_1", "read", {"path": "a.txt"})], "tool_calls"))
    events = stream_events(msg)
    assert [e["type"] for e in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    typed = [EVENTS.validate_python(e) for e in events]
    assert typed[0].message.content == [] and typed[0].message.stop_reason is None
    assert typed[2].delta.type == "text_delta" and typed[2].delta.text == "Let me look."
    assert typed[4].content_block.type == "tool_use" and typed[4].content_block.input == {}
    assert typed[5].delta.type == "input_json_delta" and json.loads(typed[5].delta.partial_json) == {"path": "a.txt"}
    assert [getattr(t, "index", None) for t in typed[1:7]] == [0, 0, 0, 1, 1, 1]
    assert typed[7].delta.stop_reason == "tool_use" and typed[7].usage.output_tokens == 7
    text = sse(events).decode()
    assert text.startswith("event: message_start\ndata: {") and text.endswith("event: message_stop\n"
                                                                             'data: {"type": "message_stop"}\n\n')


@pytest.fixture
async def sdk_over(canned_server):
    """``async (body, content_type) -> AsyncAnthropic``: a real ``anthropic`` SDK client on a loopback server
    that answers every request with ``body`` (what is checked is that the SDK parses what the translation
    produces; the gateway's own route is tested with the SDK further down)."""
    clients = []

    async def make(body: bytes, content_type: str) -> anthropic.AsyncAnthropic:
        url = await canned_server("/v1/messages", body, content_type)
        clients.append(anthropic.AsyncAnthropic(api_key="k", base_url=url, max_retries=0))
        return clients[-1]

    yield make
    for c in clients:
        await c.close()


@pytest.mark.parametrize("ans", [
    answer("Let me look.", [("call_1", "read", {"path": "a.txt", "n": [1, 2]})], "tool_calls"),
    answer(""), answer("Hello.", finish="length")])
async def test_the_sdk_accumulates_the_stream_into_the_same_message(ans, sdk_over):
    msg = to_message(ans)
    sdk = await sdk_over(sse(stream_events(msg)), "text/event-stream")
    async with sdk.messages.stream(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}]) as s:
        final = await s.get_final_message()
    assert final.model_dump(exclude_none=True) == Message.model_validate(msg).model_dump(exclude_none=True)
    sdk = await sdk_over(json.dumps(msg).encode(), "application/json")
    whole = await sdk.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert whole.model_dump(exclude_none=True) == final.model_dump(exclude_none=True)


# ------------------------------------------------------------------------------------------ on a session


def test_a_served_answer_resent_as_anthropic_blocks_is_the_same_history():
    """What the client sends back (the SDK's content blocks as params) normalises to what the gateway
    recorded as served: the session's prefix check sees no divergence."""
    first = to_chat_request({"max_tokens": 64, "tools": [TOOL], "messages": [{"role": "user", "content": "Read a.txt"}]})
    served = answer("Let me look.", [("call_1", "read", {"path": "a.txt"})], "tool_calls")
    history = [normalize_message(m, i) for i, m in enumerate(first.chat["messages"])]
    history.append(normalize_message(served["choices"][0]["message"], len(history)))
    m = Message.model_validate(to_message(served))
    resent = [{"role": "user", "content": "Read a.txt"},
              {"role": m.role, "content": [b.model_dump(exclude_none=True) for b in m.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "hello"}]}]
    second = to_chat_request({"max_tokens": 64, "tools": [TOOL], "messages": resent})
    assert describe_divergence(history, [normalize_message(x, i) for i, x in enumerate(second.chat["messages"])]) is None


def read_then_answer(prompt: str, turn: int) -> str:
    if turn == 0:
        return 'Let me look.\n<tool_call>\n{"name": "read", "arguments": {"path": "a.txt"}}\n</tool_call>'
    return f"It says: {prompt.count('<tool_response>')} response(s) seen."


@pytest.fixture
async def anthropic_session(open_session):
    """``async (client) -> (session_json, AsyncAnthropic)``: a gateway session and a real ``anthropic`` SDK
    client on it (its base URL is the session's ``base_url`` less ``/v1``: the SDK adds ``/v1/messages``)."""
    clients = []

    async def make(client):
        s, _ = await open_session(client)
        sdk = anthropic.AsyncAnthropic(base_url=s["base_url"].removesuffix("/v1"), api_key="not-the-server-token",
                                       max_retries=0, timeout=120)
        clients.append(sdk)
        return s, sdk

    yield make
    for c in clients:
        await c.close()


async def test_a_claude_style_agent_on_the_sdk_is_one_trajectory(gateway_server, anthropic_session, scripted_policy):
    """The real SDK on ``POST {base}/v1/messages`` of a real server (backend: the scripted policy): a tool use,
    its result sent back as Anthropic blocks, the second turn streamed; the session records one trajectory."""
    client, app = await gateway_server([await scripted_policy(read_then_answer)])
    s, sdk = await anthropic_session(client)
    messages = [{"role": "user", "content": "What is in a.txt?"}]
    raw = await sdk.messages.with_raw_response.create(model="m", max_tokens=64, system="You read files.",
                                                      tools=[TOOL], messages=messages)
    assert raw.headers["Server-Timing"].startswith("backend;dur=")
    m1 = await raw.parse()
    assert m1.stop_reason == "tool_use" and m1.content[0].text == "Let me look."
    use = m1.content[1]
    assert (use.type, use.name, use.input) == ("tool_use", "read", {"path": "a.txt"})
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m1.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "hello"}]}]
    async with sdk.messages.stream(model="m", max_tokens=64, system="You read files.", tools=[TOOL],
                                   messages=messages) as stream:
        text = "".join([t async for t in stream.text_stream])
        m2 = await stream.get_final_message()
    assert text == m2.content[0].text == "It says: 1 response(s) seen." and m2.stop_reason == "end_turn"
    assert m2.usage.output_tokens == len(scripted_policy.returned[1][0])
    result = await (await client.post(f"/sessions/{s['session_id']}/finalize", headers=AUTH)).json()
    assert result["split_reasons"] == [] and len(result["trajectories"]) == 1
    assert result["counters"]["requests"] == 2


async def test_errors_on_the_route_are_in_the_anthropic_format(gateway_server, anthropic_session, scripted_policy):
    client, app = await gateway_server([await scripted_policy(lambda p, t: "ok")])
    s, sdk = await anthropic_session(client)
    hi = [{"role": "user", "content": "hi"}]
    cases = [  # (SDK error, status, kwargs, words of the message)
        (anthropic.BadRequestError, 400, dict(messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]),
         "image blocks are not supported"),
        (anthropic.BadRequestError, 400, dict(messages=hi, stop_sequences=["a", "b", "c", "d", "e"]),
         "stop must be a string or a list of up to 4 strings"),  # the gateway's own check, converted
    ]
    for kind, status, kw, words in cases:
        with pytest.raises(kind) as e:
            await sdk.messages.create(model="m", max_tokens=8, **kw)
        err = ErrorResponse.model_validate(e.value.body)
        assert e.value.status_code == status and err.error.type == "invalid_request_error"
        assert words in err.error.message, err.error.message
    other = anthropic.AsyncAnthropic(base_url=s["base_url"].removesuffix("/v1").rsplit(".", 1)[0] + ".wrong-key",
                                     api_key="k", max_retries=0)
    with pytest.raises(anthropic.PermissionDeniedError) as e:
        await other.messages.create(model="m", max_tokens=8, messages=hi)
    await other.close()
    assert ErrorResponse.model_validate(e.value.body).error.type == "permission_error"
    await sdk.messages.create(model="m", max_tokens=8, messages=hi)
    await client.post(f"/sessions/{s['session_id']}/finalize", headers=AUTH)
    with pytest.raises(anthropic.ConflictError) as e:
        await sdk.messages.create(model="m", max_tokens=8, messages=hi + [
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}])
    assert ErrorResponse.model_validate(e.value.body).error.type == "invalid_request_error"


@pytest.mark.real
async def test_on_vllm_the_messages_route_records_exactly_vllms_tokens(
        one_trajectory_of_vllms_tokens, echo_every_turn, tap_llm, gateway_server, anthropic_session, vllm_server,
        tokenizer):
    """Three tool-use turns of the real SDK against a real vLLM CPU server: one trajectory of exactly vLLM's
    tokens, and the first prompt is the model's chat template over the translated messages (the same
    rendering as the Chat Completions route)."""
    client, app = await gateway_server([vllm_server.address])
    gw = app[GATEWAY]
    echo_every_turn(gw)
    calls = tap_llm(gw)
    s, sdk = await anthropic_session(client)
    echo = {"name": "echo", "description": "Echo text back.",
            "input_schema": {"type": "object", "properties": {"text": {"type": "string"}}}}
    messages = [{"role": "user", "content": "Echo things."}]
    for turn in range(3):
        m = await sdk.messages.create(model="any", max_tokens=10, system="You are a test agent.", tools=[echo],
                                      messages=messages)
        assert m.stop_reason == "tool_use"
        assert (m.usage.input_tokens, m.usage.output_tokens) == (len(calls[-1][0]), len(calls[-1][1].token_ids))
        use = next(b for b in m.content if b.type == "tool_use")
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": f"echo #{turn}: {use.input['text']}"}]}]
    result = await (await client.post(f"/sessions/{s['session_id']}/finalize", headers=AUTH)).json()
    traj = one_trajectory_of_vllms_tokens(result, calls)
    first = tokenizer.apply_chat_template(
        [{"role": "system", "content": "You are a test agent."}, {"role": "user", "content": "Echo things."}],
        tools=[{"type": "function", "function": {"name": "echo", "description": "Echo text back.",
                                                 "parameters": echo["input_schema"]}}],
        tokenize=False, add_generation_prompt=True)
    assert traj.prompt_ids == calls[0][0] == tokenizer.encode(first, add_special_tokens=False)
    assert "echo #1: " in tokenizer.decode(traj.response_ids)
