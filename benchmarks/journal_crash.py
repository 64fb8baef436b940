"""Crash safety of the journal: a real ``prorl-server`` process is SIGKILLed at random moments while jobs run,
``--kills`` times, and restarted on the same port and journal; the client resubmits every job it has no
result for under the same id, and asks again for some it has.

Counted over the whole run:
- **lost**: results a client received before a kill that the restarted server does not answer again (exactly
  the same bytes) for the same id: target 0;
- **delivered twice**: job ids for which the client received two different results (two samples for one id):
  target 0;
- **resubmittable**: jobs whose ``/process`` call died with the server (connection error), resubmitted.
The baseline is the same run with ``--journal off`` (the server before the journal). Then, on a quiet journal, the store's own figures: commit latency p50/p99 (queue → committed) at 5,000
completions/s of 200-2,000-token contexts, with a producer that idles between rows and one that never does
(``busy_loop``), and the completions/s one writer sustains (the writer process with its WAL preallocated, as
``prorl-server`` runs it; the thread baseline without); then the idle commit p99 of the writer process without
and with the preallocated WAL, alternating, twice each (``prealloc_off/on_commit_p99_ms``) (targets on this 2-core machine: < 2 ms p99,
>= 5,000/s), and what a write costs the caller (the event loop): enqueue p50/p99 in µs; each for the writer
process the server runs and, as ``baseline_thread_*``, for a writer thread in the producer's process (what the
journal had before); and the 1-minute load average when they were taken.

Setup: the backend is :class:`prorl_server.dev.fake_vllm.FakeVLLM` (standing for vLLM's completions endpoint: 2 ms
per token step), in this process; the handler is ``shout`` (2 turns of 16 tokens) with the tiny model's
tokenizer. The last line printed is one JSON object.

Usage: ``python benchmarks/journal_crash.py [--jobs 1000] [--kills 20] [--quick] [--no-store | --store-only]``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from prorl_server.dev import tiny_model  # noqa: E402
from prorl_server.dev.fake_vllm import start_fake_vllm  # noqa: E402
from prorl_server.journal.store import Journal  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m prorl_server`` with a journal, in its own process group."""

    def __init__(self, port: int, journal: str, backend: str, tokenizer: str, log: Path) -> None:
        self.port, self.journal, self.backend, self.tokenizer, self.log = port, journal, backend, tokenizer, log
        self.proc: subprocess.Popen | None = None

    async def start(self) -> None:
        ready = Path(tempfile.mkdtemp(prefix="jc-")) / "ready.json"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "prorl_server", "--port", str(self.port), "--journal", self.journal,
                 "--backend", self.backend, "--tokenizer", self.tokenizer, "--ready-file", str(ready),
                 "--log-level", "WARNING", "--run-workers", "512", "--init-workers", "512", "--eval-workers",
                 "512"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        for _ in range(1200):
            if ready.exists():
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log.read_text()[-2000:]}")
            await asyncio.sleep(0.05)
        raise RuntimeError("server did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


async def crash_rounds(n_jobs: int, kills: int, seed: int = 0, journal: bool = True) -> dict:
    rng = random.Random(seed)
    model_dir = tiny_model.build(ROOT / ".cache" / "tiny-model")
    fake, fake_runner, backend = await start_fake_vllm(step_s=0.002)
    work = Path(tempfile.mkdtemp(prefix="journal-crash-"))
    server = Server(free_port(), str(work / "journal.sqlite") if journal else "off", backend, str(model_dir),
                    work / "server.log")
    url = f"http://127.0.0.1:{server.port}"
    delivered: dict[str, bytes] = {}  # job id -> the first result body the client received
    twice = lost = resubmitted = 0
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def one(i: int) -> None:
        nonlocal twice, lost, resubmitted
        jid = f"job-{i}"
        body = {"job_id": jid, "instance": {"data_source": "shout", "prompt": f"Say {i}."},
                "sampling_params": {"max_tokens": 16}}
        try:
            async with session.post(f"{url}/process", json=body) as r:
                data = await r.read()
                if r.status != 200:
                    return
        except (aiohttp.ClientError, asyncio.TimeoutError):
            resubmitted += 1  # the server died under it: resubmittable
            return
        first = delivered.setdefault(jid, data)
        if first != data:
            if json.loads(first)["trajectory_id"] != json.loads(data)["trajectory_id"]:
                twice += 1
            else:
                lost += 1  # same job, other bytes: what was delivered was not kept as it was

    try:
        for k in range(kills + 1):
            await server.start()
            # every job without a result, and a sample of those with one (they must come back identical)
            todo = [i for i in range(n_jobs) if f"job-{i}" not in delivered]
            todo += rng.sample(sorted(int(j[4:]) for j in delivered), min(len(delivered), n_jobs // 10))
            tasks = [asyncio.create_task(one(i)) for i in todo]
            if k < kills:  # at a random point of the round: after a random share of its results came back
                before = len(delivered)
                want = before + int(rng.uniform(0.05, 0.8) * (n_jobs - before))
                t_end = time.monotonic() + 30
                while len(delivered) < want and time.monotonic() < t_end and not all(t.done() for t in tasks):
                    await asyncio.sleep(0.005)
                await asyncio.sleep(rng.uniform(0, 0.05))
                server.kill()
            await asyncio.gather(*tasks)
            if k == kills:
                server.stop()
        # after the last clean run, every delivered result must still be answered the same
        await server.start()
        for jid, body in delivered.items():
            async with session.get(f"{url}/jobs/{jid}") as r:
                got = await r.json() if r.status == 200 else None
            if got is None or got["result"]["trajectory_id"] != json.loads(body)["trajectory_id"]:
                lost += 1
        server.stop()
        size = os.path.getsize(work / "journal.sqlite") if journal else 0
        return {"journal": journal, "jobs": n_jobs, "kills": kills, "delivered": len(delivered), "lost": lost,
                "delivered_twice": twice, "resubmitted_after_a_kill": resubmitted,
                "journal_mb": round(size / 1e6, 1)}
    finally:
        server.kill()
        await session.close()
        await fake_runner.cleanup()


def store_figures(seconds: float = 4.0, rate: int = 5000) -> dict:
    """The journal alone, as the server runs it (``writer="process"``) and with the writer thread it had
    before (``writer="thread"``, the baseline): commit latency (queue -> committed, as the writer measures it)
    at ``rate`` completions/s with a producer that sleeps between rows (an event loop with idle time) and one
    that never yields the GIL (an event loop busy all the time), the rate one writer sustains, and what a write
    costs the caller (the event loop)."""
    work = Path(tempfile.mkdtemp(prefix="journal-store-"))
    rng = random.Random(1)

    def feed(j: Journal, n: int, mode: str, enqueue: list[float]) -> float:
        ctx: dict[str, list[int]] = {}
        t0 = time.perf_counter()
        for i in range(n):
            if mode == "idle":  # sleeps (releases the GIL) until the next row is due
                while (time.perf_counter() - t0) * rate < i:
                    time.sleep(0.0005)
            elif mode == "busy":  # spins (holds the GIL) until the next row is due
                while (time.perf_counter() - t0) * rate < i:
                    pass
            owner = f"job-{i % 1000}"
            c = ctx.setdefault(owner, list(range(200)))
            toks = [rng.randrange(4096) for _ in range(32)]
            t = time.perf_counter()
            j.completion(owner, "http://b", c, toks, [-0.5] * 32, [[0, 32]], "stop")
            enqueue.append(time.perf_counter() - t)
            c.extend(toks)
            c.extend((1, 2, 3))
            if len(c) > 2000:
                ctx[owner] = list(range(200))
                j.forget_owner(owner)
        j.flush()
        return time.perf_counter() - t0

    def q(xs: list[float], p: float, scale: float) -> float:
        xs = sorted(xs)
        return round(scale * xs[int(p * (len(xs) - 1))], 2 if scale == 1000 else 1)

    out: dict = {}
    n = int(seconds * rate)
    for writer, prefix in (("thread", "baseline_thread_"), ("process", "")):
        for mode in ("idle", "busy"):
            j = Journal(str(work / f"{writer}-{mode}.sqlite"), writer=writer, prealloc_wal=writer == "process")
            j.start()
            enqueue: list[float] = []
            feed(j, n, mode, enqueue)
            lat = list(j.latencies)
            j.close()
            tag = "" if mode == "idle" else "busy_loop_"
            out[f"{prefix}commit_{tag}p50_ms"] = q(lat, 0.5, 1000)
            out[f"{prefix}commit_{tag}p99_ms"] = q(lat, 0.99, 1000)
            if mode == "idle":
                out[f"{prefix}enqueue_us_p50"] = q(enqueue, 0.5, 1e6)
                out[f"{prefix}enqueue_us_p99"] = q(enqueue, 0.99, 1e6)
        j = Journal(str(work / f"{writer}-burst.sqlite"), writer=writer, prealloc_wal=writer == "process")
        j.start()
        dt = feed(j, n, "burst", [])
        j.close()
        out[f"{prefix}completions_per_s"] = int(n / dt)
    for k in range(2):  # the process writer without the preallocated WAL (what it had before), idle producer,
        for prealloc in (False, True):  # alternating with it, so both see the same load
            j = Journal(str(work / f"prealloc-{prealloc}-{k}.sqlite"), prealloc_wal=prealloc)
            j.start()
            feed(j, n, "idle", [])
            lat = list(j.latencies)
            j.close()
            key = "prealloc_off_commit_p99_ms" if not prealloc else "prealloc_on_commit_p99_ms"
            out.setdefault(key, []).append(q(lat, 0.99, 1000))
    out["load_avg_1m"] = round(os.getloadavg()[0], 2)
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="100 jobs, 3 kills")
    ap.add_argument("--no-store", action="store_true", help="skip the store figures")
    ap.add_argument("--store-only", action="store_true", help="only the store figures (no server, no kills)")
    args = ap.parse_args()
    if args.quick:
        args.jobs, args.kills = 100, 3
    if args.store_only:
        print(json.dumps(store_figures()))
        return
    base = await crash_rounds(args.jobs, args.kills, args.seed, journal=False)
    print("baseline (no journal):", json.dumps(base), flush=True)
    crash = await crash_rounds(args.jobs, args.kills, args.seed)
    print("ours (journal):      ", json.dumps(crash), flush=True)
    store = {} if args.no_store else store_figures()
    print(json.dumps({**crash, **store, "baseline_lost": base["lost"],
                      "baseline_delivered_twice": base["delivered_twice"]}))


if __name__ == "__main__":
    asyncio.run(main())
