"""Server CPU per turn of the named reward components (issue #35 part 2; target: records and components together
<= 0.05 ms a turn), beside the floor measured in this same run: the same result finished with no components
(only the outcome, as a handler that sets a scalar reward gets).

A job of ``--turns`` turns goes through what the server adds for components: the shipped process terms
(``tool_call_errors`` from the turn records, ``language_mixing`` from the assistant messages' text),
``compose_reward``'s weighted sum, and ``finalize``'s check and per-turn split. Three texts: English (ASCII, the
common case), a two-script turn (Cyrillic, Latin and Han, ~850 characters), and, read whole (red team R3: no cut
at 16,384 characters any more), turns of 262,144 characters: ASCII, the mixed text repeated, and 32,768 distinct
Han characters (the many-distinct path, the worst case per character). Rounds are interleaved so a change of
load moves a measurement and its floor together.

The language-mixing share is also timed before and after its C-speed counting (#35 cost target): the baseline
is the function it replaced (:func:`baseline_mixing_share`, kept here), run in the same rounds, alone and inside
the components (the server's ``mixing_share`` swapped for it).

Usage: python benchmarks/reward_components.py [--turns 16] [--n 2000] [--rounds 5]
Prints microseconds per turn; the last line is one JSON object.
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import random
import statistics
import sys
import time
import unicodedata

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from prorl_server import rewards  # noqa: E402
from prorl_server.rewards import (STANDARD_TERMS, finalize, language_mixing,  # noqa: E402
                                  mixing_share, tool_call_error_share)
from prorl_server.types import JobResult, RewardComponent, TurnRecord  # noqa: E402

TEXTS = {"ascii": "Let me compute this with the ipython tool, then check the result. " * 12,
         "mixed": "Привет world, 你好 " * 50}


_BASELINE_GROUP = {"CJK": "CJK", "HIRAGANA": "CJK", "KATAKANA": "CJK", "BOPOMOFO": "CJK", "IDEOGRAPHIC": "CJK",
                   "HALFWIDTH": "CJK", "FULLWIDTH": "LATIN"}


def baseline_mixing_share(text: str) -> float:
    """The baseline: ``prorl_server.rewards.mixing_share`` before its C-speed counting (commit 5d1ccf7): a set of
    the characters (one Python object per non-ASCII character), then ``str.count`` of each distinct one; reading
    the whole text, as the share now does (it then cut the text to 16,384 characters)."""
    if text.isascii():
        return 0.0
    distinct = set(text)
    if len(distinct) <= 256:
        letters = ((ch, text.count(ch)) for ch in distinct if ch.isalpha())
    else:
        letters = ((ch, k) for ch, k in collections.Counter(text).items() if ch.isalpha())
    counts: dict[str, int] = {}
    for ch, k in letters:
        if ch < "\x80":
            group = "LATIN"
        else:
            word = unicodedata.name(ch, "UNKNOWN").split(" ", 1)[0]
            group = _BASELINE_GROUP.get(word, word)
        counts[group] = counts.get(group, 0) + k
    total = sum(counts.values())
    return 0.0 if total == 0 else 1.0 - max(counts.values()) / total


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


def with_baseline_mixing(result: JobResult, messages: list[dict]) -> JobResult:
    """:func:`with_components` with the baseline language-mixing share in the server's place."""
    rewards.mixing_share = baseline_mixing_share
    try:
        return with_components(result, messages)
    finally:
        rewards.mixing_share = mixing_share


def once_ms(fn, text: str, rounds: int) -> float:
    """The fastest of ``rounds`` calls of ``fn(text)``, milliseconds."""
    best = math.inf
    for _ in range(rounds):
        t = time.perf_counter()
        fn(text)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


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
        assert baseline_mixing_share(text) == mixing_share(text)
        comp, base, old = [], [], []
        for _ in range(args.rounds):
            base.append(per_turn_us(floor, result, messages, args.n // args.rounds, args.turns))
            comp.append(per_turn_us(with_components, result, messages, args.n // args.rounds, args.turns))
            old.append(per_turn_us(with_baseline_mixing, result, messages, args.n // args.rounds, args.turns))
        c, b, o = statistics.median(comp), statistics.median(base), statistics.median(old)
        out[f"{name}_us_per_turn"], out[f"{name}_floor_us_per_turn"] = round(c, 2), round(b, 2)
        out[f"{name}_baseline_us_per_turn"] = round(o, 2)
        print(f"{name:>6}: components {c:7.2f} us/turn (baseline mixing {o:7.2f})   floor (outcome only) "
              f"{b:6.2f} us/turn   added {c - b:7.2f} us/turn")
    mixed = TEXTS["mixed"]
    new_us = once_ms(mixing_share, mixed, 2000) * 1e3
    old_us = once_ms(baseline_mixing_share, mixed, 2000) * 1e3
    out["mixing_share_us"], out["mixing_share_baseline_us"] = round(new_us, 2), round(old_us, 2)
    print(f"mixing share of the {len(mixed)}-character mixed turn alone: {new_us:.2f} us (baseline {old_us:.2f} us, "
          f"fastest of 2000)")
    # turns of 256k characters, read whole: ASCII, the mixed text, and 32,768 distinct Han characters (the CJK
    # block and extension B; one generator: each draw is a new character) repeated
    n = 1 << 18
    han = [chr(c) for c in random.Random(0).sample([*range(0x4E00, 0xA000), *range(0x20000, 0x2A6E0)], 1 << 15)]
    long_turns = {"ascii": (TEXTS["ascii"] * (n // len(TEXTS["ascii"]) + 1))[:n],
                  "mixed": (mixed * (n // len(mixed) + 1))[:n], "distinct": "".join(han * (n // len(han)))}
    for name, text in long_turns.items():
        assert len(text) == n and baseline_mixing_share(text) == mixing_share(text)
        out[f"turn_256k_{name}_ms"] = round(once_ms(mixing_share, text, 5), 4)
        out[f"turn_256k_{name}_baseline_ms"] = round(once_ms(baseline_mixing_share, text, 5), 4)
        print(f"256k: one {name} turn of {n} characters {out[f'turn_256k_{name}_ms']:.4f} ms (baseline "
              f"{out[f'turn_256k_{name}_baseline_ms']:.4f} ms; language mixing, fastest of 5)")
    out["target_us_per_turn"] = 50.0
    print(json.dumps(out))


if __name__ == "__main__":
    main()
