"""Re-grading: a finished job's recorded trajectory graded again by the current handler code, with no LLM backend.

Per journalled job (:mod:`prorl_server.journal.store`: the ``ProcessRequest`` JSON and the ``JobResult`` JSON),
:meth:`Regrader.regrade` rebuilds the :class:`~prorl_server.job.Job` the eval stage saw: the instance
(``handler.prepare_instance`` of the recorded request's, as at submit), the messages, trajectories, token stats
and ``extra`` of the result (``extra["eval"]`` dropped: it is eval's own output), then asks the handler for the
rest (:meth:`~prorl_server.plugin.handler.AgentHandler.restore_for_eval`: the state its eval reads, e.g. the
math handler's final answer, the code handler's solution file). Then the handler's ``eval`` and ``final_result``
run as the pipeline runs them (:meth:`prorl_server.pipeline.Pipeline._run_stage` and ``_finish``, eval part): an
eval exception goes to ``eval_exception`` and gives ``critical_error="eval"`` with its ``failure_kind``; a scored
kind (``model_*``) is 0.0; ``final_result`` builds the result. Sandboxes eval opens (the code handler's grading)
come from the same opener the server uses (:func:`prorl_server.app.sandbox_opener` on
:func:`sandbox.make_runtime`), started lazily; scoring that a handler sends to ``job.run_cpu`` runs in a
:class:`~prorl_server.cpu_pool.CpuPool` of this process.

What is not re-graded (the outcome's ``status`` says which and why):

- ``skipped``: the job never reached eval (``critical_error`` init, run, timeout or cancelled): there is no
  graded trajectory;
- ``not_regradable``: the handler cannot rebuild what its eval reads from the record (the swe and cli_agent
  handlers grade what only the run sandbox held; a code result recorded before the handler kept its solution);
  no reward is guessed;
- ``eval_failed``: the new eval ended in a failure outside the model's reach (a filtered ``failure_kind``:
  a sandbox that would not start here, a grader fault, no sandbox runtime): not a reward;
- ``error``: the record is unreadable, or its handler is unknown to this code.

The job-level ``timeout_s`` is not applied again (the handlers' own grading limits are); ``timeout_s`` of
:class:`Regrader` bounds one job's eval instead.
"""
from __future__ import annotations

import asyncio
import copy
import json
import traceback
from dataclasses import dataclass, field
from typing import Any, Optional

from prorl_server.completion_time import with_speed
from prorl_server.failures import SCORED_KINDS, classify, is_filtered
from prorl_server.job import Job, JobServices
from prorl_server.pipeline import handler_result
from prorl_server.plugin.handler import AgentHandler, NotRegradableError
from prorl_server.plugin.registry import HandlerRegistry, UnknownHandlerError
from prorl_server.types import JobResult, JobState

#: Critical errors after which eval ran (None: it ran and returned; "eval": it raised or declared a failure).
GRADED = (None, "eval")
#: Seconds one job's eval may take here by default (the handlers' own grading limits end theirs sooner).
DEFAULT_TIMEOUT_S = 600.0


class NoSandboxRuntimeError(RuntimeError):
    """Eval opened a sandbox and this re-grading has no sandbox runtime (``--sandbox-runtime none``, or ``auto``
    where bubblewrap is not installed)."""


@dataclass
class RegradeOutcome:
    """One job's re-grading. ``status``: ``regraded``, ``skipped``, ``not_regradable``, ``eval_failed`` or
    ``error`` (see the module docstring); ``new_*`` are None unless eval ran; ``changed``: the reward or
    ``resolved`` differ (None unless ``regraded``); ``result``: the new result (None unless eval ran)."""

    job_id: str
    handler: Optional[str]
    status: str
    old_reward: Optional[float] = None
    old_resolved: Optional[bool] = None
    old_failure_kind: Optional[str] = None
    new_reward: Optional[float] = None
    new_resolved: Optional[bool] = None
    failure_kind: Optional[str] = None
    changed: Optional[bool] = None
    reason: Optional[str] = None
    result: Optional[JobResult] = field(default=None, repr=False)
    old_components: Optional[dict[str, Any]] = field(default=None, repr=False)

    def row(self) -> dict[str, Any]:
        """The JSON line ``prorl-journal regrade`` writes: every field but ``result``, plus, once eval ran, the new
        result's ``critical_error`` and ``filter`` and its ``extra["eval"]`` (what the grader said) when there is
        one, and the old and new ``reward_components`` (#35 part 2: equal when the grader reproduces them)."""
        out = {k: getattr(self, k) for k in ("job_id", "handler", "status", "old_reward", "new_reward", "changed",
                                              "old_resolved", "new_resolved", "old_failure_kind", "failure_kind",
                                              "reason")}
        if self.result is not None:
            out["critical_error"], out["filter"] = self.result.critical_error, self.result.filter
            if "eval" in self.result.extra:
                out["eval"] = self.result.extra["eval"]
            out["old_reward_components"] = self.old_components
            out["new_reward_components"] = _components(self.result)
        return out


