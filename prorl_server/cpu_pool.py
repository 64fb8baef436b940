"""A process pool for CPU-bound reward functions, so they never run on the server's event loop.

``CpuPool(workers)`` holds ``workers`` slots; each slot is a one-process
:class:`concurrent.futures.ProcessPoolExecutor` started with the ``forkserver`` method (a clean server
process forks the workers: never a fork of this process, which runs an event loop and threads). One process
per executor lets the pool kill exactly the worker whose call ran past its limit, and replace only that one.

In a worker the function runs in the process's main thread, so scorers whose own timeouts use
``signal.alarm`` (math-verify's ``parsing_timeout`` / ``timeout_seconds``) work there. Each worker runs at a
lower CPU priority (``nice``) so the event loop wins the CPU when both want it, and under an address-space
limit so one runaway answer raises ``MemoryError`` in the worker instead of taking the node's memory.

As with any ``multiprocessing`` start method but fork, a worker imports the main module of the server's
process first: a script that creates a pool must guard its entry point with ``if __name__ == "__main__"``
(``python -m prorl_server`` and the ``prorl-server`` console script are safe: a package's ``__main__`` is
never re-run in a child).

The pool is shared by every job of the server, and fairly: calls wait in one FIFO queue per job
(:class:`CpuShare` ``owner``) and a worker that frees up goes to the waiting job whose last call started
longest ago (round-robin), so one job's many expensive calls cannot make another job's cheap one wait for
all of them. A job's time waiting for a
worker is the system's, not charged to its deadline (``Job.run_cpu`` holds the deadline until the call
starts), and what a job's calls may spend is bounded in **CPU** seconds (:class:`CpuShare` ``budget_s``,
:data:`ANSWER_CPU_BUDGET_S` by default: one answer's scoring), measured on the worker process while it runs,
so a loaded node's slowness is not charged to an answer.

Outcomes of :meth:`CpuPool.run`:
- the function's value, or the exception it raised (re-raised as is);
- :class:`CpuTimeoutError` when it ran past ``timeout_s`` (wall clock, seconds) or its share's CPU budget:
  the worker is killed and a fresh one replaces it on the slot's next call;
- :class:`WorkerCrashedError` when the worker process died (``BrokenProcessPool``): the slot gets a fresh
  worker; the caller should treat it as an infrastructure fault, not as the answer's fault.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import multiprocessing
import os
import sys
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Hashable, Optional

from prorl_server.failures import InfrastructureError

log = logging.getLogger(__name__)

#: Default size: one worker per core, at most 4 (scoring shares the node with sandboxes and the server).
DEFAULT_WORKERS = min(4, os.cpu_count() or 1)


WARM_TIMEOUT_S = 300.0
"""Longest a worker may take to start and import a function's modules (not charged to any call), seconds."""

ANSWER_CPU_BUDGET_S = 5.0
"""CPU seconds all the pool calls of one job (the scoring of one answer) may use together by default
(``JobServices.cpu_budget_s``). An honest answer's scoring takes milliseconds; math-verify's own limits are
5 s per parse and per comparison; four power towers of 30 s each held every worker of a node for two minutes."""

CPU_POLL_S = 0.05
"""How often a running call's worker is measured against its share's CPU budget, seconds."""


@dataclasses.dataclass
class CpuShare:
    """One job's share of the pool: the key of its FIFO queue (``owner``, e.g. the job id), the CPU seconds
    its calls may use together (``budget_s``; None: unbounded) and what they used so far (``used_s``, CPU
    seconds of the worker processes while they ran its calls)."""

    owner: Hashable
    budget_s: Optional[float] = None
    used_s: float = 0.0

    def left_s(self) -> Optional[float]:
        """CPU seconds left of the budget (None: unbounded), never below 0."""
        return None if self.budget_s is None else max(0.0, self.budget_s - self.used_s)


