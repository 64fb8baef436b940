"""The ``AgentHandler`` plugin interface.

A handler is dispatched on ``instance["data_source"]`` (its ``name`` or one of its ``aliases``). The pipeline
calls ``init``, ``run`` and ``eval`` in that order, each in its own worker pool; an exception in a stage goes
to ``<stage>_exception`` and ends the job with ``critical_error=<stage>``; ``final_result`` builds the
result in every case (success, failure, timeout, cancel).

Failures the model did not cause are never trained on: the pipeline gives a failed job a ``failure_kind``
and ``filter: true`` (:mod:`prorl_server.failures`). The exception's type decides (an infrastructure
``SandboxError`` -> ``sandbox``, a backend error -> ``llm_backend``, a ``ValueError`` in ``init`` or an
:class:`InvalidInstanceError` -> ``invalid_instance``, anything else -> ``handler``); a handler names what the
type does not tell by raising :class:`InfrastructureError` (``raise InfrastructureError("harness", "the
grader printed no verdict")``), or by setting ``job.failure_kind`` (in a stage, which then ends the job, or in
``<stage>_exception`` to override the classification). What the model caused (a wrong answer, a bad tool call,
its own command timing out) is not an exception: it is an observation or a reward.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from prorl_server.failures import FAILURE_KINDS, InfrastructureError, InvalidInstanceError

__all__ = ["AgentHandler", "FAILURE_KINDS", "InfrastructureError", "InvalidInstanceError"]

if TYPE_CHECKING:
    from prorl_server.job import Job
    from prorl_server.types import JobResult


class AgentHandler:
    """Base class for task handlers. Subclass it and override the stages you need.

    Class attributes:
        name: the ``data_source`` this handler serves.
        aliases: other names that dispatch here.
        needs_llm: False if the handler never calls an LLM backend (then ``/process`` works with no backend).
    """

    name: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()
    needs_llm: ClassVar[bool] = True

    async def init(self, job: "Job") -> None:
        """Prepare the job (e.g. start and populate a sandbox)."""

    async def run(self, job: "Job") -> None:
        """Run the agent (LLM calls, tool calls); fill ``job.messages`` and ``job.trajectories``."""

    async def eval(self, job: "Job") -> None:
        """Score the job: set ``job.reward`` (float) and ``job.resolved``."""

    async def init_exception(self, job: "Job", exc: BaseException) -> None:
        """Called when ``init`` raised. The default records nothing extra (the pipeline sets the error and
        ``job.failure_kind`` before the call; set ``job.failure_kind`` here to override it)."""

    async def run_exception(self, job: "Job", exc: BaseException) -> None:
        """Called when ``run`` raised."""

    async def eval_exception(self, job: "Job", exc: BaseException) -> None:
        """Called when ``eval`` raised."""

    async def final_result(self, job: "Job") -> "JobResult":
        """Build the job's result; the default takes the job's fields as they are."""
        return job.build_result()
