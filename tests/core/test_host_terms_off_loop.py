"""The host-computed reward terms run off the event loop (issue #35, U-LOOP part 1): a policy turn built to be slow
to score (262,144 characters, 32,768 distinct Han letters: the language-mixing share's worst case, ~50 ms a turn)
must not stall every other job's I/O while its eval runs, and the values stay those computed inline, so
``prorl-journal regrade`` reproduces them byte for byte.

Fast tier: the shipped ``shout`` and ``math`` handlers' eval through :class:`~prorl_server.journal.regrade.Regrader`
(the pipeline's eval stage for one rebuilt job; math scores its answer in the CPU pool, warmed before measuring):
while each handler's own ``eval`` runs, a ticker sleeps 5 ms at a time on the same loop and records how late each
wake-up is.
"""
from __future__ import annotations

import asyncio
import random
import time

from handlers.math import MathHandler
from handlers.shout import ShoutHandler
from prorl_server.journal.regrade import Regrader
from prorl_server.plugin.registry import HandlerRegistry
from prorl_server.rewards import STANDARD_TERMS, language_mixing
from prorl_server.types import JobResult, ProcessRequest, Trajectory, TurnRecord

#: The slow turn: 32,768 distinct CJK letters (BMP and plane 2), repeated to 262,144 characters.
_HAN = [chr(c) for c in random.Random(0).sample([*range(0x4E00, 0xA000), *range(0x20000, 0x2A6E0)], 1 << 15)]
SLOW_TURN = "".join(_HAN * 8) + "Latin letters mixed in"
#: Largest lateness of one 5 ms tick the loop may show while eval runs, seconds (the brief's ~20 ms). Before
#: the change one slow turn alone held the loop ~40-50 ms; a worker thread holds the GIL for at most the switch
#: interval (5 ms) plus its longest C call.
MAX_LAG_S = 0.020  # a thread's GIL hand-over alone shows 6-12 ms here
#: Tries of one measurement: a lag is a lower bound of the time eval held the loop, so the code this guards
#: against fails every try; a scheduler hiccup on this shared 2-core machine fails one try, not five.
TRIES = 5


def _record(handler: str, job_id: str, instance: dict, turns: list[str], extra: dict,
            weights: dict) -> tuple[str, str, bytes, bytes]:
    """A journalled job (request and result) whose assistant turns are ``turns``, one turn record each."""
    req = ProcessRequest(instance=instance, sampling_params={"max_tokens": 64}, job_id=job_id,
                         reward_weights=weights)
    messages = [{"role": "user", "content": "go"}]
    for t in turns:
        messages += [{"role": "assistant", "content": t}, {"role": "user", "content": "again"}]
    n = len(turns)
    res = JobResult(job_id=job_id, trajectory_id=f"t-{job_id}", handler=handler, messages=messages[:-1],
                    trajectories=[Trajectory(prompt_ids=[1, 2], response_ids=[7, 8] * n,
                                             response_logprobs=[-0.1, 0.0] * n, loss_mask=[1, 0] * n,
                                             num_turns=n)],
                    turns=[TurnRecord(response_start=2 * i, response_end=2 * i + 1) for i in range(n)],
                    extra=extra)
    return job_id, handler, req.model_dump_json().encode(), res.model_dump_json().encode()


async def _max_lag(work) -> tuple[float, object]:
    """``(largest lateness of a 5 ms sleep on this loop while ``work`` ran, seconds; what it returned)``."""
    lags: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            lags.append(time.perf_counter() - t - 0.005)

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.02)  # the ticker is running before the work starts
    try:
        out = await work
    finally:
        done.set()
        await tick
    return max(lags), out


def _measured(cls: type) -> type:
    """The handler ``cls`` whose ``eval`` records the loop's largest lag while it ran (in ``lags``): the
    re-grader's own parsing of the record is not eval's."""
    class Measured(cls):
        lags: list[float] = []

        async def eval(self, job) -> None:
            lag, _ = await _max_lag(super().eval(job))
            self.lags.append(lag)

    return Measured


async def _regrade_under_ticker(cls: type, record, warm) -> tuple[float, object]:
    handler = _measured(cls)
    registry = HandlerRegistry()
    registry.register(handler)
    async with Regrader(registry, sandbox_runtime="none") as r:
        assert (await r.regrade(*warm)).status == "regraded"  # starts the CPU pool outside the measurement
        handler.lags.clear()
        for _ in range(TRIES):
            out = await r.regrade(*record)
            if min(handler.lags) < MAX_LAG_S:
                break
    return min(handler.lags), out


async def test_shout_eval_of_a_slow_turn_leaves_the_loop_responsive():
    weights = {"language_mixing": 1.0, "turn_scores": 0.5}
    inst = {"data_source": "shout", "prompt": "Say something about the sea."}
    record = _record("shout", "slow", inst, [SLOW_TURN, "SHIP AHOY"], {"shout": {"turns": 2}}, weights)
    warm = _record("shout", "warm", inst, ["calm", "SHIP AHOY"], {"shout": {"turns": 2}}, weights)
    lag, out = await _regrade_under_ticker(ShoutHandler, record, warm)
    assert out.status == "regraded", out.reason
    # the values are the inline computation's
    expected, _ = language_mixing([{"role": "assistant", "content": t} for t in (SLOW_TURN, "SHIP AHOY")], 2)
    assert out.result.reward_components["language_mixing"].value == expected < 0.0
    assert out.result.reward_components["turn_scores"].value == 1.0  # the capital share of the answer turn
    assert lag < MAX_LAG_S, f"the event loop stalled {lag * 1e3:.1f} ms while eval scored a slow turn"


async def test_math_eval_of_a_slow_turn_leaves_the_loop_responsive():
    from handlers.math.data import load_reasoning_gym

    (p,) = load_reasoning_gym("basic_arithmetic", limit=1, seed=11)
    weights = dict.fromkeys(STANDARD_TERMS, 1.0)

    def extra(n: int) -> dict:
        return {"agent": {"finish_reason": "stop", "num_turns": n,
                          "answer": {"answer": f"\\boxed{{{p['answer']}}}"}}}

    record = _record("math", "slow", p, [SLOW_TURN, "done"], extra(2), weights)
    warm = _record("math", "warm", p, ["I add them"], extra(1), weights)
    lag, out = await _regrade_under_ticker(MathHandler, record, warm)
    assert out.status == "regraded", out.reason
    assert out.result.reward_components["outcome"].value == 1.0
    expected, _ = language_mixing([{"role": "assistant", "content": t} for t in (SLOW_TURN, "done")], 2)
    assert out.result.reward_components["language_mixing"].value == expected < 0.0
    assert lag < MAX_LAG_S, f"the event loop stalled {lag * 1e3:.1f} ms while eval scored a slow turn"
