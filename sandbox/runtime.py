"""The ``SandboxRuntime`` interface and the ``SandboxHandle`` agents act through (runtimes by name:
:mod:`sandbox.factory`).

A runtime turns a :class:`~sandbox.spec.SandboxSpec` into a launcher command line (bwrap, apptainer, or plain
python); everything else is shared here: per-sandbox run directory and workspace, the ownership record, the
loopback lease, the interpreter an isolated sandbox sees (:mod:`sandbox.python_view`: an allow-list of
distributions, never the server's whole environment), the sandbox's bounds as a whole (:mod:`sandbox.bounds`:
a memory cgroup, the workspace's disk quota, watched), starting the launcher in its own session/process group,
waiting for the execution server, closing (SIGTERM → grace → SIGKILL to the whole group, then a psutil check
that nothing is left), and reaping what a crashed earlier server left behind.
"""
from __future__ import annotations

import abc
import asyncio
import base64
import compileall
import dataclasses
import functools
import itertools
import json
import logging
import os
import re
import secrets
import stat
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import psutil

from . import bounds, procstate
from .bounds import DEFAULT_MEMORY_BYTES, DEFAULT_TMPFS_BYTES, DEFAULT_WORKSPACE_BYTES
from .client import SERVER_GRACE_S, ExecClient
from .errors import (FileTransferError, SandboxClosedError, SandboxDeadError, SandboxError, SandboxEvictedError,
                     SandboxStartError)
from .leases import Lease
from .loopback import DEFAULT_LEASE_DIR, DEFAULT_NETWORK, LoopbackAllocator
from .remove import remove_tree
from .ownership import (LAUNCHER_MARKER_VAR, MarkedProcess, OwnershipStore, default_state_dir, kill_sandbox,
                        live_pid_namespaces, marked_processes, node_identity, orphan_adopters, owner_gone, pid_namespace,
                        process_identity, same_process)
from .protocol import MAX_TRANSFER_BYTES
from .python_view import PythonView, default_view_dir, python_view
from .sessions import MARKER_VAR, live_session_ids
from .spec import BashResult, EditorResult, IPythonResult, Limits, SandboxSpec, result_from_dict
from .system_time import accounting, charge_system

log = logging.getLogger(__name__)

SOCKET_NAME = "exec.sock"
#: Seconds the execution server has to answer the ping of ``SandboxHandle._check_untouched`` (one round trip,
#: ~0.1 ms; a server that does not answer within this is the system's fault, before the model's first call).
UNTOUCHED_PING_S = 2.0
CONFIG_NAME = "config.json"
LOG_NAME = "launcher.log"
SESSIONS_NAME = "sessions.json"
#: What the execution server's interpreter runs (``python -S -c``; its ``sys.argv[1:]`` are the server's flags).
#: ``-c`` puts the current directory (the workspace) first on ``sys.path``: it is dropped before any import, or a
#: repository's top-level ``select.py`` or ``os.py`` would replace the server's module (``-P`` does the same
#: but needs Python >= 3.11, and an image's interpreter may be older).
SERVER_ENTRY = "import sys\nif sys.path[:1] == ['']: del sys.path[0]\nfrom sandbox.exec_server import main; main()"
# The execution server's directory inside bubblewrap/Singularity sandboxes.
SANDBOX_RUN_DIR = "/run/prorl"
_MAX_SOCKET_PATH = 100  # sockaddr_un.sun_path is 108 bytes


# Modules the execution server imports inside the sandbox.
_IN_SANDBOX_MODULES = ("__init__", "exec_server", "bash_tool", "ipython_tool", "editor", "eventloop", "protocol",
                       "errors", "limits", "sessions")


def _cache_sandbox_bytecode() -> None:
    """Write the byte code of the in-sandbox modules while the project is writable (also under
    ``PYTHONDONTWRITEBYTECODE``): inside a sandbox it is mounted read-only, and compiling them again at every
    start costs tens of milliseconds. Up-to-date caches are left alone; an unwritable project is fine."""
    here = os.path.dirname(os.path.abspath(__file__))
    for name in _IN_SANDBOX_MODULES:
        try:
            compileall.compile_file(os.path.join(here, name + ".py"), quiet=2)
        except OSError:
            pass


def _trusted_sessions(runtime_kind: Optional[str], run_dir: str, sandbox_id: str) -> set[int]:
    """Session ids of a sandbox's tool processes that the host may kill, from its sessions file. Only the
    ``local`` runtime (no pid namespace, no isolation) keeps such a file; for every isolated runtime the file
    would sit in the sandbox-writable run directory and is never read (the pid namespace and the launcher's
    process group, recorded by the host, find those sandboxes' processes). Even for ``local`` every entry is
    verified (:func:`sandbox.sessions.live_session_ids`)."""
    if runtime_kind != "local" or not run_dir:
        return set()
    return live_session_ids(os.path.join(run_dir, SESSIONS_NAME), sandbox_id)


#: Most parent links :func:`_descends_from` follows (a sandbox's tree is a few levels deep: bwrap, its pid 1, the
#: execution server).
_MAX_ANCESTRY = 64


def _parent_pid(pid: int) -> Optional[int]:
    """The parent pid of ``pid`` from ``/proc/PID/stat`` (field 4; the command name before it may hold any byte
    but ends at the last ``)``), or ``None`` if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _descends_from(launcher_pid: int, launcher_create_time: Optional[float], pid: int) -> bool:
    """Whether ``pid`` is the sandbox's launcher (same create time) or one of its descendants. Walks the parent
    links up to the launcher (at most :data:`_MAX_ANCESTRY`), not the whole ancestry as psutil's ``parents()``
    does: that took ~1.4 ms on the event loop at every sandbox's first connection."""
    if not same_process(launcher_pid, launcher_create_time):
        return False
    for _ in range(_MAX_ANCESTRY):
        if pid == launcher_pid:
            return True
        if pid <= 1:
            return False
        pid = _parent_pid(pid)
        if pid is None:
            return False
    return False


def project_root() -> str:
    """Directory that contains the ``sandbox`` package (bound read-only into sandboxes)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_paths() -> list[str]:
    """``sys.path`` entries the execution server needs when started with ``python -S`` on the host (the
    ``local`` runtime): the project root and the site-packages directories of this interpreter."""
    paths = [project_root()]
    paths += [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and os.path.isdir(p)]
    return list(dict.fromkeys(paths))


@dataclass(frozen=True)
class SandboxBounds:
    """A sandbox's bounds as a whole, resolved from its spec and the runtime's defaults (bytes; ``None`` = not
    bounded): ``tmpfs_bytes`` (each writable tmpfs), ``memory_bytes`` (its cgroup's limit, ``None`` without
    one), ``workspace_bytes`` (disk quota of its writable host directories). ``cgroup``: host path of its
    memory cgroup and ``cgroup_version`` (1 or 2), or ``None``."""

    tmpfs_bytes: Optional[int] = None
    memory_bytes: Optional[int] = None
    workspace_bytes: Optional[int] = None
    cgroup: Optional[str] = None
    cgroup_version: int = 0


@dataclass
class LaunchContext:
    """Everything a runtime needs to build its command line for one sandbox.

    Host paths: ``run_dir`` (holds socket, config, logs), ``workspace``. In-sandbox paths: ``sandbox_run_dir``,
    ``sandbox_workspace``. ``python``: interpreter that runs the execution server; ``pythonpath``: its
    ``PYTHONPATH`` (``-S`` mode). ``address``: leased loopback address or ``None``. ``view``: the interpreter
    view bound into the sandbox (``None``: the host's interpreter is used in place, ``local``, or the image has
    its own). ``bounds``: the sandbox's bounds as a whole."""

    sandbox_id: str
    run_dir: str
    workspace: str
    sandbox_run_dir: str
    sandbox_workspace: str
    python: str
    pythonpath: list[str]
    address: Optional[str]
    run_as: Optional[tuple[int, int]] = None
    view: Optional[PythonView] = None
    bounds: SandboxBounds = SandboxBounds()
    #: Descriptors ``build_command`` opened for the launcher (e.g. bwrap's ``--seccomp`` program): passed to it
    #: at their numbers and closed in the server once it is started.
    launch_fds: list[int] = dataclasses.field(default_factory=list)

    def server_argv(self) -> list[str]:
        # ``-c`` rather than ``-m``: runpy would import importlib.util, contextlib and warnings at every start.
        return [self.python, "-S", "-c", SERVER_ENTRY,
                "--socket", os.path.join(self.sandbox_run_dir, SOCKET_NAME),
                "--config", os.path.join(self.sandbox_run_dir, CONFIG_NAME)]


def server_binds(ctx: LaunchContext) -> list[tuple[str, str]]:
    """``(host, container)`` pairs the execution server and the tools' Python need, to bind read-only in this
    order (bubblewrap, and Singularity without an image venv): the interpreter view of ``ctx.view``
    (:mod:`sandbox.python_view`: standard library, allowed distributions, the project's ``sandbox`` package,
    at neutral paths under ``/prorl``), never the server's site-packages, the checkout or a home directory.
    Empty without a view."""
    return list(ctx.view.binds) if ctx.view is not None else []


