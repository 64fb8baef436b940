"""sandbox.procstate (fast tier: reads this test process's own /proc entries, starts nothing): a known process
reads as answering, stopped-or-gone when its pid is gone or reused, and a command name a sandbox chose (any
bytes, ``)`` and state letters included) cannot fake its state."""
from __future__ import annotations

import ctypes
import os

from sandbox import procstate

_PR_SET_NAME, _PR_GET_NAME = 15, 16


def test_a_running_process_answers_and_a_gone_or_reused_pid_does_not():
    me = os.getpid()
    state, ppid, start = procstate.stat(me)
    assert chr(state) in "RS" and ppid == os.getppid() and start > 0
    assert procstate.fault(((me, start),)) is None
    assert procstate.fault(((me, start + 1),)) == f"process {me} is gone"  # same pid, another process
    assert procstate.fault(((2 ** 22 + 1, 1),)) == f"process {2 ** 22 + 1} is gone"  # above pid_max: no such pid
    assert procstate.snapshot(me, me)[0] == (me, start) and procstate.snapshot(me, 2 ** 22 + 1) == ()
    assert me in procstate.children(os.getppid())


def test_a_command_name_cannot_fake_the_state():
    # A process inside a sandbox names itself (prctl, or its executable's name): ") T 1 " would read as stopped,
    # and ") R " as running, to a parser that split at the first ")" or at spaces.
    libc = ctypes.CDLL(None, use_errno=True)
    old = ctypes.create_string_buffer(16)
    libc.prctl(_PR_GET_NAME, old, 0, 0, 0)
    try:
        assert libc.prctl(_PR_SET_NAME, b") T 1 1 (x", 0, 0, 0) == 0
        state, ppid, _ = procstate.stat(os.getpid())
        assert chr(state) in "RS" and ppid == os.getppid()
    finally:
        libc.prctl(_PR_SET_NAME, old.value, 0, 0, 0)
