"""CPU-bound scoring off the event loop: the process pool, the event-loop lag monitor, and the built-in
``arithmetic`` handler's bound on integer size.

Everything here is real: worker processes (forkserver), math-verify in them, the server and its /metrics.
Functions sent to workers are stdlib ones (``os.getpid``, ``time.sleep``, ``os._exit``): a worker can only
run what it can import by name, and a test module is not importable there.
"""
from __future__ import annotations

import asyncio
import functools
import os
import time

import psutil
import pytest

from handlers.arithmetic import evaluate
from handlers.math.handler import MathHandler
from handlers.math.scoring import score
from prorl_server.plugin.registry import HandlerRegistry
from prorl_server.app import CPU_POOL, create_app
from prorl_server.config import ServerSettings
from prorl_server.cpu_pool import CpuPool, CpuShare, CpuTimeoutError, WorkerCrashedError
from prorl_server.failures import classify
from prorl_server.llm.agent_loop import AgentConfig
from prorl_server.loop_monitor import LoopLagMonitor
from prorl_server.plugin.handler import AgentHandler


def gone(pid: int) -> bool:
    """True once process ``pid`` has exited and been reaped (waits up to 30 s for the pool to reap it)."""
    try:
        psutil.Process(pid).wait(timeout=30)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        return False
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.fixture
async def pool():
    p = CpuPool(1)
    yield p
    await p.close()


async def test_calls_run_in_another_process_and_their_value_comes_back(pool):
    pid = await pool.run(os.getpid, timeout_s=60)
    assert pid != os.getpid() and pool.pids() == [pid]
    assert await pool.run(divmod, 17, 5, timeout_s=60) == (3, 2)
    with pytest.raises(ZeroDivisionError):  # the function's own exception, as is
        await pool.run(divmod, 1, 0, timeout_s=60)
    assert await pool.run(os.getpid, timeout_s=60) == pid  # an exception does not cost the worker


async def test_signal_alarm_timeouts_of_math_verify_work_in_a_worker(pool):
    # In a thread, math-verify's signal.alarm raises "signal only works in main thread"; in a pool worker it
    # runs in the main thread, so its own 1 s limit ends a comparison that would otherwise run for minutes.
    reward, info = await pool.run(functools.partial(score, verify_timeout_s=1), {"answer": "2"},
                                  "\\boxed{10^{10^{10}}}", timeout_s=120)
    assert reward == 0.0 and "timed out" in info["reason"], info


async def test_a_call_past_its_limit_is_cut_its_worker_killed_and_the_pool_keeps_working(pool):
    first = await pool.run(os.getpid, timeout_s=60)
    with pytest.raises(CpuTimeoutError, match="ran past its limit of 0.5 s"):
        await pool.run(time.sleep, 3600, timeout_s=0.5)  # stands in for a scorer stuck in C code
    assert gone(first)
    second = await pool.run(os.getpid, timeout_s=60)
    assert second != first and pool.pids() == [second]


async def test_a_crashed_worker_is_an_infrastructure_fault_and_is_replaced(pool):
    first = await pool.run(os.getpid, timeout_s=60)
    with pytest.raises(WorkerCrashedError) as e:
        await pool.run(os._exit, 1, timeout_s=60)
    assert e.value.kind == "harness" and classify(e.value, "eval") == "harness"
    second = await pool.run(os.getpid, timeout_s=60)
    assert second != first and gone(first)


async def test_a_cancelled_caller_does_not_free_a_busy_worker():
    pool = CpuPool(1)
    try:
        first = await pool.run(os.getpid, timeout_s=60)
        waiter = asyncio.create_task(pool.run(time.sleep, 1, timeout_s=60))
        await asyncio.sleep(0.2)
        waiter.cancel()
        # The next call waits for the sleeping one instead of queueing behind it inside the worker (where
        # its own limit would be charged for the other call's time), and the worker is not killed.
        assert await pool.run(os.getpid, timeout_s=60) == first
    finally:
        await pool.close()


async def test_close_ends_every_worker_even_a_busy_one():
    pool = CpuPool(2)
    pids = set(await asyncio.gather(pool.run(os.getpid, timeout_s=60), pool.run(os.getpid, timeout_s=60)))
    busy = asyncio.create_task(pool.run(time.sleep, 3600, timeout_s=3600))
    await asyncio.sleep(0.2)
    await pool.close()
    assert all(gone(p) for p in pids)
    with pytest.raises((WorkerCrashedError, asyncio.CancelledError)):
        await busy
    with pytest.raises(RuntimeError, match="closed"):
        await pool.run(os.getpid, timeout_s=60)


def test_fork_is_refused():
    with pytest.raises(ValueError, match="forkserver"):
        CpuPool(1, start_method="fork")


