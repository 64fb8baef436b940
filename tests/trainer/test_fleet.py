"""Fleet membership (issue #24), fast tier: the leased records a server keeps (prorl_server/membership.py) and
the reader trainers follow (trainer_plugins/fleet.py), each fault of the issue with its defined outcome, and the
job client's part (a draining server's 503, a server that fails a request, a lease that runs out while a job is
open). Real server processes joining, dying, draining and ending are in test_fleet_real.py."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import aiohttp
from aiohttp import web

from prorl_server.membership import (END_SENTINEL, FleetControl, MemberRecord, Membership, clear_end, end_marker,
                                     members_dir, prune_dead_on_node, write_end, write_record)
from trainer_plugins.fleet import Fleet, is_fleet_dir, open_fleet
from trainer_plugins.jobs import DRAINING, ROLLOUT_SERVER, JobResult, JobSubmitter, process_request


def record(member_id="n1-10-1", url="http://127.0.0.1:1", *, node="elsewhere", pid=None, seq=1, ttl_s=1.0,
           renewed_at=None, **kw) -> MemberRecord:
    now = time.time() if renewed_at is None else renewed_at
    return MemberRecord(member_id=member_id, url=url, host="127.0.0.1", port=int(url.rsplit(":", 1)[1]),
                        pid=os.getpid() if pid is None else pid, node=node, seq=seq, ttl_s=ttl_s, renewed_at=now, expires_at=now + ttl_s, **kw)


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# ------------------------------------------------------------------------------------------ records


def test_a_record_is_written_whole_and_leaves_no_temporary_file(tmp_path):
    r = record(state="draining", capacity=8, backends=2, weight_version=3)
    path = write_record(tmp_path, r)
    assert path == members_dir(tmp_path) / "n1-10-1.json"
    assert MemberRecord.model_validate_json(path.read_bytes()) == r
    assert os.listdir(members_dir(tmp_path)) == ["n1-10-1.json"]


async def test_a_member_renews_its_lease_publishes_its_state_and_removes_its_record_on_exit(tmp_path):
    status = {"backends": 0}
    m = Membership(tmp_path, url="http://127.0.0.1:5", host="127.0.0.1", port=5, ttl_s=0.6, capacity=4,
                   status=lambda: (status["backends"], 7 if status["backends"] else None, 0))
    await m.start()
    first = MemberRecord.model_validate_json(m.path.read_bytes())
    assert (first.state, first.capacity, first.backends, first.pid) == ("active", 4, 0, os.getpid())
    await asyncio.sleep(0.7)  # renewed every ttl/3 = 0.2 s
    second = MemberRecord.model_validate_json(m.path.read_bytes())
    assert second.seq >= first.seq + 2
    status["backends"] = 1  # a backend registered: published within the 0.2 s watch, not at the next renewal
    await asyncio.sleep(0.3)
    assert MemberRecord.model_validate_json(m.path.read_bytes()).backends == 1
    await m.set_state_now("draining")
    assert MemberRecord.model_validate_json(m.path.read_bytes()).state == "draining"
    await m.close()
    assert not m.path.exists()


async def test_a_member_leaves_when_an_end_sentinel_appears_but_not_for_one_left_by_an_earlier_run(tmp_path):
    write_end(tmp_path, "an earlier run")
    ended = asyncio.Event()
    m = Membership(tmp_path, url="http://127.0.0.1:5", host="127.0.0.1", port=5, ttl_s=0.6, on_end=ended.set)
    await m.start()
    await asyncio.sleep(0.5)
    assert not ended.is_set()  # the old sentinel was there when it started
    clear_end(tmp_path)
    assert end_marker(tmp_path) is None
    write_end(tmp_path, "this run's trainer ended")
    await asyncio.wait_for(ended.wait(), 2)
    await m.close()


def test_a_starting_member_removes_the_records_of_dead_processes_on_its_own_node_only(tmp_path):
    write_record(tmp_path, record("here-dead", node="here", pid=dead_pid()))
    write_record(tmp_path, record("here-alive", node="here", pid=os.getpid()))
    write_record(tmp_path, record("there-dead", node="there", pid=dead_pid()))
    assert prune_dead_on_node(tmp_path, "here") == 1
    assert sorted(os.listdir(members_dir(tmp_path))) == ["here-alive.json", "there-dead.json"]


# ------------------------------------------------------------------------------------------ the reader


def test_a_joining_member_is_routable_at_the_next_read_and_a_draining_one_is_not(tmp_path):
    fleet = Fleet(tmp_path, start=False, local_node="b")
    assert list(fleet) == [] and not fleet
    write_record(tmp_path, record("a-1-1", "http://127.0.0.1:1", node="a"))
    write_record(tmp_path, record("b-2-2", "http://127.0.0.1:2", node="b"))
    fleet.refresh()
    assert list(fleet) == ["http://127.0.0.1:2", "http://127.0.0.1:1"]  # same node first
    write_record(tmp_path, record("a-1-1", "http://127.0.0.1:1", node="a", seq=2, state="draining"))
    fleet.refresh()
    assert list(fleet) == ["http://127.0.0.1:2"]
    (members_dir(tmp_path) / "b-2-2.json").unlink()  # a clean exit
    fleet.refresh()
    assert list(fleet) == [] and not fleet.is_lost("http://127.0.0.1:2")


def test_a_lease_that_stops_moving_runs_out_after_ttl_and_a_renewal_brings_the_member_back(tmp_path):
    fleet = Fleet(tmp_path, start=False)
    write_record(tmp_path, record(ttl_s=0.5))
    fleet.refresh()
    assert list(fleet) == ["http://127.0.0.1:1"]
    time.sleep(0.3)
    fleet.refresh()
    assert list(fleet) == ["http://127.0.0.1:1"]  # within its ttl
    time.sleep(0.3)
    fleet.refresh()
    assert list(fleet) == [] and fleet.is_lost("http://127.0.0.1:1")  # 0.6 s with no renewal > ttl 0.5 s
    write_record(tmp_path, record(seq=2, ttl_s=0.5))
    fleet.refresh()
    assert list(fleet) == ["http://127.0.0.1:1"] and not fleet.is_lost("http://127.0.0.1:1")


def test_clock_skew_leases_follow_the_writers_renewal_counter_not_its_wall_clock(tmp_path):
    fleet = Fleet(tmp_path, start=False)
    hour = 3600.0
    # a writer whose clock runs an hour ahead: its expires_at is an hour "in the future" here
    write_record(tmp_path, record("ahead", "http://127.0.0.1:1", ttl_s=0.5, renewed_at=time.time() + hour))
    fleet.refresh()
    assert "http://127.0.0.1:1" in fleet
    time.sleep(0.7)  # ...but it stopped renewing: out, whatever its clock says
    fleet.refresh()
    assert "http://127.0.0.1:1" not in fleet
    # a writer whose clock is an hour behind but renews: in, although its expires_at is long past here
    write_record(tmp_path, record("behind", "http://127.0.0.1:2", ttl_s=0.5, renewed_at=time.time() - hour))
    fleet.refresh()
    assert "http://127.0.0.1:2" not in fleet  # first sight of a record far in the past: stale until it moves
    for seq in (2, 3, 4):
        time.sleep(0.2)
        write_record(tmp_path, record("behind", "http://127.0.0.1:2", ttl_s=0.5, seq=seq,
                                      renewed_at=time.time() - hour))
        fleet.refresh()
        assert "http://127.0.0.1:2" in fleet


def test_a_stale_record_left_by_a_killed_server_is_never_routed_to(tmp_path):
    # long dead elsewhere (its last renewal minutes ago): stale at first sight
    write_record(tmp_path, record("old", "http://127.0.0.1:1", renewed_at=time.time() - 600, ttl_s=5))
    # just killed on this node: its lease has seconds left, but its pid is gone
    write_record(tmp_path, record("here", "http://127.0.0.1:2", node="thisnode", pid=dead_pid(), ttl_s=5))
    fleet = Fleet(tmp_path, start=False, local_node="thisnode")
    assert list(fleet) == []
    assert fleet.is_lost("http://127.0.0.1:1") and fleet.is_lost("http://127.0.0.1:2")


def test_a_corrupt_or_partial_record_is_skipped_and_a_known_member_keeps_its_last_good_record(tmp_path):
    d = members_dir(tmp_path)
    d.mkdir()
    (d / "garbage.json").write_text('{"member_id": "x", "url": ')  # cut mid-write by a foreign tool
    (d / "wrong.json").write_text(json.dumps({"hello": "world"}))
    (d / "list.json").write_text("[1, 2]")
    write_record(tmp_path, record("good", "http://127.0.0.1:1", ttl_s=0.5))
    fleet = Fleet(tmp_path, start=False)
    assert list(fleet) == ["http://127.0.0.1:1"]
    (d / "good.json").write_bytes(b"\x00\xff not json")
    fleet.refresh()
    assert list(fleet) == ["http://127.0.0.1:1"]  # the last good record, whose lease still runs
    time.sleep(0.6)
    fleet.refresh()
    assert list(fleet) == []  # ...and runs out: its seq never moved again


def test_a_briefly_unreadable_directory_keeps_the_last_good_view_and_no_lease_runs_out_meanwhile(tmp_path,
                                                                                              monkeypatch):
    write_record(tmp_path, record("a", "http://127.0.0.1:1", ttl_s=0.4))
    fleet = Fleet(tmp_path, start=False)
    assert list(fleet) == ["http://127.0.0.1:1"]

    def unreadable(*a, **k):
        raise OSError(116, "Stale file handle")

    monkeypatch.setattr(os, "scandir", unreadable)
    monkeypatch.setattr(os, "stat", unreadable)
    monkeypatch.setattr(os, "fstat", unreadable)  # the reader stats members/ through its open descriptor
    for _ in range(4):  # 0.8 s blind: twice the ttl
        time.sleep(0.2)
        fleet.refresh()
        assert list(fleet) == ["http://127.0.0.1:1"]
    assert fleet.read_errors == 4
    monkeypatch.undo()
    write_record(tmp_path, record("a", "http://127.0.0.1:1", ttl_s=0.4, seq=2))
    fleet.refresh()
    assert list(fleet) == ["http://127.0.0.1:1"]


class _Health(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.end_headers()

    def log_message(self, *a):
        pass


def test_a_member_that_renews_its_lease_but_answers_nothing_stays_out_until_a_probe_answers(tmp_path):
    # a server that answers nothing: a listening socket nobody accepts from (connections hang in the backlog)
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(16)
    healthy = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=healthy.serve_forever, daemon=True).start()
    mute_url = f"http://127.0.0.1:{mute.getsockname()[1]}"
    ok_url = f"http://127.0.0.1:{healthy.server_address[1]}"
    try:
        fleet = Fleet(tmp_path, poll_s=0.05, probe_interval_s=0.2, probe_timeout_s=0.5, start=True)
        stop = threading.Event()

        def renew():  # both keep renewing their leases
            seq = 1
            while not stop.is_set():
                write_record(tmp_path, record("mute", mute_url, ttl_s=1.0, seq=seq))
                write_record(tmp_path, record("ok", ok_url, ttl_s=1.0, seq=seq))
                seq += 1
                time.sleep(0.1)

        threading.Thread(target=renew, daemon=True).start()
        deadline = time.monotonic() + 5
        while len(fleet) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(fleet) == sorted([mute_url, ok_url])
        fleet.mark_failed(mute_url, "timed out")
        fleet.mark_failed(ok_url, "reset once")
        assert list(fleet) == []  # out at once, both
        deadline = time.monotonic() + 10
        while ok_url not in fleet and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ok_url in fleet  # the healthy one came back at a probe
        time.sleep(1.0)  # several more probes of the mute one
        assert list(fleet) == [ok_url]  # its probes time out: it stays out while it renews its lease
        assert not fleet.is_lost(mute_url)  # its lease is live: out because it answers nothing, not lost
        stop.set()
        fleet.close()
    finally:
        healthy.shutdown()
        mute.close()


def test_a_fleet_directory_is_told_from_a_servers_json_directory(tmp_path):
    assert is_fleet_dir(tmp_path)
    (tmp_path / "servers.json").write_text("{}")
    assert not is_fleet_dir(tmp_path)
    (tmp_path / "members").mkdir()
    assert is_fleet_dir(tmp_path)
    assert not is_fleet_dir(tmp_path / "absent")
    f = open_fleet(tmp_path)
    assert open_fleet(tmp_path) is f
    f.close()


def test_the_end_sentinel_is_seen_by_readers(tmp_path):
    fleet = Fleet(tmp_path, start=False)
    assert not fleet.ended
    fleet.end("done")
    assert json.loads((tmp_path / END_SENTINEL).read_text())["reason"] == "done"
    fleet.refresh()
    assert fleet.ended


# ------------------------------------------------------------------------------------------ the job client


async def test_a_draining_server_refuses_a_racing_submit_with_503_and_the_client_goes_elsewhere(
        tmp_path, serve_handlers, varied):
    from prorl_server.app import FLEET

    drained_app = []

    @web.middleware
    async def grab(request, handler):
        drained_app.append(request.app)
        return await handler(request)

    a = await serve_handlers(varied, middlewares=[grab])
    b = await serve_handlers(varied)
    write_record(tmp_path, record("a", a, ttl_s=30))
    write_record(tmp_path, record("b", b, ttl_s=30))
    fleet = Fleet(tmp_path, start=False)
    req = process_request({"data_source": "varied", "id": "x", "rewards": [1.0]})
    async with JobSubmitter(fleet=fleet, unavailable_retry_s=30) as jobs:
        first = await jobs.submit(a, req.model_copy(update={"job_id": "j0"}))
        assert first.filter is False
        await drained_app[0][FLEET].start_drain()  # the server drains; the client's view has not caught up
        t0 = time.monotonic()
        refused = await jobs.submit(a, req.model_copy(update={"job_id": "j1"}))
        assert time.monotonic() - t0 < 1.0  # not offered again for unavailable_retry_s like another 503
        assert refused.filter and refused.failure_kind == DRAINING and "draining" in refused.error
        assert list(fleet) == [b]  # out of the rotation at once
        outcome = await jobs.run(fleet, req, job_prefix="r")
    assert outcome.server == b and not outcome.filtered


async def canned_server(aiohttp_server, status: int, body: dict) -> str:
    """A stand-in for a rollout server that answers every ``POST /process`` with ``status`` and ``body`` (a
    draining server's 503, or a job result that says filter), and ``/cancel`` with 404."""
    async def process(request):
        return web.json_response(body, status=status)

    app = web.Application()
    app.router.add_post("/process", process)
    async def cancel(request):
        return web.json_response({}, status=404)

    app.router.add_post("/cancel", cancel)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/")


DRAINING_503 = {"error": {"type": "draining", "message": "this server is draining: it takes no new jobs"}}


def sandbox_fault(job_id="x") -> dict:
    return JobResult(job_id=job_id, trajectory_id=job_id, handler="varied", reward=0.0, critical_error="init",
                     failure_kind="sandbox", filter=True, error="the sandbox did not start").model_dump(mode="json")


async def test_a_drain_refusal_does_not_use_up_the_samples_retries(aiohttp_server, serve_handlers, varied):
    # one retry allowed: the drain (not a fault) is free, the sandbox fault on the next server uses the retry,
    # and the third server delivers. Counted as a fault, the drain would have spent the retry and the sample
    # would end filtered.
    draining = await canned_server(aiohttp_server, 503, DRAINING_503)
    faulty = await canned_server(aiohttp_server, 200, sandbox_fault())
    good = await serve_handlers(varied)
    req = process_request({"data_source": "varied", "id": "x", "rewards": [1.0]})
    async with JobSubmitter(unavailable_retry_s=30) as jobs:
        outcome = await jobs.run([draining, faulty, good], req, max_sample_retries=1, job_prefix="d")
    assert not outcome.filtered and outcome.server == good
    assert [(a.server, a.failure_kind) for a in outcome.attempts] == [(draining, DRAINING), (faulty, "sandbox")]


async def test_a_drain_refusal_counts_when_the_sample_has_nowhere_else_to_go(aiohttp_server):
    # every server drains: the first refusal of each is free, a second one of the same server counts, so the
    # sample ends (filtered, kind draining) instead of going round the drained servers forever
    a = await canned_server(aiohttp_server, 503, DRAINING_503)
    b = await canned_server(aiohttp_server, 503, DRAINING_503)
    req = process_request({"data_source": "varied", "id": "x"})
    async with JobSubmitter(unavailable_retry_s=30) as jobs:
        outcome = await jobs.run([a, b], req, max_sample_retries=1, job_prefix="n")
    assert outcome.filtered and outcome.result.failure_kind == DRAINING
    assert len(outcome.attempts) == 3  # a and b free, then one counted retry, then the last answer


async def test_the_rollout_client_regenerates_a_drained_sample_without_using_up_its_retries(
        aiohttp_server, serve_handlers, varied):
    from trainer_plugins.client import RolloutClient

    draining = await canned_server(aiohttp_server, 503, DRAINING_503)
    good = await serve_handlers(varied)
    dataset = [{"data_source": "varied", "id": f"p{i}", "rewards": [0.0, 1.0]} for i in range(8)]
    # no retry at all: a drain counted as a fault would drop every group sent to the draining server
    client = RolloutClient([draining, good], dataset, groups_per_step=4, n_samples=2, max_staleness=None,
                           max_sample_retries=0)
    try:
        batch = await client.next_batch()
    finally:
        await client.close()
    m = batch.metrics
    assert len(batch.groups) == 4 and {s.server for g in batch.groups for s in g.samples} == {good}
    assert m.groups_dropped_filtered == 0
    assert m.failure_kinds.get(DRAINING, 0) > 0  # samples were sent to the draining server first


async def test_a_server_that_fails_a_request_is_out_of_the_fleet_at_once(tmp_path, serve_handlers, varied):
    b = await serve_handlers(varied)
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead_url = f"http://127.0.0.1:{dead.getsockname()[1]}"
    dead.close()  # nothing listens: connection refused
    write_record(tmp_path, record("dead", dead_url, ttl_s=30))
    write_record(tmp_path, record("b", b, ttl_s=30))
    fleet = Fleet(tmp_path, start=False)
    req = process_request({"data_source": "varied", "id": "x", "rewards": [1.0]})
    async with JobSubmitter(fleet=fleet) as jobs:
        res = await jobs.submit(dead_url, req.model_copy(update={"job_id": "k0"}))
        assert res.filter and res.failure_kind == ROLLOUT_SERVER
        assert list(fleet) == [b]
        outcomes = [await jobs.run(fleet, req, job_prefix=f"k{i}") for i in range(3)]
    assert {o.server for o in outcomes} == {b} and not any(o.filtered for o in outcomes)


async def test_an_open_request_ends_as_a_filtered_result_when_the_servers_lease_runs_out(tmp_path, aiohttp_server):
    async def hang(request):  # a node lost without a reset: the request never ends
        await asyncio.sleep(3600)

    app = web.Application()
    app.router.add_post("/process", hang)
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    write_record(tmp_path, record("lost", url, ttl_s=0.5))
    fleet = Fleet(tmp_path, poll_s=0.05)
    try:
        async with JobSubmitter(fleet=fleet) as jobs:
            t0 = time.monotonic()
            res = await jobs.submit(url, process_request({"data_source": "varied"}, job_id="lost-1"))
            waited = time.monotonic() - t0
    finally:
        fleet.close()
    assert res.filter and res.failure_kind == ROLLOUT_SERVER and "lease" in res.error
    assert waited < 2 * 0.5 + 0.5  # out within 2 x ttl (+ the watch's poll)


async def test_drain_control_waits_for_the_jobs_held_and_reports_what_is_left():
    c = FleetControl()
    left = {"n": 2}

    async def finish():
        await asyncio.sleep(0.2)
        left["n"] = 0

    await c.start_drain()
    assert c.draining and c.exit_requested.is_set()
    task = asyncio.create_task(finish())
    assert await c.wait_drained(lambda: left["n"], timeout_s=5, poll_s=0.02) == 0
    await task
    left["n"] = 1
    assert await c.wait_drained(lambda: left["n"], timeout_s=0.1, poll_s=0.02) == 1


async def test_a_rollout_client_follows_the_fleet_with_no_restart_and_ends_it_on_close(tmp_path, serve_handlers,
                                                                                     varied):
    from trainer_plugins.client import RolloutClient

    a = await serve_handlers(varied)
    b = await serve_handlers(varied)
    ma = Membership(tmp_path, url=a, host="127.0.0.1", port=int(a.rsplit(":", 1)[1]), ttl_s=2)
    mb = Membership(tmp_path, url=b, host="127.0.0.1", port=int(b.rsplit(":", 1)[1]), ttl_s=2)
    await ma.start()
    dataset = [{"data_source": "varied", "id": f"p{i}", "rewards": [0.0, 1.0], "sleeps": [0.05]}
               for i in range(64)]
    client = RolloutClient(str(tmp_path), dataset, groups_per_step=2, n_samples=2, max_staleness=None,
                           end_fleet=True)
    assert client.fleet is not None
    try:
        first = await client.next_batch()
        assert {g.server for g in first.groups} == {a}
        await mb.start()  # a server joins mid-run
        servers = set()
        for _ in range(10):
            batch = await client.next_batch()
            servers |= {g.server for g in batch.groups}
            if b in servers:
                break
        assert b in servers
        await ma.set_state_now("draining")  # and one drains: new groups go to the other only
        while client.fleet.urls() != [b]:
            await asyncio.sleep(0.05)
        seen = time.monotonic()
        later = []
        for _ in range(3):
            later += [g for g in (await client.next_batch()).groups if g.samples[0].submitted_at > seen]
        assert later and {g.server for g in later} == {b}
    finally:
        await client.close()
        await ma.close()
        await mb.close()
        client.fleet.close()
    assert (tmp_path / END_SENTINEL).exists()


async def test_a_member_that_joins_after_a_weight_update_gets_the_trainers_backends_at_the_current_version(
        tmp_path, serve_handlers, varied):
    from trainer_plugins.client import RolloutClient

    a = await serve_handlers(varied)
    b = await serve_handlers(varied)
    ma = Membership(tmp_path, url=a, host="127.0.0.1", port=int(a.rsplit(":", 1)[1]), ttl_s=2)
    mb = Membership(tmp_path, url=b, host="127.0.0.1", port=int(b.rsplit(":", 1)[1]), ttl_s=2)
    await ma.start()
    client = RolloutClient(Fleet(tmp_path), [], groups_per_step=1, max_staleness=None)
    backend = "http://127.0.0.1:9"  # never called: the varied handler needs no LLM

    async def backends_of(url):
        async with client._session.get(f"{url}/status") as r:
            return [(x["address"], x["weight_version"]) for x in (await r.json())["backends"]]

    try:
        await client.update_weights(3, backends=[backend])
        assert await backends_of(a) == [(backend, 3)]
        await mb.start()  # joins after the update
        deadline = time.monotonic() + 5
        while await backends_of(b) != [(backend, 3)]:
            assert time.monotonic() < deadline, "the joining member never got the trainer's backends"
            await asyncio.sleep(0.1)
    finally:
        await client.close()
        await ma.close()
        await mb.close()
        client.fleet.close()


async def test_the_trl_weight_sync_registers_its_backends_with_a_member_that_joins_later(tmp_path, serve_handlers,
                                                                                        varied):
    from types import SimpleNamespace

    pytest.importorskip("transformers")
    from trainer_plugins.trl.rollout import ProRLRollout
    from trainer_plugins.trl.weights import WeightPushCallback

    a = await serve_handlers(varied)
    b = await serve_handlers(varied)
    ma = Membership(tmp_path, url=a, host="127.0.0.1", port=int(a.rsplit(":", 1)[1]), ttl_s=2)
    mb = Membership(tmp_path, url=b, host="127.0.0.1", port=int(b.rsplit(":", 1)[1]), ttl_s=2)
    await ma.start()
    fleet = open_fleet(tmp_path)
    rollout = ProRLRollout(str(tmp_path), [{"data_source": "varied", "prompt": "p"}])
    backend = "http://127.0.0.1:9"  # never called: the varied handler needs no LLM
    sync = WeightPushCallback(rollout, backends=[backend], protocol="legacy")

    async def backends_of(url):
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{url}/status") as r:
                return [(x["address"], x["weight_version"]) for x in (await r.json())["backends"]]

    try:
        assert rollout.urls is fleet
        # TRL calls the callback from its training thread: a thread here, so this loop serves the servers
        state = SimpleNamespace(global_step=0, is_world_process_zero=True)
        await asyncio.to_thread(sync.on_train_begin, SimpleNamespace(), state, None)
        assert await backends_of(a) == [(backend, 0)]
        await mb.start()  # joins after the registration: nothing else would ever register the backends with it
        deadline = time.monotonic() + 10  # hang guard only
        while await backends_of(b) != [(backend, 0)]:
            assert time.monotonic() < deadline, "the joining member never got the trainer's backends"
            await asyncio.sleep(0.05)
    finally:
        await asyncio.to_thread(rollout.close)
        await ma.close()
        await mb.close()
        fleet.close()


async def test_prorl_run_follows_a_fleet_and_registers_its_backends_with_a_member_that_joins(tmp_path,
                                                                                           serve_handlers, varied):
    """``prorl-run --fleet-dir DIR --backend URL``: jobs go to the members of the moment, and a member that joins
    mid-run gets the backends and jobs."""
    from trainer_plugins import run_job

    on_b = []

    @web.middleware
    async def count(request, handler):
        if request.path == "/process":
            on_b.append(request)
        return await handler(request)

    a = await serve_handlers(varied)
    b = await serve_handlers(varied, middlewares=[count])
    ma = Membership(tmp_path / "fleet", url=a, host="127.0.0.1", port=int(a.rsplit(":", 1)[1]), ttl_s=2)
    mb = Membership(tmp_path / "fleet", url=b, host="127.0.0.1", port=int(b.rsplit(":", 1)[1]), ttl_s=2)
    await ma.start()
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"data_source": "varied", "instance_id": f"i{i}", "id": f"i{i}",
                                        "rewards": [1.0], "sleeps": [0.1]}) + "\n" for i in range(60)))
    backend = "http://127.0.0.1:9"  # never called: the varied handler needs no LLM
    args = run_job.build_parser().parse_args(["--dataset", str(data), "--fleet-dir", str(tmp_path / "fleet"),
                                              "--backend", backend, "--concurrency", "2",
                                              "--out", str(tmp_path / "out")])
    run = asyncio.create_task(run_job.run(args))
    try:
        while len(varied.seen) < 4:
            await asyncio.sleep(0.02)
        await mb.start()  # joins mid-run
        await run
    finally:
        await ma.close()
        await mb.close()
    results = [json.loads(line) for line in (tmp_path / "out" / "trajectories.jsonl").read_text().splitlines()]
    assert len(results) == 60 and all(r["reward"] == 1.0 and not r["filter"] for r in results)
    assert {r["job_id"].split("-")[0] for r in results} == {f"i{i}" for i in range(60)}

    async def backends_of(url):
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{url}/status") as r:
                return [x["address"] for x in (await r.json())["backends"]]

    assert await backends_of(b) == [backend]  # the joiner got the backends
    assert on_b  # and jobs