class Regrader:
    """Re-grades recorded jobs with the handlers of ``registry`` (see the module docstring).

    Args:
        registry: the handlers (the current code; ``HandlerRegistry().load_entry_points()`` for the shipped ones).
        sandbox_runtime: the ``sandbox_runtime`` setting's values: ``"auto"`` (bubblewrap where ``bwrap`` is on
            PATH), ``"bubblewrap"``, another :func:`sandbox.make_runtime` name, or ``"none"``; the runtime is
            made on the first sandbox an eval opens.
        sandbox_image: the ``sandbox_image`` setting (a spec naming no image gets it).
        sandbox_options: the ``sandbox_options`` setting (the runtime's constructor options).
        cpu_workers: processes of the CPU pool scoring runs in (started on first use).
        timeout_s: seconds one job's eval may take (then ``eval_failed``).

    Use as ``async with Regrader(...) as r: outcome = await r.regrade(...)``: leaving closes the CPU pool and
    every sandbox started.
    """

    def __init__(self, registry: HandlerRegistry, *, sandbox_runtime: Optional[str] = "auto",
                 sandbox_image: Optional[str] = None, sandbox_options: Optional[dict[str, Any]] = None,
                 cpu_workers: int = 1, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        from prorl_server.cpu_pool import CpuPool

        self.registry = registry
        self.sandbox_runtime = sandbox_runtime
        self.sandbox_image = sandbox_image
        self.sandbox_options = dict(sandbox_options or {})
        self.timeout_s = timeout_s
        self.cpu_pool = CpuPool(max(1, cpu_workers))
        self._runtime: Any = None
        self._runtime_lock: Optional[asyncio.Lock] = None
        self.services = JobServices(sandbox_opener=self._open_sandbox, cpu_pool=self.cpu_pool)

    async def __aenter__(self) -> "Regrader":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every sandbox started and the CPU pool."""
        try:
            if self._runtime is not None:
                await self._runtime.close_all()
        finally:
            await self.cpu_pool.close()

    async def _open_sandbox(self, spec: Any = None, **kw: Any) -> Any:
        from prorl_server.app import resolve_sandbox_runtime, sandbox_opener

        if self._runtime is None:
            if self._runtime_lock is None:
                self._runtime_lock = asyncio.Lock()
            async with self._runtime_lock:
                if self._runtime is None:
                    kind = resolve_sandbox_runtime(self.sandbox_runtime)
                    if kind is None:
                        raise NoSandboxRuntimeError(
                            f"this job's eval opens a sandbox and there is no sandbox runtime (--sandbox-runtime "
                            f"{self.sandbox_runtime}; auto means bubblewrap where bwrap is installed)")
                    from sandbox import make_runtime

                    self._runtime = make_runtime(kind, **self.sandbox_options)
        return await sandbox_opener(self._runtime, self.sandbox_image)(spec, **kw)

    def handler_of(self, handler_name: Optional[str], request: dict[str, Any]) -> tuple[str, AgentHandler]:
        """``(name, handler)`` of a recorded job: its journalled handler name, else its instance's
        ``data_source``. Raises :class:`~prorl_server.plugin.registry.UnknownHandlerError`."""
        name = handler_name or (request.get("instance") or {}).get("data_source")
        if not isinstance(name, str):
            raise UnknownHandlerError(str(name), self.registry.names())
        return self.registry.resolve(name)

    async def regrade(self, job_id: str, handler_name: Optional[str], request_json: Optional[bytes],
                      result_json: Optional[bytes]) -> RegradeOutcome:
        """Grade one journalled job again (a row of :meth:`prorl_server.journal.store.Journal.iter_jobs`). Never
        raises for a bad record: the outcome's ``status`` and ``reason`` say what happened."""
        try:
            request = json.loads(request_json or b"null")
            old = JobResult.model_validate_json(result_json or b"null")
            if not isinstance(request, dict) or not isinstance(request.get("instance"), dict):
                raise ValueError("the recorded request has no instance")
        except ValueError as e:
            return RegradeOutcome(job_id, handler_name, "error", reason=f"unreadable record: {e}")
        out = RegradeOutcome(job_id, handler_name or old.handler, "error", old_reward=old.reward,
                             old_resolved=old.resolved, old_failure_kind=old.failure_kind)
        try:
            out.handler, handler = self.handler_of(handler_name or old.handler, request)
        except UnknownHandlerError as e:
            out.reason = str(e)
            return out
        if old.critical_error not in GRADED:
            out.status, out.reason = "skipped", f"eval never ran (critical_error={old.critical_error})"
            return out
        try:
            instance = handler.prepare_instance(dict(request["instance"]))
            job = self._job(old, request, instance, handler, out.handler)
            handler.restore_for_eval(job, old)
        except NotRegradableError as e:
            out.status, out.reason = "not_regradable", str(e)
            return out
        except Exception as e:  # the current handler refuses the recorded instance, or the record is malformed
            out.reason = f"{type(e).__name__}: {e}"
            return out
        try:
            new = await self._eval(job, handler, old)
        except NoSandboxRuntimeError as e:
            out.status, out.reason = "eval_failed", str(e)
            await job.close_resources()
            return out
        out.result, out.new_reward, out.new_resolved, out.failure_kind = new, new.reward, new.resolved, \
            new.failure_kind
        if is_filtered(new.failure_kind):
            out.status, out.reason = "eval_failed", new.error or f"failure_kind {new.failure_kind}"
        else:
            out.status = "regraded"
            out.old_components = _components(old)
            # a result recorded before components existed (none recorded) is compared on its reward alone
            out.changed = (new.reward != old.reward or new.resolved != old.resolved
                           or bool(old.reward_components) and _components(new) != out.old_components)
        return out

    def _job(self, old: JobResult, request: dict[str, Any], instance: dict[str, Any], handler: AgentHandler,
             name: str) -> Job:
        job = Job(job_id=old.job_id, instance=instance, sampling_params=dict(request.get("sampling_params") or {}),
                  handler=handler, handler_name=name, timeout_s=None, services=self.services,
                  group_id=request.get("group_id"))
        job.trajectory_id = old.trajectory_id
        job.messages = copy.deepcopy(old.messages)
        job.trajectories = [t.model_copy(deep=True) for t in old.trajectories]
        job.token_stats = old.token_stats
        job.timing = old.timing.model_copy()
        job.reward_weights = dict(request.get("reward_weights") or {})  # the process terms' weights, as asked
        job.turns = [t.model_copy() for t in old.turns]  # the turn records the process terms read
        job.extra = {k: v for k, v in copy.deepcopy(old.extra).items() if k != "eval"}
        # The model acted iff turns were generated: what decides a scored failure kind (prorl_server.failures).
        turns = sum(t.num_turns for t in old.trajectories) or sum(1 for t in old.trajectories if any(t.loss_mask))
        for _ in range(turns):
            job.record_turn(old.backend or "", old.weight_version)  # the result's backend is set back afterwards
        job.status = JobState.eval  # sandboxes eval opens are closed when the job ends
        return job

    async def _eval(self, job: Job, handler: AgentHandler, old: JobResult) -> JobResult:
        """The pipeline's eval stage and finish, for one rebuilt job (see the module docstring).

        Raises:
            NoSandboxRuntimeError: eval opened a sandbox and there is no runtime (anywhere in what it raised).
        """
        exc: Optional[BaseException] = None
        job.timer.resume()
        try:
            async with asyncio.timeout(self.timeout_s) as deadline:
                await handler.eval(job)
        except (Exception, SystemExit) as e:
            if _caused_by_no_runtime(e):
                raise NoSandboxRuntimeError(str(_caused_by_no_runtime(e))) from e
            if isinstance(e, TimeoutError) and deadline.expired():
                job.failure_kind = "timeout"
                job.error = f"eval ran past the re-grading limit of {self.timeout_s:g} s"
            else:
                exc = e
        finally:
            eval_s = job.timer.pause()
        if exc is not None or job.failure_kind is not None:
            if exc is not None:
                job.error = job.error or f"eval failed: {type(exc).__name__}: {exc}"
                job.traceback = "".join(traceback.format_exception(exc))
                job.failure_kind = job.failure_kind or ("handler" if isinstance(exc, SystemExit)
                                                        else classify(exc, "eval", model_acted=job.model_acted))
                try:
                    await handler.eval_exception(job, exc)
                except Exception as cb:
                    job.error += f" (and eval_exception raised {type(cb).__name__}: {cb})"
            job.error = job.error or f"eval failed: the handler reported failure_kind {job.failure_kind!r}"
            job.critical_error = "timeout" if job.failure_kind == "timeout" else "eval"
            job.reward = 0.0 if job.failure_kind in SCORED_KINDS else float(job.reward or 0.0)
            job.resolved = False
        job.finishing = True
        await job.close_resources()
        result = await handler_result(job)
        timing = old.timing.model_copy(update={"eval_s": eval_s,
                                                "counted_s": old.timing.init_s + old.timing.run_s + eval_s})
        # what the run stage decided stays as recorded, and so does the speed its group gave it (#35 part 3: a
        # regrade of one member cannot recompute its group's median); a weighted speed enters the reward again
        if old.speed is not None:
            result = with_speed(result, old.speed, job.reward_weights)
        return result.model_copy(update={"timing": timing, "backend": old.backend,
                                         "weight_version": old.weight_version})


def _components(result: JobResult) -> dict[str, Any]:
    """``result``'s ``reward_components`` as JSON data (a result recorded before components: its outcome alone)."""
    comps = result.reward_components or {"outcome": {"value": result.reward, "weight": 1.0, "per_turn": None}}
    return {k: (v.model_dump(mode="json") if hasattr(v, "model_dump") else v) for k, v in comps.items()}


def _caused_by_no_runtime(e: Optional[BaseException]) -> Optional[NoSandboxRuntimeError]:
    """The :class:`NoSandboxRuntimeError` in ``e``'s cause/context chain (a grader may wrap what it caught)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, NoSandboxRuntimeError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None
