"""The ``SandboxRuntime`` interface and the ``SandboxHandle`` agents act through (runtimes by name:
:mod:`sandbox.factory`).

A runtime turns a :class:`~sandbox.spec.SandboxSpec` into a launcher command line (bwrap, apptainer, or plain
python); everything else is shared here: per-sandbox run directory and workspace, the ownership record, the
loopback lease, starting the launcher in its own session/process group, waiting for the execution server,
closing (SIGTERM → grace → SIGKILL to the whole group, then a psutil check that nothing is left), and reaping
what a crashed earlier server left behind.
"""
from __future__ import annotations

import abc
import asyncio
import base64
import compileall
import dataclasses
import functools
import json
import logging
import os
import secrets
import shutil
import stat
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Optional

import psutil

from .client import SERVER_GRACE_S, ExecClient
from .errors import FileTransferError, SandboxClosedError, SandboxDeadError, SandboxError, SandboxStartError
from .leases import Lease
from .loopback import DEFAULT_LEASE_DIR, DEFAULT_NETWORK, LoopbackAllocator
from .ownership import (LAUNCHER_MARKER_VAR, OwnershipStore, default_state_dir, kill_sandbox, marked_launchers,
                        pid_namespace, process_identity, same_process)
from .protocol import MAX_TRANSFER_BYTES
from .sessions import MARKER_VAR, live_session_ids
from .spec import BashResult, EditorResult, IPythonResult, SandboxSpec, result_from_dict

log = logging.getLogger(__name__)

SOCKET_NAME = "exec.sock"
CONFIG_NAME = "config.json"
LOG_NAME = "launcher.log"
SESSIONS_NAME = "sessions.json"
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


def _descends_from(launcher_pid: int, launcher_create_time: Optional[float], pid: int) -> bool:
    """Whether ``pid`` is the sandbox's launcher (same create time) or one of its descendants."""
    if not same_process(launcher_pid, launcher_create_time):
        return False
    if pid == launcher_pid:
        return True
    try:
        return any(p.pid == launcher_pid for p in psutil.Process(pid).parents())
    except psutil.Error:
        return False


def project_root() -> str:
    """Directory that contains the ``sandbox`` package (bound read-only into sandboxes)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_paths() -> list[str]:
    """``sys.path`` entries the execution server needs when started with ``python -S``: the project root and
    the site-packages directories of this interpreter."""
    paths = [project_root()]
    paths += [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and os.path.isdir(p)]
    return list(dict.fromkeys(paths))


@dataclass
class LaunchContext:
    """Everything a runtime needs to build its command line for one sandbox.

    Host paths: ``run_dir`` (holds socket, config, logs), ``workspace``. In-sandbox paths: ``sandbox_run_dir``,
    ``sandbox_workspace``. ``python``: interpreter that runs the execution server; ``pythonpath``: its
    ``PYTHONPATH`` (``-S`` mode). ``address``: leased loopback address or ``None``."""

    sandbox_id: str
    run_dir: str
    workspace: str
    sandbox_run_dir: str
    sandbox_workspace: str
    python: str
    pythonpath: list[str]
    address: Optional[str]
    run_as: Optional[tuple[int, int]] = None

    def server_argv(self) -> list[str]:
        return [self.python, "-S", "-m", "sandbox.exec_server",
                "--socket", os.path.join(self.sandbox_run_dir, SOCKET_NAME),
                "--config", os.path.join(self.sandbox_run_dir, CONFIG_NAME)]


def server_host_paths(ctx: LaunchContext) -> list[str]:
    """Host paths the execution server needs, bound read-only into a sandbox at the same place (bubblewrap, and
    Singularity without an image venv): the project's ``sandbox`` package (not the rest of the project:
    it may hold configuration, tokens, datasets), the interpreter's prefixes, the real location of the
    interpreter binary (a venv's python is a symlink) and its site-packages."""
    root = os.path.realpath(project_root())
    # An installed project's root is a site-packages directory, needed whole (the dependencies live there).
    checkout = not root.endswith(("site-packages", "dist-packages"))
    paths = [os.path.join(root, "sandbox"), sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(ctx.python))]
    paths += ctx.pythonpath
    out: list[str] = []
    for p in paths:
        p = os.path.realpath(p)
        if checkout and p == root:
            continue  # e.g. a venv's prefix being the project itself: never the whole checkout
        if os.path.isdir(p) and p != "/" and not any(p == q or p.startswith(q + os.sep) for q in out):
            out = [q for q in out if not q.startswith(p + os.sep)] + [p]
    return out