async def test_prorl_run_on_a_missing_fleet_dir_says_at_once_what_it_waits_for(tmp_path, capsys):
    """A mistyped ``--fleet-dir`` is not a silent 60 s wait: the wait is announced at once, naming the path
    and that it does not exist (servers starting beside the run may still create it, so it is not an error)."""
    from trainer_plugins import run_job

    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"data_source": "varied", "instance_id": "i0"}) + "\n")
    missing = tmp_path / "flete"
    args = run_job.build_parser().parse_args(["--dataset", str(data), "--fleet-dir", str(missing),
                                              "--out", str(tmp_path / "out")])
    run = asyncio.create_task(run_job.run(args))
    err = ""
    try:
        for _ in range(200):
            err += capsys.readouterr().err
            if "waiting up to 60 s" in err or run.done():
                break
            await asyncio.sleep(0.02)
        assert f"fleet {missing} (no such directory yet: is the path right?)" in err, err
        # and the wait is not deaf: SIGTERM (or Ctrl-C) ends it at once (main() exits 130), not after 60 s
        t0 = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(run_job.Interrupted, match="no job was submitted"):
            await asyncio.wait_for(run, 10)
        assert time.monotonic() - t0 < 5
    finally:
        run.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await run


def test_prorl_run_refuses_a_server_or_backend_url_without_its_scheme(capsys):
    from trainer_plugins import run_job

    for flag in ("--server", "--backend"):
        with pytest.raises(SystemExit) as e:
            run_job.main(["--dataset", "arithmetic", flag, "127.0.0.1:8080"])
        assert e.value.code == 2
        assert "'127.0.0.1:8080': --server and --backend take URLs that start with http:// or https:// " \
               "(e.g. http://127.0.0.1:8080)" in capsys.readouterr().err


