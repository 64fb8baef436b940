"""Keep CPython's cyclic garbage collector off the event loop's critical path.

A rollout server holds two kinds of objects: a few hundred thousand that live as long as the process (aiohttp,
pydantic, and once the first job loads the tokenizer, torch and transformers: ~370k objects) and the short-lived
state of the jobs in flight. A full (generation 2) collection walks *all* of them, stopping the event loop
for 0.5-0.9 s about once a second under load (issue #26: the collector took 47-62 % of the server's time).

:class:`CollectorControl` does three things (see docs/running.md, "Scale"):

- **freeze** (``gc.freeze``, Python docs "gc.freeze: ... avoid ... collections" for long-lived objects): at
  start, after a full collection, everything alive is moved to the permanent generation the collector never
  walks; and again, once an import burst has settled, whenever the process has imported many new modules
  since (the tokenizer's torch/transformers load on the first job, a handler's lazy imports) or a load of
  long-lived objects has ended (:func:`note_long_lived_load`: the tokenizer's load also when transformers was
  imported before it, as in tests, when it imports too few modules to count as a burst), checked every
  ``check_interval_s``. A re-freeze collects nothing and freezes: O(1). Collecting first stalled the event
  loop for the whole import: the tokenizer's first load runs with the collector off, so its ~400k objects are
  all young, and even a young-generation collection walked them (3.65 s measured on a fresh server, while
  the first jobs' timeouts ran: a third of them timed out). The price: the import's own cyclic garbage is
  frozen with it, once. Caveat of ``gc.freeze``: reference cycles among objects that were alive at a freeze
  and die later are not reclaimed until :meth:`stop` (plain reference counting still frees everything else);
  the bound is what was alive at the few re-freezes of a process's life (the jobs in flight then).
- **threshold**: generation 0 is collected every ``gen0_threshold`` net allocations instead of CPython's
  700, so the per-turn garbage of a few thousand jobs (dicts, lists, futures) mostly dies by reference
  counting before a collection ever sees it.
- **metrics**: time and count of collections by generation (``prorl_gc_seconds``), and the frozen objects
  (``prorl_gc_frozen_objects``): what the two settings above bought is visible in ``GET /metrics``.

The collector is process-wide; :meth:`stop` restores the thresholds it found and unfreezes only what it froze
when it is the last running instance in the process (tests run several servers in one process).
"""
from __future__ import annotations

import asyncio
import gc
import logging
import sys
import threading
import time
from typing import Any, Callable, Optional

log = logging.getLogger(__name__)

#: New modules imported since the last freeze that make the next check re-freeze (the tokenizer's import of
#: transformers/torch is thousands; a handler's lazy import of sympy hundreds).
REFREEZE_MODULES = 50

_running: list["CollectorControl"] = []  # instances started in this process (the collector is process-wide)
_loads = 0  # loads of long-lived objects ended in this process (note_long_lived_load)
_loads_lock = threading.Lock()  # loads end in worker threads


def note_long_lived_load() -> None:
    """Say that a load of objects that live as long as the process has ended (the server's tokenizer): the next
    check of every running :class:`CollectorControl` re-freezes once imports have settled, however few modules
    the load imported. Counting modules alone missed the tokenizer whenever transformers was imported before
    it. Thread-safe; call it from the thread that loaded."""
    global _loads
    with _loads_lock:
        _loads += 1


class CollectorControl:
    """Freezes long-lived objects and raises the generation-0 threshold while a server runs.

    Args:
        freeze: move long-lived objects out of the collector's view (``gc.freeze``) at start and after large
            imports; False leaves the collector as CPython configures it (apart from ``gen0_threshold``).
        gen0_threshold: net allocations between generation-0 collections (CPython's default 700); None keeps
            the current thresholds. Generations 1 and 2 keep their thresholds.
        on_collection: ``(generation: int, seconds: float) -> None``, called after every collection (the
            metrics); runs in whichever thread triggered the collection.
        on_frozen: ``(objects: int) -> None``, called after every freeze with ``gc.get_freeze_count()``.
        check_interval_s: seconds between the checks for new imports.

    Raises:
        ValueError: ``gen0_threshold`` below 1.
    """

    def __init__(self, *, freeze: bool = True, gen0_threshold: Optional[int] = 50_000,
                 on_collection: Optional[Callable[[int, float], None]] = None,
                 on_frozen: Optional[Callable[[int], None]] = None, check_interval_s: float = 1.0) -> None:
        if gen0_threshold is not None and gen0_threshold < 1:
            raise ValueError(f"gen0_threshold must be >= 1, got {gen0_threshold}")
        self.freeze = freeze
        self.gen0_threshold = gen0_threshold
        self.check_interval_s = check_interval_s
        self._on_collection = on_collection
        self._on_frozen = on_frozen
        self._saved_threshold: Optional[tuple[int, int, int]] = None
        self._modules_at_freeze = 0
        self._modules_at_check = 0
        self._loads_at_freeze = 0
        self._started_at = 0.0
        self._task: Optional[asyncio.Task] = None
        self.freezes = 0  # how many times this instance froze (start included)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Install the callback and threshold and freeze what is alive now (idempotent); on the running loop."""
        if self in _running:
            return
        _running.append(self)
        if self._on_collection is not None:
            gc.callbacks.append(self._callback)
        if self.gen0_threshold is not None:
            self._saved_threshold = gc.get_threshold()
            gc.set_threshold(self.gen0_threshold, *self._saved_threshold[1:])
        if self.freeze:
            self._freeze(first=True)
            self._task = asyncio.get_running_loop().create_task(self._watch_imports(), name="gc-refreeze")

    async def stop(self) -> None:
        """Undo :meth:`start` (idempotent): callback removed, thresholds restored; the frozen objects go back
        to the collector when no other instance runs in this process."""
        if self not in _running:
            return
        _running.remove(self)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        if self._saved_threshold is not None:
            gc.set_threshold(*self._saved_threshold)
            self._saved_threshold = None
        if self.freeze and not any(c.freeze for c in _running):
            gc.unfreeze()

    # ------------------------------------------------------------------ freezing
    def _freeze(self, first: bool = False) -> None:
        t0 = time.perf_counter()
        if first:  # at start, before serving; a re-freeze runs while jobs do: no walk at all (module docstring)
            gc.collect(2)
        self._loads_at_freeze = _loads  # read first: a load ending during the freeze makes the next check freeze
        gc.freeze()
        self._modules_at_freeze = self._modules_at_check = len(sys.modules)
        self.freezes += 1
        n = gc.get_freeze_count()
        if self._on_frozen is not None:
            self._on_frozen(n)
        log.info("collector: %d long-lived objects frozen (%s, %.0f ms)", n,
                 "at start" if first else "after new imports", 1000 * (time.perf_counter() - t0))

    def check(self) -> bool:
        """Re-freeze if at least :data:`REFREEZE_MODULES` modules were imported or a long-lived load ended
        (:func:`note_long_lived_load`) since the last freeze, and no module was imported since the previous
        check (an import burst, such as transformers' lazy submodules, is over: one re-freeze for it, not one
        per step). Returns whether it did."""
        n = len(sys.modules)
        settled, self._modules_at_check = n == self._modules_at_check, n
        grown = n - self._modules_at_freeze >= REFREEZE_MODULES or _loads != self._loads_at_freeze
        if not grown or not settled:
            return False
        self._freeze()
        return True

    async def _watch_imports(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval_s)
            self.check()

    # ------------------------------------------------------------------ timing
    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started_at = time.perf_counter()
        elif self._on_collection is not None:
            self._on_collection(info["generation"], time.perf_counter() - self._started_at)
