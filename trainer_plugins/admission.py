"""Admission: which finished rollouts a trainer may take and in what order (:class:`WindowedFIFO`), which
rollout server a job goes to (:class:`ServerChooser`), and what happens to groups over the staleness bound
(:class:`StalenessPolicy`). All three are pure bookkeeping (no I/O, no clock), picked by configuration.

Windowed FIFO.

Source: MiniMax "Forge" (windowed FIFO over the generation queue). Work items are numbered in submission
order (``seq`` 0, 1, 2, ...). The *head* is the oldest item not yet removed. The trainer may take a finished
item only if ``seq < head + W``. Items leave the queue when taken or discarded; the window slides only when
the head leaves, so taking item ``head + 2`` does not open position ``head + W``.

- ``W = 1`` is strict FIFO (synchronous order: the trainer waits for the oldest item);
- ``W = None`` (or any ``W`` at least the number of outstanding items) is greedy first-finished-first-out;
- in between, off-policy lag and difficulty drift are bounded by the window while most of greedy's
  throughput is kept (measured in ``benchmarks/scheduling.py``).

:mod:`trainer_plugins.client` uses it for groups on real servers, and the scheduling benchmark drives the same
class in a simulation.

Server choice (:class:`ServerChooser`; :func:`as_server_chooser` maps the configuration names):

- ``"least_in_flight"`` (:class:`LeastInFlight`, the default of ``RolloutClient`` and the TRL plugin): a
  group's first job goes to the server with the fewest of this process's jobs in flight (ties: the earliest
  in order, so equal servers are used round-robin starting on the same node); the group's later jobs follow
  it while any of them is in flight (one LLM backend, the prompt's prefix cache).
- ``"rendezvous"`` (:class:`RendezvousByGroup`, verl's default): rendezvous hashing of the group id
  (:func:`trainer_plugins.servers.server_for_group`), for samples of one group submitted by processes that
  share no state; round-robin for a job with no group.

Staleness (:class:`StalenessPolicy`; :func:`as_staleness_policy` maps ``"drop"`` and ``"wait"``):

- ``"drop"`` (:class:`DropStale`): a group over the bound is discarded (its running jobs cancelled).
- ``"wait"`` (:class:`WaitForStale`, dropless, like verl's ``max_off_policy_strategy=wait``): a step first
  takes the groups that would be over the bound at the next version; a group already over it is cancelled and
  its prompt regenerated.
"""
from __future__ import annotations

import itertools
from collections import Counter
from typing import AbstractSet, Any, Generic, Iterator, Optional, Protocol, Sequence, TypeVar, Union, runtime_checkable

from trainer_plugins.servers import server_for_group

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


# ------------------------------------------------------------------------------------------ server choice


@runtime_checkable
class ServerChooser(Protocol):
    """Picks the rollout server of one job. The job client calls :meth:`started` when it submits a job to the
    chosen server and :meth:`finished` when that job's request ended (whatever the outcome)."""

    def choose(self, servers: Sequence[str], group_id: Optional[str] = None,
               exclude: AbstractSet[str] = frozenset()) -> str:
        """One of ``servers`` (non-empty) for a job of ``group_id`` (None: no group), never one in ``exclude``
        while another is left (the servers on which this sample already failed)."""
        ...

    def started(self, server: str, group_id: Optional[str] = None) -> None: ...

    def finished(self, server: str, group_id: Optional[str] = None) -> None: ...


def _candidates(servers: Sequence[str], exclude: AbstractSet[str]) -> list[str]:
    if not servers:
        raise ValueError("no rollout server to choose from")
    return [s for s in servers if s not in exclude] or list(servers)


