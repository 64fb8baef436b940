"""Weight swaps with requests in flight: what the server's keep-mode swap costs, against the trainer-side abort
swap it replaces.

Setup (one process, this machine): a real rollout server (``create_app``: pipeline, agent, LLM client, the
``shout`` handler with the tiny model's tokenizer) over 4 :class:`prorl_server.dev.fake_vllm.FakeVLLM` backends,
**fakes standing for vLLM 0.31's completions and development endpoints** (one token per running request per
20 ms engine step; ``/pause?mode=keep|abort``, ``/resume``, the ``prorl_progress`` report). ``--jobs`` shout
jobs (2 turns of ``--tokens`` tokens) are in flight when each of ``--swaps`` swaps starts.

- **ours**: ``POST /weights/pause`` (keep) → the fakes load (stands for the trainer's load) → ``POST
  /weights/resume``.
- **baseline**: what trainers did before: each backend ``POST /pause?mode=abort`` → load → ``/resume`` and
  re-register with the new version (in-flight turns are aborted and re-sent by the LLM client).

Reported per mode: the pause the server adds (p50/p99 of the ``/weights/pause`` wall time minus the slowest
backend's own ``/pause`` answer, ms; baseline: 0, it adds none but loses work), requests in flight at the
pause, tokens discarded (the fakes' aborted tokens), failed jobs, and tokens whose recorded version differs from
the version that generated them (the fakes' token ids say it). Targets: added pause ≤1 s p99, 0 tokens
discarded, 0 failed. The last line printed is one JSON object.

Usage: ``python benchmarks/weight_swap.py [--jobs 1000] [--swaps 5] [--tokens 60] [--quick]``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
from aiohttp import web  # noqa: E402

from handlers.shout.handler import ShoutHandler  # noqa: E402
from prorl_server.dev import tiny_model  # noqa: E402
from prorl_server.app import create_app  # noqa: E402
from prorl_server.config import ServerSettings  # noqa: E402
from prorl_server.dev.fake_vllm import TOKEN_BASE, start_fake_vllm  # noqa: E402
from prorl_server.plugin.registry import HandlerRegistry  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


async def run(mode: str, n_jobs: int, n_swaps: int, tokens: int, model_dir: Path) -> dict:
    fakes, runners, addrs = [], [], []
    for _ in range(4):
        fake, runner, addr = await start_fake_vllm(step_s=0.02)
        fakes.append(fake)
        runners.append(runner)
        addrs.append(addr)
    reg = HandlerRegistry()
    reg.register(ShoutHandler)
    app = create_app(ServerSettings(tokenizer=str(model_dir), health_interval_s=3600, backends=[],
                                    init_workers=n_jobs, run_workers=n_jobs, eval_workers=n_jobs), registry=reg)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
    await site.start()
    server = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    added, in_flight, failed, mislabelled, total_tokens = [], [], 0, 0, 0
    try:
        for a in addrs:
            await session.post(f"{server}/add_llm_server", json={"address": a, "weight_version": 0})
        version = 0

        async def one(i: int) -> dict:
            body = {"job_id": f"{mode}-{version}-{i}", "instance": {"data_source": "shout", "prompt": f"Say {i}."},
                    "sampling_params": {"max_tokens": tokens}}
            async with session.post(f"{server}/process", json=body) as r:
                return await r.json()

        for _ in range(n_swaps):
            jobs = [asyncio.create_task(one(i)) for i in range(n_jobs)]
            # the swap lands when every backend is mid-generation
            while sum(len(f.running) for f in fakes) < n_jobs * 0.9 or \
                    min((len(q.tokens) for f in fakes for q in f.running.values()), default=0) < tokens // 4:
                await asyncio.sleep(0.01)
            in_flight.append(sum(len(f.running) for f in fakes))
            version += 1
            own = [0.0]  # the fakes' own /pause answers at once: all of the measured pause is the server's
            if mode == "ours":
                t0 = time.perf_counter()
                async with session.post(f"{server}/weights/pause", json={"weight_version": version}) as r:
                    paused = await r.json()
                pause_s = time.perf_counter() - t0
                for f in fakes:
                    f.version = version  # the trainer's load
                async with session.post(f"{server}/weights/resume", json={"swap_id": paused["swap_id"]}) as r:
                    assert r.status == 200, await r.text()
                added.append(pause_s - max(own))
            else:
                await asyncio.gather(*(session.post(f"{a}/pause", params={"mode": "abort"}) for a in addrs))
                added.append(0.0)
                for f in fakes:
                    f.version = version
                await asyncio.gather(*(session.post(f"{a}/resume") for a in addrs))
                await asyncio.gather(*(session.post(f"{server}/add_llm_server",
                                                    json={"address": a, "weight_version": version}) for a in addrs))
            for res in await asyncio.gather(*jobs):
                if res.get("failure_kind") is not None:
                    failed += 1
                    continue
                for t in res["trajectories"]:
                    gen = [x for x, m in zip(t["response_ids"], t["loss_mask"]) if m == 1]
                    rec = [v for v, n in t["version_runs"] for _ in range(n)]
                    total_tokens += len(gen)
                    mislabelled += sum(1 for x, v in zip(gen, rec) if v != x - TOKEN_BASE)
        discarded = sum(len(q.tokens) for f in fakes for q in f.finished if q.finish == "abort")
        return {"mode": mode, "added_pause_p50_ms": round(1000 * pct(added, 0.5), 1),
                "added_pause_p99_ms": round(1000 * pct(added, 0.99), 1),
                "in_flight_at_pause": int(statistics.median(in_flight)), "tokens_discarded": discarded,
                "aborted_requests": sum(f.counts["aborted"] for f in fakes), "failed_jobs": failed,
                "tokens": total_tokens, "mislabelled_tokens": mislabelled}
    finally:
        await session.close()
        await runner.cleanup()
        for r in runners:
            await r.cleanup()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--swaps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=60)
    ap.add_argument("--quick", action="store_true", help="200 jobs, 2 swaps")
    args = ap.parse_args()
    if args.quick:
        args.jobs, args.swaps = 200, 2
    logging.basicConfig(level=logging.ERROR)
    model_dir = tiny_model.build(ROOT / ".cache" / "tiny-model")
    rows = [await run(m, args.jobs, args.swaps, args.tokens, model_dir) for m in ("baseline", "ours")]
    cols = list(rows[0])
    print(" ".join(f"{c:>20}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]!s:>20}" for c in cols))
    ours, base = rows[1], rows[0]
    print(json.dumps({"jobs_in_flight": args.jobs, "backends": 4, "swaps": args.swaps,
                      "ours_added_pause_p50_ms": ours["added_pause_p50_ms"],
                      "ours_added_pause_p99_ms": ours["added_pause_p99_ms"],
                      "ours_tokens_discarded": ours["tokens_discarded"], "ours_failed_jobs": ours["failed_jobs"],
                      "ours_mislabelled_tokens": ours["mislabelled_tokens"],
                      "baseline_tokens_discarded": base["tokens_discarded"],
                      "baseline_aborted_requests": base["aborted_requests"]}))


if __name__ == "__main__":
    asyncio.run(main())
