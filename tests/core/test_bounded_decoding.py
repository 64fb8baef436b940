"""Everything the policy controls that the host decodes is bounded in size, depth and time (I4): request bodies
of the rollout API and the gateway, tool calls in generated text, the execution server's answers, the LLM
backend's weight versions. Each hostile input is refused as the contract says (a 4xx with a JSON reason, a
malformed tool call shown to the model, a ``ProtocolError``), never a 500, a ``RecursionError`` or seconds of
quadratic work.

Ints that differ by multiples of 2**61 - 1 hash alike in Python (``hash(n) == n % (2**61 - 1)``), so a few
thousand of them make a set or dict quadratic; :data:`COLLIDING` are such ints.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import time

import pytest

from prorl_server.config import ServerSettings
from prorl_server.plugin.registry import HandlerRegistry
from prorl_server.llm.tool_parser import ToolCallError, get_parser
from prorl_server.types import MAX_TOKEN_ID
from sandbox import bounded_json
from sandbox.bounded_json import JsonBoundError, JsonBounds

M61 = 2**61 - 1
COLLIDING = [1 + k * M61 for k in range(30000)]
DEEP = "[" * 10000 + "]" * 10000
TOKEN = "bound-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
START = [{"role": "user", "content": "hi"}]
#: A guard against the quadratic class (the parent code took seconds on these inputs), not a benchmark.
PATIENCE_S = 2.0


# ------------------------------------------------------------------------------------------ the decoder


def _items(o) -> int:
    if isinstance(o, list):
        return 1 + sum(_items(x) for x in o)
    if isinstance(o, dict):
        return 1 + sum(1 + _items(v) for v in o.values())
    return 1


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 64])
def test_the_scan_reads_strings_and_escapes_exactly_across_chunk_boundaries(monkeypatch, chunk):
    """Escaped quotes and backslashes split across scan chunks still delimit strings exactly: the item count
    (arrays, objects, strings, commas) is at least the values and keys a decode builds, less one, and at most
    twice that; the decode equals json.loads."""
    monkeypatch.setattr(bounded_json, "SCAN_CHUNK_BYTES", chunk)
    rng = random.Random(chunk)
    alphabet = ['a', '"', '\\', '[', ']', '{', '}', ',', '1', 'é', '\n', ' ']
    for _ in range(100):
        doc = [["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12))) for _ in range(rng.randint(0, 8))],
               {"k\\\"" + str(rng.random()): [1, 2.5, None, True, "x"]}]
        text = json.dumps(doc, ensure_ascii=rng.random() < 0.5)
        n = _items(doc)
        assert bounded_json.loads(text, JsonBounds(1 << 20, 2 * n)) == json.loads(text)
        if n > 3:
            with pytest.raises(JsonBoundError):
                bounded_json.loads(text, JsonBounds(1 << 20, n // 3))


@pytest.mark.parametrize("text, reason", [
    (DEEP, "too_deep"),
    ("[" + "9" * 101 + "]", "number_too_long"),
    (json.dumps([[]] * 70000), "too_many_items"),
    (json.dumps([""] * 70000), "too_many_items"),
    ("[NaN]", "invalid"),
    ('"\\ud800"', "invalid"),
    ("x" * 70000, "too_large"),
])
def test_hostile_json_is_a_bound_error_not_a_recursion_error(text, reason):
    with pytest.raises(JsonBoundError) as e:
        bounded_json.loads(text, JsonBounds(max_bytes=65536 if reason == "too_large" else 1 << 22,
                                            max_items=1 << 16))
    assert e.value.reason == reason and isinstance(e.value, ValueError)


def test_a_number_split_across_two_scan_chunks_is_still_too_long():
    raw = b"[" + b"1" * (bounded_json.SCAN_CHUNK_BYTES - 1) + b"2" * 60 + b"]"
    with pytest.raises(JsonBoundError) as e:
        bounded_json.loads(raw, JsonBounds(1 << 22, 1 << 16))
    assert e.value.reason == "number_too_long"


# ------------------------------------------------------------------------------------------ the rollout API


@pytest.fixture
def make_app_client(aiohttp_client):
    from prorl_server.app import create_app

    async def make(**settings):
        settings.setdefault("health_interval_s", 3600)
        settings.setdefault("token", TOKEN)
        return await aiohttp_client(create_app(ServerSettings(**settings), registry=HandlerRegistry()))
    return make


async def test_colliding_token_ids_in_process_sampling_params_are_a_422_naming_the_field(make_app_client):
    client = await make_app_client()
    for field in ("stop_token_ids", "allowed_token_ids"):
        t0 = time.perf_counter()
        r = await client.post("/process", headers=AUTH, json={"instance": {"data_source": "nope"},
                                                               "sampling_params": {field: COLLIDING[:1000]}})
        assert time.perf_counter() - t0 < PATIENCE_S
        err = (await r.json())["error"]
        assert r.status == 422 and err["field"] == f"sampling_params.{field}", err
        assert str(MAX_TOKEN_ID) in err["message"]
    r = await client.post("/jobs", headers=AUTH, json={"instance": {"data_source": "nope"},
                                                       "sampling_params": {"logit_bias": {"²": 1.0}}})
    assert r.status == 422 and "logit_bias" in (await r.json())["error"]["field"]


async def test_a_dense_or_deep_process_body_is_a_400_before_anything_is_built(make_app_client):
    client = await make_app_client()
    for body in (b'{"instance": {"data_source": "nope", "x": ' + json.dumps([[]] * 300000).encode() + b"}}",
                 b'{"instance": {"data_source": "nope", "x": ' + DEEP.encode() + b"}}",
                 b'{"instance": {"data_source": "nope", "x": ' + b"7" * 4000 + b"}}"):
        r = await client.post("/process", headers=AUTH, data=body)
        err = (await r.json())["error"]
        assert r.status == 400 and err["type"] == "json_too_complex", err


# ------------------------------------------------------------------------------------------ the gateway


@pytest.fixture
async def chat_url(make_app_client):
    """``async (**settings) -> (client, chat completions path, anthropic messages path)`` of a fresh session;
    no LLM backend: every body here is refused before one is asked for."""
    async def make(**settings):
        client = await make_app_client(**settings)
        r = await client.post("/sessions", json={}, headers=AUTH)
        ref = (await r.json())["base_url"].split("/sessions/")[1].split("/")[0]
        return client, f"/sessions/{ref}/v1/chat/completions", f"/sessions/{ref}/v1/messages"
    return make


async def test_gateway_logit_bias_with_colliding_or_foreign_keys_is_a_400_not_seconds_or_a_500(chat_url):
    client, chat, _ = await chat_url()
    for bias in ({str(n): 1 for n in COLLIDING[:1000]}, {"²": 1}, {str(MAX_TOKEN_ID + 1): 1}):
        r = await client.post(chat, json={"messages": START, "logit_bias": bias})
        err = (await r.json())["error"]
        assert r.status == 400 and err["param"] == "logit_bias", err
    t0 = time.perf_counter()  # 30000 keys: past the body's item bound, refused before a dict is built
    r = await client.post(chat, json={"messages": START, "logit_bias": {str(n): 1 for n in COLLIDING}})
    assert time.perf_counter() - t0 < PATIENCE_S
    assert r.status == 400 and (await r.json())["error"]["code"] == "json_too_complex"


async def test_gateway_body_too_deep_too_dense_or_too_large_is_a_4xx_in_the_api_format(chat_url):
    client, chat, messages = await chat_url()
    for data, status, code in ((DEEP.encode(), 400, "json_too_complex"),
                               (json.dumps({"messages": START, "stop": [0] * 100000}).encode(), 400,
                                "json_too_complex"),
                               (b'{"messages": "' + b"a" * (5 << 20) + b'"}', 413, "request_too_large")):
        r = await client.post(chat, data=data)
        body = await r.json()
        assert r.status == status and body["error"]["code"] == code, body
        r = await client.post(messages, data=data)
        assert r.status == status and (await r.json())["type"] == "error"


async def test_gateway_body_past_the_servers_own_size_limit_is_a_413_not_a_500(chat_url):
    client, chat, _ = await chat_url(max_body_mb=0.01)
    r = await client.post(chat, data=b'{"messages": "' + b"a" * 20000 + b'"}')
    assert r.status == 413 and (await r.json())["error"]["code"] == "request_too_large"


async def test_gateway_tool_call_arguments_nested_10k_deep_are_a_400_naming_them(chat_url):
    client, chat, _ = await chat_url()
    history = START + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    r = await client.post(chat, json={"messages": history})
    err = (await r.json())["error"]
    assert r.status == 400 and err["param"] == "messages[1].tool_calls[0].function.arguments", err
    assert "levels deep" in err["message"]


# ------------------------------------------------------------------------------------------ tool calls


@pytest.mark.parametrize("body", [
    DEEP,
    '{"name": "f", "arguments": ' + DEEP + "}",
    '{"name": "f", "arguments": ' + json.dumps(DEEP) + "}",  # double-encoded
    '{"name": "f", "arguments": {"x": "' + "a" * (1 << 20) + '"}}',
    '{"name": "f", "arguments": {"x": ' + "9" * 5000 + "}}",
])
def test_a_tool_call_too_deep_or_too_large_is_a_malformed_call_shown_to_the_model(body):
    turn = get_parser("hermes").parse(f"thinking <tool_call>{body}</tool_call> done")
    assert turn.calls == [] and len(turn.errors) == 1 and isinstance(turn.items[0], ToolCallError)
    assert turn.errors[0].message.startswith(("tool call ", "malformed tool call"))
    assert turn.content == "thinking  done"


# ------------------------------------------------------------------------------------------ the sandbox


@pytest.fixture
async def fake_exec_server(tmp_path):
    """``async (answer) -> ExecClient``: a Unix socket server standing in for code in the sandbox that answers
    in the execution server's place (TEST DOUBLE of a hostile sandbox); ``answer(request id) -> bytes``."""
    from sandbox.client import ExecClient

    servers, clients = [], []

    async def make(answer):
        path = os.path.join(str(tmp_path), f"s{len(servers)}")

        async def serve(reader, writer):
            while line := await reader.readline():
                writer.write(answer(json.loads(line)["id"]))
                await writer.drain()

        servers.append(await asyncio.start_unix_server(serve, path))
        never = asyncio.get_running_loop().create_future()
        clients.append(ExecClient(path, lambda: never, "hostile"))
        return clients[-1]

    yield make
    for c in clients:
        await c.close()
    for s in servers:
        s.close()


