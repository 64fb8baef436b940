"""Whether a sandbox's known processes can still answer: none stopped, none a zombie, none gone (issue #36, red
team row 11). A co-tenant of the same uid can SIGSTOP any process of a sandbox (its user namespace is that
uid's); a stopped execution server or shell keeps every connection open, so nothing else shows it until a call
times out.

```python
known = snapshot(h.pid)          # once, off the hot path: the launcher and every process under it
reason = fault(known)            # on every check: one small /proc/PID/stat read per known process (~10 us each)
```

A process is named by its host pid and its start time (``/proc/PID/stat`` field 22, clock ticks since boot), so a
pid reused by another process reads as gone. proc(5) gives the fields; the state field comes after the command
name, which may hold any byte but ends at the last ``)``.
"""
from __future__ import annotations

from typing import Optional

import psutil

#: ``/proc/PID/stat`` states of a process that cannot answer: stopped (``T``: SIGSTOP from its user or root),
#: stopped by a tracer (``t``), zombie (``Z``), dead (``X``). proc(5).
NOT_ANSWERING = frozenset(b"TtZX")
_NAMES = {ord("T"): "stopped", ord("t"): "stopped by a tracer", ord("Z"): "a zombie", ord("X"): "dead"}

#: A known process: (host pid, start time in clock ticks since boot).
Known = tuple[int, int]


def stat(pid: int) -> Optional[tuple[int, int, int]]:
    """``(state byte, parent pid, start time in clock ticks)`` of process ``pid`` from ``/proc/PID/stat``;
    ``None`` when it is gone or the file cannot be read or parsed."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0][0], int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def snapshot(root_pid: int, leaf_parent: Optional[int] = None) -> tuple[Known, ...]:
    """``root_pid`` and every process under it (psutil's parent map: one pass over ``/proc``, ~1-5 ms with a
    few hundred processes, so never on an acquire's path), each with its start time. In a bubblewrap sandbox
    every process of its pid namespace is under the launcher (orphans re-parent to the namespace's init).
    ``leaf_parent`` (the execution server's pid): its children are kept (the persistent shell) but nothing
    under them, whose commands come and go (a ``stty`` of the shell's set-up would later read as gone).
    Processes that end between the listing and the read are left out. Empty when ``root_pid`` is gone."""
    try:
        procs = [psutil.Process(root_pid)]
        procs += procs[0].children(recursive=True)
    except psutil.Error:
        return ()
    stats = {p.pid: stat(p.pid) for p in procs}
    leaves = {pid for pid, s in stats.items() if s is not None and s[1] == leaf_parent}
    dropped: set[int] = set()
    known = []
    for p in procs:  # psutil lists a parent before its children
        s = stats[p.pid]
        if s is None or s[1] in leaves or s[1] in dropped:
            dropped.add(p.pid)
            continue
        known.append((p.pid, s[2]))
    return tuple(known)


def fault(known: tuple[Known, ...]) -> Optional[str]:
    """Why the processes ``known`` (from :func:`snapshot`) cannot all answer, e.g. ``"process 123 is stopped"``
    or ``"process 123 is gone"`` (ended, or its pid reused); ``None`` when each runs or sleeps. One
    ``/proc/PID/stat`` read per process, no round trip to the sandbox."""
    for pid, start in known:
        s = stat(pid)
        if s is None or s[2] != start:
            return f"process {pid} is gone"
        if s[0] in NOT_ANSWERING:
            return f"process {pid} is {_NAMES[s[0]]}"
    return None
