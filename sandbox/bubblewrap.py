"""Bubblewrap runtime: ``bwrap --unshare-all --die-with-parent`` sandboxes (measured here: ~10 ms to start).

File system: a tmpfs root into which every top-level entry of the image (a rootfs directory) is bound read-only
(symlinks recreated); without an image, only the host's system directories (:data:`HOST_SYSTEM_DIRS`: /usr,
/bin, /sbin, /lib*, /etc with :data:`ETC_SECRETS` masked, the package directories of the system's Pythons
masked empty) — no home directories, /root, /opt, /var, /srv or project tree. Then ``/proc``, a minimal
``/dev`` (read-only, with a sized ``/dev/shm``), a fresh sized ``/tmp`` and ``/run``
(``SandboxBounds.tmpfs_bytes`` each; the root tmpfs :data:`ROOT_TMPFS_BYTES`), the Python view under
``/prorl`` read-only (:mod:`sandbox.python_view`: the standard library, the allowed distributions only, the
project's ``sandbox`` package; never the server's site-packages), of ``/sys`` only the CPU topology
(:data:`SYS_CPU_DIR`; never ``/sys/fs/cgroup``, which shows every co-tenant sandbox's memory use), the spec's
binds, the run directory at ``/run/prorl`` and the workspace at ``spec.workdir``: the only writable host
paths. Host-side state
(ownership records, other sandboxes' run directories) is never under a writable mount (see
:meth:`sandbox.runtime.SandboxRuntime.start`). With ``writable_tmpfs`` every top-level directory is an overlay
whose changes stay in memory (needs bubblewrap >= 0.9; Debian 12 ships 0.8, where it is refused with a clear
error; those overlays' upper layers cannot be sized).

Processes: bwrap leads its own session and process group; ``--die-with-parent`` kills the sandbox if the server
dies, and the sandbox's pid namespace dies with its init, so closing the group leaves nothing behind.

Started as root, bubblewrap cannot enforce ``max_processes`` in a user namespace (the kernel exempts uid 0),
so by default the sandbox is then set up without a user namespace and the execution server drops to an
unprivileged uid/gid of its own (leased node-wide, see ``run_as``) before anything runs; ``/root`` is not
mounted then.
bwrap cannot run inside bwrap.
"""
from __future__ import annotations

import logging
import os
import platform
import random
import shutil
import struct
import subprocess
from typing import Optional

from .errors import SandboxError, SandboxStartError
from .leases import Lease, ensure_lease_dir, try_lease
from .python_view import VIEW_ROOT, system_site_dirs
from .runtime import LaunchContext, SandboxRuntime, server_binds
from .spec import SandboxSpec

log = logging.getLogger(__name__)

# Top-level entries never taken from the image: the sandbox gets its own.
_SKIP = {"proc", "dev", "tmp", "run", "sys", "lost+found", VIEW_ROOT.strip("/")}
#: The only part of the host's /sys a sandbox without an image sees (read-only): the CPU topology.
SYS_CPU_DIR = "/sys/devices/system/cpu"
#: Size of the tmpfs root (it holds only mount points) and of each tmpfs that masks a path, bytes.
ROOT_TMPFS_BYTES = 1 << 20
MASK_TMPFS_BYTES = 4096
#: Without an image, the only top-level host entries a sandbox sees (read-only; symlinks recreated): the system.
#: No home directories, no /root, /opt, /srv, /var, /mnt or project tree; the Python view (standard library,
#: allowed distributions, the project's ``sandbox`` package) is added under /prorl
#: (:func:`sandbox.runtime.server_binds`), spec binds on top.
HOST_SYSTEM_DIRS = ("bin", "etc", "lib", "lib32", "lib64", "libx32", "sbin", "usr")
#: Paths under the host's /etc masked in a sandbox without an image (an empty file or directory over each that
#: exists): password hashes, host keys, cluster and service credentials, package-index tokens.
ETC_SECRETS = ("shadow", "shadow-", "gshadow", "gshadow-", "ssh", "ssl/private", "sudoers", "sudoers.d",
               "security/opasswd", "munge", "krb5.keytab", "pip.conf", "npmrc", "netrc", "docker",
               "containers/auth.json", "ceph", "slurm/slurmdbd.conf", "mysql/debian.cnf", "ipsec.secrets",
               "ppp/chap-secrets", "ppp/pap-secrets", "NetworkManager/system-connections", "wpa_supplicant",
               "letsencrypt", "pki/private", "libvirt", "cups/ssl")
