"""A real ``openai`` SDK client as the black-box agent, against the gateway and a real vLLM CPU server with the
tiny model: the recorded trajectory holds exactly the tokens vLLM generated, every turn's prompt is a prefix
of it, and an agent that compresses its history gets two such trajectories with the split reason."""
from __future__ import annotations

import json

import pytest

from prorl_server.gateway import GATEWAY
from prorl_server.types import Trajectory

AUTH = {"Authorization": "Bearer server-secret"}
pytestmark = pytest.mark.real

SYSTEM = {"role": "system", "content": "You are a test agent."}
TOOLS = [{"type": "function", "function": {"name": "echo", "description": "Echo text back.",
                                           "parameters": {"type": "object",
                                                          "properties": {"text": {"type": "string"}}}}}]


def generated_spans(traj: Trajectory) -> list[tuple[int, list[int]]]:
    """(offset in prompt+response where the span starts, token ids) of each run of loss_mask == 1."""
    out, start, cur = [], None, []
    p = len(traj.prompt_ids)
    for i, (t, m) in enumerate(zip(traj.response_ids, traj.loss_mask)):
        if m:
            if not cur:
                start = p + i
            cur.append(t)
        elif cur:
            out.append((start, cur))
            cur = []
    if cur:
        out.append((start, cur))
    return out


def assert_trajectory_is_what_vllm_saw_and_generated(traj: Trajectory, calls):
    """Each recorded call's generated tokens are one loss-masked span, in order, with vLLM's logprobs, and the
    prompt vLLM got for it is exactly the trajectory's tokens before that span."""
    ids = traj.prompt_ids + traj.response_ids
    spans = generated_spans(traj)
    assert [s for _, s in spans] == [c.token_ids for _, c in calls]
    assert [lp for lp, m in zip(traj.response_logprobs, traj.loss_mask) if m] == \
        [lp for _, c in calls for lp in c.logprobs]
    assert all(lp == 0.0 for lp, m in zip(traj.response_logprobs, traj.loss_mask) if not m)
    for (start, _), (prompt, _) in zip(spans, calls):
        assert prompt == ids[:start]
    assert len(traj.response_ids) == len(traj.loss_mask) == len(traj.response_logprobs)


async def finalize(client, session_id):
    r = await client.post(f"/sessions/{session_id}/finalize", headers=AUTH)
    assert r.status == 200, await r.text()
    return await r.json()


async def test_tool_using_sdk_agent_yields_one_trajectory_of_exactly_vllms_tokens(echo_every_turn, tap_llm,
        gateway_server, open_session, vllm_server, tokenizer):
    client, app = await gateway_server([vllm_server.address])
    gw = app[GATEWAY]
    echo_every_turn(gw)
    calls = tap_llm(gw)
    s, sdk = await open_session(client)
    messages = [SYSTEM, {"role": "user", "content": "Echo things."}]
    observations = []
    for turn in range(4):
        r = await sdk.chat.completions.create(model="any", messages=messages, tools=TOOLS, max_tokens=10,
                                              temperature=1.0, seed=turn)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls[0].function.name == "echo"
        assert r.usage.completion_tokens == len(calls[-1][1].token_ids)
        assert r.usage.prompt_tokens == len(calls[-1][0])
        messages.append(msg)  # the SDK's own message object, as agents do
        obs = f"echo #{turn}: " + json.loads(msg.tool_calls[0].function.arguments)["text"]
        observations.append(obs)
        messages.append({"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": obs})
    models = await sdk.models.list()
    assert [m.id for m in models.data] == [r.model] and r.model.endswith("tiny-model")

    result = await finalize(client, s["session_id"])
    assert len(result["trajectories"]) == 1 and result["split_reasons"] == []
    traj = Trajectory(**result["trajectories"][0])
    assert traj.num_turns == 4 and traj.split_reason is None
    assert len(calls) == 4
    assert_trajectory_is_what_vllm_saw_and_generated(traj, calls)
    first = tokenizer.apply_chat_template(messages[:2], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert traj.prompt_ids == tokenizer.encode(first, add_special_tokens=False)
    text = tokenizer.decode(traj.prompt_ids + traj.response_ids)
    for obs in observations[:-1]:  # the last observation was never sent with a request
        assert f"<tool_response>\n{obs}\n</tool_response>" in text
    # finalize is idempotent; the session no longer answers its agent
    assert (await finalize(client, s["session_id"]))["trajectories"] == result["trajectories"]
    import openai

    with pytest.raises(openai.ConflictError):
        await sdk.chat.completions.create(model="any", messages=messages, tools=TOOLS, max_tokens=4)


async def test_history_compression_yields_two_prefix_consistent_trajectories_with_the_split_reason(tap_llm,
        gateway_server, open_session, vllm_server, tokenizer):
    client, app = await gateway_server([vllm_server.address])
    calls = tap_llm(app[GATEWAY])
    s, sdk = await open_session(client)
    task = {"role": "user", "content": "Count to three."}
    messages = [SYSTEM, task]
    for turn in range(3):
        r = await sdk.chat.completions.create(model="any", messages=messages, max_tokens=8, temperature=1.0,
                                              seed=10 + turn)
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": f"Go on ({turn})."}]
    # the agent compresses: earlier turns replaced by a summary
    compressed = [SYSTEM, task, {"role": "user", "content": "Summary: three turns so far. Go on."}]
    r = await sdk.chat.completions.create(model="any", messages=compressed, max_tokens=8, temperature=1.0, seed=20)
    compressed += [{"role": "assistant", "content": r.choices[0].message.content},
                   {"role": "user", "content": "Once more."}]
    await sdk.chat.completions.create(model="any", messages=compressed, max_tokens=8, temperature=1.0, seed=21)

    status = await (await client.get(f"/sessions/{s['session_id']}", headers=AUTH)).json()
    assert status["state"] == "open" and len(status["split_reasons"]) == 1
    result = await finalize(client, s["session_id"])
    first, second = (Trajectory(**t) for t in result["trajectories"])
    assert first.finish_reason == "split" and second.split_reason is None
    assert first.split_reason.startswith("message_changed: message 2 was assistant, now user")
    assert (first.num_turns, second.num_turns) == (3, 2)
    assert_trajectory_is_what_vllm_saw_and_generated(first, calls[:3])
    assert_trajectory_is_what_vllm_saw_and_generated(second, calls[3:])
    rendered = tokenizer.apply_chat_template(compressed[:3], tokenize=False, add_generation_prompt=True)
    assert second.prompt_ids == tokenizer.encode(rendered, add_special_tokens=False)
