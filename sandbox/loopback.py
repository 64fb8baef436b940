"""Node-wide allocator of loopback addresses (127.x.y.z), one per sandbox.

Unique across processes and users on one node: a lease is an exclusive ``flock`` on the file
``<lease_dir>/<address>`` in one node-wide directory (default ``/dev/shm/prorl-loopback``, mode 1777 like
``/tmp``, so that every user can create leases and nobody can delete another's). ``flock`` locks belong to the
open file description, so a lease ends by itself when every holder is gone: the allocator hands the lease's fd
to the sandbox's launcher (``pass_fds``), hence the address stays taken while the sandbox lives, even if the
server that started it crashed, and is free again once both are gone (no record to clean up).
Lock files are unlinked on release; the inode check after locking makes that race-free (a process that locked
an unlinked file sees the mismatch and retries).
"""
from __future__ import annotations

import errno
import fcntl
import ipaddress
import json
import os
import random
from typing import Optional

from .errors import SandboxError

DEFAULT_LEASE_DIR = "/dev/shm/prorl-loopback"
# 127.0.0.0/16 is left to the ordinary uses of localhost (127.0.0.1, 127.0.1.1 for the hostname).
DEFAULT_NETWORK = "127.128.0.0/9"


class LoopbackLease:
    """A held address. ``fd`` is the locked file (inheritable by the launcher). ``release()`` is idempotent."""

    def __init__(self, address: str, fd: int, path: str) -> None:
        self.address = address
        self.fd = fd
        self.path = path

    @property
    def held(self) -> bool:
        return self.fd >= 0

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            if os.fstat(self.fd).st_ino == os.stat(self.path).st_ino:
                os.unlink(self.path)
        except OSError:
            pass  # another user's file in a sticky dir, or already gone: the unlock below is what matters
        os.close(self.fd)
        self.fd = -1


class LoopbackAllocator:
    """``allocate(owner)`` → :class:`LoopbackLease`. ``lease_dir`` must be node-local and shared by all users
    (tmpfs); ``network`` is the pool (an IPv4 network inside 127.0.0.0/8); the first and last address of the
    pool and every x.y.z.0 / x.y.z.255 are skipped."""

    def __init__(self, lease_dir: str = DEFAULT_LEASE_DIR, network: str = DEFAULT_NETWORK) -> None:
        net = ipaddress.ip_network(network)
        if not net.subnet_of(ipaddress.ip_network("127.0.0.0/8")):
            raise ValueError(f"{network} is not inside 127.0.0.0/8")
        self.lease_dir = lease_dir
        self.network = net
        self._ensure_dir()

    def _ensure_dir(self) -> None:
        try:
            os.mkdir(self.lease_dir, 0o1777)
            os.chmod(self.lease_dir, 0o1777)  # mkdir's mode is filtered by the umask
        except FileExistsError:
            pass

    def _candidates(self, attempts: int):
        size = self.network.num_addresses
        base = int(self.network.network_address)
        start = random.randrange(size)  # spread concurrent allocators over the pool
        for i in range(min(size, attempts)):
            addr = ipaddress.ip_address(base + (start + i) % size)
            last = int(addr) & 0xFF
            if addr in (self.network.network_address, self.network.broadcast_address) or last in (0, 255):
                continue
            yield str(addr)

    def allocate(self, owner: str = "", attempts: int = 4096) -> LoopbackLease:
        """Lease a free address. Raises :class:`SandboxError` if none of ``attempts`` candidates is free."""
        for addr in self._candidates(attempts):
            lease = self._try(addr, owner)
            if lease is not None:
                return lease
        raise SandboxError(f"no free loopback address in {self.network} after {attempts} tries "
                           f"(lease dir {self.lease_dir})")

    def _try(self, addr: str, owner: str) -> Optional[LoopbackLease]:
        path = os.path.join(self.lease_dir, addr)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            writable = True
        except PermissionError:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)  # another user's lease file: lock it read-only
            except OSError:
                return None
            writable = False
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EISDIR):
                return None
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            if os.fstat(fd).st_ino != os.stat(path).st_ino:
                raise FileNotFoundError
        except FileNotFoundError:
            os.close(fd)  # the previous holder unlinked this inode while we opened it: not a lease
            return None
        if writable:
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps({"pid": os.getpid(), "uid": os.getuid(), "owner": owner}).encode())
        return LoopbackLease(addr, fd, path)
