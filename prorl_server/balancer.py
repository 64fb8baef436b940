"""LLM backend pool: least-loaded routing over a min-heap keyed by in-flight jobs, sticky per job.

A job is assigned one backend for its whole life (all its LLM calls go there, so the backend's prefix cache
is reused across turns). The backend's in-flight count is incremented at assignment and decremented when the
job ends. Unhealthy backends leave the heap; a health probe (``GET {address}/health``, vLLM's liveness
route) puts them back when they answer again.

The heap holds ``(in_flight, seq, address)`` entries with lazy invalidation: every count change pushes a fresh
entry and stale ones are skipped when popped, so acquire/release are O(log n).
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
from dataclasses import dataclass, field
from typing import Optional

import aiohttp

from prorl_server.types import BackendInfo

log = logging.getLogger(__name__)


class NoBackendError(RuntimeError):
    """Raised when no healthy LLM backend is registered (HTTP 503 at the API)."""


@dataclass
class Backend:
    """One OpenAI-compatible inference server (vLLM/SGLang), e.g. ``http://127.0.0.1:8000``."""

    address: str
    weight_version: Optional[int] = None
    in_flight: int = 0
    healthy: bool = True
    consecutive_failures: int = 0
    jobs: set[str] = field(default_factory=set)

    def info(self) -> BackendInfo:
        return BackendInfo(address=self.address, in_flight=self.in_flight, healthy=self.healthy,
                           weight_version=self.weight_version)


