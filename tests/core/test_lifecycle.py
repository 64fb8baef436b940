"""Job lifecycle through real HTTP: results, timing, timeouts, exception callbacks, worker resilience."""
from __future__ import annotations

import asyncio

import pytest


def scripted_job(**kw):
    return {"instance": {"data_source": "scripted", **kw}}


async def test_process_returns_full_result_with_float_reward(make_client):
    client = await make_client()
    r = await client.post("/process", json={"instance": {"data_source": "arithmetic", "expression": "2*(3+4)",
                                                         "answer": 14, "instance_id": "p1"}})
    assert r.status == 200
    body = await r.json()
    assert body["reward"] == 1.0 and isinstance(body["reward"], float)
    assert body["resolved"] is True and body["critical_error"] is None
    assert body["instance_id"] == "p1" and body["handler"] == "arithmetic"
    for key in ("job_id", "trajectory_id", "messages", "trajectories", "timing", "backend", "weight_version",
                "filter", "error"):
        assert key in body
    t = body["timing"]
    assert t["counted_s"] == pytest.approx(t["init_s"] + t["run_s"] + t["eval_s"], abs=1e-6)


async def test_wrong_answer_gets_zero_reward_not_dropped(make_client):
    client = await make_client()
    r = await client.post("/process", json={"instance": {"data_source": "calc", "expression": "1+1", "answer": 3}})
    body = await r.json()
    assert body["reward"] == 0.0 and body["resolved"] is False and body["handler"] == "arithmetic"


async def test_nonblocking_submit_then_poll_until_done(make_client):
    client = await make_client()
    r = await client.post("/jobs", json=scripted_job(sleep={"run": 0.2}))
    assert r.status == 202
    job_id = (await r.json())["job_id"]
    states = set()
    for _ in range(100):
        s = await (await client.get(f"/jobs/{job_id}")).json()
        states.add(s["state"])
        if s["state"] == "done":
            break
        await asyncio.sleep(0.02)
    assert "run" in states and s["state"] == "done"
    assert s["result"]["reward"] == 1.0


@pytest.mark.parametrize("stage", ["init", "run", "eval"])
async def test_stage_exception_goes_to_callback_and_yields_result(make_client, scripted, stage):
    client = await make_client()
    body = await (await client.post("/process", json=scripted_job(fail_in=stage))).json()
    assert body["critical_error"] == stage
    assert f"injected failure in {stage}" in body["error"]
    assert "RuntimeError" in body["traceback"]
    assert body["extra"]["seen_exception"] == "RuntimeError"
    assert (body["job_id"], f"{stage}_exception") in scripted.events
    assert body["job_id"] in scripted.closed  # the stand-in sandbox was closed
    assert body["reward"] == 0.0


async def test_exception_callback_that_raises_still_yields_result(make_client):
    client = await make_client()
    body = await (await client.post("/process", json=scripted_job(fail_in="run", callback_raises=True))).json()
    assert body["critical_error"] == "run"
    assert "run_exception raised ValueError" in body["error"]


async def test_timeout_ends_job_and_closes_resources(make_client, scripted):
    client = await make_client()
    body = await (await client.post("/process", json={**scripted_job(sleep={"run": 30}), "timeout_s": 0.3})).json()
    assert body["critical_error"] == "timeout"
    assert body["timing"]["timeout_triggered"] is True
    assert 0.25 <= body["timing"]["counted_s"] < 5
    assert body["job_id"] in scripted.closed


async def test_default_timeout_applies_when_job_sets_none(make_client):
    client = await make_client(default_timeout_s=0.2)
    body = await (await client.post("/process", json=scripted_job(sleep={"init": 30}))).json()
    assert body["critical_error"] == "timeout"


async def test_handler_raised_timeout_error_is_a_stage_failure_not_job_timeout(make_client):
    client = await make_client()
    body = await (await client.post("/process", json={**scripted_job(handler_timeout_in="run"),
                                                       "timeout_s": 60})).json()
    assert body["critical_error"] == "run"
    assert body["timing"]["timeout_triggered"] is False


