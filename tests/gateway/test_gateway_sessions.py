"""Gateway sessions without vLLM: hermes tool calls round-trip through a real ``openai`` SDK client without a
split, whitespace in a resent message is a divergence, and every bad input gets a clear OpenAI-format 4xx
(unknown / finished / aborted session, malformed messages, unsupported parameters, another session's key,
the server token required for management, session limits, idle expiry)."""
from __future__ import annotations

import json
import time

import openai
import pytest
from yarl import URL

from prorl_server.gateway import GATEWAY
from prorl_server.types import Trajectory

AUTH = {"Authorization": "Bearer server-secret"}
TOOLS = [{"type": "function", "function": {"name": "read", "description": "Read a file.",
                                           "parameters": {"type": "object",
                                                          "properties": {"path": {"type": "string"}}}}}]
START = [{"role": "system", "content": "You read files."}, {"role": "user", "content": "What is in a.txt?"}]


def read_then_answer(prompt: str, turn: int) -> str:
    if turn == 0:
        return 'Let me look.\n<tool_call>\n{"name": "read", "arguments": {"path": "a.txt"}}\n</tool_call>'
    return f"It says: {prompt.count('<tool_response>')} response(s) seen."


async def test_hermes_tool_calls_round_trip_through_the_sdk_as_one_trajectory(
        gateway_server, open_session, scripted_policy, tokenizer):
    client, app = await gateway_server([await scripted_policy(read_then_answer)])
    s, sdk = await open_session(client)
    r = await sdk.chat.completions.create(model="m", messages=START, tools=TOOLS)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.content == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [("read", {"path": "a.txt"})]
    # the agent re-serialises the arguments with other whitespace and its own call id: same message
    sent = {"role": "assistant", "content": msg.content, "tool_calls": [
        {"id": "call_mine", "type": "function",
         "function": {"name": "read", "arguments": json.dumps({"path": "a.txt"}, indent=2)}}]}
    messages = START + [sent, {"role": "tool", "tool_call_id": "call_mine", "content": "hello"}]
    r2 = await sdk.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    assert r2.choices[0].finish_reason == "stop" and r2.choices[0].message.tool_calls is None
    assert r2.choices[0].message.content == "It says: 1 response(s) seen."

    result = await (await client.post(f"/sessions/{s['session_id']}/finalize", headers=AUTH)).json()
    assert result["split_reasons"] == [] and len(result["trajectories"]) == 1
    traj = Trajectory(**result["trajectories"][0])
    generated = [t for t, m in zip(traj.response_ids, traj.loss_mask) if m]
    assert generated == [t for ids, _ in scripted_policy.returned for t in ids]
    assert [lp for lp, m in zip(traj.response_logprobs, traj.loss_mask) if m] == \
        [lp for _, lps in scripted_policy.returned for lp in lps]
    observation = tokenizer.decode([t for t, m in zip(traj.response_ids, traj.loss_mask) if not m])
    assert observation == "\n<|im_start|>user\n<tool_response>\nhello\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert result["messages"][2]["tool_calls"][0]["function"] == {"name": "read", "arguments": {"path": "a.txt"}}


async def test_changed_whitespace_in_history_splits_with_the_position(gateway_server, open_session, scripted_policy):
    client, app = await gateway_server([await scripted_policy(lambda p, t: f"answer {t}")])
    s, sdk = await open_session(client)
    r = await sdk.chat.completions.create(model="m", messages=START)
    resent = START + [{"role": "assistant", "content": r.choices[0].message.content + " "},
                      {"role": "user", "content": "and?"}]
    await sdk.chat.completions.create(model="m", messages=resent)
    result = await (await client.post(f"/sessions/{s['session_id']}/finalize", headers=AUTH)).json()
    assert len(result["trajectories"]) == 2
    assert result["split_reasons"] == [result["trajectories"][0]["split_reason"]]
    assert "message 2 (assistant) content differs from character 8" in result["split_reasons"][0]


