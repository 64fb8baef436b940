"""Process ownership: per-user records of the sandboxes a server started, and killing a sandbox's processes.

A record is one JSON file, ``<state_dir>/sandboxes/<sandbox_id>.json``, written before the sandbox is
contacted and removed after it is closed. It names the owning server (pid + psutil create time) and the
sandbox's launcher process (pid + create time; the launcher leads its own process group and session). A
server that starts later reaps the records whose owner is gone, and only those: a record's processes are found
by pid + create time, descendants and recorded session ids — never by process name.

The state directory is per user (``$XDG_RUNTIME_DIR/prorl``, else ``~/.local/state/prorl``, or a configured
one), created ``0700``; never a shared ``/tmp`` file.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import socket
import stat
import time
from typing import Any, Awaitable, Callable, Iterable, Optional

import psutil

log = logging.getLogger(__name__)

_CREATE_TIME_TOLERANCE_S = 0.05


def default_state_dir() -> str:
    """``$XDG_RUNTIME_DIR/prorl`` if that variable names a directory, else ``~/.local/state/prorl``."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return os.path.join(xdg, "prorl")
    return os.path.join(os.path.expanduser("~"), ".local", "state", "prorl")


def process_identity(pid: int) -> Optional[float]:
    """psutil create time (seconds since the epoch) of ``pid``, or ``None`` if there is no such process."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def same_process(pid: Optional[int], create_time: Optional[float]) -> bool:
    """True if ``pid`` is alive, not a zombie, and was created at ``create_time`` (a reused pid is False)."""
    if not pid or create_time is None:
        return False
    try:
        p = psutil.Process(pid)
        return (abs(p.create_time() - create_time) < _CREATE_TIME_TOLERANCE_S
                and p.status() != psutil.STATUS_ZOMBIE)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


#: Environment variable the host sets on every sandbox launcher: ``<sandbox_id>``. It finds a launcher whose pid
#: its server never recorded (killed between the launch and the record). Only the process that execs a
#: program sets its environment, so code in a sandbox can mark only its own processes, never a host process.
LAUNCHER_MARKER_VAR = "PRORL_LAUNCHER_ID"


@dataclasses.dataclass(frozen=True)
class MarkedProcess:
    """A live process whose initial environment holds ``PRORL_LAUNCHER_ID=<sandbox_id>`` (a sandbox's launcher,
    or a process it forked or exec'd without clearing its environment: bwrap's namespace init, the execution
    server): its ``pid``, ``create_time`` (epoch seconds), parent ``ppid`` and pid namespace inode ``pidns``."""

    pid: int
    create_time: float
    ppid: int
    pidns: Optional[int]


def marked_processes() -> dict[str, list[MarkedProcess]]:
    """Every live process carrying a launcher marker, by the sandbox id it names: one pass over ``/proc`` for a
    whole reap (a pass per record took a full scan each, 5,000 forged records 5,000 scans)."""
    prefix = f"{LAUNCHER_MARKER_VAR}=".encode()
    out: dict[str, list[MarkedProcess]] = {}
    for p in psutil.process_iter():
        try:
            with open(f"/proc/{p.pid}/environ", "rb") as f:
                ids = [e[len(prefix):] for e in f.read().split(b"\0") if e.startswith(prefix)]
            if not ids or not _alive(p):
                continue
            m = MarkedProcess(p.pid, p.create_time(), p.ppid(), pid_namespace(p.pid))
            out.setdefault(ids[0].decode(errors="replace"), []).append(m)
        except (OSError, psutil.Error):
            continue
    return out


def live_pid_namespaces() -> set[int]:
    """Inodes of the pid namespaces that hold a live process (one readlink per process)."""
    out = set()
    for pid in psutil.pids():
        ns = pid_namespace(pid)
        if ns is not None:
            out.add(ns)
    return out


_PR_GET_CHILD_SUBREAPER = 37


def orphan_adopters() -> set[int]:
    """Pids that may be the parent of a dead server's launcher (an orphan is re-parented to the nearest child
    subreaper above it, else to init, prctl(2) PR_SET_CHILD_SUBREAPER): 0, 1, this process's ancestors (a
    server of this node and this one normally share them: systemd --user, a container's init, a Slurm step),
    and this process if it is a subreaper. A launcher whose parent is alive and is none of these was spawned by
    a live process: never a dead server's orphan."""
    out = {0, 1}
    try:
        out.update(p.pid for p in psutil.Process().parents())
    except psutil.Error:
        pass
    try:
        import ctypes

        flag = ctypes.c_int(0)
        if ctypes.CDLL(None, use_errno=True).prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) == 0 \
                and flag.value:
            out.add(os.getpid())
    except (OSError, AttributeError):
        pass
    return out