async def test_prorl_run_with_several_servers_moves_the_jobs_of_one_that_does_not_answer(tmp_path, serve_handlers,
                                                                                       varied):
    from trainer_plugins import run_job

    good = await serve_handlers(varied)
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead_url = f"http://127.0.0.1:{dead.getsockname()[1]}"
    dead.close()  # nothing listens: connection refused
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"data_source": "varied", "instance_id": f"i{i}", "id": f"i{i}",
                                        "rewards": [1.0]}) + "\n" for i in range(8)))
    args = run_job.build_parser().parse_args(["--dataset", str(data), "--server", good, "--server", dead_url,
                                              "--out", str(tmp_path / "out")])
    summary = await run_job.run(args)
    assert summary["jobs_finished"] == 8 and summary["mean_reward"] == 1.0


async def test_a_sample_whose_fleet_drained_away_ends_filtered_instead_of_raising(tmp_path, aiohttp_server):
    # red team F10: every member drained while prorl-run ran; the next attempt found no member and raised a
    # ValueError out of JobSubmitter.run, so prorl-run died with a traceback and wrote no summary
    a = await canned_server(aiohttp_server, 503, DRAINING_503)
    write_record(tmp_path, record("a", a, ttl_s=30))
    fleet = Fleet(tmp_path, start=False)
    req = process_request({"data_source": "varied", "id": "x"})
    async with JobSubmitter(fleet=fleet, unavailable_retry_s=0.2) as jobs:
        outcome = await jobs.run(fleet, req, max_sample_retries=2, job_prefix="f")
    assert outcome.filtered and outcome.result.failure_kind == ROLLOUT_SERVER
    assert "no rollout server left in the fleet" in outcome.result.error and "draining" in outcome.result.error
    assert [x.failure_kind for x in outcome.attempts] == [DRAINING]


