"""A job: one instance run through init -> run -> eval, and what handlers see of it.

Handlers read ``job.instance`` / ``job.sampling_params``, keep stage-to-stage state in ``job.state`` (an
instance of the handler's ``state_model``: ``Job[S]`` has ``state: S``),
write their outcome to ``job.reward``, ``job.resolved``, ``job.messages``, ``job.trajectories`` and
``job.extra``, and ask for resources through the job (``await job.backend()``, ``await job.open_sandbox()``)
so the pipeline releases them when the job ends, is cancelled or times out. The server's shared components
(backend pool, sandbox opener, LLM client and tokenizer, CPU pool, gateway) reach the job as one
:class:`JobServices` (``job.services``), built by the composition root (:func:`prorl_server.app.create_app`).
"""
from __future__ import annotations

import asyncio
import collections
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Generic, Optional, TypeVar

from prorl_server.types import CriticalError, JobResult, JobState, Timing, TokenStats, Trajectory, TurnRecord
from prorl_server.cpu_pool import ANSWER_CPU_BUDGET_S
from prorl_server.failures import JobEndedError, is_filtered, preparing_sandbox

if TYPE_CHECKING:
    from prorl_server.balancer import Backend, BackendPool
    from prorl_server.cpu_pool import CpuPool
    from prorl_server.gateway import Gateway
    from prorl_server.llm.context import LLMContext

SandboxOpener = Callable[..., Awaitable[Any]]
"""``async (spec=None, **spec_fields) -> handle``: starts a sandbox from the server's runtime."""


@dataclass(frozen=True)
class JobServices:
    """What a server shares with each of its jobs; every field is None on a server without that component.

    ``pool``: the LLM backend pool (``job.backend()``: sticky per job, released when the job ends).
    ``backend_wait_s``: seconds a job waits for a backend to be registered. ``sandbox_opener``: starts a
    sandbox (``job.open_sandbox()``). ``llm``: the shared LLM client and the served model's tokenizer
    (``job.llm``). ``cpu_pool``: the process pool of ``job.run_cpu``. ``cpu_budget_s``: CPU seconds all of a
    job's ``run_cpu`` calls may use together (one answer's scoring; None: unbounded), default
    :data:`prorl_server.cpu_pool.ANSWER_CPU_BUDGET_S`. ``gateway``: the OpenAI-compatible gateway whose
    sessions a handler binds to its job (``cli_agent``).
    """

    pool: Optional["BackendPool"] = None
    backend_wait_s: float = 0.0
    sandbox_opener: Optional[SandboxOpener] = None
    llm: Optional["LLMContext"] = None
    cpu_pool: Optional["CpuPool"] = None
    gateway: Optional["Gateway"] = None
    cpu_budget_s: Optional[float] = ANSWER_CPU_BUDGET_S


class PausableTimer:
    """Wall-clock stopwatch that only counts while running (seconds, ``time.monotonic``).

    The pipeline resumes it when a stage starts and pauses it when the stage ends, so queue waits are not
    charged against a job's timeout.
    """

    __slots__ = ("_started", "_elapsed")

    def __init__(self) -> None:
        self._started: Optional[float] = None
        self._elapsed = 0.0

    def resume(self) -> None:
        if self._started is None:
            self._started = time.monotonic()

    def pause(self) -> float:
        """Stop counting; returns the seconds counted since the last resume."""
        if self._started is None:
            return 0.0
        dt = time.monotonic() - self._started
        self._elapsed += dt
        self._started = None
        return dt

    def credit(self, seconds: float) -> None:
        """Take ``seconds`` back off the counted time (time the job spent held by a weight swap)."""
        self._elapsed -= min(max(0.0, seconds), self.elapsed)  # never below nothing counted

    @property
    def running(self) -> bool:
        return self._started is not None

    @property
    def elapsed(self) -> float:
        extra = time.monotonic() - self._started if self._started is not None else 0.0
        return self._elapsed + extra


Closer = Callable[[], Awaitable[None]]


S = TypeVar("S")


