"""Pipeline overhead: jobs/s and added latency of /process versus a bare aiohttp floor, in one run.

2000 jobs of the built-in ``arithmetic`` handler through ``POST /process`` from 64 concurrent clients, server
pools 64/64/64, beside the same client against a bare aiohttp handler that answers at once (the floor). Both
servers run as separate processes so client and server do not share an event loop. Added latency =
ours - floor at the same percentile. Target: >= 500 jobs/s and p50 added <= 3x the floor p50.

Usage: python benchmarks/pipeline_overhead.py [--jobs 2000] [--concurrency 64] [--rounds 3]
The last line printed is one JSON object (jobs_per_s, p50_added_ms, p99_added_ms, floor_p50_ms, ...).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import aiohttp

from prorl_server.stats import percentile

JOB = {"instance": {"data_source": "arithmetic", "expression": "2*(3+4)", "answer": 14}, "sampling_params": {}}


def serve_floor(port_file: str) -> None:
    from aiohttp import web

    body = json.dumps({"reward": 1.0}).encode()

    async def process(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=body, content_type="application/json")

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/process", process)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        with open(port_file + ".tmp", "w") as f:
            json.dump({"url": f"http://127.0.0.1:{runner.addresses[0][1]}"}, f)
        os.replace(port_file + ".tmp", port_file)
        await asyncio.Event().wait()

    asyncio.run(main())


def start(cmd: list[str], ready: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(400):
        if os.path.exists(ready):
            return proc, json.load(open(ready))["url"]
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd} exited with {proc.returncode}")
        time.sleep(0.025)
    raise RuntimeError(f"{cmd} did not become ready")


async def load(url: str, jobs: int, concurrency: int, check: bool) -> tuple[float, list[float]]:
    latencies: list[float] = []
    remaining = iter(range(jobs))
    payload = json.dumps(JOB).encode()
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        async def client() -> None:
            for _ in remaining:
                t0 = time.perf_counter()
                async with s.post(url + "/process", data=payload, headers=headers) as r:
                    body = await r.read()
                latencies.append(time.perf_counter() - t0)
                if check and json.loads(body)["reward"] != 1.0:
                    raise AssertionError(f"bad result: {body[:200]!r}")

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return time.perf_counter() - t0, latencies


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="alternating floor/ours rounds; medians reported")
    ap.add_argument("--serve-floor", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_floor:
        return serve_floor(args.serve_floor)

    tmp = tempfile.mkdtemp()
    ours_ready, floor_ready = f"{tmp}/ours.json", f"{tmp}/floor.json"
    ours, ours_url = start([sys.executable, "-m", "prorl_server", "--port", "0", "--ready-file", ours_ready,
                            "--init-workers", "64", "--run-workers", "64", "--eval-workers", "64",
                            "--log-level", "warning"], ours_ready)
    floor, floor_url = start([sys.executable, __file__, "--serve-floor", floor_ready], floor_ready)
    try:
        asyncio.run(load(ours_url, 200, args.concurrency, True))  # warm-up
        asyncio.run(load(floor_url, 200, args.concurrency, False))
        rows = []
        for _ in range(args.rounds):
            fw, fl = asyncio.run(load(floor_url, args.jobs, args.concurrency, False))
            ow, ol = asyncio.run(load(ours_url, args.jobs, args.concurrency, True))
            rows.append({"floor_rps": args.jobs / fw, "ours_rps": args.jobs / ow,
                         "floor_p50": percentile(fl, 50) * 1e3, "floor_p99": percentile(fl, 99) * 1e3,
                         "ours_p50": percentile(ol, 50) * 1e3, "ours_p99": percentile(ol, 99) * 1e3})
    finally:
        for p in (ours, floor):
            p.send_signal(signal.SIGTERM)
            p.wait(10)

    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"{args.jobs} jobs x {args.rounds} rounds, {args.concurrency} concurrent clients, pools 64/64/64 "
          f"(medians over rounds)")
    print(f"{'':14}{'jobs/s':>10}{'p50 ms':>10}{'p99 ms':>10}")
    print(f"{'bare aiohttp':14}{med['floor_rps']:10.0f}{med['floor_p50']:10.2f}{med['floor_p99']:10.2f}")
    print(f"{'prorl-server':14}{med['ours_rps']:10.0f}{med['ours_p50']:10.2f}{med['ours_p99']:10.2f}")
    added50 = med["ours_p50"] - med["floor_p50"]
    added99 = med["ours_p99"] - med["floor_p99"]
    print(f"added latency p50 {added50:.2f} ms ({added50 / med['floor_p50']:.2f}x floor p50), "
          f"p99 {added99:.2f} ms; throughput {med['ours_rps'] / med['floor_rps']:.2f}x floor")
    print(json.dumps({"jobs_per_s": round(med["ours_rps"], 1), "p50_added_ms": round(added50, 3),
                      "p99_added_ms": round(added99, 3), "floor_p50_ms": round(med["floor_p50"], 3),
                      "floor_p99_ms": round(med["floor_p99"], 3), "floor_jobs_per_s": round(med["floor_rps"], 1),
                      "added_p50_vs_floor_p50": round(added50 / med["floor_p50"], 2),
                      "meets_target": med["ours_rps"] >= 500 and added50 <= 3 * med["floor_p50"]}))


if __name__ == "__main__":
    main()
