"""Hardening of the pipeline: a job cancelled while queued never runs its next stage nor leaks a
backend slot; a handler raising SystemExit/KeyboardInterrupt fails its job, not the server."""
from __future__ import annotations

import asyncio

import pytest

from prorl_server.plugin.handler import AgentHandler
from prorl_server.plugin.registry import HandlerRegistry
from prorl_server.app import create_app
from prorl_server.balancer import BackendPool
from prorl_server.config import ServerSettings
from prorl_server.metrics import Metrics
from prorl_server.pipeline import Pipeline
from prorl_server.types import JobState, ProcessRequest

BACKEND = "http://127.0.0.1:9"  # never contacted: the handlers below only take a backend slot


class SlowCloseHandler(AgentHandler):
    """Stands in for a sandboxed LLM handler: init opens a "sandbox" whose close really awaits (a bubblewrap
    sandbox's close waits for its processes to die; here it waits for the test's ``gate``), run takes the
    job's LLM backend (after ``proceed`` when the instance says ``wait_proceed``) and, for a job marked
    ``hold``, keeps its run worker busy until ``release_hold``."""

    name = "slow_close"
    needs_llm = False

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.closing = asyncio.Event()
        self.release_hold = asyncio.Event()
        self.proceed = asyncio.Event()
        self.run_started: dict[str, asyncio.Event] = {}
        self.runs: list[str] = []

    async def init(self, job):
        self.run_started[job.job_id] = asyncio.Event()

        async def close():
            self.closing.set()
            await self.gate.wait()
        job.add_closer(close, "job")

    async def run(self, job):
        self.runs.append(job.job_id)
        self.run_started[job.job_id].set()
        if job.instance.get("hold"):
            await self.release_hold.wait()
        if job.instance.get("wait_proceed"):
            await self.proceed.wait()
        await job.backend()

    async def eval(self, job):
        job.reward = 1.0


