"""Admission policies for asynchronous RL, simulated: strict FIFO vs greedy vs Windowed FIFO at several W.

A simulated cluster generates rollouts whose durations are lognormal with a heavy tail and grow with the
task's difficulty (``duration = exp(mu + sigma * z + corr * difficulty)``, difficulty ~ U(0, 1), z ~ N(0, 1)).
The rollout side keeps ``buffer`` rollouts outstanding (submitted and not yet consumed: the staleness budget
of ``trainer_plugins.client``); a new one is submitted, in dataset order, each time the trainer consumes one.
The trainer takes ``batch`` rollouts per step through the admission policy and then trains for a fixed
``step_s`` seconds, after which the weight version advances.

The admission policy is ``trainer_plugins.admission.WindowedFIFO``, the very class the rollout client uses:
``W = 1`` strict FIFO (the synchronous order), ``W = None`` greedy first-finished-first-out, and Windowed FIFO
in between. Every policy sees the same durations (common random numbers).

Measured per policy: trainer idle fraction (time waiting for data / total time; throughput = steps per
second), off-policy lag of consumed rollouts (weight versions between submission and consumption: max and
mean), and difficulty drift: the mean over blocks of ``block`` steps of ``|mean difficulty consumed -
dataset mean| / dataset mean``. ``drift_vs_fifo`` is a policy's drift minus strict FIFO's (fractions of the
dataset mean; 0.05 is 5 points). Target: some W keeps >= 90% of greedy's throughput with a lag
bound no worse than W steps (here: max lag beyond strict FIFO's, which is the buffer's ``buffer / batch``
steps, at most ``ceil(W / batch)``) and a drift within 5% of FIFO's.

Lag is counted from submission, so its *mean* is set by the buffer (Little's law) and is the same for
every policy; the policies differ in the maximum lag (how long a straggler can wait) and the idle time.

Usage: ``python benchmarks/scheduling.py [--steps 400] [--batch 32] [--buffer-steps 4] [--seed 0]``.
The last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer_plugins.admission import WindowedFIFO  # noqa: E402


def make_tasks(n: int, seed: int, mu: float, sigma: float, corr: float,
               timeout_s: float) -> list[tuple[float, float]]:
    """``n`` tasks in dataset order: ``(difficulty in [0, 1], rollout duration in seconds)``; a rollout ends
    at ``timeout_s`` at the latest (the job timeout of the rollout server)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        d = rng.random()
        out.append((d, min(timeout_s, math.exp(mu + sigma * rng.gauss(0.0, 1.0) + corr * d))))
    return out


