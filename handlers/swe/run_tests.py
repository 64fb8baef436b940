"""Runs the SWE handler's test command inside the eval sandbox and leaves no process of it behind.

Uploaded into the eval sandbox (outside the repository) and started as
``python3 -I -S run_tests.py --timeout SECONDS -- ARGV...``: standard library only, no project import, since it
runs with whatever interpreter the task's image has. It

- becomes a child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``, Linux), so every process the tests start,
  including double-forked daemons that left the session, is re-parented to it when orphaned;
- runs ARGV with a clean test environment: ``PYTEST_ADDOPTS``, ``PYTEST_PLUGINS``, ``PYTHONSTARTUP`` and
  ``PYTHONINSPECT`` removed, ``PYTHONNOUSERSITE=1`` and ``PYTHONDONTWRITEBYTECODE=1`` set, stdin closed;
- after ARGV exits (or after ``--timeout`` seconds, then exit status 124), SIGKILLs every descendant that is
  left, until none is, so no process started by the tests outlives the run and can rewrite the test report
  the host reads next.

Exit status: ARGV's (128 + signal number if a signal ended it), or 124 on timeout.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

PR_SET_CHILD_SUBREAPER = 36
TIMEOUT_EXIT = 124
DROP_ENV = ("PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTHONSTARTUP", "PYTHONINSPECT")
SET_ENV = {"PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1"}


def set_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants. False where the kernel has no such call."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (from ``/proc/*/stat``; empty where there is no ``/proc``)."""
    out = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name (field 2) is in parentheses and may contain anything: fields follow the last ")".
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            out.append(int(entry))
    return out


def kill_descendants(group: int) -> None:
    """SIGKILL the command's process group, then every child of this process (orphans of any depth land
    here as subreaper), reaping each, until no child is left."""
    try:
        os.killpg(group, signal.SIGKILL)
    except OSError:
        pass
    me = os.getpid()
    for _ in range(10_000):  # each round kills one generation; a fork bomb is bounded by the sandbox's nproc
        kids = children(me)
        if not kids:
            break
        for kid in kids:
            try:
                os.kill(kid, signal.SIGKILL)
            except OSError:
                pass
        for kid in kids:
            try:
                os.waitpid(kid, 0)
            except ChildProcessError:
                pass
    while True:  # reap whatever is left over where /proc is missing
        try:
            if os.waitpid(-1, os.WNOHANG) == (0, 0):
                break
        except ChildProcessError:
            break


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[0] != "--timeout" or argv[2] != "--":
        print("usage: run_tests.py --timeout SECONDS -- ARGV...", file=sys.stderr)
        return 2
    timeout_s, command = float(argv[1]), argv[3:]
    set_subreaper()
    env = {k: v for k, v in os.environ.items() if k not in DROP_ENV}
    env.update(SET_ENV)
    proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        code = proc.wait(timeout_s)
        code = 128 - code if code < 0 else code
    except subprocess.TimeoutExpired:
        code = None
    finally:
        kill_descendants(proc.pid)
    if code is None:
        print(f"\n[run_tests: the tests ran past {timeout_s:g} s and were killed]", file=sys.stderr)
        return TIMEOUT_EXIT
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
