"""One rollout server process under 32 to 4,096 concurrent multi-turn jobs: throughput, CPU per turn, added
latency, event-loop stalls, collector time, memory and errors, for the baseline commit and this tree side by
side; then two server processes beside one at 1,024 jobs in flight.

Workload: the ``shout`` handler, 2 model turns of 16 tokens per job, no sandbox. The LLM is a **fake
OpenAI-compatible completions backend standing for vLLM** (``prorl_server.dev.timed_llm``, its own process):
``GET /v1/models`` names the
tiny test model's directory (the server loads that tokenizer) and every ``POST /v1/completions`` answers 16
token ids with logprobs after 50 ms + 1 ms per requested token (66 ms), so a job's ideal time is 132 ms and
the ideal rate at C jobs in flight is C / 0.132 s. The load client is this script (uvloop, one connection per
job in flight: no connection cap), sending ``POST /process`` and timing each job.

Each server runs in its own process (``python -m prorl_server``), started fresh per level with ``C`` workers
per stage, wrapped in a probe that times the garbage collector with ``gc.callbacks`` (the same probe around
both versions). Per level, after a warm-up (tokenizer loaded, ``C`` jobs done), one window of ``--window-s``
seconds is measured:

- jobs/s, and its share of the ideal;
- server CPU per 1,000 turns (user+system of the server process(es) over the window / turns done);
- added latency per turn, p50 / p99: (job time - 132 ms) / 2;
- event-loop stall p99 (interpolated in the server's ``prorl_event_loop_lag_seconds`` histogram, the lag of a
  50 ms sleep, over the window) and max (``prorl_event_loop_lag_max_seconds``, the largest lag of the last
  10 s, read at the window's end; with a window under 10 s it also covers the end of the warm-up);
- time in the collector over the window (CPU seconds of the collecting thread, and their share of the
  server's CPU time), full collections, and collections by generation;
- RSS of the server at the end of the window;
- connection errors (refused, reset, disconnected, from the first connection on: all C clients connect at
  once) and failed jobs (non-200, or a ``critical_error``).

This tree's servers run with prorl-server's defaults, admission control included (jobs start their stages only
while the event loop keeps within 5 ms of lag; ``--ours-args "--admission-target-lag-ms 0"`` turns it off): the
line under each row says the admission limit and the jobs waiting for it at the window's end.

The HTTP floor (``floor`` rows; ``--no-floor`` leaves them out): a server of a few lines that does only the
HTTP work of a job with the same libraries (aiohttp server and client on uvloop, orjson) and no job, pipeline,
handler or tokenizer; its CPU per turn is what aiohttp alone costs here, and ``ours_above_floor_*`` in the last
line what this tree spends beyond it.

Baseline: the commit ``--baseline-ref`` (default: the parent of this work, whose server has aiohttp's
default listen backlog of 128, no collector freeze, and keeps finished jobs' full results alive) checked out
with ``git worktree`` in a temporary directory and run with the same Python; ours: this tree.

Usage: python benchmarks/server_scale.py [--quick] [--levels 32 256 1024 4096] [--window-s 10] [--repeat N]
       [--baseline-ref REF | --no-baseline] [--no-two-process] [--ours-args "--gc-gen0-threshold 700 ..."]
``--quick`` (CI-sized): levels 32 and 256, 3 s windows, the two-process run at 256. The last line printed is
one JSON object (per version and level, plus the two-process ratio).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / ".cache" / "tiny-model"
TURN_S = 0.050 + 0.001 * 16  # the fake backend's answer time for one 16-token turn
JOB_S = 2 * TURN_S
DEFAULT_BASELINE_REF = "c410bdc"  # the tree before issue #26's changes
TICKS = os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------------------------------------- fake backend


# ----------------------------------------------------------------------------------------------- HTTP floor


def floor_server_main(ready_file: str, backend: str) -> None:
    """The HTTP floor: an aiohttp server on uvloop that does only the HTTP work of a rollout server for one
    job, with the same libraries and settings (aiohttp server with a 4,096 backlog and no access log, one
    ``aiohttp.ClientSession`` with an unlimited keep-alive pool, orjson): ``POST /process`` is read and parsed,
    2 ``POST /v1/completions`` go to the backend with a body of the shape the LLM client sends (60 prompt ids
    growing by each answer, the same sampling fields), their answers are parsed, and a result of a
    trajectory's shape (the ids, logprobs and loss mask of both turns) is answered. No job, pipeline, handler,
    tokenizer or metrics: its CPU per turn is what aiohttp alone costs on this machine."""
    import orjson
    import uvloop
    from aiohttp import web
    import aiohttp

    prompt = list(range(1000, 1060))
    headers = {"Content-Type": "application/json"}

    async def main() -> None:
        http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=300, connect=10))

        async def process(request: web.Request) -> web.Response:
            req = orjson.loads(await request.read())
            ids, logprobs, mask = list(prompt), [], []
            for _ in range(2):
                body = {**req.get("sampling_params", {}), "prompt": ids, "max_tokens": 16, "logprobs": 0,
                        "return_tokens_as_token_ids": True, "n": 1, "stream": False, "echo": False,
                        "add_special_tokens": False, "model": "tiny"}
                async with http.post(f"{backend}/v1/completions", data=orjson.dumps(body), headers=headers) as r:
                    answer = orjson.loads(await r.read())
                choice = answer["choices"][0]
                ids += choice["token_ids"] + [13, 14, 15, 16]
                logprobs += choice["logprobs"]["token_logprobs"] + [0.0] * 4
                mask += [1] * len(choice["token_ids"]) + [0] * 4
            n = len(prompt)
            return web.Response(body=orjson.dumps({
                "job_id": "j", "reward": 1.0, "trajectories": [{
                    "prompt_ids": ids[:n], "response_ids": ids[n:], "logprobs": logprobs, "loss_mask": mask,
                    "weight_versions": [0] * len(mask)}], "critical_error": None}), content_type="application/json")

        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/process", process)
        async def metrics(request: web.Request) -> web.Response:
            return web.Response(text="")

        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0, backlog=4096).start()
        tmp = ready_file + ".tmp"
        Path(tmp).write_text(json.dumps({"url": f"http://127.0.0.1:{runner.addresses[0][1]}"}))
        os.replace(tmp, ready_file)
        await asyncio.Event().wait()

    uvloop.run(main())


# ----------------------------------------------------------------------------------------------- server probe


def probe_main(stats_file: str, argv: list[str]) -> None:
    """Run ``python -m prorl_server argv`` with the collector timed (``gc.callbacks``): every 0.25 s the totals
    are written to ``stats_file`` as JSON ``{gc_s, collections: [g0, g1, g2], gen2_s, module}``."""
    import gc
    import runpy
    import threading

    totals = {"gc_s": 0.0, "gen_s": [0.0, 0.0, 0.0], "collections": [0, 0, 0], "pauses": []}
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        # CPU time of the collecting thread: on a shared machine a wall-clock span would also count the time
        # the process waited for a core
        if phase == "start":
            started[0] = time.thread_time()
        else:
            dt = time.thread_time() - started[0]
            totals["gc_s"] += dt
            totals["collections"][info["generation"]] += 1
            totals["gen_s"][info["generation"]] += dt
            if dt > 0.005:  # (wall time, CPU seconds) of the long ones, for the window's longest pause
                totals["pauses"] = [*totals["pauses"][-199:], (time.time(), dt)]

    gc.callbacks.append(on_gc)

    def writer() -> None:
        import prorl_server

        while True:
            tmp = stats_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump({**totals, "module": prorl_server.__file__}, f)
            os.replace(tmp, stats_file)
            time.sleep(0.25)

    threading.Thread(target=writer, daemon=True).start()
    sys.argv = ["prorl_server", *argv]
    runpy.run_module("prorl_server", run_name="__main__", alter_sys=True)


# ----------------------------------------------------------------------------------------------- processes


def cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of ``pid``, its threads and its live child processes (the journal's writer
    process) included."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    total = (int(fields[11]) + int(fields[12])) / TICKS
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    for child in children:
        try:
            total += cpu_seconds(int(child))
        except OSError:  # it exited meanwhile
            pass
    return total


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Server:
    """One ``prorl-server`` process (through :func:`probe_main`) of the tree at ``root``."""

    def __init__(self, root: Path, backend: str, workers: int, tmp: Path, name: str,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.ready = tmp / f"{name}.ready.json"
        self.stats = tmp / f"{name}.gc.json"
        self.log = tmp / f"{name}.log"
        env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1", "PRORL_TOKEN": ""}
        env.pop("PRORL_TOKEN")
        args = ["--port", "0", "--ready-file", str(self.ready), "--backend", backend, "--sandbox-runtime", "none",
                "--log-level", "WARNING", "--init-workers", str(workers), "--run-workers", str(workers),
                "--eval-workers", str(workers), *extra_args]
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--_probe", str(self.stats),
                                      "--", *args], cwd=str(root), env=env, stdout=open(self.log, "wb"),
                                     stderr=subprocess.STDOUT)
        self.url = ""

    async def wait_ready(self, timeout_s: float = 120.0) -> str:
        deadline = time.monotonic() + timeout_s
        while not self.ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {self.log.read_text()[-2000:]}")
            await asyncio.sleep(0.1)
        self.url = json.loads(self.ready.read_text())["url"]
        return self.url

    def gc_stats(self) -> dict:
        try:
            return json.loads(self.stats.read_text())
        except (OSError, ValueError):
            return {"gc_s": 0.0, "gen_s": [0.0, 0.0, 0.0], "collections": [0, 0, 0], "pauses": []}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class FloorServer(Server):
    """The HTTP floor (:func:`floor_server_main`) in its own process, with :class:`Server`'s interface."""

    def __init__(self, backend: str, tmp: Path, name: str) -> None:
        self.ready = tmp / f"{name}.ready.json"
        self.stats = tmp / f"{name}.gc.json"  # never written: no collector probe
        self.log = tmp / f"{name}.log"
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--_floor", str(self.ready),
                                      backend], cwd=str(ROOT), stdout=open(self.log, "wb"), stderr=subprocess.STDOUT)
        self.url = ""


