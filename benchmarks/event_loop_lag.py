"""Event-loop lag while math answers are scored: inline on the loop (the old code path) vs the CPU pool.

One in-process rollout server (``create_app``, served on loopback) scores the same 32 math answers twice
through ``POST /process`` (32 concurrent jobs each time): first with the ``math`` handler's eval calling
``score()`` directly on the event loop (the baseline; this handler exists only in this benchmark), then with
the shipped eval, which runs ``score()`` in the server's CPU process pool. The agent's run is replaced by
the answer given in the instance (no LLM, no sandbox): only scoring differs between the two rounds.

The answers are realistic and some are slow for math-verify: expanded polynomials, symbolic matrices, sets,
intervals, long sums, trigonometric identities, and (``--slow``, default 2) answers whose comparison runs
into math-verify's own 5 s limit (a tower of powers, as an adversarial policy writes).

Lag = how late the server's own monitor task (``prorl_event_loop_lag_seconds``, a 50 ms sleep) woke, over
the time each round's jobs were in flight. Target: p99 < 10 ms with the pool.

A first row measures the lag of the idle server for ``--idle-s`` seconds: the floor this machine gives (other
processes competing for the cores show up there, not as scoring's cost).

Usage: python benchmarks/event_loop_lag.py [--jobs 32] [--slow 2] [--cpu-workers N] [--idle-s 5]
The last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp  # noqa: E402
from aiohttp import web  # noqa: E402

from handlers.math.handler import MathHandler  # noqa: E402
from handlers.math.scoring import score  # noqa: E402
from prorl_server.plugin.registry import HandlerRegistry  # noqa: E402
from prorl_server.app import CPU_POOL, LOOP_MONITOR, create_app  # noqa: E402
from prorl_server.config import ServerSettings  # noqa: E402
from prorl_server.stats import percentile  # noqa: E402

# (gold, final answer), all correct: what a capable policy's answers cost to verify.
ANSWERS = [
    ("(x+1)^{7}", "\\boxed{x^7+7x^6+21x^5+35x^4+35x^3+21x^2+7x+1}"),
    ("(x-2)^{5}(x+3)^{2}", "\\boxed{(x^2+x-6)^2 (x-2)^3}"),
    ("\\frac{n(n+1)(2n+1)}{6}", "\\boxed{\\frac{n^3}{3}+\\frac{n^2}{2}+\\frac{n}{6}}"),
    ("\\left(\\frac{n(n+1)}{2}\\right)^2", "\\boxed{\\frac{n^4+2n^3+n^2}{4}}"),
    ("1", "\\boxed{\\sin^2(x)+\\cos^2(x)}"),
    ("\\tan(x)", "\\boxed{\\frac{\\sin(2x)}{1+\\cos(2x)}}"),
    ("\\begin{pmatrix}1&2&3\\\\4&5&6\\\\7&8&10\\end{pmatrix}",
     "\\boxed{\\begin{pmatrix}1&2&3\\\\4&5&6\\\\7&8&10\\end{pmatrix}}"),
    ("\\begin{pmatrix}a^2+bc&ab+bd\\\\ac+cd&bc+d^2\\end{pmatrix}",
     "\\boxed{\\begin{pmatrix}a^2+bc&b(a+d)\\\\c(a+d)&d^2+bc\\end{pmatrix}}"),
    ("\\begin{pmatrix}\\cos\\theta&-\\sin\\theta\\\\\\sin\\theta&\\cos\\theta\\end{pmatrix}",
     "\\boxed{\\begin{pmatrix}\\cos(\\theta)&-\\sin(\\theta)\\\\\\sin(\\theta)&\\cos(\\theta)\\end{pmatrix}}"),
    ("\\{-3, -1, 2, 5, 7\\}", "\\boxed{\\{7, 5, 2, -1, -3\\}}"),
    ("\\{\\frac{1}{2}, \\frac{\\sqrt{3}}{2}, 1\\}", "\\boxed{1, \\frac{\\sqrt 3}{2}, 0.5}"),
    ("(-\\infty, -2) \\cup (3, \\infty)", "\\boxed{(-\\infty,-2)\\cup(3,\\infty)}"),
    ("[\\frac{1}{3}, 5]", "\\boxed{[\\frac13, 5]}"),
    ("\\frac{\\sqrt{6}+\\sqrt{2}}{4}", "\\boxed{\\cos(\\frac{\\pi}{12})}"),
    ("2\\sqrt{3}", "\\boxed{\\sqrt{12}}"),
    ("\\frac{3}{8}", "\\boxed{0.375}"),
]
SLOW = ("2", "\\boxed{10^{10^{10^{10}}}}")  # math-verify's 5 s comparison limit ends it


class AnswerMathHandler(MathHandler):
    """The shipped ``math`` eval (CPU pool); the agent's run is replaced by ``instance["response"]``."""

    name = "math_pool"
    aliases = ()
    needs_llm = False

    async def init(self, job):
        pass

    async def run(self, job):
        job.state["final_answer"] = job.instance["response"]


