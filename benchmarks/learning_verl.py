"""Learning through verl on a CPU, measured: the tiny model on ``shout`` with the shipped async configs (#32 part 8).

Runs ``trainer_plugins/verl/examples/run_cpu.sh`` (verl 0.9.1's real ``main_ppo``, V1 ``colocate_async``, FSDP2
and verl's own vLLM replica on CPU, a rollout server with bubblewrap sandboxes, the plugin's relay and
``ProRLReplayBuffer``) with the shipped ``prorl_dapo`` (or ``--config prorl_cispo``) config as it ships: async
within ``max_off_policy_threshold`` (2), rollout importance-sampling correction, stale groups cancelled. The
tiny random model's first steps are the baseline, measured in the same run.

Prints one line per training step from verl's own metrics: mean reward (``critic/score/mean``), rollouts
completed / trained / discarded as stale / cancelled as stale (``training/prorl_async/*``), the staleness of
the trained rows, and the importance ratio's mean. Ends with one JSON line: ``reward_first`` / ``reward_last``
(mean reward of the first / last ``--window`` steps), ``reward_gain``, ``steps``, ``wall_s``,
``completed``, ``discarded_stale`` and ``discarded_share`` (discarded / completed over the run), ``cancelled_stale``
and the settings. Target (issue #32): ``reward_gain >= 0.3`` within 15 minutes on a 2-core machine, no completed
rollout discarded beyond those the bound forbids, and ``cancelled_stale > 0`` when the bound bites.

    .venv/bin/python benchmarks/learning_verl.py                        # DAPO, 40 steps
    .venv/bin/python benchmarks/learning_verl.py --config prorl_cispo   # CISPO
    .venv/bin/python benchmarks/learning_verl.py --steps 4              # the plumbing only

Not part of CI: it takes minutes and about 7 GB of memory.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEP_LINE = re.compile(r"step:(\d+) - (.*)")
PREFIX = "training/prorl_async/"


def parse_step(line: str) -> tuple[int, dict[str, float]] | None:
    """One verl console metrics line (``step:N - key:value - ...``, ``verl.utils.logger.concat_dict_to_str``) ->
    ``(N, {key: value})``; None for any other line."""
    m = STEP_LINE.search(line)
    if not m:
        return None
    metrics: dict[str, float] = {}
    for part in m.group(2).split(" - "):
        key, sep, value = part.rpartition(":")
        if not sep:
            continue
        try:
            metrics[key.strip()] = float(value)
        except ValueError:
            continue
    return int(m.group(1)), metrics


def step_summary(step: int, m: dict[str, float]) -> str:
    hist = {k.rsplit("/", 1)[1]: int(v) for k, v in m.items() if k.startswith(f"{PREFIX}staleness_total/")}
    return (f"step {step:3d}  reward {m.get('critic/score/mean', float('nan')):.3f}  "
            f"completed {int(m.get(PREFIX + 'rollouts_completed_total', 0)):3d}  "
            f"trained {int(m.get(PREFIX + 'rollouts_trained_total', 0)):3d}  "
            f"discarded_stale {int(m.get(PREFIX + 'rollouts_discarded_stale_total', 0)):3d}  "
            f"cancelled_stale {int(m.get(PREFIX + 'rollouts_cancelled_stale_total', 0)):3d}  "
            f"staleness {hist}  is_mean {m.get('rollout_corr/rollout_is_mean', float('nan')):.4f}  "
            f"step_s {m.get('timing_s/step', float('nan')):.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="prorl_dapo", choices=["prorl_dapo", "prorl_cispo"])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--window", type=int, default=10, help="steps averaged at each end")
    ap.add_argument("--out", default=None, help="run directory (default out/learning-verl-<config>)")
    ap.add_argument("--minutes", type=float, default=30.0, help="stop the run after this many minutes")
    ap.add_argument("--lr", type=float, default=3e-3,
                    help="actor learning rate (run_cpu.sh's 1e-4 shows the loop working, not learning, in 40 steps)")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (GRPO group)")
    ap.add_argument("--batch", type=int, default=4, help="prompts per step (data.train_batch_size)")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for verl")
    args = ap.parse_args()
    out = Path(args.out or ROOT / "out" / f"learning-verl-{args.config}")
    env = {**os.environ, "STEPS": str(args.steps), "OUT": str(out), "CONFIG": args.config, "N": str(args.n),
           "BATCH": str(args.batch)}
    start = time.monotonic()
    steps: dict[int, dict[str, float]] = {}
    cmd = ["bash", str(ROOT / "trainer_plugins/verl/examples/run_cpu.sh"), f"actor_rollout_ref.actor.optim.lr={args.lr}",
           *args.overrides]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    timed_out = False
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            parsed = parse_step(line)
            if parsed:
                steps[parsed[0]] = parsed[1]
                print(step_summary(*parsed), flush=True)
            if time.monotonic() - start > args.minutes * 60:
                timed_out = True
                break
    finally:
        if proc.poll() is None:  # its own session: the run's processes (rollout server, Ray) end with it
            os.killpg(proc.pid, 15)
        rc = proc.wait()
    wall = time.monotonic() - start
    order = sorted(steps)
    rewards = [steps[s].get("critic/score/mean") for s in order]
    rewards = [r for r in rewards if r is not None]
    w = min(args.window, max(1, len(rewards) // 2))
    first = sum(rewards[:w]) / w if rewards else None
    last = sum(rewards[-w:]) / w if rewards else None

    def total(name: str) -> int:
        return int(sum(steps[s].get(PREFIX + name, 0) for s in order))

    completed, discarded = total("rollouts_completed_total"), total("rollouts_discarded_stale_total")
    summary = {"config": args.config, "lr": args.lr, "n": args.n, "batch": args.batch, "steps": len(order),
               "wall_s": round(wall, 1), "rc": rc,
               "timed_out": timed_out, "reward_first": first, "reward_last": last,
               "reward_gain": None if first is None else round(last - first, 4), "window": w,
               "completed": completed, "trained": total("rollouts_trained_total"),
               "discarded_stale": discarded, "discarded_share": round(discarded / completed, 4) if completed else None,
               "cancelled_stale": total("rollouts_cancelled_stale_total"), "log": str(out / "verl.log")}
    print(json.dumps(summary))
    return 0 if rc == 0 and order else 1


if __name__ == "__main__":
    sys.exit(main())
