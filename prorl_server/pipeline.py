"""The three-stage init -> run -> eval pipeline and the job lifecycle.

Each stage is a pool of N asyncio workers pulling from its own queue (sizes set separately; no threads).
A worker runs one job's stage as a child task, so a job can be cancelled or timed out without touching the
worker. A job's :class:`~prorl_server.job.PausableTimer` runs only inside stages; the per-job timeout is
charged against that counted time, never against queue waits.

Outcomes: every path (success, stage exception, timeout, cancel, stop) goes through :meth:`_finish`, which
closes the job's resources, releases its backend, builds the result and completes the waiter exactly once.
A failed job gets a ``failure_kind`` (:mod:`prorl_server.failures`: who acted decides, then the exception's
type, or the handler declares it). A failure the model did not cause gets ``filter: true`` and is never trained
on; one its actions caused after it acted (its sandbox dying or stalling, a host-side reader raising on what it
shaped, a stall past the job's deadline) is a scored 0.0 with ``filter: false`` and its trajectories kept, so a
policy never learns to crash out of a problem it cannot solve.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
import traceback
from typing import Any, Optional, Sequence

from prorl_server.plugin.registry import HandlerRegistry
from prorl_server.balancer import BackendPool, NoBackendError
from prorl_server.failures import SCORED_KINDS, classify, is_filtered
from prorl_server.job import Job, JobServices
from prorl_server.metrics import Metrics
from prorl_server.plugin.handler import InstanceValidationError
from prorl_server.rewards import SPEED, finalize
from prorl_server.turn_records import charge_run_time
from prorl_server.completion_time import CompletionGroups, GroupConflictError  # noqa: F401 (raised by submit)
from prorl_server.types import STAGES, JobResult, JobState, ProcessRequest, Stage, StageStatus

log = logging.getLogger(__name__)

_QUEUED = {"init": JobState.queued_init, "run": JobState.queued_run, "eval": JobState.queued_eval}
_ACTIVE = {"init": JobState.init, "run": JobState.run, "eval": JobState.eval}
_NEXT: dict[str, Optional[Stage]] = {"init": "run", "run": "eval", "eval": None}


class ServerStoppedError(RuntimeError):
    """The pipeline is stopped (``POST /stop``); ``POST /start`` resumes it."""


class JournalUnavailableError(RuntimeError):
    """The server's journal cannot commit now (a full disk, a lock held too long): a job run now would have its
    result discarded, so none is taken until a commit goes through again."""


class DuplicateJobError(ValueError):
    """A job with this id is still in flight."""


class HandlerUnavailableError(RuntimeError):
    """This server cannot run the handler at all (it needs a sandbox runtime and the server has none): a
    configuration fault no retry fixes, refused at submit."""


class Pipeline:
    """Owns the stage queues, their workers and every live job.

    Args:
        registry: handlers to dispatch ``instance["data_source"]`` to.
        pool: LLM backend pool (sticky per job).
        workers: number of workers per stage, e.g. ``{"init": 64, "run": 64, "eval": 64}``.
        default_timeout_s: counted-time limit for jobs that do not set ``timeout_s`` (None = no limit).
        backend_wait_s: how long a job waits for a backend to be registered before failing its stage.
        keep_finished: how many finished jobs stay queryable through ``GET /jobs/{id}``.
        keep_finished_mb: MiB the retained finished results may take at most (estimated by
            :func:`result_bytes`); the oldest are forgotten first, the newest one is always kept.
        services: what every job is handed as ``job.services`` (:class:`~prorl_server.job.JobServices`: sandbox
            opener, LLM context, CPU pool, gateway), built by the composition root; its ``pool`` is ``pool``
            and its ``backend_wait_s`` replaces the argument. Without it, one is built from ``pool``,
            ``backend_wait_s`` and the loose ``sandbox_opener`` / ``llm`` / ``cpu_pool`` (tests).

    Raises:
        TypeError: ``services`` and a loose component are both given.
        ValueError: ``services.pool`` is another pool than ``pool``.
    """

    def __init__(self, registry: HandlerRegistry, pool: BackendPool, metrics: Metrics,
                 workers: dict[str, int], default_timeout_s: Optional[float] = None,
                 backend_wait_s: float = 30.0, keep_finished: int = 10000, sandbox_opener=None,
                 llm=None, cpu_pool=None, keep_finished_mb: float = 512.0,
                 services: Optional[JobServices] = None, group_retention_s: float = 600.0) -> None:
        if services is None:
            services = JobServices(pool=pool, backend_wait_s=backend_wait_s, sandbox_opener=sandbox_opener,
                                   llm=llm, cpu_pool=cpu_pool)
        elif sandbox_opener is not None or llm is not None or cpu_pool is not None:
            raise TypeError("give either services or sandbox_opener/llm/cpu_pool, not both")
        elif services.pool is None:
            services = dataclasses.replace(services, pool=pool)
        elif services.pool is not pool:
            raise ValueError("services.pool is not the pipeline's pool")
        self.registry = registry
        self.pool = pool
        self.metrics = metrics
        self.workers = {s: max(1, int(workers.get(s, 1))) for s in STAGES}
        self.default_timeout_s = default_timeout_s
        self.keep_finished = keep_finished
        self.keep_finished_bytes = int(keep_finished_mb * 1024 * 1024)
        self.retained_bytes = 0  # estimated size of the results of the jobs in self._finished
        self.services = services
        self.queues: dict[str, asyncio.Queue[Job]] = {s: asyncio.Queue() for s in STAGES}
        self.active: dict[str, int] = {s: 0 for s in STAGES}
        self.jobs: dict[str, Job | FinishedJob] = {}  # live jobs and the records of the most recent finished ones
        #: group id -> ids of its jobs in submit order, for ``GET /groups/{id}/tree`` (#34): the newest groups,
        #: at most :data:`MAX_GROUP_JOBS` ids each and ``max(4096, keep_finished)`` ids in all (the results
        #: themselves are kept, or not, by the retention bounds)
        self.groups: "collections.OrderedDict[str, list[str]]" = collections.OrderedDict()
        self._group_ids = 0  # ids in self.groups
        #: job id -> its group, for the ids in self.groups: a job id reused in another group would make the old
        #: group's tree serve the new job's rows (refused in submit)
        self._job_groups: dict[str, str] = {}
        #: group id -> jobs of it submitted past MAX_GROUP_JOBS (not indexed: its tree says so and is incomplete)
        self.group_overflow: dict[str, int] = {}
        #: seconds a group's delivered results stay whole after its newest job ended, for its tree, when no
        #: complete tree of it is served before (``release_group``)
        self.group_retention_s = group_retention_s
        self._group_ends: "collections.OrderedDict[str, float]" = collections.OrderedDict()  # oldest first
        #: group id -> (its members' runs then, the JSON answered) of the newest groups whose complete tree was served
        #: (:meth:`keep_served_tree`): a repeated GET, such as a client's retry, answers the same tree after
        #: :meth:`release_group` reduced the results it was built from
        self._served_trees: "collections.OrderedDict[str, tuple[tuple, bytes]]" = collections.OrderedDict()
        self._served_tree_bytes = 0
        #: the server's :class:`~prorl_server.journal.store.Journal`, or None: with one, a job's request, states and
        #: result are recorded, a result is answered only once committed, and job ids are idempotent
        self.journal: Any = None
        #: seconds a finished job waits for its result to be committed before it is failed instead
        self.journal_flush_s = 30.0
        self._finished: collections.deque[FinishedJob] = collections.deque()  # finish order, for retention
        self.in_flight = 0
        #: the :class:`~prorl_server.admission.AdmissionGate` a job passes before its init stage starts (and
        #: leaves when it ends), or None: every job starts as soon as a worker takes it
        self.admission: Any = None
        self.accepting = True
        self._worker_tasks: list[asyncio.Task] = []
        #: results of ``completion_time`` jobs held until their group ends (#35 part 3)
        self.completion_groups = CompletionGroups(self._deliver)

    # ------------------------------------------------------------------ lifecycle
    def start_workers(self) -> None:
        for stage in STAGES:
            for i in range(self.workers[stage]):
                self._worker_tasks.append(asyncio.create_task(self._worker(stage), name=f"{stage}-worker-{i}"))

    async def shutdown(self, grace_s: float = 3.0) -> None:
        """Refuse new jobs, cancel every live job (closing its sandboxes), then stop the workers.

        Args:
            grace_s: how long the cancelled jobs get to end (seconds); a stage that swallows its cancellation
                is then ended by cancelling its worker, which still finishes the job as ``cancelled``.
        """
        self.accepting = False
        await self.completion_groups.release_all()  # a group cannot be waited for now
        try:
            await asyncio.wait_for(self.cancel_all("server shutting down"), grace_s)
        except TimeoutError:
            log.warning("jobs still running %g s after they were cancelled; stopping their workers", grace_s)
        for t in self._worker_tasks:
            t.cancel()
        await asyncio.gather(*self._worker_tasks, return_exceptions=True)
        self._worker_tasks.clear()

    def resume(self) -> None:
        """``POST /start``: accept jobs again."""
        self.accepting = True
        self.completion_groups.closing = False

    async def stop(self) -> int:
        """``POST /stop``: refuse new jobs and cancel every in-flight one (results say ``cancelled``).
        HTTP keeps serving so ``/start`` can resume. Returns how many jobs were cancelled."""
        self.accepting = False
        await self.completion_groups.release_all()
        return await self.cancel_all("server stopped (POST /stop)")

    async def cancel_all(self, reason: str) -> int:
        live = [j for j in self.jobs.values() if not j.finished]
        results = await asyncio.gather(*(self.cancel(j.job_id, reason) for j in live))
        return sum(1 for cancelled, _ in results if cancelled)

    # ------------------------------------------------------------------ submission
    def submit(self, req: ProcessRequest) -> Job:
        """Create a job and queue it for init.

        Raises:
            ServerStoppedError: the server is stopped.
            prorl_server.plugin.registry.UnknownHandlerError: ``data_source`` names no handler.
            prorl_server.plugin.InstanceValidationError: the instance does not fit its handler's
                ``instance_model`` (or names no shipped problem by id).
            NoBackendError: the handler needs an LLM and no backend was ever registered (while backends are
                being swapped, or are down, the job is accepted and waits up to ``backend_wait_s``).
            DuplicateJobError: ``job_id`` is already in flight.
            GroupConflictError: a ``completion_time`` member its open group cannot take (another ``group_size``,
                or one beyond the size with no filtered member to replace; :meth:`CompletionGroups.admit`).
            HandlerUnavailableError: the handler needs a sandbox runtime and this server has none.
            JournalUnavailableError: the journal's writes fail now (a finished result already recorded under
                ``job_id`` is still answered).
        """
        if not self.accepting:
            raise ServerStoppedError("server is stopped; POST /start to accept jobs again")
        name, handler = self.registry.resolve(req.instance["data_source"])
        if handler.needs_sandbox and self.services.sandbox_opener is None:
            raise HandlerUnavailableError(
                f"handler {name!r} needs sandboxes and this rollout server has no sandbox runtime; start it with "
                "--sandbox-runtime bubblewrap (or singularity), or sandbox_runtime: auto where bwrap is installed")
        instance = handler.prepare_instance(req.instance)  # by-id completion + the handler's instance model
        if SPEED in (req.reward_weights or {}) and not req.completion_time:  # no group: no speed to weigh
            raise InstanceValidationError(
                f"reward_weights names {SPEED!r}, the relative completion time, which needs completion_time: true "
                "(with group_id and group_size)", "reward_weights")
        unknown = sorted(set(req.reward_weights or {}) - set(handler.reward_terms) - {SPEED})
        if unknown:  # a weight the handler would never apply: the trainer's mistake, said at once
            raise InstanceValidationError(
                f"reward_weights: {unknown} name no process term of the {name} handler (it has "
                f"{list(handler.reward_terms) or 'none'})", "reward_weights")
        # A pool that had backends and has none in rotation now is being swapped (clear -> add around a
        # weight update) or waiting for its health probe: the job waits for a backend in acquire.
        if handler.needs_llm and not self.pool.ever_registered:
            raise NoBackendError(f"handler {name!r} needs an LLM backend and none is registered; "
                                 "register one with POST /add_llm_server")
        if req.job_id is not None:
            old = self.jobs.get(req.job_id)
            if old is not None and not old.finished:
                raise DuplicateJobError(f"job {req.job_id!r} is already in flight")
            held_by = self._job_groups.get(req.job_id)
            if held_by is not None and held_by != req.group_id:
                raise DuplicateJobError(f"job id {req.job_id!r} belongs to group {held_by!r}, whose tree serves its "
                                        "result: a job of another group (or of none) needs a new job id")
            if self.journal is not None:
                done = self.journaled_result(req.job_id)
                if done is not None and not done[1]:
                    return done[0]  # idempotent: the finished result again, not a second sample
        failing = self.journal_failing()
        if failing is not None:
            raise JournalUnavailableError(f"this server's journal cannot record results now ({failing}); a job "
                                          "run here would be discarded: submit it elsewhere or later")
        job = Job(job_id=req.job_id, instance=instance, sampling_params=req.sampling_params,
                  handler=handler, handler_name=name,
                  timeout_s=req.timeout_s if req.timeout_s is not None else self.default_timeout_s,
                  services=self.services, group_id=req.group_id)
        job.reward_weights = dict(req.reward_weights or {})
        #: (group id, group size) of a job whose result waits for its group's relative completion time
        job.completion_group = (req.group_id, req.group_size) if req.completion_time else None
        if job.completion_group is not None:  # the last check: a job refused here took no slot of its group
            self.completion_groups.admit(job.job_id, req.group_id, req.group_size)
        self.jobs.pop(job.job_id, None)
        self.jobs[job.job_id] = job
        if req.group_id is not None:
            self._join_group(req.group_id, job.job_id)
        if self.journal is not None:
            if req.job_id is not None:
                row = self.journal.job(req.job_id)
                if row is not None and row[0] != "done":  # a crash interrupted it: replay what it generated
                    recorded = self.journal.completions(req.job_id)
                    if recorded:
                        job.replay = collections.deque(recorded)
                        job.extra["replay"] = {"replayed": 0, "recorded": len(recorded), "ended": None}
                    self.journal.reset_owner(req.job_id)
            self.journal.job_submitted(job.job_id, name, req.model_dump_json().encode())
        self.in_flight += 1
        self.metrics.jobs_in_flight.set(self.in_flight)
        self._enqueue(job, "init")
        return job

    def _join_group(self, group_id: str, job_id: str) -> None:
        members = self.groups.pop(group_id, None) or []
        if job_id not in members:
            if len(members) < MAX_GROUP_JOBS:
                members.append(job_id)
                self._job_groups[job_id] = group_id
                self._group_ids += 1
            else:
                self.group_overflow[group_id] = self.group_overflow.get(group_id, 0) + 1
        self.groups[group_id] = members  # the newest group last
        while self._group_ids > max(4096, self.keep_finished) and len(self.groups) > 1:
            old_group, old_members = self.groups.popitem(last=False)
            self._group_ids -= len(old_members)
            self.group_overflow.pop(old_group, None)
            for old_id in old_members:
                if self._job_groups.get(old_id) == old_group:
                    del self._job_groups[old_id]
            self._drop_served_tree(old_group)

    def keep_served_tree(self, group_id: str, members: Sequence[tuple[str, Optional[str]]], body: bytes) -> None:
        """Keep the complete tree of ``group_id`` just served (``body``, its JSON, built from the results of
        ``members``: ``(job id, trajectory id)``, the run of each job, as the route saw them before the build)
        for :meth:`served_tree`: the newest :data:`SERVED_TREES` groups' and at most
        :data:`SERVED_TREE_BYTES` bytes in all (a larger tree is not kept: a repeated GET then names its
        reduced results missing, as before)."""
        self._drop_served_tree(group_id)
        if len(body) > SERVED_TREE_BYTES:
            return
        self._served_trees[group_id] = (tuple(members), body)
        self._served_tree_bytes += len(body)
        while len(self._served_trees) > SERVED_TREES or self._served_tree_bytes > SERVED_TREE_BYTES:
            _, (_, old) = self._served_trees.popitem(last=False)
            self._served_tree_bytes -= len(old)

    def served_tree(self, group_id: str, members: Sequence[tuple[str, Optional[str]]]) -> Optional[bytes]:
        """The JSON of the complete tree of ``group_id`` served before, while the group still holds exactly the
        runs it was built from (``(job id, trajectory id)``: a job that joined since, or a job id resubmitted
        and run again, needs a new tree), else None."""
        kept = self._served_trees.get(group_id)
        return kept[1] if kept is not None and kept[0] == tuple(members) else None

    def _drop_served_tree(self, group_id: str) -> None:
        kept = self._served_trees.pop(group_id, None)
        if kept is not None:
            self._served_tree_bytes -= len(kept[1])

    def get(self, job_id: str) -> Optional[Job | FinishedJob]:
        """The live job ``job_id``, or the record of a finished one still retained (or journalled), or None."""
        job = self.jobs.get(job_id)
        if job is None and self.journal is not None:
            done = self.journaled_result(job_id)
            return done[0] if done is not None else None
        return job

    def journaled_result(self, job_id: str) -> Optional[tuple["FinishedJob", bool]]:
        """``(record, filtered)`` of ``job_id``'s finished result in the journal, or None (no journal, never
        journalled, or not finished: a crash interrupted it, see :meth:`interrupted`)."""
        row = self.journal.job(job_id) if self.journal is not None else None
        if row is None or row[0] != "done" or row[2] is None:
            return None
        record = FinishedJob(job_id, "", row[2], 0)
        return record, row[3]

    def interrupted(self, job_id: str) -> bool:
        """True when the journal has ``job_id`` as started and never finished (the server that ran it stopped
        or crashed) and it is not running here: the client should resubmit it."""
        if self.journal is None or job_id in self.jobs:
            return False
        row = self.journal.job(job_id)
        return row is not None and row[0] != "done"

    def _enqueue(self, job: Job, stage: Stage) -> None:
        if self.journal is not None and stage != "init":
            self.journal.job_state(job.job_id, stage)
        job.status = _QUEUED[stage]
        job.enqueued_at = time.monotonic()
        self.queues[stage].put_nowait(job)
        self.metrics.stage_queue_depth[stage].set(self.queues[stage].qsize())

    def journal_failing(self) -> Optional[str]:
        """Why the journal cannot record results now (its writer is gone, or its last commit failed), or None
        (no journal, or it writes)."""
        if self.journal is None:
            return None
        return self.journal.failed or self.journal.last_error

    def _retain(self, job: Job) -> None:
        """Keep the newest finished jobs queryable: at most ``keep_finished`` of them and
        ``keep_finished_mb`` of estimated result size; forget the oldest first (O(1) amortized per job).

        What is kept is a :class:`FinishedJob` (id, state, the result as JSON bytes), not the job: its handler
        state, timer, future and the result's objects are freed now (the collector never walks them again)."""
        if self.keep_finished == 0:
            if self.jobs.get(job.job_id) is job:
                del self.jobs[job.job_id]
            return
        record = FinishedJob.of(job)
        self.retained_bytes += record.retained_bytes
        if job.group_id is not None:
            now = time.monotonic()
            self._group_ends.pop(job.group_id, None)
            self._group_ends[job.group_id] = now
            while self._group_ends:  # groups whose newest job ended over group_retention_s ago
                group_id, ended = next(iter(self._group_ends.items()))
                if now - ended <= self.group_retention_s:
                    break
                self.release_group(group_id)
        if self.jobs.get(job.job_id) is job:
            self.jobs[job.job_id] = record
        self._finished.append(record)
        while len(self._finished) > self.keep_finished or (
                self.retained_bytes > self.keep_finished_bytes and len(self._finished) > 1):
            old = self._finished.popleft()
            self.retained_bytes -= old.retained_bytes
            old.retained_bytes = 0
            if self.jobs.get(old.job_id) is old:  # not resubmitted under the same id since
                del self.jobs[old.job_id]

    def release_group(self, group_id: str) -> int:
        """Reduce the delivered results of group ``group_id``'s jobs (``POST /process`` answered them) to their
        summaries, as a job outside a group is reduced at delivery: after a complete tree of the group was
        served, or ``group_retention_s`` after its newest job ended. A result not yet delivered stays whole
        (``GET /jobs/{id}`` still owes it). Returns the bytes freed (estimated, :func:`result_bytes`)."""
        self._group_ends.pop(group_id, None)
        freed = 0
        for job_id in self.groups.get(group_id, ()):
            record = self.jobs.get(job_id)
            if isinstance(record, FinishedJob) and record.full and record.delivered and record.retained_bytes:
                size = record.summarize(record.result)
                freed += record.retained_bytes - size
                self.retained_bytes += size - record.retained_bytes
                record.retained_bytes = size
        return freed

    def result_json(self, job: Job) -> bytes:
        """``job``'s full result as JSON bytes (what ``POST /process`` answers): the retained record's,
        serialized once when the job finished, or serialized now when it is not retained."""
        record = self.jobs.get(job.job_id)
        if isinstance(record, FinishedJob) and record.trajectory_id == job.trajectory_id and record.full:
            return record.result_json
        return job.result.model_dump_json().encode() if job.result is not None else b"null"

    def delivered(self, job: Job) -> bytes:
        """The blocking ``POST /process`` call is sending ``job``'s result to its client: returns that result as
        JSON bytes (:meth:`result_json`) and keeps only a summary for ``GET /jobs/{id}`` (state, reward,
        resolved, errors, failure_kind, timing, backend), not a second copy of its token arrays, messages and
        extra (``extra`` then says ``{"delivered": "POST /process"}``); a job of a group (``group_id``) keeps its
        whole result, which its group's tree (``GET /groups/{id}/tree``) is built from, until
        :meth:`release_group` (a complete tree served, or ``group_retention_s`` after the group's last end)."""
        body = self.result_json(job)
        record = self.jobs.get(job.job_id)
        # a group's results stay whole (within the retention bounds): GET /groups/{id}/tree needs their tokens
        if isinstance(record, FinishedJob) and record.trajectory_id == job.trajectory_id:
            record.delivered = True
        if (isinstance(record, FinishedJob) and record.trajectory_id == job.trajectory_id and record.retained_bytes
                and job.group_id is None):
            size = record.summarize(job.result)
            self.retained_bytes += size - record.retained_bytes
            record.retained_bytes = size
        # the job's own fields point at the same token lists: drop them too, or nothing is freed while the
        # request's handler still holds the job
        job.trajectories, job.messages, job.extra = [], [], {}
        return body

    # ------------------------------------------------------------------ cancellation
    async def cancel(self, job_id: str, reason: str = "cancelled by request",
                     by_client: bool = False) -> tuple[bool, JobState]:
        """Cancel a job wherever it is. Idempotent: a finished job is left as it is. A ``completion_time``
        member whose result is held for its group is released at once as cancelled (filtered); ``by_client``
        (``POST /cancel``): its group does not wait for a replacement of it (:class:`CompletionGroups`).

        Returns ``(cancelled_now, state)``. Raises KeyError for an unknown id.
        """
        job = self.jobs.get(job_id)
        if job is None:
            if self.journaled_result(job_id) is not None:
                return False, JobState.done
            raise KeyError(job_id)
        if job.finished:
            return False, job.status
        if getattr(job, "completion_group", None) is not None:
            # held for its group (#35 R15): answered now, never after the group's wait
            if job.finishing and await self.completion_groups.cancel(job, reason, by_client):
                return True, job.status
            job.group_cancel = (reason, by_client)
        if job.finishing:  # already ending (e.g. closing sandboxes): wait for it
            await asyncio.shield(job.done)
            return getattr(job, "group_released", False), job.status
        job.cancel_requested = True
        job.error = reason
        if job.task is not None and not job.task.done():
            # The worker sees the cancelled child task and finishes the job (closing its sandboxes).
            job.task.cancel()
            await asyncio.shield(job.done)
        else:
            # Queued: it stays in its queue and the worker that pops it skips it.
            await self._finish(job, "cancelled", reason)
        return True, job.status

    # ------------------------------------------------------------------ workers
    async def _worker(self, stage: Stage) -> None:
        queue = self.queues[stage]
        while True:
            job = await queue.get()
            self.metrics.stage_queue_depth[stage].set(queue.qsize())
            if job.ending:
                # Cancelled while queued (its _finish may still be closing its sandboxes): running the stage
                # now would take a backend slot or a sandbox after the job released its resources.
                continue
            if stage == "init" and self.admission is not None:
                try:
                    await self.admission.acquire()
                except asyncio.CancelledError:  # the worker is being cancelled (shutdown) while it waits
                    if not job.finished:
                        await asyncio.shield(self._finish(job, "cancelled", "server shutting down"))
                    raise
                job.admitted = True
                if job.ending:  # cancelled while it waited: its _finish ran, or is running, without the slot
                    self._release_admission(job)
                    continue
            job.timing.queue_s += time.monotonic() - job.enqueued_at
            self.active[stage] += 1
            self.metrics.stage_active[stage].set(self.active[stage])
            try:
                await self._run_stage(job, stage)
            except asyncio.CancelledError:
                # The worker itself is being cancelled (shutdown): end the job, then stop.
                if not job.finished:
                    await asyncio.shield(self._finish(job, "cancelled", "server shutting down"))
                raise
            except BaseException as e:  # never let one job kill a worker, or SystemExit in a hook the server
                log.exception("internal error in %s worker for job %s", stage, job.job_id)
                if not job.finished:
                    msg, tb = f"internal error: {type(e).__name__}: {e}", traceback.format_exc()
                    if job.finishing:  # _finish itself raised half-way: still answer the job's waiter
                        self._complete_broken(job, stage, msg, tb)
                    else:
                        await self._finish(job, stage, msg, tb, "internal")
            finally:
                self.active[stage] -= 1
                self.metrics.stage_active[stage].set(self.active[stage])
                # an idle worker must not keep its last job (its future, its full result) alive until the
                # next one comes: with thousands of workers that was thousands of finished jobs
                job = None

    async def _run_stage(self, job: Job, stage: Stage) -> None:
        handler = job.handler
        remaining = None if job.timeout_s is None else job.timeout_s - job.timer.elapsed
        job.status = _ACTIVE[stage]
        t0 = time.monotonic()
        job.timer.resume()
        job.task = asyncio.create_task(self._guarded(getattr(handler, stage), job, remaining),
                                       name=f"{stage}:{job.job_id}")
        try:
            await asyncio.wait({job.task})
        except asyncio.CancelledError:
            job.task.cancel()  # the worker is being cancelled: do not leave the stage running
            raise
        finally:
            dt = job.timer.pause()
            setattr(job.timing, f"{stage}_s", getattr(job.timing, f"{stage}_s") + dt)
            self.metrics.stage_seconds[stage].observe(time.monotonic() - t0)
        task, job.task = job.task, None
        if stage == "run":
            await job.close_resources("run")

        if task.cancelled() or job.cancel_requested:
            await self._finish(job, "cancelled", job.error or "cancelled")
            return
        exc = task.exception()
        base_exc = exc.original if isinstance(exc, _HandlerBaseException) else None
        if base_exc is not None:
            exc = base_exc
        if exc is None and job.failure_kind is not None:  # the handler declared a failure and returned
            await self._finish(job, stage, job.error or f"{stage} failed: the handler reported failure_kind "
                               f"{job.failure_kind!r}")
            return
        if exc is None:
            nxt = _NEXT[stage]
            if nxt is None:
                await self._finish(job, None)
            else:
                self._enqueue(job, nxt)
            return
        if isinstance(exc, _JobTimeout):
            job.timing.timeout_triggered = True
            await self._finish(job, "timeout", f"job exceeded its timeout of {job.timeout_s:g} s in {stage}")
            return
        # A stage exception: tell the handler, then end the job with critical_error=<stage>.
        tb = "".join(traceback.format_exception(exc))
        msg = f"{stage} failed: {type(exc).__name__}: {exc}"
        if isinstance(exc, NoBackendError):
            msg = f"{stage} failed: {exc}"
        # what the handler set during the stage wins; its callback may still override the classification.
        # A SystemExit/KeyboardInterrupt out of a handler is the handler's bug, never a reason to stop serving.
        job.failure_kind = job.failure_kind or ("handler" if base_exc is not None
                                                else classify(exc, stage, model_acted=job.model_acted))
        try:
            await getattr(handler, f"{stage}_exception")(job, exc)
        except asyncio.CancelledError:
            raise
        except BaseException as cb_exc:
            log.exception("%s_exception callback of handler %s raised", stage, job.handler_name)
            msg += f" (and {stage}_exception raised {type(cb_exc).__name__}: {cb_exc})"
        await self._finish(job, stage, msg, tb)

    @staticmethod
    async def _guarded(stage_fn, job: Job, remaining: Optional[float]) -> Any:
        # The handler's coroutine is created here, inside the task: a task cancelled before it first runs
        # then leaves no never-awaited coroutine behind.
        try:
            if remaining is None:
                return await stage_fn(job)
            if remaining <= 0:
                raise _JobTimeout()
            try:
                async with asyncio.timeout(remaining) as deadline:
                    job.deadline = deadline  # a weight swap stops it while it holds the job
                    pool = job.services.pool if job.services is not None else None
                    if pool is not None and pool.held:  # a stage that starts during a swap: held at once
                        job.hold_deadline()
                    try:
                        return await stage_fn(job)
                    finally:
                        job.clear_deadline()
            except TimeoutError as e:
                # A TimeoutError the handler raised itself is a stage failure, not the job's timeout.
                if deadline.expired():
                    raise _JobTimeout() from e
                raise
        except (Exception, asyncio.CancelledError):
            raise
        except BaseException as e:
            # SystemExit, KeyboardInterrupt (or any other BaseException) raised by a handler: asyncio re-raises
            # those out of the event loop and the whole server would exit. Carry it as an ordinary exception.
            raise _HandlerBaseException(e) from e

    # ------------------------------------------------------------------ completion
    async def _finish(self, job: Job, critical_error: Optional[str], error: Optional[str] = None,
                      tb: Optional[str] = None, failure_kind: Optional[str] = None) -> None:
        if job.finished or job.finishing:
            return
        job.finishing = True
        if critical_error is not None:
            # timeout and cancel are the pipeline's own decisions; a stage failure was classified in
            # _run_stage (or declared by the handler)
            if critical_error == "cancelled":
                job.failure_kind = critical_error
            elif critical_error == "timeout":
                # past the deadline after the model acted: its stall (its tool limits are clamped to the budget)
                job.failure_kind = "model_timeout" if job.model_acted else "timeout"
            else:
                job.failure_kind = failure_kind or job.failure_kind or "handler"
            job.critical_error = critical_error  # type: ignore[assignment]
            job.error = error
            job.traceback = tb
            scored = job.failure_kind in SCORED_KINDS
            job.reward = 0.0 if critical_error != "eval" or scored else float(job.reward or 0.0)
            job.resolved = False
        try:
            close_errors = await job.close_resources()
        finally:
            # whatever closing did (even a shutdown cancelling it), the job's backend slot is given back
            self.pool.release(job.job_id)
        for e in close_errors:
            log.warning("closing a resource of job %s failed: %r", job.job_id, e)
        result = await handler_result(job)
        group = getattr(job, "completion_group", None)
        if group is not None:  # answered, with its speed, when its group ends (#35 part 3)
            # its admission slot goes now: the members still to run may need it to end the group
            self._release_admission(job)
            await self.completion_groups.hold(job, group[0], result)
            return
        await self._deliver(job, result)

    async def _deliver(self, job: Job, result: JobResult) -> None:
        """Journal ``result``, answer ``job``'s waiters with it and retain it."""
        critical_error = job.critical_error
        if self.journal is not None:
            # committed before anyone sees it: a result a client received survives a crash of this process
            job.result_json_cache = _dump(result)  # serialized once: the retained record reuses it
            self.journal.job_result(job.job_id, job.result_json_cache, result.filter)
            self.journal.forget_owner(job.job_id)
            # while commits fail (a full disk), a result waits a moment, not the whole flush time: the server's
            # clients are told at once to run it again (elsewhere, or here once the journal writes again)
            wait_s = self.journal_flush_s if self.journal.last_error is None else min(1.0, self.journal_flush_s)
            if self.journal.failed is not None or not await self.journal.aflush(wait_s):
                # never answer a result the journal may lose: the client resubmits (the id stays free until
                # the row is written; once it is, the resubmission gets this result)
                why = self.journal.failed or self.journal.last_error or f"no commit within {self.journal_flush_s:g} s"
                log.error("journal: the result of job %s could not be recorded (%s)", job.job_id, why)
                result = finalize(result.model_copy(update={
                    "failure_kind": "internal", "filter": True, "reward": 0.0, "resolved": False,
                    "error": f"the server's journal could not record this result ({why}): resubmit the job"}), None)
                job.result_json_cache = None
        job.result = result
        job.status = JobState.done
        self.in_flight -= 1
        self.metrics.jobs_in_flight.set(self.in_flight)
        self.metrics.jobs_total.labels(job.handler_name, critical_error or "ok").inc()
        self.metrics.reward.labels(job.handler_name).observe(result.reward)
        if result.failure_kind is None:  # names are the handler's declared terms (bounded at registration)
            for name, component in result.reward_components.items():
                self.metrics.reward_component.labels(job.handler_name, name).observe(component.value)
        if result.filter:
            self.metrics.jobs_filtered.labels(job.handler_name, result.failure_kind or "unspecified").inc()
        if result.failure_kind is not None:
            self.metrics.jobs_failed.labels(job.handler_name, result.failure_kind,
                                            "true" if result.filter else "false").inc()
        flagged = (job.extra.get("eval") or {}).get("flagged") if isinstance(job.extra.get("eval"), dict) else None
        if isinstance(flagged, list):  # a handler's pre-grading check (the swe patch check): one count per rule
            for rule in sorted({str(f.get("rule"))[:64] for f in flagged if isinstance(f, dict)}):
                self.metrics.flagged_artifacts.labels(job.handler_name, rule).inc()
        malformed = (job.extra.get("agent") or {}).get("malformed_tool_calls")  # see AgentResult.apply_to
        if malformed:
            self.metrics.tool_parse_errors.labels(job.handler_name).inc(malformed)
        if result.token_stats is not None:  # the drift report: splits by reason, turns, by model family
            self.metrics.count_token_stats(result.token_stats)
        job.done.set_result(result)
        self._release_admission(job)
        self._retain(job)

    def _release_admission(self, job: Job) -> None:
        if job.admitted:
            job.admitted = False
            self.admission.release()

    def _complete_broken(self, job: Job, stage: Stage, error: str, tb: str) -> None:
        """Last resort when :meth:`_finish` itself failed: give the job a failed result so no waiter hangs."""
        self.pool.release(job.job_id)
        job.critical_error, job.error, job.traceback = stage, error, tb
        job.failure_kind, job.reward, job.resolved = "internal", 0.0, False
        if not job.done.done():
            job.result = finalize(job.build_result(), None)
            job.status = JobState.done
            self.in_flight -= 1
            self.metrics.jobs_in_flight.set(self.in_flight)
            job.done.set_result(job.result)
            self._retain(job)
        self._release_admission(job)

    # ------------------------------------------------------------------ status
    def stage_status(self) -> dict[str, StageStatus]:
        return {s: StageStatus(queued=self.queues[s].qsize(), active=self.active[s], workers=self.workers[s])
                for s in STAGES}


