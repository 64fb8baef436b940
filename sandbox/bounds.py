"""Bounds of a sandbox as a whole (not per process): its memory, through a cgroup of its own, and the disk
its writable host directories (workspace, run directory, ``rw`` binds) take, measured.

Memory. Where this server may create cgroups with the memory controller (cgroup v2: a cgroup whose
``cgroup.subtree_control`` has, or accepts, ``+memory``; cgroup v1: a writable memory hierarchy; or a
delegated directory given as the runtime's ``cgroup_parent``), every sandbox gets a child cgroup
``prorl-<sandbox id>`` with ``memory.max`` (v1: ``memory.limit_in_bytes``, and the same for memory+swap) and,
on v2, ``memory.swap.max = 0`` and ``memory.oom.group = 1``. The launcher is started inside it (it writes
itself into ``cgroup.procs`` and then execs), so every process of the sandbox, tmpfs pages included, is
charged to it. When the kernel's OOM killer runs in it, the host kills the whole sandbox (v2 does so itself)
and reports :class:`~sandbox.errors.SandboxDeadError` with ``reason="memory"``. Elsewhere the only memory
bound is per process (``RLIMIT_AS``, :class:`~sandbox.spec.Limits` ``max_memory_bytes``), and the runtime says
so once, at its start (:func:`memory_cgroups`).

Disk. A workspace must stay a host directory that graders read after the sandbox is gone, and a rootless
server can mount no quota'd file system (a sized tmpfs inside the sandbox's mount namespace is invisible to
the host and dies with it; a loop image or a project quota needs root), so the quota is *measured*, and the
runtime says so at its start. The host measures (:func:`disk_usage`: allocated blocks, so
``posix_fallocate`` counts; :func:`open_deleted_bytes`: files unlinked but held open, mapped or running)
every ``watch_interval_s``, each sandbox on its own schedule, and kills the sandbox when its writable host
directories pass the quota (``reason="disk_quota"``); ``RLIMIT_FSIZE`` bounds any single file to the quota as
well. What a sandbox can make a measurement cost is bounded too: one measurement reads at most
``max_entries`` entries (directory entries plus its processes' descriptors, :class:`MeasureBudget`,
default :data:`MAX_MEASURED_ENTRIES`, ~0.4 s here); a sandbox past that, or holding a path the kernel will
not resolve (longer than ``PATH_MAX``), cannot be measured and counts as over its quota
(:class:`UnmeasurableError`). The budget counts entries, not seconds: a slow, loaded host must never make an
honest sandbox look too costly. A sandbox may still overshoot by what it writes in one interval (bubblewrap
refuses ``fallocate(2)`` with a seccomp filter, :func:`sandbox.bubblewrap.no_fallocate_filter`, so that is at
most write speed, not a reservation of any size in milliseconds), so the host also watches the free space of
the file systems that hold the workspaces (:func:`free_bytes`): below the runtime's floor it ends the largest
sandbox there before the disk fills, and judges by what the kill frees whether the sandbox hid bytes from
measurement (:func:`floor_slack`, :func:`free_after_release`).
"""
from __future__ import annotations

import errno
import functools
import logging
import os
import signal
import stat
import time
from dataclasses import dataclass
from typing import Optional, Sequence

log = logging.getLogger(__name__)

#: Size of each of a sandbox's writable tmpfs mounts (/tmp, /dev/shm), bytes.
DEFAULT_TMPFS_BYTES = 512 << 20
#: Memory of a sandbox as a whole (cgroup), bytes.
DEFAULT_MEMORY_BYTES = 8 << 30
#: Disk quota of a sandbox's writable host directories (workspace, run directory, rw binds), bytes.
DEFAULT_WORKSPACE_BYTES = 4 << 30
#: Every file system entry counts at least this much (an inode and a directory entry), so that a million
#: empty files pass a quota as surely as a large file.
MIN_ENTRY_BYTES = 4096
CGROUP_PREFIX = "prorl-"
#: Most entries one measurement of a sandbox's disk use reads (directory entries of its writable host
#: directories plus its processes and their descriptors): 100,000 cost ~0.4 s of one core here (a
#: 6,000-file repository ~25 ms). A sandbox that needs more cannot be measured and counts as over its quota.
MAX_MEASURED_ENTRIES = 100_000
#: Free space (bytes) below which the host ends the largest sandbox on a file system holding workspaces.
DEFAULT_MIN_FREE_BYTES = 1 << 30
#: Least slack (bytes) between what a floor eviction freed and what the sandbox measured before it counts
#: as having hidden bytes (see :func:`floor_slack`).
MIN_FLOOR_SLACK_BYTES = 16 << 20
#: How long (seconds) the host watches free space rise after a floor eviction's processes are gone (the
#: kernel may free a large unlinked file, or a socket's in-flight descriptors, a little later).
RELEASE_SETTLE_S = 0.5