# ----------------------------------------------------------------------------------------------- load


def parse_metrics(text: str) -> tuple[dict[float, float], float]:
    """``({le: cumulative count}, lag max seconds)`` of the event-loop lag metrics in a /metrics text."""
    buckets: dict[float, float] = {}
    lag_max = 0.0
    for line in text.splitlines():
        if line.startswith("prorl_event_loop_lag_seconds_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[float("inf") if le == "+Inf" else float(le)] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("prorl_event_loop_lag_max_seconds "):
            lag_max = float(line.rsplit(" ", 1)[1])
    return buckets, lag_max


def read_gauge(text: str, name: str) -> Optional[float]:
    """The value of the unlabelled gauge ``name`` in a /metrics text; None when the server has none (the
    baseline has no admission control)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def histogram_quantile(q: float, before: dict[float, float], after: dict[float, float]) -> Optional[float]:
    """The ``q`` quantile (0-1) of the observations between two cumulative histograms, interpolated linearly
    inside its bucket (Prometheus' ``histogram_quantile``); None without observations."""
    les = sorted(after)
    counts = [after[le] - before.get(le, 0.0) for le in les]
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    prev_le, prev_c = 0.0, 0.0
    for le, c in zip(les, counts):
        if c >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_c) / (c - prev_c) if c > prev_c else 1.0)
        prev_le, prev_c = le, c
    return les[-2]


