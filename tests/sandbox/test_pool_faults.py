"""Pool faults of #36 that a red team left open (row 11): a co-tenant of the same uid SIGSTOPs the warm shell of a
pooled sandbox. Acquire must not hand such a sandbox out, and a job whose shell is stopped after acquire, before
the model's first command ran in it, fails as the system's (``failure_kind="sandbox"``, ``filter: true``), not
as a scored zero after the first call's timeout."""
from __future__ import annotations

import asyncio
import time

import psutil
import pytest

from prorl_server.failures import classify, is_filtered
from sandbox import SandboxStartError
from sandbox.pool import SandboxPool
from sandbox.system_time import system_seconds
from tests.sandbox.conftest import BWRAP_UNAVAILABLE
from tests.sandbox.test_pool import SPEC

pytestmark = [pytest.mark.real, pytest.mark.skipif(bool(BWRAP_UNAVAILABLE), reason=str(BWRAP_UNAVAILABLE))]


def _warm_shell(h) -> psutil.Process:
    """The pooled sandbox's persistent shell: the execution server's bash child (started by the pool's warm-up)."""
    server = psutil.Process(h._client.peer_pid)
    for _ in range(500):
        shells = [p for p in server.children() if p.name() == "bash"]
        if shells:
            return shells[0]
        time.sleep(0.01)
    raise AssertionError("the pooled sandbox has no warm shell")


async def _stop(p: psutil.Process) -> None:
    """SIGSTOP ``p`` as a co-tenant of the same uid would, and wait until the kernel has stopped it."""
    p.suspend()
    for _ in range(200):
        if p.status() == psutil.STATUS_STOPPED:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{p} did not stop")


async def test_a_pooled_sandbox_whose_warm_shell_was_stopped_is_replaced_not_handed_out(bwrap_runtime):
    pool = SandboxPool(bwrap_runtime, size=1)
    try:
        pool.register(SPEC)
        await pool.wait_full(SPEC, 60)
        (victim,) = bwrap_runtime.handles
        await _stop(_warm_shell(victim))  # the execution server itself still runs and answers
        got = await asyncio.wait_for(pool.acquire(SPEC), 20)
        # before: the stopped one was handed out and its first bash call waited out its timeout
        assert got.sandbox_id != victim.sandbox_id and pool.counters["dead"] == 1
        assert (await got.bash("echo alive", timeout_s=5)).output.strip() == "alive"
        await got.close()
    finally:
        await pool.close()


async def test_a_shell_stopped_after_acquire_fails_the_models_first_call_as_the_systems(bwrap_runtime):
    pool = SandboxPool(bwrap_runtime, size=1)
    try:
        pool.register(SPEC)
        await pool.wait_full(SPEC, 60)
        h = await pool.acquire(SPEC)
        await _stop(_warm_shell(h))  # after acquire, before the model's first command
        t0 = time.monotonic()
        with system_seconds():  # the call is made on the model's behalf (as the agent loop makes it)
            with pytest.raises(SandboxStartError) as err:  # before: a "[timed out]" observation after ~7 s
                await asyncio.wait_for(h.bash("echo hi", timeout_s=3), 30)
        assert time.monotonic() - t0 < 1.0
        # the run stage ends with it after the model's first turn: still the system's, filtered
        kind = classify(err.value, "run", model_acted=True)
        assert kind == "sandbox" and is_filtered(kind)
        await h.close()
    finally:
        await pool.close()


async def test_a_stop_after_the_models_first_command_stays_the_models(bwrap_runtime):
    # The model can stop its own shell (`kill -STOP $$`); the host cannot tell that from a co-tenant's stop once
    # the model's code ran in the sandbox, so it stays the command's timeout, shown to the model (scored).
    pool = SandboxPool(bwrap_runtime, size=1)
    try:
        pool.register(SPEC)
        await pool.wait_full(SPEC, 60)
        h = await pool.acquire(SPEC)
        with system_seconds():
            assert (await h.bash("echo first", timeout_s=5)).output.strip() == "first"
            await _stop(_warm_shell(h))
            r = await asyncio.wait_for(h.bash("echo hi", timeout_s=1), 30)
        assert r.timed_out
        await h.close()
    finally:
        await pool.close()
