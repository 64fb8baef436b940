"""Seconds of a tool call that were the system's, not the model's (issue #35, red team R6).

A sandbox starts its persistent shell and IPython kernel lazily, at the first call that needs them (unless a warm
pool started the shell). That start-up (~15 ms for the shell, 1-2 s for a kernel, more under host load) is
sandbox start, the system's time: it must not land in the model's tool time, where it would move the
completion-time reward with the host's load. :class:`~sandbox.runtime.SandboxHandle` times such a start on the
host (``time.monotonic`` around its own no-op request) and adds the seconds with :func:`charge_system`; a caller
that times a tool call (the agent loop) opens :func:`system_seconds` around it and moves what was charged from the
call's time to its wait time. A context variable carries the accumulator, so calls run side by side (each in its
own task, with its own copy of the context) each see only their own seconds.
"""
from __future__ import annotations

import contextvars
from contextlib import contextmanager
from typing import Iterator, Optional

_ACCUMULATOR: "contextvars.ContextVar[Optional[list[float]]]" = contextvars.ContextVar("sandbox_system_seconds",
                                                                                       default=None)


def charge_system(seconds: float) -> None:
    """Add ``seconds`` (host ``time.monotonic`` seconds, >= 0) to the innermost open :func:`system_seconds`
    accumulator of this context; a no-op outside one."""
    acc = _ACCUMULATOR.get()
    if acc is not None and seconds > 0:
        acc[0] += seconds


def accounting() -> bool:
    """Whether a :func:`system_seconds` accumulator is open in this context (the call is made on the model's
    behalf and timed by its caller)."""
    return _ACCUMULATOR.get() is not None


@contextmanager
def system_seconds() -> Iterator[list[float]]:
    """Open an accumulator for the calls made inside the ``with`` block (of this task, and of tasks it starts
    inside the block). Yields a one-element list whose ``[0]`` is the seconds charged so far (0.0 at entry)."""
    acc = [0.0]
    token = _ACCUMULATOR.set(acc)
    try:
        yield acc
    finally:
        _ACCUMULATOR.reset(token)
