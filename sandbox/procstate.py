"""Whether a sandbox's known processes can still answer: none stopped, none a zombie, none gone (issue #36, red
team row 11). A co-tenant of the same uid can SIGSTOP any process of a sandbox (its user namespace is that
uid's); a stopped execution server or shell keeps every connection open, so nothing else shows it until a call
times out.

```python
known = snapshot(h.pid, server)  # once, off the hot path: launcher chain, execution server, its shell
reason = fault(known)            # on every check: one small /proc/PID/stat read per known process (~10 us each)
```

A process is also checked for a frozen cgroup (row 1 of the #36 red team's fourth pass): the cgroup freezer (v1
``freezer.state`` ``FROZEN``/``FREEZING``; v2 ``cgroup.events`` ``frozen 1``) leaves its tasks in state ``D``, not
``T``, so the state field alone does not show it. ``/proc/PID/cgroup`` names the process's freezer cgroup (v1) and
its unified cgroup (v2); the mount points come from ``/proc/self/mountinfo`` once per process (proc(5),
Documentation/admin-guide/cgroup-v1/freezer-subsystem.rst, cgroup-v2.rst "Core Interface Files").

A process is named by its host pid and its start time (``/proc/PID/stat`` field 22, clock ticks since boot), so a
pid reused by another process reads as gone. proc(5) gives the fields; the state field comes after the command
name, which may hold any byte but ends at the last ``)``.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

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


@functools.lru_cache(maxsize=1)
def _freezer_mounts() -> tuple[Optional[tuple[str, str]], Optional[tuple[str, str]]]:
    """``(v1, v2)``: the (root, mount point) of this host's v1 freezer hierarchy and of its cgroup v2 mount, each
    ``None`` when not mounted. Read once from ``/proc/self/mountinfo`` (mounts of cgroup file systems do not move
    while a server runs)."""
    from .bounds import _mounts  # the bounds' own mountinfo reader (the same fields)

    v1 = v2 = None
    try:
        with open("/proc/self/mountinfo") as f:
            mounts = _mounts(f.read())
    except OSError:
        return None, None
    for root, point, fstype, superopts in mounts:
        if fstype == "cgroup" and v1 is None and "freezer" in superopts.split(","):
            v1 = (root, point)
        elif fstype == "cgroup2" and v2 is None:
            v2 = (root, point)
    return v1, v2


def _under(mount: tuple[str, str], path: str) -> Optional[str]:
    """The directory of cgroup ``path`` (as ``/proc/PID/cgroup`` names it) in ``mount`` (root, mount point);
    ``None`` when the mount does not hold it or the path climbs out of it."""
    root, point = mount
    if ".." in path.split("/") or not (path == root or path.startswith(root.rstrip("/") + "/")):
        return None
    return os.path.join(point, os.path.relpath(path, root))


def _read_small(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(4096)
    except OSError:
        return b""


def frozen(pid: int) -> bool:
    """Whether process ``pid``'s cgroup is frozen or freezing by the cgroup freezer (v1: its freezer cgroup's
    ``freezer.state``, which reads the state its ancestors impose too; v2: ``frozen 1`` in its cgroup's
    ``cgroup.events``, likewise). Two small file reads; ``False`` when ``pid`` is gone, no freezer is mounted or
    a file cannot be read (the root cgroup has no freezer files: it cannot be frozen)."""
    text = _read_small(f"/proc/{pid}/cgroup")
    if not text:
        return False
    v1, v2 = _freezer_mounts()
    for line in text.decode("utf-8", "replace").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if v1 is not None and "freezer" in parts[1].split(","):
            d = _under(v1, parts[2])
            if d is not None and _read_small(os.path.join(d, "freezer.state")).strip() in (b"FROZEN", b"FREEZING"):
                return True
        elif v2 is not None and parts[0] == "0" and parts[1] == "":
            d = _under(v2, parts[2])
            if d is not None and b"frozen 1" in _read_small(os.path.join(d, "cgroup.events")).splitlines():
                return True
    return False


def children(pid: int) -> list[int]:
    """Pids of the children of process ``pid``: one pass over ``/proc`` that reads the ``stat`` of the pids above
    ``pid`` first (pids are handed out in increasing order, so a child's is almost always higher; ~10 us a read,
    where psutil's parent map reads every process's, ~25 us each) and the others only when that finds none (the
    kernel's pids wrapped around). The children file of procfs (``/proc/PID/task/TID/children``) would be one
    read, but kernels built without ``CONFIG_PROC_CHILDREN`` (this one) lack it."""
    pids = [int(n) for n in os.listdir("/proc") if n.isdigit()]
    for part in ([q for q in pids if q > pid], [q for q in pids if q < pid]):
        found = [q for q in part if (s := stat(q)) is not None and s[1] == pid]
        if found:
            return found
    return []


def snapshot(root_pid: int, server_pid: int) -> tuple[Known, ...]:
    """The processes of a started sandbox that must keep answering, each with its start time: ``root_pid`` (its
    launcher), the processes between it and ``server_pid`` (its execution server; in a bubblewrap sandbox the
    namespace's init), the server, and the server's children (its persistent shell), but nothing under those,
    whose commands come and go (a ``stty`` of the shell's set-up would later read as gone). Blocking (a pass
    over ``/proc``, :func:`children`): never on an acquire's path. Empty when ``server_pid`` is gone or is not
    under ``root_pid``."""
    chain = [server_pid]
    while chain[-1] != root_pid:
        s = stat(chain[-1])
        if s is None or s[1] <= 1 or len(chain) > 16:  # gone, or not under the launcher
            return ()
        chain.append(s[1])
    known = []
    for pid in [*chain, *children(server_pid)]:
        s = stat(pid)
        if s is not None:
            known.append((pid, s[2]))
    return tuple(known)


def fault(known: tuple[Known, ...]) -> Optional[str]:
    """Why the processes ``known`` (from :func:`snapshot`) cannot all answer, e.g. ``"process 123 is stopped"``,
    ``"process 123 is frozen (cgroup freezer)"`` or ``"process 123 is gone"`` (ended, or its pid reused); ``None``
    when each runs or sleeps. Per process one ``/proc/PID/stat`` read and the :func:`frozen` reads (~40 us in all
    here), no round trip to the sandbox."""
    for pid, start in known:
        s = stat(pid)
        if s is None or s[2] != start:
            return f"process {pid} is gone"
        if s[0] in NOT_ANSWERING:
            return f"process {pid} is {_NAMES[s[0]]}"
        if frozen(pid):
            return f"process {pid} is frozen (cgroup freezer)"
    return None