async def test_bad_requests_get_openai_format_4xx(gateway_server, open_session, scripted_policy):
    client, app = await gateway_server([await scripted_policy(lambda p, t: "ok")])
    s, sdk = await open_session(client)
    cases = [
        (dict(messages=[{"role": "wizard", "content": "x"}]), "invalid_messages", "messages[0].role"),
        (dict(messages=[{"role": "user", "content": 5}]), "invalid_messages", "messages[0].content"),
        (dict(messages=START + [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "read", "arguments": "{not json"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "x"}]),
         "invalid_messages", "messages[2].tool_calls[0].function.arguments"),
        (dict(messages=[]), "invalid_messages", "messages"),
        (dict(messages=START + [{"role": "assistant", "content": "partial"}]), "invalid_messages", "messages[2]"),
        (dict(messages=START, n=0), "invalid_parameter", "n"),
        (dict(messages=START, n=17), "invalid_parameter", "n"),
        (dict(messages=START, tool_choice="required"), "invalid_parameter", "tool_choice"),
        (dict(messages=START, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "write"}}),
         "invalid_parameter", "tool_choice"),
        (dict(messages=START, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
         "unsupported_parameter", "response_format"),
        (dict(messages=START, extra_body={"guided_json": {}}), "unsupported_parameter", "guided_json"),
        (dict(messages=START, response_format={"type": "grammar", "grammar": "x"}), "unsupported_parameter",
         "response_format"),
        (dict(messages=START, response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
         "invalid_parameter", "response_format"),
        (dict(messages=START, logprobs=True, top_logprobs=21), "invalid_parameter", "top_logprobs"),
        (dict(messages=START, logit_bias={"x": 1}), "invalid_parameter", "logit_bias"),
        (dict(messages=START, logit_bias={"5": 101}), "invalid_parameter", "logit_bias"),
        (dict(messages=START, logit_bias={"99999999": 1}), "invalid_parameter", "logit_bias"),
        (dict(messages=START, reasoning_effort="extreme"), "invalid_parameter", "reasoning_effort"),
        (dict(messages=START, extra_body={"chat_template_kwargs": "yes"}), "invalid_parameter",
         "chat_template_kwargs"),
        (dict(messages=START, max_tokens=0), "invalid_parameter", "max_tokens"),
        (dict(messages=START, stream_options={"include_usage": True}), "invalid_parameter", "stream_options"),
        (dict(messages=START, tools=[{"name": "read"}]), "invalid_parameter", "tools"),
    ]
    for kwargs, code, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            await sdk.chat.completions.create(model="m", **kwargs)
        assert e.value.status_code == 400 and e.value.code == code and e.value.param == param, (kwargs, e.value.body)
    r = await client.post(URL(s["base_url"]).path + "/chat/completions", data=b"{oops")
    assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_json"
    # none of these touched the session: a good request still starts its one trajectory
    await sdk.chat.completions.create(model="m", messages=START)
    result = await (await client.post(f"/sessions/{s['session_id']}/finalize", headers=AUTH)).json()
    assert len(result["trajectories"]) == 1 and result["counters"]["generated_tokens"] > 0


async def test_capabilities_are_per_session_and_never_the_server_token(gateway_server, open_session, scripted_policy):
    client, app = await gateway_server([await scripted_policy(lambda p, t: "ok")])
    a, sdk_a = await open_session(client)
    b, sdk_b = await open_session(client)
    origin = str(client.make_url("")).rstrip("/")
    # A's key on B's session: refused, and B's history is untouched
    def sdk_for(path_segment):
        return openai.AsyncOpenAI(base_url=f"{origin}/sessions/{path_segment}/v1", api_key=a["api_key"],
                                  max_retries=0)

    async with sdk_for(f"{b['session_id']}.{a['api_key']}") as cross:
        with pytest.raises(openai.PermissionDeniedError) as e:
            await cross.chat.completions.create(model="m", messages=START)
        assert e.value.code == "invalid_session_key"
    async with sdk_for(b["session_id"]) as no_key:  # the key as a bearer only: not a capability
        with pytest.raises(openai.PermissionDeniedError):
            await no_key.chat.completions.create(model="m", messages=START)
    async with sdk_for(f"sess_0123.{a['api_key']}") as unknown:
        with pytest.raises(openai.NotFoundError) as e:
            await unknown.chat.completions.create(model="m", messages=START)
        assert e.value.code == "unknown_session"
    status = await (await client.get(f"/sessions/{b['session_id']}", headers=AUTH)).json()
    assert status["counters"]["requests"] == 0
    # the capability opens agent routes only: management needs the server token
    key_auth = {"Authorization": f"Bearer {a['api_key']}"}
    for method, path in [("post", "/sessions"), ("get", f"/sessions/{a['session_id']}"),
                         ("post", f"/sessions/{a['session_id']}/finalize"), ("get", "/status"),
                         ("post", "/stop")]:
        r = await getattr(client, method)(path, headers=key_auth)
        assert r.status == 401, (path, r.status)
    # and the server token does not open agent routes of a session whose key it is not
    r = await client.post(f"/sessions/{a['session_id']}.server-secret/v1/chat/completions", headers=AUTH,
                          json={"messages": START})
    assert r.status == 403
    assert (await sdk_a.chat.completions.create(model="m", messages=START)).choices[0].message.content == "ok"


async def test_finished_and_aborted_sessions_refuse_work(gateway_server, open_session, scripted_policy):
    client, app = await gateway_server([await scripted_policy(lambda p, t: "ok")])
    s, sdk = await open_session(client)
    await sdk.chat.completions.create(model="m", messages=START)
    base = URL(s["base_url"]).path[:-len("/v1")]
    r = await client.post(f"{base}/complete", json={"reward_info": {"reward": 0.5}})
    assert r.status == 200 and (await r.json())["state"] == "completed"
    with pytest.raises(openai.ConflictError) as e:
        await sdk.chat.completions.create(model="m", messages=START + [{"role": "assistant", "content": "ok"},
                                                                       {"role": "user", "content": "more"}])
    assert e.value.code == "session_finished"
    assert (await client.post(f"{base}/complete", json={})).status == 409
    result = await (await client.post(f"/sessions/{s['session_id']}/finalize", headers=AUTH)).json()
    assert result["state"] == "completed" and result["reward_info"] == {"reward": 0.5}
    assert len(result["trajectories"]) == 1

    t, sdk_t = await open_session(client)
    await sdk_t.chat.completions.create(model="m", messages=START)
    r = await client.post(f"/sessions/{t['session_id']}/abort", headers=AUTH)
    assert (await r.json())["state"] == "aborted"
    with pytest.raises(openai.ConflictError):
        await sdk_t.chat.completions.create(model="m", messages=START)
    r = await client.post(f"/sessions/{t['session_id']}/finalize", headers=AUTH)
    assert r.status == 409 and (await r.json())["error"]["code"] == "session_aborted"
    r = await client.post("/sessions/sess_nope/finalize", headers=AUTH)
    assert r.status == 404 and (await r.json())["error"]["code"] == "unknown_session"


async def test_a_session_body_of_whitespace_is_invalid_json_and_no_body_is_empty(gateway_server, scripted_policy):
    """``POST /sessions`` takes ``{metadata?}``: no body at all creates a session, a body that is not JSON (a
    newline, which the fuzz tier sends as "random bytes") is a 400, as on the core routes."""
    client, _ = await gateway_server([await scripted_policy(lambda p, t: "ok")])
    r = await client.post("/sessions", data=b"\n", headers={**AUTH, "Content-Type": "application/json"})
    assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_json"
    r = await client.post("/sessions", headers=AUTH)
    assert r.status == 201, await r.text()


async def test_session_state_is_bounded(gateway_server, open_session, scripted_policy):
    client, app = await gateway_server([await scripted_policy(lambda p, t: "ok")], gateway_max_sessions=2)
    gw = app[GATEWAY]
    a, sdk_a = await open_session(client)
    b, _ = await open_session(client)
    r = await client.post("/sessions", json={}, headers=AUTH)
    assert r.status == 429 and (await r.json())["error"]["code"] == "too_many_sessions"
    await sdk_a.chat.completions.create(model="m", messages=START)
    assert sum(bk.in_flight for bk in gw.pool.backends) == 1  # a holds its sticky backend
    # idle sessions expire (their tokens stay for finalize) and free their slot and backend
    gw.idle_timeout_s = 0.0
    assert gw.expire_idle() == 2 and not gw.open
    assert all(bk.in_flight == 0 for bk in gw.pool.backends)
    with pytest.raises(openai.ConflictError):
        await sdk_a.chat.completions.create(model="m", messages=START)
    r = await client.post(f"/sessions/{a['session_id']}/finalize", headers=AUTH)
    assert r.status == 200 and (await r.json())["end_reason"] == "idle_timeout"
    # ended sessions are kept up to keep_finished, oldest forgotten first
    gw.keep_finished = 1
    c, _ = await open_session(client)
    assert (await client.post(f"/sessions/{c['session_id']}/abort", headers=AUTH)).status == 200
    assert list(gw.finished) == [c["session_id"]]
    for old in (a, b):
        assert (await client.post(f"/sessions/{old['session_id']}/finalize", headers=AUTH)).status == 404


async def test_streaming_agent_gets_sse_chunks_and_the_same_trajectory(gateway_server, open_session, scripted_policy):
    client, app = await gateway_server([await scripted_policy(read_then_answer)])
    s, sdk = await open_session(client)
    stream = await sdk.chat.completions.create(model="m", messages=START, tools=TOOLS, stream=True,
                                               stream_options={"include_usage": True})
    content, calls, finish, usage = "", {}, None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or ():
                c = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                c["name"] += tc.function.name or ""
                c["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    assert content == "Let me look." and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("read", {"path": "a.txt"})]
    assert usage.completion_tokens == len(scripted_policy.returned[0][0])
    # the agent rebuilds the assistant message from the chunks; the session goes on without a split
    sent = {"role": "assistant", "content": content, "tool_calls": [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls.values()]}
    messages = START + [sent, {"role": "tool", "tool_call_id": calls[0]["id"], "content": "hello"}]
    stream = await sdk.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=True)
    text = "".join([ch.delta.content or "" async for chunk in stream for ch in chunk.choices])
    assert text == "It says: 1 response(s) seen."
    result = await (await client.post(f"/sessions/{s['session_id']}/finalize", headers=AUTH)).json()
    assert result["split_reasons"] == [] and result["trajectories"][0]["num_turns"] == 2


async def test_no_backend_is_a_503_and_the_session_can_retry(gateway_server, open_session, scripted_policy):
    client, app = await gateway_server([])
    s, sdk = await open_session(client)
    with pytest.raises(openai.InternalServerError) as e:
        await sdk.chat.completions.create(model="m", messages=START)
    assert e.value.status_code == 503 and e.value.code == "no_backend"
    r = await client.post("/add_llm_server", json={"address": await scripted_policy(lambda p, t: "ok")}, headers=AUTH)
    assert r.status == 200
    assert (await sdk.chat.completions.create(model="m", messages=START)).choices[0].message.content == "ok"
    result = await (await client.post(f"/sessions/{s['session_id']}/finalize", headers=AUTH)).json()
    assert len(result["trajectories"]) == 1 and result["counters"]["requests"] == 2


async def test_a_per_session_unix_socket_serves_its_own_session_only(gateway_server, open_session, scripted_policy,
                                                                    tmp_path):
    import aiohttp

    client, app = await gateway_server([await scripted_policy(lambda p, t: "ok")])
    gw = app[GATEWAY]
    a, b = gw.create_session(), gw.create_session()
    runner = await gw.serve_unix(a, str(tmp_path / "a.sock"))
    try:
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(tmp_path / "a.sock"))) as http:
            async with http.post(f"http://x/sessions/{a.ref}/v1/chat/completions", json={"messages": START}) as r:
                assert r.status == 200 and (await r.json())["choices"][0]["message"]["content"] == "ok"
            async with http.post(f"http://x/sessions/{b.ref}/v1/chat/completions", json={"messages": START}) as r:
                assert r.status == 404  # B's valid capability is useless on A's socket
            async with http.post(f"http://x/sessions/{a.session_id}/finalize") as r:
                assert r.status == 404  # no management route there
    finally:
        await runner.cleanup()
    assert b.counters["requests"] == 0 and a.counters["requests"] == 1


