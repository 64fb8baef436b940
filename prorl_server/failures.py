"""Why a job failed, in a form a trainer can act on (``JobResult.failure_kind``), and who caused it.

The rule is **who acted decides** (docs/reward-integrity.md, I3). The policy is an adversary: a failure it
can cause that is filtered (``filter: true``: regenerated, never trained on) is a way out of every problem it
cannot solve, because a filtered sample never gets a negative advantage. So:

- **Before the model acted** (no turn of the job was generated yet: init, or run before the first turn),
  every failure is outside the model's reach: it gets a kind of :data:`FILTERED_KINDS` and ``filter: true``.
- **After the model acted** (a turn was generated: the run stage after its first turn, and the eval stage
  that grades what the model made), what its actions or its artifact can cause is a **scored** result: reward
  0.0, ``filter: false``, trajectories kept, and a kind of :data:`SCORED_KINDS` saying what happened. Only
  faults that are plainly outside its reach stay filtered: an LLM backend that could not serve
  (``llm_backend``), a sandbox that could not *start* (``sandbox``), a harness or grader that declared its own
  fault (:class:`InfrastructureError`), a malformed instance, a cancel. The host cannot tell a sandbox killed
  from inside (``kill -9 $PPID``, a fork bomb, a full disk) from one killed from outside once the model has run
  code in it, so that death is the model's; a rising ``prorl_jobs_failed_total{failure_kind=...}`` shows an
  infrastructure problem instead.

Filtered kinds (``filter: true``):

``sandbox``
    the sandbox could not start, or died / stopped answering before the model acted: every
    :class:`sandbox.errors.SandboxError` that is not a :class:`~sandbox.errors.ToolError` (after the model acted
    only :class:`~sandbox.errors.SandboxStartError`, and :class:`~sandbox.errors.SandboxEvictedError`: the host
    ended it within its bounds for the node's free disk). The phase decides, not the exception's type: whatever is
    raised while a sandbox is opened or prepared (``job.open_sandbox``, :func:`preparing_sandbox`), in any
    stage and whoever acted before, is a start failure; a sandbox dying from what ran in it is the model's.
``llm_backend``
    no LLM backend could serve the job (:class:`~prorl_server.balancer.NoBackendError`,
    :class:`~prorl_server.llm.client.LLMError`).
``harness``
    the handler's harness failed: an agent launcher that could not start, a grader that gave no verdict
    (raise ``InfrastructureError("harness", ...)``).
``agent_missing``
    the agent program of a black-box harness is not there or not executable (``cli_agent``: exit status
    126/127 before the agent asked the model anything).
``timeout``
    the job's counted-time budget (``timeout_s``) ran out before the model acted.
``cancelled``
    the job was cancelled (``POST /cancel``, ``POST /stop``, shutdown).
``invalid_instance``
    the instance is malformed: a ``ValueError`` raised in ``init`` (where handlers validate their
    instance), :class:`InvalidInstanceError` anywhere, or a prompt that does not fit the model's context
    (:class:`~prorl_server.llm.conversation.ContextLengthError`). The trainer's bug, not the model's.
``handler``
    any other exception of a handler's stage before the model acted: a handler bug.
``internal``
    a bug of the rollout server itself (a stage worker crashed).
``configuration``
    the server's setup cannot run the job and no retry will (the served model's tokenizer cannot be loaded:
    :class:`~prorl_server.llm.context.TokenizerUnavailableError`; the LLM backend refused a request as invalid,
    4xx but 408/429: :class:`~prorl_server.llm.client.LLMRequestError`, e.g. token ids outside its vocabulary
    from a tokenizer that is not the model's, or a context longer than it serves); trainer clients stop on it
    (``trainer_plugins.jobs.ConfigurationError``) instead of regenerating the sample forever.

Scored kinds (``filter: false``, reward 0.0, trajectories kept):

``model_crashed_sandbox``
    the sandbox the model worked in died or its execution server broke (``SandboxDeadError``,
    ``ProtocolError``, a memory or disk bound of the sandbox) after the model acted.
``model_stalled_sandbox``
    a tool of the model's sandbox gave no answer within its limit (``ToolTimeout``) after the model acted.
``model_timeout``
    the job's ``timeout_s`` ran out after the model acted (its own limits are clamped to the job's budget,
    so a stall of its making ends here at the latest).
``model_crashed_grader``
    grading the model's answer or artifact killed or stalled the grading process (a CPU pool worker that
    died scoring it).
``model_error``
    a host-side step raised on what the model produced after it acted: a file it shaped that the host cannot
    read (a directory where a file was expected), a value too large or too deep to encode, any other
    exception of a handler's run or eval stage that is not a declared infrastructure fault.

A handler declares a failure that the exception type alone does not tell by raising
:class:`InfrastructureError` (re-exported by :mod:`prorl_server.plugin.handler`), or by setting ``job.failure_kind``
in a stage or in its ``<stage>_exception`` callback (a scored kind there scores the job 0.0 unfiltered).
"""
from __future__ import annotations

