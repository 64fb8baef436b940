"""A job's turn records made whole (issue #35 part 1): the run stage's time outside any turn is charged.

Each :class:`~prorl_server.llm.conversation.Conversation` partitions its own life into its turns' ``t_llm_s +
t_tool_critical_s + t_wait_s`` (:mod:`prorl_server.llm.conversation`; the critical path: calls run side by side
count once). The run stage also spends time outside any conversation: the handler's set-up before the first
turn (acquiring a backend, loading the tokenizer, a sandbox it starts in ``run``) and its wrap-up after the
last. That time is the system's, so :func:`charge_run_time` adds it to the first turn's ``t_wait_s``; then the turns' times add up to ``timing.run_s`` (the run stage's wall time, host
``time.monotonic``) and ``queue_s + init_s + run_s + eval_s`` is the job's wall time from submit to result.
"""
from __future__ import annotations

import math

from prorl_server.types import JobResult


def turn_seconds(result: JobResult) -> float:
    """Seconds the result's turns account for: the sum of ``t_llm_s + t_tool_critical_s + t_wait_s`` over
    ``turns`` (``t_tool_s`` sums calls that may have run side by side; their wall time is the critical path)."""
    return math.fsum(t.t_llm_s + t.t_tool_critical_s + t.t_wait_s for t in result.turns)


def charge_run_time(result: JobResult) -> JobResult:
    """``result`` with the run stage's time outside its turns (``timing.run_s`` minus :func:`turn_seconds`, when
    positive) added to its first timed turn's ``t_wait_s`` (the first with ``t_llm_s > 0``: a gateway ``n > 1``
    branch's records, which carry no time, come first in a session's list; else the first turn); unchanged
    without turns. Time the turns account for beyond ``run_s`` (turns of conversations run side by side) is left
    as recorded."""
    if not result.turns:
        return result
    rest = result.timing.run_s - turn_seconds(result)
    if rest <= 0:
        return result
    turns = list(result.turns)
    i = next((k for k, t in enumerate(turns) if t.t_llm_s > 0), 0)
    turns[i] = turns[i].model_copy(update={"t_wait_s": turns[i].t_wait_s + rest})
    return result.model_copy(update={"turns": turns})
