"""The cold start path (#36 part 2): each start reports where its time went, the host is woken by the execution
server's readiness signal instead of polling its socket, and the cached list of host package directories to mask
follows the host."""
from __future__ import annotations

import pytest

STEPS = {"probe", "view", "dirs", "leases", "config", "cgroup", "launch", "record", "ready", "pidns"}


@pytest.mark.real
async def test_a_start_reports_each_step(sandbox):
    assert set(sandbox.start_steps) == STEPS
    assert all(v >= 0 for v in sandbox.start_steps.values())
    assert sandbox.start_steps["ready"] > 0  # the launcher's exec until the execution server's first answer


@pytest.mark.real
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


def test_the_masked_system_package_dirs_follow_the_host_while_cached(tmp_path, monkeypatch):
    # A sandbox start reuses the answer while the directories it depends on are unchanged; a package directory
    # of another Python that appears later must still be masked in the next sandbox.
    from sandbox import python_view

    lib = tmp_path / "usr" / "lib"
    (lib / "python3.99").mkdir(parents=True)
    monkeypatch.setattr(python_view, "SYSTEM_SITE_PATTERNS", (f"{lib}/python3*/dist-packages",))
    monkeypatch.setattr(python_view, "_SITE_DIRS_CACHE", {})
    assert python_view.system_site_dirs() == []
    (lib / "python3.99" / "dist-packages").mkdir()
    assert python_view.system_site_dirs() == [f"{lib}/python3.99/dist-packages"]
    (lib / "python3.98" / "dist-packages").mkdir(parents=True)
    assert python_view.system_site_dirs() == [f"{lib}/python3.98/dist-packages", f"{lib}/python3.99/dist-packages"]
    (lib / "python3.99" / "dist-packages").rmdir()
    assert python_view.system_site_dirs() == [f"{lib}/python3.98/dist-packages"]