import contextlib
from types import MappingProxyType
from typing import Iterator, Optional

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
    "configuration": "the server's setup cannot run this job (no tokenizer for the served model, a backend that "
                     "refuses its requests as invalid); a trainer stops",
    "model_crashed_sandbox": "the model's sandbox died or broke after the model acted (scored 0.0)",
    "model_stalled_sandbox": "a tool of the model's sandbox stopped answering after the model acted (scored 0.0)",
    "model_timeout": "the job's timeout_s ran out after the model acted (scored 0.0)",
    "model_crashed_grader": "grading the model's answer killed or stalled the grader (scored 0.0)",
    "model_error": "a host-side step raised on what the model produced (scored 0.0)",
})
"""Every ``failure_kind`` the server sets, with a one-line meaning. A kind of :data:`SCORED_KINDS` is a scored
result (``filter: false``, reward 0.0); every other kind implies ``filter: true``."""

SCORED_KINDS: frozenset[str] = frozenset(k for k in FAILURE_KINDS if k.startswith("model_"))
"""Failure kinds the model caused: scored 0.0 and trained on, never filtered (see the module docstring)."""
FILTERED_KINDS: frozenset[str] = frozenset(FAILURE_KINDS) - SCORED_KINDS
"""Failure kinds outside the model's reach: ``filter: true``."""


def is_filtered(failure_kind: Optional[str]) -> bool:
    """Whether a result with this ``failure_kind`` must not be trained on: any kind but a scored one."""
    return failure_kind is not None and failure_kind not in SCORED_KINDS


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


class JobEndedError(RuntimeError):
    """The job is ending (cancelled, timed out, or the server is stopping): it may take no new resource.

    Raised by :meth:`prorl_server.job.Job.backend` and :meth:`~prorl_server.job.Job.open_sandbox` once the
    pipeline has started ending the job, so a stage that still runs at that point (a race with a cancel) cannot
    take a backend slot or a sandbox that nobody would release. Here, below every module that raises or
    catches it (the gateway answers it as 409 ``job_ended``); ``prorl_server.job`` re-exports it."""


class InvalidInstanceError(ValueError):
    """The instance is malformed (a missing or ill-typed field): ``failure_kind="invalid_instance"`` in any
    stage. A plain ``ValueError`` raised in ``init`` is read the same way."""


@contextlib.contextmanager
def preparing_sandbox(what: str = "a sandbox") -> Iterator[None]:
    """Marks a step that opens or prepares a sandbox, or what it needs on the host (its directories, its
    socket): whatever the step raises is a start failure, the system's whoever acted before, so it is
    re-raised as :class:`~sandbox.errors.SandboxStartError` (``failure_kind="sandbox"``, filtered) from the
    original. A full disk, a cgroup the host refuses or an exhausted uid range while eval's sandbox is prepared
    would otherwise read as a host-side step failing on the model's artifact (``model_error``, 0.0 for a right
    answer). :meth:`prorl_server.job.Job.open_sandbox` runs under it. Wrap only steps whose input the model did
    not shape (never applying its patch or loading its file); cancellation and a ``SandboxStartError`` or
    :class:`InfrastructureError` pass unchanged.

    Raises:
        sandbox.errors.SandboxStartError: the step raised any other ``Exception`` (its ``__cause__``).
    """
    from sandbox.errors import SandboxStartError

    try:
        yield
    except (SandboxStartError, InfrastructureError):
        raise
    except Exception as e:
        raise SandboxStartError(f"preparing {what} failed: {type(e).__name__}: {e}") from e


