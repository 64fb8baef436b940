"""Server CPU per turn of the named reward components (issue #35 part 2; target: records and components together
<= 0.05 ms a turn), beside the floor measured in this same run: the same result finished with no components
(only the outcome, as a handler that sets a scalar reward gets).

A job of ``--turns`` turns goes through what the server adds for components: the shipped process terms
(``tool_call_errors`` from the turn records, ``language_mixing`` from the assistant messages' text),
``compose_reward``'s weighted sum, and ``finalize``'s check and per-turn split. Three texts: English (ASCII, the
common case), a two-script turn (Cyrillic, Latin and Han, ~850 characters) and the bound (16,384 distinct Han
characters, the worst one turn can cost). Rounds are interleaved so a change of load moves a measurement and
its floor together.

Usage: python benchmarks/reward_components.py [--turns 16] [--n 2000] [--rounds 5]
Prints microseconds per turn; the last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from prorl_server.rewards import STANDARD_TERMS, finalize, language_mixing, mixing_share, tool_call_error_share  # noqa: E402
from prorl_server.types import JobResult, RewardComponent, TurnRecord  # noqa: E402

TEXTS = {"ascii": "Let me compute this with the ipython tool, then check the result. " * 12,
         "mixed": "Привет world, 你好 " * 50}


def job(turns: int, text: str) -> tuple[JobResult, list[dict]]:
    records = [TurnRecord(response_start=i, response_end=i + 1, tool_calls=1, tool_call_errors=int(i % 4 == 0))
               for i in range(turns)]
    messages = [{"role": "assistant", "content": text} for _ in range(turns)]
    return JobResult(job_id="j", trajectory_id="t", handler="math", reward=1.0, turns=records), messages


def with_components(result: JobResult, messages: list[dict]) -> JobResult:
    v1, p1 = tool_call_error_share(result.turns)
    v2, p2 = language_mixing(messages, len(result.turns))
    comps = {"outcome": RewardComponent(value=1.0, weight=1.0),
             "tool_call_errors": RewardComponent(value=v1, weight=0.1, per_turn=p1),
             "language_mixing": RewardComponent(value=v2, weight=0.1, per_turn=p2)}
    reward = math.fsum(c.weight * c.value for c in comps.values())
    return finalize(result.model_copy(update={"reward": reward}), comps, STANDARD_TERMS)


def floor(result: JobResult, messages: list[dict]) -> JobResult:
    return finalize(result, None)


def per_turn_us(fn, result, messages, n: int, turns: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn(result, messages)
    return (time.perf_counter() - t) / n / turns * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=16)
    ap.add_argument("--n", type=int, default=2000, help="jobs per measurement")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    out: dict[str, float] = {}
    for name, text in TEXTS.items():
        result, messages = job(args.turns, text)
        with_components(result, messages)  # warm-up (imports, caches)
        comp, base = [], []
        for _ in range(args.rounds):
            base.append(per_turn_us(floor, result, messages, args.n // args.rounds, args.turns))
            comp.append(per_turn_us(with_components, result, messages, args.n // args.rounds, args.turns))
        c, b = statistics.median(comp), statistics.median(base)
        out[f"{name}_us_per_turn"], out[f"{name}_floor_us_per_turn"] = round(c, 2), round(b, 2)
        print(f"{name:>6}: components {c:7.2f} us/turn   floor (outcome only) {b:6.2f} us/turn   "
              f"added {c - b:7.2f} us/turn")
    worst = "".join(chr(random.Random(0).randint(0x4E00, 0x9FFF)) for _ in range(16384))
    t = time.perf_counter()
    mixing_share(worst)
    out["bound_turn_ms"] = round((time.perf_counter() - t) * 1e3, 2)
    print(f" bound: one turn of 16384 distinct Han characters {out['bound_turn_ms']:.2f} ms (language mixing)")
    out["target_us_per_turn"] = 50.0
    print(json.dumps(out))


if __name__ == "__main__":
    main()
