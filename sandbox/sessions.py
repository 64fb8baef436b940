"""Session records of the tool processes, for the runtime without a pid namespace (local) only.

The shell and the kernel each lead their own session (``setsid``); their descendants keep that session id
unless they call ``setsid`` themselves. The execution server writes ``{name: {pid, start_ticks}}`` to a JSON
file in the run directory; after a server crash the host kills exactly the processes of those sessions, having
checked each leader's start time (``/proc/PID/stat`` field 22, clock ticks since boot) so that a reused pid is
never touched, and its environment marker (:func:`carries_marker`) so that a forged entry naming an unrelated
process is never trusted. Isolated runtimes never read this file: their sandboxes are found through the pid
namespace and the process group the host recorded itself.
"""
from __future__ import annotations

import os
# `typing` costs ~9 ms to import and this module runs in every sandbox start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional


def start_ticks(pid: int) -> Optional[int]:
    """Start time of ``pid`` in clock ticks since boot, or ``None`` if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def record_session(path: str, name: str, pid: int) -> None:
    """Add/replace entry ``name`` in the sessions file at ``path`` (atomic replace)."""
    import json  # here, not at the top: the execution server imports this module at every start, json costs ~10 ms

    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        data = {}
    data[name] = {"pid": pid, "start_ticks": start_ticks(pid)}
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


#: Environment variable that marks every tool process of a sandbox with the sandbox's id (set by the host in
#: the tool environment, after the spec's own variables).
MARKER_VAR = "PRORL_SANDBOX_ID"


def carries_marker(pid: int, sandbox_id: str) -> bool:
    """True if ``pid``'s initial environment (``/proc/PID/environ``, as of its last exec) holds
    ``PRORL_SANDBOX_ID=<sandbox_id>``. A process that is not a descendant of the sandbox's tools never does
    (no process can set another's environment), nor does one this user cannot read."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return False
    return (MARKER_VAR + "=" + sandbox_id).encode() in env.split(b"\0")


#: Bounds of a sessions file as the host reads it (bytes, JSON items): a sandbox holds at most a few hundred
#: sessions of under 100 bytes each; anything larger was not written by the execution server. Plain ints: this
#: module is imported on the execution server's start path, which must not import the JSON scanner.
SESSIONS_FILE_MAX_BYTES, SESSIONS_FILE_MAX_ITEMS = 1 << 20, 1 << 16


def live_session_ids(path: str, sandbox_id: str) -> set[int]:
    """Session ids recorded in ``path`` whose leader is still the same process (pid and start time) and carries
    the marker of ``sandbox_id`` (:func:`carries_marker`). The file is written by the sandbox's own execution
    server, so code in the sandbox can forge it: an entry naming any other process is ignored."""
    import stat

    from .bounded_json import JsonBounds, loads

    try:  # a link is refused, a FIFO never blocks, and at most one byte past the bound is read
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return set()
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return set()
        bounds = JsonBounds(SESSIONS_FILE_MAX_BYTES, SESSIONS_FILE_MAX_ITEMS)
        data = loads(os.read(fd, bounds.max_bytes + 1), bounds)
    except (OSError, ValueError):  # JsonBoundError is a ValueError: too large, too many items, not JSON
        return set()
    finally:
        os.close(fd)
    if not isinstance(data, dict):
        return set()
    sids = set()
    for entry in data.values():
        if not isinstance(entry, dict):
            continue
        pid = entry.get("pid")
        if (isinstance(pid, int) and pid > 1 and entry.get("start_ticks") is not None
                and start_ticks(pid) == entry["start_ticks"] and carries_marker(pid, sandbox_id)):
            sids.add(pid)
    return sids