def classify(exc: BaseException, stage: Optional[str] = None, model_acted: bool = False) -> str:
    """The :data:`FAILURE_KINDS` kind of an exception that ended a handler stage.

    Args:
        exc: what the stage raised (an exception group is read through its members: the first that is not
            ``"handler"`` decides).
        stage: ``"init"``, ``"run"`` or ``"eval"``; a ``ValueError`` in ``init`` is ``invalid_instance``.
        model_acted: a turn of the job was generated before the exception (``Job.model_acted``): then, in the
            run and eval stages, what the model can cause is one of :data:`SCORED_KINDS` (module docstring).

    Returns:
        the kind; ``"handler"`` (``"model_error"`` after the model acted) when nothing more specific is
        known. An exception raised ``from`` another (``raise RuntimeError(...) from sandbox_error``) takes its
        cause's kind when that one is specific.
    """
    kind = _classify(exc, stage, set())
    if not model_acted or stage == "init" or isinstance(exc, InfrastructureError):
        return kind  # a fault the handler declared stays its kind
    if kind == "handler":
        return "model_error"
    if kind == "sandbox" and not _any_start_error(exc, set()):
        return "model_stalled_sandbox" if _any_timeout(exc, set()) else "model_crashed_sandbox"
    return kind


def _walk(exc: BaseException, seen: set[int]):
    """``exc``, its causes and the members of exception groups, each once."""
    if id(exc) in seen:
        return
    seen.add(id(exc))
    yield exc
    if isinstance(exc, BaseExceptionGroup):
        for e in exc.exceptions:
            yield from _walk(e, seen)
    if exc.__cause__ is not None:
        yield from _walk(exc.__cause__, seen)


def _any_start_error(exc: BaseException, seen: set[int]) -> bool:
    """Whether a sandbox fault in ``exc`` is the system's whoever acted before: the sandbox could not be
    started or prepared, or the host evicted it within its bounds for the node's sake (the free-space floor:
    :class:`~sandbox.errors.SandboxEvictedError`, which only the host raises)."""
    from sandbox.errors import SandboxEvictedError, SandboxStartError

    return any(isinstance(e, (SandboxStartError, SandboxEvictedError)) for e in _walk(exc, seen))


def _any_timeout(exc: BaseException, seen: set[int]) -> bool:
    from sandbox.errors import ToolTimeout

    return any(isinstance(e, ToolTimeout) for e in _walk(exc, seen))


def _classify(exc: BaseException, stage: Optional[str], seen: set[int]) -> str:
    from prorl_server.balancer import NoBackendError
    from prorl_server.llm.conversation import ContextLengthError
    from prorl_server.llm.client import LLMError
    from sandbox.errors import SandboxError, ToolError

    seen.add(id(exc))
    if isinstance(exc, BaseExceptionGroup):
        kinds = (_classify(e, stage, seen) for e in exc.exceptions if id(e) not in seen)
        return next((k for k in kinds if k != "handler"), "handler")
    if isinstance(exc, InfrastructureError):
        return exc.kind
    from prorl_server.llm.context import TokenizerUnavailableError

    if isinstance(exc, TokenizerUnavailableError):
        return "configuration"
    from prorl_server.llm.client import LLMRequestError

    # The turn engine sends only token ids it holds and never more than the context has room for, so a backend
    # that refuses the request as invalid disagrees with this server's tokenizer or context length: a setup
    # fault no retry fixes (408/429 are the backend's load, not the request).
    if isinstance(exc, LLMRequestError) and exc.status not in (408, 429):
        return "configuration"
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
