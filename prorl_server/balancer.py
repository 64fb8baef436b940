"""LLM backend pool: least-loaded routing over a min-heap keyed by in-flight jobs, sticky per job, with
group affinity and weight swaps that keep each backend's identity.

A job is assigned one backend for its whole life (all its LLM calls go there, so the backend's prefix cache
is reused across turns). The backend's in-flight count is incremented at assignment and decremented when the
job ends. Unhealthy backends leave the heap; a health probe (``GET {address}/health``, vLLM's liveness
route) puts them back when they answer again.

**Weight swaps** (ProRL Agent paper, section 3.3): after each weight update the
trainer clears the pool and re-registers its inference servers with the new ``weight_version``. A backend is
known by its address for the pool's whole life: :meth:`BackendPool.clear` takes backends out of the rotation
(no new assignment) but keeps their :class:`Backend` objects, and :meth:`BackendPool.add` of a known address
revives that same object with the new version. So a job holding it sees the new version on its next turn,
its in-flight count survives the swap (a release after the swap decrements the count the job incremented),
and a job holding a backend that is cleared and never re-added keeps using it until it ends. A job that needs
a backend while the rotation is empty waits (``acquire(wait_s=...)``) for the re-registration; one that
finds backends registered but all unhealthy (a crashed server) fails at once with their last errors.

**Group affinity**: the n samples of one prompt (a *group*, ``group_id``) share their prompt's prefix, so
the pool sends them to one backend when load allows (its prefix cache then holds the prompt once): a job of a
group goes to the backend that group's first job got if that backend's in-flight count is at most
``affinity_slack`` above the least-loaded healthy backend's; otherwise (or if that backend left the rotation)
to the least-loaded one, as any job. Each such decision is reported to ``on_affinity("hit" | "miss")``
(the first job of a group decides nothing and is not reported).

The heap holds ``(in_flight, seq, address)`` entries with lazy invalidation: every count change pushes a fresh
entry and stale ones are skipped when popped, so acquire/release are O(log n).
"""
from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

import aiohttp

from prorl_server.types import BackendInfo

log = logging.getLogger(__name__)

#: Default of ``affinity_slack`` (jobs): a group of up to 9 samples submitted together onto equally loaded
#: backends stays on one backend, and no backend runs more than 8 jobs above the least-loaded one for it.
DEFAULT_AFFINITY_SLACK = 8


class NoBackendError(RuntimeError):
    """Raised when no healthy LLM backend is registered (HTTP 503 at the API)."""


@dataclass(eq=False)
class Backend:
    """One OpenAI-compatible inference server (vLLM/SGLang), e.g. ``http://127.0.0.1:8000``.

    ``weight_version``: the trainer step of the weights it serves (None: unknown), updated in place when the
    address is re-registered. ``in_flight``: jobs assigned to it (cleared or not). ``registered``: in the
    pool's rotation (False after ``clear`` until re-added). Compared by identity: one object per address.
    """

    address: str
    weight_version: Optional[int] = None
    in_flight: int = 0
    healthy: bool = True
    registered: bool = True
    consecutive_failures: int = 0
    jobs: set[str] = field(default_factory=set)
    #: why it last left the rotation or failed a request (e.g. ``ClientConnectorError(...)``), None if never
    last_error: Optional[str] = None
    #: why a weight swap took it out (:meth:`BackendPool.withdraw`); None once registered again. Jobs holding
    #: a withdrawn backend move off it (a cleared one they keep).
    withdrawn: Optional[str] = None

    @property
    def in_rotation(self) -> bool:
        """May get new jobs: registered and healthy."""
        return self.registered and self.healthy

    def info(self) -> BackendInfo:
        return BackendInfo(address=self.address, in_flight=self.in_flight, healthy=self.healthy,
                           weight_version=self.weight_version)


