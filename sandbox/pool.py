"""A warm pool of started sandboxes per spec (issue #36): a job's sandbox is handed out in about a millisecond
instead of started on its path; the start's work (directories, leases, cgroup, mounts, the execution server)
moves into the background.

```python
pool = SandboxPool(runtime, size=4)
h = await pool.acquire(spec)     # a started sandbox of exactly this spec; the caller owns it and closes it
await pool.close()               # closes the sandboxes still waiting (runtime.close_all would too)
```

Rules:
- A pooled sandbox is an ordinary sandbox of the runtime, started from the spec it is handed out for: every
  bound is on (cgroup, workspace quota watch, tmpfs sizes, seccomp filter), it holds its leases and its
  ownership record, so it counts against the node like any other and a crashed server's pool is reaped by the
  next server's :meth:`~sandbox.runtime.SandboxRuntime.reap_orphans`.
- Handed out once: the pool forgets a sandbox when it hands it out; the job closes it (destroyed, never put
  back), and the pool starts a replacement in the background.
- Warm: a pooled sandbox's shell is started while it waits (:meth:`~sandbox.runtime.SandboxHandle.warm_up`), so
  a job's first bash call finds it ready; a cold start leaves its shell to the first bash call.
- Never dead: on acquire the sandbox's launcher must run, no bound may have ended it, none of its known
  processes (the launcher chain, the execution server and its warm shell, recorded after warm-up:
  :attr:`SandboxHandle.processes`) may be stopped (SIGSTOP, a tracer), a zombie or gone (their
  ``/proc/PID/stat``, :mod:`sandbox.procstate`), and the server must hold its connection open (a server that
  died closed it; checked with ``poll``, no round trip; without a connection, a ping within
  :data:`ACQUIRE_PING_S`); one that fails is closed (counted ``dead``) and the next is tried, else a cold
  start. Frozen (the cgroup freezer) counts as stopped. The same processes found stopped, frozen or gone at
  the model's first call, or an execution server that took requests the host did not send (a same-uid co-tenant
  used its socket while it waited), fail that call as the system's (:class:`SandboxStartError`, see
  ``SandboxHandle._check_untouched``).
- Pooled specs: those without per-job host state (no ``workspace``, no ``binds``), the first ``max_specs``
  distinct ones asked for (the shipped math and code handlers' run sandboxes); any other spec is a cold start.
- A pool that cannot refill (a full disk, no lease, a refused cgroup: :class:`SandboxStartError`) serves cold
  starts, counts ``refill_failures`` and ``cold_fallbacks``, reports ``degraded`` for that spec, and retries
  after ``retry_s``.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import time
from typing import Any, Optional

from . import procstate
from .errors import SandboxError
from .runtime import SandboxHandle, SandboxRuntime
from .spec import SandboxSpec

log = logging.getLogger(__name__)

#: Seconds a pooled sandbox has to answer the liveness ping on acquire before it counts as dead.
ACQUIRE_PING_S = 2.0
#: Seconds a refill waits, after a sandbox's warm-up, for its execution server to have spawned the shell.
SHELL_WAIT_S = 2.0
#: Counter names of :attr:`SandboxPool.counters` (what the server exports on /metrics).
COUNTERS = ("hits", "misses", "dead", "cold_fallbacks", "refill_starts", "refill_failures")


def _stopped(pid: Optional[int]) -> bool:
    """Whether process ``pid`` (the execution server, the verified peer of the pool's connection) is stopped or
    gone (:data:`sandbox.procstate.NOT_ANSWERING`, or its ``/proc/PID/stat`` unreadable). A stopped server keeps
    its connection open and would hold a job's first call until the call's timeout (red team F6). One small
    procfs read, ~10 us. ``None`` (no connection yet): ``False``, the ping decides."""
    if pid is None:
        return False
    s = procstate.stat(pid)
    return s is None or s[0] in procstate.NOT_ANSWERING


def _warm_processes(launcher_pid: int, server_pid: Optional[int]) -> tuple[procstate.Known, ...]:
    """The processes of a warmed-up sandbox that acquire checks (:func:`sandbox.procstate.snapshot`): its
    launcher chain, the execution server and the server's children, once the persistent shell is among them
    (the warm-up returns before the server has spawned it; waited for at most :data:`SHELL_WAIT_S`). Blocking
    (a pass over ``/proc`` each try): run in a worker thread. Empty without a verified server (acquire's other
    checks decide then)."""
    if server_pid is None:
        return ()
    deadline = time.monotonic() + SHELL_WAIT_S
    while not procstate.children(server_pid) and time.monotonic() < deadline:
        if procstate.stat(server_pid) is None:
            return ()  # the server is gone: acquire's own checks see that
        time.sleep(0.005)
    return procstate.snapshot(launcher_pid, server_pid)


def spec_key(spec: SandboxSpec) -> str:
    """A canonical text of every field of ``spec`` (two specs with the same key start the same sandbox)."""
    return json.dumps(dataclasses.asdict(spec), sort_keys=True, default=str)


def poolable(spec: SandboxSpec) -> bool:
    """Whether sandboxes of ``spec`` can be started before a job asks: no per-job host state (a named
    workspace, binds of host paths)."""
    return not spec.workspace and not spec.binds


class _SpecPool:
    def __init__(self, spec: SandboxSpec) -> None:
        self.spec = spec
        self.ready: collections.deque[SandboxHandle] = collections.deque()
        self.starting = 0
        self.refill: Optional[asyncio.Task] = None
        self.failed_at: Optional[float] = None  # last refill failure (monotonic), None while refills succeed
        self.full = asyncio.Event()


class SandboxPool:
    """Started sandboxes of ``runtime`` waiting per spec. ``size``: sandboxes kept ready per pooled spec (0:
    off, every acquire is a cold start). ``max_specs``: distinct specs pooled at most (the first asked for).
    ``refill_concurrency``: starts the pool runs at once (its refill competes with jobs for the CPU).
    ``retry_s``: seconds before a pool whose refill failed tries again (cold starts meanwhile). Raises
    ``ValueError`` for a negative size or a non-positive ``max_specs``/``refill_concurrency``/``retry_s``."""

    def __init__(self, runtime: SandboxRuntime, *, size: int = 4, max_specs: int = 8, refill_concurrency: int = 2,
                 retry_s: float = 5.0) -> None:
        if size < 0 or max_specs <= 0 or refill_concurrency <= 0 or retry_s <= 0:
            raise ValueError("size must be >= 0; max_specs, refill_concurrency and retry_s must be positive")
        self.runtime = runtime
        self.size = size
        self.max_specs = max_specs
        self.retry_s = retry_s
        self._refill_slots: Optional[asyncio.Semaphore] = None
        self._refill_concurrency = refill_concurrency
        self._pools: dict[str, _SpecPool] = {}
        self._closed = False
        #: Running counts: ``hits`` (handed out from the pool), ``misses`` (cold starts of pooled specs: empty
        #: pool), ``dead`` (pooled sandboxes found dead on acquire, closed), ``cold_fallbacks`` (cold starts
        #: while the spec's refill is failing), ``refill_starts``, ``refill_failures``.
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)

    # ------------------------------------------------------------------------------------------ public
    def register(self, spec: SandboxSpec) -> bool:
        """Keep ``size`` sandboxes of ``spec`` ready from now on (refilled in the background). Returns whether
        it is pooled (not when the pool is off or closed, ``spec`` is not :func:`poolable`, or ``max_specs``
        specs are pooled already)."""
        key = spec_key(spec)
        if key in self._pools:
            return True
        if self.size == 0 or self._closed or not poolable(spec) or len(self._pools) >= self.max_specs:
            return False
        self._pools[key] = _SpecPool(dataclasses.replace(spec))
        self._kick(self._pools[key])
        return True

    @property
    def degraded(self) -> list[SandboxSpec]:
        """Pooled specs whose last refill failed (their acquires are cold starts until a refill succeeds)."""
        return [p.spec for p in self._pools.values() if p.failed_at is not None]

    def ready_count(self, spec: Optional[SandboxSpec] = None) -> int:
        """Sandboxes waiting (for ``spec``, or for all specs)."""
        if spec is not None:
            p = self._pools.get(spec_key(spec))
            return len(p.ready) if p else 0
        return sum(len(p.ready) for p in self._pools.values())

    async def wait_full(self, spec: SandboxSpec, timeout_s: float) -> None:
        """Wait until ``size`` sandboxes of ``spec`` (registered) are ready. Raises ``KeyError`` for a spec not
        pooled, ``asyncio.TimeoutError`` after ``timeout_s`` seconds."""
        p = self._pools[spec_key(spec)]
        await asyncio.wait_for(p.full.wait(), timeout_s)

    async def acquire(self, spec: Optional[SandboxSpec] = None) -> SandboxHandle:
        """A started sandbox of ``spec`` (``None``: the default spec) for the caller to own and close: a waiting
        one that answers a ping, else a cold start (:meth:`SandboxRuntime.start`). A :func:`poolable` spec not
        pooled yet is registered (the pool fills in the background for the next acquires). Raises what
        ``runtime.start`` raises (:class:`SandboxStartError`: the host's doing)."""
        spec = spec if spec is not None else SandboxSpec()
        key = spec_key(spec)
        p = self._pools.get(key)
        if p is None and self.register(spec):
            p = self._pools[key]
        if p is None:
            return await self.runtime.start(spec)
        while p.ready:
            h = p.ready.popleft()
            p.full.clear()
            self._kick(p)
            if await self._alive(h):
                self.counters["hits"] += 1
                return h
        self.counters["cold_fallbacks" if p.failed_at is not None else "misses"] += 1
        return await self.runtime.start(spec)

    async def close(self) -> None:
        """Stop refilling and close every waiting sandbox, concurrently and without a SIGTERM grace (SIGKILL:
        nothing of a job is inside one). Idempotent; acquires afterwards are cold starts."""
        self._closed = True
        pools, self._pools = list(self._pools.values()), {}
        for p in pools:
            if p.refill is not None:
                p.refill.cancel()
        await asyncio.gather(*(p.refill for p in pools if p.refill is not None), return_exceptions=True)
        waiting = [h for p in pools for h in p.ready]
        for p in pools:
            p.ready.clear()
        # Concurrently and with no grace: nothing of a job is in a sandbox never handed out, and a SIGTERM grace
        # each (2 s) was what a server's shutdown with a full pool waited for under load (red team F9).
        results = await asyncio.gather(*(h.close(grace_s=0.0) for h in waiting), return_exceptions=True)
        for h, r in zip(waiting, results):
            if isinstance(r, BaseException):
                log.error("closing pooled sandbox %s failed: %s", h.sandbox_id, r)

    # ----------------------------------------------------------------------------------------- helpers
    async def _alive(self, h: SandboxHandle) -> bool:
        """Whether a waiting sandbox can be handed out: alive, not ended by a bound, its execution server not
        stopped nor a zombie (:func:`_stopped`), none of its known processes stopped, a zombie or gone
        (:func:`sandbox.procstate.fault`), and its connection open with no hang-up (checked without a round
        trip; without a connection, a ping within :data:`ACQUIRE_PING_S`). A dead one is closed in the
        background (its leases, cgroup and directories released)."""
        ok = (h.alive and h._death is None and not _stopped(h._client.peer_pid)
              and procstate.fault(h.processes) is None)
        if ok and not h._client.connection_alive():
            try:
                # the client's own call (not the handle's, which grants a tool's grace): a stopped server must
                # not hold an acquire for long
                await asyncio.wait_for(h._client.call("ping", {}, ACQUIRE_PING_S), ACQUIRE_PING_S)
            except asyncio.CancelledError:
                # the caller gave up while we checked: the sandbox is nobody's now, so it goes
                self._discard(h)
                raise
            except (SandboxError, OSError, asyncio.TimeoutError):
                ok = False
        if not ok:
            self.counters["dead"] += 1
            log.warning("pooled sandbox %s died while it waited: closed, not handed out", h.sandbox_id)
            self._discard(h)
        return ok

    def _discard(self, h: SandboxHandle) -> None:
        def done(t: asyncio.Task) -> None:
            if not t.cancelled() and t.exception() is not None:
                log.error("closing pooled sandbox %s failed: %s", h.sandbox_id, t.exception())

        asyncio.ensure_future(h.close(grace_s=0.0)).add_done_callback(done)

    def _kick(self, p: _SpecPool) -> None:
        """Start the spec's refill task unless it runs."""
        if self._closed or (p.refill is not None and not p.refill.done()):
            return
        p.refill = asyncio.ensure_future(self._refill(p))

    async def _refill(self, p: _SpecPool) -> None:
        """Start sandboxes until ``size`` wait, at most ``refill_concurrency`` at once across the pool; after a
        failure, wait ``retry_s`` and try again (acquires are cold starts meanwhile)."""
        if self._refill_slots is None:
            self._refill_slots = asyncio.Semaphore(self._refill_concurrency)
        while not self._closed:
            missing = self.size - len(p.ready) - p.starting
            if missing <= 0:
                if p.starting == 0:
                    p.full.set()
                return
            p.starting += missing
            results = await asyncio.gather(*(self._start_one(p) for _ in range(missing)), return_exceptions=True)
            p.starting -= missing
            errors = [r for r in results if isinstance(r, BaseException)]
            if any(isinstance(e, asyncio.CancelledError) for e in errors):
                raise asyncio.CancelledError
            if errors:
                p.failed_at = time.monotonic()
                log.warning("sandbox pool: refill failed (%s); acquires of that spec are cold starts, retry in "
                            "%g s", errors[0], self.retry_s)
                await asyncio.sleep(self.retry_s)
            else:
                p.failed_at = None

    async def _start_one(self, p: _SpecPool) -> None:
        async with self._refill_slots:
            if self._closed:
                return
            self.counters["refill_starts"] += 1
            try:
                h = await self.runtime.start(p.spec)
            except asyncio.CancelledError:
                raise
            except Exception:
                self.counters["refill_failures"] += 1
                raise
            try:
                await h.warm_up()  # its shell starts while it waits: a job's first bash call finds it ready
                # what acquire (and the first call made for the model) checks: none of these stopped or gone
                h.processes = await asyncio.to_thread(_warm_processes, h.pid, h._client.peer_pid)
            except BaseException as e:
                if not isinstance(e, asyncio.CancelledError):
                    self.counters["refill_failures"] += 1
                await h.close(grace_s=0.0)
                raise
        if self._closed:
            await h.close(grace_s=0.0)
            return
        p.ready.append(h)
        # a start succeeded: the spec refills again (set at once, not after the batch's other starts, so that
        # ``degraded`` never names a spec with ready sandboxes)
        p.failed_at = None
