"""Group affinity: the n samples of one prompt (``group_id``) run on one LLM backend when load allows, so the
backend's prefix cache holds their shared prompt once; under skew they spread by least-in-flight. On the
trainer side, ``RolloutClient`` sends a group to one rollout server with its ``group_id``."""
from __future__ import annotations

import asyncio
import re
from collections import Counter

import pytest
from aiohttp import web

from prorl_server.balancer import BackendPool
from trainer_plugins.client import RolloutClient
from trainer_plugins.servers import server_for_group


def loads(pool: BackendPool) -> dict[str, int]:
    return {b.address: b.in_flight for b in pool.backends}


async def test_a_group_shares_one_backend_under_light_load():
    outcomes = []
    pool = BackendPool(affinity_slack=8, on_affinity=outcomes.append)
    for port in (1, 2, 3):
        pool.add(f"http://b:{port}")
    placed = {pool.assign(f"g-{i}", group="g").address for i in range(6)}
    assert len(placed) == 1  # least-in-flight alone would have spread them 2-2-2
    assert Counter(outcomes) == {"hit": 5}  # the first job picks the group's backend: not counted
    assert pool.affinity == {"hit": 5, "miss": 0}
    # the next group starts on the least-loaded backend, not on the busy one
    assert pool.assign("h-0", group="h").address not in placed


async def test_groups_spread_when_their_backend_is_loaded_beyond_the_slack():
    pool = BackendPool(affinity_slack=1)
    a, b = pool.add("http://a:1"), pool.add("http://b:1")
    got = [pool.assign(f"g-{i}", group="g") for i in range(4)]
    # g-0 -> a (1, 0); g-1 -> a: 1 <= 0 + 1 (2, 0); g-2 -> b: 2 > 0 + 1 (2, 1); g-3 -> a: 2 <= 1 + 1 (3, 1)
    assert got == [a, a, b, a]
    assert pool.affinity == {"hit": 2, "miss": 1}
    # a big group: it uses its backend while that stays within the slack, then spills over, so the load
    # never drifts further apart than the slack allows
    for i in range(20):
        pool.assign(f"big-{i}", group="big")
        assert max(loads(pool).values()) - min(loads(pool).values()) <= 1 + 1
    assert pool.affinity["hit"] > 2 and pool.affinity["miss"] > 1


async def test_slack_zero_keeps_plain_least_in_flight_with_the_group_as_tie_breaker():
    pool = BackendPool(affinity_slack=0)
    for port in (1, 2):
        pool.add(f"http://b:{port}")
    first = pool.assign("g-0", group="g").address
    pool.assign("other")  # the other backend: now tied at 1 each
    assert pool.assign("g-1", group="g").address == first  # the tie goes to the group's backend
    assert pool.assign("g-2", group="g").address != first  # 2 > 1: least-in-flight wins
    assert pool.affinity == {"hit": 1, "miss": 1}


async def test_a_group_whose_backend_left_the_rotation_moves_with_its_next_job():
    pool = BackendPool()
    a, b = pool.add("http://a:1"), pool.add("http://b:1")
    assert pool.assign("g-0", group="g") is a
    pool.mark_unhealthy("http://a:1")
    assert pool.assign("g-1", group="g") is b
    assert pool.assign("g-2", group="g") is b  # the group now lives on b
    assert pool.affinity == {"hit": 1, "miss": 1}


async def test_a_group_keeps_its_backend_through_a_weight_swap():
    pool = BackendPool()
    a = pool.add("http://a:1", 1)
    pool.add("http://b:1", 1)
    assert pool.assign("g-0", group="g") is a
    pool.clear()
    pool.add("http://b:1", 2)
    pool.add("http://a:1", 2)
    assert pool.assign("g-1", group="g") is a  # same address, same backend: its prefix cache
    assert pool.affinity == {"hit": 1, "miss": 0}


async def test_failover_of_a_group_job_is_no_placement_decision():
    pool = BackendPool()
    a, b = pool.add("http://a:1"), pool.add("http://b:1")
    assert pool.assign("g-0", group="g") is a
    assert pool.assign("g-0", exclude=frozenset({a.address}), group="g") is b
    assert pool.affinity == {"hit": 0, "miss": 0}
    assert (a.in_flight, b.in_flight) == (0, 1)


async def test_remembered_groups_are_bounded():
    pool = BackendPool(max_groups=3)
    pool.add("http://a:1")
    for g in range(10):
        pool.assign(f"{g}", group=f"g{g}")
    assert len(pool._groups) == 3


