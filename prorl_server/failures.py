"""Why a job failed, in a form a trainer can act on (``JobResult.failure_kind``).

The rule: what the model caused is a normal outcome and is trained on
(a wrong answer, a bad tool call, its own command running past its time limit: those are observations or a
low reward); what it did not cause is a failure with a ``failure_kind`` and ``filter: true``, and a trainer
regenerates the sample instead of training on it. The kinds:

``sandbox``
    the sandbox could not start, died, or its execution server stopped answering: every
    :class:`sandbox.errors.SandboxError` that is not a :class:`~sandbox.errors.ToolError`, and a tool of the
    agent loop that gave no answer within ``AgentConfig.tool_timeout_s``.
``llm_backend``
    no LLM backend could serve the job (:class:`~prorl_server.balancer.NoBackendError`,
    :class:`~prorl_server.llm_client.LLMError`).
``harness``
    the handler's harness failed: an agent launcher that could not start, a grader that gave no verdict
    (raise ``InfrastructureError("harness", ...)``).
``agent_missing``
    the agent program of a black-box harness is not there or not executable (``cli_agent``: exit status
    126/127 before the agent asked the model anything).
``timeout``
    the job's counted-time budget (``timeout_s``) ran out.
``cancelled``
    the job was cancelled (``POST /cancel``, ``POST /stop``, shutdown).
``invalid_instance``
    the instance is malformed: a ``ValueError`` raised in ``init`` (where handlers validate their
    instance), :class:`InvalidInstanceError` anywhere, or a prompt that does not fit the model's context
    (:class:`~prorl_server.conversation.ContextLengthError`). The trainer's bug, not the model's.
``handler``
    any other exception of a handler's stage: a handler bug.
``internal``
    a bug of the rollout server itself (a stage worker crashed).

A handler declares a failure that the exception type alone does not tell by raising
:class:`InfrastructureError` (re-exported by :mod:`prorl_server.plugin.handler`), or by setting ``job.failure_kind``
in a stage or in its ``<stage>_exception`` callback.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Optional

FAILURE_KINDS: "MappingProxyType[str, str]" = MappingProxyType({
    "sandbox": "the sandbox could not start, died, or stopped answering",
    "llm_backend": "no LLM backend could serve the job",
    "harness": "the handler's harness (agent launcher, grader) failed",
    "agent_missing": "the agent program is not there or not executable",
    "timeout": "the job's timeout_s ran out",
    "cancelled": "the job was cancelled",
    "invalid_instance": "the instance is malformed (the trainer's bug)",
    "handler": "a handler stage raised an unexpected exception (a handler bug)",
    "internal": "the rollout server itself failed",
})
"""Every ``failure_kind`` the server sets, with a one-line meaning. ``failure_kind`` not null implies
``filter: true``."""


class InfrastructureError(Exception):
    """A stage failure that is not the model's doing, with its :data:`FAILURE_KINDS` kind.

    ``raise InfrastructureError("agent_missing", "bash: my-agent: command not found")`` from a handler
    stage (or from a tool function of the agent loop, which then fails the job instead of showing the model
    an observation) ends the job with ``critical_error=<stage>``, ``failure_kind=kind``, ``filter=true``.

    Raises:
        ValueError: ``kind`` is not one of :data:`FAILURE_KINDS`.
    """

    def __init__(self, kind: str, message: str) -> None:
        if kind not in FAILURE_KINDS:
            raise ValueError(f"unknown failure kind {kind!r}; one of {sorted(FAILURE_KINDS)}")
        super().__init__(message)
        self.kind = kind


class InvalidInstanceError(ValueError):
    """The instance is malformed (a missing or ill-typed field): ``failure_kind="invalid_instance"`` in any
    stage. A plain ``ValueError`` raised in ``init`` is read the same way."""


def classify(exc: BaseException, stage: Optional[str] = None) -> str:
    """The :data:`FAILURE_KINDS` kind of an exception that ended a handler stage.

    Args:
        exc: what the stage raised (an exception group is read through its members: the first that is not
            ``"handler"`` decides).
        stage: ``"init"``, ``"run"`` or ``"eval"``; a ``ValueError`` in ``init`` is ``invalid_instance``.

    Returns:
        the kind; ``"handler"`` when nothing more specific is known. An exception raised ``from`` another
        (``raise RuntimeError(...) from sandbox_error``) takes its cause's kind when that one is specific.
    """
    return _classify(exc, stage, set())


def _classify(exc: BaseException, stage: Optional[str], seen: set[int]) -> str:
    from prorl_server.balancer import NoBackendError
    from prorl_server.conversation import ContextLengthError
    from prorl_server.llm_client import LLMError
    from sandbox.errors import SandboxError, ToolError

    seen.add(id(exc))
    if isinstance(exc, BaseExceptionGroup):
        kinds = (_classify(e, stage, seen) for e in exc.exceptions if id(e) not in seen)
        return next((k for k in kinds if k != "handler"), "handler")
    if isinstance(exc, InfrastructureError):
        return exc.kind
    if isinstance(exc, (InvalidInstanceError, ContextLengthError)):
        return "invalid_instance"
    if isinstance(exc, SandboxError) and not isinstance(exc, ToolError):
        return "sandbox"
    if isinstance(exc, (NoBackendError, LLMError)):
        return "llm_backend"
    cause = exc.__cause__
    if cause is not None and id(cause) not in seen:
        kind = _classify(cause, stage, seen)
        if kind != "handler":
            return kind
    if stage == "init" and isinstance(exc, ValueError):
        return "invalid_instance"
    return "handler"