def _cpu_seconds(pid: Optional[int]) -> Optional[float]:
    """CPU time (user + system, seconds) the process ``pid`` has used; None when it is gone or unknown."""
    if pid is None:
        return None
    import psutil

    try:
        t = psutil.Process(pid).cpu_times()
    except (psutil.Error, OSError):
        return None
    return t.user + t.system


class CpuTimeoutError(TimeoutError):
    """A call ran past its wall-clock limit; its worker process was killed and will be replaced."""


class WorkerCrashedError(InfrastructureError):
    """The worker process running a call died (killed, segfault, ``os._exit``): an infrastructure fault of
    kind ``"harness"`` (the grader's machinery failed, not the graded answer), so a stage that lets it
    propagate ends the job with ``failure_kind="harness"`` and ``filter: true``."""

    def __init__(self, message: str) -> None:
        super().__init__("harness", message)


def _init_worker(server_pid: int, nice: int, memory_limit_bytes: Optional[int]) -> None:
    _exit_with_server(server_pid)
    if nice:
        try:
            os.nice(nice)
        except OSError:  # not permitted here: scoring still works, at normal priority
            pass
    if memory_limit_bytes:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))


def _exit_with_server(server_pid: int) -> None:
    """End this worker when the server process ends, even by SIGKILL (then nothing runs ``close()``).

    A worker's parent is the forkserver, which waits for its children's pipes before it exits, so the
    parent-death signal would never fire: a thread waits on a pidfd of the server instead (Linux >= 5.3; a
    pidfd never refers to a reused pid). Signals still go to the main thread, where the scorer runs."""
    import select
    import threading

    try:
        fd = os.pidfd_open(server_pid)
    except ProcessLookupError:
        os._exit(1)
    except (AttributeError, OSError):  # no pidfd here: the pool's close() still ends workers on a clean exit
        return

    def wait() -> None:
        select.select([fd], [], [])
        os._exit(1)

    threading.Thread(target=wait, name="exit-with-server", daemon=True).start()


def _warm(modules: tuple[str, ...]) -> None:
    """Import ``modules`` in a worker (its first call for a function of theirs then pays nothing for them)."""
    import importlib

    for name in modules:
        importlib.import_module(name)


def warm_modules(fn: Callable[..., Any]) -> tuple[str, ...]:
    """What a worker imports before running ``fn`` the first time, uncharged to the call's limit:
    ``fn``'s module and the names in that module's ``CPU_PRELOAD`` tuple (the heavy modules it imports
    lazily, e.g. ``("math_verify",)``)."""
    module = getattr(fn, "__module__", None)
    if module is None and hasattr(fn, "func"):  # functools.partial
        return warm_modules(fn.func)
    if module is None:
        return ()
    return (module, *getattr(sys.modules.get(module), "CPU_PRELOAD", ()))


class _Slot:
    """One worker process (a one-process executor, created on first use and after a kill or crash)."""

    def __init__(self, index: int, make: Callable[[], concurrent.futures.ProcessPoolExecutor]) -> None:
        self.index = index
        self._make = make
        self.executor: Optional[concurrent.futures.ProcessPoolExecutor] = None
        self.warmed: set[str] = set()  # modules imported in the current worker

    def submit(self, fn: Callable[..., Any], args: tuple) -> concurrent.futures.Future:
        if self.executor is None:
            self.executor = self._make()
        return self.executor.submit(fn, *args)

    def pids(self) -> list[int]:
        # ProcessPoolExecutor keeps its processes in ``_processes`` (pid -> Process); it offers no public way
        # to stop one running call, and killing its process is the only way to end a call stuck in C code.
        procs = getattr(self.executor, "_processes", None) or {}
        return [p.pid for p in list(procs.values()) if p.pid is not None]

    def discard(self, kill: bool) -> None:
        """Forget this slot's executor (the next call starts a fresh worker); ``kill``: SIGKILL its process
        first (a call is still running in it)."""
        ex, self.executor = self.executor, None
        self.warmed = set()
        if ex is None:
            return
        if kill:
            for p in list((getattr(ex, "_processes", None) or {}).values()):
                try:
                    p.kill()
                except (OSError, ValueError):  # already gone / already closed
                    pass
        # The executor's own manager thread sees the dead process, fails its futures and reaps it.
        ex.shutdown(wait=False, cancel_futures=True)