class BackendPool:
    """Min-heap of backends keyed by in-flight jobs; one backend per job (sticky); group affinity.

    Args:
        on_change: optional callback ``(backend) -> None`` called after a count/health/registration change
            (metrics).
        affinity_slack: how many in-flight jobs (>= 0) a group's backend may have above the least-loaded
            healthy backend and still get the group's next job (0: only when it is tied for least-loaded).
        on_affinity: optional callback ``(outcome) -> None``, outcome ``"hit"`` (a group's job went to its
            group's backend) or ``"miss"`` (load or health sent it elsewhere).
        max_groups: groups whose backend is remembered (least recently used ones are forgotten first).
    """

    def __init__(self, on_change: Optional[Callable[[Backend], None]] = None, *,
                 affinity_slack: int = DEFAULT_AFFINITY_SLACK,
                 on_affinity: Optional[Callable[[str], None]] = None, max_groups: int = 100_000) -> None:
        if affinity_slack < 0:
            raise ValueError("affinity_slack must be >= 0")
        self._backends: dict[str, Backend] = {}  # registered: the rotation (healthy ones get jobs)
        self._known: dict[str, Backend] = {}  # every backend ever registered, by address, cleared or not
        self._heap: list[tuple[int, int, str]] = []
        self._seq = itertools.count()
        self._by_job: dict[str, Backend] = {}
        self._groups: collections.OrderedDict[str, str] = collections.OrderedDict()  # group -> address, LRU
        self._available = asyncio.Event()
        self._on_change = on_change
        self._on_affinity = on_affinity
        self.affinity_slack = affinity_slack
        self.max_groups = max_groups
        self.affinity = {"hit": 0, "miss": 0}
        self._unheld = asyncio.Event()  # clear while a weight swap holds new LLM calls
        self._unheld.set()

    # ------------------------------------------------------------------ registration
    def add(self, address: str, weight_version: Optional[int] = None) -> Backend:
        """Register ``address`` (idempotent). A known address (registered now, or before a :meth:`clear`) is
        the same :class:`Backend` object: its ``weight_version`` is updated in place (``None`` keeps the
        version it has), it is marked healthy and returns to the rotation with its in-flight count.

        Returns:
            the backend (the same object for the same address over the pool's life).
        """
        address = address.rstrip("/")
        b = self._known.get(address)
        if b is None:
            b = Backend(address=address, weight_version=weight_version)
            self._known[address] = b
        else:
            if weight_version is not None:
                b.weight_version = weight_version
            b.healthy = True
            b.consecutive_failures = 0
        b.registered = True
        b.withdrawn = None
        self._backends[address] = b
        self._push(b)
        return b

    def clear(self) -> int:
        """Take every backend out of the rotation (no new assignment). Jobs that hold one keep it until they
        end; a later :meth:`add` of the same address revives the same object. Returns how many were removed.
        """
        removed = list(self._backends.values())
        self._backends.clear()
        self._heap.clear()
        self._available.clear()
        for b in removed:
            b.registered = False
            if self._on_change:
                self._on_change(b)
        return len(removed)

    def withdraw(self, address: str, reason: str) -> Optional[Backend]:
        """Take one backend out of the rotation until it is registered again (``/add_llm_server``): a backend
        that failed a weight swap (its weights are unknown), so the health probe does not bring it back. Jobs
        holding it move on their next call (:meth:`assign` skips a backend out of rotation for a job only when
        told to exclude it; :class:`~prorl_server.llm.client.LLMClient` does). Returns it, or None if unknown."""
        b = self.get(address)
        if b is None:
            return None
        log.warning("backend %s taken out of the rotation: %s", b.address, reason)
        b.registered = False
        b.last_error = b.withdrawn = reason
        self._backends.pop(b.address, None)
        if self._on_change:
            self._on_change(b)
        return b

    # ------------------------------------------------------------------ weight-swap hold
    @property
    def held(self) -> bool:
        """True while a weight swap holds new LLM calls (they wait in the server, not at a backend)."""
        return not self._unheld.is_set()

    def hold(self) -> None:
        """Hold every new LLM call until :meth:`unhold` (a weight swap's pause)."""
        self._unheld.clear()

    def unhold(self) -> None:
        self._unheld.set()

    async def wait_unheld(self) -> None:
        await self._unheld.wait()

    def __len__(self) -> int:
        """Backends in the rotation (registered and healthy)."""
        return sum(1 for b in self._backends.values() if b.healthy)

    @property
    def backends(self) -> list[Backend]:
        """Registered backends (healthy or not); cleared ones are in :attr:`known` only."""
        return list(self._backends.values())

    @property
    def known(self) -> list[Backend]:
        """Every backend ever registered, cleared ones included (they may still be held by jobs)."""
        return list(self._known.values())

    @property
    def ever_registered(self) -> bool:
        """True once any backend was registered: a job that finds the rotation empty (a swap in progress,
        or its backends down) may wait for one, where a pool that never had one can only refuse it."""
        return bool(self._known)

    def get(self, address: str) -> Optional[Backend]:
        """The backend known under ``address`` (registered or cleared), or None."""
        return self._known.get(address.rstrip("/"))

    # ------------------------------------------------------------------ heap
    def _push(self, b: Backend) -> None:
        if b.in_rotation and self._backends.get(b.address) is b:
            heapq.heappush(self._heap, (b.in_flight, next(self._seq), b.address))
            self._available.set()
        if self._on_change:
            self._on_change(b)

    def _least_loaded(self) -> Optional[Backend]:
        """The least-loaded backend in rotation (not popped), or None."""
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
    def assign(self, job_id: str, exclude: frozenset[str] = frozenset(), group: Optional[str] = None) -> Backend:
        """Give ``job_id`` a backend: the one it already holds (sticky, even if it was cleared since), else its
        ``group``'s backend when load allows (see the module doc), else the least-loaded healthy one.

        Raises:
            NoBackendError: no healthy backend in rotation outside ``exclude``.
        """
        held = self._by_job.get(job_id)
        if held is not None and held.address not in exclude:
            return held
        b = self._least_loaded()
        if b is not None and b.address in exclude:
            candidates = [c for c in self._backends.values() if c.healthy and c.address not in exclude]
            b = min(candidates, key=lambda c: c.in_flight, default=None)
        if b is None:
            raise NoBackendError("no healthy LLM backend is registered (POST /add_llm_server)")
        if group is not None and held is None:  # a failover is not a placement decision
            b = self._place_group(group, b, exclude)
        if held is not None:
            self.release(job_id)
        b.in_flight += 1
        b.jobs.add(job_id)
        self._by_job[job_id] = b
        self._push(b)
        return b

    def _place_group(self, group: str, least: Backend, exclude: frozenset[str]) -> Backend:
        address = self._groups.get(group)
        if address is None:  # the group's first job: it picks the group's backend
            self._groups[group] = least.address
            while len(self._groups) > self.max_groups:
                self._groups.popitem(last=False)
            return least
        self._groups.move_to_end(group)
        own = self._backends.get(address)
        if own is not None and own.healthy and address not in exclude:
            if own.in_flight <= least.in_flight + self.affinity_slack:
                self._count_affinity("hit")
                return own
        else:
            self._groups[group] = least.address  # it left the rotation: the group moves with this job
        self._count_affinity("miss")
        return least

    def _count_affinity(self, outcome: str) -> None:
        self.affinity[outcome] += 1
        if self._on_affinity:
            self._on_affinity(outcome)

    async def acquire(self, job_id: str, wait_s: float = 0.0, exclude: frozenset[str] = frozenset(),
                      group: Optional[str] = None) -> Backend:
        """Like :meth:`assign`, but waits up to ``wait_s`` seconds while the rotation is empty (the trainer
        clears and re-adds backends around every weight update).

        Raises:
            NoBackendError: none in rotation within ``wait_s``; every one in rotation is in ``exclude``; or
                backends are registered and every one is unhealthy (a dead server: raised at once, the message
                names each backend and its ``last_error``).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            try:
                return self.assign(job_id, exclude, group)
            except NoBackendError:
                remaining = deadline - loop.time()
                if remaining <= 0 or any(b.healthy for b in self._backends.values()):
                    raise  # healthy backends exist but are all excluded: waiting would not help
                if self._backends:
                    # Backends are registered and every one is down (a crashed vLLM): nothing will come back
                    # by itself soon, so fail now with the reason rather than after wait_s. Only an empty
                    # rotation (clear -> add around a weight swap) is worth waiting for.
                    raise NoBackendError(self._down_reason()) from None
                self._available.clear()
                try:
                    await asyncio.wait_for(self._available.wait(), min(remaining, 1.0))
                except asyncio.TimeoutError:
                    pass

    def _down_reason(self) -> str:
        down = "; ".join(f"{b.address} ({b.last_error or 'unhealthy'})" for b in self._backends.values())
        return f"every registered LLM backend is down: {down}"

    def holder(self, job_id: str) -> Optional[Backend]:
        return self._by_job.get(job_id)

    def release(self, job_id: str) -> None:
        """The job ended (or moved): decrement its backend's in-flight count (the backend it was assigned,
        registered or cleared). Idempotent."""
        b = self._by_job.pop(job_id, None)
        if b is None:
            return
        b.jobs.discard(job_id)
        b.in_flight -= 1
        if b.in_flight < 0:  # a bookkeeping bug; never hide it, never report a negative load
            log.error("backend %s in-flight count went negative releasing %s", b.address, job_id)
            b.in_flight = 0
        self._push(b)

    def mark_unhealthy(self, address: str, reason: str = "") -> None:
        """Take a backend out of rotation (its jobs may retry elsewhere with ``assign(exclude=...)``)."""
        b = self.get(address)
        if b is not None and b.healthy:
            log.warning("backend %s marked unhealthy: %s", address, reason)
            b.healthy = False
            b.last_error = reason or b.last_error
            if self._on_change:
                self._on_change(b)

    def report_failure(self, address: str, reason: str = "", threshold: int = 2) -> None:
        """A request to ``address`` failed to connect: after ``threshold`` such failures in a row the backend
        leaves rotation (one dropped keep-alive connection does not take the only backend out)."""
        b = self.get(address)
        if b is None:
            return
        b.consecutive_failures += 1
        b.last_error = reason or b.last_error
        if b.consecutive_failures >= threshold:
            self.mark_unhealthy(address, f"{b.consecutive_failures} failures in a row; last: {reason}")

    def report_success(self, address: str) -> None:
        """A request to ``address`` succeeded: its failure streak is over."""
        b = self.get(address)
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
        """Probe every registered backend's ``/health`` once; remove after ``failures_to_remove`` failures in
        a row."""

        async def probe(b: Backend) -> None:
            why = ""
            try:
                async with session.get(f"{b.address}/health",
                                       timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                    ok = r.status < 500
                    why = f"HTTP {r.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                ok, why = False, repr(e)
            if ok:
                self.mark_healthy(b.address)
            else:
                b.consecutive_failures += 1
                b.last_error = f"health probe failed: {why}"
                if b.consecutive_failures >= failures_to_remove:
                    self.mark_unhealthy(b.address, b.last_error)

        await asyncio.gather(*(probe(b) for b in list(self._backends.values())))

    async def probe_forever(self, session: aiohttp.ClientSession, interval_s: float,
                            failures_to_remove: int = 2) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.probe_once(session, failures_to_remove=failures_to_remove)
            except Exception:  # a probe bug must not kill the loop
                log.exception("health probe round failed")