# Sandbox users of a root server: high uids that belong to nobody on the node, one per sandbox.
DEFAULT_UID_RANGE = (1_900_000_000, 1_000_000)
#: Where root servers lease sandbox uids: a private (0755, root's) directory under /run, where only root can
#: create anything, so no other local user can plant or hold a name (a world-writable /dev/shm directory let
#: a FIFO at every free name fail every sandbox start).
DEFAULT_UID_LEASE_DIR = "/run/prorl-uids"


# Refused calls by audit arch, per host machine: (AUDIT_ARCH_*, mask that clears the x32 bit, ((syscall number,
# errno), ...)): fallocate(2) (EOPNOTSUPP) and io_uring_setup(2) (ENOSYS: io_uring's registered files hold
# files with no descriptor in /proc/PID/fd, so unlinked bytes could hide from the quota's measurement).
_EOPNOTSUPP, _ENOSYS = 95, 38
_REFUSED = {"x86_64": ((0xC000003E, 0xBFFFFFFF, ((285, _EOPNOTSUPP), (425, _ENOSYS))),
                       (0x40000003, None, ((324, _EOPNOTSUPP), (425, _ENOSYS)))),
            "aarch64": ((0xC00000B7, None, ((47, _EOPNOTSUPP), (425, _ENOSYS))),
                        (0x40000028, None, ((352, _EOPNOTSUPP), (425, _ENOSYS))))}


def no_fallocate_filter(machine: Optional[str] = None) -> Optional[bytes]:
    """A seccomp program (classic BPF, ``struct sock_filter`` array as bwrap's ``--seccomp FD`` reads it) that
    makes ``fallocate(2)`` fail with ``EOPNOTSUPP`` and ``io_uring_setup(2)`` with ``ENOSYS`` and allows every
    other call; ``None`` on a machine it does not know (then nothing is filtered). Why: the workspace quota is
    measured (:mod:`sandbox.bounds`), and ``fallocate`` reserved 22x the quota in 2 ms, so between two
    measurements a sandbox could take the whole disk; without it, glibc's ``posix_fallocate`` falls back to
    writing, so a sandbox fills the disk at most at write speed. io_uring's registered files keep unlinked
    files alive where no measurement can see them (programs fall back to plain calls on ``ENOSYS``).
    ``machine``: ``platform.machine()`` by default."""
    table = _REFUSED.get(machine or platform.machine())
    if table is None:
        return None
    ld_abs, jeq, and_k, ret = 0x20, 0x15, 0x54, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_ALU|AND|K, BPF_RET|K
    allow = 0x7FFF0000  # SECCOMP_RET_ALLOW; SECCOMP_RET_ERRNO is 0x00050000 | errno
    prog = [(ld_abs, 0, 0, 4)]  # seccomp_data.arch
    for arch, mask, calls in table:
        size = 2 + (mask is not None) + 2 * len(calls) + 1
        # another arch: on to the next block (the accumulator still holds the arch)
        prog.append((jeq, 0, size - 1, arch))
        prog.append((ld_abs, 0, 0, 0))  # seccomp_data.nr
        if mask is not None:
            prog.append((and_k, 0, 0, mask))
        for nr, err in calls:
            prog += [(jeq, 0, 1, nr), (ret, 0, 0, 0x00050000 | err)]
        prog.append((ret, 0, 0, allow))
    prog.append((ret, 0, 0, allow))
    return b"".join(struct.pack("=HBBI", *ins) for ins in prog)


