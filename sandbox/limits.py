"""Applying :class:`sandbox.spec.Limits` to a process with ``setrlimit`` (man 2 setrlimit)."""
from __future__ import annotations

import resource
from types import MappingProxyType
# `typing` costs ~9 ms to import and this module runs in every sandbox start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Mapping, Optional

_RLIMITS = MappingProxyType({
    "max_processes": resource.RLIMIT_NPROC,
    "max_memory_bytes": resource.RLIMIT_AS,
    "cpu_seconds": resource.RLIMIT_CPU,
    "max_file_bytes": resource.RLIMIT_FSIZE,
    "max_open_files": resource.RLIMIT_NOFILE,
})


def apply_limits(limits: Mapping[str, Optional[int]]) -> None:
    """Set soft and hard limits of the calling process (meant for a ``preexec_fn``). Keys as in
    :class:`sandbox.spec.Limits`; ``None`` values are skipped. A limit above the current hard limit is
    clamped to it. Raises ``ValueError`` for an unknown key."""
    for key, value in limits.items():
        if value is None:
            continue
        if key not in _RLIMITS:
            raise ValueError(f"unknown limit {key!r}")
        which = _RLIMITS[key]
        _soft, hard = resource.getrlimit(which)
        v = int(value)
        if hard != resource.RLIM_INFINITY:
            v = min(v, hard)
        resource.setrlimit(which, (v, v))


def child_setup(limits: Mapping[str, Optional[int]]) -> None:
    """``preexec_fn`` of the shell and the kernel: default signal dispositions, then :func:`apply_limits`.

    Why: Python ignores SIGPIPE, and a server started in the background of a non-interactive shell inherits
    SIGINT ignored; ignored signals survive ``exec``, so without this ``yes | head`` would print EPIPE errors and
    Ctrl-C (the bash timeout) or a kernel interrupt would not stop a command."""
    import signal

    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGPIPE, signal.SIGXFSZ, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    apply_limits(limits)
