"""Relative completion time within a group (issue #35 part 3; MiniMax Forge's completion-time reward).

A request opts in with ``completion_time: true`` (with ``group_id`` and ``group_size``, the n samples of one
prompt). When the group ends, each resolved member gets

    speed_i = clip((median_resolved(T) - T_i) / median_resolved(T), -1, 1)

where ``T`` is the member's **model time**, the sum over its turn records of ``t_llm_s + t_tool_critical_s``
(generation plus the critical path of its own tool calls; never ``t_wait_s``: queueing, weight-swap holds,
failover and sandbox start are the system's and cannot move it). Unresolved members get 0 (shaping time on failed
rollouts teaches giving up fast), and so does every member of a group with fewer than 2 resolved members.

Delivery: a member's result is held (its ``POST /process`` and ``GET /jobs/{id}`` say it is still running)
until its group ends, then every member's result is answered, and journalled, with ``speed`` set. A filtered
result (the system's doing, which the trainer re-submits under a new job id) and a cancelled one are answered at
once with ``speed`` 0: holding them would keep the trainer from re-submitting, and a trainer's cancel must not
wait. A group ends when its ``group_size`` slots are all held or were cancelled by a client (``POST /cancel``) and
no member runs or is awaited: a filtered member's slot waits for its replacement (a member beyond ``group_size``
is taken only as one), so a system fault never costs the rest of the group its speed. It also ends
:attr:`CompletionGroups.wait_s` seconds (the server's ``completion_time_wait_s``, default 600) after its first
member ended (members not ended by then are left out), or when the server stops or shuts down. A member of an
ended group (its id among the last :data:`MAX_ENDED_GROUPS`) is answered at once with ``speed`` 0, as a group of
its own. A member whose ``group_size`` differs from its open group's, or one beyond the size with no filtered
member to replace, is refused at submission (:class:`GroupConflictError`).

Reward: ``speed`` enters ``reward`` only when the request also names it in ``reward_weights`` (weight ``w``):
then, at the group's end, each member that did not fail gets the component ``speed`` ``{value: speed, weight:
w, per_turn: all of it on the last turn}`` and ``reward`` becomes the weighted sum of its components, checked
as a handler's are (:func:`with_speed`). ``resolved`` stays the task's. A failed member keeps its outcome alone
(:func:`prorl_server.rewards.finalize`: a failure earns no process term).
"""
from __future__ import annotations

import asyncio
import collections
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


#: Ids of ended groups remembered, so that a member of one that comes later is answered at once (not a new group).
MAX_ENDED_GROUPS = 4096


class GroupConflictError(ValueError):
    """A ``completion_time`` member that its open group cannot take (the HTTP routes answer 409 with
    :attr:`type`): ``group_size_mismatch``, another ``group_size`` than the group's (the client's mistake: no
    retry fixes it), or ``group_full``, one member more than ``group_size`` with no filtered member to replace
    (a member of it still runs: once the group ends, the id takes late members)."""

    def __init__(self, message: str, type_: str) -> None:
        super().__init__(message)
        self.type = type_


def cancelled_result(result: JobResult, reason: str) -> JobResult:
    """``result`` of a held member released by a cancel: ``failure_kind`` and ``critical_error`` ``cancelled``,
    ``filter: true``, reward 0.0 (the outcome alone), unresolved, ``speed`` 0.0, ``error`` = ``reason``."""
    return finalize(result.model_copy(update={
        "failure_kind": "cancelled", "critical_error": "cancelled", "filter": True, "reward": 0.0,
        "resolved": False, "error": reason, "speed": 0.0}), None)


@dataclass
class _Group:
    size: int
    live: set[str] = field(default_factory=set)  # ids of admitted members not ended yet
    held: dict[str, tuple[Any, JobResult]] = field(default_factory=dict)  # job id -> (job, result): ended, kept
    awaited: int = 0  # slots of members that ended filtered by the system's doing: their replacement is waited for
    optional: int = 0  # slots of members a client cancelled: ended, unless a replacement comes while the group is open
    timer: Optional[asyncio.TimerHandle] = None

    def complete(self) -> bool:
        return not self.live and not self.awaited and len(self.held) + self.optional >= self.size


Deliver = Callable[[Any, JobResult], Awaitable[None]]


