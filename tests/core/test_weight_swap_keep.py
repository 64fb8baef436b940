"""Weight swaps the rollout server orchestrates (``POST /weights/pause`` / ``/weights/resume``): in-flight
turns are frozen in the backends, never aborted; each turn's tokens split exactly into an old-version prefix
and a new-version suffix; ``kv: recompute`` leaves no token attending to KV computed with the old weights;
stale jobs are dropped; a backend that fails a step is withdrawn and its calls move; a trainer that dies does
not leave the fleet paused.

The server is the real one (pipeline, agent, LLM client, ``shout`` handler with the tiny model's tokenizer);
its backends are :class:`prorl_server.dev.fake_vllm.FakeVLLM`, standing for vLLM 0.31's completions and
development endpoints: its tokens are ``1000 + version`` of the weights that generated them, which is the
truth each test compares the server's ``version_runs`` with.
"""
from __future__ import annotations

import asyncio

import pytest

from handlers.shout.handler import ShoutHandler
from prorl_server.app import create_app
from prorl_server.config import ServerSettings
from prorl_server.dev.fake_vllm import TOKEN_BASE, start_fake_vllm
from prorl_server.plugin.registry import HandlerRegistry


@pytest.fixture
async def fleet(aiohttp_client, tiny_model_dir):
    """``start(n_backends, **fake_kwargs) -> (client, fakes, addresses)``: a rollout server with ``shout``
    and ``n`` fake vLLM backends registered with weight version 0."""
    runners = []

    async def start(n: int = 2, **kw):
        fakes, addrs = [], []
        for _ in range(n):
            fake, runner, addr = await start_fake_vllm(**{"step_s": 0.004, **kw})
            runners.append(runner)
            fakes.append(fake)
            addrs.append(addr)
        reg = HandlerRegistry()
        reg.register(ShoutHandler)
        app = create_app(ServerSettings(tokenizer=str(tiny_model_dir), health_interval_s=3600, backends=[]),
                         registry=reg)
        client = await aiohttp_client(app)
        for a in addrs:
            r = await client.post("/add_llm_server", json={"address": a, "weight_version": 0})
            assert r.status == 200
        return client, fakes, addrs

    yield start
    for r in runners:
        await r.cleanup()


def job(i: int, tokens: int = 60) -> dict:
    return {"job_id": f"j{i}", "instance": {"data_source": "shout", "prompt": f"Say something {i}."},
            "sampling_params": {"max_tokens": tokens, "temperature": 1.0}}


async def submit(client, n: int, tokens: int = 60) -> list[str]:
    for i in range(n):
        r = await client.post("/jobs", json=job(i, tokens))
        assert r.status == 202, await r.text()
    return [f"j{i}" for i in range(n)]


async def results(client, ids, wait_done) -> list[dict]:
    return [await wait_done(client, j, patience_s=60) for j in ids]


async def until(cond, patience_s: float = 90.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + patience_s
    while not cond():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.005)


def generated(traj: dict) -> list[int]:
    return [t for t, m in zip(traj["response_ids"], traj["loss_mask"]) if m == 1]


def per_token(traj: dict) -> list:
    return [v for v, n in traj["version_runs"] for _ in range(n)]


async def swap(client, fakes, version: int, *, kv: str = "keep", failed=None, pause_extra=None):
    r = await client.post("/weights/pause", json={"weight_version": version, "kv": kv, **(pause_extra or {})})
    assert r.status == 200, await r.text()
    paused = await r.json()
    before = [sum(len(q.tokens) for q in f.running.values()) for f in fakes]
    await asyncio.sleep(0.1)  # the trainer loads the weights: nothing may be generated meanwhile
    assert [sum(len(q.tokens) for q in f.running.values()) for f in fakes] == before
    for f in fakes:
        f.version = version  # stands for the trainer's load (vLLM /collective_rpc)
    r = await client.post("/weights/resume", json={"swap_id": paused["swap_id"], "weight_version": version,
                                                   "failed": failed or {}})
    assert r.status == 200, await r.text()
    return paused, await r.json()


