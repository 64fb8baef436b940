"""The one rollout client: submit, cancel and retry jobs on rollout servers, typed by the wire models.

:class:`JobSubmitter` is the only code in the project that talks ``/process`` and ``/cancel``: ``prorl-run``
(:mod:`trainer_plugins.run_job`), :class:`trainer_plugins.client.RolloutClient`, the TRL plugin
(:mod:`trainer_plugins.trl`) and the verl plugin's agent loop (:mod:`trainer_plugins.verl.agent_loop`) all go
through it. Requests are :class:`prorl_server.types.ProcessRequest` (built with :func:`process_request`),
answers are parsed into :class:`prorl_server.types.JobResult`. What it does with each answer:

======================================  ==================================================================
the rollout server answers              outcome
======================================  ==================================================================
200 with a job result                   the result (``filter: true`` in it: not to be trained on; see below)
200, ``failure_kind: invalid_instance``  :class:`InvalidInstanceError` naming the instance (retrying cannot help)
200 with a body that is no job result   a filtered ``rollout_server`` result
503 ``draining`` (the server leaves)     a filtered ``draining`` result at once (another attempt, elsewhere,
                                        not counted against ``max_sample_retries``: see below); a fleet
                                        takes the server out of the rotation
503 (no LLM backend yet, stopped,       offered again on the same server every 0.25 s for
``journal_unavailable``: a full disk)   ``unavailable_retry_s``, then a filtered ``rollout_server`` result
409 ``group_full`` (a completion-time   a filtered ``rollout_server`` result (retried; the group's running
group whose members all run or ended)   member ends, and the group with it)
410 ``result_expired`` (the job ran and  a filtered ``expired`` result, never re-submitted (:func:`never_rerun`):
its result was answered; the server's   the sample was finished and delivered once; running it again would
journal has since deleted it)           give one id two samples
401 / 403                               :class:`RolloutAuthError` (the token is wrong: a configuration error)
400 ``handler_unavailable``             :class:`HandlerUnavailableError` (the server cannot run the handler,
                                        e.g. no sandbox runtime: a configuration error), the server's message
400 ``unknown_handler``                 :class:`UnknownHandlerError` (no such handler on the server)
any other 4xx but 408 / 429             :class:`InvalidInstanceError` naming the instance and the server's reason
408, 429, other 5xx                     a filtered ``rollout_server`` result (another attempt, elsewhere)
no answer (refused, reset, died)        a filtered ``rollout_server`` result (a fleet takes the server out)
the server's fleet lease ran out        a filtered ``rollout_server`` result at once (node lost: no answer
                                        would ever come; see :mod:`trainer_plugins.fleet`)
no result within ``request_timeout_s``  the job is cancelled on the server; a filtered ``timeout`` result
the job was cancelled (:meth:`cancel`)  the server's result (``critical_error: cancelled``), or, when the
                                        request was not sent yet, a filtered ``cancelled`` result
the caller is cancelled                 the job is cancelled on the server (shielded), then CancelledError
======================================  ==================================================================

:data:`CONFIGURATION_FAULTS` are the errors no retry can fix: a trainer stops on them with their message (the
verl plugin carries them through verl's V1 worker, which would otherwise swallow them; see
``trainer_plugins/verl/agent_loop.py``). Everything that ends as a filtered result is a job fault, retried.

A *filtered result* made here has the server's shape (``reward 0.0, critical_error, error, failure_kind,
filter: true, trajectories: []``), so callers treat a dead server exactly like a job the server failed.

Retry and failover (one rule for every caller). A filtered result is re-submitted as a new job (a new job
id) up to ``max_sample_retries`` times; each re-submission goes to the server the caller's
:class:`trainer_plugins.admission.ServerChooser` picks with every server on which this sample was already
filtered excluded, while another server is left; a ``completion_time`` request (issue #35) excludes only a
server that was itself the fault (``rollout_server``, ``draining``): its group's server waits for the
replacement, and elsewhere the job would be a group of its own. :meth:`JobSubmitter.run` is that loop;
``RolloutClient`` applies the same rule itself (:meth:`JobSubmitter.retry_server`) because it regenerates
samples inside groups. A ``draining`` refusal is no fault (the server leaves on purpose and never took the job):
it does not use up a retry (:func:`uses_retry`), unless the sample had been filtered on that server already
(there was nowhere else to go), so a sample meets each server's drain at most once for free.

Cancel (:meth:`JobSubmitter.cancel`), robust against the race with the job's own submission:

1. the job id is remembered as cancelled first: a request of this client that has not been sent yet (or
   waits between 503 retries) is never sent, and its caller gets a filtered ``cancelled`` result;
2. ``POST /cancel {job_id}``: a 200 means the server stopped the job;
3. a 404 means the ``/process`` request has not reached the server yet: while this client's request for the
   job is still open, the cancel is sent again (every 50 ms, backing off to 1 s) until the server knows the
   job or the request ended; for a job not open here (submitted elsewhere, or a request this client already
   gave up on) 404s are retried for ``cancel_patience_s``;
4. any other answer, or no answer, ends the cancel (logged, never raised: the server is gone or refused).
"""
from __future__ import annotations