class BackendPool:
    """Min-heap of backends keyed by in-flight jobs; one backend per job (sticky).

    Args:
        on_change: optional callback ``(backend) -> None`` called after a count/health change (metrics).
    """

    def __init__(self, on_change=None) -> None:
        self._backends: dict[str, Backend] = {}
        self._heap: list[tuple[int, int, str]] = []
        self._seq = itertools.count()
        self._by_job: dict[str, Backend] = {}
        self._available = asyncio.Event()
        self._on_change = on_change

    # ------------------------------------------------------------------ registration
    def add(self, address: str, weight_version: Optional[int] = None) -> Backend:
        """Register ``address`` (idempotent: re-adding updates the weight version and marks it healthy)."""
        address = address.rstrip("/")
        b = self._backends.get(address)
        if b is None:
            b = Backend(address=address, weight_version=weight_version)
            self._backends[address] = b
        else:
            if weight_version is not None:
                b.weight_version = weight_version
            b.healthy = True
            b.consecutive_failures = 0
        self._push(b)
        return b

    def clear(self) -> int:
        """Forget every backend. Jobs that hold one keep it until they end. Returns how many were removed."""
        n = len(self._backends)
        self._backends.clear()
        self._heap.clear()
        self._available.clear()
        return n

    def __len__(self) -> int:
        return sum(1 for b in self._backends.values() if b.healthy)

    @property
    def backends(self) -> list[Backend]:
        return list(self._backends.values())

    def get(self, address: str) -> Optional[Backend]:
        return self._backends.get(address.rstrip("/"))

    # ------------------------------------------------------------------ heap
    def _push(self, b: Backend) -> None:
        if b.healthy and self._backends.get(b.address) is b:
            heapq.heappush(self._heap, (b.in_flight, next(self._seq), b.address))
            self._available.set()
        if self._on_change:
            self._on_change(b)

    def _pop_least_loaded(self) -> Optional[Backend]:
        while self._heap:
            in_flight, _, address = self._heap[0]
            b = self._backends.get(address)
            if b is None or not b.healthy or b.in_flight != in_flight:
                heapq.heappop(self._heap)  # stale entry
                continue
            return b
        self._available.clear()
        return None

    # ------------------------------------------------------------------ assignment
    def assign(self, job_id: str, exclude: frozenset[str] = frozenset()) -> Backend:
        """Give ``job_id`` the least-loaded healthy backend (or the one it already holds: sticky).

        Raises:
            NoBackendError: no healthy backend outside ``exclude``.
        """
        held = self._by_job.get(job_id)
        if held is not None and held.address not in exclude:
            return held
        b = self._pop_least_loaded()
        if b is not None and b.address in exclude:
            candidates = [c for c in self._backends.values() if c.healthy and c.address not in exclude]
            b = min(candidates, key=lambda c: c.in_flight, default=None)
        if b is None:
            raise NoBackendError("no healthy LLM backend is registered (POST /add_llm_server)")
        if held is not None:
            self.release(job_id)
        b.in_flight += 1
        b.jobs.add(job_id)
        self._by_job[job_id] = b
        self._push(b)
        return b

    async def acquire(self, job_id: str, wait_s: float = 0.0,
                      exclude: frozenset[str] = frozenset()) -> Backend:
        """Like :meth:`assign`, but waits up to ``wait_s`` seconds for a backend to be registered (the
        trainer clears and re-adds backends around every weight update)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            try:
                return self.assign(job_id, exclude)
            except NoBackendError:
                remaining = deadline - loop.time()
                if remaining <= 0 or any(b.healthy for b in self._backends.values()):
                    raise  # healthy backends exist but are all excluded: waiting would not help
                self._available.clear()
                try:
                    await asyncio.wait_for(self._available.wait(), min(remaining, 1.0))
                except asyncio.TimeoutError:
                    pass

    def holder(self, job_id: str) -> Optional[Backend]:
        return self._by_job.get(job_id)

    def release(self, job_id: str) -> None:
        """The job ended (or moved): decrement its backend's in-flight count. Idempotent."""
        b = self._by_job.pop(job_id, None)
        if b is None:
            return
        b.jobs.discard(job_id)
        b.in_flight = max(0, b.in_flight - 1)
        self._push(b)

    def mark_unhealthy(self, address: str, reason: str = "") -> None:
        """Take a backend out of rotation (its jobs may retry elsewhere with ``assign(exclude=...)``)."""
        b = self.get(address)
        if b is not None and b.healthy:
            log.warning("backend %s marked unhealthy: %s", address, reason)
            b.healthy = False
            if self._on_change:
                self._on_change(b)

    def report_failure(self, address: str, reason: str = "", threshold: int = 2) -> None:
        """A request to ``address`` failed to connect: after ``threshold`` such failures in a row the backend
        leaves rotation (one dropped keep-alive connection does not take the only backend out)."""
        b = self.get(address)
        if b is None:
            return
        b.consecutive_failures += 1
        if b.consecutive_failures >= threshold:
            self.mark_unhealthy(address, f"{b.consecutive_failures} failures in a row; last: {reason}")

    def report_success(self, address: str) -> None:
        """A request to ``address`` succeeded: its failure streak is over."""
        b = self._backends.get(address)
        if b is not None:
            b.consecutive_failures = 0

    def mark_healthy(self, address: str) -> None:
        b = self.get(address)
        if b is not None:
            b.consecutive_failures = 0
            if not b.healthy:
                log.info("backend %s is healthy again", address)
                b.healthy = True
            self._push(b)

    # ------------------------------------------------------------------ health probing
    async def probe_once(self, session: aiohttp.ClientSession, timeout_s: float = 5.0,
                         failures_to_remove: int = 2) -> None:
        """Probe every backend's ``/health`` once; remove after ``failures_to_remove`` failures in a row."""

        async def probe(b: Backend) -> None:
            try:
                async with session.get(f"{b.address}/health",
                                       timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                    ok = r.status < 500
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                ok = False
            if ok:
                self.mark_healthy(b.address)
            else:
                b.consecutive_failures += 1
                if b.consecutive_failures >= failures_to_remove:
                    self.mark_unhealthy(b.address, "health probe failed")

        await asyncio.gather(*(probe(b) for b in list(self._backends.values())))

    async def probe_forever(self, session: aiohttp.ClientSession, interval_s: float,
                            failures_to_remove: int = 2) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.probe_once(session, failures_to_remove=failures_to_remove)
            except Exception:  # a probe bug must not kill the loop
                log.exception("health probe round failed")