@pytest.mark.parametrize("answer", [
    lambda rid: b'{"id": %d, "ok": true, "result": {"o": ' % rid + b"[" * 3000 + b"]" * 3000 + b"}}\n",
    lambda rid: b'{"id": %d, "ok": true, "result": {"o": ' % rid + json.dumps([[]] * 50000).encode() + b"}}\n",
    lambda rid: json.dumps({"id": rid, "ok": True, "result": {"output": "x" * (7 << 20)}}).encode() + b"\n",
    lambda rid: json.dumps({"id": [rid], "ok": True, "result": {}}).encode() + b"\n",
    lambda rid: json.dumps({"id": rid, "ok": True, "result": [1, 2]}).encode() + b"\n",
    lambda rid: b'{"id": %d, "ok": true, "result": {"exit_code": ' % rid + b"9" * 5000 + b"}}\n",
], ids=["deep", "dense", "oversized for bash", "list id", "list result", "huge int"])
async def test_an_exec_server_answer_out_of_bounds_or_shape_is_a_protocol_error(fake_exec_server, answer):
    from sandbox.errors import ProtocolError

    client = await fake_exec_server(answer)
    with pytest.raises(ProtocolError):
        await client.call("bash", {"command": "true", "timeout_s": 1, "max_output_bytes": 1 << 20}, 10)


