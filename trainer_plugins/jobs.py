"""Submit, cancel and retry jobs on rollout servers: the one behaviour every trainer plugin shares.

:class:`JobSubmitter` is the one implementation of submit, cancel and retry:
:class:`trainer_plugins.client.RolloutClient`, the TRL plugin (:mod:`trainer_plugins.trl`) and the verl
plugin's agent loop (:mod:`trainer_plugins.verl.agent_loop`) all go through it. What it does with each answer:

======================================  ==================================================================
the rollout server answers              outcome
======================================  ==================================================================
200 with a job result                   the result (``filter: true`` in it: not to be trained on; see below)
200, ``failure_kind: invalid_instance``  :class:`InvalidInstanceError` naming the instance (retrying cannot help)
503 (no LLM backend yet, stopped)       offered again on the same server every 0.25 s for
                                        ``unavailable_retry_s``, then a filtered ``rollout_server`` result
401 / 403                               :class:`RolloutAuthError` (the token is wrong: a configuration error)
any other 4xx but 408 / 429             :class:`InvalidInstanceError` naming the instance and the server's reason
408, 429, other 5xx                     a filtered ``rollout_server`` result (another attempt, elsewhere)
no answer (refused, reset, died)        a filtered ``rollout_server`` result
no result within ``request_timeout_s``  the job is cancelled on the server; a filtered ``timeout`` result
the caller is cancelled                 the job is cancelled on the server (shielded), then CancelledError
======================================  ==================================================================

A *filtered result* is the server's own shape (``job_id, reward 0.0, critical_error, error, failure_kind,
filter: true, trajectories: []``), so callers treat a dead server exactly like a job the server failed.
:meth:`JobSubmitter.run` retries filtered results up to ``max_sample_retries`` times, each attempt a new job
id, the next one on another server when the previous server did not answer; RolloutClient regenerates them
itself (group-aware) with :meth:`JobSubmitter.submit` and the same rules.

Cancel (:meth:`JobSubmitter.cancel`): ``POST /cancel {job_id}``; a 404 (the ``/process`` request has not
reached the server yet) is retried every 50 ms for ``patience_s``.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import aiohttp

log = logging.getLogger(__name__)


class InvalidInstanceError(ValueError):
    """The rollout server refused an instance (4xx) or its handler did (``failure_kind="invalid_instance"``).
    The message names the instance (``what``: the caller's description, e.g. the prompt or the dataset row)
    and the server's reason. Retrying cannot help: it is the dataset's or the mapping's fault."""


class RolloutAuthError(RuntimeError):
    """A rollout server refused the bearer token (401/403)."""


def filtered_result(job_id: str, failure_kind: str, error: str, critical_error: str = "run") -> dict[str, Any]:
    """A job result in the server's shape for a job that produced nothing to train on (``filter: true``)."""
    return {"job_id": job_id, "reward": 0.0, "resolved": False, "critical_error": critical_error,
            "failure_kind": failure_kind, "filter": True, "trajectories": [], "error": error}


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
    """What :meth:`JobSubmitter.run` ended with: the last ``result`` (filtered when every attempt was) and
    every ``attempts`` entry before it that was filtered."""

    result: dict[str, Any]
    server: str
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def filtered(self) -> bool:
        return bool(self.result.get("filter"))


class JobSubmitter:
    """Submits jobs to rollout servers over one aiohttp session (see the module docstring for the rules).

    Args:
        headers: sent with every request (the bearer token).
        session: an open session to use (not closed here); default: one opened on first use.
        unavailable_retry_s: how long a 503 is offered again on the same server (seconds).
        request_timeout_s: wall-clock limit of one attempt, queue waits included (None: none).
        cancel_patience_s: how long a cancel retries a 404.
    """

    def __init__(self, headers: Optional[Mapping[str, str]] = None, *,
                 session: Optional[aiohttp.ClientSession] = None, unavailable_retry_s: float = 120.0,
                 request_timeout_s: Optional[float] = None, cancel_patience_s: float = 5.0) -> None:
        self.headers = dict(headers or {})
        self._session = session
        self._own_session = session is None
        self.unavailable_retry_s = unavailable_retry_s
        self.request_timeout_s = request_timeout_s
        self.cancel_patience_s = cancel_patience_s

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers=self.headers,
                                                  timeout=aiohttp.ClientTimeout(total=None, sock_connect=30))
            self._own_session = True
        return self._session

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
        self._session = None

    async def __aenter__(self) -> "JobSubmitter":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ------------------------------------------------------------------ one attempt
    async def submit(self, server: str, body: Mapping[str, Any], *, what: str = "",
                     cancelled: Callable[[], bool] = lambda: False) -> dict[str, Any]:
        """``POST {server}/process`` with ``body`` (which carries its ``job_id``) -> the job result.

        Args:
            what: how to name the instance in an :class:`InvalidInstanceError` (e.g. the prompt).
            cancelled: stops the 503 retries (the caller already cancelled the job).

        Returns:
            the server's result, or a filtered result (``failure_kind`` ``rollout_server`` / ``timeout``).
        Raises:
            InvalidInstanceError, RolloutAuthError: see the module docstring. CancelledError: the job was
            cancelled on the server first.
        """
        job_id = str(body.get("job_id") or "")
        if not job_id:
            raise ValueError("body needs a job_id (so the job can be cancelled)")
        try:
            return await asyncio.wait_for(self._process(server, body, what, cancelled), self.request_timeout_s)
        except asyncio.CancelledError:
            await asyncio.shield(self.cancel(server, job_id))
            raise
        except asyncio.TimeoutError:
            await asyncio.shield(self.cancel(server, job_id))
            return filtered_result(job_id, "timeout", f"no result from {server} within request_timeout_s="
                                   f"{self.request_timeout_s} s; cancelled", critical_error="timeout")

    async def _process(self, server: str, body: Mapping[str, Any], what: str,
                       cancelled: Callable[[], bool]) -> dict[str, Any]:
        job_id = str(body["job_id"])
        deadline = time.monotonic() + self.unavailable_retry_s
        while True:
            try:
                async with self.session.post(f"{server}/process", json=body) as r:
                    status = r.status
                    data = await r.json(content_type=None)
            except (aiohttp.ClientError, OSError, ValueError) as e:  # refused, reset, died, not JSON
                log.warning("job %s on %s: no answer (%r)", job_id, server, e)
                return filtered_result(job_id, "rollout_server", f"rollout server {server} did not answer: {e!r}")
            # 503: no LLM backend registered yet (or a swap), or the server is stopped: offered again.
            if status == 503 and not cancelled() and time.monotonic() < deadline:
                await asyncio.sleep(0.25)
                continue
            break
        message = _error_message(data)
        if status in (401, 403):
            raise RolloutAuthError(f"rollout server {server} refused our bearer token (HTTP {status}): {message}")
        if 400 <= status < 500 and status not in (408, 429):
            raise InvalidInstanceError(f"rollout server {server} refused {what or 'the instance'}: HTTP {status} "
                                       f"{message}")
        if status != 200 or not isinstance(data, dict):
            return filtered_result(job_id, "rollout_server", f"rollout server {server} answered HTTP {status}: "
                                   f"{message}")
        if data.get("failure_kind") == "invalid_instance":
            raise InvalidInstanceError(f"the {_handler(body)!r} handler refused {what or 'the instance'} "
                                       f"(instance fields: {sorted(body.get('instance') or {})}): {data.get('error')}")
        return data

    # ------------------------------------------------------------------ cancel
    async def cancel(self, server: str, job_id: str, done: Callable[[], bool] = lambda: False) -> bool:
        """``POST {server}/cancel``; True when the server took it. A 404 is retried for ``cancel_patience_s``
        (until ``done()``); other failures are logged, never raised (cancelling is best effort)."""
        deadline = time.monotonic() + self.cancel_patience_s
        while not done():
            try:
                async with self.session.post(f"{server}/cancel", json={"job_id": job_id},
                                             timeout=aiohttp.ClientTimeout(total=10)) as r:
                    if r.status == 200:
                        return True
                    if r.status != 404:
                        log.warning("cancel %s on %s: HTTP %d", job_id, server, r.status)
                        return False
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
                log.warning("cancel %s on %s: %r", job_id, server, e)
                return False
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return False

    # ------------------------------------------------------------------ attempts with retries
    async def run(self, servers: Sequence[str], body: Mapping[str, Any], *, max_sample_retries: int = 2,
                  pick: Optional[Callable[[Sequence[str], set[str]], str]] = None, what: str = "",
                  job_prefix: str = "job") -> JobOutcome:
        """Run one sample to a result worth training on, or give up after ``max_sample_retries``
        re-submissions of filtered results.

        Args:
            servers: rollout server URLs. body: ``/process`` body without ``job_id`` (each attempt gets
                ``{job_prefix}-{random}``).
            pick: ``pick(servers, unreachable) -> url``; default: the first server not found unreachable by
                this sample (servers that did not answer are skipped while another is left).
        Raises:
            InvalidInstanceError, RolloutAuthError, CancelledError: as :meth:`submit`.
        """
        if max_sample_retries < 0:
            raise ValueError("max_sample_retries must be >= 0")
        if not servers:
            raise ValueError("no rollout server given")
        unreachable: set[str] = set()
        attempts: list[Attempt] = []
        while True:
            server = (pick or _first_reachable)(servers, unreachable)
            job_id = f"{job_prefix}-{uuid.uuid4().hex[:16]}"
            result = await self.submit(server, {**body, "job_id": job_id}, what=what)
            if not result.get("filter") or len(attempts) >= max_sample_retries:
                return JobOutcome(result=result, server=server, attempts=attempts)
            attempts.append(Attempt(job_id=job_id, server=server, failure_kind=result.get("failure_kind"),
                                    error=result.get("error")))
            if result.get("failure_kind") == "rollout_server":
                unreachable.add(server)
            log.warning("job %s (%s) on %s must not be trained on (failure_kind=%s: %s); re-submitting", job_id,
                        what or "instance", server, result.get("failure_kind"), result.get("error"))


def _first_reachable(servers: Sequence[str], unreachable: set[str]) -> str:
    return next((s for s in servers if s not in unreachable), servers[0])


def _handler(body: Mapping[str, Any]) -> Any:
    inst = body.get("instance")
    return inst.get("data_source") if isinstance(inst, Mapping) else None


def _error_message(data: Any) -> str:
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return str(data["error"].get("message") or data["error"])
    return str(data)[:2000]
