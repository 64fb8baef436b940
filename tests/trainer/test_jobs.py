"""The one rollout client (trainer_plugins/jobs.py): typed requests and results, the cancel that races a job's
submission, and the server choosers and staleness policies (trainer_plugins/admission.py). Real rollout
servers (the project's app on loopback) serve the ``varied`` stand-in handler (see conftest)."""
from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from prorl_server.types import JobResult
from trainer_plugins.admission import (DropStale, LeastInFlight, RendezvousByGroup, ServerChooser,
                                       StalenessPolicy, WaitForStale, as_server_chooser, as_staleness_policy)
from trainer_plugins.jobs import EXPIRED, ROLLOUT_SERVER, JobSubmitter, process_request
from trainer_plugins.servers import server_for_group


def slow(instance_id: str, sleep_s: float = 30.0) -> dict:
    return {"data_source": "varied", "id": instance_id, "instance_id": instance_id, "sleeps": [sleep_s]}


class Recorder:
    """An aiohttp middleware that records ``(path, job_id)`` of every request as it arrives and can hold
    ``/process`` requests for ``delay_s`` before the server sees them: a stand-in for a request still on the
    network (or in the server's accept queue) when the trainer decides to cancel the job."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.seen: list[tuple[str, str]] = []

        @web.middleware
        async def record(request, handler):
            body = await request.json() if request.can_read_body else {}
            self.seen.append((request.path, body.get("job_id") if isinstance(body, dict) else None))
            if request.path == "/process" and self.delay_s:
                await asyncio.sleep(self.delay_s)
            return await handler(request)

        self.middleware = record


async def test_requests_and_results_are_the_wire_models(serve_handlers, varied):
    url = await serve_handlers(varied)
    request = process_request({"data_source": "varied", "id": "a", "rewards": [1.0]}, {"temperature": 0.5},
                              job_id="typed-1", group_id="g", timeout_s=30)
    assert request.model_dump(mode="json", exclude_none=True) == {
        "instance": {"data_source": "varied", "id": "a", "rewards": [1.0]}, "sampling_params": {"temperature": 0.5},
        "job_id": "typed-1", "group_id": "g", "timeout_s": 30.0}
    async with JobSubmitter() as jobs:
        result = await jobs.submit(url, request)
    assert isinstance(result, JobResult) and result.job_id == "typed-1" and result.reward == 1.0
    assert result.filter is False and result.timing.counted_s >= 0


async def test_a_body_that_is_no_job_result_is_a_filtered_rollout_server_result(aiohttp_server):
    async def process(request):
        return web.json_response({"ok": True})  # a 200 from something that is not a rollout server

    app = web.Application()
    app.router.add_post("/process", process)
    server = await aiohttp_server(app)
    async with JobSubmitter() as jobs:
        r = await jobs.submit(str(server.make_url("")).rstrip("/"), process_request({"data_source": "x"},
                                                                                    job_id="j"))
    assert r.filter is True and r.failure_kind == ROLLOUT_SERVER and "no job result" in r.error


async def test_an_expired_job_is_a_finished_sample_never_resubmitted(aiohttp_server):
    # a server whose journal's retention deleted the job's delivered result answers 410 result_expired: the job
    # ran once; running it again (or a new attempt of the sample) would give the trainer a second sample of it
    calls = []

    async def process(request):
        calls.append((await request.json())["job_id"])
        return web.json_response({"error": {"type": "result_expired", "message": "job was answered; retention "
                                            "deleted its result", "field": "job_id"}}, status=410)

    app = web.Application()
    app.router.add_post("/process", process)
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    async with JobSubmitter() as jobs:
        r = await jobs.submit(url, process_request({"data_source": "x"}, job_id="j"))
        assert r.filter is True and r.failure_kind == EXPIRED and r.critical_error is None
        outcome = await jobs.run([url], process_request({"data_source": "x"}), max_sample_retries=3)
    assert outcome.result.failure_kind == EXPIRED and outcome.attempts == []
    assert len(calls) == 2  # one each: not retried, not re-submitted under a new id


async def test_a_cancel_that_races_the_submission_still_cancels_the_job(serve_handlers, varied, job_state):
    # the /process request reaches the server 1 s after the cancel is sent: the first /cancel answers 404,
    # and the job client asks again while its request is open (far past cancel_patience_s), so the job is
    # cancelled once the server knows it instead of running its 30 s
    rec = Recorder(delay_s=1.0)
    url = await serve_handlers(varied, middlewares=[rec.middleware])
    async with JobSubmitter(cancel_patience_s=0.1) as jobs:
        task = asyncio.ensure_future(jobs.submit(url, process_request(slow("race"), job_id="race-1")))
        while ("/process", "race-1") not in rec.seen:
            await asyncio.sleep(0.01)
        assert jobs.open_jobs() == [(url, "race-1")]
        took = await asyncio.wait_for(jobs.cancel(url, "race-1"), 10)
        result = await asyncio.wait_for(task, 10)
    assert took is True
    assert result.critical_error == "cancelled" and result.filter is True
    assert rec.seen.count(("/cancel", "race-1")) >= 2  # the first one came before the job was known
    assert (await job_state(url, "race-1"))["result"]["critical_error"] == "cancelled"


async def test_a_job_cancelled_before_its_request_is_sent_is_never_sent(serve_handlers, varied):
    rec = Recorder()
    url = await serve_handlers(varied, middlewares=[rec.middleware])
    async with JobSubmitter(cancel_patience_s=0.1) as jobs:
        assert await jobs.cancel(url, "early-1") is False  # unknown everywhere: nothing to stop yet
        result = await jobs.submit(url, process_request(slow("early"), job_id="early-1"))
        assert jobs.was_cancelled("early-1")
        # run() does not re-submit a job its caller cancelled
        outcome = None
        task = asyncio.ensure_future(jobs.run([url], process_request(slow("early2")), max_sample_retries=3,
                                              job_prefix="early2"))
        while not jobs.open_jobs():
            await asyncio.sleep(0.01)
        assert await jobs.cancel_open() == 1
        outcome = await asyncio.wait_for(task, 10)
    assert result.filter is True and result.failure_kind == "cancelled" and result.critical_error == "cancelled"
    assert ("/process", "early-1") not in rec.seen
    assert outcome.result.critical_error == "cancelled" and outcome.attempts == []


async def test_run_fails_over_to_a_server_where_the_sample_has_not_failed(serve_handlers, varied,
                                                                          unused_tcp_port_factory):
    live = await serve_handlers(varied)
    dead = f"http://127.0.0.1:{unused_tcp_port_factory()}"
    chooser = RendezvousByGroup()
    gid = next(g for g in (f"g{k}" for k in range(100)) if server_for_group([dead, live], g) == dead)
    async with JobSubmitter() as jobs:
        outcome = await jobs.run([dead, live], process_request({"data_source": "varied", "id": "f"},
                                                               group_id=gid), chooser=chooser)
    assert [(a.server, a.failure_kind) for a in outcome.attempts] == [(dead, ROLLOUT_SERVER)]
    assert outcome.server == live and outcome.filtered is False


def test_least_in_flight_keeps_a_group_on_one_server_while_it_runs():
    c = LeastInFlight()
    servers = ["a", "b"]
    assert c.choose(servers, "g1") == "a"
    c.started("a", "g1")
    assert c.choose(servers, "g2") == "b"  # the least loaded
    c.started("b", "g2")
    assert c.choose(servers, "g1") == "a"  # g1 stays on a while a job of it runs ...
    c.started("a", "g1")
    assert c.choose(servers, "g1", exclude={"a"}) == "b"  # ... unless the sample failed there
    assert c.choose(["a"], "g1", exclude={"a"}) == "a"  # with no other server left, the same one
    c.finished("a", "g1")
    c.finished("a", "g1")
    assert c.in_flight == {"a": 0, "b": 1}
    assert c.choose(servers, "g1") == "a"  # g1 has no job in flight: chosen afresh (least loaded)
    c.started("a", None)
    c.started("a", None)  # a: 2 jobs, b: 1
    assert c.choose(servers, "g1") == "b"
    with pytest.raises(ValueError):
        c.choose([], "g1")


def test_rendezvous_agrees_across_processes_and_round_robins_ungrouped_jobs():
    servers = ["http://a:1", "http://b:2", "http://c:3"]
    one, two = RendezvousByGroup(), RendezvousByGroup()  # two workers that share nothing
    for g in (f"verl-{k}" for k in range(20)):
        assert one.choose(servers, g) == two.choose(servers, g) == server_for_group(servers, g)
    first = server_for_group(servers, "verl-x")
    assert one.choose(servers, "verl-x", exclude={first}) == server_for_group(
        [s for s in servers if s != first], "verl-x")
    assert [one.choose(servers) for _ in range(3)] == servers


def test_configuration_names_map_to_the_policy_objects():
    assert isinstance(as_server_chooser("least_in_flight"), LeastInFlight)
    assert isinstance(as_server_chooser("rendezvous"), RendezvousByGroup)
    mine = RendezvousByGroup()
    assert as_server_chooser(mine) is mine and isinstance(mine, ServerChooser)
    assert isinstance(as_staleness_policy("drop"), DropStale)
    assert isinstance(as_staleness_policy("wait"), WaitForStale) and isinstance(WaitForStale(), StalenessPolicy)
    with pytest.raises(ValueError, match="least_in_flight"):
        as_server_chooser("fastest")
    with pytest.raises(ValueError, match=r"staleness_policy must be one of \['drop', 'wait'\]"):
        as_staleness_policy("keep")
    with pytest.raises(ValueError):
        as_staleness_policy(object())
    wait, drop = WaitForStale(), DropStale()
    assert wait.due(2, 1) and not wait.due(1, 1) and wait.regenerate()
    assert not drop.due(5, 1) and not drop.regenerate()


def test_rollout_client_and_trl_pick_policies_by_name():
    from trainer_plugins.client import RolloutClient
    from trainer_plugins.trl import ProRLRollout

    client = RolloutClient(["http://127.0.0.1:1"], [], groups_per_step=1, server_chooser="rendezvous",
                           staleness_policy="wait")
    assert isinstance(client.chooser, RendezvousByGroup) and isinstance(client.staleness_policy, WaitForStale)
    assert isinstance(RolloutClient(["http://127.0.0.1:1"], [], groups_per_step=1).chooser, LeastInFlight)
    with pytest.raises(ValueError, match="staleness_policy"):
        RolloutClient(["http://127.0.0.1:1"], [], groups_per_step=1, staleness_policy="fifo")
    rollout = ProRLRollout(["http://127.0.0.1:1"], {"p": {"data_source": "arithmetic"}}, server_chooser="rendezvous")
    assert isinstance(rollout.chooser, RendezvousByGroup)
    assert isinstance(ProRLRollout(["http://127.0.0.1:1"], {}).chooser, LeastInFlight)


async def test_a_completion_time_member_is_retried_on_its_groups_server(aiohttp_server):
    """#35 R9: a filtered completion-time member goes back to the server holding its group, which waits for the
    replacement; sent elsewhere it would be a group of its own there, each server waiting completion_time_wait_s.
    Stub servers stand for rollout servers: the group's answers a sandbox fault (filtered) first, then a result."""
    calls: dict[str, list[str]] = {"a": [], "b": []}

    def stub(name: str) -> web.Application:
        async def process(request):
            job_id = (await request.json())["job_id"]
            calls[name].append(job_id)
            if len(calls[name]) == 1:
                r = JobResult(job_id=job_id, trajectory_id=job_id, handler="x", reward=0.0, resolved=False,
                              critical_error="init", failure_kind="sandbox", filter=True, error="injected")
            else:
                r = JobResult(job_id=job_id, trajectory_id=job_id, handler="x", reward=1.0, resolved=True)
            return web.json_response(r.model_dump(mode="json"))

        app = web.Application()
        app.router.add_post("/process", process)
        return app

    urls = {n: str((await aiohttp_server(stub(n))).make_url("")).rstrip("/") for n in ("a", "b")}
    gid = next(g for g in (f"g{k}" for k in range(100)) if server_for_group([urls["a"], urls["b"]], g) == urls["a"])
    request = process_request({"data_source": "x"}, group_id=gid, group_size=2, speed_weight=1.0)
    async with JobSubmitter() as jobs:
        outcome = await jobs.run([urls["a"], urls["b"]], request, chooser=RendezvousByGroup())
    assert outcome.filtered is False and outcome.server == urls["a"]
    assert len(calls["a"]) == 2 and calls["b"] == []