#: Most job ids a group records for its tree (a GRPO group is a few to a few hundred samples).
MAX_GROUP_JOBS = 1024

#: Complete group trees kept after they were served, for a repeated GET (:meth:`Pipeline.keep_served_tree`): the
#: newest groups' and bytes of JSON in all.
SERVED_TREES = 64
SERVED_TREE_BYTES = 64 * 1024 * 1024


class FinishedJob:
    """What a finished job leaves for ``GET /jobs/{id}``, ``POST /cancel`` and the resubmission check: its id,
    its state and its result as JSON bytes (one ``bytes`` object, which the garbage collector never walks,
    several times smaller than the result's Python objects), instead of the job with its handler state,
    timer, future and token lists.

    It reads like a finished :class:`~prorl_server.job.Job` where the routes look (``job_id``, ``status``,
    ``finished``, ``finishing``, ``ending``, ``result``); the handler-owned fields (``messages``,
    ``trajectories``, ``extra``) are not kept and read empty (``result`` has them until a ``POST /process``
    delivered it). ``retained_bytes`` is :func:`result_bytes` of the result it stands for.
    """

    __slots__ = ("job_id", "trajectory_id", "result_json", "full", "retained_bytes", "delivered")
    status = JobState.done
    finished = finishing = ending = True

    def __init__(self, job_id: str, trajectory_id: str, result_json: bytes, retained_bytes: int) -> None:
        self.job_id = job_id
        self.trajectory_id = trajectory_id  # tells this job from a later one submitted under the same id
        self.result_json = result_json
        self.full = True  # False once summarize() replaced the result with its summary
        self.retained_bytes = retained_bytes
        self.delivered = False  # True once POST /process answered it (Pipeline.delivered)

    @classmethod
    def of(cls, job: Job) -> "FinishedJob":
        """The record of ``job``, whose ``result`` is set (serialized once here)."""
        body = getattr(job, "result_json_cache", None)
        return cls(job.job_id, job.trajectory_id, body if body is not None else _dump(job.result),
                   result_bytes(job.result))

    @property
    def result(self) -> JobResult:
        """The result (parsed from the kept JSON on each access)."""
        return JobResult.model_validate_json(self.result_json)

    @property
    def messages(self) -> list:
        return []

    @property
    def trajectories(self) -> list:
        return []

    @property
    def extra(self) -> dict:
        return {}

    def summarize(self, result: JobResult) -> int:
        """Keep only ``result``'s summary: no token arrays, messages or extra (``extra`` says
        ``{"delivered": "POST /process"}``). Returns the summary's :func:`result_bytes`."""
        summary = result.model_copy(update={"trajectories": [], "messages": [],
                                            "extra": {"delivered": "POST /process"}})
        self.result_json = _dump(summary)
        self.full = False
        return result_bytes(summary)


