"""Sandbox runtimes by name: the one place that knows every implementation of :class:`SandboxRuntime`.

``RUNTIMES`` maps a runtime's name to its class, ``ALIASES`` other accepted names to those; the server's
``sandbox_runtime`` setting and ``prorl-run --sandbox-runtime`` go through :func:`make_runtime`.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any

from .bubblewrap import BubblewrapRuntime
from .local import LocalRuntime
from .runtime import SandboxRuntime
from .singularity import SingularityRuntime

#: name → runtime class: ``bubblewrap`` (what CI exercises), ``singularity`` (Apptainer/SingularityCE images on
#: clusters), ``local`` (no isolation, development only).
RUNTIMES: MappingProxyType[str, type[SandboxRuntime]] = MappingProxyType({
    "bubblewrap": BubblewrapRuntime,
    "singularity": SingularityRuntime,
    "local": LocalRuntime,
})
#: other accepted names → a key of :data:`RUNTIMES`.
ALIASES = MappingProxyType({"bwrap": "bubblewrap", "apptainer": "singularity"})


def make_runtime(kind: str, **options: Any) -> SandboxRuntime:
    """Runtime by name (case-insensitive): a key of :data:`RUNTIMES` or :data:`ALIASES`. ``options`` go to the
    runtime's constructor (see :class:`SandboxRuntime` and each runtime). Raises ``ValueError`` for an unknown
    kind, :class:`~sandbox.errors.SandboxError` if the runtime's binary is missing."""
    k = kind.lower()
    cls = RUNTIMES.get(ALIASES.get(k, k))
    if cls is None:
        raise ValueError(f"unknown sandbox runtime {kind!r}; choose {', '.join(RUNTIMES)}")
    return cls(**options)
