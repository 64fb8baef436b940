"""The cold start path (#36 part 2): each start reports where its time went, the host is woken by the execution
server's readiness signal instead of polling its socket."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.real

STEPS = {"probe", "view", "dirs", "leases", "config", "cgroup", "launch", "record", "ready", "pidns"}


async def test_a_start_reports_each_step(sandbox):
    assert set(sandbox.start_steps) == STEPS
    assert all(v >= 0 for v in sandbox.start_steps.values())
    assert sandbox.start_steps["ready"] > 0  # the launcher's exec until the execution server's first answer


async def test_start_is_woken_by_the_readiness_signal_not_the_poll(bwrap_runtime, monkeypatch):
    # With the fallback poll slower than the start timeout, only the signal lets the start finish (else it is a
    # SandboxStartError: the execution server did not listen within start_timeout_s).
    monkeypatch.setattr("sandbox.client.READY_FALLBACK_POLL_S", 60.0)
    bwrap_runtime.start_timeout_s = 5.0
    h = await bwrap_runtime.start()
    try:
        assert (await h.bash("echo ok")).output.strip() == "ok"
    finally:
        await h.close()
