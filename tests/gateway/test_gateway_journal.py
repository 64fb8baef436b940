"""With a journal, every gateway exchange of a session is recorded: the request body exactly as the agent sent
it (and its SHA-256) and the answer it received, in order; the completions behind them are journalled with
their exact tokens. The backend is :class:`prorl_server.dev.fake_vllm.FakeVLLM` (standing for vLLM)."""
from __future__ import annotations

import hashlib
import json

from prorl_server.dev.fake_vllm import start_fake_vllm
from prorl_server.journal.store import Journal

from .conftest import AUTH

START = [{"role": "system", "content": "You are a test agent."}, {"role": "user", "content": "Talk."}]


async def test_each_exchange_is_journalled_as_sent_and_answered(gateway_server, tiny_model_dir, tmp_path):
    fake, runner, address = await start_fake_vllm(step_s=0.001)
    path = tmp_path / "j.sqlite"
    try:
        client, _ = await gateway_server([address], tokenizer=str(tiny_model_dir), journal=str(path))
        r = await client.post("/sessions", json={}, headers=AUTH)
        s = await r.json()
        url = f"/sessions/{s['session_id']}.{s['api_key']}/v1/chat/completions"
        sent, got = [], []
        history = list(START)
        for k in range(2):
            body = json.dumps({"model": "m", "messages": history, "max_tokens": 5}).encode()
            resp = await client.post(url, data=body, headers={"Content-Type": "application/json"})
            assert resp.status == 200
            answer = await resp.read()
            sent.append(body)
            got.append(answer)
            history = history + [json.loads(answer)["choices"][0]["message"], {"role": "user", "content": "More."}]
        await client.post(f"/sessions/{s['session_id']}/finalize", headers=AUTH)
        await client.close()
    finally:
        await runner.cleanup()
    j = Journal(str(path), readonly=True)
    rows = j.gateway_exchanges(s["session_id"])
    assert [(seq, h, req, resp) for seq, h, req, resp in rows] == [
        (k + 1, hashlib.sha256(sent[k]).hexdigest(), sent[k], got[k]) for k in range(2)]
    assert len(j.completions(f"gateway:{s['session_id']}")) == 2
    j.close()
