"""Node-wide allocator of loopback addresses (127.x.y.z), one per sandbox that asks for ``network="loopback"``.

Unique across processes and users on one node, released on close, reclaimed after a crash: each address is
a :mod:`sandbox.leases` lease in one node-wide directory (default ``/dev/shm/prorl-loopback``).
"""
from __future__ import annotations

import ipaddress
import random

from .errors import SandboxStartError
from .leases import Lease, ensure_lease_dir, try_lease

DEFAULT_LEASE_DIR = "/dev/shm/prorl-loopback"
# 127.0.0.0/16 is left to the ordinary uses of localhost (127.0.0.1, 127.0.1.1 for the hostname).
DEFAULT_NETWORK = "127.128.0.0/9"


class LoopbackLease(Lease):
    """A held address; ``address`` is the dotted quad."""

    @property
    def address(self) -> str:
        return self.name


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
        ensure_lease_dir(lease_dir)

    def _candidates(self, attempts: int):
        size = self.network.num_addresses
        base = int(self.network.network_address)
        start = random.randrange(size)  # spread concurrent allocators over the pool
        for i in range(min(size, attempts)):
            addr = ipaddress.ip_address(base + (start + i) % size)
            if addr in (self.network.network_address, self.network.broadcast_address) or int(addr) & 0xFF in (0, 255):
                continue
            yield str(addr)

    def allocate(self, owner: str = "", attempts: int = 4096) -> LoopbackLease:
        """Lease a free address. Raises :class:`SandboxStartError` if none of ``attempts`` candidates is free
        (held, or a name another user planted: see :mod:`sandbox.leases`)."""
        for addr in self._candidates(attempts):
            lease = try_lease(self.lease_dir, addr, owner)
            if lease is not None:
                return LoopbackLease(lease.name, lease.fd, lease.path)
        raise SandboxStartError(f"no free loopback address in {self.network} after {attempts} tries "
                           f"(lease dir {self.lease_dir})")