def _dump(result: Optional[JobResult]) -> bytes:
    if result is None:
        return b"null"
    try:
        return result.model_dump_json().encode()
    except ValueError:  # a handler put something JSON cannot hold in extra: keep its repr, not a 500 later
        log.exception("the result of job %s does not serialize; unknown values are kept as their repr",
                      result.job_id)
        return result.model_dump_json(fallback=repr).encode()


#: Estimated bytes a Python list holds per element: an 8-byte pointer plus the object it points to (a token id
#: above 256 is its own 28-byte int, a logprob a 24-byte float; loss-mask 0/1 are shared small ints).
_TOKEN_ID_BYTES, _LOGPROB_BYTES, _MASK_BYTES = 36, 32, 8


def result_bytes(result: Optional[JobResult]) -> int:
    """Cheap estimate of the memory a retained :class:`JobResult` holds, in bytes: token arrays by their
    lengths (an 18k-token trajectory is ~1.4 MB), message contents by their string lengths, plus 2 KiB of
    fixed overhead. O(number of trajectories + messages); never serializes the result."""
    if result is None:
        return 0
    n = 2048
    for t in result.trajectories:
        n += (len(t.prompt_ids) + len(t.response_ids)) * _TOKEN_ID_BYTES
        n += len(t.response_logprobs) * _LOGPROB_BYTES + len(t.loss_mask) * _MASK_BYTES
    for m in result.messages:
        content = m.get("content") if isinstance(m, dict) else None
        n += 200 + (len(content) if isinstance(content, str) else 0)
    return n


