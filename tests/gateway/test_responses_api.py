"""The OpenAI Responses API on gateway sessions (prorl_server.gateway.responses, ``POST {base_url}/responses``):
every input item type becomes the Chat Completions body the gateway accepts, answers become
``openai.types.responses.Response`` objects the real SDK reads (whole and streamed, event order and sequence
numbers checked), bad input (stored state such as ``previous_response_id`` included) gets OpenAI-format 400s,
and a multi-turn function-calling conversation of the real SDK on a real server stays one trajectory."""
from __future__ import annotations

import json

import openai
import pytest
from openai.types.responses import Response, ResponseInputParam, ResponseStreamEvent
from openai.types.shared import ErrorObject
from pydantic import TypeAdapter

from prorl_server.gateway import GATEWAY, GatewayError, describe_divergence, normalize_message, parse_chat_request
from prorl_server.gateway.responses import sse, stream_events, to_chat_request, to_response
from prorl_server.gateway.protocol import answer_choice, assistant_message, chat_completion
from prorl_server.llm.tool_parser import ParsedTurn, ToolCall

AUTH = {"Authorization": "Bearer server-secret"}
EVENTS = TypeAdapter(ResponseStreamEvent)
TOOL = {"type": "function", "name": "read", "description": "Read a file.", "strict": False,
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}


def answer(content, calls=(), finish="stop"):
    """A ``chat.completion`` as Gateway.chat answers it (the gateway's own builders), with a fixed id."""
    tool_calls = [ToolCall(name, args, call_id) for call_id, name, args in calls]
    msg, finish = assistant_message(content, ParsedTurn(content=content, calls=tool_calls) if calls else None,
                                    finish)
    out = chat_completion([answer_choice(0, msg, finish)], model="tiny", prompt_tokens=40, completion_tokens=7)
    out["id"] = "chatcmpl-abc123"
    return out


# ------------------------------------------------------------------------------------------ requests


