"""A minimal single-threaded event loop (``selectors`` + timers) for the in-sandbox execution server.

Why not asyncio: importing asyncio costs ~45 ms on this class of machine, which alone would break the
bubblewrap start target (issue #36: p50 < 20 ms); this loop imports in well under 1 ms. The execution server
needs only file descriptor readiness, timers and a thread-safe wake-up (for the IPython thread, which does run
asyncio, lazily, on first use). It polls with ``select.poll`` and wakes through a pipe, not through
``selectors`` and ``socket``: those import ``enum`` and ``collections`` and build enum classes of every
socket constant (~7 ms a start).
"""
from __future__ import annotations

import itertools
import posix  # not `os`: it imports _collections_abc, stat and posixpath (~1.1 ms at every start)
import select
import _thread  # not `threading`: a lock is all that is needed, and its import is not free
import time
# `typing` costs ~9 ms to import and this module runs in every sandbox start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable, Optional

# Imported by the first call_later (every heap operation follows one), not at the top: its C part is a shared
# object to load, and a start schedules no timer.
heapq = None


class Timer:
    """Handle of a scheduled callback; ``cancel()`` makes it a no-op."""

    __slots__ = ("when", "callback", "cancelled")

    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class EventLoop:
    """Readers, writers, timers (monotonic seconds) and ``call_soon_threadsafe``."""

    def __init__(self) -> None:
        self._poll = select.poll()
        self._timers: list[tuple[float, int, Timer]] = []
        self._seq = itertools.count()
        self._ready: list[Callable[[], None]] = []
        self._lock = _thread.allocate_lock()
        self._wake_r, self._wake_w = posix.pipe()  # close-on-exec, as every descriptor Python opens
        posix.set_blocking(self._wake_r, False)
        posix.set_blocking(self._wake_w, False)
        self._readers: dict[int, Callable[[], None]] = {}
        self._writers: dict[int, Callable[[], None]] = {}
        self._poll.register(self._wake_r, select.POLLIN)
        self._stopping = False

    # -- fds
    def _update(self, fd: int) -> None:
        events = (select.POLLIN if fd in self._readers else 0) | (select.POLLOUT if fd in self._writers else 0)
        if events:
            self._poll.register(fd, events)  # registers or modifies
        else:
            try:
                self._poll.unregister(fd)
            except KeyError:
                pass

    def add_reader(self, fd: int, cb: Callable[[], None]) -> None:
        self._readers[fd] = cb
        self._update(fd)

    def remove_reader(self, fd: int) -> None:
        if self._readers.pop(fd, None) is not None:
            self._update(fd)

    def add_writer(self, fd: int, cb: Callable[[], None]) -> None:
        self._writers[fd] = cb
        self._update(fd)

    def remove_writer(self, fd: int) -> None:
        if self._writers.pop(fd, None) is not None:
            self._update(fd)

    # -- time
    def call_later(self, delay_s: float, cb: Callable[[], None]) -> Timer:
        global heapq
        if heapq is None:
            import heapq
        t = Timer(time.monotonic() + max(0.0, delay_s), cb)
        heapq.heappush(self._timers, (t.when, next(self._seq), t))
        return t

    def call_soon_threadsafe(self, cb: Callable[[], None]) -> None:
        with self._lock:
            self._ready.append(cb)
        try:
            posix.write(self._wake_w, b"\0")
        except OSError:
            pass  # the wake-up pipe is already full: the loop will run the callback anyway

    def stop(self) -> None:
        """Stop after the current iteration. Safe in a signal handler (no lock; one byte to the wake-up pipe)."""
        self._stopping = True
        try:
            posix.write(self._wake_w, b"\0")
        except OSError:
            pass

    def run_forever(self) -> None:
        while not self._stopping:
            timeout: Optional[float] = None
            while self._timers and self._timers[0][2].cancelled:
                heapq.heappop(self._timers)
            if self._timers:
                timeout = max(0.0, self._timers[0][0] - time.monotonic())
            try:
                polled = self._poll.poll(None if timeout is None else timeout * 1000.0)  # ms, rounded up
            except InterruptedError:  # a signal handler ran (PEP 475 retries only without one that raised)
                polled = []
            for fd, events in polled:
                if fd == self._wake_r:
                    try:
                        while posix.read(self._wake_r, 4096):
                            pass
                    except OSError:
                        pass
                    continue
                # as selectors does: an error or hang-up wakes readers and writers alike
                if events & ~select.POLLOUT and fd in self._readers:
                    self._readers[fd]()
                if events & ~select.POLLIN and fd in self._writers:
                    self._writers[fd]()
            with self._lock:
                ready, self._ready = self._ready, []
            for cb in ready:
                cb()
            now = time.monotonic()
            while self._timers and self._timers[0][0] <= now:
                _, _, t = heapq.heappop(self._timers)
                if not t.cancelled:
                    t.callback()

    def close(self) -> None:
        posix.close(self._wake_r)
        posix.close(self._wake_w)