class OwnershipStore:
    """The records of one state directory. File operations are small and local; the async methods of the
    runtimes call these through ``asyncio.to_thread``."""

    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir
        self.dir = os.path.join(state_dir, "sandboxes")
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        os.chmod(state_dir, 0o700)

    def _path(self, sandbox_id: str) -> str:
        return os.path.join(self.dir, f"{sandbox_id}.json")

    def write(self, record: dict[str, Any]) -> None:
        path = self._path(record["sandbox_id"])
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)

    def remove(self, sandbox_id: str) -> None:
        try:
            os.unlink(self._path(sandbox_id))
        except FileNotFoundError:
            pass

    def records(self) -> list[dict[str, Any]]:
        """The records, each a dict with at least a string ``sandbox_id``. A name that is not a regular file of
        this user with one link (a symbolic link is never followed, a FIFO never blocks the open), larger than
        :data:`MAX_RECORD_BYTES` or not a JSON object is skipped with a warning: what a reaper acts on must be
        a record this server's user wrote, never one planted through a link or by another user."""
        out, skipped = [], []
        for name in sorted(os.listdir(self.dir)):
            if not name.endswith(".json"):
                continue
            rec = _read_record(os.path.join(self.dir, name))
            if isinstance(rec, dict) and isinstance(rec.get("sandbox_id"), str) \
                    and name == f"{rec['sandbox_id']}.json":
                out.append(rec)
            else:
                skipped.append(name)
        if skipped:  # one line however many were planted (a line each flooded the log)
            log.warning("%d ownership record(s) skipped: not a regular file of this user holding a record, e.g. %s",
                        len(skipped), ", ".join(skipped[:3]))
        return out


#: A record is a few hundred bytes; a larger file is not one.
MAX_RECORD_BYTES = 64 * 1024


def _read_record(path: str) -> Any:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1 \
                or st.st_size > MAX_RECORD_BYTES:
            return None
        return json.loads(os.read(fd, MAX_RECORD_BYTES + 1))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def _boot_id() -> Optional[str]:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def node_identity() -> dict[str, Any]:
    """``{"node": hostname, "boot_id": the kernel's boot id, "owner_pidns": this process's pid namespace}``:
    written into every record beside its owner, so that a reaper tells a server of this node, boot and pid
    namespace from one of another node sharing the state directory (a home directory on a cluster's shared
    file system) or of another container on this node (whose pids mean nothing here)."""
    return {"node": socket.gethostname(), "boot_id": _boot_id(), "owner_pidns": pid_namespace()}


def owner_gone(rec: dict[str, Any], here: dict[str, Any]) -> bool:
    """Whether the server that wrote ``rec`` is provably dead, seen from the node ``here``
    (:func:`node_identity`): a record of another node is never (its server's pid means nothing here); one of
    an earlier boot of this node always; one of another pid namespace of this boot never; else its pid is gone
    or belongs to a process of another create time (:func:`same_process`). Records without these fields (older
    servers) count as this node's and namespace's."""
    node, boot = rec.get("node"), rec.get("boot_id")
    if node is not None and node != here["node"]:
        return False
    if boot is not None and here["boot_id"] is not None and boot != here["boot_id"]:
        return True
    if rec.get("owner_pidns") is not None and rec.get("owner_pidns") != here["owner_pidns"]:
        return False
    pid, ct = rec.get("owner_pid"), rec.get("owner_create_time")
    if not isinstance(pid, int) or not isinstance(ct, (int, float)):
        return True  # no owner named at all: nothing can hold it
    return not same_process(pid, ct)


# ------------------------------------------------------------------------------------------- killing


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True


def pid_namespace(pid: int | str = "self") -> Optional[int]:
    """Inode number of the pid namespace of ``pid`` (``/proc/PID/ns/pid``), or ``None`` if unreadable."""
    try:
        return int(os.readlink(f"/proc/{pid}/ns/pid").split("[", 1)[1].rstrip("]"))
    except (OSError, IndexError, ValueError):
        return None


