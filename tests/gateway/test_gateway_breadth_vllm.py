"""The gateway's constrained and multi-choice answers on a real vLLM CPU server (the tiny random model, whose
free text is noise): a forced tool call (OpenAI ``tool_choice``, Anthropic ``tool_choice: any``, Responses
``tool_choice: required``) is generated in the hermes format by vLLM's structured outputs and parsed by the
real hermes parser, a ``json_schema`` response format (Chat ``response_format``, Anthropic
``output_config.format``, Responses ``text.format``) gives JSON that validates against the schema, ``n=2``
gives two recorded trajectories of exactly vLLM's tokens; every tool round trip is one trajectory of exactly
vLLM's tokens."""
from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest

from prorl_server.gateway import GATEWAY
from prorl_server.types import Trajectory

AUTH = {"Authorization": "Bearer server-secret"}
pytestmark = pytest.mark.real

SYSTEM = {"role": "system", "content": "You are a test agent."}
#: Bounded arguments and answers: the random model's strings would run to max_tokens.
PARAMS = {"type": "object", "properties": {"mode": {"enum": ["fast", "slow"]}, "count": {"type": "integer",
                                                                                      "minimum": 0, "maximum": 9}},
          "required": ["mode", "count"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "run", "description": "Run something.", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "stop", "description": "Stop.",
                                           "parameters": {"type": "object", "properties": {},
                                                          "additionalProperties": False}}}]
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer",
                                                                                     "minimum": 0, "maximum": 5}},
          "required": ["answer", "score"], "additionalProperties": False}


async def finalize(client, session_id):
    r = await client.post(f"/sessions/{session_id}/finalize", headers=AUTH)
    assert r.status == 200, await r.text()
    return await r.json()


def assert_tokens_are_vllms(traj: Trajectory, calls) -> None:
    """The trajectory is the first call's prompt, then each call's generated tokens (loss-masked, with vLLM's
    logprobs) at the position where the next call's prompt has them."""
    ids = traj.prompt_ids + traj.response_ids
    assert traj.prompt_ids == calls[0][0]
    pos, spans = len(traj.prompt_ids), []
    for prompt, comp in calls:
        assert ids[:len(prompt)] == prompt
        start = len(prompt)
        assert ids[start:start + len(comp.token_ids)] == comp.token_ids
        spans.append((start - len(traj.prompt_ids), comp))
        pos = start + len(comp.token_ids)
    assert pos == len(ids)
    for off, comp in spans:
        assert traj.loss_mask[off:off + len(comp.token_ids)] == [1] * len(comp.token_ids)
        assert traj.response_logprobs[off:off + len(comp.token_ids)] == comp.logprobs
    assert sum(traj.loss_mask) == sum(len(c.token_ids) for _, c in calls)


async def test_openai_tool_choice_required_is_a_parsed_call_and_the_round_trip_one_trajectory(
        tap_llm, gateway_server, open_session, vllm_server):
    client, app = await gateway_server([vllm_server.address])
    calls = tap_llm(app[GATEWAY])
    s, sdk = await open_session(client)
    messages = [SYSTEM, {"role": "user", "content": "Run it."}]
    r = await sdk.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="required",
                                          max_tokens=400, seed=0)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls", msg
    call = msg.tool_calls[0]
    assert call.function.name in ("run", "stop")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, PARAMS if call.function.name == "run" else TOOLS[1]["function"]["parameters"])
    messages += [msg, {"role": "tool", "tool_call_id": call.id, "content": "done"}]
    named = {"type": "function", "function": {"name": "run"}}
    r = await sdk.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice=named,
                                          max_tokens=400, seed=1)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "run"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS)
    result = await finalize(client, s["session_id"])
    assert len(result["trajectories"]) == 1 and result["split_reasons"] == []
    assert_tokens_are_vllms(Trajectory(**result["trajectories"][0]), calls)


