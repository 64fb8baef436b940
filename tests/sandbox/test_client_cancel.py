"""A tool call that ends in an exception (a cancellation, a timeout) leaves the handle usable: the next call
reconnects instead of failing on the abandoned stream. Real bubblewrap sandboxes."""
from __future__ import annotations

import asyncio

import psutil
import pytest

from sandbox import ToolTimeout

pytestmark = [pytest.mark.real]


async def _until_running(procs, handle, name: str) -> None:
    # Polls the sandbox's process list (no timing assumption: waits for the command to exist).
    for _ in range(3000):
        if any(p.name() == name for p in procs.of(handle) if p.is_running()):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{name} never started in the sandbox")


async def test_cancelled_bash_call_then_download_on_same_handle_works(sandbox, procs):
    await sandbox.upload("answer.txt", b"solution")
    call = asyncio.ensure_future(sandbox.bash("sleep 300", timeout_s=600))
    await _until_running(procs, sandbox, "sleep")
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    # What the code/swe handlers do in `finally` after a timeout cancelled the agent's tool call.
    assert await sandbox.download("answer.txt") == b"solution"
    await sandbox.upload("second.txt", b"more")
    assert await sandbox.download("second.txt") == b"more"


async def test_cancel_while_waiting_for_the_lock_and_after_a_client_timeout(sandbox, procs):
    first = asyncio.ensure_future(sandbox.bash("sleep 300", timeout_s=600))
    await _until_running(procs, sandbox, "sleep")
    queued = asyncio.ensure_future(sandbox.download("nothing-yet"))
    await asyncio.sleep(0)
    queued.cancel()
    first.cancel()
    for t in (first, queued):
        with pytest.raises(asyncio.CancelledError):
            await t
    # The client gives up waiting for an answer (its own ToolTimeout; the shell is still busy with the
    # abandoned sleep, so the slow call is an IPython cell).
    with pytest.raises(ToolTimeout):
        await sandbox._client.call("ipython", {"code": "import time; time.sleep(300)", "timeout_s": 600}, 0.5)
    await sandbox.upload("after.txt", b"ok")
    assert await sandbox.download("after.txt") == b"ok"
    assert psutil.pid_exists(sandbox.pid)
