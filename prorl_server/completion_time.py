"""Relative completion time within a group (issue #35 part 3; MiniMax Forge's completion-time reward).

A request opts in with ``completion_time: true`` (with ``group_id`` and ``group_size``, the n samples of one
prompt). When the group ends, each resolved member gets

    speed_i = clip((median_resolved(T) - T_i) / median_resolved(T), -1, 1)

where ``T`` is the member's **model time**, the sum over its turn records of ``t_llm_s + t_tool_critical_s``
(generation plus the critical path of its own tool calls; never ``t_wait_s``: queueing, weight-swap holds,
failover and sandbox start are the system's and cannot move it). Unresolved members get 0 (shaping time on failed
rollouts teaches giving up fast), and so does every member of a group with fewer than 2 resolved members.

Delivery: a member's result is held (its ``POST /process`` and ``GET /jobs/{id}`` say it is still running)
until its group ends, then every member's result is answered, and journalled, with ``speed`` set. A group ends
when ``group_size`` of its opted-in members have ended (failed and cancelled ones included), or
:attr:`CompletionGroups.wait_s` seconds (the server's ``completion_time_wait_s``, default 600) after its first
member ended (members not ended by then are left out;
one ending later is answered at once, as a group of its own), or when the server stops or shuts down.

Reward: ``speed`` enters ``reward`` only when the request also names it in ``reward_weights`` (weight ``w``):
then, at the group's end, each member that did not fail gets the component ``speed`` ``{value: speed, weight:
w, per_turn: all of it on the last turn}`` and ``reward`` becomes the weighted sum of its components, checked
as a handler's are (:func:`with_speed`). ``resolved`` stays the task's. A failed member keeps its outcome alone
(:func:`prorl_server.rewards.finalize`: a failure earns no process term).
"""
from __future__ import annotations

import asyncio
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional

from prorl_server.rewards import SPEED, finalize, weighted_sum
from prorl_server.types import JobResult, RewardComponent

#: Seconds a group waits for its missing members after its first member ended.
GROUP_WAIT_S = 600.0


def model_time(result: JobResult) -> float:
    """The model's seconds of ``result``: ``math.fsum`` of ``t_llm_s + t_tool_critical_s`` over its turns."""
    return math.fsum(t.t_llm_s + t.t_tool_critical_s for t in result.turns)


def relative_speeds(members: list[tuple[bool, float]]) -> list[float]:
    """``speed`` of each ``(resolved, model_time_s)`` member (see the module docstring); a list of the same length,
    each in [-1, 1]. A resolved member's time of 0 beside a median of 0 scores 0."""
    times = [t for ok, t in members if ok]
    if len(times) < 2:
        return [0.0] * len(members)
    med = statistics.median(times)
    if not med > 0:
        return [0.0] * len(members)
    return [max(-1.0, min(1.0, (med - t) / med)) if ok else 0.0 for ok, t in members]


def with_speed(result: JobResult, speed: float, reward_weights: Optional[dict[str, float]]) -> JobResult:
    """``result`` with its ``speed`` set and, when ``reward_weights`` names :data:`~prorl_server.rewards.SPEED`
    and ``result`` did not fail, the component ``speed`` (``per_turn``: 0 on every turn but the last, which
    takes ``speed``) added, ``reward`` recomputed as the weighted sum of the components and each turn's share
    refilled, through the check every handler's components pass (:func:`prorl_server.rewards.finalize`).

    Shared by the group's end and ``prorl-journal regrade``, so both give the same bytes. ``speed`` in [-1, 1].
    """
    result = result.model_copy(update={"speed": speed})
    weights = reward_weights or {}
    if SPEED not in weights or result.failure_kind is not None:
        return result
    n = len(result.turns)
    comps = {**result.reward_components,
             SPEED: RewardComponent(value=speed, weight=float(weights[SPEED]),
                                    per_turn=[0.0] * (n - 1) + [speed] if n else None)}
    return finalize(result.model_copy(update={"reward": weighted_sum(comps)}), comps, comps)


@dataclass
class _Group:
    size: int
    held: dict[str, tuple[Any, JobResult]] = field(default_factory=dict)  # job id -> (job, result)
    timer: Optional[asyncio.TimerHandle] = None


Deliver = Callable[[Any, JobResult], Awaitable[None]]


class CompletionGroups:
    """Holds the results of opted-in members until their group ends, then delivers each with its ``speed``.

    Args:
        deliver: ``async (job, result)``: answer and journal one result (the pipeline's tail of finishing a job).
        wait_s: see :data:`GROUP_WAIT_S`.
    """

    def __init__(self, deliver: Deliver, wait_s: float = GROUP_WAIT_S) -> None:
        self.deliver = deliver
        self.wait_s = wait_s
        self.groups: dict[str, _Group] = {}
        self.closing = False  # the server stops: no group can be waited for
        self._tasks: set[asyncio.Task] = set()

    @property
    def held(self) -> int:
        """Results held now."""
        return sum(len(g.held) for g in self.groups.values())

    async def hold(self, job: Any, group_id: str, size: int, result: JobResult) -> None:
        """Hold ``result`` of ``job`` (a member of ``group_id``, of ``size`` members) until the group ends; if
        this member ends it, deliver the whole group (awaited here)."""
        g = self.groups.get(group_id)
        if g is None:
            g = self.groups[group_id] = _Group(size=size)
        g.held[job.job_id] = (job, result)
        if self.closing or len(g.held) >= g.size:
            await self._end(group_id)
        elif g.timer is None:
            g.timer = asyncio.get_running_loop().call_later(self.wait_s, self._expire, group_id)

    def _expire(self, group_id: str) -> None:
        task = asyncio.create_task(self._end(group_id), name=f"completion-time:{group_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _end(self, group_id: str) -> None:
        g = self.groups.pop(group_id, None)
        if g is None:
            return
        if g.timer is not None:
            g.timer.cancel()
        members = list(g.held.values())
        speeds = relative_speeds([(r.resolved and not r.filter, model_time(r)) for _, r in members])
        await asyncio.gather(*(self.deliver(job, with_speed(r, s, getattr(job, "reward_weights", None)))
                               for (job, r), s in zip(members, speeds)))

    async def release_all(self) -> None:
        """End every group now (the server stops): each is delivered with the speeds of the members it has."""
        self.closing = True
        for gid in list(self.groups):
            await self._end(gid)
