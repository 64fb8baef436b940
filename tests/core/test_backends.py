"""LLM backend pool: least-loaded assignment, sticky routing, in-flight accounting, health removal."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from prorl_server.balancer import BackendPool, NoBackendError


async def test_pool_assigns_least_loaded_and_is_sticky():
    pool = BackendPool()
    pool.add("http://a:1")
    pool.add("http://b:1")
    first = {pool.assign(f"j{i}").address for i in range(2)}
    assert first == {"http://a:1", "http://b:1"}  # spread over both
    assert pool.assign("j0").address == pool.assign("j0").address  # sticky
    pool.assign("j2")
    loads = sorted(b.in_flight for b in pool.backends)
    assert loads == [1, 2]
    for j in ("j0", "j1", "j2"):
        pool.release(j)
        pool.release(j)  # idempotent
    assert [b.in_flight for b in pool.backends] == [0, 0]


async def test_pool_failover_excludes_failed_backend_and_moves_the_count():
    pool = BackendPool()
    pool.add("http://a:1")
    pool.add("http://b:1")
    held = pool.assign("j")
    other = pool.assign("j", exclude=frozenset({held.address}))
    assert other.address != held.address
    assert held.in_flight == 0 and other.in_flight == 1
    with pytest.raises(NoBackendError):
        pool.assign("k", exclude=frozenset({"http://a:1", "http://b:1"}))


async def test_add_is_idempotent_and_updates_weight_version(make_client):
    client = await make_client()
    for v in (1, 2):
        r = await client.post("/add_llm_server", json={"address": "http://127.0.0.1:9/", "weight_version": v})
        assert r.status == 200
    backends = (await (await client.get("/status")).json())["backends"]
    assert backends == [{"address": "http://127.0.0.1:9", "in_flight": 0, "healthy": True, "weight_version": 2}]
    await client.post("/clear_llm_server")
    assert (await (await client.get("/status")).json())["backends"] == []


async def test_jobs_spread_over_backends_sticky_and_counts_return_to_zero(make_client):
    client = await make_client()
    for port in (9, 10):
        await client.post("/add_llm_server", json={"address": f"http://127.0.0.1:{port}", "weight_version": 3})
    ids = []
    for i in range(4):
        r = await client.post("/jobs", json={"instance": {"data_source": "llm_holder", "hold_s": 0.5}})
        ids.append((await r.json())["job_id"])
    await asyncio.sleep(0.2)
    backends = (await (await client.get("/status")).json())["backends"]
    assert sorted(b["in_flight"] for b in backends) == [2, 2]
    results = []
    for j in ids:
        for _ in range(200):
            s = await (await client.get(f"/jobs/{j}")).json()
            if s["state"] == "done":
                break
            await asyncio.sleep(0.02)
        results.append(s["result"])
    for res in results:
        assert res["extra"]["backends_seen"] == [res["backend"]]  # every call went to one backend
        assert res["weight_version"] == 3
    backends = (await (await client.get("/status")).json())["backends"]
    assert [b["in_flight"] for b in backends] == [0, 0]


async def test_job_waits_for_backend_readded_during_weight_update(make_client):
    client = await make_client(backend_wait_s=5)
    await client.post("/add_llm_server", json={"address": "http://127.0.0.1:9"})
    await client.post("/clear_llm_server")
    # No backend in rotation, but this server had one: a swap is in progress, so the job is accepted ...
    r = await client.post("/jobs", json={"instance": {"data_source": "llm_holder"}})
    assert r.status == 202
    job = (await r.json())["job_id"]
    await asyncio.sleep(0.1)
    assert (await (await client.get(f"/jobs/{job}")).json())["state"] == "run"  # waiting in acquire
    # ... and runs on whatever the trainer registers next.
    await client.post("/add_llm_server", json={"address": "http://127.0.0.1:10", "weight_version": 8})
    for _ in range(200):
        s = await (await client.get(f"/jobs/{job}")).json()
        if s["state"] == "done":
            break
        await asyncio.sleep(0.02)
    assert s["result"]["critical_error"] is None, s["result"]["error"]
    assert (s["result"]["backend"], s["result"]["weight_version"]) == ("http://127.0.0.1:10", 8)


async def test_dead_backend_leaves_rotation_and_returns_when_it_answers(unused_tcp_port_factory):
    """A real HTTP server stands in for vLLM's /health route."""
    port = unused_tcp_port_factory()
    async def ok(request):
        return web.Response(text="")

    health = web.Application()
    health.router.add_get("/health", ok)

    async def serve():
        runner = web.AppRunner(health)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    runner = await serve()
    pool = BackendPool()
    pool.add(f"http://127.0.0.1:{port}")
    dead_port = unused_tcp_port_factory()
    pool.add(f"http://127.0.0.1:{dead_port}")
    async with aiohttp.ClientSession() as session:
        for _ in range(2):
            await pool.probe_once(session, timeout_s=2)
        state = {b.address: b.healthy for b in pool.backends}
        assert state == {f"http://127.0.0.1:{port}": True, f"http://127.0.0.1:{dead_port}": False}
        assert len(pool) == 1
        # every new job goes to the live one
        assert {pool.assign(f"j{i}").address for i in range(3)} == {f"http://127.0.0.1:{port}"}
        await runner.cleanup()
        for _ in range(2):
            await pool.probe_once(session, timeout_s=2)
        assert len(pool) == 0
        with pytest.raises(NoBackendError):
            pool.assign("new")
        runner = await serve()
        await pool.probe_once(session, timeout_s=2)
        assert len(pool) == 1 and pool.assign("new").address == f"http://127.0.0.1:{port}"
        await runner.cleanup()


async def test_one_dropped_connection_does_not_take_out_the_only_backend(aiohttp_server):
    """Fault injection: a stand-in for vLLM's /v1/completions that drops the first connection (as a server
    closing an idle keep-alive connection does) and answers afterwards."""
    from prorl_server.llm.client import LLMClient

    calls = []

    async def models(request):
        return web.json_response({"data": [{"id": "m", "max_model_len": 64}]})

    async def completions(request):
        calls.append(1)
        if len(calls) == 1:
            request.transport.close()
            return web.Response()
        return web.json_response({"choices": [{"text": "x", "token_ids": [5], "finish_reason": "stop",
                                               "logprobs": {"token_logprobs": [-0.5]}}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    server = await aiohttp_server(app)
    pool = BackendPool()
    address = str(server.make_url("")).rstrip("/")
    pool.add(address)
    async with LLMClient(pool=pool, pause_backoff_s=0.01) as client:
        c = await client.complete([1, 2, 3], backend=lambda ex: pool.acquire("j", exclude=ex),
                                  max_tokens=4)
    assert c.token_ids == [5] and c.backend == address and len(calls) == 2
    assert len(pool) == 1 and pool.get(address).consecutive_failures == 0
    pool.report_failure(address, "refused")
    pool.report_failure(address, "refused")
    assert len(pool) == 0  # repeated failures do take it out (the health probe brings it back)
