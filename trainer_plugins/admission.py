"""Windowed FIFO admission: which finished rollouts a trainer may take, and in what order.

Source: MiniMax "Forge" (windowed FIFO over the generation queue). Work items are numbered in submission
order (``seq`` 0, 1, 2, ...). The *head* is the oldest item not yet removed. The trainer may take a finished
item only if ``seq < head + W``. Items leave the queue when taken or discarded; the window slides only when
the head leaves, so taking item ``head + 2`` does not open position ``head + W``.

- ``W = 1`` is strict FIFO (synchronous order: the trainer waits for the oldest item);
- ``W = None`` (or any ``W`` at least the number of outstanding items) is greedy first-finished-first-out;
- in between, off-policy lag and difficulty drift are bounded by the window while most of greedy's
  throughput is kept (measured in ``benchmarks/scheduling.py``).

This class is pure bookkeeping (no I/O, no clock): :mod:`trainer_plugins.client` uses it for groups on real
servers, and the scheduling benchmark drives the same class in a simulation.
"""
from __future__ import annotations

from typing import Generic, Iterator, Optional, TypeVar

T = TypeVar("T")


class WindowedFIFO(Generic[T]):
    """Submission-ordered queue with a take window of ``window`` positions from the head.

    Args:
        window: W >= 1, or None for greedy (no window).

    Raises:
        ValueError: ``window`` < 1.
    """

    def __init__(self, window: Optional[int] = None) -> None:
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1 or None (greedy), got {window}")
        self.window = window
        self._items: dict[int, T] = {}  # seq -> item, insertion (= seq) order
        self._ready: set[int] = set()
        self._next_seq = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, seq: int) -> bool:
        return seq in self._items

    def __iter__(self) -> Iterator[tuple[int, T]]:
        return iter(list(self._items.items()))

    @property
    def head(self) -> Optional[int]:
        """``seq`` of the oldest item still queued (None when empty)."""
        return next(iter(self._items), None)

    @property
    def limit(self) -> Optional[int]:
        """First ``seq`` outside the window (None: no limit, greedy or empty)."""
        head = self.head
        if head is None or self.window is None:
            return None
        return head + self.window

    def push(self, item: T) -> int:
        """Append ``item`` at the tail; returns its ``seq``."""
        seq = self._next_seq
        self._next_seq += 1
        self._items[seq] = item
        return seq

    def get(self, seq: int) -> T:
        return self._items[seq]

    def mark_ready(self, seq: int) -> None:
        """The item finished generating and may be taken once it is inside the window."""
        if seq in self._items:
            self._ready.add(seq)

    def is_ready(self, seq: int) -> bool:
        return seq in self._ready

    def in_window(self, seq: int) -> bool:
        limit = self.limit
        return seq in self._items and (limit is None or seq < limit)

    def takeable(self) -> list[int]:
        """``seq`` of the ready items inside the window, oldest first."""
        limit = self.limit
        return sorted(s for s in self._ready if limit is None or s < limit)

    def take(self, seq: int) -> T:
        """Hand out one ready item inside the window and remove it.

        Raises:
            KeyError: not queued. ValueError: not ready, or outside the window (never handed out).
        """
        if seq not in self._items:
            raise KeyError(seq)
        if seq not in self._ready:
            raise ValueError(f"item {seq} has not finished")
        if not self.in_window(seq):
            raise ValueError(f"item {seq} is outside the window [{self.head}, {self.limit})")
        return self.remove(seq)

    def take_ready(self, limit: Optional[int] = None) -> list[T]:
        """Take up to ``limit`` takeable items, oldest first (all of them when None)."""
        seqs = self.takeable()
        if limit is not None:
            seqs = seqs[:limit]
        return [self.take(s) for s in seqs]

    def remove(self, seq: int) -> T:
        """Remove an item without the window check (discarded: dropped, cancelled, stale)."""
        self._ready.discard(seq)
        return self._items.pop(seq)