async def test_a_keep_swap_aborts_nothing_and_splits_every_turn_exactly(fleet, wait_done):
    client, fakes, _ = await fleet(2)
    ids = await submit(client, 8)
    await until(lambda: all(f.running and min(len(q.tokens) for q in f.running.values()) >= 5 for f in fakes))
    paused, resumed = await swap(client, fakes, 1)
    assert set(paused["backends"].values()) == {"paused"} and paused["held_calls"] >= 2
    assert set(resumed["backends"].values()) == {"resumed"}
    out = await results(client, ids, wait_done)
    assert all(r["failure_kind"] is None for r in out), [r["error"] for r in out]
    assert sum(f.counts["aborted"] for f in fakes) == 0
    assert resumed["tokens_discarded"] == 0
    mixed = 0
    for r in out:
        for t in r["trajectories"]:
            truth = [tok - TOKEN_BASE for tok in generated(t)]
            assert per_token(t) == truth  # the recorded version of every token is the one that generated it
            mixed += t["mixed_version_turns"]
            assert sorted(t["weight_versions"]) == sorted(set(truth))
    assert mixed >= 2  # turns really were cut by the swap, and were recorded as such
    state = await (await client.get("/weights")).json()
    assert state["swap"] is None and {b["weight_version"] for b in state["backends"]} == {1}


@pytest.mark.parametrize("kv", ["keep", "recompute"])
async def test_recompute_leaves_no_token_on_old_kv(fleet, wait_done, kv):
    client, fakes, _ = await fleet(1)
    ids = await submit(client, 4)
    await until(lambda: fakes[0].running and min(len(q.tokens) for q in fakes[0].running.values()) >= 5)
    await swap(client, fakes, 1, kv=kv)
    out = await results(client, ids, wait_done)
    assert all(r["failure_kind"] is None for r in out)
    # (version that generated the token, oldest KV version it attended to), over every request the fake served
    pairs = [(tok - TOKEN_BASE, kvv) for req in fakes[0].finished for tok, kvv in zip(req.tokens, req.kv_min)]
    on_old_kv = [p for p in pairs if p[0] == 1 and p[1] == 0]
    if kv == "recompute":
        assert on_old_kv == []
    else:  # keep: frozen requests go on over their old KV (what vLLM's keep mode does)
        assert on_old_kv


async def test_calls_sent_during_a_swap_wait_in_the_server_and_run_on_the_new_weights(fleet, wait_done):
    client, fakes, _ = await fleet(2)
    r = await client.post("/weights/pause", json={"weight_version": 5})
    sid = (await r.json())["swap_id"]
    ids = await submit(client, 4, tokens=8)
    await asyncio.sleep(0.3)
    assert sum(f.counts["requests"] for f in fakes) == 0  # held in the server, not queued at a backend
    for f in fakes:
        f.version = 5
    assert (await client.post("/weights/resume", json={"swap_id": sid})).status == 200
    out = await results(client, ids, wait_done)
    for r in out:
        assert r["failure_kind"] is None
        assert {v for t in r["trajectories"] for v in per_token(t)} == {5}


async def test_stale_jobs_are_dropped_at_pause_and_counted(fleet, wait_done):
    client, fakes, _ = await fleet(1, step_s=0.02)
    ids = await submit(client, 3, tokens=200)
    await until(lambda: len(fakes[0].running) == 3 and min(len(q.tokens) for q in fakes[0].running.values()) >= 2)
    # the jobs' first turns are still running: no first version is recorded yet, so none is stale
    r = await client.post("/weights/pause", json={"weight_version": 3, "max_staleness": 1})
    body = await r.json()
    assert body["dropped_jobs"] == 0
    for f in fakes:
        f.version = 3
    await client.post("/weights/resume", json={"swap_id": body["swap_id"]})
    # wait until every job has its first turn (version 0 for its first tokens)
    await until(lambda: fakes[0].counts["requests"] >= 6, 60)
    r = await client.post("/weights/pause", json={"weight_version": 3, "max_staleness": 1})
    body = await r.json()
    await client.post("/weights/resume", json={"swap_id": body["swap_id"]})
    out = await results(client, ids, wait_done)
    dropped = [x for x in out if x["failure_kind"] == "cancelled"]
    assert body["dropped_jobs"] == len(dropped) >= 1
    assert all("max_staleness" in x["error"] for x in dropped)
    metrics = await (await client.get("/metrics")).text()
    assert f"prorl_weight_swap_dropped_jobs_total {float(len(dropped))}" in metrics