async def test_abort_while_a_turn_is_generated_records_nothing_and_frees_the_backend(
        gateway_server, open_session, scripted_policy):
    import asyncio

    client, app = await gateway_server([await scripted_policy(lambda p, t: "ok")])
    gw = app[GATEWAY]
    # FAULT INJECTION: a generation that lasts until the test lets it finish (a slow backend)
    release, started = asyncio.Event(), asyncio.Event()
    real = gw.llm.client.complete

    async def slow(*a, **kw):
        started.set()
        await release.wait()
        return await real(*a, **kw)

    gw.llm.client.complete = slow
    s, sdk = await open_session(client)
    turn = asyncio.ensure_future(sdk.chat.completions.create(model="m", messages=START))
    await started.wait()
    assert sum(b.in_flight for b in gw.pool.backends) == 1
    assert (await client.post(f"/sessions/{s['session_id']}/abort", headers=AUTH)).status == 200
    release.set()
    with pytest.raises(openai.ConflictError):
        await turn
    assert sum(b.in_flight for b in gw.pool.backends) == 0
    assert gw.finished[s["session_id"]].history == [] and gw.finished[s["session_id"]].trajectories() == []


async def test_answers_say_where_their_time_went_in_server_timing(gateway_server, open_session, scripted_policy):
    def slow(prompt, turn):  # the policy takes 50 ms to answer
        time.sleep(0.05)
        return f"answer {turn}"

    client, app = await gateway_server([await scripted_policy(slow)])
    s, sdk = await open_session(client)
    messages = list(START)
    for stream in (False, True):
        raw = await sdk.chat.completions.with_raw_response.create(model="m", messages=messages, stream=stream)
        timing = {}
        for part in raw.headers["server-timing"].split(","):
            name, _, dur = part.strip().partition(";dur=")
            timing[name] = float(dur)
        assert set(timing) == {"backend", "gateway"}
        assert 50 <= timing["backend"] < 5000 and 0 < timing["gateway"] < 5000  # the first loads the tokenizer
        if stream:
            [ch async for ch in raw.parse()]
        else:
            messages += [{"role": "assistant", "content": raw.parse().choices[0].message.content},
                         {"role": "user", "content": "again"}]
    result = await (await client.post(f"/sessions/{s['session_id']}/finalize", headers=AUTH)).json()
    assert result["split_reasons"] == [] and result["trajectories"][0]["num_turns"] == 2


async def test_a_request_of_a_session_whose_job_is_ending_is_a_409_without_a_traceback(
        gateway_server, scripted_policy, caplog):
    """A job's session asks for a turn while its job is being ended (cancelled, timed out, the server
    stopping): Job.backend() refuses with JobEndedError. That is the system ending the job, not a bug: a 409
    `job_ended` the agent's SDK reads, and no ERROR traceback per session (a benchmark's orderly shutdown
    logged one for each agent in flight)."""
    import logging

    from prorl_server.balancer import BackendPool
    from prorl_server.job import Job

    client, app = await gateway_server([await scripted_policy(lambda p, t: "ok")])
    job = Job(job_id="ending", instance={}, sampling_params={}, handler=None, handler_name="h", timeout_s=None,
              pool=BackendPool())
    job.finishing = True
    s = app[GATEWAY].create_session(job=job)
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url(f"/sessions/{s.ref}/v1")), api_key="k", max_retries=0)
    try:
        with caplog.at_level(logging.ERROR), pytest.raises(openai.ConflictError) as e:
            await sdk.chat.completions.create(model="m", messages=START)
    finally:
        await sdk.close()
    assert e.value.status_code == 409 and e.value.code == "job_ended"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
