"""Proof that learning happens through the service: TRL GRPO on the ``shout`` task raises reward on a CPU.

The whole loop is real: a vLLM CPU server with the tiny random model (2 layers, hidden 128, built locally) and
the weight-loader worker extension, a rollout server in its own process (``python -m prorl_server``, the
``shout`` handler: two model turns with the environment's "Louder!" message between them, reward = the share
of capital letters in the last turn), and TRL's ``GRPOTrainer`` in this process with
``rollout_func=ProRLRollout(prefetch=2)`` (the next two steps' rollouts run while the trainer trains, two steps
off-policy at most, corrected by TRL's importance sampling on the server's logprobs) and ``WeightPushCallback`` (after
every step: gather, save, and the rollout server's swap: ``/weights/pause`` holds the in-flight requests in
vLLM's keep mode, the trainer loads the weights through ``/collective_rpc``, ``/weights/resume`` labels the
backend with the new version; tokens generated after the swap carry it).

Prints one line per step (mean reward, the weight versions of the batch's tokens, the importance-ratio
deviation, the swap: seconds generation was held, rollout jobs in flight and LLM calls the server held in the
engine) and ends with one JSON line: ``reward_first`` / ``reward_last`` (mean reward of the first / last 3
steps: the random model is the baseline, measured in the same run), ``steps``, ``wall_s``, ``ratio_dev_step0``
(mean |exp(trainer logprob - rollout logprob) - 1| over the generated tokens of the first batch),
``weight_sync_s_per_step`` (pause -> load -> resume, seconds) and its p50, ``push_s_per_gb`` (gather, write
and swap per GB of weights), ``in_flight_at_swap`` / ``held_calls_at_swap`` (per swap), ``tokens_discarded``
(generated tokens thrown away: the rollout server's count over the run, plus earlier segments of split rollouts),
``swaps_with_work_in_flight``, and the settings. Target: ``reward_last - reward_first >= 0.3`` within 15 minutes,
``ratio_dev_step0 < 1e-3``, ``tokens_discarded == 0`` with work in flight at every swap.

    .venv/bin/python benchmarks/learning_curve.py                 # up to 15 min / 60 steps
    .venv/bin/python benchmarks/learning_curve.py --steps 3       # the plumbing only
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from _common import stop_process  # noqa: E402 (benchmarks/, the script's folder)
from prorl_server.stats import percentile  # noqa: E402


def start_rollout_server(backend: str, log_path: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    """A rollout server in its own process with ``backend`` registered (weight version 0 until the trainer
    registers it)."""
    ready = Path(tempfile.mkdtemp(prefix="learning-curve-")) / "ready.json"
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "prorl_server", "--port", "0", "--ready-file", str(ready),
                             "--backend", backend, "--log-level", "WARNING", *extra], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the rollout server did not start (log: {log_path})")
        time.sleep(0.1)
    return proc, json.loads(ready.read_text())["url"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps at most")
    ap.add_argument("--budget-s", type=float, default=900.0, help="stop after this many seconds of training")
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8, help="GRPO num_generations")
    # Rollouts must outlast a training step for the next step's work to be in flight at the swap (agents'
    # rollouts do; a tiny model's short turns on 2 cores do not): 3 turns of exactly 16 tokens, one at a time.
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens per model turn")
    ap.add_argument("--min-tokens", type=int, default=16, help="at least this many tokens per model turn")
    ap.add_argument("--turns", type=int, default=3, help="model turns per episode (the shout task's turns)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefetch", type=int, default=2,
                    help="steps of rollouts kept running ahead of the trainer (0: each step waits for its own)")
    ap.add_argument("--run-workers", type=int, default=1,
                    help="the rollout server's run stage size: rollouts run this many at a time (like a fleet "
                         "busy with agents, generating a batch then outlasts a training step)")
    ap.add_argument("--trainer-threads", type=int, default=1,
                    help="torch threads of the trainer (the rest of the cores are vLLM's)")
    ap.add_argument("--model-dir", default=str(ROOT / ".cache" / "tiny-model"))
    ap.add_argument("--out-dir", default=None, help="trainer output and weight files (default: a temp dir)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from handlers.shout import load_dataset
    from prorl_server.dev import tiny_model
    from prorl_server.dev.vllm_launcher import start_vllm
    from trainer_plugins.trl import ProRLRollout, WeightPushCallback, server_reward

    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, args.trainer_threads))
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="learning-curve-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = tiny_model.build(args.model_dir)
    t0 = time.monotonic()
    vllm = start_vllm(model_dir, max_model_len=1024, max_num_batched_tokens=1024, log_path=out_dir / "vllm.log",
                      extra_args=["--worker-extension-cls", "trainer_plugins.vllm_weights.WeightLoaderExtension"])
    print(f"vLLM ready at {vllm.address} in {time.monotonic() - t0:.0f} s", flush=True)
    server_proc, server = start_rollout_server(vllm.address, out_dir / "rollout-server.log", "--run-workers",
                                               str(args.run_workers))
    print(f"rollout server at {server}", flush=True)
    try:
        instances = [{**inst, "turns": args.turns} for inst in load_dataset(limit=16, seed=args.seed)]
        dataset = Dataset.from_list(ProRLRollout.dataset_rows(instances))
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        rollout = ProRLRollout([server], instances, max_tokens=args.max_tokens, measure_ratio=True,
                               request_timeout_s=300, prefetch=args.prefetch,
                               sampling_params={"min_tokens": args.min_tokens} if args.min_tokens else None)
        push = WeightPushCallback(rollout, [vllm.address], weights_dir=out_dir / "weights")
        started = {}

        class Budget(TrainerCallback):
            """Stops training once the wall-clock budget is spent (checked after each step)."""

            def on_train_begin(self, a, state, control, **kw):
                started["t"] = time.monotonic()

            def on_step_end(self, a, state, control, **kw):
                rollout.measure_ratio = False  # the first batch's ratio is the one the target is about
                st = rollout.history[-1] if rollout.history else None
                rep = push.reports[-1] if push.reports else None
                versions = {v: n for v, n in sorted(st.token_versions.items(), key=lambda kv: (kv[0] is None, kv[0]))}
                ratio = f"ratio_dev {st.ratio_dev:.2e}  " if st.ratio_dev is not None else ""
                print(f"step {state.global_step:3d}  reward {st.mean_reward:.3f}  token versions {versions}  {ratio}"
                      f"rollout wait {st.wall_s:.1f} s  sync {rep.sync_s if rep else float('nan'):.3f} s  "
                      f"in flight {rep.jobs_in_flight if rep else None} jobs / {rep.held_calls if rep else None} "
                      f"calls held  push {rep.total_s if rep else float('nan'):.2f} s  "
                      f"t {time.monotonic() - started['t']:.0f} s", flush=True)
                if time.monotonic() - started["t"] > args.budget_s:
                    control.should_training_stop = True
                return control

        batch = args.prompts_per_step * args.group_size
        config = GRPOConfig(output_dir=str(out_dir / "trainer"), per_device_train_batch_size=batch,
                            num_generations=args.group_size, max_completion_length=args.max_tokens,
                            learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, max_steps=args.steps,
                            beta=0.0, temperature=1.0, logging_steps=1, report_to=[], save_strategy="no",
                            use_cpu=True, seed=args.seed, bf16=False, disable_tqdm=True, dataloader_num_workers=0,
                            log_level="warning", vllm_importance_sampling_mode="token_truncate")
        trainer = GRPOTrainer(model=model, reward_funcs=server_reward, args=config, train_dataset=dataset,
                              processing_class=tokenizer, rollout_func=rollout, callbacks=[push, Budget()])
        t_train = time.monotonic()
        trainer.train()
        wall = time.monotonic() - t_train
        rollout.close()
    finally:
        stop_process(server_proc, 30)
        vllm.stop()

    rewards = [h.mean_reward for h in rollout.history if h.mean_reward is not None]
    k = min(3, len(rewards))
    first = statistics.mean(rewards[:k]) if k else float("nan")
    last = statistics.mean(rewards[-k:]) if k else float("nan")
    syncs = [r.sync_s for r in push.reports]
    in_flight = [r.jobs_in_flight for r in push.reports]
    held = [r.held_calls for r in push.reports]
    server_discarded = max((r.tokens_discarded or 0 for r in push.reports), default=0)  # the server's running count
    total_bytes = sum(r.bytes for r in push.reports)
    total_push = sum(r.total_s for r in push.reports)
    summary = {
        "benchmark": "learning_curve", "task": "shout", "trainer": "trl-grpo",
        "reward_first": round(first, 4), "reward_last": round(last, 4), "reward_gain": round(last - first, 4),
        "steps": len(rollout.history), "wall_s": round(wall, 1),
        "ratio_dev_step0": rollout.history[0].ratio_dev if rollout.history else None,
        "weight_sync_s_p50": round(percentile(syncs, 50), 3) if syncs else None,
        "push_s_per_gb": round(total_push / (total_bytes / 1e9), 1) if total_bytes else None,
        "weights_mb": round(push.reports[-1].bytes / 1e6, 2) if push.reports else None,
        "swap_protocol": push.reports[-1].mode if push.reports else None,
        "prefetch": args.prefetch,
        "mixed_version_turns": sum(h.mixed_version_turns for h in rollout.history),
        "filtered_rows": sum(h.filtered_rows for h in rollout.history),
        "versions_per_step": [h.versions for h in rollout.history],
        "rewards_per_step": [round(r, 4) for r in rewards],
        "target_met": bool(last - first >= 0.3 and wall <= 900 and rollout.history
                           and (rollout.history[0].ratio_dev or 0) < 1e-3),
        "settings": {"prompts_per_step": args.prompts_per_step, "group_size": args.group_size,
                     "max_tokens_per_turn": args.max_tokens, "min_tokens_per_turn": args.min_tokens,
                     "turns": args.turns, "lr": args.lr, "seed": args.seed,
                     "run_workers": args.run_workers, "trainer_threads": args.trainer_threads},
        # the last keys are the ones this benchmark is read for: work in flight at every swap, none thrown away
        "in_flight_at_swap": in_flight,
        "held_calls_at_swap": held,
        "swaps_with_work_in_flight": f"{sum(1 for j in in_flight if j)}/{len(in_flight)}",
        "weight_sync_s_per_step": [round(x, 3) for x in syncs],
        "tokens_discarded": server_discarded + sum(h.tokens_discarded for h in rollout.history),
    }
    summary["target_met"] = bool(summary["target_met"] and summary["tokens_discarded"] == 0
                                 and (not args.prefetch or all(in_flight)))
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