class CompletionGroups:
    """Holds the results of opted-in members until their group ends, then delivers each with its ``speed``.

    A group has ``group_size`` slots. A member takes one when admitted (:meth:`admit`). Its result is held when it
    ends unfiltered; a filtered result (the system's doing: the trainer re-submits it under a new job id) and a
    cancelled one are answered at once with ``speed`` 0 and free the slot for one replacement. The group ends
    when no member is live, every slot is held or was cancelled by a client, and no filtered member waits for its
    replacement; or ``wait_s`` after its first member ended; or at :meth:`release_all`. A member of a group that
    has ended (the last :data:`MAX_ENDED_GROUPS` group ids) is answered at once with ``speed`` 0, as a group of its
    own.

    Args:
        deliver: ``async (job, result)``: answer and journal one result (the pipeline's tail of finishing a job).
        wait_s: see :data:`GROUP_WAIT_S`.
    """

    def __init__(self, deliver: Deliver, wait_s: float = GROUP_WAIT_S) -> None:
        self.deliver = deliver
        self.wait_s = wait_s
        self.groups: dict[str, _Group] = {}
        self.ended: "collections.OrderedDict[str, None]" = collections.OrderedDict()  # oldest first
        self.closing = False  # the server stops: no group can be waited for
        self._tasks: set[asyncio.Task] = set()

    @property
    def held(self) -> int:
        """Results held now."""
        return sum(len(g.held) for g in self.groups.values())

    def admit(self, job_id: str, group_id: str, size: int) -> None:
        """Take ``job_id`` into ``group_id`` (of ``size`` members) at submission; a group id that ended takes it
        as a late member (answered at once, ``speed`` 0).

        Raises:
            GroupConflictError: the open group has another size, or all its slots are taken and none is free
                for a replacement.
        """
        if group_id in self.ended or self.closing:
            return
        g = self.groups.get(group_id)
        if g is None:
            g = self.groups[group_id] = _Group(size=size)
        if size != g.size:
            raise GroupConflictError(f"group_size {size} differs from {g.size}, the size of the open group "
                                     f"{group_id!r}: every member of a group gives the same group_size",
                                     "group_size_mismatch")
        if job_id in g.live:
            return
        if len(g.live) + len(g.held) + g.awaited + g.optional < g.size:
            pass  # a slot never taken
        elif g.awaited:  # the replacement of a member the system failed
            g.awaited -= 1
        elif g.optional:
            g.optional -= 1
        else:
            raise GroupConflictError(
                f"group {group_id!r} has its group_size {g.size} members ({len(g.live)} running, {len(g.held)} "
                "ended) and none ended filtered: a member beyond the size is taken only to replace a filtered one",
                "group_full")
        g.live.add(job_id)

    async def hold(self, job: Any, group_id: str, result: JobResult) -> None:
        """Hold ``result`` of ``job`` (a member of ``group_id``) until the group ends; if this member ends it,
        deliver the whole group (awaited here). A filtered or cancelled result, or one of a member not live in
        an open group (late), is delivered at once with ``speed`` 0."""
        g = self.groups.get(group_id)
        if g is None or job.job_id not in g.live:
            await self.deliver(job, with_speed(result, 0.0, getattr(job, "reward_weights", None)))
            return
        g.live.discard(job.job_id)
        cancel = getattr(job, "group_cancel", None)  # (reason, by_client): cancelled while it was ending
        if cancel is not None and result.failure_kind != "cancelled":
            result = self._release(job, result, cancel[0])
        if result.filter:
            if cancel is not None and cancel[1]:
                g.optional += 1
            else:
                g.awaited += 1
            await self.deliver(job, with_speed(result, 0.0, getattr(job, "reward_weights", None)))
        else:
            g.held[job.job_id] = (job, result)
        if self.closing or g.complete():
            await self._end(group_id)
        elif g.timer is None:
            g.timer = asyncio.get_running_loop().call_later(self.wait_s, self._expire, group_id)

    async def cancel(self, job: Any, reason: str, by_client: bool) -> bool:
        """Release ``job`` if its result is held: it is delivered now, as :func:`cancelled_result`, and its slot
        counts as ended (``by_client``) or waits for a replacement (another cancel: the trainer re-submits).
        Returns whether it was held; a member still ending is released by :meth:`hold` (``job.group_cancel``)."""
        job.group_cancel = (reason, by_client)
        group_id = getattr(job, "completion_group", None) or (None,)
        g = self.groups.get(group_id[0])
        if g is None or job.job_id not in g.held:
            return False
        _, result = g.held.pop(job.job_id)
        if by_client:
            g.optional += 1
        else:
            g.awaited += 1
        await self.deliver(job, self._release(job, result, reason))
        if g.complete():  # never true here (the slot moved), but a group that can end must not wait
            await self._end(group_id[0])
        return True

    @staticmethod
    def _release(job: Any, result: JobResult, reason: str) -> JobResult:
        job.group_released = True  # the pipeline's cancel reports it cancelled
        job.critical_error = job.failure_kind = "cancelled"  # what the pipeline's metrics count it as
        return cancelled_result(result, reason)

    def _expire(self, group_id: str) -> None:
        task = asyncio.create_task(self._end(group_id), name=f"completion-time:{group_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _end(self, group_id: str) -> None:
        g = self.groups.pop(group_id, None)
        if g is None:
            return
        self.ended[group_id] = None
        while len(self.ended) > MAX_ENDED_GROUPS:
            self.ended.popitem(last=False)
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
