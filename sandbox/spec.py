"""The sandbox's core types: what to start (:class:`SandboxSpec`) and what tools return.

Plain dataclasses rather than pydantic models on purpose: this module is imported by the execution server
inside every sandbox, and sandbox start latency (target p50 < 50 ms for bubblewrap) cannot afford
pydantic's import time.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

Network = Literal["none", "loopback", "host"]
NETWORKS: tuple[str, ...] = ("none", "loopback", "host")


@dataclass(frozen=True)
class Bind:
    """A host path made visible inside the sandbox. ``host`` and ``container`` are absolute paths."""

    host: str
    container: str
    ro: bool = True


@dataclass(frozen=True)
class Limits:
    """Resource limits of the processes the tools start (the shell, its commands, the kernel), and of the
    sandbox as a whole.

    Per process, applied with ``setrlimit`` in the execution server before the shell or kernel is executed, so
    every descendant inherits them. ``None`` = not limited.

    - ``max_processes``: RLIMIT_NPROC, processes + threads of the sandbox user. Rootless runtimes count it per
      user namespace (per sandbox); a bubblewrap runtime started as root runs the sandbox as an unprivileged
      user so that the limit holds (the kernel exempts uid 0).
    - ``max_memory_bytes``: RLIMIT_AS, virtual memory per process, in bytes.
    - ``cpu_seconds``: RLIMIT_CPU, CPU time per process, in seconds.
    - ``max_file_bytes``: RLIMIT_FSIZE, largest file a process may write, in bytes (never more than the
      disk quota, ``workspace_bytes``).
    - ``max_open_files``: RLIMIT_NOFILE.

    The sandbox as a whole (:mod:`sandbox.bounds`); ``None`` = the runtime's default (its options of the same
    name; 512 MiB, 8 GiB and 4 GiB unless configured), a number of bytes otherwise:

    - ``tmpfs_bytes``: size of each writable in-memory file system of the sandbox (``/tmp``, ``/dev/shm``,
      ``/run``; bubblewrap). Writing past it fails with ENOSPC inside; the host is not affected.
    - ``sandbox_memory_bytes``: memory of all its processes together (a cgroup, where the host allows one).
      Past it the sandbox is killed and its calls raise :class:`~sandbox.errors.SandboxDeadError` with
      ``reason="memory"``.
    - ``workspace_bytes``: disk quota of its writable host directories (workspace, run directory, ``rw``
      binds), measured by the host. Past it the sandbox is killed: ``SandboxDeadError`` with
      ``reason="disk_quota"``.
    """

    max_processes: Optional[int] = None
    max_memory_bytes: Optional[int] = None
    cpu_seconds: Optional[int] = None
    max_file_bytes: Optional[int] = None
    max_open_files: Optional[int] = None
    tmpfs_bytes: Optional[int] = None
    sandbox_memory_bytes: Optional[int] = None
    workspace_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        for name in SANDBOX_WIDE_LIMITS:
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ValueError(f"Limits.{name} must be a positive integer (bytes) or None, got {v!r}")

    def to_dict(self) -> dict[str, Optional[int]]:
        return dataclasses.asdict(self)

    def rlimits(self) -> dict[str, Optional[int]]:
        """The per-process limits (the keys :func:`sandbox.limits.apply_limits` takes)."""
        return {k: v for k, v in self.to_dict().items() if k not in SANDBOX_WIDE_LIMITS}


#: :class:`Limits` fields that bound the sandbox as a whole (the rest are per process, ``setrlimit``).
SANDBOX_WIDE_LIMITS = ("tmpfs_bytes", "sandbox_memory_bytes", "workspace_bytes")


@dataclass
class SandboxSpec:
    """What sandbox to start.

    - ``image``: Singularity: path of a ``.sif`` (required). Bubblewrap: a rootfs directory, or ``None`` for the
      host root, mounted read-only. Local: ignored.
    - ``binds``: extra mounts, as :class:`Bind` or ``(host, container, ro)`` tuples.
    - ``env``: environment of the shell and kernel (added to a minimal default: PATH, HOME=workdir, LANG,
      TERM=dumb, PAGER=cat).
    - ``workdir``: where the workspace is mounted inside the sandbox; the shell starts there and the editor is
      confined to it. Local runtime: the host workspace path is used instead.
    - ``workspace``: host directory to mount as the workspace; ``None`` = a fresh private directory that is
      deleted on close.
    - ``network``: ``"none"`` = a private network namespace with only its own loopback (no way out);
      ``"loopback"`` = the host's network namespace plus one node-unique 127.x.y.z address for this sandbox's
      services (exported as ``PRORL_SANDBOX_ADDRESS``; reachable from the host; this mode does NOT block
      outbound traffic, rootless runtimes cannot filter it); ``"host"`` = the host's network, no address.
    - ``limits``: :class:`Limits` of the tool processes.
    - ``fakeroot``: appear as uid 0 inside (Singularity ``--fakeroot``; bubblewrap ``--uid 0`` in a user
      namespace).
    - ``writable_tmpfs``: the root file system is writable, changes kept in memory and dropped on close
      (Singularity ``--writable-tmpfs``; bubblewrap >= 0.9 overlays, refused with an error on older bwrap).
    - ``python_packages``: distribution names (as ``pip`` knows them) the sandbox's Python may import, on top
      of what the execution server needs; their requirements come along. ``None`` = the runtime's default
      (``numpy``, ``sympy``, ``pytest`` where installed). Only these are visible: never the server's whole
      environment, and never a dataset/benchmark package or this project's own (see
      :mod:`sandbox.python_view`). Ignored where the sandbox has its own interpreter (a Singularity image built
      with its venv) and by ``local``.
    """

    image: Optional[str] = None
    binds: list[Union[Bind, tuple]] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/workspace"
    workspace: Optional[str] = None
    network: str = "none"
    limits: Limits = field(default_factory=Limits)
    fakeroot: bool = False
    writable_tmpfs: bool = False
    python_packages: Optional[tuple[str, ...]] = None

    def __post_init__(self) -> None:
        if self.python_packages is not None:
            if isinstance(self.python_packages, str) or not all(isinstance(p, str) and p.strip()
                                                                 for p in self.python_packages):
                raise ValueError(f"python_packages must be a list of distribution names, got "
                                 f"{self.python_packages!r}")
            self.python_packages = tuple(p.strip() for p in self.python_packages)
        if self.network not in NETWORKS:
            raise ValueError(f"network must be one of {NETWORKS}, got {self.network!r}")
        if not self.workdir.startswith("/"):
            raise ValueError(f"workdir must be an absolute path, got {self.workdir!r}")
        if isinstance(self.limits, dict):
            self.limits = Limits(**self.limits)
        binds: list[Bind] = []
        for b in self.binds:
            if isinstance(b, Bind):
                binds.append(b)
            elif isinstance(b, dict):
                binds.append(Bind(**b))
            else:
                binds.append(Bind(*b))
        for b in binds:
            if not (b.host.startswith("/") and b.container.startswith("/")):
                raise ValueError(f"bind paths must be absolute: {b}")
        self.binds = binds


# ------------------------------------------------------------------------------------------- tool results


@dataclass
class BashResult:
    """One bash call. ``output``: stdout and stderr interleaved as the terminal showed them (str, decoded
    UTF-8 with replacement), ending with a ``[...]`` notice when truncated or interrupted.
    ``exit_code``: the command's status (130 after an interrupt); ``None`` if the shell had to be
    restarted. ``output_bytes``: bytes the command printed in total, shown or not."""

    output: str
    exit_code: Optional[int]
    timed_out: bool = False
    truncated: bool = False
    output_bytes: int = 0
    duration_s: float = 0.0


@dataclass
class IPythonResult:
    """One IPython cell. ``text``: stdout, stderr and the ``text/plain`` results in order. ``images``: the
    cell's ``image/png`` outputs, each a base64 string. ``error``: ``"EName: value"`` plus the traceback
    (ANSI colours stripped) if the cell raised, or the timeout notice; ``None`` on success."""

    text: str
    images: list[str] = field(default_factory=list)
    error: Optional[str] = None
    timed_out: bool = False
    duration_s: float = 0.0


@dataclass
class EditorResult:
    """One ``str_replace_editor`` command. ``output``: what the agent is shown (a file view with line
    numbers, a directory listing, or a snippet around the edit). ``path``: the absolute path inside the
    sandbox that the command acted on."""

    output: str
    path: str


def result_from_dict(cls: type, data: dict[str, Any]) -> Any:
    """Build a result dataclass from a wire dict, ignoring unknown keys (newer servers may add fields)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})