def sandbox_processes(pid: int, create_time: Optional[float], sessions: Iterable[int] = (),
                      pidns: Optional[int] = None, not_before: Optional[float] = None) -> list[psutil.Process]:
    """The live processes of a sandbox: the launcher ``pid`` (if its create time matches), its descendants,
    every process whose session id is in ``sessions``, and every process of the sandbox's own pid namespace
    ``pidns`` created at or after ``not_before`` (epoch seconds; guards against a recycled namespace inode).
    The namespace finds the sandbox's processes even after its launcher is gone."""
    found: dict[int, psutil.Process] = {}
    if same_process(pid, create_time):
        root = psutil.Process(pid)
        found[root.pid] = root
        try:
            for c in root.children(recursive=True):
                found[c.pid] = c
        except psutil.NoSuchProcess:
            pass
    sessions = set(sessions)
    if pidns is not None and pidns == pid_namespace():
        pidns = None  # never treat the host's own namespace as the sandbox's
    if sessions or pidns is not None:
        for p in psutil.process_iter():
            try:
                if (sessions and os.getsid(p.pid) in sessions) or (
                        pidns is not None and pid_namespace(p.pid) == pidns
                        and (not_before is None or p.create_time() >= not_before - 1.0)):
                    found[p.pid] = p
            except (OSError, psutil.Error):
                continue
    return [p for p in found.values() if _alive(p)]


def _signal_all(procs: list[psutil.Process], pgid: Optional[int], sig: int) -> None:
    if pgid:
        try:
            os.killpg(pgid, sig)
        except OSError:
            pass
    for p in procs:
        try:
            p.send_signal(sig)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


async def kill_sandbox(pid: int, create_time: Optional[float], *, grace_s: float, sessions: Iterable[int] = (),
                       pidns: Optional[int] = None, not_before: Optional[float] = None,
                       own_child_wait: Optional[Callable[[], Awaitable[Any]]] = None) -> list[psutil.Process]:
    """SIGTERM, up to ``grace_s`` seconds, then SIGKILL to the sandbox's process group and every process
    found by :func:`sandbox_processes` (arguments as there); repeated until none is left (at most ~5 s
    more). Returns the processes still alive at the end (normally ``[]``). ``own_child_wait``: ``proc.wait``
    of the launcher when it is this process's child, so that asyncio (not psutil) reaps it."""
    sessions = set(sessions)
    pgid = pid if same_process(pid, create_time) else None
    procs = await asyncio.to_thread(sandbox_processes, pid, create_time, sessions, pidns, not_before)
    if not procs:
        return []
    waiter = asyncio.ensure_future(own_child_wait()) if own_child_wait else None
    deadline = time.monotonic() + grace_s
    # Inside first: the execution server exits on SIGTERM, and a launcher whose child exited reaps it and
    # exits by itself (killing the launcher first would leave its children as zombies for init to reap).
    _signal_all([p for p in procs if p.pid != pid], None, signal.SIGTERM)
    while time.monotonic() < deadline - grace_s / 2 and any(_alive(p) for p in procs):
        await asyncio.sleep(0.005)
    _signal_all([p for p in procs if _alive(p)], pgid, signal.SIGTERM)
    while time.monotonic() < deadline and any(_alive(p) for p in procs):
        await asyncio.sleep(0.005)
    for _ in range(50):
        # Children forked during the grace period are found again through the recorded sessions and the
        # parent links of the survivors.
        extra: list[psutil.Process] = []
        for p in procs:
            if _alive(p):
                try:
                    extra.extend(p.children(recursive=True))
                except psutil.NoSuchProcess:
                    pass
        if sessions or pidns is not None:
            extra.extend(await asyncio.to_thread(sandbox_processes, 0, None, sessions, pidns, not_before))
        procs = [p for p in {p.pid: p for p in procs + extra}.values() if _alive(p)]
        if not procs:
            break
        _signal_all(procs, pgid, signal.SIGKILL)
        await asyncio.sleep(0.1)
    if waiter is not None:
        try:
            await asyncio.wait_for(waiter, 5.0)
        except asyncio.TimeoutError:
            pass
    return [p for p in procs if _alive(p)]