async def test_the_lag_monitor_sees_a_blocked_event_loop():
    monitor = LoopLagMonitor(interval_s=0.01)
    monitor.start()
    await asyncio.sleep(0.1)
    time.sleep(0.3)  # what inline scoring did: hold the loop
    await asyncio.sleep(0.1)
    await monitor.stop()
    assert max(monitor.samples) >= 0.25
    assert sorted(monitor.samples)[len(monitor.samples) // 2] < 0.25  # one stall, not a constant offset


class AnswerMathHandler(MathHandler):
    """The real ``math`` handler's eval, with its run replaced by a TEST DOUBLE standing in for the agent:
    the final answer is ``instance["response"]`` (no LLM, no sandbox)."""

    name = "math_answer"
    aliases = ()
    needs_llm = False

    async def init(self, job):
        pass

    async def run(self, job):
        job.state.final_answer = job.instance["response"]


async def test_the_server_scores_in_its_pool_and_exports_loop_lag_and_pool_outcomes(aiohttp_client):
    registry = HandlerRegistry()
    registry.register(AnswerMathHandler())
    app = create_app(ServerSettings(cpu_workers=1, health_interval_s=3600), registry=registry)
    client = await aiohttp_client(app)
    r = await (await client.post("/process", json={"instance": {
        "data_source": "math_answer", "question": "1/2?", "answer": "\\frac{1}{2}", "response": "so \\boxed{0.5}"}})).json()
    assert r["critical_error"] is None and r["reward"] == 1.0, r
    (worker,) = app[CPU_POOL].pids()
    assert worker != os.getpid()
    text = await (await client.get("/metrics")).text()
    assert 'prorl_cpu_tasks_total{outcome="ok"} 1.0' in text
    count = next(line for line in text.splitlines() if line.startswith("prorl_event_loop_lag_seconds_count"))
    assert float(count.split()[-1]) >= 1
    assert "prorl_event_loop_lag_max_seconds" in text
    await client.close()
    assert gone(worker)  # the app's cleanup closed the pool


async def test_a_crashed_scoring_worker_fails_eval_as_a_harness_fault(aiohttp_client, monkeypatch):
    registry = HandlerRegistry()
    registry.register(AnswerMathHandler())
    app = create_app(ServerSettings(cpu_workers=1, health_interval_s=3600), registry=registry)
    client = await aiohttp_client(app)
    pool = app[CPU_POOL]
    real_run = pool.run

    async def crash_once(fn, *args, timeout_s, **kwargs):
        # Fault injection: the worker dies (as under the OOM killer) while scoring this answer.
        monkeypatch.setattr(pool, "run", real_run)
        return await real_run(os._exit, 9, timeout_s=timeout_s, **kwargs)

    monkeypatch.setattr(pool, "run", crash_once)
    body = {"instance": {"data_source": "math_answer", "question": "1+1?", "answer": "2", "response": "\\boxed{2}"}}
    r = await (await client.post("/process", json=body)).json()
    assert r["critical_error"] == "eval" and r["reward"] == 0.0 and "died" in r["error"], r
    if "failure_kind" in r:
        assert r["failure_kind"] == "harness" and r["filter"] is True
    r = await (await client.post("/process", json=body)).json()  # the pool was rebuilt
    assert r["critical_error"] is None and r["reward"] == 1.0, r


def test_arithmetic_refuses_integers_too_large_to_compute_on_the_event_loop():
    assert evaluate("2**1000") == 2 ** 1000
    assert evaluate("(9**99)**9") == 9 ** 891
    for expr in ("((9**999)**999)**999", "(2**1000)**1000", "9**999*" * 60 + "9"):
        with pytest.raises(ValueError, match="larger than"):
            evaluate(expr)


def test_workers_exit_when_the_server_process_is_killed():
    # SIGKILL runs no cleanup: the workers must notice by themselves (their parent, the forkserver, stays up
    # as long as they do). One worker is busy in a call that would run for an hour.
    import subprocess
    import sys

    code = ("import asyncio, os, signal, time\n"
            "from prorl_server.cpu_pool import CpuPool\n"
            "async def main():\n"
            "    p = CpuPool(2)\n"
            "    print(*await asyncio.gather(p.run(os.getpid, timeout_s=60), p.run(os.getpid, timeout_s=60)),"
            " flush=True)\n"
            "    asyncio.create_task(p.run(time.sleep, 3600, timeout_s=3600))\n"
            "    await asyncio.sleep(0.5)\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
            "asyncio.run(main())\n")
    out = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                             os.path.abspath(__file__)))))
    pids = [int(p) for p in out.stdout.split()]
    assert out.returncode == -9 and len(pids) == 2
    assert all(gone(p) for p in pids)


