"""Admission control: how many jobs run their stages at once, adapted so the event loop is never saturated.

Why (issue #26): a server holding more work than its one core can turn over answers every ready callback of
every job in one pass of the event loop. At 1,024 jobs in flight on a core that serves ~500 jobs/s, a pass
took 0.3-0.5 s: every job, health probe, ``/metrics`` scrape and cancel waited that long (event-loop lag p99
480 ms), and the jobs gained nothing from it, since the core was full either way. Jobs that are not admitted
wait in the init queue, where they cost an open connection and a queue slot; their wait is reported as
``timing.queue_s`` and never charged to their timeout (the pipeline's rule for queue waits).

:class:`AdmissionGate` admits a job when its init stage is about to start and releases it when the job ends
(whatever the outcome), and adapts its limit with additive-increase / multiplicative-decrease (TCP's AIMD,
Jacobson 1988; the same shape as Netflix's ``concurrency-limits``) on a signal from the loop-lag probe
(:class:`~prorl_server.loop_monitor.LoopLagMonitor`, every 50 ms):

- **saturated**: the probe woke more than ``target_lag_s`` late *and* the loop's thread was on the CPU for
  most of the probe's span (``busy >= busy_high``) or for at least the probe's own interval (a loop that
  other processes starve of its core, and that still had ready work whenever it ran): the lag is this
  process's own work, which fewer jobs shorten (a pass over fewer ready jobs is shorter, starved or not).
  Limit x ``decrease`` (at most once per ``cooldown_s``, so a cut shows its effect first), not below
  ``min_limit``. Lag while the thread hardly ran is an idle loop waiting for the scheduler, or a blocking
  call: admitting fewer jobs would not help, so the limit stays.
- **headroom**: lag within the target, the loop busy less than ``busy_low`` of the span, and jobs waiting:
  limit + max(1, limit / 16).

The gate only ever delays the start of a job; an admitted job is never paused. ``enabled=False`` (the
``--admission-target-lag-ms 0`` setting) admits every job at once, as before.
"""
from __future__ import annotations

import asyncio
import collections
import time
from typing import Callable, Optional


class AdmissionGate:
    """An adaptive limit on the jobs admitted into their stages at once.

    Args:
        target_lag_s: event-loop lag (seconds) above which a busy loop counts as saturated.
        initial_limit: jobs admitted at once before the first adjustment.
        min_limit: the limit never goes below this (jobs).
        max_limit: nor above this (jobs; None: no bound but the jobs submitted).
        busy_high: share of the probe's span the loop's thread was on the CPU at and above which lag is the
            loop's own work (0-1).
        busy_low: share below which the loop has headroom to admit more (0-1).
        decrease: factor of a cut (0-1).
        cooldown_s: seconds between two cuts.
        interval_s: the probe's sleep, seconds (the loop-lag monitor's, 0.05).
        enabled: False admits every job at once (the limit is not enforced, still reported).
        on_change: ``(limit: int, admitted: int, waiting: int) -> None`` after every change (the metrics).

    Raises:
        ValueError: a bound or factor out of range.
    """

    def __init__(self, *, target_lag_s: float = 0.005, initial_limit: int = 256, min_limit: int = 16,
                 max_limit: Optional[int] = None, busy_high: float = 0.8, busy_low: float = 0.6,
                 decrease: float = 0.8, cooldown_s: float = 0.25, interval_s: float = 0.05, enabled: bool = True,
                 on_change: Optional[Callable[[int, int, int], None]] = None) -> None:
        if target_lag_s <= 0 or min_limit < 1 or initial_limit < min_limit or not 0 < decrease < 1 \
                or (max_limit is not None and max_limit < min_limit) or not 0 <= busy_low <= busy_high <= 1:
            raise ValueError("admission: need target_lag_s > 0, 1 <= min_limit <= initial_limit (<= max_limit), "
                             "0 < decrease < 1 and 0 <= busy_low <= busy_high <= 1")
        self.enabled = enabled
        self.target_lag_s = target_lag_s
        self.min_limit, self.max_limit = min_limit, max_limit
        self.limit = initial_limit if max_limit is None else min(initial_limit, max_limit)
        self.busy_high, self.busy_low = busy_high, busy_low
        self.decrease = decrease
        self.cooldown_s = cooldown_s
        self.interval_s = interval_s
        self.admitted = 0
        self.cuts = 0  # times the limit was cut (saturated loop)
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._last_cut = 0.0
        self._on_change = on_change

    @property
    def waiting(self) -> int:
        """Jobs waiting to be admitted."""
        return len(self._waiters)

    async def acquire(self) -> None:
        """Wait until a job may start (FIFO); the caller must :meth:`release` once, when the job ends.

        Raises:
            asyncio.CancelledError: cancelled while waiting (nothing to release then).
        """
        if not self.enabled or (self.admitted < self.limit and not self._waiters):
            self.admitted += 1
            self._changed()
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._changed()
        try:
            await fut  # its slot is counted in admitted by whoever woke it
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # woken and cancelled in the same pass: give the slot on
                self.release()
            else:
                try:
                    self._waiters.remove(fut)
                except ValueError:
                    pass
                self._changed()
            raise

    def release(self) -> None:
        """A job admitted by :meth:`acquire` ended."""
        self.admitted -= 1
        self._wake()
        self._changed()

    def _wake(self) -> None:
        while self._waiters and (not self.enabled or self.admitted < self.limit):
            fut = self._waiters.popleft()
            if not fut.done():
                self.admitted += 1
                fut.set_result(None)

    def observe(self, lag_s: float, busy: float) -> None:
        """One probe of the event loop: it woke ``lag_s`` seconds late, and the loop's thread was on the CPU
        for ``busy`` (0-1) of the probe's span. Adjusts the limit (see the module docstring)."""
        own_work = busy >= self.busy_high or busy * (self.interval_s + lag_s) >= self.interval_s
        if lag_s > self.target_lag_s and own_work:
            now = time.monotonic()
            if now - self._last_cut >= self.cooldown_s and self.limit > self.min_limit:
                # cut from what is admitted when that is below the limit: a limit nobody reaches says nothing
                self.limit = max(self.min_limit, int(min(self.limit, max(self.admitted, 1)) * self.decrease))
                self._last_cut = now
                self.cuts += 1
                self._changed()
        elif lag_s <= self.target_lag_s and busy < self.busy_low and self._waiters:
            grown = self.limit + max(1, self.limit // 16)
            self.limit = grown if self.max_limit is None else min(grown, self.max_limit)
            self._wake()
            self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self.limit, self.admitted, len(self._waiters))