async def run_level(servers: list[Server], backend_pid: int, concurrency: int, window_s: float) -> dict:
    """Drive ``concurrency`` jobs in flight over ``servers`` (spread evenly); measure one window."""
    import aiohttp
    import orjson

    urls = [s.url for s in servers]
    body = orjson.dumps({"instance": {"data_source": "shout", "prompt": "Say something about the sea."},
                         "sampling_params": {"max_tokens": 16, "temperature": 1.0}})
    headers = {"Content-Type": "application/json"}
    state = {"measuring": False, "stop": False}
    lat: list[float] = []
    errors = {"connection": 0, "failed": 0, "done": 0, "done_total": 0}
    failures: dict[str, int] = {}

    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as probe:
        async def client(i: int) -> None:
            url = urls[i % len(urls)] + "/process"
            while not state["stop"]:
                t0 = time.perf_counter()
                try:
                    async with http.post(url, data=body, headers=headers) as r:
                        raw = await r.read()
                        status = r.status
                except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as e:
                    if not state["stop"]:  # counted from the first connection on: the connect storm is the test
                        errors["connection"] += 1
                        failures[type(e).__name__] = failures.get(type(e).__name__, 0) + 1
                    await asyncio.sleep(0.05)
                    continue
                dt = time.perf_counter() - t0
                ok = status == 200 and orjson.loads(raw).get("critical_error") is None
                errors["done_total"] += 1
                if state["measuring"] and not state["stop"]:
                    if ok:
                        errors["done"] += 1
                        lat.append(dt)
                    else:
                        errors["failed"] += 1
                        key = f"http {status}" if status != 200 else str(orjson.loads(raw).get("error"))[:80]
                        failures[key] = failures.get(key, 0) + 1

        async def scrape(url: str) -> tuple[dict, float]:
            try:
                async with probe.get(url + "/metrics") as r:
                    return parse_metrics(await r.text())
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                return {}, float("nan")

        tasks = [asyncio.create_task(client(i)) for i in range(concurrency)]
        # warm-up: the tokenizer loaded, every client through at least one job, and 2 s of steady load
        t_start = time.monotonic()
        while errors["done_total"] < concurrency and time.monotonic() - t_start < 120:
            await asyncio.sleep(0.1)
        await asyncio.sleep(2.0)
        hist0 = [(await scrape(u))[0] for u in urls]
        cpu0 = [cpu_seconds(s.proc.pid) for s in servers]
        gc0 = [s.gc_stats() for s in servers]
        w0 = time.time()
        bcpu0, ccpu0 = cpu_seconds(backend_pid), time.process_time()
        state["measuring"] = True
        t0 = time.monotonic()
        lag_max = 0.0
        scrape_failed = 0
        while time.monotonic() - t0 < window_s:
            await asyncio.sleep(min(1.0, max(0.0, window_s - (time.monotonic() - t0))))
            for u in urls:
                _, m = await scrape(u)
                if m != m:  # NaN: /metrics did not answer within 5 s
                    scrape_failed += 1
                else:
                    lag_max = max(lag_max, m)
        wall = time.monotonic() - t0
        if window_s >= 10.0:  # the gauge is the max of the last 10 s: now exactly the window's (warm-up excluded)
            finals = [(await scrape(u))[1] for u in urls]
            lag_max = max(finals) if all(m == m for m in finals) else lag_max
        state["stop"] = True
        cpu = sum(cpu_seconds(s.proc.pid) - c for s, c in zip(servers, cpu0))
        gc1 = [s.gc_stats() for s in servers]
        bcpu, ccpu = cpu_seconds(backend_pid) - bcpu0, time.process_time() - ccpu0
        hist1 = [(await scrape(u))[0] for u in urls]
        admission = []  # (limit, waiting) of each server at the window's end: what admission control did
        for u in urls:
            try:
                async with probe.get(u + "/metrics") as r:
                    text = await r.text()
                admission.append((read_gauge(text, "prorl_admission_limit"),
                                  read_gauge(text, "prorl_admission_waiting")))
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                admission.append((None, None))
        rss = sum(rss_mb(s.proc.pid) for s in servers)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    done = errors["done"]
    turns = 2 * done
    p99s = [histogram_quantile(0.99, h0, h1) for h0, h1 in zip(hist0, hist1) if h1]
    added = sorted((x - JOB_S) / 2 * 1000 for x in lat)
    gc_s = sum(b["gc_s"] - a["gc_s"] for a, b in zip(gc0, gc1))
    full = sum(b["collections"][2] - a["collections"][2] for a, b in zip(gc0, gc1))
    by_gen = [(sum(b["collections"][g] - a["collections"][g] for a, b in zip(gc0, gc1)),
               sum(b["gen_s"][g] - a["gen_s"][g] for a, b in zip(gc0, gc1))) for g in range(3)]
    return {
        "concurrency": concurrency, "processes": len(servers), "jobs_per_s": done / wall,
        "ideal_jobs_per_s": concurrency / JOB_S, "of_ideal": done / wall / (concurrency / JOB_S),
        "cpu_ms_per_turn": 1000 * cpu / turns if turns else float("nan"),
        "server_cpu_cores": cpu / wall, "backend_cpu_cores": bcpu / wall, "client_cpu_cores": ccpu / wall,
        "added_ms_p50": added[len(added) // 2] if added else float("nan"),
        "added_ms_p99": added[min(len(added) - 1, int(0.99 * len(added)))] if added else float("nan"),
        "stall_ms_p99": 1000 * max(p99s) if p99s and None not in p99s else float("nan"),
        "stall_ms_max": 1000 * lag_max, "metrics_unanswered": scrape_failed,
        "gc_s": gc_s, "gc_share_of_cpu": gc_s / cpu if cpu else float("nan"), "full_collections": full,
        "gc_by_generation": by_gen,
        "gc_pause_max_ms": 1000 * max([dt for g in gc1 for t, dt in g.get("pauses", []) if t >= w0] or [0.0]),
        "load_average": os.getloadavg()[0], "admission": admission,
        "rss_mb": rss, "connection_errors": errors["connection"], "failed_jobs": errors["failed"],
        "failures": failures, "window_s": wall,
    }


# ----------------------------------------------------------------------------------------------- driver


@contextlib.contextmanager
def baseline_tree(ref: str):
    """A ``git worktree`` of ``ref`` in a temporary directory (removed on exit)."""
    d = tempfile.mkdtemp(prefix="prorl-scale-base-")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", d, ref], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield Path(d)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", d], check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def median_row(runs: list[dict]) -> dict:
    """Per key, the median of ``runs`` (numbers; lists and dicts from the median-jobs/s run)."""
    mid = sorted(runs, key=lambda r: r["jobs_per_s"])[len(runs) // 2]
    out = dict(mid)
    for k, v in mid.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            xs = sorted(r[k] for r in runs)
            out[k] = xs[len(xs) // 2]
    return out


async def measure(root: Path, backend_url: str, backend_pid: int, concurrency: int, processes: int,
                  window_s: float, tmp: Path, name: str, extra_args: tuple[str, ...] = (), repeat: int = 1) -> dict:
    """One level, ``repeat`` times with fresh servers; the median of each figure (:func:`median_row`)."""
    runs = [await _measure_once(root, backend_url, backend_pid, concurrency, processes, window_s, tmp,
                                f"{name}-r{i}", extra_args) for i in range(repeat)]
    return median_row(runs)


async def _measure_once(root: Path, backend_url: str, backend_pid: int, concurrency: int, processes: int,
                        window_s: float, tmp: Path, name: str, extra_args: tuple[str, ...]) -> dict:
    servers = [FloorServer(backend_url, tmp, f"{name}-c{concurrency}-{i}") if name.startswith("floor") else
               Server(root, backend_url, concurrency // processes, tmp, f"{name}-c{concurrency}-p{processes}-{i}",
                      extra_args) for i in range(processes)]
    try:
        await asyncio.gather(*(s.wait_ready() for s in servers))
        return await run_level(servers, backend_pid, concurrency, window_s)
    finally:
        for s in servers:
            s.stop()


COLS = [("jobs/s", "jobs_per_s", "{:.0f}"), ("ideal", "of_ideal", "{:.0%}"),
        ("cpu ms/turn", "cpu_ms_per_turn", "{:.3f}"), ("add p50", "added_ms_p50", "{:.1f}"),
        ("add p99", "added_ms_p99", "{:.1f}"), ("stall p99", "stall_ms_p99", "{:.1f}"),
        ("stall max", "stall_ms_max", "{:.0f}"), ("gc s", "gc_s", "{:.2f}"), ("gc/cpu", "gc_share_of_cpu", "{:.0%}"),
        ("full gc", "full_collections", "{}"), ("rss MB", "rss_mb", "{:.0f}"), ("conn err", "connection_errors", "{}"),
        ("failed", "failed_jobs", "{}"), ("srv cores", "server_cpu_cores", "{:.2f}"),
        ("bk+cl cores", "other_cores", "{:.2f}")]


def print_rows(rows: list[tuple[str, dict]], header: bool = True) -> None:
    if header:
        print(f"{'':>16}" + "".join(f"{c:>12}" for c, _, _ in COLS))
    for name, r in rows:
        r = {**r, "other_cores": r["backend_cpu_cores"] + r["client_cpu_cores"]}
        print(f"{name:>16}" + "".join(f"{fmt.format(r[k]):>12}" for _, k, fmt in COLS), flush=True)


async def main(args: argparse.Namespace) -> None:
    levels = args.levels or ([32, 256] if args.quick else [32, 256, 1024, 4096])
    window = args.window_s or (3.0 if args.quick else 10.0)
    two_at = args.two_process_at or (256 if args.quick else 1024)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # 4,096 client sockets + the servers'
    if not (MODEL_DIR / "tokenizer.json").exists():
        from prorl_server.dev import tiny_model

        tiny_model.build(MODEL_DIR)
    print(f"server_scale: shout handler, 2 turns x 16 tokens, fake vLLM backend (50 ms + 1 ms/token), levels "
          f"{levels}, window {window:g} s, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start",
          flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="prorl-scale-"))
    port_file = tmp / "backend.port"
    backend = subprocess.Popen([sys.executable, "-m", "prorl_server.dev.timed_llm", "--model-dir", str(MODEL_DIR),
                                "--turn-s", "0.050", "--per-token-s", "0.001", "--port-file", str(port_file)],
                               cwd=str(ROOT))  # the stand-in for vLLM
    results: dict[str, dict[str, Any]] = {}
    try:
        while not port_file.exists():
            if backend.poll() is not None:
                raise RuntimeError("the fake backend did not start")
            await asyncio.sleep(0.05)
        backend_url = f"http://127.0.0.1:{json.loads(port_file.read_text())['port']}"
        with contextlib.ExitStack() as stack:
            versions = [("ours", ROOT)]
            if not args.no_floor:
                versions.append(("floor", ROOT))
            if not args.no_baseline:
                versions.insert(0, ("baseline", stack.enter_context(baseline_tree(args.baseline_ref))))
            rows: list[tuple[str, dict]] = []
            for c in levels:
                for name, root in versions:
                    r = await measure(root, backend_url, backend.pid, c, 1, window, tmp, name,
                                      tuple(args.ours_args.split()) if name == "ours" else (), args.repeat)
                    results.setdefault(name, {})[str(c)] = r
                    rows.append((f"{name} {c}", r))
                    print_rows([rows[-1]], header=len(rows) == 1)
                    gens = ", ".join(f"gen{g} {n} x {1000 * t / n if n else 0:.1f} ms"
                                     for g, (n, t) in enumerate(r["gc_by_generation"]))
                    adm = ", ".join(f"limit {lim:.0f} jobs, {w:.0f} waiting" for lim, w in r["admission"]
                                    if lim is not None)
                    print(f"{'':>16}  collections: {gens}; longest {r['gc_pause_max_ms']:.0f} ms CPU; load average "
                          f"{r['load_average']:.1f}" + (f"; admission at the end: {adm}" if adm else "")
                          + (f"; failures: {r['failures']}" if r["failures"] else ""), flush=True)
            if not args.no_two_process:
                for name, root in [v for v in versions if v[0] != "floor"]:
                    r = await measure(root, backend_url, backend.pid, two_at, 2, window, tmp, name,
                                      tuple(args.ours_args.split()) if name == "ours" else (), args.repeat)
                    results[name][f"{two_at}x2"] = r
                    rows.append((f"{name} {two_at}x2p", r))
                    print_rows([rows[-1]], header=False)
            print()
            print("Side by side:")
            print_rows(rows)
            if "baseline" in results:
                print("\nRatios ours / baseline (jobs/s; CPU per turn; stall p99) and errors (baseline -> ours):")
                for c in levels:
                    b, o = results["baseline"][str(c)], results["ours"][str(c)]
                    print(f"  {c:>5} in flight: jobs/s x{o['jobs_per_s'] / max(b['jobs_per_s'], 1e-9):.2f}, "
                          f"cpu/turn x{o['cpu_ms_per_turn'] / b['cpu_ms_per_turn']:.2f}, stall p99 "
                          f"{b['stall_ms_p99']:.0f} -> {o['stall_ms_p99']:.0f} ms, gc share "
                          f"{b['gc_share_of_cpu']:.0%} -> {o['gc_share_of_cpu']:.0%}, connection errors "
                          f"{b['connection_errors']} -> {o['connection_errors']}, failed {b['failed_jobs']} -> "
                          f"{o['failed_jobs']}")
    finally:
        backend.terminate()
        backend.wait()
    summary: dict[str, Any] = {}
    for name, per in results.items():
        for key, r in per.items():
            summary[f"{name}_{key}"] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                                        if k in ("jobs_per_s", "of_ideal", "cpu_ms_per_turn", "added_ms_p50",
                                                 "added_ms_p99", "stall_ms_p99", "stall_ms_max", "gc_s",
                                                 "rss_mb", "connection_errors", "failed_jobs")}
    for name, per in results.items():
        if f"{two_at}x2" in per and str(two_at) in per:
            summary[f"{name}_two_process_ratio"] = round(per[f"{two_at}x2"]["jobs_per_s"] /
                                                         per[str(two_at)]["jobs_per_s"], 3)
    if "baseline" in results:
        for c in levels:
            b, o = results["baseline"][str(c)], results["ours"][str(c)]
            summary[f"jobs_per_s_ratio_{c}"] = round(o["jobs_per_s"] / b["jobs_per_s"], 3) if b["jobs_per_s"] else None
            summary[f"cpu_per_turn_ratio_{c}"] = round(o["cpu_ms_per_turn"] / b["cpu_ms_per_turn"], 3)
    ours = [results["ours"][str(c)]["cpu_ms_per_turn"] for c in levels]
    summary["ours_cpu_ms_per_turn_spread"] = round(max(ours) / min(ours) - 1, 3)
    if "floor" in results:  # what this tree spends per turn beyond aiohttp's own HTTP work
        for c in levels:
            summary[f"ours_above_floor_cpu_ms_per_turn_{c}"] = round(
                results["ours"][str(c)]["cpu_ms_per_turn"] - results["floor"][str(c)]["cpu_ms_per_turn"], 3)
    print(f"load average at end {os.getloadavg()[0]:.2f}")
    print(json.dumps(summary))


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "--_floor":
        floor_server_main(sys.argv[2], sys.argv[3])
    elif len(sys.argv) > 3 and sys.argv[1] == "--_probe":
        probe_main(sys.argv[2], sys.argv[4:])
    else:
        ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
        ap.add_argument("--quick", action="store_true", help="CI-sized: levels 32 and 256, 3 s windows")
        ap.add_argument("--levels", type=int, nargs="+", help="jobs in flight (default 32 256 1024 4096)")
        ap.add_argument("--window-s", type=float, help="measured seconds per level (default 10; quick 3)")
        ap.add_argument("--baseline-ref", default=DEFAULT_BASELINE_REF, help="git ref of the baseline")
        ap.add_argument("--no-baseline", action="store_true", help="measure this tree only")
        ap.add_argument("--no-two-process", action="store_true", help="skip the two-process run")
        ap.add_argument("--no-floor", action="store_true", help="skip the HTTP floor (aiohttp alone) rows")
        ap.add_argument("--two-process-at", type=int, help="jobs in flight of the two-process run (default 1024)")
        ap.add_argument("--repeat", type=int, default=1, help="runs per level (fresh servers each); the median "
                        "of each figure is printed (a shared machine's noise)")
        ap.add_argument("--ours-args", default="", help="extra prorl-server flags for this tree's servers (e.g. "
                        "'--no-gc-freeze --gc-gen0-threshold 700' to see what each setting buys)")
        sys.path.insert(0, str(ROOT))
        import uvloop

        uvloop.run(main(ap.parse_args()))