def test_a_fifo_a_device_link_or_a_huge_file_among_the_records_is_skipped_without_blocking(tmp_path):
    # red team F5: a FIFO in members/ made open_fleet() never return (its reading thread's open blocked) and a
    # server starting on the directory ignored SIGTERM; a symlink to /dev/zero read forever
    import threading

    from prorl_server.membership import MAX_RECORD_BYTES, prune_dead_on_node

    d = tmp_path / "members"
    d.mkdir()
    os.mkfifo(d / "vm-1-1.json")
    os.symlink("/dev/zero", d / "vm-2-2.json")
    (d / "vm-3-3.json").write_bytes(b" " * (MAX_RECORD_BYTES + 1))
    os.mkfifo(tmp_path / "token")
    write_record(tmp_path, record("a", "http://127.0.0.1:1", ttl_s=30))
    done = threading.Event()
    seen = {}

    def read():
        fleet = Fleet(tmp_path, start=False)
        fleet.refresh()
        seen["urls"], seen["headers"] = list(fleet), fleet.headers
        seen["pruned"] = prune_dead_on_node(tmp_path, "vm")
        done.set()

    threading.Thread(target=read, daemon=True).start()
    assert done.wait(10), "reading the fleet directory blocked"
    assert seen == {"urls": ["http://127.0.0.1:1"], "headers": {}, "pruned": 0}


