"""The IPython tool inside bubblewrap: persistence, images, errors, timeouts and a kernel that dies."""
from __future__ import annotations

import base64
import struct
import zlib

import pytest

from sandbox import KernelDiedError

pytestmark = [pytest.mark.real]


def _png_1x1() -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00\x7f")) + chunk(b"IEND", b""))


async def test_kernel_state_persists_and_results_are_text(sandbox):
    r = await sandbox.ipython("x = 20\nprint('side', flush=True)\nx + 1")
    assert r.error is None and not r.timed_out
    assert r.text == "side\n21\n"
    assert (await sandbox.ipython("x * 2")).text == "40\n"


async def test_kernel_runs_in_workspace_and_sees_bash_files(sandbox):
    await sandbox.bash("echo shared > f.txt")
    r = await sandbox.ipython("import os; print(os.getcwd()); print(open('f.txt').read().strip())")
    assert r.text == "/workspace\nshared\n"


async def test_images_come_back_as_base64_png(sandbox):
    png = _png_1x1()
    await sandbox.upload("dot.png", png)
    r = await sandbox.ipython("from IPython.display import Image, display\ndisplay(Image(filename='dot.png'))")
    assert r.error is None
    assert [base64.b64decode(i) for i in r.images] == [png]


async def test_exception_is_reported_as_error_with_traceback(sandbox):
    r = await sandbox.ipython("print('before')\n1/0")
    assert r.text == "before\n"
    assert r.error.startswith("ZeroDivisionError: division by zero")
    assert "\x1b[" not in r.error  # colours stripped


async def test_timeout_interrupts_kernel_and_keeps_its_state(sandbox):
    await sandbox.ipython("kept = 'yes'")
    r = await sandbox.ipython("import time\nprint('begun', flush=True)\ntime.sleep(60)", timeout_s=1.0)
    assert r.timed_out and r.error.startswith("TimeoutError")
    assert "begun" in r.text
    assert (await sandbox.ipython("kept")).text == "'yes'\n"


async def test_kernel_that_dies_raises_and_next_cell_gets_fresh_kernel(sandbox, procs):
    await sandbox.ipython("import os; pid = os.getpid(); lost = 1")
    before = {p.pid for p in procs.of(sandbox)}
    with pytest.raises(KernelDiedError, match="kernel died"):
        await sandbox.ipython("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", timeout_s=20)
    r = await sandbox.ipython("'lost' in globals()")
    assert r.text == "False\n"
    after = {p.pid for p in procs.of(sandbox)}
    assert len(after - before) >= 1  # a new kernel process
    procs.assert_gone(before - after - {sandbox.pid})  # the dead kernel left nothing behind


async def test_cell_ignoring_interrupt_gets_kernel_restarted(sandbox):
    await sandbox.ipython("state = 1")
    r = await sandbox.ipython("import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(60)",
                              timeout_s=0.5)
    assert r.timed_out and "restarted" in r.error
    assert (await sandbox.ipython("'state' in globals()")).text == "False\n"


async def test_kernel_leaves_no_profile_files_in_the_workspace(sandbox):
    await sandbox.ipython("1")
    assert (await sandbox.bash("ls -A")).output == ""