async def test_a_trainer_that_never_resumes_does_not_leave_the_fleet_paused(fleet, wait_done):
    client, fakes, addrs = await fleet(2)
    ids = await submit(client, 4, tokens=30)
    await until(lambda: any(f.running for f in fakes))
    r = await client.post("/weights/pause", json={"weight_version": 9, "lease_s": 0.3})
    sid = (await r.json())["swap_id"]
    fakes[0].version = 9  # the trainer loaded one backend, then died: the server cannot know
    await until(lambda: all(f.paused is None for f in fakes))  # the lease ends: resumed in the engines...
    state = await (await client.get("/weights")).json()
    assert all(b["withdrawn"] and not b["registered"] for b in state["backends"])  # ...and withdrawn
    late = await client.post("/weights/resume", json={"swap_id": sid})
    assert late.status == 409 and (await late.json())["error"]["type"] == "swap_expired"
    assert "prorl_weight_swaps_expired_total 1.0" in await (await client.get("/metrics")).text()
    # the restarted trainer registers each backend with the version it serves; the jobs go on and finish
    for f, a in zip(fakes, addrs):
        await client.post("/add_llm_server", json={"address": a, "weight_version": f.version})
    out = await results(client, ids, wait_done)
    assert all(x["failure_kind"] is None for x in out)
    for x in out:  # no token was served under a version that was not the one generating it
        for t in x["trajectories"]:
            assert per_token(t) == [tok - TOKEN_BASE for tok in generated(t)]


@pytest.mark.parametrize("fault", ["/pause", "/resume", "load"])
async def test_a_backend_that_fails_the_swap_is_withdrawn_and_its_calls_move(fleet, wait_done, fault):
    client, fakes, addrs = await fleet(2)
    ids = await submit(client, 8)
    await until(lambda: all(f.running and min(len(q.tokens) for q in f.running.values()) >= 3 for f in fakes))
    if fault != "load":
        fakes[0].fail.add(fault)
    r = await client.post("/weights/pause", json={"weight_version": 1})
    paused = await r.json()
    for f in fakes:
        f.version = 1
    failed = {addrs[0]: "CUDA out of memory (stands for a failed load)"} if fault == "load" else {}
    r = await client.post("/weights/resume", json={"swap_id": paused["swap_id"], "failed": failed})
    assert r.status == 200
    resumed = await r.json()
    outcome = paused["backends"][addrs[0]] if fault == "/pause" else resumed["backends"][addrs[0]]
    assert outcome not in ("paused", "resumed")
    out = await results(client, ids, wait_done)
    assert all(x["failure_kind"] is None for x in out), [x["error"] for x in out]  # no job lost
    state = await (await client.get("/weights")).json()
    b0 = next(b for b in state["backends"] if b["address"] == addrs[0])
    assert b0["registered"] is False and b0["withdrawn"]
    status = await (await client.get("/status")).json()
    assert [b["address"] for b in status["backends"]] == [addrs[1]]
    # every token kept in a trajectory came from a backend that really had the version recorded for it
    for x in out:
        for t in x["trajectories"]:
            assert per_token(t) == [tok - TOKEN_BASE for tok in generated(t)]


async def test_without_the_progress_extension_a_cut_turn_is_labelled_unknown(fleet, wait_done):
    client, fakes, _ = await fleet(1, progress=False)
    ids = await submit(client, 2)
    await until(lambda: len(fakes[0].running) == 2 and min(len(q.tokens) for q in fakes[0].running.values()) >= 3)
    await swap(client, fakes, 1)
    out = await results(client, ids, wait_done)
    cut = [t for x in out for t in x["trajectories"] if any(v is None for v, _ in t["version_runs"])]
    assert cut and all(t["mixed_version_turns"] >= 1 for t in cut)


async def test_swap_requests_are_checked(fleet):
    client, fakes, _ = await fleet(1)
    r = await client.post("/weights/pause", json={"weight_version": "x"})
    assert r.status == 422
    r = await client.post("/weights/pause", json={"weight_version": 1, "lease_s": 0})
    assert r.status == 422
    r = await client.post("/weights/resume", json={"swap_id": "nope"})
    assert r.status == 409 and (await r.json())["error"]["type"] == "unknown_swap"
    r = await client.post("/weights/pause", json={"weight_version": 1})
    assert r.status == 200
    again = await client.post("/weights/pause", json={"weight_version": 2})
    assert again.status == 409 and (await again.json())["error"]["type"] == "swap_in_progress"
    await client.post("/weights/resume", json={"swap_id": (await r.json())["swap_id"]})