def test_every_item_type_becomes_the_chat_body_the_gateway_accepts():
    items: ResponseInputParam = [
        {"role": "developer", "content": "Use the tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<env/>"},
                                                        {"type": "input_text", "text": "Read a.txt"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "read", "arguments": '{"path": "a.txt"}'},
        {"type": "function_call", "call_id": "call_2", "name": "read", "arguments": '{"path": "b.txt"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "hello"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "no such "}, {"type": "input_text", "text": "file"}]},
        {"type": "function_call", "call_id": "call_3", "name": "read", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_3", "output": "?"},
        {"role": "user", "content": "Summarise."},
    ]
    body = {"model": "gpt-anything", "instructions": "You read files.", "input": items, "tools": [TOOL],
            "tool_choice": "auto", "max_output_tokens": 256, "temperature": 0.5, "top_p": 0.9,
            "parallel_tool_calls": False, "store": False, "include": ["reasoning.encrypted_content"],
            "reasoning": {"effort": "low", "summary": "auto"}, "prompt_cache_key": "k", "metadata": {"run": "1"},
            "text": {"format": {"type": "text"}, "verbosity": "low"}, "truncation": "disabled"}
    req = to_chat_request(body)
    assert req.stream is False
    assert req.chat == {
        "messages": [
            {"role": "system", "content": "You read files."},
            {"role": "developer", "content": "Use the tools."},
            {"role": "user", "content": "<env/>Read a.txt"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.txt"}'}},
                {"id": "call_2", "type": "function", "function": {"name": "read", "arguments": '{"path": "b.txt"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "hello"},
            {"role": "tool", "tool_call_id": "call_2", "content": "no such file"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_3", "type": "function", "function": {"name": "read", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_3", "content": "?"},
            {"role": "user", "content": "Summarise."}],
        "max_tokens": 256, "temperature": 0.5, "top_p": 0.9, "parallel_tool_calls": False,
        "tools": [{"type": "function", "function": {"name": "read", "description": "Read a file.",
                                                    "parameters": TOOL["parameters"]}}],
        "tool_choice": "auto"}
    parsed = parse_chat_request(req.chat)  # the gateway's own validation accepts it as it is
    assert [m["role"] for m in parsed.messages] == ["system", "system", "user", "assistant", "tool", "tool",
                                                    "assistant", "tool", "user"]
    assert parsed.max_tokens == 256 and parsed.parse_tools
    assert req.echo["metadata"] == {"run": "1"} and req.echo["parallel_tool_calls"] is False


def test_a_string_input_is_one_user_message():
    req = to_chat_request({"model": "m", "input": "hi", "stream": True})
    assert req.stream is True and req.chat == {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("choice, expected", [
    ("auto", "auto"), ("none", "none"), ("required", "required"),
    ({"type": "function", "name": "read"}, {"type": "function", "function": {"name": "read"}})])
def test_tool_choice_maps_to_its_chat_completions_form(choice, expected):
    assert to_chat_request({"input": "hi", "tools": [TOOL], "tool_choice": choice}).chat["tool_choice"] == expected


@pytest.mark.parametrize("fmt, expected", [
    ({"type": "json_schema", "name": "answer", "strict": True, "schema": {"type": "object"}},
     {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}, "strict": True}}),
    ({"type": "json_object"}, {"type": "json_object"})])
def test_text_format_becomes_response_format(fmt, expected):
    assert to_chat_request({"input": "hi", "text": {"format": fmt}}).chat["response_format"] == expected


@pytest.mark.parametrize("body, code, param, says", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "unsupported_parameter", "previous_response_id",
     "send the whole conversation in input"),
    ({"input": "hi", "conversation": "conv_1"}, "unsupported_parameter", "conversation", "stores no conversations"),
    ({"input": "hi", "prompt": {"id": "pmpt_1"}}, "unsupported_parameter", "prompt", "stored prompt"),
    ({"input": "hi", "background": True}, "unsupported_parameter", "background", "background responses"),
    ({"input": "hi", "modalities": ["text"]}, "unsupported_parameter", "modalities", "unsupported parameter"),
    ({"instructions": "x"}, "invalid_input", "input", "input: is required"),
    ({"input": "hi", "instructions": [{"type": "input_text", "text": "x"}]}, "invalid_parameter", "instructions",
     "must be a string"),
    ({"input": []}, "invalid_input", "input", "non-empty list"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
     "invalid_input", "input[0].content[0]", "text-only model"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "invalid_input", "input[0]", "stores no items"),
    ({"input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]}, "invalid_input",
     "input[0].type", "'web_search_call' are not supported"),
    ({"input": [{"role": "tool", "content": "x"}]}, "invalid_input", "input[0].role", "must be user"),
    ({"input": [{"type": "function_call", "name": "read", "arguments": {}}]}, "invalid_input", "input[0]",
     "needs call_id, name and arguments"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "invalid_input", "input[0].call_id", "non-empty"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "invalid_parameter", "tools[0]", "only function tools"),
    ({"input": "hi", "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "invalid_parameter",
     "tool_choice", "must be"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}}, "invalid_parameter",
     "text.format", "needs name"),
    ("hi", "invalid_request", None, "JSON object"),
])
def test_bad_requests_are_openai_format_400s(body, code, param, says):
    with pytest.raises(GatewayError) as e:
        to_chat_request(body)
    err = ErrorObject.model_validate({"message": e.value.message, "type": e.value.type, "param": e.value.param,
                                      "code": e.value.code})
    assert e.value.status == 400 and (err.code, err.param, err.type) == (code, param, "invalid_request_error")
    assert says in err.message, err.message


# ------------------------------------------------------------------------------------------ answers


@pytest.mark.parametrize("ans, kinds, text, status", [
    (answer("Hello."), ["message"], "Hello.", "completed"),
    (answer("Let me look.", [("call_1", "read", {"path": "a.txt"}), ("call_2", "read", {"path": "b"})],
            "tool_calls"), ["message", "function_call", "function_call"], "Let me look.", "completed"),
    (answer(None, [("call_1", "read", {"path": "a.txt"})], "tool_calls"), ["function_call"], "", "completed"),
    (answer("Hel", finish="length"), ["message"], "Hel", "incomplete"),
    (answer(""), ["message"], "", "completed"),
])
def test_answers_become_sdk_responses(ans, kinds, text, status):
    echo = to_chat_request({"input": "hi", "tools": [TOOL], "temperature": 0.5, "max_output_tokens": 64}).echo
    r = Response.model_validate(to_response(ans, echo))
    assert r.id == "resp_abc123" and r.object == "response" and r.model == "tiny"
    assert [o.type for o in r.output] == kinds and r.output_text == text and r.status == status
    assert r.incomplete_details == (None if status == "completed" else
                                    type(r.incomplete_details)(reason="max_output_tokens"))
    calls = [(o.call_id, o.name, json.loads(o.arguments)) for o in r.output if o.type == "function_call"]
    assert calls == [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
                     for c in ans["choices"][0]["message"].get("tool_calls", [])]
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (40, 7, 47)
    assert r.temperature == 0.5 and r.max_output_tokens == 64 and [t.name for t in r.tools] == ["read"]
    assert r.tool_choice == "auto" and r.parallel_tool_calls is True


def test_stream_events_are_in_order_and_typed():
    resp = to_response(answer("Let me look.", [("call_1", "read", {"path": "a.txt"})], "tool_calls"))
    events = stream_events(resp)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    typed = [EVENTS.validate_python(e) for e in events]
    assert [t.sequence_number for t in typed] == list(range(len(events)))
    assert typed[0].response.status == "in_progress" and typed[0].response.output == []
    assert typed[4].delta == "Let me look." and typed[4].item_id == resp["output"][0]["id"]
    assert typed[8].output_index == 1 and typed[8].item.arguments == ""
    assert json.loads(typed[10].arguments) == {"path": "a.txt"}
    assert typed[-1].response.model_dump() == Response.model_validate(resp).model_dump()
    incomplete = stream_events(to_response(answer("Hel", finish="length")))
    assert incomplete[-1]["type"] == "response.incomplete"
    assert sse(events).decode().startswith("event: response.created\ndata: {")


@pytest.fixture
async def sdk_over(canned_server):
    """``async (body, content_type) -> AsyncOpenAI``: a real ``openai`` SDK client on a loopback server that
    answers every request with ``body`` (what is checked is that the SDK parses what the translation
    produces)."""
    clients = []

    async def make(body: bytes, content_type: str) -> openai.AsyncOpenAI:
        url = await canned_server("/v1/responses", body, content_type)
        clients.append(openai.AsyncOpenAI(api_key="k", base_url=url.rstrip("/") + "/v1", max_retries=0))
        return clients[-1]

    yield make
    for c in clients:
        await c.close()


@pytest.mark.parametrize("ans", [
    answer("Let me look.", [("call_1", "read", {"path": "a.txt", "n": [1, 2]})], "tool_calls"),
    answer(""), answer("Hello.", finish="length")])
async def test_the_sdk_reads_the_stream_as_the_same_response(ans, sdk_over):
    """The SDK's stream helper accumulates the events; like OpenAI, an incomplete turn ends with
    ``response.incomplete`` (the helper's ``get_final_response`` is for completed ones)."""
    resp = to_response(ans)
    expected = Response.model_validate(resp).model_dump(exclude_none=True)
    sdk = await sdk_over(sse(stream_events(resp)), "text/event-stream")
    async with sdk.responses.stream(model="m", input="hi") as s:
        seen = [e async for e in s]
        if resp["status"] == "completed":
            assert (await s.get_final_response()).model_dump(exclude_none=True)["output"] == expected["output"]
    assert seen[0].type == "response.created"
    assert seen[-1].type == ("response.completed" if resp["status"] == "completed" else "response.incomplete")
    assert seen[-1].response.model_dump(exclude_none=True) == expected
    sdk = await sdk_over(json.dumps(resp).encode(), "application/json")
    whole = await sdk.responses.create(model="m", input="hi")
    assert whole.model_dump(exclude_none=True) == expected


# ------------------------------------------------------------------------------------------ on a session


def test_a_served_answer_resent_as_items_is_the_same_history():
    """What the client sends back (the output items, as Codex-style harnesses keep them) normalises to what
    the gateway recorded as served: the session's prefix check sees no divergence."""
    first = to_chat_request({"instructions": "You read files.", "input": "Read a.txt", "tools": [TOOL]})
    served = answer("Let me look.", [("call_1", "read", {"path": "a.txt"})], "tool_calls")
    history = [normalize_message(m, i) for i, m in enumerate(first.chat["messages"])]
    history.append(normalize_message(served["choices"][0]["message"], len(history)))
    r = Response.model_validate(to_response(served))
    items = [{"role": "user", "content": "Read a.txt"}, *[o.model_dump(exclude_none=True) for o in r.output],
             {"type": "function_call_output", "call_id": "call_1", "output": "hello"}]
    second = to_chat_request({"instructions": "You read files.", "input": items, "tools": [TOOL]})
    assert describe_divergence(history, [normalize_message(x, i) for i, x in enumerate(second.chat["messages"])]) is None


def read_then_answer(prompt: str, turn: int) -> str:
    if turn == 0:
        return 'Let me look.\n<tool_call>\n{"name": "read", "arguments": {"path": "a.txt"}}\n</tool_call>'
    return f"It says: {prompt.count('<tool_response>')} response(s) seen."


async def test_a_codex_style_agent_on_the_sdk_is_one_trajectory(gateway_server, open_session, scripted_policy):
    """The real SDK's ``responses.create`` on ``POST {base_url}/responses`` of a real server (backend: the
    scripted policy), ``store=False`` and the whole conversation as items each turn, the second turn streamed;
    the session records one trajectory."""
    client, app = await gateway_server([await scripted_policy(read_then_answer)])
    s, sdk = await open_session(client)
    items = [{"role": "user", "content": "What is in a.txt?"}]
    raw = await sdk.responses.with_raw_response.create(model="m", instructions="You read files.", tools=[TOOL],
                                                       input=items, store=False)
    assert raw.headers["Server-Timing"].startswith("backend;dur=")
    r1 = raw.parse()
    assert [o.type for o in r1.output] == ["message", "function_call"] and r1.output_text == "Let me look."
    call = r1.output[1]
    assert (call.name, json.loads(call.arguments)) == ("read", {"path": "a.txt"})
    items += [o.model_dump(exclude_none=True) for o in r1.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "hello"})
    events = [e async for e in await sdk.responses.create(model="m", instructions="You read files.", tools=[TOOL],
                                                          input=items, store=False, stream=True)]
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    r2 = events[-1].response
    assert r2.status == "completed" and r2.output_text == "It says: 1 response(s) seen."
    assert r2.usage.output_tokens == len(scripted_policy.returned[1][0])
    result = await (await client.post(f"/sessions/{s['session_id']}/finalize", headers=AUTH)).json()
    assert result["split_reasons"] == [] and len(result["trajectories"]) == 1
    assert result["counters"]["requests"] == 2


async def test_errors_on_the_route_are_in_the_openai_format(gateway_server, open_session, scripted_policy):
    client, app = await gateway_server([await scripted_policy(lambda p, t: "ok")])
    s, sdk = await open_session(client)
    cases = [  # (kwargs, code, param)
        (dict(input="hi", previous_response_id="resp_1"), "unsupported_parameter", "previous_response_id"),
        (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]),
         "invalid_input", "input[0].content[0]"),
        (dict(input="hi", temperature="hot"), "invalid_parameter", "temperature"),  # the gateway's own check
    ]
    for kw, code, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            await sdk.responses.create(model="m", **kw)
        assert (e.value.code, e.value.param) == (code, param), e.value.body
    wrong = openai.AsyncOpenAI(base_url=s["base_url"].replace(s["api_key"], "wrong-key"), api_key="k", max_retries=0)
    with pytest.raises(openai.PermissionDeniedError):
        await wrong.responses.create(model="m", input="hi")
    await wrong.close()