def simulate(tasks: list[tuple[float, float]], window: Optional[int], batch: int, buffer: int, steps: int,
             step_s: float, block: int) -> dict:
    """Run ``steps`` trainer steps under one admission window; return the measurements (see module doc)."""
    q: WindowedFIFO[tuple[int, float, int]] = WindowedFIFO(window)  # (task index, difficulty, submit version)
    events: list[tuple[float, int]] = []  # (finish time, seq)
    now = 0.0
    version = 0
    next_task = 0

    def submit(t: float) -> None:
        nonlocal next_task
        d, dur = tasks[next_task]
        seq = q.push((next_task, d, version))
        heapq.heappush(events, (t + dur, seq))
        next_task += 1

    for _ in range(buffer):
        submit(0.0)
    idle = 0.0
    lags: list[int] = []
    step_difficulty: list[float] = []
    for _ in range(steps):
        got: list[tuple[int, float, int]] = []
        wait_from = now
        while len(got) < batch:
            ready = q.takeable()
            if ready:  # taking the head may bring ready rollouts into the window: look again before waiting
                got.append(q.take(ready[0]))
                submit(now)  # the consumed slot is refilled at once
                continue
            t, seq = heapq.heappop(events)  # the trainer waits for the next rollout to finish
            now = max(now, t)
            q.mark_ready(seq)
        idle += now - wait_from
        lags.extend(version - v for _, _, v in got)
        step_difficulty.append(sum(d for _, d, _ in got) / len(got))
        # training: rollouts keep finishing meanwhile; the slots they free are refilled at the next take
        end = now + step_s
        while events and events[0][0] <= end:
            _, seq = heapq.heappop(events)
            q.mark_ready(seq)
        now = end
        version += 1
    dataset_mean = sum(d for d, _ in tasks[:next_task]) / next_task
    blocks = [step_difficulty[i:i + block] for i in range(0, len(step_difficulty), block)]
    drift = sum(abs(sum(b) / len(b) - dataset_mean) for b in blocks) / len(blocks) / dataset_mean
    return {"W": window, "idle_frac": idle / now, "steps_per_s": steps / now, "max_lag": max(lags),
            "mean_lag": sum(lags) / len(lags), "drift": drift,
            "early_difficulty": sum(step_difficulty[:block]) / block, "dataset_difficulty": dataset_mean}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=32, help="rollouts per trainer step")
    p.add_argument("--buffer-steps", type=int, default=8, help="outstanding rollouts, in batches")
    p.add_argument("--step-s", type=float, default=2.0, help="trainer step time, seconds")
    p.add_argument("--mu", type=float, default=0.0)
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal shape: the heavy tail")
    p.add_argument("--corr", type=float, default=1.5, help="log-duration added per unit of difficulty")
    p.add_argument("--timeout-s", type=float, default=30.0, help="job timeout: the longest rollout, seconds")
    p.add_argument("--block", type=int, default=10, help="steps per block of the drift measure")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--windows", default="8,32,64,128,192,256", help="W values (rollouts), comma-separated")
    a = p.parse_args(argv)
    buffer = a.buffer_steps * a.batch
    tasks = make_tasks(a.steps * a.batch + buffer + 1, a.seed, a.mu, a.sigma, a.corr, a.timeout_s)
    run = lambda w: simulate(tasks, w, a.batch, buffer, a.steps, a.step_s, a.block)  # noqa: E731
    fifo, greedy = run(1), run(None)
    windowed = [run(int(w)) for w in a.windows.split(",")]

    print(f"{a.steps} steps x {a.batch} rollouts, {buffer} outstanding, step {a.step_s:g} s, "
          f"durations min({a.timeout_s:g}, exp({a.mu:g} + {a.sigma:g} z + {a.corr:g} d)) s")
    print(f"{'policy':>14} {'idle':>6} {'thr/greedy':>10} {'max_lag':>7} {'mean_lag':>8} {'drift':>6} "
          f"{'drift-fifo':>10} {'early_d':>7}")
    rows = [("strict FIFO", fifo), *((f"window {r['W']}", r) for r in windowed), ("greedy", greedy)]
    summary = []
    for name, r in rows:
        thr = r["steps_per_s"] / greedy["steps_per_s"]
        dv = r["drift"] - fifo["drift"]
        print(f"{name:>14} {r['idle_frac']:6.3f} {thr:10.3f} {r['max_lag']:7d} {r['mean_lag']:8.2f} "
              f"{r['drift']:6.3f} {dv:+10.3f} {r['early_difficulty']:7.3f}")
        if name.startswith("window"):
            summary.append({"W": r["W"], "W_steps": r["W"] / a.batch, "throughput_vs_greedy": round(thr, 4),
                            "max_lag": r["max_lag"], "extra_lag_vs_fifo": r["max_lag"] - fifo["max_lag"],
                            "mean_lag": round(r["mean_lag"], 3), "drift_vs_fifo": round(dv, 4),
                            "idle_frac": round(r["idle_frac"], 4)})
    print(f"dataset mean difficulty {fifo['dataset_difficulty']:.3f}; lag in weight versions (steps); "
          f"W in rollouts ({a.batch} per step)")
    # the target: >= 90% of greedy's throughput, lag beyond FIFO's within W steps, drift within 5 points
    meets = [s["W"] for s in summary if s["throughput_vs_greedy"] >= 0.9 and abs(s["drift_vs_fifo"]) <= 0.05
             and s["extra_lag_vs_fifo"] <= math.ceil(s["W_steps"])]
    print(json.dumps({"greedy_idle_frac": round(greedy["idle_frac"], 4), "fifo_idle_frac": round(fifo["idle_frac"], 4),
                      "greedy_max_lag": greedy["max_lag"], "fifo_max_lag": fifo["max_lag"],
                      "greedy_drift_vs_fifo": round(greedy["drift"] - fifo["drift"], 4),
                      "windowed": summary, "meets_target": meets}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
