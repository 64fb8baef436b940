"""Typed errors of the sandbox layer.

Two families, so that a handler can decide what an agent sees:

- :class:`ToolError` and its subclasses are caused by what the agent asked for (an editor path outside the
  workspace, a ``str_replace`` whose text is not unique, a kernel that the agent's code killed). Their message
  is written to be shown to the agent as the tool's observation: ``except ToolError as e: obs = str(e)``.
- Every other :class:`SandboxError` is an infrastructure fault (the sandbox could not start, died, or stopped
  answering). The job should fail with it, not feed it to the model.

A command that runs past its timeout is *not* an exception: bash and ipython return their partial output
with ``timed_out=True``. :class:`ToolTimeout` is raised only when the execution server itself did not answer
within the timeout plus a grace period.
"""
from __future__ import annotations

# types.MappingProxyType, as the types module defines it, without importing that module (~0.2 ms at every
# sandbox start: the execution server imports this package)
MappingProxyType = type(type.__dict__)


class SandboxError(Exception):
    """Base class of every error raised by the sandbox layer."""


class SandboxStartError(SandboxError):
    """The sandbox process could not be started or did not become ready (message carries its log tail)."""


class SandboxDeadError(SandboxError):
    """The sandbox's processes are gone (killed from outside, crashed, or closed) while or before a call ran.

    ``reason``: why, when the host knows it: ``"memory"`` (the sandbox passed its memory limit),
    ``"disk_quota"`` (its workspace passed its disk quota, or could not be measured within the host's budget,
    or its eviction at the free-space floor freed more than it measured: it hid bytes):
    both are the doing of what ran inside; ``"host_disk"``: see :class:`SandboxEvictedError`; ``None``:
    unknown (killed from outside, crashed, closed)."""

    def __init__(self, *args: object, reason: "str | None" = None) -> None:
        super().__init__(*args)
        self.reason = reason


class SandboxEvictedError(SandboxDeadError):
    """The host ended a sandbox for the node's sake, not for anything it did past its own bounds:
    ``reason="host_disk"`` (the file system holding its workspace fell below the runtime's free-space floor,
    ``min_free_bytes``, it held the most there as measured, and its end freed no more than that, plus a
    slack, so it hid nothing). An infrastructure fault: the
    job should be filtered, not scored. Raised by the host only; the execution server cannot send it (it is
    not in :data:`ERRORS_BY_NAME`)."""

    REASON = "host_disk"


class SandboxClosedError(SandboxDeadError):
    """A call was made on a handle after ``close()``."""


class ProtocolError(SandboxError):
    """The execution server answered something that is not a valid response."""


class ToolTimeout(SandboxError):
    """The execution server gave no answer within the call's timeout plus the grace period."""


class ToolError(SandboxError):
    """A tool refused or failed because of its input; the message is meant for the agent."""


class EditorError(ToolError):
    """``str_replace_editor`` refused a command (bad arguments, missing file, non-unique ``old_str``...)."""


class PathOutsideWorkspaceError(EditorError):
    """An editor path resolves (after ``..`` and symlinks) outside the sandbox workspace."""


class KernelDiedError(ToolError):
    """The IPython kernel died while running a cell; a fresh kernel is started on the next call."""


class FileTransferError(ToolError):
    """An upload or download failed inside the sandbox (missing file, permission, size limit)."""


# Names the execution server may put in an error response, mapped back to classes by the host client: only what
# the server itself raises. Never a class whose meaning only the host can establish (the sandbox could not start,
# died, was closed or evicted; a call ran past the host's deadline): once the model has run code in the sandbox, that code can shape the server's
# answers, and a failure named SandboxStartError is filtered (prorl_server.failures), a way out of every problem
# the policy cannot solve. Such a name reads as a plain SandboxError (scored after the model acted).
ERRORS_BY_NAME: "MappingProxyType[str, type[SandboxError]]" = MappingProxyType({
    cls.__name__: cls
    for cls in (SandboxError, ProtocolError, ToolError, EditorError, PathOutsideWorkspaceError, KernelDiedError,
                FileTransferError)
})