@pytest.mark.real
async def test_on_vllm_the_responses_route_records_exactly_vllms_tokens(
        one_trajectory_of_vllms_tokens, echo_every_turn, tap_llm, gateway_server, open_session, vllm_server,
        tokenizer):
    """Three function-calling turns of the real SDK (``store=False``, whole conversation as items) against a
    real vLLM CPU server: one trajectory of exactly vLLM's tokens, and the first prompt is the model's chat
    template over the translated messages (the same rendering as the Chat Completions route)."""
    client, app = await gateway_server([vllm_server.address])
    gw = app[GATEWAY]
    echo_every_turn(gw)
    calls = tap_llm(gw)
    s, sdk = await open_session(client)
    echo = {"type": "function", "name": "echo", "description": "Echo text back.",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}
    items = [{"role": "user", "content": "Echo things."}]
    for turn in range(3):
        r = await sdk.responses.create(model="any", instructions="You are a test agent.", tools=[echo], input=items,
                                       max_output_tokens=10, temperature=1.0, store=False)
        assert r.output[-1].type == "function_call"
        assert (r.usage.input_tokens, r.usage.output_tokens) == (len(calls[-1][0]), len(calls[-1][1].token_ids))
        call = r.output[-1]
        items += [o.model_dump(exclude_none=True) for o in r.output]
        items.append({"type": "function_call_output", "call_id": call.call_id,
                      "output": f"echo #{turn}: {json.loads(call.arguments)['text']}"})
    result = await (await client.post(f"/sessions/{s['session_id']}/finalize", headers=AUTH)).json()
    traj = one_trajectory_of_vllms_tokens(result, calls)
    first = tokenizer.apply_chat_template(
        [{"role": "system", "content": "You are a test agent."}, {"role": "user", "content": "Echo things."}],
        tools=[{"type": "function", "function": {"name": "echo", "description": "Echo text back.",
                                                 "parameters": echo["parameters"]}}],
        tokenize=False, add_generation_prompt=True)
    assert traj.prompt_ids == calls[0][0] == tokenizer.encode(first, add_special_tokens=False)
    assert "echo #1: " in tokenizer.decode(traj.response_ids)