class LeastInFlight:
    """Fewest of this chooser's jobs in flight, ties to the earliest server in order; a group's jobs follow its
    first job's server while any of them is in flight (see the module docstring)."""

    def __init__(self) -> None:
        self.in_flight: Counter = Counter()  # server -> jobs in flight
        self._groups: dict[str, list] = {}  # group_id -> [server, jobs in flight]

    def choose(self, servers: Sequence[str], group_id: Optional[str] = None,
               exclude: AbstractSet[str] = frozenset()) -> str:
        candidates = _candidates(servers, exclude)
        pinned = self._groups.get(group_id) if group_id is not None else None
        if pinned is not None and pinned[0] in candidates:
            return pinned[0]
        return min(candidates, key=lambda s: self.in_flight[s])

    def started(self, server: str, group_id: Optional[str] = None) -> None:
        self.in_flight[server] += 1
        if group_id is not None:
            entry = self._groups.setdefault(group_id, [server, 0])
            entry[1] += 1

    def finished(self, server: str, group_id: Optional[str] = None) -> None:
        self.in_flight[server] -= 1
        entry = self._groups.get(group_id) if group_id is not None else None
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                del self._groups[group_id]


class RendezvousByGroup:
    """Rendezvous hashing of the group id over the candidate servers (every process computes the same server
    for a group with no shared state); round-robin for a job with no group."""

    def __init__(self) -> None:
        self._rr = itertools.count()

    def choose(self, servers: Sequence[str], group_id: Optional[str] = None,
               exclude: AbstractSet[str] = frozenset()) -> str:
        candidates = _candidates(servers, exclude)
        if group_id is None:
            return candidates[next(self._rr) % len(candidates)]
        return server_for_group(candidates, group_id)

    def started(self, server: str, group_id: Optional[str] = None) -> None:
        pass

    def finished(self, server: str, group_id: Optional[str] = None) -> None:
        pass


SERVER_CHOOSERS = {"least_in_flight": LeastInFlight, "rendezvous": RendezvousByGroup}


def as_server_chooser(spec: Union[str, ServerChooser]) -> ServerChooser:
    """A chooser from its configuration name (:data:`SERVER_CHOOSERS`), or ``spec`` itself when it is one.

    Raises:
        ValueError: an unknown name, or an object that is no :class:`ServerChooser`.
    """
    return _configured(spec, SERVER_CHOOSERS, ServerChooser, "server_chooser")


def _configured(spec: Any, table: dict[str, type], protocol: type, setting: str) -> Any:
    """``table[spec]()`` for a name, ``spec`` itself for an instance of ``protocol``; ValueError otherwise."""
    if isinstance(spec, str):
        if spec not in table:
            raise ValueError(f"{setting} must be one of {sorted(table)}, got {spec!r}")
        return table[spec]()
    if not isinstance(spec, protocol):
        raise ValueError(f"{setting} must be a name or a {protocol.__name__}, got {spec!r}")
    return spec


# ------------------------------------------------------------------------------------------ staleness


@runtime_checkable
class StalenessPolicy(Protocol):
    """What happens to a group whose weight-version lag exceeds the bound ``max_staleness`` (K)."""

    #: the configuration name
    name: str

    def due(self, lag_at_next_version: int, max_staleness: int) -> bool:
        """True: this step must take the group (finished or not: the step waits for it), because at the next
        weight version its lag would exceed K."""
        ...

    def regenerate(self) -> bool:
        """What becomes of a group found over the bound (its running jobs are cancelled either way): True, its
        prompt is submitted again at the current version; False, it is discarded."""
        ...


class DropStale:
    """``"drop"``: a group over the bound is discarded; no step waits for a slow group."""

    name = "drop"

    def due(self, lag_at_next_version: int, max_staleness: int) -> bool:
        return False

    def regenerate(self) -> bool:
        return False


class WaitForStale:
    """``"wait"`` (dropless): a step takes first the groups that would be over the bound at the next version;
    a group already over it (the version jumped by more than one in a step) is regenerated."""

    name = "wait"

    def due(self, lag_at_next_version: int, max_staleness: int) -> bool:
        return lag_at_next_version > max_staleness

    def regenerate(self) -> bool:
        return True


STALENESS_POLICIES = {"drop": DropStale, "wait": WaitForStale}


def as_staleness_policy(spec: Union[str, StalenessPolicy]) -> StalenessPolicy:
    """A policy from its configuration name (:data:`STALENESS_POLICIES`), or ``spec`` itself when it is one.

    Raises:
        ValueError: an unknown name, or an object that is no :class:`StalenessPolicy`.
    """
    return _configured(spec, STALENESS_POLICIES, StalenessPolicy, "staleness_policy")
