"""Nothing on the node decides a sandbox's seccomp filter or hangs its start (red team #36, seccomp2.py,
seccomp_srv.sh): the filter was reopened from ``<state>/seccomp-no-fallocate.bpf`` at every start, so a same-uid
process that swapped it for an allow-all program turned the fallocate block off for the next sandbox, and a FIFO
there hung every start (the pool drained, jobs sat in ``init``, SIGTERM did not exit)."""
from __future__ import annotations

import asyncio
import os
import struct
import threading
import time

import pytest

from sandbox import SandboxSpec, SandboxStartError, make_runtime
from sandbox.pool import SandboxPool
from tests.sandbox.conftest import BWRAP_UNAVAILABLE

pytestmark = [pytest.mark.real, pytest.mark.skipif(bool(BWRAP_UNAVAILABLE), reason=str(BWRAP_UNAVAILABLE))]

FALLOCATE = ("python3 -c \"import os\nfd = os.open('f', os.O_CREAT | os.O_WRONLY)\ntry:\n"
             "    os.posix_fallocate(fd, 0, 1)\nexcept OSError as e:\n    print(e)\n"
             "import ctypes\nl = ctypes.CDLL(None, use_errno=True)\n"
             "print('rc', l.fallocate(fd, 0, ctypes.c_long(0), ctypes.c_long(1 << 20)), ctypes.get_errno())\"")


async def test_a_filter_file_swapped_in_the_state_directory_changes_no_sandboxs_filter(bwrap_runtime):
    rt = bwrap_runtime
    path = os.path.join(rt.state_dir, "seccomp-no-fallocate.bpf")
    allow_all = struct.pack("=HBBI", 0x06, 0, 0, 0x7FFF0000)  # one instruction: SECCOMP_RET_ALLOW
    with open(path + ".new", "wb") as f:
        f.write(allow_all)
    os.replace(path + ".new", path)
    h = await rt.start(SandboxSpec(network="none"))
    r = await h.bash(FALLOCATE, timeout_s=30)
    assert "rc -1 95" in r.output, r.output  # EOPNOTSUPP: still refused
    await h.close()
    os.unlink(path)
    os.mkfifo(path)  # a FIFO there must not block anything either
    h = await asyncio.wait_for(rt.start(SandboxSpec(network="none")), 20)
    await h.close()


async def test_a_start_that_hangs_on_the_node_fails_within_its_deadline_as_the_systems_fault(runtime_options):
    """Stands in for a start step blocked by the node (a FIFO or a hung file system where a file is read): the
    step blocks its worker thread until released. The start fails with :class:`SandboxStartError` (the host's
    doing, filtered) within ``start_timeout_s``, the pool counts the failed refill, ``close_all`` returns, and
    the sandbox the step eventually makes is closed, not leaked."""
    rt = make_runtime("bubblewrap", start_timeout_s=1.0, **runtime_options)
    release = threading.Event()
    prepare = rt._prepare

    def hung_prepare(*args, **kwargs):
        release.wait(60)
        return prepare(*args, **kwargs)

    rt._prepare = hung_prepare
    pool = SandboxPool(rt, size=1, retry_s=60)
    try:
        t0 = time.monotonic()
        with pytest.raises(SandboxStartError):
            await rt.start(SandboxSpec(network="none"))
        assert time.monotonic() - t0 < 3
        pool.register(SandboxSpec(network="none"))
        for _ in range(100):
            if pool.counters["refill_failures"]:
                break
            await asyncio.sleep(0.05)
        assert pool.counters["refill_failures"] == 1
        await asyncio.wait_for(pool.close(), 5)
        t0 = time.monotonic()
        await asyncio.wait_for(rt.close_all(), 10)
        assert time.monotonic() - t0 < 5
    finally:
        release.set()
    records = os.path.join(runtime_options["state_dir"], "sandboxes")
    for _ in range(200):  # the released starts finish in the background and are closed at once
        if not rt._starting and not os.listdir(records):
            break
        await asyncio.sleep(0.05)
    await rt.close_all()
    assert rt.handles == [] and os.listdir(records) == []