async def test_time_held_by_a_swap_is_not_charged_to_the_jobs_timeout(fleet, wait_done):
    client, fakes, _ = await fleet(1, step_s=0.01)
    body = {**job(0, tokens=20), "timeout_s": 4.0}
    assert (await client.post("/jobs", json=body)).status == 202
    await until(lambda: fakes[0].running and min(len(q.tokens) for q in fakes[0].running.values()) >= 3)
    r = await client.post("/weights/pause", json={"weight_version": 1})
    sid = (await r.json())["swap_id"]
    await asyncio.sleep(5.0)  # a slow load: longer than the job's whole budget
    fakes[0].version = 1
    assert (await client.post("/weights/resume", json={"swap_id": sid})).status == 200
    res = await wait_done(client, "j0", patience_s=30)
    assert res["failure_kind"] is None, res["error"]


@pytest.mark.parametrize("spelling", ["{a}/", "{a}/v1", "{A}"])
async def test_a_failed_backend_is_recognised_however_its_address_is_written(fleet, wait_done, spelling):
    client, fakes, addrs = await fleet(2)
    ids = await submit(client, 4)
    await until(lambda: all(f.running for f in fakes))
    paused = await (await client.post("/weights/pause", json={"weight_version": 1})).json()
    fakes[1].version = 1  # only the second backend loaded
    name = spelling.format(a=addrs[0], A=addrs[0].upper())
    r = await client.post("/weights/resume", json={"swap_id": paused["swap_id"], "failed": {name: "oom"}})
    assert r.status == 200
    assert (await r.json())["backends"][addrs[0]] != "resumed"
    out = await results(client, ids, wait_done)
    for x in out:
        for t in x["trajectories"]:
            assert per_token(t) == [tok - TOKEN_BASE for tok in generated(t)]


async def test_a_failed_address_the_swap_did_not_pause_is_refused_and_the_swap_stays(fleet):
    client, fakes, addrs = await fleet(1)
    paused = await (await client.post("/weights/pause", json={"weight_version": 1})).json()
    r = await client.post("/weights/resume", json={"swap_id": paused["swap_id"],
                                                   "failed": {"http://127.0.0.1:1": "typo"}})
    assert r.status == 422 and (await r.json())["error"]["type"] == "unknown_backend"
    assert (await (await client.get("/weights")).json())["swap"]["swap_id"] == paused["swap_id"]
    assert (await client.post("/weights/resume", json={"swap_id": paused["swap_id"]})).status == 200


async def test_a_job_submitted_during_a_swap_is_not_charged_for_it(fleet, wait_done):
    client, fakes, _ = await fleet(1)
    sid = (await (await client.post("/weights/pause", json={"weight_version": 1})).json())["swap_id"]
    assert (await client.post("/jobs", json={**job(0, tokens=10), "timeout_s": 3.0})).status == 202
    await asyncio.sleep(4.0)  # longer than the job's whole budget, all of it spent waiting for the swap
    fakes[0].version = 1
    await client.post("/weights/resume", json={"swap_id": sid})
    res = await wait_done(client, "j0", patience_s=30)
    assert res["failure_kind"] is None, res["error"]


async def test_an_impossible_progress_report_gives_unknown_labels_not_wrong_ones(fleet, wait_done):
    client, fakes, _ = await fleet(1)
    ids = await submit(client, 2)
    await until(lambda: len(fakes[0].running) == 2 and min(len(q.tokens) for q in fakes[0].running.values()) >= 3)
    real = fakes[0]._rpc

    async def lying(request):  # stands for a misbehaving worker extension: a negative count
        body = await request.json()
        if body.get("method") == "prorl_progress":
            from aiohttp import web
            return web.json_response({"results": [{rid: -5 for rid in fakes[0].running}]})
        return await real(request)
    fakes[0]._rpc = lying
    app_router_swap(fakes[0])
    await swap(client, fakes, 1)
    out = await results(client, ids, wait_done)
    cut = [t for x in out for t in x["trajectories"] if t["mixed_version_turns"]]
    assert cut and all(t["version_runs"][0][0] is None for t in cut)


def app_router_swap(fake) -> None:
    """Point the running fake's /collective_rpc route at its (replaced) ``_rpc``."""
    for route in fake._app.router.routes():
        if route.resource is not None and route.resource.canonical == "/collective_rpc":
            route._handler = lambda request: fake._rpc(request)
