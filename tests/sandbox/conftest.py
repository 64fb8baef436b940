"""Fixtures of the sandbox tests: a bubblewrap runtime with a private state dir and loopback lease dir, and
a started sandbox that is closed (and checked for leftover processes) after each test."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import psutil
import pytest

from sandbox.ownership import sandbox_processes


def _bwrap_works() -> str | None:
    """None if bubblewrap can start a sandbox here, else the reason it cannot."""
    bwrap = shutil.which("bwrap")
    if not bwrap:
        return "bwrap is not installed (apt-get install bubblewrap)"
    r = subprocess.run([bwrap, "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "--proc", "/proc",
                        "--dev", "/dev", "true"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"bwrap cannot create namespaces here: {r.stderr.strip()}"
    return None


BWRAP_UNAVAILABLE = _bwrap_works()


@pytest.fixture
def short_tmp():
    """A short private directory (Unix socket paths must stay under 108 bytes)."""
    d = tempfile.mkdtemp(prefix="prorl-t-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def runtime_options(short_tmp):
    return {"state_dir": os.path.join(short_tmp, "state"), "workspace_root": os.path.join(short_tmp, "ws"),
            "loopback_dir": os.path.join(short_tmp, "leases"), "close_grace_s": 1.0}


@pytest.fixture
async def bwrap_runtime(runtime_options):
    from sandbox import make_runtime

    if BWRAP_UNAVAILABLE:
        pytest.skip(BWRAP_UNAVAILABLE)
    rt = make_runtime("bubblewrap", uid_lease_dir=os.path.join(runtime_options["state_dir"], "..", "uids"),
                      **runtime_options)
    yield rt
    await rt.close_all()


def live_processes(handle) -> list[psutil.Process]:
    """Every live process of a sandbox, found by its launcher pid + create time (descendants)."""
    return sandbox_processes(handle.pid, handle.create_time)


@pytest.fixture
async def sandbox(bwrap_runtime):
    """A started bubblewrap sandbox (host root read-only, network none). After the test it is closed and no
    process of it may remain."""
    h = await bwrap_runtime.start()
    pids = {p.pid for p in live_processes(h)}
    yield h
    pids |= {p.pid for p in live_processes(h)}
    await h.close()
    assert_gone(pids)


def assert_gone(pids) -> None:
    left = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                left.append((pid, p.name()))
        except psutil.NoSuchProcess:
            pass
    assert not left, f"processes of the sandbox survived: {left}"


@pytest.fixture
def procs():
    """Helpers for tests: ``procs.of(handle)`` lists live processes, ``procs.assert_gone(pids)`` checks."""
    class _Procs:
        of = staticmethod(live_processes)
        assert_gone = staticmethod(assert_gone)

    return _Procs
