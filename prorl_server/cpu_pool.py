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

Outcomes of :meth:`CpuPool.run`:
- the function's value, or the exception it raised (re-raised as is);
- :class:`CpuTimeoutError` when it ran past ``timeout_s`` (wall clock, seconds): the worker is killed and a
  fresh one replaces it on the slot's next call;
- :class:`WorkerCrashedError` when the worker process died (``BrokenProcessPool``): the slot gets a fresh
  worker; the caller should treat it as an infrastructure fault, not as the answer's fault.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import os
import sys
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Optional

from prorl_server.failures import InfrastructureError

log = logging.getLogger(__name__)

#: Default size: one worker per core, at most 4 (scoring shares the node with sandboxes and the server).
DEFAULT_WORKERS = min(4, os.cpu_count() or 1)


WARM_TIMEOUT_S = 300.0
"""Longest a worker may take to start and import a function's modules (not charged to any call), seconds."""


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
        self._free: Optional[asyncio.Queue[_Slot]] = None
        self._calls: set[asyncio.Task] = set()
        self._on_outcome = on_outcome or (lambda outcome: None)
        self.closed = False

    def _free_slots(self) -> asyncio.Queue[_Slot]:
        if self._free is None:  # created in the running loop
            self._free = asyncio.Queue()
            for s in self._slots:
                self._free.put_nowait(s)
        return self._free

    def pids(self) -> list[int]:
        """Process ids of the workers started now (workers start on first use)."""
        return [pid for s in self._slots for pid in s.pids()]

    async def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
        """``fn(*args)`` in a worker process; waits for a free worker first (that wait is not counted).

        Args:
            timeout_s: wall-clock limit of the call in the worker, seconds. A worker's start and its first
                import of ``fn``'s modules (:func:`warm_modules`) are done before and not counted.

        Raises:
            CpuTimeoutError: the call ran past ``timeout_s``; its worker was killed.
            WorkerCrashedError: the worker died during the call.
            RuntimeError: the pool is closed.
            Exception: whatever ``fn`` raised.

        Cancelling the caller does not cut the call short: the worker stays busy (and is not handed out
        again) until the call ends or reaches ``timeout_s``, so one slot never runs two calls.
        """
        if self.closed:
            raise RuntimeError("the CPU pool is closed")
        slot = await self._free_slots().get()
        if self.closed:
            raise RuntimeError("the CPU pool is closed")
        call = asyncio.get_running_loop().create_task(self._call(slot, fn, args, timeout_s))
        self._calls.add(call)
        call.add_done_callback(self._call_done)
        return await asyncio.shield(call)

    def _call_done(self, task: asyncio.Task) -> None:
        self._calls.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a caller that was cancelled no longer reads it

    async def _call(self, slot: _Slot, fn: Callable[..., Any], args: tuple, timeout_s: float) -> Any:
        outcome = "error"
        try:
            modules = tuple(m for m in warm_modules(fn) if m not in slot.warmed)
            if modules:
                outcome = "crashed"  # unless it gets ready
                await self._warm(slot, modules)
                outcome = "error"
            try:
                fut = asyncio.wrap_future(slot.submit(fn, args))
            except BrokenProcessPool as e:  # died while idle: nothing ran yet, but the caller still learns it
                outcome = "crashed"
                slot.discard(kill=False)
                raise WorkerCrashedError(f"CPU worker {slot.index} died before the call started: {e}") from e
            done, _ = await asyncio.wait({fut}, timeout=timeout_s)
            if not done:
                outcome = "timeout"
                fut.cancel()
                slot.discard(kill=True)
                raise CpuTimeoutError(f"{getattr(fn, '__qualname__', fn)} ran past its limit of {timeout_s:g} s "
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
                self._free_slots().put_nowait(slot)

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
        await asyncio.gather(*calls, return_exceptions=True)