class Job(Generic[S]):
    """Runtime state of one job. Created by the pipeline; handlers get it in every callback.

    ``handler``: the job's :class:`~prorl_server.plugin.handler.AgentHandler` (typed ``Any`` here: the handler
    API imports this module, not the other way round). ``state``: what the handler carries between stages,
    ``handler.new_state()`` unless given (a ``dict`` for a handler that declares no ``state_model``).

    ``services``: the server's shared components (:class:`JobServices`). Outside a server (tests, scripts)
    the keyword arguments ``pool``, ``sandbox_opener``, ``backend_wait_s``, ``llm`` and ``cpu_pool`` build it
    instead; giving both is a ``TypeError``.

    A job is a :class:`~prorl_server.llm.client.BackendSource` (``acquire`` / ``record_turn``): pass it as the
    ``backend`` of :meth:`~prorl_server.llm.client.LLMClient.complete` or
    :meth:`~prorl_server.llm.agent_loop.AgentLoop.run` and its turns fail over within its sticky assignment and
    set its result's ``backend`` and ``weight_version``.
    """

    def __init__(self, *, job_id: Optional[str], instance: dict[str, Any], sampling_params: dict[str, Any],
                 handler: Any, handler_name: str, timeout_s: Optional[float], state: Optional[S] = None,
                 services: Optional[JobServices] = None, group_id: Optional[str] = None,
                 pool: Optional["BackendPool"] = None, sandbox_opener: Optional[SandboxOpener] = None,
                 backend_wait_s: Optional[float] = None, llm: Optional["LLMContext"] = None,
                 cpu_pool: Optional["CpuPool"] = None) -> None:
        loose = {"pool": pool, "sandbox_opener": sandbox_opener, "backend_wait_s": backend_wait_s, "llm": llm,
                 "cpu_pool": cpu_pool}
        given = {k: v for k, v in loose.items() if v is not None}
        if services is not None and given:
            raise TypeError(f"give either services or {', '.join(given)}, not both")
        self.services = services if services is not None else JobServices(**given)
        self.job_id = job_id or uuid.uuid4().hex
        self.group_id = group_id  # the n samples of one prompt share it (backend affinity)
        self.trajectory_id = uuid.uuid4().hex
        self.instance = instance
        self.sampling_params = sampling_params
        self.handler = handler
        self.handler_name = handler_name
        self.timeout_s = timeout_s
        self.status = JobState.queued_init
        self.timer = PausableTimer()
        self.timing = Timing()
        self.enqueued_at = time.monotonic()
        self.created_at = time.time()

        # handler-owned outcome
        self.state: S = state if state is not None else handler.new_state() if hasattr(handler, "new_state") \
            else {}
        self.reward: float = 0.0
        self.resolved: bool = False
        #: name -> RewardComponent the handler's eval reported (prorl_server.rewards.compose_reward); None: the
        #: reward is the outcome alone. ``reward_weights``: the request's weights of the process terms.
        self.reward_components: Optional[dict[str, Any]] = None
        self.reward_weights: dict[str, float] = {}
        self.filter: bool = False
        # why the job failed (prorl_server.failures.FAILURE_KINDS); a handler may set it (then the stage ends
        # the job) or raise InfrastructureError; it implies filter unless it is one of SCORED_KINDS
        self.failure_kind: Optional[str] = None
        # generated turns recorded for this job (record_turn): once there is one, the model has acted and what
        # its actions cause is scored, not filtered (prorl_server.failures, "who acted decides")
        self.turns_generated = 0
        self.messages: list[dict[str, Any]] = []
        self.trajectories: list[Trajectory] = []
        #: one per generated turn, in order (:class:`TurnRecord`; set with the trajectories they index)
        self.turns: list[TurnRecord] = []
        # the drift report of the job's conversations, summed (AgentResult.apply_to, a gateway session's end)
        self.token_stats: Optional[TokenStats] = None
        self.extra: dict[str, Any] = {}
        #: completions journalled by an attempt of this job that a crash interrupted, oldest first: the LLM
        #: client answers the same requests with them again (exact resume; see prorl_server.llm.client)
        self.replay: Optional[collections.deque] = None

        # pipeline-owned outcome
        self.critical_error: Optional[CriticalError] = None
        self.error: Optional[str] = None
        self.traceback: Optional[str] = None
        self.result: Optional[JobResult] = None
        self.done = asyncio.get_running_loop().create_future()
        self.task: Optional[asyncio.Task] = None  # the stage task now running, if any
        self.cancel_requested = False
        self.admitted = False  # holds a slot of the pipeline's admission gate (released when the job ends)
        self.finishing = False  # set once the pipeline starts ending the job
        #: the running stage's deadline (an ``asyncio.Timeout``; None without a budget or between stages)
        self.deadline: Optional[asyncio.Timeout] = None
        self._held_remaining: Optional[float] = None  # seconds the deadline had left when a hold started
        self._held_at: Optional[float] = None  # time.monotonic() when the first of the current holds started
        self._holds: set[object] = set()  # what holds the deadline now: "swap", a run_cpu call waiting
        self._cpu_share: Any = None  # the job's prorl_server.cpu_pool.CpuShare, made by its first run_cpu
        self.retained_bytes = 0  # estimated size of the result while the pipeline retains it (result_bytes)

        self._backend_address: Optional[str] = None
        self._weight_version: Optional[int] = None
        #: weight version of the job's first generated turn (None until one is recorded): its staleness
        self.first_weight_version: Optional[int] = None
        self._closers: list[tuple[str, Closer]] = []  # (scope, closer); scope "run" or "job"

    # ------------------------------------------------------------------ identity
    @property
    def llm(self) -> Optional["LLMContext"]:
        """The server's shared LLM client and tokenizer (None on a server without one)."""
        return self.services.llm

    @property
    def instance_id(self) -> Optional[str]:
        v = self.instance.get("instance_id", self.instance.get("id"))
        return None if v is None else str(v)

    @property
    def finished(self) -> bool:
        return self.done.done()

    @property
    def ending(self) -> bool:
        """True once a cancel was asked for or the pipeline started ending the job (it may be closing its
        sandboxes): no stage may start for it and it may take no new resource."""
        return self.cancel_requested or self.finishing or self.done.done()

    def _refuse_if_ending(self, what: str) -> None:
        if self.ending:
            raise JobEndedError(f"job {self.job_id} is ending ({self.error or 'cancelled'}); it may not take "
                                f"{what}")

    # ------------------------------------------------------------------ resources
    async def backend(self, exclude: frozenset[str] = frozenset()) -> "Backend":
        """The job's sticky LLM backend (assigned on first call: its group's backend when load allows, else
        the least-loaded healthy one; see :mod:`prorl_server.balancer`).

        ``exclude`` names backends that failed for this job: a new one is assigned instead. Every call
        records the backend's current ``weight_version`` as the job's (it may change between calls when the
        trainer re-registers the backend after a weight update).

        Raises:
            prorl_server.balancer.NoBackendError: none registered within the server's backend wait, or every
                registered backend is down (see :meth:`~prorl_server.balancer.BackendPool.acquire`).
            JobEndedError: the job is being cancelled or is ending.
        """
        pool = self.services.pool
        if pool is None:
            from prorl_server.balancer import NoBackendError

            raise NoBackendError("this server has no backend pool")
        self._refuse_if_ending("an LLM backend")
        b = await pool.acquire(self.job_id, wait_s=self.services.backend_wait_s, exclude=exclude,
                               group=self.group_id)
        if self.ending:
            # It ended while we waited for a backend: the pipeline's release may already have run, so give the
            # slot back here or it would count against the backend forever.
            pool.release(self.job_id)
            self._refuse_if_ending("an LLM backend")
        self._backend_address = b.address
        self._weight_version = b.weight_version
        return b

    def acquire(self, exclude: frozenset[str]) -> Awaitable["Backend"]:
        """:class:`~prorl_server.llm.client.BackendSource`: the same as :meth:`backend`."""
        return self.backend(exclude)

    def add_token_stats(self, stats: TokenStats) -> None:
        """Add one conversation's drift report (:class:`~prorl_server.types.TokenStats`) to the job's: a job
        that runs several conversations (agent loops, gateway sessions) reports their sum."""
        self.token_stats = stats if self.token_stats is None else self.token_stats + stats

    def replay_event(self, replayed: bool, reason: Optional[str] = None) -> None:
        """A turn was answered from :attr:`replay` (``replayed``), or the replay ended (``reason``: why the
        request differed from the recorded one). Kept in the result's ``extra["replay"]``."""
        report = self.extra.setdefault("replay", {"replayed": 0, "recorded": 0, "ended": None})
        if replayed:
            report["replayed"] += 1
        elif reason is not None and report["ended"] is None:
            report["ended"] = reason

    @property
    def journal_owner(self) -> str:
        """Under which name the journal records this job's completions (its id)."""
        return self.job_id

    def record_turn(self, backend: str, weight_version: Optional[int], oldest_version: Optional[int] = None) -> None:
        """A turn was generated for this job by ``backend`` with weights ``weight_version`` (what the LLM
        client recorded for it): the result's ``backend`` / ``weight_version`` are those of the last turn."""
        self._backend_address = backend
        self.turns_generated += 1
        if weight_version is not None:
            self._weight_version = weight_version
            if self.first_weight_version is None:
                self.first_weight_version = weight_version if oldest_version is None else oldest_version

    @property
    def model_acted(self) -> bool:
        """Whether a turn was generated for this job (by the agent loop or a gateway session): from then on a
        failure the model's actions can cause is a scored result (:mod:`prorl_server.failures`)."""
        return self.turns_generated > 0

    def hold_deadline(self, reason: object = "swap") -> None:
        """Something outside the job holds it: a weight swap (its LLM calls wait in the server or are frozen
        in the engine; ``reason="swap"``, idempotent), or a shared resource it waits for (a CPU-pool worker:
        ``run_cpu`` passes a key of its own per call). Its running stage's deadline (:attr:`deadline`, the
        pipeline's ``asyncio.Timeout``) stops until :meth:`release_deadline` of the last of its holds."""
        self._holds.add(reason)
        deadline = self.deadline
        if self._held_at is None:
            self._held_at = time.monotonic()
        if deadline is not None and not deadline.expired() and deadline.when() is not None \
                and self._held_remaining is None:
            self._held_remaining = deadline.when() - asyncio.get_running_loop().time()
            deadline.reschedule(None)

    def clear_deadline(self) -> None:
        """The stage whose deadline :attr:`deadline` was ended (a hold still running goes on counting)."""
        self.deadline = None
        self._held_remaining = None

    def release_deadline(self, reason: object = "swap") -> None:
        """The hold ``reason`` ended; once no hold is left, the time since the first :meth:`hold_deadline` is
        not charged to the job's timeout (the running stage's deadline restarts with what it had left; later
        stages get the counted time back). Releasing a hold that is not held does nothing."""
        self._holds.discard(reason)
        if self._holds or self._held_at is None:
            return
        if self.timer.running:
            self.timer.credit(time.monotonic() - self._held_at)
        self._held_at = None
        remaining, self._held_remaining = self._held_remaining, None
        deadline = self.deadline
        if remaining is not None and deadline is not None and not deadline.expired():
            deadline.reschedule(asyncio.get_running_loop().time() + remaining)

    def remaining_s(self) -> Optional[float]:
        """Seconds left of the job's counted-time budget (``timeout_s``), never below 0; None without a
        budget. The agent loop clamps its tool limits to it, so a stall of the model's ends as its own."""
        if self.timeout_s is None:
            return None
        return max(0.0, self.timeout_s - self.timer.elapsed)

    async def run_cpu(self, fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
        """``fn(*args)`` in the server's CPU process pool, off the event loop (CPU-bound scoring goes here).

        ``fn`` and ``args`` are pickled: ``fn`` must be importable by module and name. It runs in a worker's
        main thread, so ``signal.alarm``-based timeouts inside it work. The pool is shared fairly: the job's
        calls wait in its own queue, served in turn with other jobs'. Time waiting for a worker is the
        system's: the job's deadline is held meanwhile (as a stage queue wait is not counted). All of the job's
        calls together may use ``services.cpu_budget_s`` CPU seconds (one answer's scoring).

        Args:
            timeout_s: wall-clock limit in the worker, seconds (time waiting for a free worker not counted).

        Raises:
            prorl_server.cpu_pool.CpuTimeoutError: ``fn`` ran past ``timeout_s`` or the job's CPU budget (its
                worker was replaced), or the budget was already spent: the answer's doing, score it 0.0.
            prorl_server.cpu_pool.WorkerCrashedError: the worker died (an infrastructure fault, ``harness``).
            RuntimeError: this server has no CPU pool.
            Exception: whatever ``fn`` raised.
        """
        pool = self.services.cpu_pool
        if pool is None:
            raise RuntimeError("this server has no CPU pool")
        if self._cpu_share is None:
            from prorl_server.cpu_pool import CpuShare

            self._cpu_share = CpuShare(owner=self.job_id, budget_s=self.services.cpu_budget_s)
        waiting = object()  # this call's own hold: calls of one job may wait side by side
        self.hold_deadline(waiting)
        try:
            return await pool.run(fn, *args, timeout_s=timeout_s, share=self._cpu_share,
                                  on_start=lambda: self.release_deadline(waiting))
        finally:
            self.release_deadline(waiting)

    def add_closer(self, closer: Closer, scope: str = "run") -> None:
        """Register an async cleanup. ``scope="run"``: runs when the run stage ends (the run
        sandbox is released as soon as run ends); ``scope="job"``: runs when the job ends. Every closer runs
        at the latest when the job ends, whatever the outcome."""
        self._closers.append((scope, closer))

    async def open_sandbox(self, spec: Any = None, **kwargs: Any) -> Any:
        """Start a sandbox from the server's configured runtime; it is closed for the handler when the run
        stage ends (if opened in init/run) or when the job ends (if opened in eval). The start is the system's:
        the job's deadline is held while it runs (bounded by the runtime's ``start_timeout_s``).

        Raises:
            RuntimeError: the server has no sandbox runtime configured.
            JobEndedError: the job is being cancelled or is ending.
            sandbox.errors.SandboxStartError: the sandbox could not be opened, whatever the runtime raised (a
                full disk, a refused cgroup, no free uid lease: its ``__cause__``): a start failure, the
                system's even after the model acted (:func:`prorl_server.failures.preparing_sandbox`).
        """
        opener = self.services.sandbox_opener
        if opener is None:
            raise RuntimeError("this server has no sandbox runtime configured")
        self._refuse_if_ending("a sandbox")
        opening = object()  # a start waits for the node (a uid lease, a loaded host): the system's time
        self.hold_deadline(opening)
        try:
            with preparing_sandbox():
                handle = await opener(spec, **kwargs)
        finally:
            self.release_deadline(opening)
        if self.ending:
            # It ended while the sandbox started: the pipeline's close may already have run; close it here.
            await handle.close()
            self._refuse_if_ending("a sandbox")
        scope = "job" if self.status == JobState.eval else "run"
        self.add_closer(handle.close, scope)
        return handle

    async def close_resources(self, scope: Optional[str] = None) -> list[BaseException]:
        """Run closers of ``scope`` (all if None), newest first. Returns the errors they raised; never raises
        except for cancellation of the caller."""
        # Detach the closers before awaiting any, so a concurrent call never runs one twice.
        take = [(sc, c) for sc, c in self._closers if scope is None or sc == scope]
        self._closers = [(sc, c) for sc, c in self._closers if not (scope is None or sc == scope)]
        errors: list[BaseException] = []
        for _, closer in reversed(take):
            try:
                await closer()
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # a failing close (even SystemExit) must not stop the others
                errors.append(e)
        return errors

    # ------------------------------------------------------------------ result
    def build_result(self) -> JobResult:
        """The default result from the job's fields (handlers may override ``final_result``)."""
        self.timing.counted_s = self.timer.elapsed
        return JobResult(
            job_id=self.job_id, instance_id=self.instance_id, trajectory_id=self.trajectory_id,
            handler=self.handler_name, reward=float(self.reward), resolved=bool(self.resolved),
            critical_error=self.critical_error, error=self.error, traceback=self.traceback,
            filter=bool(self.filter) or is_filtered(self.failure_kind), failure_kind=self.failure_kind,
            messages=self.messages, trajectories=self.trajectories,
            timing=self.timing, backend=self._backend_address, weight_version=self._weight_version,
            token_stats=self.token_stats, turns=list(self.turns), extra=self.extra,
        )
