"""Rollout throughput of the ``code`` handler: the pipeline at concurrency 1, 8 and 32 beside the same work
done sequentially with no server (the handler's init/run/eval called in-process, one rollout after another).

Workload: the first ``--problems`` HumanEval problems x ``--samples`` samples, the tiny test model on a real
local vLLM CPU server (started here), real bubblewrap sandboxes. What the pipeline buys is the overlap of
LLM generation, sandbox start and hidden-test evaluation across jobs.

Usage: python benchmarks/rollout_throughput.py [--problems 32] [--samples 4] [--max-tokens 64] [--max-turns 2]
The last line is one JSON object with rollouts_per_s_c1, rollouts_per_s_c8, rollouts_per_s_c32,
sequential_rollouts_per_s and per-phase medians.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prorl_server.stats import percentile  # noqa: E402


async def sequential(instances, sampling, address) -> tuple[float, list[dict]]:
    """Baseline: one rollout at a time, handler stages called directly (no server, no pipeline)."""
    from handlers.code import CodeHandler
    from prorl_server.balancer import BackendPool
    from prorl_server.job import Job
    from prorl_server.llm.context import LLMContext
    from sandbox import make_runtime

    pool = BackendPool()
    pool.add(address)
    runtime = make_runtime("bubblewrap")
    llm = LLMContext(pool)
    handler = CodeHandler()
    results = []
    t0 = time.perf_counter()
    for inst in instances:
        job = Job(job_id=None, instance=inst, sampling_params=sampling, handler=handler, handler_name="code",
                  timeout_s=None, pool=pool, sandbox_opener=lambda spec=None, **kw: runtime.start(spec), llm=llm)
        times = {}
        try:
            for stage in ("init", "run", "eval"):
                s = time.perf_counter()
                await getattr(handler, stage)(job)
                times[f"{stage}_s"] = time.perf_counter() - s
                if stage == "run":
                    await job.close_resources("run")
        finally:
            await job.close_resources()
            pool.release(job.job_id)
        results.append({"reward": job.reward, "timing": times})
    wall = time.perf_counter() - t0
    await llm.close()
    await runtime.close_all()
    return wall, results


async def through_server(url, instances, sampling, concurrency) -> tuple[float, list[dict]]:
    results = []
    it = iter(instances)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as s:
        async def client():
            for inst in it:
                async with s.post(f"{url}/process", json={"instance": inst, "sampling_params": sampling}) as r:
                    res = await r.json()
                    if res.get("critical_error"):
                        raise RuntimeError(f"job failed: {res['critical_error']}: {res['error']}")
                    results.append(res)

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return time.perf_counter() - t0, results


def medians(results, key="timing"):
    return {ph: round(percentile((r[key][ph] for r in results), 50), 4) for ph in ("init_s", "run_s", "eval_s")}


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--problems", type=int, default=32)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-turns", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    args = ap.parse_args()

    from handlers.code.data import load_dataset
    from prorl_server.app import create_app
    from prorl_server.config import ServerSettings
    from prorl_server.dev.tiny_model import build
    from prorl_server.dev.vllm_launcher import start_vllm

    instances = [{**inst, "max_turns": args.max_turns} for inst in load_dataset(limit=args.problems)
                 for _ in range(args.samples)]
    sampling = {"max_tokens": args.max_tokens, "temperature": 1.0}
    model = build(ROOT / ".cache" / "tiny-model")
    vllm = start_vllm(model, max_model_len=4096, max_num_batched_tokens=4096,
                      log_path=ROOT / ".cache" / "logs" / "bench-vllm.log")
    rows = {}

    async def reset_prefix_cache() -> None:
        # Every run sends the same prompts: start each from a cold prefix cache so no run rides on another's.
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{vllm.address}/reset_prefix_cache") as r:
                r.raise_for_status()

    try:
        await sequential(instances[:2], sampling, vllm.address)  # warm-up: tokenizer load, first requests
        await reset_prefix_cache()
        seq_wall, seq = await sequential(instances, sampling, vllm.address)
        rows["sequential"] = (len(seq) / seq_wall, medians(seq))
        for c in args.concurrency:
            settings = ServerSettings(port=0, backends=[vllm.address], sandbox_runtime="bubblewrap",
                                      init_workers=c, run_workers=c, eval_workers=c, log_level="WARNING")
            runner = web.AppRunner(create_app(settings), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            await reset_prefix_cache()
            try:
                wall, res = await through_server(url, instances, sampling, c)
            finally:
                await runner.cleanup()
            rows[f"c{c}"] = (len(res) / wall, medians(res))
    finally:
        vllm.stop()

    print(f"code handler, {args.problems} HumanEval problems x {args.samples} samples = {len(instances)} rollouts, "
          f"tiny model on vLLM CPU, bubblewrap sandboxes, max_turns {args.max_turns}, max_tokens {args.max_tokens}")
    print(f"{'':12}{'rollouts/s':>12}{'vs seq':>8}{'init p50':>10}{'run p50':>10}{'eval p50':>10}")
    base = rows["sequential"][0]
    for name, (rps, ph) in rows.items():
        print(f"{name:12}{rps:12.2f}{rps / base:8.2f}{ph['init_s']:10.3f}{ph['run_s']:10.3f}{ph['eval_s']:10.3f}")
    summary = {f"rollouts_per_s_{k}": round(v[0], 3) for k, v in rows.items() if k != "sequential"}
    summary["sequential_rollouts_per_s"] = round(base, 3)
    summary["phase_p50_s"] = {k: v[1] for k, v in rows.items()}
    print(json.dumps(summary))


if __name__ == "__main__":
    asyncio.run(main())