class InlineMathHandler(AnswerMathHandler):
    """BASELINE ONLY: the old eval, ``score()`` called directly on the event loop."""

    name = "math_inline"

    async def eval(self, job):
        reward, info = score(job.instance, job.state["final_answer"])
        job.reward, job.resolved = reward, reward >= 1.0
        job.extra["eval"] = info


def answers(n: int, slow: int) -> list[tuple[str, str]]:
    out = [SLOW] * slow
    while len(out) < n:
        out.append(ANSWERS[len(out) % len(ANSWERS)])
    return out[:n]


async def one_round(url: str, session: aiohttp.ClientSession, monitor, handler: str,
                    items: list[tuple[str, str]]) -> dict:
    first = len(monitor.samples)
    t0 = time.perf_counter()

    async def post(gold: str, response: str) -> dict:
        body = {"instance": {"data_source": handler, "question": "Simplify.", "answer": gold, "response": response}}
        async with session.post(url + "/process", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"{handler}: HTTP {r.status}: {await r.text()}")
            return await r.json()

    results = await asyncio.gather(*(post(g, a) for g, a in items))
    wall = time.perf_counter() - t0
    lags = list(monitor.samples)[first:]
    errors = [r["error"] for r in results if r["critical_error"]]
    if errors:
        raise RuntimeError(f"{handler}: {len(errors)} jobs failed: {errors[:2]}")
    return {"wall_s": wall, "solved": sum(r["reward"] == 1.0 for r in results), "samples": len(lags),
            "p50_ms": percentile(lags, 50) * 1000, "p99_ms": percentile(lags, 99) * 1000,
            "max_ms": max(lags) * 1000}


async def main(args) -> None:
    registry = HandlerRegistry()
    registry.register(AnswerMathHandler())
    registry.register(InlineMathHandler())
    app = create_app(ServerSettings(cpu_workers=args.cpu_workers, health_interval_s=3600, eval_workers=64,
                                    log_level="WARNING"), registry=registry)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    items = answers(args.jobs, args.slow)
    try:
        async with aiohttp.ClientSession() as session:
            # Warm both paths so neither round pays for imports: the baseline's in this process (on the
            # loop, as the old code did on the first answer), the pool's in every worker.
            score({"answer": "1"}, "\\boxed{1}")
            pool = app[CPU_POOL]
            await asyncio.gather(*(one_round(url, session, app[LOOP_MONITOR], "math_pool", [ANSWERS[0]])
                                   for _ in range(pool.workers)))
            first = len(app[LOOP_MONITOR].samples)
            await asyncio.sleep(args.idle_s)  # the floor: this machine's lag with nothing to do
            idle_lags = list(app[LOOP_MONITOR].samples)[first:]
            idle = {"wall_s": args.idle_s, "solved": "-", "samples": len(idle_lags),
                    "p50_ms": percentile(idle_lags, 50) * 1000, "p99_ms": percentile(idle_lags, 99) * 1000,
                    "max_ms": max(idle_lags) * 1000}
            inline = await one_round(url, session, app[LOOP_MONITOR], "math_inline", items)
            await asyncio.sleep(0.5)
            pooled = await one_round(url, session, app[LOOP_MONITOR], "math_pool", items)
    finally:
        await runner.cleanup()

    print(f"{args.jobs} math jobs scored concurrently through POST /process ({args.slow} hitting math-verify's "
          f"5 s limit); CPU pool: {app[CPU_POOL].workers} workers; {os.cpu_count()} cores; loop lag sampled "
          "every 50 ms by the server's monitor")
    cols = ["wall_s", "solved", "samples", "p50_ms", "p99_ms", "max_ms"]
    print(f"{'':22}" + "".join(f"{c:>10}" for c in cols))
    for name, row in (("idle (floor)", idle), ("inline on the loop", inline), ("CPU process pool", pooled)):
        print(f"{name:22}" + "".join(f"{row[c]:>10.2f}" if isinstance(row[c], float) else f"{row[c]:>10}"
                                     for c in cols))
    print(json.dumps({"jobs": args.jobs, "slow": args.slow, "cpu_workers": app[CPU_POOL].workers,
                      "inline_p50_ms": round(inline["p50_ms"], 2), "inline_p99_ms": round(inline["p99_ms"], 2),
                      "inline_max_ms": round(inline["max_ms"], 2), "pool_p50_ms": round(pooled["p50_ms"], 2),
                      "pool_p99_ms": round(pooled["p99_ms"], 2), "pool_max_ms": round(pooled["max_ms"], 2),
                      "idle_p99_ms": round(idle["p99_ms"], 2), "inline_wall_s": round(inline["wall_s"], 2), "pool_wall_s": round(pooled["wall_s"], 2),
                      "solved_inline": inline["solved"], "solved_pool": pooled["solved"],
                      "meets_target": pooled["p99_ms"] < 10}))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=32)
    ap.add_argument("--slow", type=int, default=2, help="answers that run into math-verify's 5 s limit")
    ap.add_argument("--cpu-workers", type=int, default=None, help="default: min(4, CPU count)")
    ap.add_argument("--idle-s", type=float, default=5.0, help="seconds of idle lag measured first (the floor)")
    asyncio.run(main(ap.parse_args()))