async def test_a_full_completion_time_group_is_a_filtered_attempt_and_a_size_mismatch_stops(aiohttp_server):
    """#35 R9: ``409 group_full`` (a member of the group still runs, e.g. one whose connection was lost) is a
    filtered attempt, retried; ``409 group_size_mismatch`` is the trainer's mistake, which no retry fixes."""
    from trainer_plugins.jobs import InvalidInstanceError

    async def process(request):
        body = await request.json()
        kind = "group_full" if body["group_size"] == 2 else "group_size_mismatch"
        return web.json_response({"error": {"type": kind, "message": kind, "field": "group_size"}}, status=409)

    app = web.Application()
    app.router.add_post("/process", process)
    url = str((await aiohttp_server(app)).make_url("")).rstrip("/")
    async with JobSubmitter() as jobs:
        r = await jobs.submit(url, process_request({"data_source": "x"}, job_id="j", group_id="g", group_size=2,
                                                   speed_weight=1.0))
        assert r.filter is True and r.failure_kind == ROLLOUT_SERVER and "group_full" in r.error
        with pytest.raises(InvalidInstanceError, match="group_size_mismatch"):
            await jobs.submit(url, process_request({"data_source": "x"}, job_id="k", group_id="g", group_size=3,
                                                   speed_weight=1.0))