async def test_group_jobs_through_the_server_share_a_backend_and_the_metric_counts(make_client):
    client = await make_client(affinity_slack=8)
    for port in (9, 10):
        await client.post("/add_llm_server", json={"address": f"http://127.0.0.1:{port}"})
    jobs = []
    for i in range(4):
        r = await client.post("/jobs", json={"instance": {"data_source": "llm_holder", "hold_s": 0.3},
                                             "group_id": "prompt-7"})
        assert r.status == 202
        jobs.append((await r.json())["job_id"])
    backends_used = set()
    for j in jobs:
        for _ in range(1000):
            s = await (await client.get(f"/jobs/{j}")).json()
            if s["state"] == "done":
                break
            await asyncio.sleep(0.02)
        backends_used.add(s["result"]["backend"])
    assert len(backends_used) == 1
    metrics = await (await client.get("/metrics")).text()
    counts = dict(re.findall(r'prorl_backend_affinity_total\{outcome="(\w+)"\} ([\d.]+)', metrics))
    assert counts == {"hit": "3.0", "miss": "0.0"}


@pytest.mark.parametrize("bad", ["", 7, "x" * 201])
async def test_a_bad_group_id_is_refused_with_the_field_named(make_client, bad):
    client = await make_client()
    r = await client.post("/jobs", json={"instance": {"data_source": "arithmetic"}, "group_id": bad})
    body = await r.json()
    assert r.status == 422 and body["error"]["field"] == "group_id"


# ---------------------------------------------------------------------------------------------- trainer side


def recording_server():
    """A small app standing for a rollout server's ``/process``: records each body, answers a result with
    reward 0 or 1 alternating per group (so DAPO keeps every group)."""
    bodies: list[dict] = []

    async def process(request):
        body = await request.json()
        bodies.append(body)
        await asyncio.sleep(0.01)
        k = int(body["job_id"].rsplit("-s", 1)[1])
        return web.json_response({"job_id": body["job_id"], "trajectory_id": body["job_id"], "handler": "varied",
                                  "reward": float(k % 2), "critical_error": None, "trajectories": [],
                                  "weight_version": 0})

    async def cancel(request):
        body = await request.json()
        return web.json_response({"job_id": body["job_id"], "cancelled": False, "state": "done"})

    app = web.Application()
    app.router.add_post("/process", process)
    app.router.add_post("/cancel", cancel)
    return app, bodies


async def test_rollout_client_sends_a_group_to_one_server_with_its_group_id(aiohttp_server):
    servers = [recording_server() for _ in range(2)]
    urls = [str((await aiohttp_server(app)).make_url("")).rstrip("/") for app, _ in servers]
    data = [{"data_source": "varied", "id": f"p{i}"} for i in range(4)]
    async with RolloutClient(urls, data, groups_per_step=4, n_samples=4, max_staleness=None,
                             max_epochs=1) as client:
        batch = await asyncio.wait_for(client.next_batch(), 60)
    assert len(batch.groups) == 4
    by_group: dict[str, set[str]] = {}
    for url, (_, bodies) in zip(urls, servers):
        for body in bodies:
            assert body["group_id"] == body["job_id"].rsplit("-a", 1)[0]  # <prefix>-<uid>, shared by the group
            by_group.setdefault(body["group_id"], set()).add(url)
    assert len(by_group) == 4 and all(len(s) == 1 for s in by_group.values())  # one server per group
    assert {g.server for g in batch.groups} == set(urls)  # groups spread over the servers
    assert all({s.server for s in g.samples} == {g.server} for g in batch.groups)


def test_server_for_group_is_stable_and_spreads():
    urls = [f"http://s{k}:8080" for k in range(4)]
    picks = Counter(server_for_group(urls, f"uid-{i}") for i in range(4000))
    assert set(picks) == set(urls) and min(picks.values()) > 800  # about 1000 each
    assert all(server_for_group(urls, f"uid-{i}") == server_for_group(list(reversed(urls)), f"uid-{i}")
               for i in range(100))  # independent of the list's order: every worker agrees
    # removing a server moves only the groups it had
    moved = [i for i in range(1000) if server_for_group(urls, f"uid-{i}") != urls[3]
             and server_for_group(urls[:3], f"uid-{i}") != server_for_group(urls, f"uid-{i}")]
    assert moved == []
    with pytest.raises(ValueError):
        server_for_group([], "g")
