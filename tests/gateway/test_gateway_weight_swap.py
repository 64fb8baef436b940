"""A black-box agent (the real ``openai`` SDK through the gateway) never sees a weight swap: its request in
flight when ``POST /weights/pause`` lands is frozen and finishes after the resume, one sent during the swap
waits in the server, both answer 200, and the session's trajectory records the exact version of every token.

The backend is :class:`prorl_server.dev.fake_vllm.FakeVLLM`, standing for vLLM 0.31's completions and
development endpoints; its token ids say which weights generated them (``1000 + version``).
"""
from __future__ import annotations

import asyncio

from prorl_server.dev.fake_vllm import TOKEN_BASE, start_fake_vllm

from .conftest import AUTH

START = [{"role": "system", "content": "You are a test agent."}, {"role": "user", "content": "Talk."}]


async def test_an_agent_request_in_flight_and_one_sent_during_a_swap_both_succeed(
        gateway_server, open_session, tiny_model_dir):
    fake, runner, address = await start_fake_vllm(step_s=0.01)
    try:
        client, _ = await gateway_server([], tokenizer=str(tiny_model_dir))
        await client.post("/add_llm_server", json={"address": address, "weight_version": 0}, headers=AUTH)
        s, sdk = await open_session(client)
        first = asyncio.create_task(sdk.chat.completions.create(model="m", messages=START, max_tokens=60))
        while not fake.running or min(len(q.tokens) for q in fake.running.values()) < 10:
            await asyncio.sleep(0.005)
        r = await client.post("/weights/pause", json={"weight_version": 1}, headers=AUTH)
        assert r.status == 200
        paused = await r.json()
        assert paused["held_calls"] == 1
        second = asyncio.create_task(sdk.chat.completions.create(model="m", messages=START, max_tokens=20))
        await asyncio.sleep(0.3)
        assert not first.done() and not second.done()
        assert fake.counts["requests"] == 1  # the second waits in the server, not at the paused backend
        fake.version = 1  # stands for the trainer's load
        r = await client.post("/weights/resume", json={"swap_id": paused["swap_id"]}, headers=AUTH)
        assert r.status == 200
        a, b = await first, await second
        assert a.choices[0].finish_reason == "length" and b.choices[0].finish_reason == "length"
        assert fake.counts["aborted"] == 0
        result = await (await client.post(f"/sessions/{s['session_id']}/finalize", headers=AUTH)).json()
        runs = [tuple(r) for t in result["trajectories"] for r in t["version_runs"]]
        gen = [x for t in result["trajectories"] for x, m in zip(t["response_ids"], t["loss_mask"]) if m]
        assert [v for v, n in runs for _ in range(n)] == [x - TOKEN_BASE for x in gen]
        assert runs[0][0] == 0 and runs[1][0] == 1 and sum(t["mixed_version_turns"]
                                                           for t in result["trajectories"]) == 1
    finally:
        await runner.cleanup()