class UnmeasurableError(Exception):
    """A sandbox's disk use cannot be measured within bounds: more entries than its :class:`MeasureBudget`,
    or a path longer than ``PATH_MAX`` (what lies below it would be invisible to the walk). The runtime
    counts such a sandbox as over its quota: only what ran inside can make its workspace so."""


class MeasureBudget:
    """How many entries (directory entries, processes, descriptors) one measurement may still read;
    :meth:`spend` raises :class:`UnmeasurableError` past ``max_entries``."""

    def __init__(self, max_entries: int = MAX_MEASURED_ENTRIES) -> None:
        self.max_entries = max_entries
        self.left = max_entries

    def spend(self, n: int = 1) -> None:
        self.left -= n
        if self.left < 0:
            raise UnmeasurableError(f"more than {self.max_entries} entries (files, processes and descriptors) "
                                    "to read")


@dataclass(frozen=True)
class MemoryCgroups:
    """Where sandbox cgroups are created: ``parent`` (a directory of a cgroup file system) and ``version``
    (1 or 2)."""

    parent: str
    version: int

    def create(self, name: str, limit_bytes: int) -> str:
        """Create the cgroup ``parent/name`` with a memory limit of ``limit_bytes``; returns its path.
        Raises ``OSError`` if it cannot be created or limited (the directory is removed again)."""
        path = os.path.join(self.parent, name)
        os.mkdir(path)
        try:
            if self.version == 2:
                _write(path, "memory.max", str(limit_bytes))
                for f, v in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
                    if os.path.exists(os.path.join(path, f)):
                        _write(path, f, v)
            else:
                _write(path, "memory.limit_in_bytes", str(limit_bytes))
                if os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):
                    _write(path, "memory.memsw.limit_in_bytes", str(limit_bytes))
        except BaseException:
            os.rmdir(path)
            raise
        return path

    def oom_kills(self, path: str) -> int:
        """How many processes the OOM killer has killed in the cgroup ``path`` (0 if it is gone)."""
        return oom_kills(path, self.version)


def oom_kills(path: str, version: int) -> int:
    """OOM kills counted in cgroup ``path`` (v2 ``memory.events``, v1 ``memory.oom_control``); 0 if it is
    unreadable."""
    try:
        with open(os.path.join(path, "memory.events" if version == 2 else "memory.oom_control")) as f:
            fields = dict(line.split() for line in f if line.strip())
    except (OSError, ValueError):
        return 0
    return int(fields.get("oom_kill", 0)) + int(fields.get("oom_group_kill", 0))


