"""Session records of the tool processes, for runtimes without a pid namespace (local).

The shell and the kernel each lead their own session (``setsid``); their descendants keep that session id
unless they call ``setsid`` themselves. The execution server writes ``{name: {pid, start_ticks}}`` to a JSON
file in the run directory; after a server crash the host kills exactly the processes of those sessions, having
checked each leader's start time (``/proc/PID/stat`` field 22, clock ticks since boot) so that a reused pid is
never touched.
"""
from __future__ import annotations

import json
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
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        data = {}
    data[name] = {"pid": pid, "start_ticks": start_ticks(pid)}
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def live_session_ids(path: str) -> set[int]:
    """Session ids recorded in ``path`` whose leader is still the same process (pid and start time)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return set()
    sids = set()
    for entry in data.values():
        pid = entry.get("pid")
        if isinstance(pid, int) and entry.get("start_ticks") is not None and start_ticks(pid) == entry["start_ticks"]:
            sids.add(pid)
    return sids
