"""The ``AgentHandler`` plugin interface.

A handler is dispatched on ``instance["data_source"]`` (its ``name`` or one of its ``aliases``). The pipeline
calls ``init``, ``run`` and ``eval`` in that order, each in its own worker pool; an exception in a stage goes
to ``<stage>_exception`` and ends the job with ``critical_error=<stage>``; ``final_result`` builds the
result in every case (success, failure, timeout, cancel).

Before a job exists, :meth:`AgentHandler.prepare_instance` completes an instance given only by id (from the
handler's :meth:`~AgentHandler.instance_by_id`) and validates it against the handler's ``instance_model``: a
malformed instance is refused at submit (HTTP 422 naming ``instance.<field>``), never run.

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

from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional

from pydantic import BaseModel, ValidationError

from prorl_server.failures import FAILURE_KINDS, InfrastructureError, InvalidInstanceError

__all__ = ["AgentHandler", "FAILURE_KINDS", "HandlerSettingsError", "InfrastructureError",
           "InstanceValidationError", "InvalidInstanceError", "NotRegradableError", "error_location"]

if TYPE_CHECKING:
    from prorl_server.job import Job
    from prorl_server.types import JobResult


class InstanceValidationError(ValueError):
    """A submitted instance does not fit its handler's ``instance_model`` (or names an unknown shipped
    problem): the request is refused with HTTP 422. ``field`` is the dotted path of the first bad field
    (``"instance.prompt"``, ``"instance.files.a.txt"``; ``"instance"`` for a whole-instance rule). An
    ``instance_model`` validator may raise it to name the field a cross-field rule is about."""

    def __init__(self, message: str, field: str = "instance") -> None:
        super().__init__(message)
        self.field = field


class HandlerSettingsError(ValueError):
    """The server settings' ``handlers`` section names an unknown handler, a key its ``settings_model`` does
    not have, or a bad value (raised at startup)."""


class NotRegradableError(RuntimeError):
    """A recorded result cannot be graded again (:meth:`AgentHandler.restore_for_eval`): what the handler's eval
    reads was never recorded (it lived in the run stage's sandbox or handler state). The message says what is
    missing; a re-grading tool refuses the job instead of guessing a reward."""


def error_location(err: dict[str, Any], prefix: str) -> str:
    """``prefix`` joined with a pydantic error's ``loc`` (``("files", "a")`` -> ``"instance.files.a"``)."""
    return ".".join([prefix, *(str(p) for p in err.get("loc", ()))])


class AgentHandler:
    """Base class for task handlers. Subclass it and override the stages you need.

    Class attributes:
        name: the ``data_source`` this handler serves.
        aliases: other names that dispatch here.
        needs_llm: False if the handler never calls an LLM backend (then ``/process`` works with no backend).
        needs_sandbox: True if the handler opens sandboxes (``job.open_sandbox``): a server without a sandbox
            runtime then refuses its jobs at submit (HTTP 400 ``handler_unavailable``), a configuration fault
            a trainer stops on, instead of failing each one in init.
        instance_model: a pydantic model of the instance, validated at submit (None: any dict with a
            ``data_source`` is accepted, and checking it is the handler's). Unknown keys should be allowed
            (trainers add their own bookkeeping): they are kept in ``job.instance`` either way.
        settings_model: a pydantic model of the handler's server-side settings, filled from the settings
            file's ``handlers: {<name>: {...}}`` section (None: the handler takes no settings). Give it
            ``extra="forbid"``; the registry refuses unknown keys in any case.
        state_model: what the handler carries from one stage of a job to the next (``job.state``): a class
            called with no argument when the job is created, typically a dataclass whose fields all have
            defaults (``job.state.sandbox``, ``job.state.solution``), so a typo is an AttributeError and a type
            checker sees the fields (``Job[MyState]``). The default, ``dict``, keeps handlers written for the
            string-keyed ``job.state["..."]`` working.
        reward_terms: the process reward terms the handler may report beside ``outcome`` (issue #35 part 2;
            :mod:`prorl_server.rewards`): its eval calls :func:`~prorl_server.rewards.compose_reward` with the
            outcome and these terms, each weighted by the request's ``reward_weights`` (0 when not named there, so
            the reward is the outcome unless a request opts in). A request weighting another name is refused
            (422 on ``reward_weights``); a component not declared here, non-finite, or whose weighted sum is not
            the reward fails the job as a handler fault. A handler that sets only ``job.reward`` gets one
            ``outcome`` component of weight 1.
    """

    name: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()
    needs_llm: ClassVar[bool] = True
    needs_sandbox: ClassVar[bool] = False
    instance_model: ClassVar[Optional[type[BaseModel]]] = None
    settings_model: ClassVar[Optional[type[BaseModel]]] = None
    state_model: ClassVar[Callable[[], Any]] = dict
    reward_terms: ClassVar[tuple[str, ...]] = ()

    # ------------------------------------------------------------------ settings and instances
    @property
    def settings(self) -> Any:
        """This handler's settings: an instance of ``settings_model`` (its defaults until the registry
        hands it the settings file's section), or None for a handler without a ``settings_model``."""
        value = self.__dict__.get("_settings")
        if value is None and self.settings_model is not None:
            value = self.__dict__["_settings"] = self.settings_model()
        return value

    @settings.setter
    def settings(self, value: Any) -> None:
        self.__dict__["_settings"] = value

    def instance_by_id(self, instance_id: str) -> Optional[dict[str, Any]]:
        """The shipped dataset's instance with id ``instance_id``, or None when there is none. Override it
        to let requests name a problem only by id (``{"data_source": "code", "instance_id": "HumanEval/0"}``);
        it runs on the event loop at submit, so it must be fast (cache what it loads)."""
        return None

    def prepare_instance(self, instance: dict[str, Any]) -> dict[str, Any]:
        """The instance a job of this handler runs: ``instance`` completed from :meth:`instance_by_id` when
        it names a problem by ``instance_id`` and gives none of ``instance_model``'s required fields (the
        request's own keys win), then validated against ``instance_model``: the fields it gives, as validated
        (coerced), over the request's keys; unknown keys are kept and defaults are not filled in (the handler
        applies its own, so a field's absence still says the request did not set it).

        Raises:
            InstanceValidationError: the instance does not fit ``instance_model``, or its id names no
                shipped problem.
        """
        model = self.instance_model
        if model is None:
            return instance
        iid = instance.get("instance_id")
        required = [n for n, f in model.model_fields.items() if f.is_required()]
        if (isinstance(iid, str) and required and not any(k in instance for k in required)
                and type(self).instance_by_id is not AgentHandler.instance_by_id):
            shipped = self.instance_by_id(iid)
            if shipped is None:
                raise InstanceValidationError(
                    f"instance.instance_id: {iid!r} is no problem of the {self.name} handler's shipped dataset "
                    f"(give the problem inline: {', '.join(required)})", "instance.instance_id")
            instance = {**shipped, **instance}
        try:
            validated = model.model_validate(instance, context={"handler": self})
        except ValidationError as e:
            err = e.errors(include_url=False)[0]
            cause = (err.get("ctx") or {}).get("error")
            if isinstance(cause, InstanceValidationError):  # a model validator that names its field
                raise InstanceValidationError(f"{cause.field}: {cause}", cause.field) from None
            field = error_location(err, "instance")
            message = str(cause) if isinstance(cause, ValueError) else err["msg"]  # no "Value error, " prefix
            raise InstanceValidationError(f"{field}: {message}", field) from None
        return {**instance, **validated.model_dump(exclude_unset=True)}

    # ------------------------------------------------------------------ stages
    async def init(self, job: "Job") -> None:
        """Prepare the job (e.g. start and populate a sandbox)."""

    async def run(self, job: "Job") -> None:
        """Run the agent (LLM calls, tool calls); fill ``job.messages`` and ``job.trajectories``."""

    async def eval(self, job: "Job") -> None:
        """Score the job: set ``job.reward`` (float) and ``job.resolved``, or, with process terms,
        ``job.resolved`` and :func:`prorl_server.rewards.compose_reward` (which sets ``job.reward`` to the
        weighted sum of ``outcome`` and the terms)."""

    async def init_exception(self, job: "Job", exc: BaseException) -> None:
        """Called when ``init`` raised. The default records nothing extra (the pipeline sets the error and
        ``job.failure_kind`` before the call; set ``job.failure_kind`` here to override it)."""

    async def run_exception(self, job: "Job", exc: BaseException) -> None:
        """Called when ``run`` raised."""

    async def eval_exception(self, job: "Job", exc: BaseException) -> None:
        """Called when ``eval`` raised."""

    def new_state(self) -> Any:
        """A fresh ``job.state`` for a new job (``state_model()``)."""
        return self.state_model()

    def restore_for_eval(self, job: "Job", result: "JobResult") -> None:
        """Rebuild, from a finished job's recorded ``result``, what :meth:`eval` reads that the pipeline does
        not restore itself, so the current ``eval`` can grade it again with no LLM backend and no run stage
        (``prorl-journal regrade``). The caller has already set ``job.instance`` (from the recorded request),
        ``job.messages``, ``job.trajectories``, ``job.token_stats`` and ``job.extra`` (without ``"eval"``) from
        ``result``; a handler whose eval reads ``job.state`` fills it here.

        The default refuses: a handler is re-gradable only when it says how (its eval may read state that
        only its run stage's sandbox held).

        Raises:
            NotRegradableError: ``result`` lacks what eval needs (the message names it).
        """
        raise NotRegradableError(f"the {self.name or type(self).__name__} handler does not say how to re-grade a "
                                 "recorded result (AgentHandler.restore_for_eval)")

    async def final_result(self, job: "Job") -> "JobResult":
        """Build the job's result; the default takes the job's fields as they are."""
        return job.build_result()