async def test_an_exec_server_line_past_the_line_limit_is_a_protocol_error(fake_exec_server, monkeypatch):
    from sandbox import protocol
    from sandbox.errors import ProtocolError

    monkeypatch.setattr(protocol, "MAX_LINE_BYTES", 1 << 16)
    client = await fake_exec_server(lambda rid: b'{"id": %d, "ok": true, "result": {"o": "' % rid + b"a" * (1 << 17))
    with pytest.raises(ProtocolError):
        await client.call("ipython", {"code": "1"}, 10)
    good = await fake_exec_server(lambda rid: json.dumps({"id": rid, "ok": True, "result": {"o": 1}}).encode() + b"\n")
    assert await good.call("ipython", {"code": "1"}, 10) == {"o": 1}


# ------------------------------------------------------------------------------------------ the LLM backend


def test_a_backends_weight_versions_are_read_bounded():
    from prorl_server.balancer import Backend
    from prorl_server.llm.client import MAX_WEIGHT_VERSIONS, LLMClient

    choice = {"token_ids": [1], "logprobs": {"token_logprobs": [-0.5]}, "finish_reason": "stop", "text": "a"}
    data = {"choices": [choice], "weight_version": 3, "weight_versions": COLLIDING[:5000] + [2**70]}
    c = LLMClient._completion(data, choice, Backend(address="http://b"), None, 0.0, 1, 0, 0)
    assert c.weight_versions[0] == 3 and len(c.weight_versions) <= MAX_WEIGHT_VERSIONS + 1
    assert all(-2**63 <= v < 2**63 for v in c.weight_versions)
