"""Admission control (prorl_server.admission, issue #26): a server admits jobs into their stages only up to a
limit that adapts to its event loop, so thousands of jobs in flight do not stall it. What a user notices:
jobs beyond the limit wait as queued (their wait is queue time, not charged to their timeout), a job
cancelled while it waits ends ``cancelled`` at once and frees nothing it did not hold, every job still ends,
and the limit falls only when the loop's own work makes it late."""
from __future__ import annotations

import asyncio

import pytest

from prorl_server.admission import AdmissionGate
from prorl_server.balancer import BackendPool
from prorl_server.metrics import Metrics
from prorl_server.pipeline import Pipeline
from prorl_server.plugin import AgentHandler
from prorl_server.plugin.registry import HandlerRegistry
from prorl_server.types import JobState, ProcessRequest


class Gate(AgentHandler):
    """Runs until the test opens its event; counts how many jobs are inside their run stage at once."""

    name = "gate"
    needs_llm = False

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.running = 0
        self.most = 0

    async def init(self, job) -> None:
        pass

    async def run(self, job) -> None:
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await self.open.wait()
        finally:
            self.running -= 1

    async def eval(self, job) -> None:
        job.reward = 1.0


async def _until(cond, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def test_jobs_beyond_the_limit_wait_queued_and_all_end_when_slots_free():
    handler = Gate()
    registry = HandlerRegistry()
    registry.register(handler)
    pipeline = Pipeline(registry, BackendPool(), Metrics(), {"init": 8, "run": 8, "eval": 8})
    pipeline.admission = AdmissionGate(initial_limit=2, min_limit=2, max_limit=2)
    pipeline.start_workers()
    try:
        jobs = [pipeline.submit(ProcessRequest(instance={"data_source": "gate"}, timeout_s=30.0)) for _ in range(5)]
        await _until(lambda: handler.running == 2)
        await asyncio.sleep(0.05)
        assert handler.running == 2 and pipeline.admission.waiting == 3
        assert sorted(j.status.value for j in jobs).count(JobState.queued_init.value) == 3
        # cancelled while it waits for admission: ends at once, and holds no slot
        waiting = next(j for j in jobs if j.status == JobState.queued_init)
        cancelled, _ = await pipeline.cancel(waiting.job_id)
        assert cancelled and waiting.result.critical_error == "cancelled"
        handler.open.set()
        results = await asyncio.wait_for(asyncio.gather(*(j.done for j in jobs)), 10)
        assert [r.critical_error for r in results].count(None) == 4 and handler.most == 2
        assert pipeline.admission.admitted == 0 and pipeline.admission.waiting == 0
        # the wait for admission is queue time, not counted time
        assert max(r.timing.queue_s for r in results if r.critical_error is None) > 0.04
    finally:
        await pipeline.shutdown()


async def test_a_shutdown_ends_the_jobs_that_wait_for_admission():
    handler = Gate()
    registry = HandlerRegistry()
    registry.register(handler)
    pipeline = Pipeline(registry, BackendPool(), Metrics(), {"init": 4, "run": 4, "eval": 4})
    pipeline.admission = AdmissionGate(initial_limit=1, min_limit=1, max_limit=1)
    pipeline.start_workers()
    jobs = [pipeline.submit(ProcessRequest(instance={"data_source": "gate"})) for _ in range(3)]
    await _until(lambda: handler.running == 1 and pipeline.admission.waiting == 2)
    await pipeline.shutdown(grace_s=2.0)
    results = [j.done.result() for j in jobs]
    assert [r.critical_error for r in results] == ["cancelled"] * 3


async def test_the_limit_falls_when_the_loop_is_busy_and_late_not_when_another_process_had_the_core():
    gate = AdmissionGate(target_lag_s=0.005, initial_limit=100, min_limit=10, cooldown_s=0.0)
    for _ in range(100):
        await gate.acquire()
    gate.observe(0.2, busy=0.1)  # late, but the loop's thread was hardly on the CPU: admitting fewer won't help
    assert gate.limit == 100
    gate.observe(0.2, busy=0.95)  # late because of its own work: cut
    assert gate.limit == 80 and gate.cuts == 1
    gate.observe(0.4, busy=0.35)  # starved of its core, yet it computed 158 ms in a 50 ms probe: its own work
    assert gate.limit == 64 and gate.cuts == 2
    for _ in range(20):
        gate.observe(0.2, busy=0.95)
    assert gate.limit == 10  # never below min_limit


async def test_the_limit_grows_with_headroom_and_admits_the_waiting_in_order():
    gate = AdmissionGate(target_lag_s=0.005, initial_limit=16, min_limit=16)
    for _ in range(16):
        await gate.acquire()
    order = []

    async def wait(i):
        await gate.acquire()
        order.append(i)

    waiters = [asyncio.create_task(wait(i)) for i in range(3)]
    await asyncio.sleep(0.01)
    assert order == [] and gate.waiting == 3
    gate.observe(0.001, busy=0.9)  # within the target but busy: hold
    await asyncio.sleep(0.01)
    assert gate.limit == 16 and order == []
    gate.observe(0.001, busy=0.2)  # headroom and jobs waiting: +1
    await asyncio.sleep(0.01)
    assert gate.limit == 17 and order == [0]
    gate.release()
    await asyncio.sleep(0.01)
    assert order == [0, 1]
    waiters[2].cancel()  # a waiter cancelled before its turn takes no slot
    await asyncio.gather(waiters[2], return_exceptions=True)
    gate.release()
    await asyncio.sleep(0.01)
    assert gate.waiting == 0 and gate.admitted == 16


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        AdmissionGate(min_limit=0)
    with pytest.raises(ValueError):
        AdmissionGate(initial_limit=8, min_limit=16)