# ------------------------------------------------------------------------------ a shared pool, fairly shared
async def test_the_pool_serves_jobs_round_robin_so_one_jobs_calls_cannot_starve_another():
    """Job A queues four calls on a one-worker pool, then job B one: B's call runs second (per-job FIFO,
    round-robin across jobs), not fifth behind all of A's."""
    pool = CpuPool(1)
    finished: list[str] = []

    async def call(share, name, seconds):
        await pool.run(time.sleep, seconds, timeout_s=60, share=share)
        finished.append(name)

    try:
        await pool.run(os.getpid, timeout_s=60)  # the worker is up
        a, b = CpuShare(owner="A"), CpuShare(owner="B")
        calls = [asyncio.create_task(call(a, f"A{i}", 0.3)) for i in range(4)]
        await asyncio.sleep(0.1)  # A's first call runs, three wait
        calls.append(asyncio.create_task(call(b, "B", 0)))
        await asyncio.wait_for(asyncio.gather(*calls), 60)
        assert finished[:2] == ["A0", "B"], finished
    finally:
        await pool.close()


async def test_one_answers_scoring_has_a_cpu_budget_and_waiting_or_sleeping_is_not_charged_to_it():
    from prorl_server.job import Job, JobServices

    pool = CpuPool(1)
    try:
        job = Job(job_id="j", instance={}, sampling_params={}, handler=None, handler_name="h", timeout_s=None,
                  services=JobServices(cpu_pool=pool, cpu_budget_s=1.0))
        # wall-clock time in the worker that uses no CPU (a loaded node, a sleep) is not the answer's spending
        assert await job.run_cpu(time.sleep, 1.5, timeout_s=60) is None
        # an answer that keeps a worker's CPU busy is cut at its budget, far before the handler's limit of 60 s
        with pytest.raises(CpuTimeoutError, match="CPU budget of 1 s"):
            await asyncio.wait_for(job.run_cpu(sum, range(10 ** 11), timeout_s=60), 30)
        with pytest.raises(CpuTimeoutError, match="CPU budget"):  # spent: no worker is taken at all
            await job.run_cpu(os.getpid, timeout_s=60)
        other = Job(job_id="k", instance={}, sampling_params={}, handler=None, handler_name="h", timeout_s=None,
                    services=JobServices(cpu_pool=pool, cpu_budget_s=1.0))
        assert await other.run_cpu(os.getpid, timeout_s=60) != os.getpid()  # another job's budget is its own
    finally:
        await pool.close()


class TwoStepHandler(AgentHandler):
    """One model turn (the scripted policy answers ``42``), then eval scores in the CPU pool: ``"heavy": n``
    sends n calls that hold a worker for ``hold_s`` each (``time.sleep``: stands in for scoring that is slow
    for the pool, not for the answer, e.g. another job's power towers in math-verify); otherwise one cheap
    call checks the answer (``operator.mul(6, 7)``) and scores 1.0 when it matches."""

    name = "two_step"
    needs_llm = True

    async def run(self, job):
        from prorl_server.plugin.toolkit import run_agent

        result = await run_agent(job, [{"role": "user", "content": "Six times seven?"}], {},
                                 AgentConfig(max_turns=1))
        job.state["answer"] = result.messages[-1]["content"].strip()

    async def eval(self, job):
        import operator

        if job.instance.get("heavy"):
            await asyncio.gather(*(job.run_cpu(time.sleep, job.instance["hold_s"], timeout_s=60)
                                   for _ in range(job.instance["heavy"])))
            return
        expected = await job.run_cpu(operator.mul, 6, 7, timeout_s=60)
        job.reward = 1.0 if job.state["answer"] == str(expected) else 0.0
        job.resolved = job.reward == 1.0


async def test_a_right_answer_waiting_behind_another_jobs_scoring_is_resolved_within_its_deadline(
        aiohttp_client, scripted_policy):
    """Job A sends four slow scoring calls to a one-worker pool; job B's right answer, with a 2 s deadline,
    needs the same worker. B's wait for it is the system's (not charged to its deadline) and it is served
    next, not behind all of A's calls: B is scored 1.0 while A is still scoring."""
    registry = HandlerRegistry()
    registry.register(TwoStepHandler)
    backend = await scripted_policy(lambda prompt, turn: "42")
    app = create_app(ServerSettings(cpu_workers=1, backends=[backend], health_interval_s=3600), registry=registry)
    client = await aiohttp_client(app)
    sampling = {"max_tokens": 16}
    r = await client.post("/jobs", json={"instance": {"data_source": "two_step", "heavy": 4, "hold_s": 2.5},
                                         "sampling_params": sampling})
    a_id = (await r.json())["job_id"]
    for _ in range(3000):  # until A scores
        if (await (await client.get(f"/jobs/{a_id}")).json())["state"] == "eval":
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.5)  # A's first call holds the worker, three wait
    b = await (await client.post("/process", json={"instance": {"data_source": "two_step"},
                                                    "sampling_params": sampling, "timeout_s": 2.0})).json()
    assert (b["reward"], b["resolved"], b["failure_kind"]) == (1.0, True, None), b["error"]
    assert b["timing"]["counted_s"] < 2.0
    assert (await (await client.get(f"/jobs/{a_id}")).json())["state"] != "done"  # B did not wait for all of A