async def _until(pred, patience_s: float = 30.0) -> None:
    """Poll ``pred`` (a guard against a hang, not a timing assertion)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience_s
    while not pred():
        assert loop.time() < deadline, "condition never became true"
        await asyncio.sleep(0.005)


async def test_job_cancelled_while_queued_for_run_never_runs_it_nor_leaks_its_backend_slot():
    handler = SlowCloseHandler()
    registry = HandlerRegistry()
    registry.register(handler)
    pool = BackendPool()
    pool.add(BACKEND)
    pipeline = Pipeline(registry, pool, Metrics(), {"init": 4, "run": 1, "eval": 1}, backend_wait_s=5)
    pipeline.start_workers()
    try:
        def submit(job_id, **extra):
            return pipeline.submit(ProcessRequest(job_id=job_id, instance={"data_source": "slow_close", **extra}))

        # "busy" holds the only run worker; "victim" is queued behind it, then "marker" behind the victim
        busy = submit("busy", hold=True)
        await _until(lambda: "busy" in handler.runs)
        victim = submit("victim", wait_proceed=True)
        await _until(lambda: victim.status == JobState.queued_run)
        # cancel it while it waits for the run stage: its _finish awaits the slow sandbox close
        cancel = asyncio.create_task(pipeline.cancel("victim", "DAPO early termination"))
        await handler.closing.wait()
        handler.closing.clear()
        marker = submit("marker")
        await _until(lambda: marker.status == JobState.queued_run)
        handler.release_hold.set()
        # the run worker pops the victim next: either it starts the victim's run (the bug) or skips it
        # and runs the marker
        victim_started = asyncio.create_task(handler.run_started["victim"].wait())
        marker_started = asyncio.create_task(handler.run_started["marker"].wait())
        await asyncio.wait({victim_started, marker_started}, return_when=asyncio.FIRST_COMPLETED)
        handler.gate.set()  # the sandbox close completes; the victim's _finish releases its backend
        assert (await cancel) == (True, JobState.done)
        handler.proceed.set()  # a run that was started anyway would take a backend only now
        for job in (busy, victim, marker):
            await asyncio.wait_for(asyncio.shield(job.done), 30)  # hang guard
        await _until(lambda: pipeline.active["run"] == 0)
        victim_started.cancel()
        marker_started.cancel()
        assert "victim" not in handler.runs
        assert victim.result.critical_error == "cancelled"
        assert busy.result.reward == 1.0 and marker.result.reward == 1.0
        assert [b.in_flight for b in pool.known] == [0]  # no slot held by a job that ended
        assert pool.holder("victim") is None
    finally:
        handler.gate.set()
        handler.release_hold.set()
        handler.proceed.set()
        await pipeline.shutdown()


async def test_a_stage_of_a_cancelled_job_cannot_take_a_backend_or_sandbox():
    """``Job.backend()`` and ``Job.open_sandbox()`` refuse a job that is ending, whatever the path to it."""
    from prorl_server.job import Job, JobEndedError

    pool = BackendPool()
    pool.add(BACKEND)
    opened = []

    class Sandbox:
        """Stands in for a bubblewrap sandbox handle: records its close."""
        async def close(self):
            opened.remove(self)

    async def opener(spec=None, **kw):
        sb = Sandbox()
        opened.append(sb)
        return sb

    job = Job(job_id="j", instance={}, sampling_params={}, handler=None, handler_name="h", timeout_s=None,
              pool=pool, sandbox_opener=opener)
    job.finishing = True
    with pytest.raises(JobEndedError):
        await job.backend()
    with pytest.raises(JobEndedError):
        await job.open_sandbox()
    assert pool.holder("j") is None and opened == []

    # ended while waiting for a backend (a swap in progress): the slot it then gets is given back
    pool.clear()
    job2 = Job(job_id="j2", instance={}, sampling_params={}, handler=None, handler_name="h", timeout_s=None,
               pool=pool, backend_wait_s=30)
    waiting = asyncio.create_task(job2.backend())
    await asyncio.sleep(0.01)
    job2.cancel_requested = True
    pool.add(BACKEND)
    with pytest.raises(JobEndedError):
        await asyncio.wait_for(waiting, 30)
    assert pool.holder("j2") is None and [b.in_flight for b in pool.known] == [0]


# ------------------------------------------------------------------------------------ BaseException


class BaseRaisingHandler(AgentHandler):
    """Stands in for a buggy handler (or a library it calls, e.g. ``sys.exit`` in a CLI tool's main): raises
    the BaseException named by ``instance["raise"]`` in ``instance["stage"]`` (or in final_result / the
    stage's exception callback)."""

    name = "base_raiser"
    needs_llm = False

    async def _maybe(self, job, where):
        if job.instance.get("stage") == where:
            raise {"SystemExit": SystemExit(3), "KeyboardInterrupt": KeyboardInterrupt(),
                   "GeneratorExit": GeneratorExit()}[job.instance["raise"]]

    async def init(self, job):
        async def close():
            await self._maybe(job, "close")
        job.add_closer(close, "run")
        await self._maybe(job, "init")

    async def run(self, job):
        await self._maybe(job, "run")

    async def eval(self, job):
        job.reward = 1.0
        await self._maybe(job, "eval")

    async def run_exception(self, job, exc):
        if job.instance.get("callback_raises"):
            raise SystemExit("callback")

    async def final_result(self, job):
        await self._maybe(job, "final_result")
        return await super().final_result(job)


@pytest.fixture
def base_client(aiohttp_client):
    async def make():
        registry = HandlerRegistry()
        registry.register(BaseRaisingHandler)
        app = create_app(ServerSettings(health_interval_s=3600), registry=registry)
        return await aiohttp_client(app)
    return make


@pytest.mark.parametrize("exc", ["SystemExit", "KeyboardInterrupt", "GeneratorExit"])
@pytest.mark.parametrize("stage", ["init", "run", "eval"])
async def test_handler_raising_base_exception_fails_its_job_not_the_server(base_client, stage, exc):
    client = await base_client()
    r = await client.post("/process", json={"instance": {"data_source": "base_raiser", "stage": stage,
                                                          "raise": exc}})
    assert r.status == 200
    res = await r.json()
    assert res["critical_error"] == stage
    assert res["failure_kind"] == "handler" and res["filter"] is True
    assert exc in res["error"]
    # the server still serves, and runs the next job to its end
    r = await client.post("/process", json={"instance": {"data_source": "base_raiser"}})
    assert (await r.json())["reward"] == 1.0
    assert (await (await client.get("/health")).json()) == {"status": "ok"}


async def test_base_exception_in_final_result_or_exception_callback_fails_the_job_only(base_client):
    client = await base_client()
    r = await client.post("/process", json={"instance": {"data_source": "base_raiser", "stage": "final_result",
                                                          "raise": "SystemExit"}})
    res = await r.json()
    assert "final_result failed: SystemExit" in res["error"]
    r = await client.post("/process", json={"instance": {"data_source": "base_raiser", "stage": "run",
                                                          "raise": "KeyboardInterrupt",
                                                          "callback_raises": True}})
    res = await r.json()
    assert res["critical_error"] == "run" and res["failure_kind"] == "handler"
    assert "run_exception raised SystemExit" in res["error"]
    r = await client.post("/process", json={"instance": {"data_source": "base_raiser"}})
    assert (await r.json())["reward"] == 1.0


async def test_base_exception_closing_a_sandbox_does_not_stop_the_job_or_server(base_client):
    client = await base_client()
    r = await client.post("/process", json={"instance": {"data_source": "base_raiser", "stage": "close",
                                                          "raise": "SystemExit"}})
    res = await r.json()
    assert res["critical_error"] is None and res["reward"] == 1.0
    assert (await (await client.get("/health")).json()) == {"status": "ok"}


class StubbornHandler(AgentHandler):
    """Stands in for a handler (or a library it awaits) that swallows its first cancellation and goes on
    waiting, e.g. a retry loop catching every exception around a long call."""

    name = "stubborn"
    needs_llm = False

    def __init__(self) -> None:
        self.running = asyncio.Event()

    async def run(self, job):
        self.running.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.sleep(3600)


async def test_shutdown_ends_a_job_whose_stage_swallows_its_cancellation():
    handler = StubbornHandler()
    registry = HandlerRegistry()
    registry.register(handler)
    pipeline = Pipeline(registry, BackendPool(), Metrics(), {"init": 1, "run": 1, "eval": 1})
    pipeline.start_workers()
    job = pipeline.submit(ProcessRequest(job_id="s", instance={"data_source": "stubborn"}))
    await asyncio.wait_for(handler.running.wait(), 30)
    await asyncio.wait_for(pipeline.shutdown(grace_s=0.2), 30)  # hang guard
    assert job.finished and job.result.critical_error == "cancelled"
    assert job.result.failure_kind == "cancelled" and pipeline.in_flight == 0