async def test_a_member_that_renews_its_lease_but_never_answers_is_taken_out_and_its_job_resubmitted(
        tmp_path, serve_handlers, varied):
    # red team F7: a member that renews its lease and accepts connections but never answers held its jobs
    # forever (no refusal, no reset, a live lease): 4 of 40 prorl-run jobs hung
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # accepts (the kernel does), never reads or answers
    silent_url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    good = await serve_handlers(varied)
    write_record(tmp_path, record("s", silent_url, ttl_s=3600))
    write_record(tmp_path, record("g", good, ttl_s=3600))
    fleet = Fleet(tmp_path, poll_s=0.05, liveness_interval_s=0.1, liveness_timeout_s=0.2, liveness_failures=2,
                  slurm=None)
    try:
        req = process_request({"data_source": "varied", "id": "x", "rewards": [1.0]})
        async with JobSubmitter(fleet=fleet) as jobs:
            t0 = time.monotonic()
            held = await asyncio.wait_for(jobs.submit(silent_url, req.model_copy(update={"job_id": "h"})), 10)
            assert held.filter and held.failure_kind == ROLLOUT_SERVER and "health probes" in held.error
            assert time.monotonic() - t0 < 5
            assert list(fleet) == [good] and fleet.is_lost(silent_url)
            outcome = await jobs.run(fleet, req, job_prefix="r")
        assert outcome.server == good and not outcome.filtered
    finally:
        fleet.close()
        silent.close()


