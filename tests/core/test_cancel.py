"""Cancellation at every point of the lifecycle; /stop and /start."""
from __future__ import annotations

import asyncio

import pytest


async def _submit(client, **instance):
    r = await client.post("/jobs", json={"instance": {"data_source": "scripted", **instance}})
    return (await r.json())["job_id"]


async def _wait_state(client, job_id, state, timeout=5.0):
    for _ in range(int(timeout / 0.01)):
        s = await (await client.get(f"/jobs/{job_id}")).json()
        if s.get("state") == state:
            return s
        await asyncio.sleep(0.01)
    raise AssertionError(f"job {job_id} never reached {state}; last {s}")


@pytest.mark.parametrize("stage", ["init", "run", "eval"])
async def test_cancel_in_each_stage_closes_sandbox_and_reports_cancelled(make_client, scripted, stage):
    client = await make_client()
    job_id = await _submit(client, sleep={stage: 30})
    await _wait_state(client, job_id, stage)
    r = await client.post("/cancel", json={"job_id": job_id})
    assert r.status == 200
    assert (await r.json())["cancelled"] is True
    s = await _wait_state(client, job_id, "done", timeout=2)
    assert s["result"]["critical_error"] == "cancelled"
    assert job_id in scripted.closed


async def test_cancel_queued_job_never_runs_it(make_client, scripted):
    client = await make_client(init_workers=1)
    blocker = await _submit(client, sleep={"init": 30})
    await _wait_state(client, blocker, "init")
    queued = await _submit(client)
    assert (await (await client.get(f"/jobs/{queued}")).json())["state"] == "queued_init"
    assert (await (await client.post("/cancel", json={"job_id": queued})).json())["cancelled"] is True
    s = await _wait_state(client, queued, "done")
    assert s["result"]["critical_error"] == "cancelled"
    await client.post("/cancel", json={"job_id": blocker})
    await _wait_state(client, blocker, "done")
    assert not any(jid == queued for jid, _ in scripted.events)


async def test_cancel_is_idempotent_and_leaves_finished_jobs_alone(make_client):
    client = await make_client()
    done = (await (await client.post("/process", json={"instance": {"data_source": "scripted"}})).json())
    r = await client.post("/cancel", json={"job_id": done["job_id"]})
    assert (await r.json()) == {"job_id": done["job_id"], "cancelled": False, "state": "done"}
    s = await (await client.get(f"/jobs/{done['job_id']}")).json()
    assert s["result"]["critical_error"] is None and s["result"]["reward"] == 1.0

    job_id = await _submit(client, sleep={"run": 30})
    await _wait_state(client, job_id, "run")
    first, second = await asyncio.gather(client.post("/cancel", json={"job_id": job_id}),
                                         client.post("/cancel", json={"job_id": job_id}))
    flags = sorted([(await first.json())["cancelled"], (await second.json())["cancelled"]])
    assert flags == [False, True]


async def test_blocking_process_waiter_gets_cancelled_result(make_client):
    client = await make_client()
    waiter = asyncio.create_task(client.post("/process", json={"instance": {"data_source": "scripted",
                                                                            "sleep": {"run": 30}},
                                                               "job_id": "mine"}))
    await _wait_state(client, "mine", "run")
    await client.post("/cancel", json={"job_id": "mine"})
    body = await (await asyncio.wait_for(waiter, 5)).json()
    assert body["critical_error"] == "cancelled" and body["job_id"] == "mine"


async def test_cancel_unknown_job_is_404(make_client):
    client = await make_client()
    r = await client.post("/cancel", json={"job_id": "nope"})
    assert r.status == 404
    assert (await r.json())["error"]["type"] == "unknown_job"


async def test_stop_cancels_in_flight_refuses_new_and_start_resumes(make_client, scripted):
    client = await make_client()
    ids = [await _submit(client, sleep={"run": 30}) for _ in range(3)]
    for j in ids:
        await _wait_state(client, j, "run")
    r = await client.post("/stop")
    assert r.status == 200
    for j in ids:
        s = await (await client.get(f"/jobs/{j}")).json()
        assert s["state"] == "done" and s["result"]["critical_error"] == "cancelled"
        assert j in scripted.closed
    r = await client.post("/process", json={"instance": {"data_source": "scripted"}})
    assert r.status == 503 and (await r.json())["error"]["type"] == "stopped"
    assert (await client.post("/start")).status == 200
    body = await (await client.post("/process", json={"instance": {"data_source": "scripted"}})).json()
    assert body["reward"] == 1.0