class BubblewrapRuntime(SandboxRuntime):
    """Options (besides :class:`SandboxRuntime`'s): ``bwrap`` (path of the binary, default from PATH);
    ``run_as`` for a server running as root: ``None`` (default) = one unprivileged uid/gid per sandbox, leased
    node-wide from ``uid_range`` (``(first, count)``) in ``uid_lease_dir`` (a directory of this user's that no
    one else can write, see :func:`sandbox.leases.ensure_lease_dir`), so that ``max_processes`` counts
    each sandbox alone and sandboxes cannot touch each other's files; ``(uid, gid)`` = that user for every
    sandbox (their process counts add up); ``False`` = stay root (no process limit). A given
    ``spec.workspace`` is chowned to the sandbox user. ``host_dirs``: top-level host directories bound
    read-only in addition to :data:`HOST_SYSTEM_DIRS` when a spec has no image (e.g. ``("opt",)``); raises
    ``ValueError`` for a path that is not a top-level name. Every sandbox runs under :func:`no_fallocate_filter`
    (bwrap ``--seccomp``, read from a pipe of its own, never from a file) where the machine is known."""

    kind = "bubblewrap"

    def __init__(self, *, bwrap: Optional[str] = None, run_as=None, uid_range: tuple[int, int] = DEFAULT_UID_RANGE,
                 uid_lease_dir: str = DEFAULT_UID_LEASE_DIR, host_dirs: tuple[str, ...] = (), **options) -> None:
        self.bwrap = bwrap or shutil.which("bwrap")
        if not self.bwrap:
            raise SandboxError("bubblewrap runtime: no `bwrap` on PATH (Debian/Ubuntu: apt-get install bubblewrap)")
        super().__init__(**options)
        self._root = os.geteuid() == 0
        self._overlay = "--overlay-src" in subprocess.run([self.bwrap, "--help"], capture_output=True,
                                                          text=True).stdout
        self._run_as = run_as
        self._uid_range = uid_range
        self._uid_lease_dir = uid_lease_dir
        self._host_dirs = tuple(dict.fromkeys((*HOST_SYSTEM_DIRS, *(d.strip("/") for d in host_dirs))))
        if any(not d or "/" in d or d in _SKIP for d in self._host_dirs):
            raise ValueError(f"host_dirs must be top-level directory names, got {host_dirs!r}")
        # Kept in memory and handed to each bwrap through a pipe of its own: a file in the state directory,
        # reopened at every start, was swapped by a same-uid process for an allow-all program (the next sandbox
        # could fallocate) or a FIFO (every start hung in its open) (red team #36).
        self._seccomp: Optional[bytes] = no_fallocate_filter()
        if self._seccomp is None:
            log.warning("bubblewrap: no seccomp filter for %s; fallocate is not refused in sandboxes",
                        platform.machine())

    def sandbox_uid(self, uid: int) -> bool:
        if super().sandbox_uid(uid):
            return True
        if not self._root or self._run_as is False:
            return False
        if self._run_as is not None:
            return uid == self._run_as[0]
        first, count = self._uid_range
        return first <= uid < first + count

    def sandbox_user(self, spec: SandboxSpec, sandbox_id: str) -> tuple[Optional[tuple[int, int]], Optional[Lease]]:
        if not self._root or spec.fakeroot or self._run_as is False:
            return None, None
        if self._run_as is not None:
            return tuple(self._run_as), None
        try:
            ensure_lease_dir(self._uid_lease_dir, private=True)
        except OSError as e:
            raise SandboxStartError(f"sandbox uid lease directory {self._uid_lease_dir}: {e}") from e
        first, count = self._uid_range
        start = random.randrange(count)
        for i in range(count):
            uid = first + (start + i) % count
            lease = try_lease(self._uid_lease_dir, str(uid), owner=sandbox_id)
            if lease is not None:
                return (uid, uid), lease
        raise SandboxStartError(f"no free sandbox uid in [{first}, {first + count}): every name in the lease "
                                f"directory {self._uid_lease_dir} is held, or is not a regular file of this user")

    def build_command(self, spec: SandboxSpec, ctx: LaunchContext) -> list[str]:
        argv = build_bwrap_command(self.bwrap, spec, ctx, privileged=self._root, overlay=self._overlay,
                                   host_dirs=self._host_dirs)
        fd = self.seccomp_fd()
        if fd is not None:
            ctx.launch_fds.append(fd)
            argv[1:1] = ["--seccomp", str(fd)]
        return argv

    def seccomp_fd(self) -> Optional[int]:
        """A fresh descriptor (close-on-exec; pass it with ``pass_fds``) from which bwrap's ``--seccomp FD``
        reads :func:`no_fallocate_filter`'s program to its end: the read end of a pipe that already holds the
        whole program (a few hundred bytes, well under a pipe's buffer) and whose write end is closed. ``None``
        on a machine without a filter. Raises ``OSError`` if no pipe can be made."""
        if self._seccomp is None:
            return None
        r, w = os.pipe()
        try:
            os.write(w, self._seccomp)
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        return r


