"""A minimal single-threaded event loop (``selectors`` + timers) for the in-sandbox execution server.

Why not asyncio: importing asyncio costs ~45 ms on this class of machine, which alone would break the
bubblewrap start target (p50 < 50 ms); this loop imports in ~2 ms. The execution server needs only file
descriptor readiness, timers and a thread-safe wake-up (for the IPython thread, which does run asyncio,
lazily, on first use).
"""
from __future__ import annotations

import heapq
import itertools
import selectors
import socket
import _thread  # not `threading`: a lock is all that is needed, and its import is not free
import time
# `typing` costs ~9 ms to import and this module runs in every sandbox start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable, Optional


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
        self._sel = selectors.DefaultSelector()
        self._timers: list[tuple[float, int, Timer]] = []
        self._seq = itertools.count()
        self._ready: list[Callable[[], None]] = []
        self._lock = _thread.allocate_lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._readers: dict[int, Callable[[], None]] = {}
        self._writers: dict[int, Callable[[], None]] = {}
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._stopping = False

    # -- fds
    def _update(self, fd: int) -> None:
        events = (selectors.EVENT_READ if fd in self._readers else 0) | (
            selectors.EVENT_WRITE if fd in self._writers else 0)
        try:
            self._sel.unregister(fd)
        except KeyError:
            pass
        if events:
            self._sel.register(fd, events)

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
        t = Timer(time.monotonic() + max(0.0, delay_s), cb)
        heapq.heappush(self._timers, (t.when, next(self._seq), t))
        return t

    def call_soon_threadsafe(self, cb: Callable[[], None]) -> None:
        with self._lock:
            self._ready.append(cb)
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # the wake-up pipe is already full: the loop will run the callback anyway

    def stop(self) -> None:
        """Stop after the current iteration. Safe in a signal handler (no lock; one byte to the wake-up pipe)."""
        self._stopping = True
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass

    def run_forever(self) -> None:
        while not self._stopping:
            timeout: Optional[float] = None
            while self._timers and self._timers[0][2].cancelled:
                heapq.heappop(self._timers)
            if self._timers:
                timeout = max(0.0, self._timers[0][0] - time.monotonic())
            for key, events in self._sel.select(timeout):
                fd = key.fd
                if key.fileobj is self._wake_r:
                    try:
                        while self._wake_r.recv(4096):
                            pass
                    except (BlockingIOError, OSError):
                        pass
                    continue
                if events & selectors.EVENT_READ and fd in self._readers:
                    self._readers[fd]()
                if events & selectors.EVENT_WRITE and fd in self._writers:
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
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()