async def test_servers_show_lists_a_fleet_directorys_live_members(tmp_path, serve_handlers, varied, capsys):
    """``python -m trainer_plugins.servers show DIR`` takes a fleet directory as it takes a servers.json (the
    docs say a fleet directory goes wherever a server list does); an empty one is a clear error, not a
    missing servers.json."""
    from trainer_plugins import servers

    empty = tmp_path / "empty"
    empty.mkdir()
    assert await asyncio.to_thread(servers.main, ["show", str(empty)]) == 1
    assert f"no live member in the fleet {empty}" in capsys.readouterr().err
    a = await serve_handlers(varied)
    m = Membership(tmp_path / "fleet", url=a, host="127.0.0.1", port=int(a.rsplit(":", 1)[1]), ttl_s=2)
    await m.start()
    try:
        assert await asyncio.to_thread(servers.main, ["show", str(tmp_path / "fleet"), "--health"]) == 0
        out = capsys.readouterr().out.split("\t")
        assert out[0] == a and out[-1].strip() == "ok"
    finally:
        await m.close()


# ------------------------------------------------------------------------------------------ proof of membership


async def forger_server(aiohttp_server) -> tuple[str, list]:
    """A co-tenant's server: records every request that reaches it (path and Authorization header)."""
    seen: list[tuple[str, str]] = []

    async def anything(request):
        seen.append((request.path, request.headers.get("Authorization", "")))
        return web.json_response({"error": {"type": "forged", "message": "a co-tenant's server"}}, status=500)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", anything)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/"), seen


def private_token(fleet_dir, token: str, mode: int = 0o600):
    fleet_dir.mkdir(parents=True, exist_ok=True)
    path = fleet_dir / "token"
    path.write_text(token)
    path.chmod(mode)
    return path