def build_bwrap_command(bwrap: str, spec: SandboxSpec, ctx: LaunchContext, *, privileged: bool = False,
                        overlay: bool = False, host_dirs: tuple[str, ...] = HOST_SYSTEM_DIRS) -> list[str]:
    """The complete bwrap argv for ``spec``. ``privileged``: the caller is root (no user namespace when the
    server drops to ``ctx.run_as``). ``overlay``: this bwrap has ``--overlay-src`` (>= 0.9), needed for
    ``writable_tmpfs`` (each top-level directory becomes an in-memory overlay). ``host_dirs``: without an
    image, the top-level host entries bound read-only (default :data:`HOST_SYSTEM_DIRS`; /etc minus
    :data:`ETC_SECRETS`, the system Pythons' package directories masked). Sizes of the writable tmpfs mounts
    come from ``ctx.bounds.tmpfs_bytes`` (``None``: the kernel's default, half the RAM). Raises
    :class:`SandboxError` for an image that is not a directory or ``writable_tmpfs`` without overlay
    support."""
    args = [bwrap]
    if privileged and ctx.run_as:
        args += ["--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try"]
        if spec.network == "none":
            args += ["--unshare-net"]
    else:
        args += ["--unshare-all"]
        if spec.network != "none":
            args += ["--share-net"]
        if spec.fakeroot:
            args += ["--uid", "0", "--gid", "0"]
    args += ["--die-with-parent", "--hostname", "sandbox"]

    root = spec.image or "/"
    if spec.image and not os.path.isdir(spec.image):
        raise SandboxError(f"bubblewrap image must be a rootfs directory, got {spec.image!r}")
    if spec.writable_tmpfs and not overlay:
        raise SandboxError("writable_tmpfs needs bubblewrap >= 0.9 (--overlay-src/--tmp-overlay); this bwrap lacks it")
    args += ["--size", str(ROOT_TMPFS_BYTES), "--tmpfs", "/"]
    provided: set[str] = set()  # top-level entries that come from the image
    names = sorted(os.listdir(root)) if spec.image else [n for n in host_dirs if os.path.lexists("/" + n)]
    for name in names:
        src = os.path.join(root, name)
        if name in _SKIP or (name == "root" and ctx.run_as):
            continue
        provided.add(name)
        if os.path.islink(src):
            args += ["--symlink", os.readlink(src), "/" + name]
        elif os.path.isdir(src) and spec.writable_tmpfs:
            args += ["--overlay-src", src, "--tmp-overlay", "/" + name]
        elif os.path.isdir(src) or os.path.isfile(src):
            args += ["--ro-bind", src, "/" + name]
    if spec.image is None and "etc" in provided and not os.path.islink("/etc"):
        for rel in ETC_SECRETS:
            path = os.path.join("/etc", rel)
            if os.path.islink(path) or not os.path.lexists(path):
                continue  # a link leads into what is bound or masked anyway
            args += (["--size", str(MASK_TMPFS_BYTES), "--tmpfs", path] if os.path.isdir(path)
                     else ["--ro-bind", "/dev/null", path])
    size = ["--size", str(ctx.bounds.tmpfs_bytes)] if ctx.bounds.tmpfs_bytes else []
    # /dev itself is read-only (its tmpfs cannot be sized); /dev/shm gets a sized, world-writable tmpfs.
    args += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", *size, "--tmpfs", "/dev/shm",
             "--remount-ro", "/dev", "--perms", "1777", *size, "--tmpfs", "/tmp", *size, "--tmpfs", "/run"]
    if spec.image is None:
        if "usr" in provided:
            for path in system_site_dirs():  # other Pythons' packages: not part of what the sandbox may import
                args += ["--size", str(MASK_TMPFS_BYTES), "--tmpfs", path, "--remount-ro", path]
    made: set[str] = set()

    def parents(path: str) -> list[str]:
        # bwrap creates missing parents of a mount point 0700, which the unprivileged sandbox user could not
        # traverse: create those that the image does not provide 0755 first.
        out, parts = [], path.strip("/").split("/")
        for i in range(1, len(parts)):
            d = "/" + "/".join(parts[:i])
            if parts[0] not in provided and d not in ("/tmp", "/run") and d not in made:
                made.add(d)
                out += ["--perms", "0755", "--dir", d]
        return out

    if spec.image is None and os.path.isdir(SYS_CPU_DIR):
        # Of /sys only the CPU topology (glibc's get_nprocs, os.cpu_count, BLAS/OpenMP thread counts): the
        # whole of it showed /sys/fs/cgroup, every co-tenant job's memory use among it (red team F5).
        args += parents(SYS_CPU_DIR) + ["--ro-bind", SYS_CPU_DIR, SYS_CPU_DIR]
    for host, container in server_binds(ctx):
        args += parents(container) + ["--ro-bind", host, container]
        if container == VIEW_ROOT:
            provided.add(VIEW_ROOT.strip("/"))  # the view's skeleton holds every mount point below it
    for b in spec.binds:
        args += parents(b.container) + ["--ro-bind" if b.ro else "--bind", b.host, b.container]
    args += parents(ctx.sandbox_run_dir) + ["--bind", ctx.run_dir, ctx.sandbox_run_dir]
    args += parents(ctx.sandbox_workspace) + ["--bind", ctx.workspace, ctx.sandbox_workspace,
                                              "--chdir", ctx.sandbox_workspace, "--"]
    return args + ctx.server_argv()