import asyncio
import logging
import math
import resource
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Mapping, Optional, Sequence

import aiohttp
import pydantic

from prorl_server.types import CancelRequest, JobResult, ProcessRequest
from trainer_plugins.admission import LeastInFlight, ServerChooser
from trainer_plugins.fleet import Fleet

log = logging.getLogger(__name__)

#: ``failure_kind`` of a result made here because the rollout server gave none (no answer, 5xx, 503 for too
#: long, a body that is not a job result). The server's own kinds are ``prorl_server.failures.FAILURE_KINDS``.
ROLLOUT_SERVER = "rollout_server"
#: ``failure_kind`` of a result made here because the server refused the job with 503 ``draining``: it is leaving
#: (SIGTERM in a fleet, ``POST /drain``) and took no job; re-submitted elsewhere without using up a retry.
DRAINING = "draining"
#: ``failure_kind`` of a result made here because the server answered 410 ``result_expired``: the job finished
#: and its result was answered before, and the server's journal has since deleted it. A finished sample, not to
#: be trained on (again) nor re-submitted.
EXPIRED = "expired"
#: how many cancelled job ids a client remembers (each is a short string; the oldest is forgotten first)
_TOMBSTONES = 65536
#: Connections one client session opens at most, over all servers: 0 = no cap, the jobs in flight are bounded by
#: the caller's own admission (window, staleness, concurrency). aiohttp's own default, 100, silently held a
#: trainer to 100 ``/process`` requests in flight however many servers it had.
DEFAULT_MAX_CONNECTIONS = 0


def open_session(headers: Optional[Mapping[str, str]] = None, *, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 timeout: Optional[aiohttp.ClientTimeout] = None) -> aiohttp.ClientSession:
    """An aiohttp session for talking to rollout servers: ``max_connections`` connections at most (0: no cap),
    no per-host cap, and the process's open-files limit raised to fit them (:func:`raise_open_files_limit`).
    ``timeout`` defaults to none in total and 30 s to connect. Call it from a running event loop.

    Raises:
        ValueError: ``max_connections`` is negative.
    """
    if max_connections < 0:
        raise ValueError(f"max_connections must be >= 0 (0: no cap), got {max_connections}")
    raise_open_files_limit(max_connections)
    return aiohttp.ClientSession(headers=dict(headers or {}),
                                 connector=aiohttp.TCPConnector(limit=max_connections, limit_per_host=0),
                                 timeout=timeout or aiohttp.ClientTimeout(total=None, sock_connect=30))