class CpuPool:
    """Run picklable functions in worker processes, at most ``workers`` at a time.

    Args:
        workers: number of worker processes (>= 1); default :data:`DEFAULT_WORKERS`.
        nice: niceness added in each worker (0 = same priority as the server).
        memory_limit_bytes: ``RLIMIT_AS`` of each worker (None = unlimited); default 4 GiB.
        start_method: ``"forkserver"`` (default) or ``"spawn"``; ``"fork"`` is refused (this process runs an
            event loop and threads, which a fork would copy in an unusable state).
        on_outcome: ``(outcome) -> None`` called once per call with ``"ok"``, ``"error"`` (the function
            raised), ``"timeout"`` or ``"crashed"`` (for a metric).

    Functions and arguments travel by pickle: a function must be importable by its module and name.
    """

    def __init__(self, workers: int = DEFAULT_WORKERS, *, nice: int = 10,
                 memory_limit_bytes: Optional[int] = 4 << 30, start_method: str = "forkserver",
                 on_outcome: Optional[Callable[[str], None]] = None) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, not {workers}")
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(f"start_method must be 'forkserver' or 'spawn', not {start_method!r}")
        self.workers = workers
        ctx = multiprocessing.get_context(start_method)

        def make() -> concurrent.futures.ProcessPoolExecutor:
            return concurrent.futures.ProcessPoolExecutor(
                max_workers=1, mp_context=ctx, initializer=_init_worker,
                initargs=(os.getpid(), nice, memory_limit_bytes))

        self._slots = [_Slot(i, make) for i in range(workers)]
        self._idle: list[_Slot] = list(reversed(self._slots))
        # callers waiting for a worker: one FIFO per owner (in order of arrival)
        self._waiting: dict[Hashable, collections.deque[asyncio.Future]] = {}
        # when each owner with a call running or waiting last got a worker (a sequence number), and how many it
        # holds: the next worker goes to the waiting owner served longest ago (never served: first)
        self._turns = 0
        self._last_turn: dict[Hashable, int] = {}
        self._busy: collections.Counter = collections.Counter()
        self._calls: set[asyncio.Task] = set()
        self._on_outcome = on_outcome or (lambda outcome: None)
        self.closed = False

    async def _acquire(self, owner: Hashable) -> _Slot:
        """A free worker slot for a call of ``owner``: at once if one is idle and nobody waits, else when its
        turn comes (:meth:`_release`) to this owner's oldest waiting call."""
        if self._idle and not self._waiting:
            self._took(owner)
            return self._idle.pop()
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(owner, collections.deque()).append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # handed a slot as it was cancelled: pass it on
                self._release(fut.result(), owner)
            else:
                queue = self._waiting.get(owner)
                if queue is not None and fut in queue:
                    queue.remove(fut)
                    if not queue:
                        del self._waiting[owner]
                self._forget(owner)
            raise

    def _took(self, owner: Hashable) -> None:
        self._last_turn[owner] = self._turns
        self._turns += 1
        self._busy[owner] += 1

    def _forget(self, owner: Hashable) -> None:
        """Drop ``owner``'s turn once it has no call running or waiting (the tables stay as small as that)."""
        if not self._busy.get(owner) and owner not in self._waiting:
            self._busy.pop(owner, None)
            self._last_turn.pop(owner, None)

    def _release(self, slot: _Slot, owner: Hashable) -> None:
        """``owner``'s call is done with ``slot``: hand it to the waiting owner whose last call started longest
        ago (one that never had one first; ties: the earliest to wait), its oldest call; else mark it idle."""
        self._busy[owner] -= 1
        self._forget(owner)
        while self._waiting:
            # min() keeps the first of equals: owners in order of arrival
            nxt = min(self._waiting, key=lambda o: self._last_turn.get(o, -1))
            queue = self._waiting[nxt]
            fut = queue.popleft()
            if not queue:
                del self._waiting[nxt]
            if not fut.done():
                self._took(nxt)
                fut.set_result(slot)
                return
            self._forget(nxt)
        self._idle.append(slot)

    def waiting(self) -> int:
        """Calls waiting for a worker now."""
        return sum(len(q) for q in self._waiting.values())

    def pids(self) -> list[int]:
        """Process ids of the workers started now (workers start on first use)."""
        return [pid for s in self._slots for pid in s.pids()]

    async def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float, share: Optional[CpuShare] = None,
                  on_start: Optional[Callable[[], None]] = None) -> Any:
        """``fn(*args)`` in a worker process; waits for a free worker first (that wait is not counted), in
        ``share``'s queue, served round-robin with the other owners' queues.

        Args:
            timeout_s: wall-clock limit of the call in the worker, seconds. A worker's start and its first
                import of ``fn``'s modules (:func:`warm_modules`) are done before and not counted.
            share: the calling job's share (its queue, its CPU budget: the worker's CPU seconds during the call
                are added to ``share.used_s``); None: a queue of its own and no budget.
            on_start: called once the call has its worker, ready, just before it is timed (``Job.run_cpu``
                stops holding its deadline there); not called if the call never starts.

        Raises:
            CpuTimeoutError: the call ran past ``timeout_s`` or past ``share``'s CPU budget (a spent budget:
                at once, no worker taken); its worker was killed.
            WorkerCrashedError: the worker died during the call.
            RuntimeError: the pool is closed.
            Exception: whatever ``fn`` raised.

        Cancelling the caller does not cut the call short: the worker stays busy (and is not handed out
        again) until the call ends or reaches ``timeout_s``, so one slot never runs two calls.
        """
        if self.closed:
            raise RuntimeError("the CPU pool is closed")
        if share is not None and share.left_s() == 0.0:
            raise CpuTimeoutError(f"{getattr(fn, '__qualname__', fn)} not run: its job has spent its CPU budget of "
                                  f"{share.budget_s:g} s")
        owner = share.owner if share is not None else object()
        slot = await self._acquire(owner)
        if self.closed:
            raise RuntimeError("the CPU pool is closed")
        call = asyncio.get_running_loop().create_task(self._call(slot, owner, fn, args, timeout_s, share, on_start))
        self._calls.add(call)
        call.add_done_callback(self._call_done)
        return await asyncio.shield(call)

    def _call_done(self, task: asyncio.Task) -> None:
        self._calls.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a caller that was cancelled no longer reads it

    async def _call(self, slot: _Slot, owner: Hashable, fn: Callable[..., Any], args: tuple, timeout_s: float,
                    share: Optional[CpuShare] = None, on_start: Optional[Callable[[], None]] = None) -> Any:
        outcome = "error"
        try:
            modules = tuple(m for m in warm_modules(fn) if m not in slot.warmed)
            if modules:
                outcome = "crashed"  # unless it gets ready
                await self._warm(slot, modules)
                outcome = "error"
            pids = slot.pids()
            pid = pids[0] if pids else None
            if on_start is not None:
                on_start()
            try:
                fut = asyncio.wrap_future(slot.submit(fn, args))
            except BrokenProcessPool as e:  # died while idle: nothing ran yet, but the caller still learns it
                outcome = "crashed"
                slot.discard(kill=False)
                raise WorkerCrashedError(f"CPU worker {slot.index} died before the call started: {e}") from e
            if not await self._until_done(fut, slot, pid, timeout_s, share):
                outcome = "timeout"
                fut.cancel()
                slot.discard(kill=True)
                name = getattr(fn, '__qualname__', fn)
                if share is not None and share.left_s() == 0.0:
                    raise CpuTimeoutError(f"{name} ran past its job's CPU budget of {share.budget_s:g} s (CPU "
                                          "time of all its calls) in a CPU worker; the worker was killed and is "
                                          "replaced")
                raise CpuTimeoutError(f"{name} ran past its limit of {timeout_s:g} s "
                                      "in a CPU worker; the worker was killed and is replaced")
            try:
                value = fut.result()
            except BrokenProcessPool as e:
                outcome = "crashed"
                slot.discard(kill=False)
                raise WorkerCrashedError(f"CPU worker {slot.index} died while running "
                                         f"{getattr(fn, '__qualname__', fn)}: {e}") from e
            outcome = "ok"
            return value
        except asyncio.CancelledError:  # only when the pool closes: the worker is killed there
            outcome = "cancelled"
            raise
        finally:
            if outcome != "cancelled":
                self._on_outcome(outcome)
            if not self.closed:
                self._release(slot, owner)

    @staticmethod
    async def _until_done(fut: asyncio.Future, slot: _Slot, pid: Optional[int], timeout_s: float,
                          share: Optional[CpuShare]) -> bool:
        """Wait for the call ``fut`` running in ``slot``'s worker ``pid``; False if it passes ``timeout_s``
        (wall clock) or, measured every :data:`CPU_POLL_S`, ``share``'s CPU budget (its use is added to
        ``share.used_s`` as it goes)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        if pid is None:  # no worker started yet: it starts with this call, measure it once it is there
            pids = slot.pids()
            pid = pids[0] if pids else None
        last = _cpu_seconds(pid) if share is not None else None
        while True:
            poll = deadline - loop.time()
            if share is not None and share.budget_s is not None:
                poll = min(poll, CPU_POLL_S)
            done, _ = await asyncio.wait({fut}, timeout=max(0.0, poll))
            if share is not None and last is not None:
                now = _cpu_seconds(pid)
                if now is not None:
                    share.used_s += max(0.0, now - last)
                    last = now
            if done:
                return True
            if loop.time() >= deadline or (share is not None and share.left_s() == 0.0):
                return False

    async def _warm(self, slot: _Slot, modules: tuple[str, ...]) -> None:
        """Start the slot's worker if needed and import ``modules`` there, outside any call's limit: a worker
        starting and importing sympy on a loaded node takes seconds that are no answer's doing.

        Raises:
            WorkerCrashedError: the worker died or did not get ready within :data:`WARM_TIMEOUT_S`.
        """
        try:
            fut = asyncio.wrap_future(slot.submit(_warm, (modules,)))
            done, _ = await asyncio.wait({fut}, timeout=WARM_TIMEOUT_S)
            if not done:
                fut.cancel()
                raise BrokenProcessPool(f"not ready within {WARM_TIMEOUT_S:g} s")
            fut.result()
        except (BrokenProcessPool, ImportError) as e:
            slot.discard(kill=True)
            raise WorkerCrashedError(f"CPU worker {slot.index} could not start or import {modules}: {e}") from e
        slot.warmed.update(modules)

    async def close(self) -> None:
        """Stop every worker (killing any still running a call) and wait until they are reaped. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for s in self._slots:
            ex = s.executor
            s.discard(kill=True)
            if ex is not None:
                # Joining reaps the killed processes; it blocks, so not on the event loop.
                await asyncio.to_thread(ex.shutdown, wait=True)
        calls = list(self._calls)
        for c in calls:
            c.cancel()
        waiting = [f for q in self._waiting.values() for f in q]
        self._waiting.clear()
        for f in waiting:
            if not f.done():
                f.set_exception(RuntimeError("the CPU pool is closed"))
        await asyncio.gather(*calls, return_exceptions=True)
