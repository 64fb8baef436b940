"""A policy learns to finish sooner from the completion-time reward (issue #35 part 5): TRL GRPO on CPU, with the
component on beside the same run with it off.

The whole loop is real, as in ``benchmarks/learning_curve.py``: a vLLM CPU server with the tiny random model
(built locally) and the weight-loader worker extension, a rollout server in its own process, and TRL's
``GRPOTrainer`` in this process with ``rollout_func=ProRLRollout(...)`` and ``WeightPushCallback``. The task is
``choice`` (``handlers/choice.py``): a multiple-choice question whose reply stops at the first option number
``1``-``4``, outcome 1 when that option is the key. Every token the model samples before the digit is generation
time that buys nothing, so a shorter path to the same outcome exists: name an option at once.

Two runs, same seed and settings, one after the other on the same vLLM server (its weights reset to the initial
model's before each run, a fresh rollout server each): **on**, ``ProRLRollout(completion_time_weight=w)`` (the
server adds ``w * speed`` to each result's reward, ``speed`` the member's relative model time within its group,
``prorl_server/completion_time.py``), and **off**, the outcome alone. Model time per rollout is the server's turn
records: the sum of ``t_llm_s + t_tool_critical_s`` (docs/http-api.md, "Turn records"); with a tiny model on a
CPU it is about proportional to the tokens sampled.

Prints per step the mean outcome, the resolved rollouts' median model time and tokens, and per run: the median
model time of resolved rollouts over the first and the last ``--window`` steps and their ratio (last / first),
the same for generated tokens, and the mean outcome reward over those steps. The last line is one JSON object
``{"on": {...}, "off": {...}, "target_met": bool, "settings": {...}}``. Target: with the component on, the
median model time of resolved rollouts falls by at least 30% from the first to the last 10 steps
(``time_ratio <= 0.7``) while the mean outcome does not fall (``outcome_last >= outcome_first``).

    .venv/bin/python benchmarks/completion_time_learning.py               # about 6-8 min on 2 busy cores
    .venv/bin/python benchmarks/completion_time_learning.py --steps 3 --window 1 --runs off   # the plumbing
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from benchmarks.learning_curve import start_rollout_server  # noqa: E402
from prorl_server.completion_time import model_time  # noqa: E402


def summarize(steps: list[list[dict]], window: int) -> dict:
    """Per-run figures from ``steps`` (per step, one ``{resolved, model_time_s, tokens, outcome}`` per row)."""
    first, last = steps[:window], steps[-window:]

    def resolved(block, key):
        return [r[key] for s in block for r in s if r["resolved"]]

    def outcome(block):
        xs = [r["outcome"] for s in block for r in s]
        return statistics.mean(xs) if xs else float("nan")

    def med(xs):
        return statistics.median(xs) if xs else float("nan")

    t0, t1 = med(resolved(first, "model_time_s")), med(resolved(last, "model_time_s"))
    n0, n1 = med(resolved(first, "tokens")), med(resolved(last, "tokens"))
    return {"steps": len(steps), "model_time_first_s": round(t0, 4), "model_time_last_s": round(t1, 4),
            "time_ratio": round(t1 / t0, 3) if t0 > 0 else None,
            "tokens_first": n0, "tokens_last": n1, "tokens_ratio": round(n1 / n0, 3) if n0 > 0 else None,
            "outcome_first": round(outcome(first), 3), "outcome_last": round(outcome(last), 3),
            "resolved_first": len(resolved(first, "tokens")), "resolved_last": len(resolved(last, "tokens"))}


async def warm_up(address: str, n: int, max_tokens: int, rounds: int = 3) -> None:
    """``rounds`` batches of ``n`` concurrent completions of ``max_tokens`` tokens straight to vLLM."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.get(f"{address}/v1/models") as r:
            model = (await r.json())["data"][0]["id"]

        async def one(i: int) -> None:
            body = {"model": model, "prompt": f"Warm up {i}.", "max_tokens": max_tokens, "ignore_eos": True}
            async with session.post(f"{address}/v1/completions", json=body) as r:
                r.raise_for_status()
                await r.read()

        for _ in range(rounds):
            await asyncio.gather(*(one(i) for i in range(n)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50, help="optimizer steps per run")
    ap.add_argument("--window", type=int, default=10, help="steps compared at the start and the end of a run")
    ap.add_argument("--runs", default="on,off", help="which runs, in order (on, off)")
    ap.add_argument("--weight", type=float, default=1.0, help="the completion-time component's weight w (on run)")
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8, help="GRPO num_generations (the completion-time group)")
    # a reply with no option digit within max_tokens is unresolved, which pushes the off run to shorter replies
    # too; 192 tokens (a random reply passes a digit by 99%) keeps that pressure small (96: off went 26 -> 4)
    ap.add_argument("--max-tokens", type=int, default=192, help="tokens of the reply at most")
    ap.add_argument("--lr", type=float, default=1e-2,
                    help="3e-3 (learning_curve.py's) moved the replies' length too little in 40 steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trainer-threads", type=int, default=1, help="torch threads of the trainer")
    ap.add_argument("--model-dir", default=str(ROOT / ".cache" / "tiny-model"))
    ap.add_argument("--out-dir", default=None, help="logs and weight files (default: a temp dir)")
    args = ap.parse_args()
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if not runs or set(runs) - {"on", "off"} or args.steps < args.window:
        ap.error("--runs takes on and/or off; --steps must be >= --window")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    import aiohttp
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from handlers.choice import load_dataset
    from prorl_server.dev import tiny_model
    from prorl_server.dev.vllm_launcher import start_vllm
    from trainer_plugins.trl import ProRLRollout, WeightPushCallback, server_reward
    from trainer_plugins.trl.weights import load_into_backend, save_weights

    torch.set_num_threads(max(1, args.trainer_threads))
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="completion-time-learning-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = tiny_model.build(args.model_dir)
    t_start = time.monotonic()
    # Model time should follow the tokens sampled: a batch's prompts are prefilled in one engine step (4,096
    # tokens), and prefix caching is off, or the steps after each prompt's first visit would prefill less and
    # look faster in both runs whatever the policy learned (measured: median model time 0.5x from the first to
    # the last 10 steps of a run that sampled as many tokens at the end as at the start).
    vllm = start_vllm(model_dir, max_model_len=1024, max_num_batched_tokens=4096, log_path=out_dir / "vllm.log",
                      extra_args=["--worker-extension-cls", "trainer_plugins.vllm_weights.WeightLoaderExtension",
                                  "--no-enable-prefix-caching"])
    print(f"vLLM ready at {vllm.address} in {time.monotonic() - t_start:.0f} s", flush=True)
    # A fresh vLLM's first batches run many times slower (measured: 3.3 s for a 7-token reply, 0.2 s later),
    # which would make whichever run goes first look faster at its end; both runs start warm instead.
    asyncio.run(warm_up(vllm.address, args.prompts_per_step * args.group_size, args.max_tokens))
    instances = load_dataset(limit=16, seed=args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    results: dict[str, dict] = {}

    class Recording(ProRLRollout):
        """ProRLRollout that also keeps, per call, each kept row's resolved bit, model time, generated tokens
        and outcome (the server's results; ``_rows`` is where the rollout turns them into TRL's rows)."""

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.rows_per_step: list[list[dict]] = []

        def _rows(self, prompts, outcomes, trainer, step):
            kept = []
            for oc in outcomes:
                r = oc.result
                if oc.filtered or not r.trajectories:
                    continue
                out = r.reward_components.get("outcome")
                kept.append({"resolved": bool(r.resolved), "model_time_s": model_time(r),
                             "tokens": sum(sum(t.loss_mask) for t in r.trajectories),
                             "outcome": out.value if out is not None else float(r.reward), "speed": r.speed})
            self.rows_per_step.append(kept)
            return super()._rows(prompts, outcomes, trainer, step)

    try:
        for mode in runs:
            torch.manual_seed(args.seed)
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            # the vLLM server serves the previous run's last weights: load the initial model's first
            path = out_dir / f"{mode}-initial.safetensors"
            digest = save_weights(model, path)

            async def reset():
                async with aiohttp.ClientSession() as session:
                    await load_into_backend(session, vllm.address, str(path), digest)

            asyncio.run(reset())
            server_proc, server = start_rollout_server(vllm.address, out_dir / f"{mode}-rollout-server.log")
            try:
                extra = {"completion_time_weight": args.weight} if mode == "on" else {}
                rollout = Recording([server], instances, max_tokens=args.max_tokens, request_timeout_s=300,
                                    **extra)
                push = WeightPushCallback(rollout, [vllm.address], weights_dir=out_dir / f"{mode}-weights")
                started: dict[str, float] = {}

                class Progress(TrainerCallback):
                    """Prints one line per step."""

                    def on_train_begin(self, a, state, control, **kw):
                        started["t"] = time.monotonic()

                    def on_step_end(self, a, state, control, **kw):
                        rows = rollout.rows_per_step[-1] if rollout.rows_per_step else []
                        ok = [r for r in rows if r["resolved"]]
                        mt = statistics.median(r["model_time_s"] for r in ok) if ok else float("nan")
                        nt = statistics.median(r["tokens"] for r in ok) if ok else float("nan")
                        outcome = statistics.mean(r["outcome"] for r in rows) if rows else float("nan")
                        print(f"[{mode}] step {state.global_step:3d}  outcome {outcome:.3f}  resolved {len(ok):2d}/"
                              f"{len(rows)}  median model time {mt * 1000:6.1f} ms  tokens {nt:4.1f}  "
                              f"t {time.monotonic() - started['t']:.0f} s", flush=True)
                        return control

                batch = args.prompts_per_step * args.group_size
                config = GRPOConfig(output_dir=str(out_dir / f"{mode}-trainer"), per_device_train_batch_size=batch,
                                    num_generations=args.group_size, max_completion_length=args.max_tokens,
                                    learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
                                    max_steps=args.steps, beta=0.0, temperature=1.0, logging_steps=1, report_to=[],
                                    save_strategy="no", use_cpu=True, seed=args.seed, bf16=False,
                                    disable_tqdm=True, dataloader_num_workers=0, log_level="warning",
                                    vllm_importance_sampling_mode="token_truncate")
                trainer = GRPOTrainer(model=model, reward_funcs=server_reward, args=config,
                                      train_dataset=Dataset.from_list(ProRLRollout.dataset_rows(instances)),
                                      processing_class=tokenizer, rollout_func=rollout, callbacks=[push, Progress()])
                t0 = time.monotonic()
                trainer.train()
                wall = time.monotonic() - t0
                rollout.close()
            finally:
                server_proc.terminate()
                try:
                    server_proc.wait(timeout=30)
                except Exception:  # noqa: BLE001 - a server that will not stop is killed
                    server_proc.kill()
            results[mode] = {**summarize(rollout.rows_per_step, args.window), "wall_s": round(wall, 1)}
            r = results[mode]
            print(f"[{mode}] median model time of resolved rollouts, first {args.window} steps -> last "
                  f"{args.window}: {r['model_time_first_s'] * 1000:.1f} -> {r['model_time_last_s'] * 1000:.1f} ms "
                  f"(ratio {r['time_ratio']}); tokens {r['tokens_first']} -> {r['tokens_last']}; mean outcome "
                  f"{r['outcome_first']:.3f} -> {r['outcome_last']:.3f}; {r['wall_s']:.0f} s", flush=True)
    finally:
        vllm.stop()

    on = results.get("on")
    summary = {**{k: results[k] for k in ("on", "off") if k in results},
               "target_met": bool(on and on["time_ratio"] is not None and on["time_ratio"] <= 0.7
                                  and on["outcome_last"] >= on["outcome_first"]),
               "settings": {"task": "choice", "weight": args.weight, "steps": args.steps, "window": args.window,
                            "prompts_per_step": args.prompts_per_step, "group_size": args.group_size,
                            "max_tokens": args.max_tokens, "lr": args.lr, "seed": args.seed},
               "wall_s": round(time.monotonic() - t_start, 1)}
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