async def test_queue_wait_is_not_charged_against_timeout(make_client):
    client = await make_client(init_workers=1, run_workers=1, eval_workers=1)
    blocker = asyncio.create_task(client.post("/process", json=scripted_job(sleep={"init": 0.6})))
    await asyncio.sleep(0.05)
    r = await client.post("/process", json={**scripted_job(sleep={"run": 0.05}), "timeout_s": 0.4})
    body = await r.json()
    assert body["critical_error"] is None, body["error"]
    assert body["timing"]["queue_s"] >= 0.4  # waited behind the blocker ...
    assert body["timing"]["counted_s"] < 0.4  # ... but only stage time counted
    await blocker


async def test_failing_jobs_never_kill_the_worker_pool(make_client):
    client = await make_client(init_workers=2, run_workers=2, eval_workers=2)
    bodies = await asyncio.gather(*(client.post("/process", json=scripted_job(fail_in=s))
                                    for s in ["init", "run", "eval"] * 10))
    assert all(b.status == 200 for b in bodies)
    ok = await (await client.post("/process", json=scripted_job())).json()
    assert ok["critical_error"] is None and ok["reward"] == 1.0
    status = await (await client.get("/status")).json()
    assert status["jobs_in_flight"] == 0
    assert all(s["active"] == 0 and s["queued"] == 0 for s in status["stages"].values())


async def test_metrics_count_jobs_by_outcome_and_stage_latency(make_client):
    client = await make_client()
    await client.post("/process", json=scripted_job())
    await client.post("/process", json=scripted_job(fail_in="eval", malformed_tool_calls=3))
    text = await (await client.get("/metrics")).text()
    assert 'prorl_tool_parse_errors_total{handler="scripted"} 3.0' in text
    assert 'prorl_jobs_total{handler="scripted",outcome="ok"} 1.0' in text
    assert 'prorl_jobs_total{handler="scripted",outcome="eval"} 1.0' in text
    assert 'prorl_stage_latency_seconds_count{stage="run"} 2.0' in text
    assert "prorl_stage_queue_depth" in text


async def test_finished_jobs_are_kept_up_to_the_limit_then_forgotten_oldest_first(make_client):
    client = await make_client(keep_finished=3)
    ids = [(await (await client.post("/process", json=scripted_job())).json())["job_id"] for _ in range(5)]
    states = [(await client.get(f"/jobs/{j}")).status for j in ids]
    assert states == [404, 404, 200, 200, 200]


async def test_stopping_the_server_closes_every_component_in_one_order(make_client, scripted):
    # Spies on the real components record when each is closed; nothing is replaced.
    from prorl_server.app import COMPONENTS

    client = await make_client()
    c = client.app[COMPONENTS]
    assert c.services.gateway is c.gateway and c.pipeline.services is c.services  # one of each, wired
    session = await (await client.post("/sessions", json={})).json()
    job_id = (await (await client.post("/jobs", json=scripted_job(sleep={"run": 30}))).json())["job_id"]
    while (await (await client.get(f"/jobs/{job_id}")).json())["state"] != "run":
        await asyncio.sleep(0.01)
    job = c.pipeline.get(job_id)
    assert job.services is c.services and job.llm is c.llm
    order = []
    for name, obj, method in (("gateway", c.gateway, "close"), ("pipeline", c.pipeline, "shutdown"),
                              ("llm", c.llm, "close"), ("cpu_pool", c.cpu_pool, "close"),
                              ("runtime", c, "_close_sandboxes"), ("loop_monitor", c.loop_monitor, "stop")):
        def spy(real=getattr(obj, method), name=name):
            async def call(*a, **kw):
                order.append(name)
                return await real(*a, **kw)
            return call
        setattr(obj, method, spy())
    janitor, health = c.gateway._janitor, c._health
    await client.close()
    # on_shutdown cancels the jobs first (a blocking /process answers at once); then the written close order
    assert order == ["pipeline", "gateway", "pipeline", "llm", "cpu_pool", "runtime", "loop_monitor"]
    assert job.result.critical_error == "cancelled" and scripted.closed == [job_id]
    s = c.gateway.lookup(session["session_id"])
    assert (s.state, s.end_reason) == ("expired", "server_shutdown")
    assert janitor.done() and health.done() and c._health_session.closed
