"""Rootless sandboxes and their tools.

Runtimes (:func:`make_runtime`, by name from :data:`sandbox.factory.RUNTIMES`): ``bubblewrap`` (what CI
exercises), ``singularity`` / ``apptainer`` (HPC clusters), ``local`` (no isolation, development only). A
runtime starts a sandbox from a :class:`SandboxSpec` and returns a :class:`SandboxHandle` with the tools
``bash``, ``ipython``, ``editor``, ``upload``, ``download`` and ``close``; they are served by
:mod:`sandbox.exec_server` inside the sandbox over a Unix socket. Errors are in :mod:`sandbox.errors`.

Names are loaded lazily: the execution server imports this package inside every sandbox and must not pay for
asyncio or psutil at start.
"""
from __future__ import annotations

# types.MappingProxyType, as the types module defines it, without importing that module (~0.2 ms at every
# sandbox start: the execution server imports this package)
MappingProxyType = type(type.__dict__)

# `typing` costs ~9 ms to import and this module runs in every sandbox start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

_EXPORTS = MappingProxyType({
    "make_runtime": "factory", "RUNTIMES": "factory", "SandboxRuntime": "runtime", "SandboxHandle": "runtime",
    "SandboxSpec": "spec", "Bind": "spec", "Limits": "spec", "BashResult": "spec", "IPythonResult": "spec",
    "EditorResult": "spec",
    "BubblewrapRuntime": "bubblewrap", "SingularityRuntime": "singularity", "LocalRuntime": "local",
    "LoopbackAllocator": "loopback",
    "SandboxError": "errors", "SandboxStartError": "errors", "SandboxDeadError": "errors",
    "SandboxEvictedError": "errors", "SandboxClosedError": "errors", "ProtocolError": "errors", "ToolTimeout": "errors", "ToolError": "errors",
    "EditorError": "errors", "PathOutsideWorkspaceError": "errors", "KernelDiedError": "errors",
    "FileTransferError": "errors",
})
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'sandbox' has no attribute {name!r}")