async def test_a_forged_record_never_gets_a_job_or_the_token_and_a_signed_member_does(
        tmp_path, aiohttp_server, serve_handlers, varied, caplog):
    # issue #33: the fleet directory trusted any parseable record; a co-tenant who could write it registered a
    # server, received the fleet's bearer token with the next job, and returned reward 1.0
    from prorl_server.membership import canonical_record_bytes, sign_fields

    secret = "fleet-secret"
    private_token(tmp_path, secret)
    good = await serve_handlers(varied, token=secret)  # refuses any request without the fleet's token
    forger, seen = await forger_server(aiohttp_server)
    write_record(tmp_path, record("good", good, ttl_s=3600), token=secret)
    d = members_dir(tmp_path)
    write_record(tmp_path, record("unsigned", forger, ttl_s=3600))
    bad = json.loads(record("badsig", forger, ttl_s=3600).model_dump_json())
    (d / "badsig.json").write_text(json.dumps({**bad, "sig": "0" * 64}))
    write_record(tmp_path, record("otherkey", forger, ttl_s=3600), token="the-forgers-own-key")
    genuine = json.loads((d / "good.json").read_text())  # a genuine record, its address rewritten, signature kept
    (d / "rewritten.json").write_text(json.dumps({**genuine, "member_id": "rewritten", "url": forger}))
    (d / "good-copy.json").write_text(json.dumps({**genuine, "url": forger}))  # and one under another name
    assert sign_fields(genuine, secret) == genuine["sig"] and canonical_record_bytes(genuine)
    caplog.set_level("WARNING", logger="trainer_plugins.fleet")
    fleet = Fleet(tmp_path, start=False, slurm=None)
    for _ in range(3):
        fleet.refresh()
    assert list(fleet) == [good] and fleet.known_urls() == [good]
    assert [r.member_id for r in fleet.records()] == ["good"]
    skipped = [r.getMessage() for r in caplog.records if "not a proven member" in r.getMessage()]
    assert len(skipped) == 5, skipped  # one line per forged file, however often the directory is read
    assert fleet.headers == {"Authorization": f"Bearer {secret}"}
    req = process_request({"data_source": "varied", "id": "x", "rewards": [1.0]})
    async with JobSubmitter(headers=fleet.headers, fleet=fleet) as jobs:
        outcomes = [await jobs.run(fleet, req, job_prefix=f"f{i}") for i in range(6)]
    fleet.probe_liveness()
    assert {o.server for o in outcomes} == {good} and all(o.result.reward == 1.0 for o in outcomes)
    assert seen == []  # no job, no token, not even a probe reached the forger