def remove_cgroup(path: str, version: int, timeout_s: float = 2.0) -> bool:
    """Kill what is left in the cgroup ``path`` (v2 ``cgroup.kill``, else SIGKILL to each pid it lists:
    only processes of the sandbox can be in it) and remove it. Returns whether it is gone."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                log.warning("sandbox cgroup %s not removed: %s", path, e)
                return False
        if os.path.exists(os.path.join(path, "cgroup.kill")):
            _write(path, "cgroup.kill", "1", missing_ok=True)
        else:
            try:
                with open(os.path.join(path, "cgroup.procs")) as f:
                    pids = [int(x) for x in f.read().split()]
            except OSError:
                pids = []
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        time.sleep(0.01)


def sweep_stale_cgroups(parent: str, version: int, older_than_s: float = 600.0) -> int:
    """Remove the sandbox cgroups (``prorl-*``) under ``parent`` that hold no process and were made more than
    ``older_than_s`` seconds ago: left by a server killed before it could remove them, whose state directory
    no later server reaps. A live sandbox always has its launcher inside its cgroup, so none is touched.
    Returns how many were removed."""
    removed = 0
    try:
        names = [n for n in os.listdir(parent) if n.startswith(CGROUP_PREFIX)]
    except OSError:
        return 0
    now = time.time()
    for name in names:
        path = os.path.join(parent, name)
        try:
            if now - os.stat(path).st_mtime < older_than_s:
                continue
            with open(os.path.join(path, "cgroup.procs")) as f:
                if f.read().strip():
                    continue
            os.rmdir(path)
            removed += 1
        except OSError:
            continue
    if removed:
        log.info("removed %d stale sandbox cgroup(s) under %s", removed, parent)
    return removed


def _write(path: str, name: str, value: str, missing_ok: bool = False) -> None:
    try:
        with open(os.path.join(path, name), "w") as f:
            f.write(value)
    except FileNotFoundError:
        if not missing_ok:
            raise


def _mounts(mountinfo: str) -> list[tuple[str, str, str, str]]:
    """(root, mount point, fstype, super options) of each line of ``/proc/self/mountinfo``."""
    out = []
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        a, b = left.split(), right.split()
        if len(a) >= 5 and len(b) >= 3:
            out.append((a[3], a[4].replace("\\040", " "), b[0], b[2]))
    return out


def find_memory_cgroups(self_cgroup: str, mountinfo: str, *, enable: bool = True) -> Optional[MemoryCgroups]:
    """Where this process may create memory-limited cgroups, from the text of ``/proc/self/cgroup`` and
    ``/proc/self/mountinfo``: the process's own cgroup of a cgroup v2 mount whose ``cgroup.controllers``
    lists ``memory`` and whose ``cgroup.subtree_control`` has it (``enable``: or accepts ``+memory``), else its
    own cgroup of a cgroup v1 memory hierarchy, in each case only if it is writable; ``None`` if neither.
    Nothing is created."""
    own2, own1 = None, None
    for line in self_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            own2 = parts[2]
        elif "memory" in parts[1].split(","):
            own1 = parts[2]
    mounts = _mounts(mountinfo)

    def under(root: str, mount: str, own: str) -> Optional[str]:
        if own == root or own.startswith(root.rstrip("/") + "/"):
            return os.path.join(mount, os.path.relpath(own, root)).rstrip("/.") or mount
        return None

    if own2 is not None:
        for root, mount, fstype, _opts in mounts:
            path = under(root, mount, own2) if fstype == "cgroup2" else None
            if path is None or not os.access(path, os.W_OK):
                continue
            try:
                with open(os.path.join(path, "cgroup.controllers")) as f:
                    if "memory" not in f.read().split():
                        continue
                with open(os.path.join(path, "cgroup.subtree_control")) as f:
                    enabled = "memory" in f.read().split()
                if not enabled and enable:
                    _write(path, "cgroup.subtree_control", "+memory")
                    enabled = True
            except OSError:
                continue
            if enabled:
                return MemoryCgroups(path, 2)
    if own1 is not None:
        for root, mount, fstype, opts in mounts:
            if fstype != "cgroup" or "memory" not in opts.split(","):
                continue
            path = under(root, mount, own1)
            if path and os.path.isdir(path) and os.access(path, os.W_OK) and \
                    os.path.exists(os.path.join(path, "memory.limit_in_bytes")):
                return MemoryCgroups(path, 1)
    return None


def check_cgroup_parent(parent: str) -> MemoryCgroups:
    """A configured, delegated cgroup directory (the runtime's ``cgroup_parent``): its version and that it
    can limit memory. Raises ``ValueError`` if it cannot."""
    if os.path.exists(os.path.join(parent, "cgroup.subtree_control")):
        with open(os.path.join(parent, "cgroup.subtree_control")) as f:
            if "memory" not in f.read().split():
                raise ValueError(f"cgroup_parent {parent}: memory is not in its cgroup.subtree_control")
        version = 2
    elif os.path.exists(os.path.join(parent, "memory.limit_in_bytes")):
        version = 1
    else:
        raise ValueError(f"cgroup_parent {parent} is not a cgroup directory with the memory controller")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"cgroup_parent {parent} is not writable by this user")
    return MemoryCgroups(parent, version)


@functools.lru_cache(maxsize=None)
def memory_cgroups(parent: Optional[str] = None) -> Optional[MemoryCgroups]:
    """This server's sandbox cgroups (``parent``: a configured delegated directory, checked), found once per
    process; when there are none, logs once that a sandbox's memory is bounded per process only."""
    if parent:
        return check_cgroup_parent(parent)
    try:
        with open("/proc/self/cgroup") as f, open("/proc/self/mountinfo") as g:
            found = find_memory_cgroups(f.read(), g.read())
    except OSError:
        found = None
    if found is None:
        log.warning("sandbox memory is bounded per process only (RLIMIT_AS, Limits.max_memory_bytes), not per "
                    "sandbox: this server cannot create memory cgroups (no writable cgroup v2 with the memory "
                    "controller delegated, nor a writable v1 memory hierarchy). Give the runtime a delegated "
                    "cgroup_parent to bound each sandbox as a whole.")
    else:
        log.info("sandbox memory: one cgroup v%d per sandbox under %s", found.version, found.parent)
    return found


def disk_usage(paths: Sequence[str], stop_above: Optional[int] = None, budget: Optional[MeasureBudget] = None) -> int:
    """Bytes the trees at ``paths`` take on disk: allocated blocks of each entry (``st_blocks``: space reserved
    with ``fallocate`` counts), at least :data:`MIN_ENTRY_BYTES` per entry, hard links counted once, symbolic
    links not followed, other file systems not entered. Stops early once the total passes ``stop_above``. An
    unreadable directory owned by this user is made readable (a sandbox may ``chmod 000`` to hide what it
    wrote); entries that vanish while it walks are skipped.

    Raises:
        UnmeasurableError: more entries than ``budget`` allows, or a path longer than ``PATH_MAX`` (skipping
            it would hide everything below it).
    """
    total = 0
    seen: set[tuple[int, int]] = set()
    me = os.geteuid()

    def too_long(e: OSError) -> None:
        if e.errno == errno.ENAMETOOLONG:
            raise UnmeasurableError(f"a path longer than PATH_MAX under {paths[0]!r}") from e

    for top in dict.fromkeys(paths):
        try:
            st = os.lstat(top)
        except OSError:
            continue
        dev = st.st_dev
        stack = [top]
        total += max(st.st_blocks * 512, MIN_ENTRY_BYTES)
        while stack:
            d = stack.pop()
            try:
                it = os.scandir(d)
            except PermissionError:
                try:
                    if os.lstat(d).st_uid == me:
                        os.chmod(d, 0o700)
                        it = os.scandir(d)
                    else:
                        continue
                except OSError as e:
                    too_long(e)
                    continue
            except OSError as e:
                too_long(e)
                continue
            with it:
                for e in it:
                    if budget is not None:
                        budget.spend()
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError as err:
                        too_long(err)
                        continue
                    if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                        key = (st.st_dev, st.st_ino)
                        if key in seen:
                            continue
                        seen.add(key)
                    total += max(st.st_blocks * 512, MIN_ENTRY_BYTES)
                    if stat.S_ISDIR(st.st_mode) and st.st_dev == dev:
                        stack.append(e.path)
            if stop_above is not None and total > stop_above:
                return total
    return total


def open_deleted_bytes(root_pid: int, paths: Sequence[str], budget: Optional[MeasureBudget] = None) -> int:
    """Bytes of files on the file systems of ``paths`` that processes of the tree under ``root_pid`` hold
    after unlinking them (no link left): open (``/proc/PID/fd``), mapped (``/proc/PID/maps``, see
    :func:`_mapped_deleted`) or running (``/proc/PID/exe``): a walk of the tree cannot see them, yet they take the disk
    until the last descriptor closes (open, unlink, write: 6 GB passed a 4 GiB quota unseen). Each file counted
    once; a process that ends or a descriptor that closes while this reads is skipped. One ``stat`` per
    descriptor.

    Raises:
        UnmeasurableError: more processes plus descriptors plus mappings than ``budget`` allows (400 processes
            sharing 1,000 descriptors made one unbounded reading cost 8-13 s), or a mapped deleted file whose
            size cannot be read.
    """
    import psutil

    devices = set()
    for p in paths:
        try:
            devices.add(os.lstat(p).st_dev)
        except OSError:
            continue
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    if budget is not None:
        budget.spend(len(procs))
    total, seen = 0, set()

    def count(st: os.stat_result) -> None:
        nonlocal total
        key = (st.st_dev, st.st_ino)
        if st.st_nlink == 0 and stat.S_ISREG(st.st_mode) and st.st_dev in devices and key not in seen:
            seen.add(key)
            total += st.st_blocks * 512

    for proc in procs:
        fd_dir = f"/proc/{proc.pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        if budget is not None:
            budget.spend(len(fds))
        for fd in fds:
            try:
                st = os.stat(os.path.join(fd_dir, fd))  # the open file itself, whatever its name was
            except OSError:
                continue
            count(st)
        try:  # a program run from a file it then unlinked keeps the file alive
            count(os.stat(f"/proc/{proc.pid}/exe"))
        except OSError:
            pass
        _mapped_deleted(proc.pid, devices, seen, count, budget)
    return total


def _mapped_deleted(pid: int, devices: set[int], seen: set[tuple[int, int]], count, budget: Optional[MeasureBudget]
                    ) -> None:
    """Count (``count(stat)``) the files on ``devices`` that process ``pid`` maps after unlinking them: a
    ``MAP_SHARED`` mapping keeps a file alive with no descriptor left (red team: 6.25x the quota held through
    ctypes ``mmap``, fd closed, file unlinked). Their size comes from ``stat`` of ``/proc/PID/map_files/RANGE``,
    which the kernel allows only with ``CAP_SYS_ADMIN`` or ``CAP_CHECKPOINT_RESTORE`` (a root server).

    Raises:
        UnmeasurableError: more lines than ``budget`` allows, a ``/proc/PID/maps`` line longer than 8 KiB, or
            a deleted file mapped on ``devices`` whose size cannot be read (a rootless server): the bytes
            it holds are invisible, so the sandbox counts as over its quota.
    """
    try:
        f = open(f"/proc/{pid}/maps", "rb")
    except OSError:
        return
    with f:
        while True:
            try:
                line = f.readline(8192)
            except OSError:
                return  # the process ended while this read
            if not line:
                return
            if budget is not None:
                budget.spend()
            if not line.endswith(b"\n"):
                raise UnmeasurableError(f"a line of /proc/{pid}/maps longer than 8 KiB")
            if not line.endswith(b" (deleted)\n"):
                continue
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or fields[4] == b"0":
                continue
            try:
                major, minor = (int(x, 16) for x in fields[3].split(b":"))
                dev, ino = os.makedev(major, minor), int(fields[4])
            except ValueError:
                continue
            if dev not in devices or (dev, ino) in seen:
                continue
            try:
                st = os.stat(f"/proc/{pid}/map_files/{fields[0].decode('ascii')}")
            except FileNotFoundError:
                continue  # unmapped (or the process ended) while this read
            except OSError as e:
                raise UnmeasurableError(f"process {pid} maps a deleted file (inode {ino}) of a sandbox directory "
                                        f"whose size cannot be read ({e.strerror})") from e
            count(st)


def free_bytes(path: str) -> int:
    """Bytes an unprivileged user can still write on the file system holding ``path`` (``statvfs``
    ``f_bavail * f_frsize``). Raises ``OSError``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def floor_slack(floor: int) -> int:
    """Bytes an evicted sandbox's end may free beyond its measured usage before it counts as having hidden
    bytes from measurement: ``max(MIN_FLOOR_SLACK_BYTES, floor // 64)`` (what was written between the last
    measurement and the kill, what the file system's own accounting moves)."""
    return max(MIN_FLOOR_SLACK_BYTES, floor // 64)


def free_after_release(path: str, before: int, settle_s: float = RELEASE_SETTLE_S, step_s: float = 0.05) -> int:
    """Free bytes (:func:`free_bytes`) of the file system of ``path`` once what a sandbox's ended processes
    held is released: the most seen over ``settle_s`` seconds, sampled every ``step_s`` and stopped early
    when two samples in a row agree above ``before``. Raises ``OSError``."""
    best = last = free_bytes(path)
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        time.sleep(step_s)
        now = free_bytes(path)
        best = max(best, now)
        if now == last and now > before:
            break
        last = now
    return best