class _JobTimeout(Exception):
    """Internal: the job's counted-time budget ran out inside a stage."""


class _HandlerBaseException(Exception):
    """Internal: a stage raised a BaseException that is not cancellation (``SystemExit``,
    ``KeyboardInterrupt``, ...); ``original`` is it. The job fails with ``failure_kind="handler"``."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(f"{type(original).__name__}: {original}")
        self.original = original


async def handler_result(job: Job) -> JobResult:
    """The result of an ending job as its handler builds it (``final_result``), with the reward invariants the
    server enforces whatever the handler returns (docs/reward-integrity.md, I3): a failure kind the job
    declared is on the result, a filtered kind is ``filter: true``, a scored kind (the model's doing) scores
    0.0, unresolved; ``reward`` is the weighted sum of ``reward_components`` and each turn record carries its
    share (:func:`prorl_server.rewards.finalize`: components that do not make the reward are a handler fault,
    filtered). A ``final_result`` that raises (SystemExit included: it must not stop the server) or
    returns something else falls back to :meth:`Job.build_result`, its error kept in ``job.error``.

    Shared by the pipeline's finish and the journal's re-grading (:mod:`prorl_server.journal.regrade`).

    Raises:
        asyncio.CancelledError: the caller was cancelled.
    """
    try:
        result = await job.handler.final_result(job)
        if not isinstance(result, JobResult):
            raise TypeError(f"final_result returned {type(result).__name__}, not JobResult")
    except asyncio.CancelledError:
        raise
    except BaseException as e:
        log.exception("final_result of handler %s raised", job.handler_name)
        if job.error is None:
            job.error = f"final_result failed: {type(e).__name__}: {e}"
        result = job.build_result()
    if job.failure_kind is not None and result.failure_kind is None:  # a final_result of the handler's own
        result = result.model_copy(update={"failure_kind": job.failure_kind,
                                           "filter": result.filter or is_filtered(job.failure_kind)})
    elif is_filtered(result.failure_kind) and not result.filter:
        result = result.model_copy(update={"filter": True})
    if result.failure_kind in SCORED_KINDS and (result.reward != 0.0 or result.resolved):
        result = result.model_copy(update={"reward": 0.0, "resolved": False})
    # named components (#35 part 2): checked against the reward, or the job fails as the handler's fault
    result = charge_run_time(result)  # the turns' times add up to run_s (#35 part 1)
    return finalize(result, result.reward_components or job.reward_components,
                    getattr(job.handler, "reward_terms", ()))