async def test_openai_json_schema_response_format_validates(tap_llm, gateway_server, open_session, vllm_server):
    client, app = await gateway_server([vllm_server.address])
    calls = tap_llm(app[GATEWAY])
    s, sdk = await open_session(client)
    for seed in range(3):
        r = await sdk.chat.completions.create(
            model="m", messages=[SYSTEM, {"role": "user", "content": f"Answer #{seed}."}], max_tokens=400,
            seed=seed, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    # (json_object is not tried here: any object allows strings without end, which the random model writes)
    result = await finalize(client, s["session_id"])
    assert len(calls) == 3 and len(result["trajectories"]) == 3  # three unrelated prompts: three splits


async def test_n_2_is_two_recorded_trajectories_of_exactly_vllms_tokens(tap_llm, gateway_server, open_session,
                                                                       vllm_server):
    client, app = await gateway_server([vllm_server.address])
    calls = tap_llm(app[GATEWAY])
    s, sdk = await open_session(client)
    messages = [SYSTEM, {"role": "user", "content": "Say things."}]
    r = await sdk.chat.completions.create(model="m", messages=messages, n=2, max_tokens=12, temperature=1.0,
                                          seed=3, logprobs=True, top_logprobs=2)
    assert len(r.choices) == 2 and len(calls) == 2 and calls[0][0] == calls[1][0]
    assert r.choices[0].message.content != r.choices[1].message.content  # seeds 3 and 4
    for choice, (_, comp) in zip(r.choices, calls):
        assert [c.logprob for c in choice.logprobs.content] == pytest.approx(comp.logprobs)
        assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
                   for c in choice.logprobs.content)
    # the agent continues with choice 1 for one more turn
    messages += [r.choices[1].message, {"role": "user", "content": "More."}]
    await sdk.chat.completions.create(model="m", messages=messages, max_tokens=6, seed=9)
    result = await finalize(client, s["session_id"])
    branch, main = (Trajectory(**t) for t in result["trajectories"])
    assert branch.split_reason.startswith("branch: choice 0 of 2")
    assert_tokens_are_vllms(branch, calls[:1])
    assert_tokens_are_vllms(main, [calls[1], calls[2]])


async def test_anthropic_forced_tool_use_round_trip_and_structured_output(tap_llm, gateway_server, open_session,
                                                                          vllm_server):
    client, app = await gateway_server([vllm_server.address])
    calls = tap_llm(app[GATEWAY])
    s, _ = await open_session(client)
    tool = {"name": "run", "description": "Run something.", "input_schema": PARAMS}
    async with anthropic.AsyncAnthropic(base_url=s["base_url"].removesuffix("/v1"), api_key="x",
                                        max_retries=0, timeout=120) as claude:
        messages = [{"role": "user", "content": "Run it."}]
        m = await claude.messages.create(model="m", max_tokens=400, system="You are a test agent.", tools=[tool],
                                         tool_choice={"type": "any"}, messages=messages)
        assert m.stop_reason == "tool_use"
        use = next(b for b in m.content if b.type == "tool_use")
        assert use.name == "run"
        jsonschema.validate(use.input, PARAMS)
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "ok"}]}]
        m = await claude.messages.create(
            model="m", max_tokens=400, system="You are a test agent.", tools=[tool], messages=messages,
            extra_body={"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}})
        assert m.stop_reason == "end_turn"
        jsonschema.validate(json.loads(m.content[0].text), SCHEMA)
    result = await finalize(client, s["session_id"])
    assert len(result["trajectories"]) == 1
    assert_tokens_are_vllms(Trajectory(**result["trajectories"][0]), calls)


async def test_responses_forced_function_call_round_trip_and_structured_output(tap_llm, gateway_server,
                                                                               open_session, vllm_server):
    client, app = await gateway_server([vllm_server.address])
    calls = tap_llm(app[GATEWAY])
    s, sdk = await open_session(client)
    run = {"type": "function", "name": "run", "description": "Run something.", "parameters": PARAMS}
    items = [{"role": "user", "content": "Run it."}]
    r = await sdk.responses.create(model="m", instructions="You are a test agent.", tools=[run], input=items,
                                   tool_choice="required", max_output_tokens=400, store=False)
    call = r.output[-1]
    assert call.type == "function_call" and call.name == "run"
    jsonschema.validate(json.loads(call.arguments), PARAMS)
    items += [o.model_dump(exclude_none=True) for o in r.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "ok"})
    r = await sdk.responses.create(model="m", instructions="You are a test agent.", tools=[run], input=items,
                                   max_output_tokens=400, store=False,
                                   text={"format": {"type": "json_schema", "name": "a", "schema": SCHEMA}})
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    result = await finalize(client, s["session_id"])
    assert len(result["trajectories"]) == 1
    assert_tokens_are_vllms(Trajectory(**result["trajectories"][0]), calls)


async def test_a_stop_string_is_vllms_stop_reason_and_the_anthropic_stop_sequence(tap_llm, gateway_server,
                                                                                   open_session, vllm_server):
    client, app = await gateway_server([vllm_server.address])
    calls = tap_llm(app[GATEWAY])
    s, sdk = await open_session(client)
    raw = await sdk.chat.completions.with_raw_response.create(
        model="m", messages=[SYSTEM, {"role": "user", "content": "Spell."}], max_tokens=300, seed=0, stop=["e"])
    choice = json.loads(raw.text)["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "e") == \
        (calls[-1][1].finish_reason, calls[-1][1].stop_reason)
    s2, _ = await open_session(client)
    async with anthropic.AsyncAnthropic(base_url=s2["base_url"].removesuffix("/v1"), api_key="x",
                                        max_retries=0, timeout=120) as claude:
        m = await claude.messages.create(model="m", max_tokens=300, stop_sequences=["e"],
                                         messages=[{"role": "user", "content": "Spell."}])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "e")
