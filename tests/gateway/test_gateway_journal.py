"""With a journal, every gateway exchange of a session is recorded: the request decoded and stored compact (its
messages after those the session's previous request had; the SHA-256 of the body as sent) and the answer it
received, in order; the completions behind them are journalled with their exact tokens. What one session (or
job) journals is capped. The backend is :class:`prorl_server.dev.fake_vllm.FakeVLLM` (standing for vLLM)."""
from __future__ import annotations

import hashlib
import json
import sqlite3

from prorl_server.app import PIPELINE
from prorl_server.dev.fake_vllm import start_fake_vllm
from prorl_server.journal.store import Journal

from .conftest import AUTH

START = [{"role": "system", "content": "You are a test agent."}, {"role": "user", "content": "Talk."}]


def compact(value) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


async def _session_url(client) -> tuple[str, str]:
    r = await client.post("/sessions", json={}, headers=AUTH)
    s = await r.json()
    return s["session_id"], f"/sessions/{s['session_id']}.{s['api_key']}/v1/chat/completions"


async def test_each_exchange_is_journalled_compact_and_answered(gateway_server, tiny_model_dir, tmp_path):
    fake, runner, address = await start_fake_vllm(step_s=0.001)
    path = tmp_path / "j.sqlite"
    try:
        client, _ = await gateway_server([address], tokenizer=str(tiny_model_dir), journal=str(path))
        sid, url = await _session_url(client)
        sent, got = [], []
        history = list(START)
        for k in range(2):
            body = json.dumps({"model": "m", "messages": history, "max_tokens": 5}, indent=4).encode()
            resp = await client.post(url, data=body, headers={"Content-Type": "application/json"})
            assert resp.status == 200
            answer = await resp.read()
            sent.append(body)
            got.append(answer)
            history = history + [json.loads(answer)["choices"][0]["message"], {"role": "user", "content": "More."}]
        await client.post(f"/sessions/{sid}/finalize", headers=AUTH)
        await client.close()
    finally:
        await runner.cleanup()
    j = Journal(str(path), readonly=True)
    rows = j.gateway_exchanges(sid)
    assert [(seq, h, req, resp) for seq, h, req, resp in rows] == [
        (k + 1, hashlib.sha256(sent[k]).hexdigest(), compact(json.loads(sent[k])), got[k]) for k in range(2)]
    assert len(j.completions(f"gateway:{sid}")) == 2
    j.close()
    db = sqlite3.connect(path)
    stored = db.execute("SELECT prefix_messages, request FROM gateway WHERE session_id = ? ORDER BY id",
                        (sid,)).fetchall()
    db.close()
    # the second request repeats the first one's two messages: stored are only the two it added
    assert [(p, len(json.loads(r)["messages"])) for p, r in stored] == [(0, 2), (2, 2)]


def _journalled_bytes(path, sid: str) -> int:
    db = sqlite3.connect(path)
    gw = db.execute("SELECT COALESCE(SUM(length(request) + length(response)), 0) FROM gateway WHERE session_id = ?",
                    (sid,)).fetchone()[0]
    comp = db.execute("SELECT COALESCE(SUM(length(prompt_tail) + length(token_ids) + length(logprobs)), 0) "
                      "FROM completions WHERE owner = ?", (f"gateway:{sid}",)).fetchone()[0]
    db.close()
    return gw + comp


async def test_whitespace_padded_and_repeated_bodies_cannot_grow_the_journal_past_the_cap(
        gateway_server, tiny_model_dir, tmp_path):
    # red team (#33): 2 MiB bodies padded with JSON whitespace were journalled as sent, 80 MB for 160 tokens
    fake, runner, address = await start_fake_vllm(step_s=0.001)
    path = tmp_path / "j.sqlite"
    cap = 16 << 10
    try:
        client, app = await gateway_server([address], tokenizer=str(tiny_model_dir), journal=str(path))
        app[PIPELINE].journal.max_owner_bytes = cap
        headers = {"Content-Type": "application/json"}

        # 1. the same request again and again, each padded with 1 MB of whitespace: stored once, compact
        sid, url = await _session_url(client)
        body = json.dumps({"model": "m", "messages": START, "max_tokens": 2})
        padded = ("{" + " \n\t" * 350_000 + body[1:]).encode()
        for _ in range(8):
            r = await client.post(url, data=padded, headers=headers)
            assert r.status == 200, await r.text()
        await client.post(f"/sessions/{sid}/finalize", headers=AUTH)
        assert app[PIPELINE].journal.flush()
        assert _journalled_bytes(path, sid) < 8 << 10  # 8 MB sent

        # 2. a new conversation each time (nothing shared with the last request): refused once past the cap
        sid, url = await _session_url(client)
        codes = []
        for k in range(60):
            msgs = [START[0], {"role": "user", "content": f"Question {k}: " + "why " * 60}]
            r = await client.post(url, data=json.dumps({"model": "m", "messages": msgs, "max_tokens": 2}),
                                  headers=headers)
            codes.append(r.status if r.status == 200 else (await r.json())["error"]["code"])
        await client.post(f"/sessions/{sid}/finalize", headers=AUTH)
        assert app[PIPELINE].journal.flush()
        assert 200 in codes and codes[-1] == "journal_cap_exceeded"
        assert codes.index("journal_cap_exceeded") == codes.count(200)  # once refused, refused for good
        assert cap <= _journalled_bytes(path, sid) < cap + 2048  # one request past the cap at most
        await client.close()
    finally:
        await runner.cleanup()


async def test_an_anthropic_messages_exchange_is_journalled_compact_too(gateway_server, tiny_model_dir, tmp_path):
    fake, runner, address = await start_fake_vllm(step_s=0.001)
    path = tmp_path / "j.sqlite"
    try:
        client, app = await gateway_server([address], tokenizer=str(tiny_model_dir), journal=str(path))
        sid, url = await _session_url(client)
        body = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi."}]}
        sent = json.dumps(body, indent=8).encode()
        r = await client.post(url.replace("/chat/completions", "/messages"), data=sent,
                              headers={"Content-Type": "application/json"})
        assert r.status == 200, await r.text()
        answer = await r.read()
        assert app[PIPELINE].journal.flush()
        j = Journal(str(path), readonly=True)
        assert j.gateway_exchanges(sid) == [(1, hashlib.sha256(sent).hexdigest(), compact(body), answer)]
        j.close()
        await client.close()
    finally:
        await runner.cleanup()
