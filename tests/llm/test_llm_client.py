"""Client retry semantics against small aiohttp servers standing for vLLM's /v1/completions in the states
that are hard to produce on demand (abort during weight sync, 5xx, 4xx, refused connections). The real
server is exercised in test_vllm_rollouts.py."""
from __future__ import annotations

import pytest
from aiohttp import web

from prorl_server.balancer import Backend, BackendPool
from prorl_server.llm.client import REQUEST_ID, LLMClient, LLMRequestError, LLMUnavailableError, PoolBackends


def choice(ids, finish="length"):
    return {"choices": [{"index": 0, "text": "", "finish_reason": finish, "stop_reason": None,
                         "logprobs": {"tokens": [f"token_id:{t}" for t in ids],
                                      "token_logprobs": [-0.5] * len(ids)}}]}


def fake_vllm(script):
    """An app answering /v1/completions from ``script`` (a list of (status, body) consumed in order) and
    recording the request bodies."""
    seen = []

    async def models(request):
        return web.json_response({"data": [{"id": "fake-model", "max_model_len": 128}]})

    async def completions(request):
        seen.append(await request.json())
        status, body = script.pop(0)
        return web.json_response(body, status=status)

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    return app, seen


def vllm_answering(completions):
    """An app whose /v1/completions is ``completions`` (a handler) and /v1/models names model "m"."""
    async def models(request):
        return web.json_response({"data": [{"id": "m", "max_model_len": 128}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    return app


async def test_request_carries_token_ids_and_owned_keys_cannot_be_overridden(aiohttp_server):
    app, seen = fake_vllm([(200, choice([7, 8, 9]))])
    server = await aiohttp_server(app)
    async with LLMClient() as llm:
        c = await llm.complete([1, 2, 3], backend=str(server.make_url("")), max_tokens=3,
                               sampling_params={"temperature": 0.7, "logprobs": 5, "n": 4, "prompt": "x"})
    body = seen[0]
    assert body["prompt"] == [1, 2, 3] and body["model"] == "fake-model"
    assert (body["logprobs"], body["n"], body["return_tokens_as_token_ids"], body["temperature"]) == (0, 1, True, 0.7)
    assert c.token_ids == [7, 8, 9] and c.logprobs == [-0.5] * 3 and c.finish_reason == "length"


async def test_request_ids_are_unique_within_a_client_and_across_clients_sharing_a_backend(aiohttp_server):
    """vLLM keys its requests by ``X-Request-Id`` (aborts, progress): two rollout servers on one engine must not
    send the same id."""
    ids = []

    async def completions(request):
        ids.append(request.headers["X-Request-Id"])
        return web.json_response(choice([7]))

    server = await aiohttp_server(vllm_answering(completions))
    async with LLMClient() as a, LLMClient() as b:
        for llm in (a, b, a, b, a):
            await llm.complete([1], backend=str(server.make_url("")), max_tokens=1)
    assert len(ids) == 5 and len(set(ids)) == 5
    # the weight-swap coordinator finds them again inside vLLM's own ids (cmpl-<ours>-0-<suffix>)
    assert all(REQUEST_ID.fullmatch(i) and REQUEST_ID.search(f"cmpl-{i}-0-a1b2").group(0) == i for i in ids)


async def test_aborted_turn_during_weight_sync_is_retried_and_nothing_partial_is_kept(aiohttp_server):
    b = Backend("", weight_version=1)
    seen = []

    async def models(request):
        return web.json_response({"data": [{"id": "m", "max_model_len": 128}]})

    async def completions(request):
        seen.append(await request.json())
        if len(seen) == 1:  # /pause (mode=abort) ends the request; the trainer then registers version 2
            b.weight_version = 2
            return web.json_response(choice([5, 5], finish="abort"))
        return web.json_response(choice([6, 6, 6]))

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    server = await aiohttp_server(app)
    b.address = str(server.make_url("")).rstrip("/")

    async def getter(exclude):
        return b

    async with LLMClient(pause_backoff_s=0.01) as llm:
        c = await llm.complete([1], backend=getter, max_tokens=3)
    assert c.token_ids == [6, 6, 6] and c.pause_retries == 1 and c.failovers == 0
    assert c.weight_versions == [2]  # the kept turn was generated entirely by the new weights
    assert len(seen) == 2 and seen[0]["prompt"] == seen[1]["prompt"] == [1]


async def test_connection_failure_fails_over_and_repeated_failures_mark_the_backend_unhealthy(aiohttp_server,
                                                                                           unused_tcp_port):
    app, _ = fake_vllm([(200, choice([4]))])
    server = await aiohttp_server(app)
    pool = BackendPool()
    dead = f"http://127.0.0.1:{unused_tcp_port}"
    pool.add(dead, weight_version=1)
    pool.add(str(server.make_url("")), weight_version=2)
    async with LLMClient(pool=pool) as llm:
        c = await llm.complete([1], backend=PoolBackends(pool, "j"), max_tokens=1)
    assert c.token_ids == [4] and c.failovers == 1 and c.weight_versions == [2]
    assert pool.get(dead).consecutive_failures == 1 and pool.get(dead).healthy  # one failure may be transient
    assert pool.holder("j").address == str(server.make_url("")).rstrip("/")
    pool.report_failure(dead, "refused again")  # the next failure in a row takes it out of rotation
    assert not pool.get(dead).healthy


async def test_server_error_is_retried_elsewhere_then_gives_up(aiohttp_server):
    app, seen = fake_vllm([(500, {"error": "boom"})] * 3)
    server = await aiohttp_server(app)
    addr = str(server.make_url("")).rstrip("/")

    async def same(exclude):  # a getter that keeps offering the same (failing) backend
        return Backend(addr)

    async with LLMClient(max_attempts=3) as llm:
        with pytest.raises(LLMUnavailableError, match="failed 3 times"):
            await llm.complete([1], backend=same, max_tokens=1)
    assert len(seen) == 3


async def test_bad_request_is_not_retried(aiohttp_server):
    app, seen = fake_vllm([(400, {"error": {"message": "prompt too long"}})])
    server = await aiohttp_server(app)
    async with LLMClient() as llm:
        with pytest.raises(LLMRequestError, match="prompt too long") as e:
            await llm.complete([1], backend=str(server.make_url("")), max_tokens=1)
    assert e.value.status == 400 and len(seen) == 1


async def test_only_backend_down_is_unavailable(unused_tcp_port):
    async with LLMClient() as llm:
        with pytest.raises(LLMUnavailableError):
            await llm.complete([1], backend=f"http://127.0.0.1:{unused_tcp_port}", max_tokens=1)


async def test_a_keep_alive_connection_the_backend_closes_is_sent_again_not_counted_as_a_failure(aiohttp_server):
    # The backend closes the pooled connection as the request arrives (a keep-alive that expired by its clock
    # while a loaded client released the connection late): here the handler drops its connection, once.
    seen = []

    async def models(request):
        return web.json_response({"data": [{"id": "m", "max_model_len": 128}]})

    async def completions(request):
        seen.append(await request.json())
        if len(seen) == 1:
            request.transport.close()
            return web.Response()
        return web.json_response(choice([3, 4], finish="stop"))

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    server = await aiohttp_server(app)
    pool = BackendPool()
    pool.add(str(server.make_url("")), weight_version=1)
    async with LLMClient(pool=pool) as llm:
        c = await llm.complete([1], backend=PoolBackends(pool, "j"), max_tokens=2)
    assert c.token_ids == [3, 4] and (c.attempts, c.failovers) == (1, 0) and len(seen) == 2
    assert llm.counters["backend_failures"] == 0 and pool.backends[0].consecutive_failures == 0


async def test_a_backend_that_keeps_disconnecting_still_fails_over(aiohttp_server):
    async def completions(request):
        request.transport.close()
        return web.Response()

    server = await aiohttp_server(vllm_answering(completions))
    async with LLMClient(max_attempts=2) as llm:
        with pytest.raises(LLMUnavailableError, match="failed 2 times.*ServerDisconnected"):
            await llm.complete([1], backend=str(server.make_url("")), max_tokens=1)
    assert llm.counters["backend_failures"] == 2


async def test_one_session_is_shared_across_calls(aiohttp_server):
    app, _ = fake_vllm([(200, choice([1]))] * 3)
    server = await aiohttp_server(app)
    async with LLMClient() as llm:
        sessions = set()
        for _ in range(3):
            await llm.complete([1], backend=str(server.make_url("")), max_tokens=1)
            sessions.add(id(llm.session))
    assert len(sessions) == 1
    assert llm._session.closed  # the client closes the session it created


def test_launcher_shows_its_plan_without_running(capsys, tmp_path):
    from prorl_server.dev.vllm_launcher import main, plan_vllm

    plan = plan_vllm(tmp_path, port=1234, max_model_len=2048, max_num_batched_tokens=2048)
    assert plan.argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert {"--enforce-eager", "--max-num-batched-tokens"} <= set(plan.argv)
    assert plan.env["VLLM_CPU_KVCACHE_SPACE"] == "1" and plan.env["HF_HUB_OFFLINE"] == "1"
    assert main(["--model", str(tmp_path), "--port", "1234", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "--port 1234" in out and "--dtype float32" in out  # printed, nothing started


def test_launcher_refuses_a_port_something_listens_on(tmp_path):
    import socket

    from prorl_server.dev.vllm_launcher import VLLMStartError, port_in_use, start_vllm

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert port_in_use("127.0.0.1", port)
        with pytest.raises(VLLMStartError, match="already in use"):
            start_vllm(tmp_path, port=port)  # vLLM would silently share it (SO_REUSEPORT)
    assert not port_in_use("127.0.0.1", port)


async def test_request_body_is_json_with_content_type_and_python_callers_values_keep_their_meaning(aiohttp_server):
    """The body goes out as orjson bytes: still ``application/json``; integer ``logit_bias`` keys a Python caller
    passes arrive as strings (as ``json.dumps`` wrote them) and an int past 64 bits (orjson refuses it) still
    goes, through the fallback."""
    seen_types = []
    app, seen = fake_vllm([(200, choice([7])), (200, choice([8]))])

    @web.middleware
    async def content_type(request, handler):
        if request.method == "POST":
            seen_types.append(request.content_type)
        return await handler(request)

    app.middlewares.append(content_type)
    server = await aiohttp_server(app)
    async with LLMClient() as llm:
        await llm.complete([1, 2], backend=str(server.make_url("")), max_tokens=1,
                           sampling_params={"logit_bias": {12: 5.0}, "temperature": 0.5})
        await llm.complete([1, 2], backend=str(server.make_url("")), max_tokens=1,
                           sampling_params={"seed": 2 ** 70})
    assert seen_types == ["application/json", "application/json"]
    assert seen[0]["logit_bias"] == {"12": 5.0} and seen[0]["temperature"] == 0.5 and seen[0]["prompt"] == [1, 2]
    assert seen[1]["seed"] == 2 ** 70
