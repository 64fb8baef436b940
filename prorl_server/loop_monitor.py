"""Event-loop lag: how late a task that sleeps a fixed interval wakes up.

Anything that holds the event loop (CPU-bound scoring, a blocking call, a huge JSON body) delays every job,
gateway request and health probe by as much; this monitor makes that delay visible as a metric
(``prorl_event_loop_lag_seconds``) instead of as unexplained timeouts.
"""
from __future__ import annotations

import asyncio
import collections
import time
from typing import Callable, Optional

DEFAULT_INTERVAL_S = 0.05


class LoopLagMonitor:
    """Sleeps ``interval_s`` in a loop and records ``lag = woke - (slept_at + interval_s)``, seconds (>= 0).

    Args:
        interval_s: the sleep between probes, seconds.
        histogram: a prometheus-client ``Histogram`` each lag is observed in (or None).
        max_gauge: a ``Gauge`` set to the largest lag of the last ``window_s`` seconds (or None).
        window_s: the window of ``max_gauge``, seconds.
        keep: how many recent lags :attr:`samples` keeps (benchmarks read them for percentiles).
        on_probe: ``(lag_s: float, busy: float) -> None`` after every probe: its lag and the share (0-1) of the
            probe's span the loop's thread spent on the CPU (near 1: the loop was busy with its own work; low
            with a high lag: another process had the core, or the thread blocked); the admission gate's signal
            (:mod:`prorl_server.admission`).
    """

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S, histogram=None, max_gauge=None,
                 window_s: float = 10.0, keep: int = 20000,
                 on_probe: Optional[Callable[[float, float], None]] = None) -> None:
        self.on_probe = on_probe
        self.interval_s = interval_s
        self._histogram = histogram
        self._max_gauge = max_gauge
        self._window: collections.deque[float] = collections.deque(maxlen=max(1, round(window_s / interval_s)))
        self.samples: collections.deque[float] = collections.deque(maxlen=keep)
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        """Start probing on the running loop (idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._probe(), name="loop-lag-monitor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def record(self, lag: float) -> None:
        self.samples.append(lag)
        self._window.append(lag)
        if self._histogram is not None:
            self._histogram.observe(lag)
        if self._max_gauge is not None:
            self._max_gauge.set(max(self._window))

    async def _probe(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t0, c0 = loop.time(), time.thread_time()
            await asyncio.sleep(self.interval_s)
            span = loop.time() - t0
            lag = max(0.0, span - self.interval_s)
            self.record(lag)
            if self.on_probe is not None:
                self.on_probe(lag, (time.thread_time() - c0) / span if span > 0 else 0.0)