def raise_open_files_limit(connections: int) -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` so ``connections`` sockets fit beside 1,024 other files
    (0: as high as the hard limit allows); never lowers it. A soft limit of 1,024, common on login nodes,
    would otherwise fail the 1,000th request in flight with "Too many open files". Returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = hard if hard != resource.RLIM_INFINITY else 1 << 20
    want = cap if connections == 0 else min(cap, connections + 1024)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            log.debug("open-files limit raised from %d to %d for the rollout client's connections", soft, want)
            return want
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-files limit from %d to %d (%s): at most about %d requests can "
                        "be in flight", soft, want, e, max(0, soft - 64))
    return soft


class ConfigurationError(RuntimeError):
    """A fault of the setup, not of one job: no retry can fix it, so the trainer must stop with this message
    (wrong token, a handler the server cannot run or does not have, an unreachable relay, a turn with no
    weight version)."""


class InvalidInstanceError(ValueError):
    """The rollout server refused an instance (4xx) or its handler did (``failure_kind="invalid_instance"``).
    The message names the instance (``what``: the caller's description, e.g. the prompt or the dataset row)
    and the server's reason. Retrying cannot help: it is the dataset's or the mapping's fault."""


class RolloutAuthError(ConfigurationError):
    """A rollout server refused the bearer token (401/403)."""


class HandlerUnavailableError(ConfigurationError):
    """A rollout server has the handler but cannot run it (HTTP 400 ``handler_unavailable``: e.g. it needs a
    sandbox and the server has no sandbox runtime). The message is the server's."""


class UnknownHandlerError(ConfigurationError, InvalidInstanceError):
    """A rollout server has no handler of the instance's ``data_source`` (HTTP 400 ``unknown_handler``)."""


#: errors that stop a trainer (retrying cannot help): the setup's (:class:`ConfigurationError`) and the
#: dataset's (:class:`InvalidInstanceError`: a row that maps to no instance the server accepts)
CONFIGURATION_FAULTS: tuple[type[BaseException], ...] = (ConfigurationError, InvalidInstanceError)


#: Largest ``completion_time_weight`` a trainer plugin accepts: ``speed`` is in [-1, 1] and the shipped outcomes
#: in [0, 1], so a larger weight would let time outweigh solving the task many times over.
MAX_COMPLETION_TIME_WEIGHT = 10.0


def completion_time_weight(value: Any, setting: str = "completion_time_weight") -> float:
    """``value`` checked as the weight of the ``speed`` reward component (issue #35; docs/http-api.md "Relative
    completion time"): a finite real number in [0, :data:`MAX_COMPLETION_TIME_WEIGHT`], 0 meaning off.

    Raises:
        ValueError: anything else (a bool, a string, NaN, inf, a negative or larger number), naming ``setting``.
    """
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not 0.0 <= value <= MAX_COMPLETION_TIME_WEIGHT):
        raise ValueError(f"{setting} must be a number in [0, {MAX_COMPLETION_TIME_WEIGHT:g}] (0: off), got {value!r}")
    return float(value)


def process_request(instance: Mapping[str, Any], sampling_params: Optional[Mapping[str, Any]] = None, *,
                    job_id: Optional[str] = None, group_id: Optional[str] = None,
                    timeout_s: Optional[float] = None, group_size: Optional[int] = None,
                    speed_weight: float = 0.0,
                    reward_weights: Optional[Mapping[str, float]] = None) -> ProcessRequest:
    """The ``POST /process`` body as the wire model, unvalidated: the rollout server is the one validator
    (its 4xx becomes an :class:`InvalidInstanceError` naming the instance), and validating here would resolve
    shipped-dataset ids and handler aliases in the trainer's process, where the server's datasets may not be.
    ``timeout_s`` in seconds of counted time; ``None`` fields are not sent.

    ``speed_weight`` > 0 (checked by :func:`completion_time_weight`) opts the job in to the relative completion
    time reward: ``completion_time: true``, ``group_size`` (the group's n samples) and ``reward_weights`` with
    ``speed`` = the weight, merged into ``reward_weights``. 0 sends none of them, so a server from before issue
    #35, which refuses unknown fields, still takes the request.

    Raises:
        ValueError: ``speed_weight`` > 0 without ``group_id`` and ``group_size`` >= 1.
    """
    weights = dict(reward_weights) if reward_weights else None
    completion_time = None
    if speed_weight:
        if group_id is None or not group_size or group_size < 1:
            raise ValueError(f"completion_time_weight {speed_weight!r} needs the job's group_id and group_size "
                             f"(got {group_id!r}, {group_size!r}): speed is relative to the group")
        completion_time, weights = True, {**(weights or {}), "speed": float(speed_weight)}
    else:
        group_size = None
    return ProcessRequest.model_construct(instance=dict(instance), sampling_params=dict(sampling_params or {}),
                                          job_id=job_id, group_id=group_id,
                                          timeout_s=None if timeout_s is None else float(timeout_s),
                                          completion_time=completion_time, group_size=group_size,
                                          reward_weights=weights)


def filtered_result(job_id: str, failure_kind: str, error: str, critical_error: Optional[str] = "run",
                    handler: str = "") -> JobResult:
    """A :class:`JobResult` for a job that produced nothing to train on (``filter: true``), made by the client
    when the server gave no result (``trajectory_id`` is the job id)."""
    return JobResult(job_id=job_id, trajectory_id=job_id, handler=handler, reward=0.0, resolved=False,
                     critical_error=critical_error, failure_kind=failure_kind, filter=True, error=error)


@dataclass
class Attempt:
    """One submission of :meth:`JobSubmitter.run`: the job id, the server, and why it was not kept (its
    ``failure_kind`` and ``error``), for logs and training metadata."""

    job_id: str
    server: str
    failure_kind: Optional[str] = None
    error: Optional[str] = None


@dataclass
class JobOutcome:
    """What :meth:`JobSubmitter.run` ended with: the last ``result`` (filtered when every attempt was), its
    ``server``, and every filtered attempt before it (``attempts``)."""

    result: JobResult
    server: str
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def filtered(self) -> bool:
        return bool(self.result.filter)


class JobSubmitter:
    """Submits jobs to rollout servers over one aiohttp session (see the module docstring for the rules).

    Args:
        headers: sent with every request (the bearer token).
        session: an open session to use (not closed here); default: one opened on first use.
        unavailable_retry_s: how long a 503 is offered again on the same server (seconds; 0: not at all).
        request_timeout_s: wall-clock limit of one attempt, queue waits included (None: none).
        cancel_patience_s: how long a cancel retries a 404 for a job whose request is not open here.
        max_connections: connections of the session opened here at most (0, the default: no cap; see
            :data:`DEFAULT_MAX_CONNECTIONS`); a ``session`` given keeps its own.
        fleet: the :class:`trainer_plugins.fleet.Fleet` the servers come from (set by :meth:`run` when it is
            given one): a server that fails a request or answers 503 ``draining`` is taken out of it, and an open
            request to a server whose lease ran out ends at once as a filtered result.

    Raises:
        ValueError: ``max_connections`` is negative.
    """

    def __init__(self, headers: Optional[Mapping[str, str]] = None, *,
                 session: Optional[aiohttp.ClientSession] = None, unavailable_retry_s: float = 120.0,
                 request_timeout_s: Optional[float] = None, cancel_patience_s: float = 5.0,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, fleet: Optional[Fleet] = None) -> None:
        if max_connections < 0:
            raise ValueError(f"max_connections must be >= 0 (0: no cap), got {max_connections}")
        self.max_connections = max_connections
        self.fleet = fleet
        self._lease_watch: Optional[asyncio.Task] = None
        self.headers = dict(headers or {})
        self._session = session
        self._own_session = session is None
        self.unavailable_retry_s = unavailable_retry_s
        self.request_timeout_s = request_timeout_s
        self.cancel_patience_s = cancel_patience_s
        self.chooser: ServerChooser = LeastInFlight()  # run()'s default
        self._open: dict[str, _OpenJob] = {}  # job id -> its /process request while submit() runs
        self._cancelled: "OrderedDict[str, None]" = OrderedDict()  # tombstones, see the module docstring

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = open_session(self.headers, max_connections=self.max_connections)
            self._own_session = True
        return self._session

    async def close(self) -> None:
        if self._lease_watch is not None:
            self._lease_watch.cancel()
            await asyncio.gather(self._lease_watch, return_exceptions=True)
            self._lease_watch = None
        if self._own_session and self._session is not None:
            await self._session.close()
        self._session = None

    async def __aenter__(self) -> "JobSubmitter":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def open_jobs(self) -> list[tuple[str, str]]:
        """``(server, job_id)`` of every job whose ``/process`` request is open in this client."""
        return [(o.server, job_id) for job_id, o in self._open.items() if not o.ended.is_set()]

    # ------------------------------------------------------------------ one attempt
    async def submit(self, server: str, request: ProcessRequest, *, what: str = "") -> JobResult:
        """``POST {server}/process`` with ``request`` (which carries its ``job_id``) -> the job result.

        Args:
            what: how to name the instance in an :class:`InvalidInstanceError` (e.g. the prompt).

        Returns:
            the server's result, or a filtered result (``failure_kind`` ``rollout_server`` / ``timeout`` /
            ``cancelled``).
        Raises:
            ValueError: the request has no ``job_id``. InvalidInstanceError, RolloutAuthError: see the module
            docstring. CancelledError: the job was cancelled on the server first.
        """
        job_id = request.job_id
        if not job_id:
            raise ValueError("the request needs a job_id (so the job can be cancelled)")
        if job_id in self._open:
            raise ValueError(f"job {job_id} is already open in this client")
        state = self._open[job_id] = _OpenJob(server)
        try:
            try:
                return await asyncio.wait_for(self._watched(state, request, what), self.request_timeout_s)
            except asyncio.CancelledError:
                state.ended.set()  # the request was aborted: a 404 now is waited for only cancel_patience_s
                await asyncio.shield(self._cancel_on_server(server, job_id))
                raise
            except asyncio.TimeoutError:
                state.ended.set()
                await asyncio.shield(self._cancel_on_server(server, job_id))
                return filtered_result(job_id, "timeout", f"no result from {server} within request_timeout_s="
                                       f"{self.request_timeout_s} s; cancelled", critical_error="timeout",
                                       handler=_handler(request))
        finally:
            state.ended.set()
            self._open.pop(job_id, None)

    def was_cancelled(self, job_id: str) -> bool:
        """True when :meth:`cancel` was called for ``job_id`` (remembered for the last 65536 cancels; a
        cancel this client sends itself, for a timeout or a cancelled caller, does not count)."""
        return job_id in self._cancelled

    async def _process(self, state: "_OpenJob", request: ProcessRequest, what: str) -> JobResult:
        job_id, server = str(request.job_id), state.server
        body = request.model_dump(mode="json", exclude_none=True)
        deadline = time.monotonic() + self.unavailable_retry_s
        while True:
            if job_id in self._cancelled:  # cancelled before it was sent: never sent
                return filtered_result(job_id, "cancelled", "cancelled by the client before it was sent to "
                                       f"{server}", critical_error="cancelled", handler=_handler(request))
            try:
                state.sent = True
                async with self.session.post(f"{server}/process", json=body) as r:
                    status = r.status
                    data = await r.json(content_type=None)
                state.answered = True
            except (aiohttp.ClientError, OSError, ValueError) as e:  # refused, reset, died, not JSON
                log.warning("job %s on %s: no answer (%r)", job_id, server, e)
                if self.fleet is not None and not isinstance(e, ValueError):
                    self.fleet.mark_failed(server, repr(e))
                return filtered_result(job_id, ROLLOUT_SERVER, f"rollout server {server} did not answer: {e!r}",
                                       handler=_handler(request))
            if status == 503 and _error_type(data) == "draining":  # it leaves: the job goes elsewhere at once
                if self.fleet is not None:
                    self.fleet.mark_draining(server)
                return filtered_result(job_id, DRAINING, f"rollout server {server} is draining (it took no "
                                       "new job): submit elsewhere", handler=_handler(request))
            # 503: no LLM backend registered yet (or a swap), or the server is stopped: offered again.
            if status == 503 and time.monotonic() < deadline:
                state.sent = state.answered = False  # the server did not take the job
                await asyncio.sleep(0.25)
                continue
            break
        message = _error_message(data)
        if status == 410 and _error_type(data) == "result_expired":
            return filtered_result(job_id, EXPIRED, f"rollout server {server}: {message}", critical_error=None,
                                   handler=_handler(request))
        if status in (401, 403):
            raise RolloutAuthError(f"rollout server {server} refused our bearer token (HTTP {status}): {message}")
        if 400 <= status < 500 and _error_type(data) == "handler_unavailable":
            raise HandlerUnavailableError(f"rollout server {server} cannot run the {_handler(request)!r} handler "
                                          f"(HTTP {status} handler_unavailable): {message}")
        if 400 <= status < 500 and _error_type(data) == "unknown_handler":
            raise UnknownHandlerError(f"rollout server {server} has no {_handler(request)!r} handler "
                                      f"(HTTP {status} unknown_handler), for {what or 'the instance'}: {message}")
        if status == 409 and _error_type(data) == "group_full":  # a member of its group still runs (#35): it ends
            return filtered_result(job_id, ROLLOUT_SERVER, f"rollout server {server}: {message}",
                                   handler=_handler(request))
        if 400 <= status < 500 and status not in (408, 429):
            raise InvalidInstanceError(f"rollout server {server} refused {what or 'the instance'}: HTTP {status} "
                                       f"{message}")
        if status != 200:
            return filtered_result(job_id, ROLLOUT_SERVER, f"rollout server {server} answered HTTP {status}: "
                                   f"{message}", handler=_handler(request))
        try:
            result = JobResult.model_validate(data)
        except pydantic.ValidationError as e:
            return filtered_result(job_id, ROLLOUT_SERVER, f"rollout server {server} answered 200 with no job "
                                   f"result ({e.error_count()} error(s): {e.errors()[0]['msg']}): {message}",
                                   handler=_handler(request))
        if result.failure_kind == "configuration":  # the server cannot run any job like it: stop, never retry
            raise ConfigurationError(f"rollout server {server} cannot run the {_handler(request)!r} handler's "
                                     f"jobs: {result.error}")
        if result.failure_kind == "invalid_instance":
            raise InvalidInstanceError(f"the {_handler(request)!r} handler refused {what or 'the instance'} "
                                       f"(instance fields: {sorted(request.instance)}): {result.error}")
        return result

    async def _watched(self, state: "_OpenJob", request: ProcessRequest, what: str) -> JobResult:
        """:meth:`_process`, ended early with a filtered result when the server's fleet lease runs out (a node
        lost without a TCP reset would leave the request open forever)."""
        if self.fleet is None:
            return await self._process(state, request, what)
        self._watch_leases()
        state.lost = asyncio.Event()
        proc = asyncio.ensure_future(self._process(state, request, what))
        lost = asyncio.ensure_future(state.lost.wait())
        try:
            await asyncio.wait({proc, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
            if not proc.done():
                proc.cancel()
                await asyncio.gather(proc, return_exceptions=True)
        if not proc.cancelled():
            return proc.result()
        log.warning("job %s on %s: the server left the fleet (lease ran out, or silent): resubmittable",
                    request.job_id, state.server)
        return filtered_result(str(request.job_id), ROLLOUT_SERVER, f"rollout server {state.server} left the fleet "
                               "(its lease ran out, or it stopped answering health probes) while it held the job",
                               handler=_handler(request))

    def _watch_leases(self) -> None:
        if self._lease_watch is None or self._lease_watch.done():
            self._lease_watch = asyncio.create_task(self._lease_watch_forever(), name="fleet-lease-watch")

    async def _lease_watch_forever(self) -> None:
        """Every ``fleet.poll_s``: end the open requests to servers whose lease ran out."""
        while self._open:
            fleet = self.fleet
            if fleet is not None:
                lost: dict[str, bool] = {}
                for o in list(self._open.values()):
                    if o.lost is not None and not o.lost.is_set():
                        if o.server not in lost:
                            lost[o.server] = fleet.is_lost(o.server)
                        if lost[o.server]:
                            o.lost.set()
            await asyncio.sleep(fleet.poll_s if fleet is not None else 0.25)

    # ------------------------------------------------------------------ cancel
    async def cancel(self, server: str, job_id: str) -> bool:
        """Cancel the job ``job_id`` on ``server`` (the rule is in the module docstring).

        Returns:
            True when the server stopped the job, or the request was never sent; False when the job had
            already ended, the server is gone, or it refused (logged, never raised: cancelling is best effort).
        """
        self._cancelled[job_id] = None
        self._cancelled.move_to_end(job_id)
        while len(self._cancelled) > _TOMBSTONES:
            self._cancelled.popitem(last=False)
        return await self._cancel_on_server(server, job_id)

    async def _cancel_on_server(self, server: str, job_id: str) -> bool:
        """Steps 2-4 of the cancel rule (the module docstring); :meth:`cancel` without the tombstone."""
        state = self._open.get(job_id)
        deadline = time.monotonic() + self.cancel_patience_s
        pause = 0.05
        body = CancelRequest(job_id=job_id).model_dump(mode="json")
        while True:
            if state is None:  # a submit that had not started when the cancel came may have started since
                state = self._open.get(job_id)
            if state is not None and state.ended.is_set():
                if not state.sent:
                    return True  # the tombstone kept the request from being sent
                if state.answered:
                    return False  # the server answered the request: the job ended before the cancel took
            elif state is not None and not state.sent:
                # not sent (yet, or between 503 retries): the tombstone stops it before it is sent
                await _wait(state.ended, pause)
                continue
            try:
                async with self.session.post(f"{server}/cancel", json=body,
                                             timeout=aiohttp.ClientTimeout(total=10)) as r:
                    if r.status == 200:
                        return True
                    if r.status != 404:
                        log.warning("cancel %s on %s: HTTP %d", job_id, server, r.status)
                        return False
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
                log.warning("cancel %s on %s: %r", job_id, server, e)
                return False
            if state is not None and not state.ended.is_set():
                # 404 while our request is open: it has not reached the server yet; ask again until it has
                await _wait(state.ended, pause)
                pause = min(1.0, pause * 2)
                continue
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)

    async def cancel_open(self) -> int:
        """Cancel every job whose request is open in this client (see :meth:`cancel`); their callers get the
        cancelled results. Returns how many the servers stopped."""
        done = await asyncio.gather(*(self.cancel(server, job_id) for server, job_id in self.open_jobs()))
        return sum(done)

    # ------------------------------------------------------------------ attempts with retries
    def retry_server(self, servers: Sequence[str], group_id: Optional[str], failed_on: set[str],
                     chooser: Optional[ServerChooser] = None) -> str:
        """The server of a sample's next attempt: the chooser's pick with every server in ``failed_on`` (where
        the sample's earlier attempts were filtered) excluded while another is left."""
        return (chooser or self.chooser).choose(servers, group_id, frozenset(failed_on))

    async def run(self, servers: Sequence[str], request: ProcessRequest, *, max_sample_retries: int = 2,
                  chooser: Optional[ServerChooser] = None, what: str = "", job_prefix: str = "job") -> JobOutcome:
        """Run one sample to a result worth training on, or give up after ``max_sample_retries``
        re-submissions of filtered results (the retry and failover rule of the module docstring).

        Args:
            servers: rollout server URLs. request: the ``/process`` body; each attempt gets the job id
                ``{job_prefix}-{random}``. chooser: picks each attempt's server (default: this client's
                :class:`~trainer_plugins.admission.LeastInFlight`); told when each job starts and ends.
        Raises:
            ValueError: no server, or ``max_sample_retries`` < 0. InvalidInstanceError, RolloutAuthError,
            CancelledError: as :meth:`submit`.
        """
        if max_sample_retries < 0:
            raise ValueError("max_sample_retries must be >= 0")
        if isinstance(servers, Fleet):  # follow the fleet: each attempt picks among its members of that moment
            if self.fleet is None:
                self.fleet = servers
            if not servers and not await servers.wait_for_members(self.unavailable_retry_s):
                raise ValueError(f"no rollout server in the fleet {servers.fleet_dir} after "
                                 f"{self.unavailable_retry_s:g} s")
        if not servers:
            raise ValueError("no rollout server given")
        chooser = chooser or self.chooser
        failed_on: set[str] = set()
        attempts: list[Attempt] = []
        retries = 0  # attempts that used up a retry (a drain refusal does not: uses_retry)
        while True:
            # one snapshot per attempt: a fleet's members change under us (its reading thread)
            candidates = list(servers) or _fallback(servers)
            if not candidates and isinstance(servers, Fleet):
                await servers.wait_for_members(self.unavailable_retry_s)
                candidates = list(servers) or _fallback(servers)
            if not candidates and isinstance(servers, Fleet) and attempts:
                # every member drained or is out after this sample was tried: its result, not an exception that
                # would end the caller's run without a word about the other samples (red team F10)
                last = attempts[-1]
                result = filtered_result(last.job_id, ROLLOUT_SERVER,
                                         f"no rollout server left in the fleet {servers.fleet_dir} after "
                                         f"{self.unavailable_retry_s:g} s (every member drained or is out); "
                                         f"the last attempt: {last.failure_kind}: {last.error}")
                return JobOutcome(result=result, server=last.server, attempts=attempts)
            if not candidates:
                raise ValueError("no rollout server left to choose from")
            server = self.retry_server(candidates, request.group_id, failed_on, chooser)
            job_id = f"{job_prefix}-{uuid.uuid4().hex[:16]}"
            chooser.started(server, request.group_id)
            try:
                result = await self.submit(server, request.model_copy(update={"job_id": job_id}), what=what)
            finally:
                chooser.finished(server, request.group_id)
            counted = uses_retry(result, server, failed_on)
            if not result.filter or (counted and retries >= max_sample_retries) or self.was_cancelled(job_id) \
                    or never_rerun(result):
                return JobOutcome(result=result, server=server, attempts=attempts)
            attempts.append(Attempt(job_id=job_id, server=server, failure_kind=result.failure_kind,
                                    error=result.error))
            # a completion-time member goes back to the server holding its group (which waits for the
            # replacement, #35) unless that server is the fault: elsewhere it would be a group of its own
            if not request.completion_time or result.failure_kind in (ROLLOUT_SERVER, DRAINING):
                failed_on.add(server)
            retries += counted
            log.warning("job %s (%s) on %s must not be trained on (failure_kind=%s: %s); re-submitting", job_id,
                        what or "instance", server, result.failure_kind, result.error)


@dataclass
class _OpenJob:
    """A ``/process`` request of :meth:`JobSubmitter.submit`: ``sent`` once it went out (reset when the server
    answered 503: it did not take the job), ``answered`` once the server answered, ``ended`` when submit is
    done with it (answered, aborted, timed out, or stopped unsent)."""

    server: str
    sent: bool = False
    answered: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    lost: Optional[asyncio.Event] = None  # set when the server's fleet lease ran out (fleet only)


async def _wait(event: asyncio.Event, timeout_s: float) -> None:
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except asyncio.TimeoutError:
        pass


def never_rerun(result: JobResult) -> bool:
    """True for a result whose job must not be submitted again: it finished once already (``expired``)."""
    return result.failure_kind == EXPIRED


def uses_retry(result: JobResult, server: str, failed_on: AbstractSet[str]) -> bool:
    """Whether the filtered ``result`` of an attempt on ``server`` counts against ``max_sample_retries``: every
    one does but a ``draining`` refusal from a server the sample had not been filtered on yet (``failed_on``,
    before this attempt) -- a drain is no fault, and the next attempt has another server to go to."""
    return not (result.failure_kind == DRAINING and server not in failed_on)


def _fallback(servers: Sequence[str]) -> Sequence[str]:
    """Servers to pick from when a fleet has no routable member: those with a live lease (a job sent to one
    fails fast and comes back filtered), else the empty list (the chooser then raises ValueError)."""
    return servers.known_urls() if isinstance(servers, Fleet) else servers


def _handler(request: ProcessRequest) -> str:
    ds = request.instance.get("data_source") if isinstance(request.instance, Mapping) else None
    return ds if isinstance(ds, str) else ""


def _error_type(data: Any) -> Optional[str]:
    """``error.type`` of a 4xx body (``{"error": {"type", "message", "field"?}}``), or None."""
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        t = data["error"].get("type")
        return t if isinstance(t, str) else None
    return None


def _error_message(data: Any) -> str:
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return str(data["error"].get("message") or data["error"])
    return str(data)[:2000]
