"""Pool faults of #36 from the red team's fourth pass (rows 1 and 4): a co-tenant freezes a pooled sandbox with
the cgroup freezer. Its processes then sleep in state ``D`` (not ``T``), so a check of the state field alone hands
the sandbox out and the job's first bash waits out its timeout. Acquire must replace a frozen sandbox (counted
``dead``), and a freeze after acquire fails the model's first call at once as the system's. Real tier: bubblewrap
sandboxes and the host's v1 freezer hierarchy (needs root to create a freezer cgroup; skipped otherwise)."""
from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid

import psutil
import pytest

from prorl_server.failures import classify, is_filtered
from sandbox import SandboxError, SandboxStartError, procstate
from sandbox.system_time import system_seconds
from tests.sandbox.conftest import BWRAP_UNAVAILABLE
from tests.sandbox.test_pool import SPEC, full_pool

FREEZER = "/sys/fs/cgroup/freezer"
#: The cgroup v2 mount point (on a hybrid host, the unified hierarchy beside the v1 ones), or ``None``.
UNIFIED = (procstate._freezer_mounts()[1] or (None, None))[1]


def _no_freezer(version: int) -> str:
    where = FREEZER if version == 1 else UNIFIED
    if where is None or not os.path.isfile(os.path.join(where, "cgroup.procs")):
        return f"no cgroup v{version} hierarchy with a freezer here"
    if not os.access(where, os.W_OK):
        return f"{where} is not writable by this user (a freezer cgroup needs root or a delegated hierarchy)"
    return ""


pytestmark = [pytest.mark.real, pytest.mark.skipif(bool(BWRAP_UNAVAILABLE), reason=str(BWRAP_UNAVAILABLE))]
VERSIONS = [pytest.param(v, id=f"v{v}", marks=pytest.mark.skipif(bool(_no_freezer(v)), reason=_no_freezer(v) or "-"))
            for v in (1, 2)]


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


@contextlib.contextmanager
def frozen(handle, version: int = 1):
    """Move every process of ``handle``'s sandbox (its launcher and descendants) into a fresh freezer cgroup
    (``version`` 1: the v1 freezer hierarchy, ``freezer.state``; 2: the v2 hierarchy, ``cgroup.freeze``) and
    freeze it, as a co-tenant with the freezer would; thaw, move them back to the cgroups they came from and
    remove it on exit. Yields a ``thaw()`` that thaws early."""
    mount = FREEZER if version == 1 else UNIFIED
    path = os.path.join(mount, f"prorl-test-{uuid.uuid4().hex[:8]}")
    os.mkdir(path)
    thawed = False
    came_from: dict[int, str] = {}

    def thaw() -> None:
        nonlocal thawed
        if not thawed:
            _write(os.path.join(path, "freezer.state" if version == 1 else "cgroup.freeze"),
                   "THAWED" if version == 1 else "0")
            thawed = True

    def is_frozen() -> bool:
        if version == 1:
            return _read(os.path.join(path, "freezer.state")).strip() == "FROZEN"
        return "frozen 1" in _read(os.path.join(path, "cgroup.events")).splitlines()

    try:
        root = psutil.Process(handle.pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(OSError):
                for line in _read(f"/proc/{p.pid}/cgroup").splitlines():
                    n, ctl, rel = line.split(":", 2)
                    if (version == 1 and "freezer" in ctl.split(",")) or (version == 2 and n == "0"):
                        came_from[p.pid] = os.path.join(mount, rel.lstrip("/"))
                _write(os.path.join(path, "cgroup.procs"), str(p.pid))
        _write(os.path.join(path, "freezer.state" if version == 1 else "cgroup.freeze"),
               "FROZEN" if version == 1 else "1")
        for _ in range(200):
            if is_frozen():
                break
            time.sleep(0.01)
        yield thaw
    finally:
        thaw()
        for pid in _read(os.path.join(path, "cgroup.procs")).split():
            with contextlib.suppress(OSError):
                _write(os.path.join(came_from.get(int(pid), mount), "cgroup.procs"), pid)
        for _ in range(100):
            try:
                os.rmdir(path)
                break
            except OSError:
                time.sleep(0.02)


@pytest.mark.parametrize("version", VERSIONS)
async def test_a_frozen_pooled_sandbox_is_replaced_not_handed_out(bwrap_runtime, version):
    async with full_pool(bwrap_runtime) as pool:
        (victim,) = bwrap_runtime.handles
        with frozen(victim, version):
            got = await asyncio.wait_for(pool.acquire(SPEC), 20)
            # before: the frozen one (state D, not T) was handed out
            assert got.sandbox_id != victim.sandbox_id and pool.counters["dead"] == 1
            assert (await got.bash("echo alive", timeout_s=5)).output.strip() == "alive"
            await got.close()


@pytest.mark.parametrize("version", VERSIONS)
async def test_a_sandbox_frozen_after_acquire_fails_the_models_first_call_as_the_systems(bwrap_runtime, version):
    async with full_pool(bwrap_runtime) as pool:
        h = await pool.acquire(SPEC)
        with frozen(h, version):
            t0 = time.monotonic()
            with system_seconds():  # on the model's behalf, as the agent loop calls it
                with pytest.raises(SandboxStartError) as err:  # before: the call waited out its timeout + grace
                    await asyncio.wait_for(h.bash("echo hi", timeout_s=3), 30)
            assert time.monotonic() - t0 < 1.0 and "frozen" in str(err.value)
            kind = classify(err.value, "run", model_acted=True)
            assert kind == "sandbox" and is_filtered(kind)
        await h.close()


@pytest.mark.parametrize("version", VERSIONS[:1])
async def test_a_cold_sandbox_frozen_before_the_models_first_call_fails_it_as_the_systems(bwrap_runtime, version):
    h = await bwrap_runtime.start(SPEC)  # no pool: no recorded processes, its launcher and server are checked
    try:
        with frozen(h, version):
            t0 = time.monotonic()
            with system_seconds():
                with pytest.raises(SandboxStartError) as err:  # before: the call waited out its timeout + grace
                    await asyncio.wait_for(h.bash("echo hi", timeout_s=3), 30)
            assert time.monotonic() - t0 < 1.0 and "frozen" in str(err.value)
    finally:
        await h.close()


@pytest.mark.parametrize("version", VERSIONS[:1])  # v1 only: the v2 freezer lets SIGKILL through
async def test_a_close_whose_processes_survive_sigkill_keeps_the_record_until_a_reap_finishes(bwrap_runtime, version):
    # A frozen task dies of SIGKILL only once thawed: before, close removed the ownership record (and cgroup,
    # leases, directories) anyway, so nothing could reap the processes that lived on.
    h = await bwrap_runtime.start(SPEC)
    ids = lambda: {r["sandbox_id"] for r in bwrap_runtime.store.records()}  # noqa: E731
    root = psutil.Process(h.pid)
    procs = [root, *root.children(recursive=True)]
    with frozen(h, version) as thaw:
        with pytest.raises(SandboxError, match="survived SIGKILL"):
            await h.close(grace_s=0.0)
        assert h.sandbox_id in ids() and os.path.isdir(h._ctx.run_dir)
        thaw()
        assert await bwrap_runtime.reap_orphans() == 1
    assert h.sandbox_id not in ids() and not os.path.exists(h._ctx.run_dir)
    assert not [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
