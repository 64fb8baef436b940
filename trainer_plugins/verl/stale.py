"""Cancel the rollouts of prompt groups that can no longer be trained (verl 0.9.1 V1 trainer, ``drop`` strategy).

verl's async replay buffer (``verl.trainer.ppo.v1.replay_buffer.ReplayBufferAsync``) evicts a *finished* prompt
group sampled at step ``s`` once ``global_steps - s + 1 > max_off_policy_threshold``, but it never stops one that
is still running: its jobs keep their sandboxes, tools and LLM calls on the rollout servers until they end, and
are then thrown away. verl never cancels agent-loop tasks. Here:

1. :class:`trainer_plugins.verl.replay_buffer.ProRLReplayBuffer` (trainer process), after it has sampled step
   ``g``'s batch, names the groups still pending or running that the next sample, at step ``g + 1``, must evict:
   ``(g + 1) - s + 1 > max_off_policy_threshold`` (verl's own rule, one step ahead; nothing can train them any
   more). It hands their uids to a canceller, by default :class:`RayStaleCanceller`.
2. :class:`RayStaleCanceller` runs :func:`cancel_stale_groups` in every agent loop worker (verl's
   ``AgentLoopWorkerTQ`` Ray actors, reached through the trainer that owns the buffer's ``refill_fn``) with Ray's
   ``__ray_call__``: verl's worker has no method for it.
3. In each worker, :data:`STALE_ROWS` (a :class:`StaleRows`) knows the running rows of
   :class:`trainer_plugins.verl.agent_loop.ProRLAgentLoop` by their group ``uid``; each row of a stale group is
   cancelled as an asyncio task, which cancels its job on the rollout server through the one rollout client
   (:meth:`trainer_plugins.jobs.JobSubmitter.submit`: ``POST /cancel``, robust to the job not having reached the
   server yet; the server releases the sandbox and the job's LLM call). The row then ends as a zero-loss row
   with ``extra_fields.prorl.stale`` true and ``failure_kind`` ``cancelled`` (never re-submitted, never a fault
   for the circuit breaker), so the group finishes and verl evicts it as stale and refills it. A row of a
   stale group that starts after the cancel ends the same way without submitting a job.

The count of samples cancelled is ``training/prorl_async/rollouts_cancelled_stale_total``, per step.
Limit: the cancel comes when step ``g``'s sample ends; in ``colocate_async`` verl's replicas sleep while the
trainer trains, so a stale turn waiting on them holds only its sandbox until then. The relay's own call into
verl's replica (a Ray actor call) is not aborted when the rollout server drops its request: that turn ends at
its ``max_tokens`` inside verl.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from typing import Any, Callable, Iterable, Optional

log = logging.getLogger(__name__)

#: how many stale group uids a worker remembers (each a short string; the oldest is forgotten first)
_TOMBSTONES = 65536


class StaleRows:
    """The rows (asyncio tasks) of this process's agent loops, by their prompt group's ``uid``, and the groups
    declared stale. Thread-safe: :meth:`cancel` may be called from a Ray thread other than the loop's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: dict[str, set[asyncio.Task]] = {}
        self._stale: "OrderedDict[str, None]" = OrderedDict()

    def add(self, uid: str, task: asyncio.Task) -> None:
        with self._lock:
            self._rows.setdefault(uid, set()).add(task)

    def discard(self, uid: str, task: asyncio.Task) -> None:
        with self._lock:
            tasks = self._rows.get(uid)
            if tasks is not None:
                tasks.discard(task)
                if not tasks:
                    del self._rows[uid]

    def is_stale(self, uid: str) -> bool:
        """Whether ``uid``'s group was declared stale (:meth:`cancel`)."""
        with self._lock:
            return uid in self._stale

    def cancel(self, uids: Iterable[str]) -> int:
        """Declare the groups ``uids`` stale and cancel their running rows (each on its own event loop).

        Returns: how many rows were running and are being cancelled.
        """
        todo: list[asyncio.Task] = []
        with self._lock:
            for uid in uids:
                self._stale[uid] = None
                self._stale.move_to_end(uid)
                todo.extend(t for t in self._rows.get(uid, ()) if not t.done())
            while len(self._stale) > _TOMBSTONES:
                self._stale.popitem(last=False)
        for task in todo:
            # the task's own loop cancels it: this may run on a Ray thread (call_soon_threadsafe wakes the loop)
            task.get_loop().call_soon_threadsafe(task.cancel, "its prompt group is stale")
        return len(todo)


#: the rows of this process (one per agent loop worker process)
STALE_ROWS = StaleRows()


def cancel_stale_groups(worker: Any, uids: Iterable[str]) -> int:
    """Cancel the running rows of the groups ``uids`` in this process (:data:`STALE_ROWS`); run in an agent loop
    worker through Ray's ``worker.__ray_call__.remote(cancel_stale_groups, uids)`` (``worker`` is verl's actor
    instance, unused). Returns how many rows were cancelled."""
    return STALE_ROWS.cancel(list(uids))


class RayStaleCanceller:
    """Hands stale group uids to every agent loop worker of verl's trainer (:func:`cancel_stale_groups`).

    Args:
        refill_fn: the ``refill_fn`` verl gives its replay buffer (``PPOTrainer._add_prompts_to_generate``, a
            bound method): its trainer holds ``agent_loop_manager.agent_loop_workers`` once ``fit`` started.
        timeout_s: seconds to wait for the workers' answers (a worker that does not answer is logged).
    """

    def __init__(self, refill_fn: Optional[Callable], timeout_s: float = 30.0) -> None:
        self.trainer = getattr(refill_fn, "__self__", None)
        self.timeout_s = timeout_s
        self._warned = False

    def workers(self) -> list:
        manager = getattr(self.trainer, "agent_loop_manager", None)
        return list(getattr(manager, "agent_loop_workers", None) or [])

    def __call__(self, uids: set[str]) -> int:
        """Cancel the rows of ``uids`` in every worker. Returns how many rows the workers cancelled."""
        workers = self.workers()
        if not workers:
            if not self._warned:
                log.warning("stale prompt groups cannot be cancelled: the replay buffer reaches no agent loop "
                            "workers (refill_fn is not a verl trainer's method); they run to completion")
                self._warned = True
            return 0
        import ray

        refs = [w.__ray_call__.remote(cancel_stale_groups, sorted(uids)) for w in workers]
        try:
            return int(sum(ray.get(refs, timeout=self.timeout_s)))
        except Exception as e:  # cancelling is best effort: verl still evicts the groups when they finish
            log.warning("cancelling %d stale prompt groups in the agent loop workers failed: %r", len(uids), e)
            return 0