def test_without_a_token_only_records_of_this_user_in_a_directory_only_it_can_write_are_trusted(tmp_path):
    write_record(tmp_path, record("mine", "http://127.0.0.1:1", ttl_s=3600))
    d = members_dir(tmp_path)
    write_record(tmp_path, record("theirs", "http://127.0.0.1:2", ttl_s=3600))
    os.chown(d / "theirs.json", 4321, 4321)  # written by another local user
    fleet = Fleet(tmp_path, start=False, slurm=None)
    assert list(fleet) == ["http://127.0.0.1:1"] and fleet.headers == {}
    d.chmod(0o775)  # a group-writable members/: anyone in the group could have put "mine" there
    fleet.refresh()
    assert list(fleet) == []
    d.chmod(0o755)
    os.chown(d, 4321, 4321)  # members/ of another user (or a members/ swapped in by one)
    fleet.refresh()
    assert list(fleet) == []
    os.chown(d, os.geteuid(), os.getegid())
    fleet.refresh()
    assert list(fleet) == ["http://127.0.0.1:1"]
    os.rename(d, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", d)  # a link in its place is not the directory that was checked
    fleet.refresh()
    assert list(fleet) == []


def test_a_token_file_planted_by_another_user_or_readable_by_others_is_not_the_fleets_key(tmp_path):
    write_record(tmp_path, record("mine", "http://127.0.0.1:1", ttl_s=3600))
    write_record(tmp_path, record("forged", "http://127.0.0.1:2", ttl_s=3600), token="planted")
    os.chown(members_dir(tmp_path) / "forged.json", 4321, 4321)
    token = private_token(tmp_path, "planted")
    os.chown(token, 4321, 4321)  # the co-tenant made DIR/token first, with a key they know
    fleet = Fleet(tmp_path, start=False, slurm=None)
    assert fleet.headers == {}  # their key is neither sent nor trusted: records are judged by owner
    assert list(fleet) == ["http://127.0.0.1:1"]
    os.chown(token, os.geteuid(), os.getegid())
    token.chmod(0o644)  # ours, but any local user can read it
    fleet.refresh()
    assert fleet.headers == {} and list(fleet) == ["http://127.0.0.1:1"]
    token.chmod(0o600)  # a good token from now on: the unsigned record is checked again, and refused
    fleet.refresh()
    assert fleet.headers == {"Authorization": "Bearer planted"} and list(fleet) == ["http://127.0.0.1:2"]


async def test_a_member_signs_its_record_with_its_token_and_only_readers_with_that_token_route_to_it(tmp_path):
    m = Membership(tmp_path, url="http://127.0.0.1:5", host="127.0.0.1", port=5, ttl_s=30, token="k1")
    await m.start()
    try:
        assert json.loads(m.path.read_text())["sig"]
        assert list(Fleet(tmp_path, start=False, slurm=None, token="k1")) == ["http://127.0.0.1:5"]
        assert list(Fleet(tmp_path, start=False, slurm=None, token="k2")) == []
    finally:
        await m.close()


async def test_a_rollout_client_given_a_token_admits_only_members_that_signed_with_it(tmp_path):
    # a group-writable members/ (a project directory) and no DIR/token: the client's own token is the proof
    from trainer_plugins.client import RolloutClient

    write_record(tmp_path, record("signed", "http://127.0.0.1:1", ttl_s=3600), token="k")
    write_record(tmp_path, record("other", "http://127.0.0.1:2", ttl_s=3600), token="not-k")
    members_dir(tmp_path).chmod(0o775)
    client = RolloutClient(str(tmp_path), [], groups_per_step=1, max_staleness=None, token="k")
    try:
        assert client.fleet is not None and client.fleet.urls() == ["http://127.0.0.1:1"]
        assert client.headers["Authorization"] == "Bearer k"
    finally:
        await client.close()
        client.fleet.close()


async def test_an_end_sentinel_a_co_tenant_wrote_is_ignored_and_the_trainers_signed_one_ends_the_member(tmp_path):
    # a co-tenant who can write the directory wrote DIR/END: every member exited and the launcher released the
    # allocation under a running trainer
    from prorl_server.membership import end_is_proven

    ended = asyncio.Event()
    m = Membership(tmp_path, url="http://127.0.0.1:5", host="127.0.0.1", port=5, ttl_s=0.6, on_end=ended.set,
                   token="k")
    await m.start()
    try:
        (tmp_path / END_SENTINEL).write_text(json.dumps({"reason": "forged", "at": time.time()}))  # unsigned
        await asyncio.sleep(1.3)
        write_end(tmp_path, "signed with another key", token="not-k")
        await asyncio.sleep(1.3)
        assert not ended.is_set()
        Fleet(tmp_path, start=False, slurm=None, token="k").end("the trainer ended")
        await asyncio.wait_for(ended.wait(), 3)
    finally:
        await m.close()
    write_end(tmp_path, "no token anywhere")  # without a token: this uid's END counts, another uid's does not
    assert end_is_proven(tmp_path, None) == (True, "")
    os.chown(tmp_path / END_SENTINEL, 4321, 4321)
    assert end_is_proven(tmp_path, None)[0] is False


def test_prorl_run_refuses_a_token_in_argv_and_takes_a_private_token_file(tmp_path, capsys, monkeypatch):
    from trainer_plugins import run_job

    monkeypatch.delenv("PRORL_TOKEN", raising=False)
    with pytest.raises(SystemExit) as e:
        run_job.main(["--token", "s3cret", "--server", "http://127.0.0.1:1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--token-file" in err and "PRORL_TOKEN" in err
    loose = private_token(tmp_path, "t", mode=0o644)
    with pytest.raises(SystemExit):
        run_job.main(["--token-file", str(loose), "--server", "http://127.0.0.1:1"])
    assert "mode 0644" in capsys.readouterr().err
    loose.chmod(0o600)
    args = run_job.build_parser().parse_args(["--token-file", str(loose)])
    assert run_job.read_token(args) == "t"
    monkeypatch.setenv("PRORL_TOKEN", "from-env")
    assert run_job.read_token(run_job.build_parser().parse_args([])) == "from-env"


# ------------------------------------------------------------------------------------------ a co-tenant (#33 part 6)


def _as_other_user(fn) -> int:
    """Run ``fn`` in a child that has dropped to uid/gid 65534 (a co-tenant); its exit status (0: ``fn`` ran
    without raising)."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            fn()
            os._exit(0)
        except BaseException:
            os._exit(1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second local user")
async def test_a_co_tenant_who_can_write_the_fleet_directory_cannot_rename_the_end_or_members_away(tmp_path):
    # red team F2a/F3/F4: in a group-writable fleet directory a co-tenant renamed the trainer's END away (the
    # fleet never ended) and members/ (servers wrote into her directory; the trainer saw none)
    d = tmp_path / "fleet"
    d.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(d, 0o777)  # stands for a project directory the co-tenant's group may write
    m = Membership(d, url="http://127.0.0.1:5", host="127.0.0.1", port=5, ttl_s=0.6, token="k")
    await m.start()
    try:
        write_end(d, "the trainer ended", token="k")
        assert os.stat(d).st_mode & 0o1777 == 0o1777  # sticky, its other bits kept
        assert os.stat(d / "members").st_mode & 0o7777 == 0o1755
        assert _as_other_user(lambda: os.rename(d / END_SENTINEL, d / "hidden")) != 0
        assert _as_other_user(lambda: os.rename(d / "members", d / "old")) != 0
        assert _as_other_user(lambda: os.unlink(m.path)) != 0
        assert (d / END_SENTINEL).exists() and m.path.exists()
    finally:
        await m.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to own a directory as another user")
async def test_a_server_refuses_a_fleet_directory_of_another_user_that_others_can_write_without_the_sticky_bit(
        tmp_path):
    from prorl_server.membership import FleetDirError

    d = tmp_path / "fleet"
    d.mkdir(mode=0o777)
    os.chmod(d, 0o777)
    os.chown(d, 65534, 65534)
    m = Membership(d, url="http://127.0.0.1:5", host="127.0.0.1", port=5, ttl_s=0.6, token="k")
    with pytest.raises(FleetDirError, match="chmod \\+t"):
        await m.start()
    os.chmod(d, 0o1777)  # its owner made it sticky: joining is fine
    await m.start()
    await m.close()


async def test_a_member_whose_members_directory_is_replaced_says_why_and_exits_instead_of_leaving_silently(
        tmp_path, caplog):
    # red team F4: members/ replaced by a plain file: every renewal failed, the server fell out of the fleet and
    # kept serving with a warning-level line per renewal and nothing in /health
    lost: list[str] = []
    m = Membership(tmp_path, url="http://127.0.0.1:5", host="127.0.0.1", port=5, ttl_s=0.6, on_lost=lost.append)
    await m.start()
    try:
        os.rename(tmp_path / "members", tmp_path / "gone")
        (tmp_path / "members").write_text("x")
        await asyncio.sleep(1.5)
        assert m.problem and "not a directory" in m.problem
        assert len(lost) == 1 and "not a directory" in lost[0]
        assert [r.levelname for r in caplog.records if "not a directory" in r.getMessage()].count("ERROR") >= 1
    finally:
        await m.close()


async def test_an_end_of_an_earlier_run_put_back_in_the_directory_does_not_stop_this_run(tmp_path):
    # red team F2b: run 1's genuine signed END, renamed aside and renamed back during run 2, stopped run 2's
    # servers within 4 s
    write_end(tmp_path, "run 1 ended", token="k")
    os.rename(tmp_path / END_SENTINEL, tmp_path / ".kept-END")
    await asyncio.sleep(0.05)  # the file system's clock moves on
    ended = asyncio.Event()
    m = Membership(tmp_path, url="http://127.0.0.1:5", host="127.0.0.1", port=5, ttl_s=0.6, on_end=ended.set,
                   token="k")
    await m.start()
    try:
        os.rename(tmp_path / ".kept-END", tmp_path / END_SENTINEL)
        await asyncio.sleep(1.5)
        assert not ended.is_set()
        Fleet(tmp_path, start=False, slurm=None, token="k").end("run 2 ended")  # this run's END still counts
        await asyncio.wait_for(ended.wait(), 3)
    finally:
        await m.close()