class SandboxHandle:
    """A running sandbox. Tools are coroutines; one action runs at a time (calls queue up).

    Attributes: ``sandbox_id`` (str), ``workspace`` (host path of the workspace directory), ``workdir`` (the
    workspace's path inside the sandbox), ``address`` (leased 127.x.y.z or ``None``), ``pid`` (launcher pid on
    the host; it leads the sandbox's process group), ``bounds`` (:class:`SandboxBounds`: its memory, tmpfs and
    disk bounds as a whole).

    A sandbox that passes its memory limit or its disk quota is killed by the host; every call then raises
    :class:`SandboxDeadError` whose ``reason`` (``"memory"``, ``"disk_quota"``) and message say so. One that the
    host ends for the node's sake (its disk below the free-space floor) raises :class:`SandboxEvictedError`
    (``reason="host_disk"``, not the doing of what ran inside).
    """

    def __init__(self, runtime: "SandboxRuntime", *, sandbox_id: str, spec: SandboxSpec,
                 proc: asyncio.subprocess.Process,
                 create_time: Optional[float], client: ExecClient, ctx: LaunchContext, leases: list[Lease],
                 workspace_created: bool, started_at: float) -> None:
        self._runtime = runtime
        self.started_at = started_at
        #: Inode of the sandbox's own pid namespace (None for the local runtime): finds every process of the
        #: sandbox even after its launcher is gone.
        self.pidns: Optional[int] = None
        self.sandbox_id = sandbox_id
        self.spec = spec
        self._proc = proc
        self.pid = proc.pid
        self.create_time = create_time
        self._client = client
        self._ctx = ctx
        self._leases = leases
        self._workspace_created = workspace_created
        self.workspace = ctx.workspace
        self.workdir = ctx.sandbox_workspace
        self.address = ctx.address
        self.bounds = ctx.bounds
        self._closing: Optional[asyncio.Task] = None
        #: (reason, message) once the host ended the sandbox for passing a bound.
        self._death: Optional[tuple[str, str]] = None
        self._ending: Optional[asyncio.Future] = None
        #: Bytes its writable host directories took at the last measurement (what the free-space floor compares).
        self._used = 0
        #: Entries the last measurement read (the watch measures the cheapest sandboxes first).
        self._entries = 0
        #: Seconds each step of its start took (``probe``, ``view``, ``dirs``, ``leases``, ``config``,
        #: ``cgroup``, ``launch`` (argv built, launcher spawned), ``record``, ``ready`` (launcher exec until the
        #: execution server's verified connection), ``pidns``): what ``benchmarks/sandbox_start.py`` prints.
        self.start_steps: dict[str, float] = {}
        #: Pending while the host verifies, after an eviction at the free-space floor, what the kill freed: the
        #: reason a call raises (``host_disk`` or ``disk_quota``) is known only then.
        self._verdict: Optional[asyncio.Future] = None
        #: The readiness pipe, whose read end is held until close (its closing ends the execution server).
        self._ready: Optional["_ReadyPipe"] = None
        #: The ownership record's rewrite with the pid namespace, done off the start's path; close waits for it.
        self._record_write: Optional[asyncio.Future] = None
        #: Tool processes ("bash", "ipython") started, or asked to start, by this handle (see _start_lazily).
        self._started: set[str] = set()
        #: A bash, ipython or editor call was made on the model's behalf (inside a sandbox.system_time accumulator).
        self._model_ran = False
        #: Host processes (pid, start time) that must all run before the model's first call: set by the warm
        #: pool (:func:`sandbox.procstate.snapshot` after warm-up); empty for a cold start.
        self.processes: tuple[procstate.Known, ...] = ()
        #: The execution server's ``served`` count matched the host's at the model's first call (_check_untouched).
        self._served_checked = False

    def __repr__(self) -> str:
        return f"<SandboxHandle {self.sandbox_id} {self._runtime.kind} pid={self.pid} alive={self.alive}>"

    @property
    def alive(self) -> bool:
        """True while the sandbox's launcher runs and ``close()`` has not been called."""
        return self._closing is None and self._proc.returncode is None

    def _check(self) -> None:
        if self._closing is not None:
            raise SandboxClosedError(f"sandbox {self.sandbox_id} is closed")
        if self._death is not None or self._proc.returncode is not None:
            raise self._dead_error()

    def _memory_exceeded(self) -> bool:
        """Whether the kernel's OOM killer has run in the sandbox's cgroup (cheap: one small file read)."""
        b = self.bounds
        return bool(b.cgroup) and bounds.oom_kills(b.cgroup, b.cgroup_version) > 0

    def _dead_error(self) -> SandboxDeadError:
        if self._death is None and self._memory_exceeded():
            self._death = ("memory", self._memory_message())
        if self._death is not None:
            reason, message = self._death
            cls = SandboxEvictedError if reason == SandboxEvictedError.REASON else SandboxDeadError
            return cls(f"sandbox {self.sandbox_id}: {message}", reason=reason)
        return SandboxDeadError(f"sandbox {self.sandbox_id} died (exit status {self._proc.returncode})")

    def _memory_message(self) -> str:
        return (f"the sandbox passed its memory limit of {self.bounds.memory_bytes} bytes (the kernel's OOM "
                "killer ran in it) and was killed")

    async def _end(self, reason: str, message: str) -> None:
        """Kill the sandbox because it passed a bound (``reason``, ``message`` say which); its handle stays
        (``close`` cleans up), every call raises :class:`SandboxDeadError` with that reason. Idempotent."""
        if self._death is None:
            self._death = (reason, message)
            log.warning("sandbox %s killed: %s", self.sandbox_id, message)
        if self._ending is None:
            self._ending = asyncio.ensure_future(kill_sandbox(
                self.pid, self.create_time, grace_s=0.0, pidns=self.pidns, not_before=self.started_at,
                own_child_wait=self._proc.wait))
        await asyncio.shield(self._ending)

    async def _settled(self) -> None:
        """Wait for a pending eviction verdict (see ``_verdict``), so that no call raises before the host knows
        whose doing the sandbox's end was."""
        if self._verdict is not None and not self._verdict.done():
            await asyncio.shield(self._verdict)

    async def _call(self, op: str, args: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        await self._settled()
        self._check()
        try:
            res = await self._client.call(op, args, timeout_s + SERVER_GRACE_S)
        except SandboxClosedError:
            raise
        except (SandboxError, OSError) as e:
            await self._settled()
            # A kernel or shell the OOM killer hit shows up as a dead kernel or shell: the sandbox passed its
            # memory limit, and it ends as a whole.
            if self._death is None and self._memory_exceeded() and self._closing is None:
                await self._end("memory", self._memory_message())
            if self._death is not None:
                raise self._dead_error() from e
            raise
        await self._settled()
        if self._death is None and self._memory_exceeded() and self._closing is None:
            await self._end("memory", self._memory_message())
        if self._death is not None:
            raise self._dead_error()
        return res

    async def warm_up(self) -> None:
        """Have the execution server start the persistent shell now, in the background, so that the first
        :meth:`bash` call finds it ready (otherwise that call starts it: ~15 ms here). Returns once asked (one
        round trip), not once the shell is ready. Raises what a call raises (:class:`SandboxDeadError`, ...)."""
        await self._call("ping", {"warm": True}, 5.0)
        self._started.add("bash")

    async def _check_untouched(self) -> None:
        """Before the first call made on the model's behalf: raise :class:`SandboxStartError` (the system's
        fault, filtered) if the sandbox has died or been ended (cold or pooled), a known process of it
        (:attr:`processes`, a pooled sandbox's; a cold one's launcher and execution server) is stopped, frozen,
        a zombie or gone, or its execution server took requests the host did not send (a same-uid co-tenant
        used its socket: a command of theirs may still run, files of theirs lie in the workspace; one ``ping``
        round trip, once per sandbox, compares the server's ``served`` count with the client's ``sent``).
        Nothing of the model has run in it yet, so a co-tenant or the host did it (#36 red team row 11: a warm
        shell SIGSTOPped after acquire made the first call time out, scored; row 2: a co-tenant's running
        ``sleep`` made the first bash fail, scored). After that call the host cannot tell a stop or a request
        from outside from the model's own (its code may ``kill -STOP $$`` or talk to the socket), so it is never
        checked again."""
        if self._model_ran or self._closing is not None or not accounting():
            return
        reason = None
        if self._death is not None or self._proc.returncode is not None:
            # cold or pooled: what ended it before the model's first call (a co-tenant's kill, a crash of the
            # execution server after its start, a bound passed by the handler's own setup) is not the model's
            reason = str(self._dead_error())
        else:
            known = self.processes or tuple(
                (pid, s[2]) for pid in (self.pid, self._client.peer_pid)
                if pid is not None and (s := procstate.stat(pid)) is not None)
            reason = procstate.fault(known)
        if reason is None and not self._served_checked:
            t0 = time.monotonic()
            try:
                res = await self._client.call("ping", {}, UNTOUCHED_PING_S)
            except SandboxClosedError:
                raise  # the host closed it meanwhile (a cancel): not a start
            except (SandboxError, OSError, asyncio.TimeoutError) as e:
                reason = f"its execution server did not answer a ping: {type(e).__name__}: {e}"
            else:
                served, sent = res.get("served"), self._client.sent
                if not isinstance(served, int) or isinstance(served, bool) or served > sent:
                    reason = (f"tampered before the model's first call: its execution server took {str(served)[:40]} "
                              f"requests, the host sent {sent}")
                else:
                    self._served_checked = True
            finally:
                charge_system(time.monotonic() - t0)  # the host's check, not the model's work
        if reason is not None:
            raise SandboxStartError(f"sandbox {self.sandbox_id} was not usable at the model's first call "
                                    f"(before any of its commands ran): {reason}")

    async def _start_lazily(self, tool: str, timeout_s: float) -> None:
        """Before a call made on the model's behalf (inside :func:`sandbox.system_time.system_seconds`), start
        ``tool``'s process ("bash": the shell, "ipython": the kernel) with a no-op request (``:``, an empty cell)
        timed on the host, and charge its seconds to the system (:func:`~sandbox.system_time.charge_system`):
        the lazy start is sandbox start, not the model's work (issue #35, R6). Only the first start on this handle
        and only while no call of the model's has run in the sandbox: after one has, the start could be shaped or
        slowed by what it did (a file in IPython's startup directory or a ``usercustomize.py`` in the workspace,
        which is HOME; a CPU hog in the background), so it stays in the call's time as before. ``timeout_s``: the call's own limit (seconds), which a shell's start gets too, as
        it would inside the call. Raises what the call raises (a shell not ready within ``timeout_s``:
        :class:`SandboxError`; a kernel that does not start: :class:`ToolError`)."""
        if tool in self._started or not accounting():
            return
        self._started.add(tool)
        if self._model_ran:
            return
        t0 = time.monotonic()
        try:
            if tool == "bash":
                await self._call("bash", {"command": ":", "timeout_s": timeout_s, "max_output_bytes": 1024},
                                 timeout_s)
            else:
                from .ipython_tool import KERNEL_START_TIMEOUT_S

                await self._call("ipython", {"code": "", "timeout_s": timeout_s}, timeout_s + KERNEL_START_TIMEOUT_S)
        except SandboxClosedError:
            raise  # the host closed it (a cancel): not a start
        except SandboxError as e:
            # Nothing of the model's has run in the sandbox yet: a shell or kernel that cannot start (a tool's
            # module missing from the view, the server dead, no answer in time) is the system's, filtered.
            raise SandboxStartError(f"sandbox {self.sandbox_id}: its {tool} could not start before the model's "
                                    f"first call: {type(e).__name__}: {e}") from e
        finally:
            charge_system(time.monotonic() - t0)

    # ----------------------------------------------------------------------------------------------- tools
    async def bash(self, command: str, timeout_s: float = 30.0, max_output_bytes: int = 1 << 20) -> BashResult:
        """Run ``command`` (any bash text, multi-line allowed) in the persistent shell; cwd, variables and
        functions persist across calls. ``timeout_s`` (seconds): then Ctrl-C, SIGKILL of the foreground job,
        and at last a fresh shell; the partial output comes back with ``timed_out=True``. Output beyond
        ``max_output_bytes`` is dropped with a notice (``truncated=True``). Raises :class:`SandboxDeadError`,
        :class:`SandboxClosedError`, :class:`ToolTimeout` (the server itself stopped answering),
        :class:`SandboxStartError` (a pooled sandbox found stopped before the model's first call:
        :meth:`_check_untouched`)."""
        if timeout_s <= 0 or max_output_bytes <= 0:
            raise ValueError("timeout_s and max_output_bytes must be positive")
        await self._check_untouched()
        await self._start_lazily("bash", timeout_s)
        self._model_ran = self._model_ran or accounting()
        res = await self._call("bash", {"command": command, "timeout_s": timeout_s,
                                        "max_output_bytes": max_output_bytes}, timeout_s)
        return result_from_dict(BashResult, res)

    async def ipython(self, code: str, timeout_s: float = 60.0) -> IPythonResult:
        """Run one cell in the persistent IPython kernel (started on first use; its start is not charged to
        ``timeout_s``, nor, inside :func:`sandbox.system_time.system_seconds`, to the model: see
        :meth:`_start_lazily`). On timeout the kernel is interrupted and ``timed_out=True``. Raises
        :class:`KernelDiedError` if the kernel dies during the cell (the next call starts a fresh one), and
        the errors of :meth:`bash`."""
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        from .ipython_tool import KERNEL_START_TIMEOUT_S

        await self._check_untouched()
        await self._start_lazily("ipython", timeout_s)
        self._model_ran = self._model_ran or accounting()
        res = await self._call("ipython", {"code": code, "timeout_s": timeout_s}, timeout_s + KERNEL_START_TIMEOUT_S)
        return result_from_dict(IPythonResult, res)

    async def editor(self, command: str, path: str, **kw: Any) -> EditorResult:
        """``str_replace_editor``: ``command`` in view / create / str_replace / insert / undo_edit; ``path``
        absolute inside the sandbox or relative to the workspace; keywords ``view_range``, ``file_text``,
        ``old_str``, ``new_str``, ``insert_line``. Raises :class:`PathOutsideWorkspaceError` for a path that
        leaves the workspace (``..`` or symlinks), :class:`EditorError` for any other refusal."""
        # a file the model writes can shape a later shell or kernel start (the workspace is HOME: a
        # usercustomize.py under ~/.local), so that start is no longer charged to the system (_start_lazily)
        await self._check_untouched()
        self._model_ran = self._model_ran or accounting()
        res = await self._call("editor", {"command": command, "path": path, **kw}, 30.0)
        return result_from_dict(EditorResult, res)

    async def upload(self, path_in_sandbox: str, data: bytes, mode: Optional[int] = None) -> str:
        """Write ``data`` to ``path_in_sandbox`` (relative = to the workspace; parents created). Returns the
        absolute path inside the sandbox. Raises :class:`FileTransferError` (also for data larger than
        :data:`sandbox.protocol.MAX_TRANSFER_BYTES`; bind a host directory for bigger files)."""
        if len(data) > MAX_TRANSFER_BYTES:
            raise FileTransferError(f"upload of {len(data)} bytes refused: larger than {MAX_TRANSFER_BYTES} bytes")
        res = await self._call("upload", {"path": path_in_sandbox, "mode": mode,
                                          "data_b64": base64.b64encode(data).decode("ascii")}, 60.0)
        return res["path"]

    async def download(self, path: str, max_bytes: int = 32 * 1024 * 1024) -> bytes:
        """Read a file inside the sandbox (relative = to the workspace). Raises :class:`FileTransferError` if
        it is missing, unreadable, or larger than ``max_bytes`` (capped at
        :data:`sandbox.protocol.MAX_TRANSFER_BYTES`)."""
        max_bytes = min(max_bytes, MAX_TRANSFER_BYTES)
        res = await self._call("download", {"path": path, "max_bytes": max_bytes}, 60.0)
        return base64.b64decode(res["data_b64"])

    # ------------------------------------------------------------------------------------------- lifecycle
    async def close(self, grace_s: Optional[float] = None) -> None:
        """Stop the sandbox: SIGTERM to its process group, ``grace_s`` seconds (``None``: the runtime's
        ``close_grace_s``; ``0``: SIGKILL at once, for a sandbox with nothing of a job inside, such as a pooled
        one never handed out), SIGKILL to everything left; then release its address, delete its run directory
        (and its workspace if the runtime created it) and its ownership record. Idempotent; concurrent calls
        wait for the same close (the first call's grace applies). Raises :class:`SandboxError` only if
        processes survive SIGKILL (frozen by the cgroup freezer: a frozen task dies only once thawed); then its
        ownership record, cgroup, leases and directories are kept and the runtime's next
        :meth:`SandboxRuntime.reap_orphans` kills again and finishes the cleanup (#36 red team row 4)."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close(self._runtime.close_grace_s if grace_s is None
                                                              else grace_s))
        await asyncio.shield(self._closing)

    async def _close(self, grace_s: float) -> None:
        await self._client.close()
        if self._ending is not None:
            await asyncio.gather(self._ending, return_exceptions=True)
        survivors = await self._kill(grace_s)
        if self._ready is not None:
            self._ready.close()
        if survivors:
            # What a later reap needs stays: the record (with its pid namespace), the run directory (the shell's
            # recorded session), the cgroup, and the leases (a surviving process keeps its uid: that uid must not
            # go to another sandbox yet). The runtime's reaper retries the kill (reap_orphans).
            if self._record_write is not None:
                await asyncio.gather(self._record_write, return_exceptions=True)
            self._runtime._handles.pop(self.sandbox_id, None)
            self._runtime._unfinished[self.sandbox_id] = self
            raise SandboxError(f"sandbox {self.sandbox_id}: processes survived SIGKILL: "
                               f"{[p.pid for p in survivors]}; its ownership record is kept for the next reap")
        await self._release()

    async def _kill(self, grace_s: float) -> list[psutil.Process]:
        """SIGTERM, ``grace_s`` seconds, SIGKILL to every process of the sandbox; returns those still alive."""
        return await kill_sandbox(self.pid, self.create_time, grace_s=grace_s,
                                  sessions=_trusted_sessions(self._runtime.kind, self._ctx.run_dir, self.sandbox_id),
                                  pidns=self.pidns, not_before=self.started_at, own_child_wait=self._proc.wait)

    async def _release(self) -> None:
        """Release what the sandbox held once none of its processes is left: cgroup, leases, directories,
        ownership record."""
        if self.bounds.cgroup:
            await asyncio.to_thread(bounds.remove_cgroup, self.bounds.cgroup, self.bounds.cgroup_version)
        for lease in self._leases:
            lease.release()
        await asyncio.to_thread(self._runtime._cleanup_dirs, self._ctx.run_dir,
                                self.workspace if self._workspace_created else None)
        if self._record_write is not None:  # a write that landed after the removal would bring the record back
            await asyncio.gather(self._record_write, return_exceptions=True)
        await asyncio.to_thread(self._runtime.store.remove, self.sandbox_id)
        self._runtime._handles.pop(self.sandbox_id, None)
        self._runtime._unfinished.pop(self.sandbox_id, None)


class SandboxRuntime(abc.ABC):
    """Starts sandboxes of one kind. Options common to all runtimes:

    - ``state_dir``: per-user directory for ownership records and run directories (default
      :func:`sandbox.ownership.default_state_dir`).
    - ``workspace_root``: where fresh workspaces are created (default: the system temp dir; each one a private
      0700 directory, named in the ownership record before it is created).
    - ``python``: interpreter that runs the execution server of a ``local`` sandbox (default: this one,
      ``sys.executable``). An isolated sandbox always gets this server's interpreter, seen through its
      Python view (:mod:`sandbox.python_view`); naming another one there is a ``ValueError``.
    - ``start_timeout_s``: deadline of a whole start, preparation to the execution server's verified connection
      (seconds; past it :meth:`start` raises :class:`SandboxStartError`, the host's doing).
    - ``close_grace_s``: SIGTERM → SIGKILL grace on close (seconds).
    - ``loopback_dir`` / ``loopback_network``: see :class:`sandbox.loopback.LoopbackAllocator`.

    Defaults for what a spec leaves ``None`` (isolated runtimes; see :class:`sandbox.spec.Limits`):
    ``python_packages`` (distributions visible besides the execution server's; default
    :data:`sandbox.python_view.DEFAULT_PYTHON_PACKAGES`), ``tmpfs_bytes`` (512 MiB), ``sandbox_memory_bytes``
    (8 GiB), ``workspace_bytes`` (4 GiB); ``None`` for one of the last three: not bounded. ``cgroup_parent``:
    a delegated cgroup directory (memory controller enabled for its children) to create sandbox cgroups in;
    default: found at start (:func:`sandbox.bounds.memory_cgroups`, which warns once when there is none).
    ``watch_interval_s``: how often the host checks each sandbox's disk usage and memory (seconds; each
    sandbox on its own schedule, this long after its last check ended, whatever other sandboxes cost).
    ``measure_max_entries``: most entries one
    measurement of a sandbox's disk use reads (:class:`sandbox.bounds.MeasureBudget`; a sandbox that needs more
    counts as over its quota). ``min_free_bytes``: free-space floor of the file systems holding the sandboxes'
    writable host directories (default 1 GiB, :data:`sandbox.bounds.DEFAULT_MIN_FREE_BYTES`; ``None``: not
    watched): below it the largest sandbox there is ended, ``host_disk`` (filtered) unless its end freed
    more than it measured (then ``disk_quota``: it hid bytes).
    ``reap_interval_s``: how often :meth:`start_reaper` reaps what dead servers of this node left in the state
    directory (seconds; ``None``: only when called).
    ``view_dir``: where the Python views' skeletons are built, once per set of distributions, and reused
    (default :func:`sandbox.python_view.default_view_dir`, a per-user cache; never visible in a sandbox).
    """

    kind: str = "abstract"
    #: Whether sandboxes of this runtime are isolated from the host.
    isolated: bool = True

    def __init__(self, *, state_dir: Optional[str] = None, workspace_root: Optional[str] = None,
                 python: Optional[str] = None, start_timeout_s: float = 30.0, close_grace_s: float = 2.0,
                 loopback_dir: str = DEFAULT_LEASE_DIR, loopback_network: str = DEFAULT_NETWORK,
                 python_packages: Optional[tuple[str, ...]] = None,
                 tmpfs_bytes: Optional[int] = DEFAULT_TMPFS_BYTES,
                 sandbox_memory_bytes: Optional[int] = DEFAULT_MEMORY_BYTES,
                 workspace_bytes: Optional[int] = DEFAULT_WORKSPACE_BYTES,
                 cgroup_parent: Optional[str] = None, watch_interval_s: float = 1.0,
                 view_dir: Optional[str] = None, measure_max_entries: int = bounds.MAX_MEASURED_ENTRIES,
                 min_free_bytes: Optional[int] = bounds.DEFAULT_MIN_FREE_BYTES,
                 reap_interval_s: Optional[float] = 60.0) -> None:
        if self.isolated and python and os.path.realpath(python) != os.path.realpath(sys.executable):
            raise ValueError(f"python={python!r}: an isolated sandbox runs this server's own interpreter "
                             f"({sys.executable}) through its Python view; `python` applies to the local runtime")
        if watch_interval_s <= 0:
            raise ValueError("watch_interval_s must be positive")
        if reap_interval_s is not None and reap_interval_s <= 0:
            raise ValueError("reap_interval_s must be positive or None")
        if measure_max_entries <= 0 or (min_free_bytes is not None and min_free_bytes < 0):
            raise ValueError("measure_max_entries must be positive and min_free_bytes >= 0 or None")
        # Checked here so that a bad option fails at start, not at the first sandbox.
        bounds_defaults = Limits(tmpfs_bytes=tmpfs_bytes, sandbox_memory_bytes=sandbox_memory_bytes,
                                 workspace_bytes=workspace_bytes)
        _cache_sandbox_bytecode()
        self.state_dir = os.path.abspath(state_dir or default_state_dir())
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        self.store = OwnershipStore(self.state_dir)
        self.workspace_root = workspace_root
        self.python = python or sys.executable
        self.python_packages = None if python_packages is None else tuple(python_packages)
        self.view_dir = os.path.abspath(view_dir or default_view_dir())
        self._bounds_defaults = bounds_defaults
        self.watch_interval_s = watch_interval_s
        self.measure_max_entries = measure_max_entries
        self.min_free_bytes = min_free_bytes
        if self.isolated and (workspace_bytes is not None or min_free_bytes is not None):
            log.info("sandbox disk: %s", self.disk_enforcement)
        self._cgroup_parent = cgroup_parent
        if self.isolated and sandbox_memory_bytes is not None:
            bounds.memory_cgroups(cgroup_parent)  # found (or its absence logged) once, at start
        self._watcher: Optional[asyncio.Task] = None
        self.start_timeout_s = start_timeout_s
        self.close_grace_s = close_grace_s
        self._loopback_args = (loopback_dir, loopback_network)
        self._loopback: Optional[LoopbackAllocator] = None
        self._handles: dict[str, SandboxHandle] = {}
        #: Closed sandboxes whose processes survived SIGKILL (frozen): record, cgroup, leases and directories
        #: kept; :meth:`reap_orphans` kills them again and releases what they held.
        self._unfinished: dict[str, SandboxHandle] = {}
        self._starting: set[asyncio.Future] = set()
        me = os.getpid()
        self._node = node_identity()
        self._owner = {"owner_pid": me, "owner_create_time": process_identity(me), **self._node}
        self.reap_interval_s = reap_interval_s
        self._reaper: Optional[asyncio.Task] = None
        self._reaping: Optional[asyncio.Lock] = None
        #: (kind, sandbox id) of dead-owner records a reap left alone and logged (see reap_orphans).
        self._refused_seen: set[tuple[str, str]] = set()
        self._own_pidns = pid_namespace()

    # ------------------------------------------------------------------------------------ for subclasses
    @abc.abstractmethod
    def build_command(self, spec: SandboxSpec, ctx: LaunchContext) -> list[str]:
        """The launcher's argv for ``spec``; it must end up running ``ctx.server_argv()``."""

    def sandbox_paths(self, spec: SandboxSpec, run_dir: str, workspace: str) -> tuple[str, str]:
        """(workspace, run dir) as seen inside the sandbox, given their host paths."""
        return spec.workdir, SANDBOX_RUN_DIR

    def sandbox_user(self, spec: SandboxSpec, sandbox_id: str) -> tuple[Optional[tuple[int, int]], Optional[Lease]]:
        """(uid, gid) the execution server switches to inside the sandbox (``None``: keep the server's user),
        and the lease that reserves it, if any (released on close)."""
        return None, None

    def sandbox_uid(self, uid: int) -> bool:
        """Whether ``uid`` may own a workspace this runtime's sandboxes made: this server's own, and the
        unprivileged uids it runs sandboxes as (a root server's leased range). A reaper removes no workspace of
        any other owner (another user's files)."""
        return uid == os.geteuid()

    def tool_env(self, spec: SandboxSpec, ctx: LaunchContext) -> dict[str, str]:
        """Environment of the shell and the kernel."""
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": ctx.sandbox_workspace,
               "LANG": "C.UTF-8", "TERM": "dumb", "PAGER": "cat", "GIT_PAGER": "cat", "PYTHONUNBUFFERED": "1"}
        if spec.image is None:
            env["PATH"] = os.path.dirname(ctx.python) + ":" + env["PATH"]
        if ctx.view is not None:
            env.update(ctx.view.env)
        if ctx.address:
            env["PRORL_SANDBOX_ADDRESS"] = ctx.address
        env.update(spec.env)
        env[MARKER_VAR] = ctx.sandbox_id  # after the spec's: see sandbox.sessions.carries_marker
        return env

    def launcher_env(self, ctx: LaunchContext) -> dict[str, str]:
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
                "PYTHONPATH": ":".join(ctx.pythonpath), **dict(ctx.view.env if ctx.view is not None else ())}

    def uses_python_view(self, spec: SandboxSpec) -> bool:
        """Whether a sandbox for ``spec`` runs this server's interpreter through a Python view (isolated
        runtimes, unless the image brings its own interpreter)."""
        return self.isolated

    def sessions_file(self, ctx: LaunchContext) -> Optional[str]:
        """Where the execution server records its tool sessions (host path), or ``None``. Only a runtime
        without a pid namespace (``local``) may have one: see :func:`_trusted_sessions`."""
        return None

    async def prepare_launch(self, spec: SandboxSpec) -> None:
        """Called at the start of every :meth:`start`, before anything is created: checks that may take time
        (Singularity's isolation probe). Raises :class:`SandboxStartError` if ``spec`` cannot run here."""

    # ---------------------------------------------------------------------------------------- interface
    async def start(self, spec: SandboxSpec | dict[str, Any] | None = None, **fields: Any) -> SandboxHandle:
        """Start a sandbox and wait until its execution server listens (a connection whose peer is verified to be
        the sandbox's). ``spec``: a :class:`SandboxSpec`, a
        dict of its fields (e.g. from a config file), or ``None`` for the defaults; ``fields`` override single
        fields (``start(image=..., network="loopback")``). Raises ``TypeError``/``ValueError`` for a bad spec,
        :class:`SandboxStartError` (with the launcher's log tail) if the sandbox exits before it answers, if
        the whole start (any step of it, e.g. one blocked by the node) takes more than ``start_timeout_s``
        seconds, and for every ``OSError`` of preparing or launching it (a full disk, a
        refused cgroup, a lease directory it cannot use, a failed fork: the host's, never the sandbox's
        doing; the ``OSError`` is its ``__cause__``). Cancelling the caller is safe at any point: the start finishes in the
        background and the sandbox is closed at once (``close_all`` waits for that too, up to
        ``start_timeout_s + close_grace_s``); so is one that passed its deadline."""
        if spec is None:
            spec = SandboxSpec(**fields)
        elif isinstance(spec, dict):
            spec = SandboxSpec(**{**spec, **fields})
        elif fields:
            spec = dataclasses.replace(spec, **fields)
        steps: dict[str, float] = {}
        task = asyncio.ensure_future(self._start(spec, steps))
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

        def close_when_started(t: asyncio.Task) -> None:
            if not t.cancelled() and t.exception() is None:
                # nobody got it, so nothing of a job is inside: no grace to wait
                closing = asyncio.ensure_future(t.result().close(grace_s=0.0))
                self._starting.add(closing)
                closing.add_done_callback(self._starting.discard)

        try:
            # A deadline on the whole start, not only on the execution server's answer: a step blocked by the
            # node (a FIFO planted where a file is read, a hung file system) held a job's init and the pool's
            # refill forever (red team #36). The blocked worker thread cannot be interrupted; the start goes on
            # in the background and what it makes is closed at once.
            done, _ = await asyncio.wait({task}, timeout=self.start_timeout_s)
        except asyncio.CancelledError:
            task.add_done_callback(close_when_started)
            raise
        if not done:
            task.add_done_callback(close_when_started)
            raise SandboxStartError(f"{self.kind} sandbox did not start within start_timeout_s="
                                    f"{self.start_timeout_s:g} s (steps done: {', '.join(steps) or 'none'})")
        return task.result()

    async def _start(self, spec: SandboxSpec, steps: dict[str, float]) -> SandboxHandle:
        lap = _Laps(steps)
        await self.prepare_launch(spec)
        lap("probe")
        sandbox_id = f"{self.id_prefix}-{secrets.token_hex(6)}"
        started_at = time.time()
        ready = _ReadyPipe()
        try:
            ctx, leases, created, argv = await asyncio.to_thread(self._prepare, sandbox_id, spec, steps,
                                                                 ready.write_fd)
            lap.restart()
        except BaseException as e:
            ready.close()
            if not isinstance(e, OSError):
                raise
            raise SandboxStartError(f"{self.kind} sandbox {sandbox_id} could not be prepared: "
                                    f"{type(e).__name__}: {e}") from e
        proc = None
        try:
            try:
                with open(os.path.join(ctx.run_dir, LOG_NAME), "wb") as logf:
                    proc = await asyncio.create_subprocess_exec(
                        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True,
                        env={**self.launcher_env(ctx), LAUNCHER_MARKER_VAR: sandbox_id},
                        pass_fds=(*(lease.fd for lease in leases), *ctx.launch_fds, ready.write_fd))
                ready.watch()
            except OSError as e:
                raise SandboxStartError(f"{self.kind} sandbox {sandbox_id} could not be launched: "
                                        f"{type(e).__name__}: {e}") from e
            finally:
                for fd in ctx.launch_fds:  # the launcher has its copies
                    os.close(fd)
                ctx.launch_fds.clear()
                ready.close_write()
            lap("launch")
            record = {"sandbox_id": sandbox_id, "runtime": self.kind, "pid": proc.pid, "create_time": None,
                      "run_dir": ctx.run_dir, "workspace": ctx.workspace, "workspace_created": created,
                      "address": ctx.address, "cgroup": ctx.bounds.cgroup,
                      "cgroup_version": ctx.bounds.cgroup_version, "started_at": started_at, **self._owner}
            record["create_time"] = await asyncio.to_thread(self._record_start, record)
            client = ExecClient(os.path.join(ctx.run_dir, SOCKET_NAME), proc.wait, sandbox_id,
                                peer_ok=functools.partial(_descends_from, proc.pid, record["create_time"]),
                                ready=ready.event)
            handle = SandboxHandle(self, sandbox_id=sandbox_id, spec=spec, proc=proc,
                                   create_time=record["create_time"], client=client, ctx=ctx, leases=leases,
                                   workspace_created=created, started_at=started_at)
            handle._ready = ready
            self._handles[sandbox_id] = handle
            handle.start_steps = steps
            lap("record")
        except BaseException:
            ready.close()
            if sandbox_id not in self._handles:
                if proc is not None:
                    await kill_sandbox(proc.pid, process_identity(proc.pid), grace_s=0.0, own_child_wait=proc.wait)
                for lease in leases:
                    lease.release()
                if ctx.bounds.cgroup:
                    await asyncio.to_thread(bounds.remove_cgroup, ctx.bounds.cgroup, ctx.bounds.cgroup_version)
                await asyncio.to_thread(self._cleanup_dirs, ctx.run_dir, ctx.workspace if created else None)
                # last: until the directories are gone the (provisional) record is how a later server finds them
                await asyncio.to_thread(self.store.remove, sandbox_id)
            raise
        try:
            # A verified connection, not a ping's answer: the listening socket's peer (SO_PEERCRED, checked against
            # the launcher's tree) and its pid namespace are all a start learns, and the round trip of a ping
            # (~1.5 ms: the server's accept and answer, the host's bounded decode) was on every start's path. A
            # server that dies after it listened fails the first call as SandboxDeadError, as it would a moment
            # after a ping.
            await client.connect(self.start_timeout_s)
            ready._unwatch()  # the read end stays open while the sandbox lives (see _ReadyPipe)
            lap("ready")
            # The sandbox's pid namespace as the host sees it at the verified peer (not as the sandbox reports
            # it: with an image, the image's own loader and libraries run the execution server): one readlink
            # of procfs, microseconds, so not worth a worker thread's round trip.
            pidns = pid_namespace(client.peer_pid) if client.peer_pid else None
            handle.pidns = pidns if pidns != self._own_pidns else None
            if handle.pidns is not None:
                # Not awaited: a worker thread's round trip (~0.7 ms, more under load) added to every start.
                # Until it lands the record names the launcher, by which a reap after a crash finds the sandbox
                # (as during the whole boot); close waits for it before it removes the record.
                handle._record_write = asyncio.ensure_future(
                    asyncio.to_thread(self.store.write, {**record, "pidns": handle.pidns}))
                handle._record_write.add_done_callback(functools.partial(_log_record_write, sandbox_id))
            lap("pidns")
        except BaseException as e:
            ready.close()
            tail = await asyncio.to_thread(self._log_tail, ctx.run_dir)
            await handle.close()
            if isinstance(e, SandboxError):
                raise SandboxStartError(f"{self.kind} sandbox {sandbox_id} did not start: {e}\n"
                                        f"launcher log (tail):\n{tail}") from None
            raise
        watched = ctx.bounds.workspace_bytes or ctx.bounds.cgroup or (self.isolated and self.min_free_bytes is not None)
        if watched and (self._watcher is None or self._watcher.done()):
            self._watcher = asyncio.ensure_future(self._watch())
        return handle

    # ------------------------------------------------------------------------------------------- bounds
    def _writable_host_dirs(self, handle: SandboxHandle) -> list[str]:
        """Host directories a sandbox writes to: what its disk quota counts."""
        return [handle.workspace, handle._ctx.run_dir, *(b.host for b in handle.spec.binds if not b.ro)]

    @property
    def disk_enforcement(self) -> str:
        """How a sandbox's disk use is bounded here, in words (logged at start)."""
        floor = ("not watched" if self.min_free_bytes is None
                 else f"below {self.min_free_bytes} bytes free the largest sandbox on that file system is ended")
        return (f"workspace quota measured by the host (no file-system quota: a rootless server can mount none "
                f"that graders on the host can read) every {self.watch_interval_s} s, at most "
                f"{self.measure_max_entries} entries a measurement (a sandbox needing more counts as over its "
                f"quota); free-space floor: {floor}")

    async def _watch(self) -> None:
        """While sandboxes with bounds run: each sandbox on its own schedule (:meth:`_watch_one`: every
        ``watch_interval_s`` after its last check ended, whatever the others cost), and every
        ``watch_interval_s`` the free-space floor (:meth:`_check_free_space`). Measurements run on a few threads
        of their own (:class:`_MeasurePool`: many sandboxes never crowd out the default executor that starts and
        closes sandboxes), cheapest first by the entries of their last measurement: 10 sandboxes of 95,000 files
        each let an over-quota writer beside them live 8.4 s when every round waited for all of them."""
        pool = _MeasurePool(min(4, os.cpu_count() or 1))
        tasks: dict[str, asyncio.Task] = {}
        try:
            while True:
                handles = [h for h in self._handles.values()
                           if h._closing is None and h._death is None and h._proc.returncode is None]
                if not handles:
                    return
                for h in handles:
                    if h.sandbox_id not in tasks or tasks[h.sandbox_id].done():
                        tasks[h.sandbox_id] = asyncio.ensure_future(self._watch_one(h, pool))
                for sid in [sid for sid, t in tasks.items() if t.done()]:
                    del tasks[sid]
                try:
                    await self._check_free_space()
                except Exception:  # noqa: BLE001 - a failed check must not end the watch of every sandbox
                    log.exception("checking the free space of the sandboxes' file systems failed")
                await asyncio.sleep(self.watch_interval_s)
        finally:
            for t in tasks.values():
                t.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            pool.shutdown()

    async def _watch_one(self, h: SandboxHandle, pool: "_MeasurePool") -> None:
        """Check one sandbox's bounds every ``watch_interval_s`` until it ends."""
        while h._closing is None and h._death is None and h._proc.returncode is None:
            try:
                await self._check_bounds(h, pool)
            except Exception as e:  # noqa: BLE001 - a failed check must not end this sandbox's watch
                log.error("checking the bounds of sandbox %s failed: %r", h.sandbox_id, e)
            await asyncio.sleep(self.watch_interval_s)

    async def _check_bounds(self, h: SandboxHandle, pool: Optional["_MeasurePool"] = None) -> None:
        if h._closing is not None or h._death is not None:
            return
        if h._memory_exceeded():
            await h._end("memory", h._memory_message())
            return
        quota = h.bounds.workspace_bytes
        if quota is None and self.min_free_bytes is None:
            return
        dirs = self._writable_host_dirs(h)

        def measure() -> tuple[int, int]:
            budget = bounds.MeasureBudget(self.measure_max_entries)
            try:
                used = bounds.disk_usage(dirs, quota, budget)
                if quota is None or used <= quota:
                    used += bounds.open_deleted_bytes(h.pid, dirs, budget)
            finally:
                h._entries = budget.max_entries - budget.left
            return used, h._entries

        try:
            if pool is None:
                h._used, _ = await asyncio.to_thread(measure)
            else:
                h._used, _ = await pool.run(h._entries, measure)
        except bounds.UnmeasurableError as e:
            if quota is not None and h._closing is None:
                await h._end("disk_quota", f"the sandbox's workspace could not be measured against its disk quota "
                                           f"of {quota} bytes ({e}) and the sandbox was killed: it counts as over "
                                           "its quota")
            return
        if quota is not None and h._used > quota and h._closing is None:
            await h._end("disk_quota", f"the sandbox's workspace passed its disk quota of {quota} bytes (at "
                                       f"least {h._used} bytes in its workspace and other writable host "
                                       "directories, files it unlinked but holds open or mapped included) and the "
                                       "sandbox was killed")

    async def _check_free_space(self) -> None:
        """End the largest sandbox (last measured) on each file system holding sandboxes' writable host
        directories whose free space is below ``min_free_bytes``, one per file system per call, counting as free
        what sandboxes already ended still hold (their directories go when they are closed). The disk must
        never fill while sandboxes run, so the largest is ended even when none holds much: bytes a sandbox
        hides from measurement (a descriptor in flight in a socket) show only in free space. What the kill
        freed tells whose doing it was (:meth:`_evict`)."""
        floor = self.min_free_bytes
        if floor is None:
            return
        for path, hs in self._sandboxes_by_fs().items():
            live = [h for h in hs if h._closing is None and h._death is None and h._proc.returncode is None]
            if not live:
                continue
            free = await asyncio.to_thread(bounds.free_bytes, path)
            ending = sum(h._used for h in hs if h not in live)
            if free + ending >= floor:
                continue
            victim = max(live, key=lambda h: h._used)
            if victim._used < floor // 64:
                log.warning("the file system of %s has %d bytes free, below the floor of %d, and no sandbox on it "
                            "holds much (the most: %d bytes, sandbox %s): it is ended all the same", path, free,
                            floor, victim._used, victim.sandbox_id)
            await self._evict(victim, path, floor)

    def _sandboxes_by_fs(self) -> dict[str, list[SandboxHandle]]:
        """A path on each file system holding sandboxes' writable host directories -> the sandboxes there."""
        by_fs: dict[int, tuple[str, list[SandboxHandle]]] = {}  # st_dev -> (a path on it, its sandboxes)
        for h in list(self._handles.values()):
            for d in self._writable_host_dirs(h):
                try:
                    path, hs = by_fs.setdefault(os.stat(d).st_dev, (d, []))
                except OSError:
                    continue
                if h not in hs:
                    hs.append(h)
        return dict(by_fs.values())

    async def _evict(self, victim: SandboxHandle, path: str, floor: int) -> None:
        """End ``victim`` for the free-space floor of the file system of ``path``, and judge by what the kill
        freed whose doing it was. Its directories stay until it is closed, so its processes' end frees only
        what they held unlinked; a kill that frees more than the sandbox's measured bytes plus a slack
        (:func:`sandbox.bounds.floor_slack`) shows bytes hidden from measurement: ``disk_quota``, scored.
        Otherwise it was the host's need: :class:`SandboxEvictedError` (``host_disk``), filtered. Calls of the
        sandbox wait for the verdict. Bytes that other sandboxes' closes free meanwhile are not counted
        against it."""
        victim._verdict = asyncio.get_running_loop().create_future()
        try:
            measured = victim._used
            others_closing = {h.sandbox_id for h in self._handles.values() if h._closing is not None}
            before = await asyncio.to_thread(bounds.free_bytes, path)
            await victim._end(SandboxEvictedError.REASON,
                              f"the host's file system holding the sandbox's workspace fell below its free-space "
                              f"floor ({before} of {floor} bytes free) and this sandbox held the most on it "
                              f"({measured} bytes, within its quota): the host ended it")
            after = await asyncio.to_thread(bounds.free_after_release, path, before)
            closed_meanwhile = sum(h._used for h in self._handles.values()
                                   if h._closing is not None and h.sandbox_id not in others_closing
                                   and h is not victim)
            freed = after - before - closed_meanwhile
            if freed > measured + bounds.floor_slack(floor) and victim._death is not None \
                    and victim._death[0] == SandboxEvictedError.REASON:
                victim._death = ("disk_quota", f"the host's file system fell below its free-space floor ({before} of "
                                               f"{floor} bytes free) and the host ended this sandbox, which held the "
                                               f"most on it as measured ({measured} bytes); its end freed {freed} "
                                               "bytes: it held files hidden from measurement (unlinked, kept "
                                               "alive), so it passed its disk quota")
                log.warning("sandbox %s: %s", victim.sandbox_id, victim._death[1])
        finally:
            victim._verdict.set_result(None)

    async def reap_orphans(self) -> int:
        """Kill and clean up the sandboxes recorded in this state directory by servers that are provably dead
        (:func:`sandbox.ownership.owner_gone`: of this node, pid gone or of another create time, or of an
        earlier boot), and nothing else; also remove empty sandbox cgroups older than ten minutes that servers
        killed elsewhere left (:func:`sandbox.bounds.sweep_stale_cgroups`); and finish this runtime's own closes
        whose processes survived SIGKILL (:meth:`SandboxHandle.close`: killed again, then released). Returns how
        many records were reaped or finished.

        A record is only a claim (a forged or stale one may name anything), so what it names is checked first:
        nothing a live sandbox holds (this runtime's, or one a live server's record names: its id, launcher,
        pid namespace, directories, cgroup) is touched; a launcher is killed by pid only if the host's marker
        in its environment names the record's sandbox; a pid namespace only if one of its processes carries
        that marker (a namespace's init does while it lives: bwrap forks it without clearing the
        environment); nothing at all if a process carrying the marker has a live parent that adopts no
        orphans (:func:`sandbox.ownership.orphan_adopters`: a live server spawned it, so its record here is a
        copy, defence in depth beside the owner check); a workspace is removed only if it is a directory of
        this user named ``prorl-<sandbox_id>-<hex>`` with no symbolic link on its path, a run directory only
        under this state directory, a cgroup only by its own sandbox's name. What was left alone is logged in
        one line per reap, however many records asked for it."""
        if self._reaping is None:
            self._reaping = asyncio.Lock()
        async with self._reaping:  # the periodic reap and a call never act on one record twice at once
            groups = bounds.memory_cgroups(self._cgroup_parent) if self.isolated else None
            if groups is not None:
                await asyncio.to_thread(bounds.sweep_stale_cgroups, groups.parent, groups.version)
            finished = 0
            for h in list(self._unfinished.values()):  # this server's own closes that left survivors
                survivors = await h._kill(0.0)
                if survivors:
                    log.error("closed sandbox %s: processes still survive SIGKILL: %s (kept for the next reap)",
                              h.sandbox_id, [p.pid for p in survivors])
                    continue
                await h._release()
                finished += 1
            records = await asyncio.to_thread(self.store.records)
            dead = [r for r in records if owner_gone(r, self._node)]
            live = [r for r in records if not any(r is d for d in dead)]
            if not dead:
                return finished
            held = self._held_state(live)
            marked, adopters, namespaces = await asyncio.to_thread(
                lambda: (marked_processes(), orphan_adopters(), live_pid_namespaces()))
            refused: dict[str, list[str]] = {"own": [], "live_parent": [], "unproven_pidns": [], "reused_pidns": []}
            reaped = finished
            for rec in dead:
                if rec["sandbox_id"] in self._handles:
                    refused["own"].append(rec["sandbox_id"])
                    continue
                try:
                    reaped += await self._reap(rec, held, marked, adopters, namespaces, refused)
                except Exception:  # what one orphan left (shaped by its sandbox) never stops a server
                    log.exception("reaping orphan sandbox %s failed; its record is kept for the next reap",
                                  rec.get("sandbox_id"))
            if reaped:
                log.info("reaped %d orphan sandbox record(s) left by servers that are gone", reaped)
            why = {"own": "name a sandbox of this server (record kept)",
                   "live_parent": "name a launcher a live process spawned (record kept)",
                   "unproven_pidns": "name a live pid namespace in which no process carries a sandbox's "
                                     "launcher marker (namespace not killed): forged, or its number reused by a "
                                     "namespace that is no sandbox's",
                   "reused_pidns": "were stale: their sandbox is gone, and the kernel has given its pid "
                                   "namespace's number to another sandbox (left alone)"}
            for kind, ids in refused.items():
                # once per record, not at every periodic reap while it stays (kept records come back)
                ids = [i for i in ids if (kind, i) not in self._refused_seen]
                if len(self._refused_seen) > 100_000:
                    self._refused_seen.clear()
                self._refused_seen.update((kind, i) for i in ids)
                if not ids:
                    continue
                if kind == "reused_pidns":
                    # the honest case after a crash: namespace inode numbers are reused at once (the kernel's
                    # proc inum allocator hands out the lowest free one), here by a sandbox that carries its own
                    # marker
                    log.info("%d dead-owner ownership record(s) %s, e.g. %s", len(ids), why[kind],
                             ", ".join(ids[:3]))
                elif kind == "unproven_pidns":
                    log.warning("%d dead-owner ownership record(s) %s, e.g. %s", len(ids), why[kind],
                                ", ".join(ids[:3]))
                else:
                    log.warning("%d dead-owner ownership record(s) %s: forged or stale, e.g. %s", len(ids),
                                why[kind], ", ".join(ids[:3]))
            return reaped

    def _held_state(self, live_records: list[dict]) -> dict[str, set]:
        """What live sandboxes hold (this runtime's and those of live servers' records), by kind."""
        held: dict[str, set] = {"sandbox_id": set(), "launcher": set(), "pidns": set(), "path": set(),
                                "cgroup": set()}
        for h in self._handles.values():
            held["sandbox_id"].add(h.sandbox_id)
            held["launcher"].add(h.pid)
            held["pidns"].add(h.pidns)
            held["path"].update((h.workspace, h._ctx.run_dir))
            held["cgroup"].add(h.bounds.cgroup)
        for r in live_records:
            held["sandbox_id"].add(r["sandbox_id"])
            held["launcher"].add(r.get("pid"))
            held["pidns"].add(r.get("pidns"))
            held["path"].update((r.get("workspace"), r.get("run_dir")))
            held["cgroup"].add(r.get("cgroup"))
        for kind in held:
            held[kind].discard(None)
        return held

    def _reapable_workspace(self, rec: dict, held: dict[str, set]) -> Optional[str]:
        """The workspace of a dead server's record if it may be removed (see :meth:`reap_orphans`), else
        ``None``."""
        ws, sid = rec.get("workspace"), rec["sandbox_id"]
        if not rec.get("workspace_created") or not isinstance(ws, str) or not os.path.isabs(ws) \
                or ws in held["path"]:
            return None
        parent, name = os.path.split(os.path.normpath(ws))
        if not re.fullmatch(rf"prorl-{re.escape(sid)}-[0-9a-f]{{8}}", name) or os.path.realpath(parent) != parent:
            return None
        try:
            st = os.lstat(ws)
        except OSError:
            return None
        return ws if stat.S_ISDIR(st.st_mode) and self.sandbox_uid(st.st_uid) else None

    async def _reap(self, rec: dict, held: dict[str, set], marked: dict[str, list[MarkedProcess]],
                    adopters: set[int], namespaces: set[int], refused: dict[str, list[str]]) -> int:
        """Kill and clean up one orphan's record (see :meth:`reap_orphans`); 1 if it was reaped. ``marked``:
        :func:`sandbox.ownership.marked_processes` of this reap; ``adopters``:
        :func:`sandbox.ownership.orphan_adopters`; ``namespaces``: the live pid namespaces
        (:func:`sandbox.ownership.live_pid_namespaces`); ``refused``: ids of records left alone, by why."""
        sid = rec["sandbox_id"]
        started_at = rec.get("started_at") if isinstance(rec.get("started_at"), (int, float)) else None
        mine = [m for m in marked.get(sid, ()) if m.pid not in held["launcher"]
                and (started_at is None or m.create_time >= started_at - 1.0)]
        pids = {m.pid for m in mine}
        if any(m.ppid not in pids and m.ppid not in adopters and psutil.pid_exists(m.ppid) for m in mine):
            refused["live_parent"].append(sid)
            return 0
        run_dir = rec.get("run_dir") or ""
        run_dir = run_dir if isinstance(run_dir, str) and self._owns(run_dir) and run_dir not in held["path"] \
            and os.path.basename(run_dir) == sid else ""
        sessions = _trusted_sessions(rec.get("runtime"), run_dir, sid) if run_dir else set()
        pid, ct = rec.get("pid"), rec.get("create_time")
        if not isinstance(pid, int) or pid not in pids:
            pid, ct = 0, None  # not this sandbox's launcher (gone, reused, or another sandbox's): never killed
        pidns = rec.get("pidns")
        pidns = pidns if isinstance(pidns, int) and pidns not in held["pidns"] else None
        if pidns is not None and not any(m.pidns == pidns for m in mine):
            # No process of that namespace proves it is this sandbox's: a live namespace always holds its
            # init, which carries the marker, so this one is gone or belongs to someone else. Gone: the common
            # honest case (nothing said). Another sandbox's (its init carries that sandbox's marker): the number
            # was reused, the record is stale. Neither (no marker at all, or the host's own namespace, where
            # the launchers live): a forged record, or a number reused by a namespace that is no sandbox's.
            if pidns in namespaces:
                other = pidns != self._own_pidns and any(
                    m.pidns == pidns for ms in marked.values() for m in ms)
                refused["reused_pidns" if other else "unproven_pidns"].append(sid)
            pidns = None
        survivors = await kill_sandbox(pid, ct, grace_s=self.close_grace_s, sessions=sessions, pidns=pidns,
                                       not_before=started_at)
        # What the record cannot name: a launcher its server died before recording (a provisional record),
        # or a launcher's forked children (bwrap's namespace init) that outlived it before the sandbox's
        # pid namespace was recorded (die-with-parent races a parent's death). They carry the marker the
        # host put in the launcher's environment.
        for m in mine:
            if m.ppid not in pids:
                survivors += await kill_sandbox(m.pid, m.create_time, grace_s=self.close_grace_s,
                                                not_before=started_at)
        if survivors:
            log.error("orphan sandbox %s: processes survived SIGKILL: %s", sid, [p.pid for p in survivors])
            return 0
        cgroup = rec.get("cgroup")
        if isinstance(cgroup, str) and os.path.basename(cgroup) == bounds.CGROUP_PREFIX + sid \
                and cgroup not in held["cgroup"]:
            await asyncio.to_thread(bounds.remove_cgroup, cgroup, rec.get("cgroup_version") or 2)
        await asyncio.to_thread(self._cleanup_dirs, run_dir or None, self._reapable_workspace(rec, held))
        await asyncio.to_thread(self.store.remove, sid)
        log.debug("reaped orphan sandbox %s (runtime %s, pid %s) left by a server that is gone",
                  sid, rec.get("runtime"), rec.get("pid"))
        return 1

    def start_reaper(self) -> None:
        """Reap every ``reap_interval_s`` seconds from now on (:meth:`reap_orphans`), so that what a server of
        this node left when it died is reaped while this one runs, not only when some server starts again.
        Idempotent; stopped by :meth:`close_all`. Nothing when ``reap_interval_s`` is ``None``."""
        if self.reap_interval_s is None or (self._reaper is not None and not self._reaper.done()):
            return
        self._reaper = asyncio.ensure_future(self._reap_forever())

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.reap_interval_s)
            try:
                await self.reap_orphans()
            except Exception:  # noqa: BLE001 - one failed round must not end the reaping
                log.exception("reaping orphan sandboxes failed; retried in %g s", self.reap_interval_s)

    async def close_all(self) -> None:
        """Close every sandbox this runtime started and has not closed yet (concurrently), including those
        still starting."""
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
            self._reaper = None
        # Starts in flight finish (and are closed) within their deadline; one blocked by the node past it
        # (its worker thread cannot be interrupted) must not hold a server's shutdown: its launcher, if it ever
        # runs, dies with this process (--die-with-parent, the readiness pipe).
        deadline = time.monotonic() + self.start_timeout_s + self.close_grace_s
        while self._starting:
            left = deadline - time.monotonic()
            if left <= 0:
                log.error("%d sandbox start(s) still blocked after start_timeout_s: not waited for",
                          len(self._starting))
                break
            await asyncio.wait(list(self._starting), timeout=left)
        handles = list(self._handles.values())
        results = await asyncio.gather(*(h.close() for h in handles), return_exceptions=True)
        for h, r in zip(handles, results):
            if isinstance(r, BaseException):
                log.error("closing sandbox %s failed: %s", h.sandbox_id, r)
        if self._watcher is not None and not self._handles:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
            self._watcher = None

    @property
    def handles(self) -> list[SandboxHandle]:
        return list(self._handles.values())

    # ------------------------------------------------------------------------------------------ helpers
    @property
    def id_prefix(self) -> str:
        return "sb"

    def _check_writable_paths(self, workspace: str, spec: SandboxSpec) -> None:
        """Refuse a sandbox whose writable host paths (workspace, ``rw`` binds) overlap the state directory:
        the ownership records and every other sandbox's run directory are host-side state that the host reads
        to decide what to kill and trust, so no sandbox may write them. Raises ``ValueError``."""
        state = os.path.realpath(self.state_dir)
        for name, path in [("workspace", workspace)] + [(f"bind {b.container}", b.host) for b in spec.binds
                                                           if not b.ro]:
            real = os.path.realpath(path)
            if real == state or real.startswith(state + os.sep) or state.startswith(real + os.sep):
                raise ValueError(f"sandbox {name} {path!r} overlaps the host state directory {self.state_dir} "
                                 "(ownership records, run directories): refused, a sandbox must not write it")

    def _owns(self, path: Optional[str]) -> bool:
        return bool(path) and os.path.abspath(path).startswith(os.path.join(self.state_dir, "run") + os.sep)

    def _bounds_for(self, spec: SandboxSpec, sandbox_id: str) -> SandboxBounds:
        """The sandbox's bounds as a whole: the spec's, else this runtime's defaults; the cgroup path it will
        get (not created yet) where the host offers memory cgroups. ``local`` sandboxes have none."""
        if not self.isolated:
            return SandboxBounds()
        d, mine = self._bounds_defaults, spec.limits
        pick = {name: getattr(mine, name) if getattr(mine, name) is not None else getattr(d, name)
                for name in ("tmpfs_bytes", "sandbox_memory_bytes", "workspace_bytes")}
        groups = bounds.memory_cgroups(self._cgroup_parent) if pick["sandbox_memory_bytes"] else None
        return SandboxBounds(tmpfs_bytes=pick["tmpfs_bytes"],
                             memory_bytes=pick["sandbox_memory_bytes"] if groups else None,
                             workspace_bytes=pick["workspace_bytes"],
                             cgroup=os.path.join(groups.parent, bounds.CGROUP_PREFIX + sandbox_id) if groups else None,
                             cgroup_version=groups.version if groups else 0)

    def _view_for(self, spec: SandboxSpec) -> Optional[PythonView]:
        """The Python view of a sandbox for ``spec``, or ``None`` (see :meth:`uses_python_view`). Raises
        ``ValueError`` for a package that is never visible, :class:`SandboxStartError` for a missing one."""
        if not self.uses_python_view(spec):
            return None
        packages = spec.python_packages if spec.python_packages is not None else self.python_packages
        return python_view(packages, self.view_dir, os.path.join(project_root(), "sandbox"))

    def _prepare(self, sandbox_id: str, spec: SandboxSpec, steps: Optional[dict[str, float]] = None,
                 ready_fd: Optional[int] = None) -> tuple[LaunchContext, list[Lease], bool, list[str]]:
        """Blocking part of ``start`` before the launch: the Python view, directories, leases (address, user),
        the sandbox's cgroup, the config, the launcher's argv (:meth:`build_command`: it stats and lists host
        directories; in this same worker-thread call, so a start makes one round trip to the executor for all
        of it, not two). ``steps``: filled with each step's duration (seconds, see
        :attr:`SandboxHandle.start_steps`). ``ready_fd``: the descriptor (number in the launcher) the execution
        server writes a byte to once it listens (config ``ready_fd``). Returns ``(ctx, leases, created,
        argv)``; on failure, whatever it made is undone."""
        lap = _Laps(steps)
        view = self._view_for(spec)
        lap("view")
        limits = self._bounds_for(spec, sandbox_id)
        run_dir, workspace, created = self._make_dirs(sandbox_id, spec, limits)
        lap("dirs")
        leases: list[Lease] = []
        cgroup_made = False
        ctx: Optional[LaunchContext] = None
        try:
            if self.isolated:
                self._check_writable_paths(workspace, spec)
            lap("dirs")
            address = None
            if spec.network == "loopback":
                if self._loopback is None:
                    self._loopback = LoopbackAllocator(*self._loopback_args)
                lease = self._loopback.allocate(owner=sandbox_id)
                leases.append(lease)
                address = lease.address
            run_as, user_lease = self.sandbox_user(spec, sandbox_id)
            if user_lease is not None:
                leases.append(user_lease)
            lap("leases")
            sb_ws, sb_run = self.sandbox_paths(spec, run_dir, workspace)
            ctx = LaunchContext(sandbox_id=sandbox_id, run_dir=run_dir, workspace=workspace, sandbox_run_dir=sb_run,
                                sandbox_workspace=sb_ws, python=view.python if view else self.python,
                                pythonpath=list(view.server_path) if view else python_paths(),
                                address=address, run_as=run_as, view=view, bounds=limits)
            if ctx.run_as:
                for d in (run_dir, workspace):
                    os.chown(d, *ctx.run_as)
            rlimits = spec.limits.rlimits()
            if limits.workspace_bytes is not None:  # no single file may pass the disk quota either
                rlimits["max_file_bytes"] = min(rlimits["max_file_bytes"] or limits.workspace_bytes,
                                                limits.workspace_bytes)
            config = {"workspace": sb_ws, "run_dir": sb_run, "env": self.tool_env(spec, ctx),
                      "limits": rlimits, "run_as": list(ctx.run_as) if ctx.run_as else None,
                      "sessions_file": self.sessions_file(ctx), "ready_fd": ready_fd}
            with open(os.path.join(run_dir, CONFIG_NAME), "w") as f:
                json.dump(config, f)
            lap("config")
            if limits.cgroup:
                bounds.MemoryCgroups(os.path.dirname(limits.cgroup), limits.cgroup_version).create(
                    os.path.basename(limits.cgroup), limits.memory_bytes)
                cgroup_made = True
            lap("cgroup")
            argv = self.build_command(spec, ctx)
            if ctx.bounds.cgroup:
                # The launcher enters the sandbox's cgroup before it runs anything, so every process of the
                # sandbox is born inside it (the exec keeps its pid and create time). A shell, not the host: the
                # host writing another process's pid to cgroup.procs took 10.9 ms here, the self-move 1.5 ms.
                argv = ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', ctx.bounds.cgroup, *argv]
            lap("launch")
        except BaseException:
            if ctx is not None:
                for fd in ctx.launch_fds:
                    os.close(fd)
                ctx.launch_fds.clear()
            if cgroup_made:
                bounds.remove_cgroup(limits.cgroup, limits.cgroup_version)
            for lease in leases:
                lease.release()
            self._cleanup_dirs(run_dir, workspace if created else None)
            self.store.remove(sandbox_id)  # after the directories: the record is how they are found
            raise
        return ctx, leases, created, argv

    def _record_start(self, record: dict[str, Any]) -> Optional[float]:
        """Write the ownership record of a just-launched sandbox; returns the launcher's create time."""
        record["create_time"] = process_identity(record["pid"])
        self.store.write(record)
        return record["create_time"]

    def _make_dirs(self, sandbox_id: str, spec: SandboxSpec,
                   limits: SandboxBounds = SandboxBounds()) -> tuple[str, str, bool]:
        """Create the run directory and the workspace (a fresh private one unless the spec names one), after
        writing a provisional ownership record (no launcher pid yet) that names both, and the sandbox's cgroup
        to be: a server killed at any point from here on leaves nothing that the next server's
        :meth:`reap_orphans` does not find."""
        run_dir = os.path.join(self.state_dir, "run", sandbox_id)
        if len(os.path.join(run_dir, SOCKET_NAME)) > _MAX_SOCKET_PATH:
            raise SandboxStartError(f"state_dir {self.state_dir} is too long for a Unix socket path; "
                                    "configure a shorter one")
        created = not spec.workspace
        if created:
            # The name is chosen (unguessably) before the directory exists so that the record can name it;
            # os.mkdir refuses an existing path, as mkdtemp does.
            # no symbolic link on the recorded path: a reaper removes only such workspaces (_reapable_workspace)
            root = os.path.realpath(self.workspace_root or tempfile.gettempdir())
            workspace = os.path.join(root, f"prorl-{sandbox_id}-{secrets.token_hex(4)}")
        else:
            workspace = os.path.abspath(spec.workspace)
        self.store.write({"sandbox_id": sandbox_id, "runtime": self.kind, "pid": None, "create_time": None,
                          "run_dir": run_dir, "workspace": workspace, "workspace_created": created,
                          "cgroup": limits.cgroup, "cgroup_version": limits.cgroup_version,
                          "started_at": time.time(), **self._owner})
        try:
            os.makedirs(run_dir, mode=0o700)
            if not created:
                os.makedirs(workspace, exist_ok=True)
            else:
                if self.workspace_root:
                    os.makedirs(self.workspace_root, mode=0o700, exist_ok=True)
                os.mkdir(workspace, mode=0o700)
        except BaseException:
            self._cleanup_dirs(run_dir, None)  # never a workspace this call did not create
            self.store.remove(sandbox_id)
            raise
        return run_dir, workspace, created

    @staticmethod
    def _cleanup_dirs(run_dir: Optional[str], workspace: Optional[str]) -> None:
        # the sandbox shaped both: however deep or odd, they go (shutil.rmtree recursed into a RecursionError)
        for d in (run_dir, workspace):
            if d:
                remove_tree(d)

    @staticmethod
    def _log_tail(run_dir: str, n: int = 4000) -> str:
        # The run directory is sandbox-writable: never follow a link planted there (it could name a host
        # secret that would then travel in the start error), and read only the last ``n`` bytes.
        try:
            fd = os.open(os.path.join(run_dir, LOG_NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return "(no log)"
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return "(no log)"
            os.lseek(fd, max(0, st.st_size - n), os.SEEK_SET)
            return os.read(fd, n).decode("utf-8", errors="replace")
        except OSError:
            return "(no log)"
        finally:
            os.close(fd)


class _MeasurePool:
    """A few threads that run measurements, those of the lowest priority number first (the entries a
    sandbox's last measurement read: a cheap sandbox never waits behind a queue of costly ones, only behind
    the at most ``workers`` measurements already running, each bounded by its entry budget)."""

    def __init__(self, workers: int) -> None:
        import queue
        import threading

        self._queue: "queue.PriorityQueue" = queue.PriorityQueue()
        self._seq = itertools.count()
        self._threads = [threading.Thread(target=self._work, name=f"prorl-measure-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    def _work(self) -> None:
        while True:
            _, _, job = self._queue.get()
            if job is None:
                return
            fn, fut, loop = job
            if fut.done():  # its waiter was cancelled (the watch stopped): nothing to measure for
                continue
            try:
                res, exc = fn(), None
            except BaseException as e:  # noqa: BLE001 - handed to the waiting coroutine
                res, exc = None, e
            try:
                loop.call_soon_threadsafe(_settle, fut, res, exc)
            except RuntimeError:  # the loop closed while this measured: no one waits
                pass

    async def run(self, priority: int, fn: Callable[[], Any]) -> Any:
        """``fn()`` on a pool thread, after every queued job of a lower ``priority``; returns its result."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.put((priority, next(self._seq), (fn, fut, loop)))
        return await fut

    def shutdown(self) -> None:
        """Let the threads end once the jobs queued before this ran (they are daemons: a server that exits
        does not wait)."""
        for _ in self._threads:
            self._queue.put((float("inf"), next(self._seq), None))


class _ReadyPipe:
    """The execution server's readiness signal: a pipe whose write end the launcher inherits (at the same
    number, config ``ready_fd``); the server writes a byte to it once it listens, and the end of every process
    holding it (the sandbox's death) closes it. ``event`` is set at either, so the host connects once instead of
    polling the socket: at 64 concurrent starts a 1 ms poll of each socket took more CPU than the starts. What a
    sandbox writes there is never read, only waited for; the connection is checked as before.

    The read end stays open (unwatched) while the sandbox lives and closes with it: the execution server exits
    when its ready write finds no reader, or later when the read end closes, so a sandbox never outlives a
    SIGKILLed server, even one caught before bwrap armed ``--die-with-parent`` (its parent-death signal then
    names init). It is close-on-exec and the server's process pool forks from a clean forkserver, so only this
    process holds it."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        self.event = asyncio.Event()
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    def watch(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.read_fd, self._fire)

    def _fire(self) -> None:
        self.event.set()
        self._unwatch()

    def _unwatch(self) -> None:
        if self._loop is not None and self.read_fd >= 0:
            self._loop.remove_reader(self.read_fd)
        self._loop = None

    def close_write(self) -> None:
        if self.write_fd >= 0:
            os.close(self.write_fd)
            self.write_fd = -1

    def close(self) -> None:
        """Idempotent: stop watching and close both ends."""
        self.close_write()
        if self.read_fd >= 0:
            self._unwatch()
            os.close(self.read_fd)
            self.read_fd = -1


class _Laps:
    """Adds the seconds since the last lap to ``steps[name]`` on each call (``None``: records nothing)."""

    def __init__(self, steps: Optional[dict[str, float]]) -> None:
        self.steps = steps
        self.t = time.perf_counter()

    def restart(self) -> None:
        self.t = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        if self.steps is not None:
            self.steps[name] = self.steps.get(name, 0.0) + now - self.t
        self.t = now


def _log_record_write(sandbox_id: str, fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("sandbox %s: its ownership record could not be updated with its pid namespace (%s); a reap "
                    "after a crash finds it by its launcher", sandbox_id, fut.exception())


def _settle(fut: asyncio.Future, res: Any, exc: Optional[BaseException]) -> None:
    if not fut.done():
        fut.set_exception(exc) if exc is not None else fut.set_result(res)