class SandboxHandle:
    """A running sandbox. Tools are coroutines; one action runs at a time (calls queue up).

    Attributes: ``sandbox_id`` (str), ``workspace`` (host path of the workspace directory), ``workdir`` (the
    workspace's path inside the sandbox), ``address`` (leased 127.x.y.z or ``None``), ``pid`` (launcher pid on
    the host; it leads the sandbox's process group).
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
        self._closing: Optional[asyncio.Task] = None

    def __repr__(self) -> str:
        return f"<SandboxHandle {self.sandbox_id} {self._runtime.kind} pid={self.pid} alive={self.alive}>"

    @property
    def alive(self) -> bool:
        """True while the sandbox's launcher runs and ``close()`` has not been called."""
        return self._closing is None and self._proc.returncode is None

    def _check(self) -> None:
        if self._closing is not None:
            raise SandboxClosedError(f"sandbox {self.sandbox_id} is closed")
        if self._proc.returncode is not None:
            raise SandboxDeadError(f"sandbox {self.sandbox_id} died (exit status {self._proc.returncode})")

    async def _call(self, op: str, args: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        self._check()
        return await self._client.call(op, args, timeout_s + SERVER_GRACE_S)

    # ----------------------------------------------------------------------------------------------- tools
    async def bash(self, command: str, timeout_s: float = 30.0, max_output_bytes: int = 1 << 20) -> BashResult:
        """Run ``command`` (any bash text, multi-line allowed) in the persistent shell; cwd, variables and
        functions persist across calls. ``timeout_s`` (seconds): then Ctrl-C, SIGKILL of the foreground job,
        and at last a fresh shell; the partial output comes back with ``timed_out=True``. Output beyond
        ``max_output_bytes`` is dropped with a notice (``truncated=True``). Raises :class:`SandboxDeadError`,
        :class:`SandboxClosedError`, :class:`ToolTimeout` (the server itself stopped answering)."""
        if timeout_s <= 0 or max_output_bytes <= 0:
            raise ValueError("timeout_s and max_output_bytes must be positive")
        res = await self._call("bash", {"command": command, "timeout_s": timeout_s,
                                        "max_output_bytes": max_output_bytes}, timeout_s)
        return result_from_dict(BashResult, res)

    async def ipython(self, code: str, timeout_s: float = 60.0) -> IPythonResult:
        """Run one cell in the persistent IPython kernel (started on first use; its start is not charged to
        ``timeout_s``). On timeout the kernel is interrupted and ``timed_out=True``. Raises
        :class:`KernelDiedError` if the kernel dies during the cell (the next call starts a fresh one), and
        the errors of :meth:`bash`."""
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        from .ipython_tool import KERNEL_START_TIMEOUT_S

        res = await self._call("ipython", {"code": code, "timeout_s": timeout_s}, timeout_s + KERNEL_START_TIMEOUT_S)
        return result_from_dict(IPythonResult, res)

    async def editor(self, command: str, path: str, **kw: Any) -> EditorResult:
        """``str_replace_editor``: ``command`` in view / create / str_replace / insert / undo_edit; ``path``
        absolute inside the sandbox or relative to the workspace; keywords ``view_range``, ``file_text``,
        ``old_str``, ``new_str``, ``insert_line``. Raises :class:`PathOutsideWorkspaceError` for a path that
        leaves the workspace (``..`` or symlinks), :class:`EditorError` for any other refusal."""
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
    async def close(self) -> None:
        """Stop the sandbox: SIGTERM to its process group, ``close_grace_s``, SIGKILL to everything left; then
        release its address, delete its run directory (and its workspace if the runtime created it) and its
        ownership record. Idempotent; concurrent calls wait for the same close. Raises :class:`SandboxError`
        only if processes survive SIGKILL."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        await self._client.close()
        survivors = await kill_sandbox(self.pid, self.create_time, grace_s=self._runtime.close_grace_s,
                                       sessions=_trusted_sessions(self._runtime.kind, self._ctx.run_dir,
                                                                  self.sandbox_id),
                                       pidns=self.pidns, not_before=self.started_at, own_child_wait=self._proc.wait)
        for lease in self._leases:
            lease.release()
        await asyncio.to_thread(self._runtime._cleanup_dirs, self._ctx.run_dir,
                                self.workspace if self._workspace_created else None)
        await asyncio.to_thread(self._runtime.store.remove, self.sandbox_id)
        self._runtime._handles.pop(self.sandbox_id, None)
        if survivors:
            raise SandboxError(f"sandbox {self.sandbox_id}: processes survived SIGKILL: "
                               f"{[p.pid for p in survivors]}")


class SandboxRuntime(abc.ABC):
    """Starts sandboxes of one kind. Options common to all runtimes:

    - ``state_dir``: per-user directory for ownership records and run directories (default
      :func:`sandbox.ownership.default_state_dir`).
    - ``workspace_root``: where fresh workspaces are created (default: the system temp dir; each one a private
      0700 directory, named in the ownership record before it is created).
    - ``python``: interpreter that runs the execution server (default: this one, ``sys.executable``).
    - ``start_timeout_s``: how long to wait for the execution server (seconds).
    - ``close_grace_s``: SIGTERM → SIGKILL grace on close (seconds).
    - ``loopback_dir`` / ``loopback_network``: see :class:`sandbox.loopback.LoopbackAllocator`.
    """

    kind: str = "abstract"
    #: Whether sandboxes of this runtime are isolated from the host.
    isolated: bool = True

    def __init__(self, *, state_dir: Optional[str] = None, workspace_root: Optional[str] = None,
                 python: Optional[str] = None, start_timeout_s: float = 30.0, close_grace_s: float = 2.0,
                 loopback_dir: str = DEFAULT_LEASE_DIR, loopback_network: str = DEFAULT_NETWORK) -> None:
        _cache_sandbox_bytecode()
        self.state_dir = os.path.abspath(state_dir or default_state_dir())
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        self.store = OwnershipStore(self.state_dir)
        self.workspace_root = workspace_root
        self.python = python or sys.executable
        self.start_timeout_s = start_timeout_s
        self.close_grace_s = close_grace_s
        self._loopback_args = (loopback_dir, loopback_network)
        self._loopback: Optional[LoopbackAllocator] = None
        self._handles: dict[str, SandboxHandle] = {}
        self._starting: set[asyncio.Future] = set()
        me = os.getpid()
        self._owner = {"owner_pid": me, "owner_create_time": process_identity(me)}
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

    def tool_env(self, spec: SandboxSpec, ctx: LaunchContext) -> dict[str, str]:
        """Environment of the shell and the kernel."""
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": ctx.sandbox_workspace,
               "LANG": "C.UTF-8", "TERM": "dumb", "PAGER": "cat", "GIT_PAGER": "cat", "PYTHONUNBUFFERED": "1"}
        if spec.image is None:
            env["PATH"] = os.path.dirname(self.python) + ":" + env["PATH"]
        if ctx.address:
            env["PRORL_SANDBOX_ADDRESS"] = ctx.address
        env.update(spec.env)
        env[MARKER_VAR] = ctx.sandbox_id  # after the spec's: see sandbox.sessions.carries_marker
        return env

    def launcher_env(self, ctx: LaunchContext) -> dict[str, str]:
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
                "PYTHONPATH": ":".join(ctx.pythonpath)}

    def sessions_file(self, ctx: LaunchContext) -> Optional[str]:
        """Where the execution server records its tool sessions (host path), or ``None``. Only a runtime
        without a pid namespace (``local``) may have one: see :func:`_trusted_sessions`."""
        return None

    async def prepare_launch(self, spec: SandboxSpec) -> None:
        """Called at the start of every :meth:`start`, before anything is created: checks that may take time
        (Singularity's isolation probe). Raises :class:`SandboxStartError` if ``spec`` cannot run here."""

    # ---------------------------------------------------------------------------------------- interface
    async def start(self, spec: SandboxSpec | dict[str, Any] | None = None, **fields: Any) -> SandboxHandle:
        """Start a sandbox and wait until its execution server answers. ``spec``: a :class:`SandboxSpec`, a
        dict of its fields (e.g. from a config file), or ``None`` for the defaults; ``fields`` override single
        fields (``start(image=..., network="loopback")``). Raises ``TypeError``/``ValueError`` for a bad spec,
        :class:`SandboxStartError` (with the launcher's log tail) if the sandbox exits or does not answer
        within ``start_timeout_s``. Cancelling the caller is safe at any point: the start finishes in the
        background and the sandbox is closed at once (``close_all`` waits for that too)."""
        if spec is None:
            spec = SandboxSpec(**fields)
        elif isinstance(spec, dict):
            spec = SandboxSpec(**{**spec, **fields})
        elif fields:
            spec = dataclasses.replace(spec, **fields)
        task = asyncio.ensure_future(self._start(spec))
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            def close_when_started(t: asyncio.Task) -> None:
                if not t.cancelled() and t.exception() is None:
                    closing = asyncio.ensure_future(t.result().close())
                    self._starting.add(closing)
                    closing.add_done_callback(self._starting.discard)

            task.add_done_callback(close_when_started)
            raise

    async def _start(self, spec: SandboxSpec) -> SandboxHandle:
        await self.prepare_launch(spec)
        sandbox_id = f"{self.id_prefix}-{secrets.token_hex(6)}"
        started_at = time.time()
        ctx, leases, created = await asyncio.to_thread(self._prepare, sandbox_id, spec)
        proc = None
        try:
            argv = self.build_command(spec, ctx)
            logf = open(os.path.join(ctx.run_dir, LOG_NAME), "wb")
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv, stdin=asyncio.subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True,
                    env={**self.launcher_env(ctx), LAUNCHER_MARKER_VAR: sandbox_id},
                    pass_fds=tuple(lease.fd for lease in leases))
            finally:
                logf.close()
            record = {"sandbox_id": sandbox_id, "runtime": self.kind, "pid": proc.pid, "create_time": None,
                      "run_dir": ctx.run_dir, "workspace": ctx.workspace, "workspace_created": created,
                      "address": ctx.address, "started_at": started_at, **self._owner}
            record["create_time"] = await asyncio.to_thread(self._record_start, record)
            client = ExecClient(os.path.join(ctx.run_dir, SOCKET_NAME), proc.wait, sandbox_id,
                                peer_ok=functools.partial(_descends_from, proc.pid, record["create_time"]))
            handle = SandboxHandle(self, sandbox_id=sandbox_id, spec=spec, proc=proc,
                                   create_time=record["create_time"], client=client, ctx=ctx, leases=leases,
                                   workspace_created=created, started_at=started_at)
            self._handles[sandbox_id] = handle
        except BaseException:
            if sandbox_id not in self._handles:
                if proc is not None:
                    await kill_sandbox(proc.pid, process_identity(proc.pid), grace_s=0.0, own_child_wait=proc.wait)
                for lease in leases:
                    lease.release()
                await asyncio.to_thread(self._cleanup_dirs, ctx.run_dir, ctx.workspace if created else None)
                # last: until the directories are gone the (provisional) record is how a later server finds them
                await asyncio.to_thread(self.store.remove, sandbox_id)
            raise
        try:
            await client.call("ping", {}, self.start_timeout_s)
            # The sandbox's pid namespace as the host sees it at the verified peer (not as the sandbox reports
            # it: with an image, the image's own loader and libraries run the execution server).
            pidns = await asyncio.to_thread(pid_namespace, client.peer_pid) if client.peer_pid else None
            handle.pidns = pidns if pidns != self._own_pidns else None
            if handle.pidns is not None:
                await asyncio.to_thread(self.store.write, {**record, "pidns": handle.pidns})
        except BaseException as e:
            tail = await asyncio.to_thread(self._log_tail, ctx.run_dir)
            await handle.close()
            if isinstance(e, SandboxError):
                raise SandboxStartError(f"{self.kind} sandbox {sandbox_id} did not start: {e}\n"
                                        f"launcher log (tail):\n{tail}") from None
            raise
        return handle

    async def reap_orphans(self) -> int:
        """Kill and clean up the sandboxes recorded in this state directory by servers that are no longer
        running (pid + create time), and nothing else. Returns how many records were reaped."""
        reaped = 0
        for rec in await asyncio.to_thread(self.store.records):
            if same_process(rec.get("owner_pid"), rec.get("owner_create_time")):
                continue  # its server is alive (this one or another): not an orphan
            run_dir = rec.get("run_dir") or ""
            sessions = (_trusted_sessions(rec.get("runtime"), run_dir, rec["sandbox_id"]) if self._owns(run_dir)
                        else set())
            survivors = await kill_sandbox(rec["pid"], rec.get("create_time"), grace_s=self.close_grace_s,
                                           sessions=sessions, pidns=rec.get("pidns"), not_before=rec.get("started_at"))
            # What the record cannot name: a launcher its server died before recording (a provisional record),
            # or a launcher's forked children (bwrap's namespace init) that outlived it before the sandbox's
            # pid namespace was recorded (die-with-parent races a parent's death). They carry the marker the
            # host put in the launcher's environment.
            for pid, ct in await asyncio.to_thread(marked_launchers, rec["sandbox_id"], rec.get("started_at")):
                survivors += await kill_sandbox(pid, ct, grace_s=self.close_grace_s, not_before=rec.get("started_at"))
            if survivors:
                log.error("orphan sandbox %s: processes survived SIGKILL: %s", rec["sandbox_id"],
                          [p.pid for p in survivors])
                continue
            await asyncio.to_thread(self._cleanup_dirs, run_dir if self._owns(run_dir) else None,
                                    rec.get("workspace") if rec.get("workspace_created") else None)
            await asyncio.to_thread(self.store.remove, rec["sandbox_id"])
            log.warning("reaped orphan sandbox %s (runtime %s, pid %s) left by a server that is gone",
                        rec["sandbox_id"], rec.get("runtime"), rec.get("pid"))
            reaped += 1
        return reaped

    async def close_all(self) -> None:
        """Close every sandbox this runtime started and has not closed yet (concurrently), including those
        still starting."""
        while self._starting:
            await asyncio.gather(*list(self._starting), return_exceptions=True)
        handles = list(self._handles.values())
        results = await asyncio.gather(*(h.close() for h in handles), return_exceptions=True)
        for h, r in zip(handles, results):
            if isinstance(r, BaseException):
                log.error("closing sandbox %s failed: %s", h.sandbox_id, r)

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

    def _prepare(self, sandbox_id: str, spec: SandboxSpec) -> tuple[LaunchContext, list[Lease], bool]:
        """Blocking part of ``start`` before the launch: directories, leases (address, user), the config."""
        run_dir, workspace, created = self._make_dirs(sandbox_id, spec)
        leases: list[Lease] = []
        try:
            if self.isolated:
                self._check_writable_paths(workspace, spec)
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
            sb_ws, sb_run = self.sandbox_paths(spec, run_dir, workspace)
            ctx = LaunchContext(sandbox_id=sandbox_id, run_dir=run_dir, workspace=workspace, sandbox_run_dir=sb_run,
                                sandbox_workspace=sb_ws, python=self.python, pythonpath=python_paths(),
                                address=address, run_as=run_as)
            if ctx.run_as:
                for d in (run_dir, workspace):
                    os.chown(d, *ctx.run_as)
            config = {"workspace": sb_ws, "run_dir": sb_run, "env": self.tool_env(spec, ctx),
                      "limits": spec.limits.to_dict(), "run_as": list(ctx.run_as) if ctx.run_as else None,
                      "sessions_file": self.sessions_file(ctx)}
            with open(os.path.join(run_dir, CONFIG_NAME), "w") as f:
                json.dump(config, f)
        except BaseException:
            for lease in leases:
                lease.release()
            self._cleanup_dirs(run_dir, workspace if created else None)
            self.store.remove(sandbox_id)  # after the directories: the record is how they are found
            raise
        return ctx, leases, created

    def _record_start(self, record: dict[str, Any]) -> Optional[float]:
        """Write the ownership record of a just-launched sandbox; returns the launcher's create time."""
        record["create_time"] = process_identity(record["pid"])
        self.store.write(record)
        return record["create_time"]

    def _make_dirs(self, sandbox_id: str, spec: SandboxSpec) -> tuple[str, str, bool]:
        """Create the run directory and the workspace (a fresh private one unless the spec names one), after
        writing a provisional ownership record (no launcher pid yet) that names both: a server killed at any
        point from here on leaves nothing that the next server's :meth:`reap_orphans` does not find."""
        run_dir = os.path.join(self.state_dir, "run", sandbox_id)
        if len(os.path.join(run_dir, SOCKET_NAME)) > _MAX_SOCKET_PATH:
            raise SandboxStartError(f"state_dir {self.state_dir} is too long for a Unix socket path; "
                                    "configure a shorter one")
        created = not spec.workspace
        if created:
            # The name is chosen (unguessably) before the directory exists so that the record can name it;
            # os.mkdir refuses an existing path, as mkdtemp does.
            root = self.workspace_root or tempfile.gettempdir()
            workspace = os.path.join(root, f"prorl-{sandbox_id}-{secrets.token_hex(4)}")
        else:
            workspace = os.path.abspath(spec.workspace)
        self.store.write({"sandbox_id": sandbox_id, "runtime": self.kind, "pid": None, "create_time": None,
                          "run_dir": run_dir, "workspace": workspace, "workspace_created": created,
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
        for d in (run_dir, workspace):
            if d:
                shutil.rmtree(d, ignore_errors=True)

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
