"""A fleet of rollout servers under 4,096 concurrent multi-turn sessions from one trainer-side client, with one
server SIGKILLed and one joining mid-run (issue #24, item 6): the fleet (``--fleet-dir``, the client following a
:class:`trainer_plugins.fleet.Fleet`) and the launcher's old way (a ``servers.json`` written once, read once)
side by side, the same load and the same kill and join.

The LLM is a **fake OpenAI-compatible completions backend standing for vLLM on a GPU**
(``prorl_server.dev.timed_llm``, its own process): every ``POST /v1/completions`` answers 8 token ids of
the tiny test model after ``--turn-s`` seconds (default 8 s, a GPU turn of a few hundred tokens under load), so
a session of ``--turns`` model turns (the ``shout`` handler, no sandbox) ideally takes ``turns x turn_s``
seconds, and the ideal rate is ``sessions / (turns x turn_s)`` jobs/s. The rollout servers are real
``python -m prorl_server`` processes (``--servers`` of them, each with enough workers for every session); the
client is this process: one :class:`trainer_plugins.jobs.JobSubmitter` and ``--sessions`` asyncio tasks, each
running one sample after another through ``JobSubmitter.run`` (closed loop: a session's next job starts when
its last one is delivered).

Phases, per side: one job on each server (its first job loads the tokenizer), warm-up (until every session
has had its first job; sessions start spread over one session length), a measured window of
``--window-s`` seconds, then the fault: server 0 gets SIGKILL (``--fault stop``: SIGSTOP, standing for a node
lost: no TCP reset, requests on it hang) and a new server is started (the joiner), the
load goes on for ``--fault-s`` seconds, then every session finishes the job it holds and stops. Printed:

- jobs/s in the window against the ideal;
- client-observed added latency per job, p50 / p99 (job time - turns x turn_s), jobs delivered in the window;
- server CPU per 1,000 turns (user+system of every server process over the window / turns done);
- the coordinator's own CPU per 1,000 sessions (user+system of this process: the client, its event loop and
  the fleet's reading thread, over the window / jobs delivered);
- the fault: jobs lost (a sample that ended filtered after its retries, or raised: must be 0), delivered twice
  (a sample with two delivered results: must be 0), attempts sent to the killed server after the kill, time
  until the killed server is out of the client's rotation, time from the joiner's ready file to its first job,
  jobs the joiner ran, and sessions still running ``2 x session length`` after the stop (a stall).

The machine this was written on has 2 cores shared with other work: ``--turn-s`` is chosen so the servers, the
fake LLM and the client together fit in them (about 500 turns/s at the defaults); at shorter turns the CPUs,
not the design, set the rate. Wall time at the defaults: about 4 minutes for both sides.

Usage: python benchmarks/fleet_scale.py [--sessions 4096] [--servers 4] [--turn-s 8] [--turns 2]
       [--window-s 24] [--fault-s 18] [--only fleet|static] [--fleet-first]
       [--fault kill|stop] [--quick]
The last line printed is one summary line.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from server_scale import cpu_seconds  # noqa: E402  (run as a script: the benchmarks folder is on sys.path)

from prorl_server.stats import percentile  # noqa: E402
from trainer_plugins.admission import LeastInFlight  # noqa: E402
from trainer_plugins.fleet import Fleet  # noqa: E402
from trainer_plugins.jobs import JobSubmitter, process_request  # noqa: E402
from trainer_plugins.servers import ServerEntry, load_servers, write_servers  # noqa: E402

MODEL_DIR = ROOT / ".cache" / "tiny-model"


def raise_nofile() -> None:
    """Soft open-files limit to the hard one (inherited by the children): 4,096 sessions are ~8,000 sockets."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class Proc:
    """A child process in its own session, with a ready/port file."""

    def __init__(self, argv: list[str], ready: Path, log: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
        env.pop("PRORL_TOKEN", None)
        self.ready, self.log = ready, log
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.ready_at = 0.0

    async def wait_ready(self, timeout_s: float = 90.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while not self.ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.proc.args[:3]} did not start: {self.log.read_text()[-2000:]}")
            await asyncio.sleep(0.02)
        self.ready_at = time.monotonic()
        return json.loads(self.ready.read_text())

    def cpu(self) -> float:
        try:
            return cpu_seconds(self.proc.pid)
        except (OSError, IndexError):
            return 0.0

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def start_server(tmp: Path, name: str, backend: str, workers: int, fleet_dir: Optional[Path]) -> Proc:
    ready = tmp / f"{name}.ready.json"
    argv = [sys.executable, "-m", "prorl_server", "--port", "0", "--ready-file", str(ready), "--backend", backend,
            "--sandbox-runtime", "none", "--journal", "off", "--log-level", "WARNING", "--init-workers",
            str(workers), "--run-workers", str(workers), "--eval-workers", str(workers)]
    if fleet_dir is not None:
        argv += ["--fleet-dir", str(fleet_dir)]
    return Proc(argv, ready, tmp / f"{name}.log")


class Recording(LeastInFlight):
    """The default chooser, recording ``(monotonic time, server)`` of every attempt it sends."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[float, str]] = []

    def started(self, server, group_id=None):
        self.sent.append((time.monotonic(), server))
        super().started(server, group_id)


def pct(xs: list[float], q: float) -> float:
    """The project's one percentile (nearest rank; ``q`` from 0 to 1 here); NaN for no data."""
    return percentile(xs, 100 * q) if xs else float("nan")


async def prime(jobs: JobSubmitter, urls: list[str]) -> None:
    """One job on each server before the load: a server's first job loads the model's tokenizer (~6 s here),
    which is start-up, not steady state."""
    await asyncio.gather(*(jobs.submit(u, process_request(
        {"data_source": "shout", "instance_id": "prime", "prompt": "Say something about the sea."},
        {"max_tokens": 8}, job_id=f"prime-{i}")) for i, u in enumerate(urls)))


async def run_side(mode: str, args, backend: str, llm: Proc, tmp: Path) -> dict:
    """One side (``fleet`` or ``static``): start the servers, run the load with the kill and the join, stop."""
    fleet_dir = tmp / f"{mode}-fleet" if mode == "fleet" else None
    session_s = args.turns * args.turn_s
    workers = args.sessions  # each server can hold every session: the workers never bound the rate
    servers = [start_server(tmp, f"{mode}-s{i}", backend, workers, fleet_dir) for i in range(args.servers)]
    urls = [(await s.wait_ready())["url"] for s in servers]
    fleet: Optional[Fleet] = None
    if mode == "fleet":
        fleet = Fleet(fleet_dir)
        deadline = time.monotonic() + 30
        while len(fleet) < args.servers and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        pool = fleet
    else:  # the launcher's old way: servers.json written once every server answers, read once by the trainer
        path = write_servers(tmp / "servers.json", "bench", None,
                             [ServerEntry(url=u, node="local", host="127.0.0.1", port=int(u.rsplit(":", 1)[1]))
                              for u in urls])
        pool = load_servers(path).urls()
    chooser = Recording()
    delivered: list[tuple[float, float, str, object]] = []  # (start, end, sample id, outcome)
    lost: list[str] = []
    stop = asyncio.Event()
    running = [0]

    async def session(i: int, jobs: JobSubmitter) -> None:
        n = 0
        running[0] += 1
        # starts spread over one session length: a training run's sessions are not in lockstep, so jobs start
        # and end at a steady rate (in lockstep they would come in waves, and a joiner would wait for the next)
        await asyncio.sleep(session_s * i / args.sessions)
        try:
            while not stop.is_set():
                sample = f"s{i}-{n}"
                req = process_request({"data_source": "shout", "instance_id": sample, "turns": args.turns,
                                       "prompt": "Say something about the sea."}, {"max_tokens": 8})
                t0 = time.monotonic()
                try:
                    out = await jobs.run(pool, req, chooser=chooser, job_prefix=sample, max_sample_retries=2)
                except Exception as e:  # noqa: BLE001 - counted: a lost job
                    lost.append(f"{sample}: {e!r}")
                else:
                    if out.filtered:
                        lost.append(f"{sample}: {out.result.failure_kind}: {out.result.error}")
                    else:
                        delivered.append((t0, time.monotonic(), sample, out))
                n += 1
        finally:
            running[0] -= 1

    print(f"[{mode}] {args.servers} servers ready; {args.sessions} sessions of {args.turns} turns x "
          f"{args.turn_s:g} s (ideal {args.sessions / session_s:.0f} jobs/s)", flush=True)
    jobs = JobSubmitter(fleet=fleet, unavailable_retry_s=30.0)
    await prime(jobs, urls)
    t_start = time.monotonic()
    tasks = [asyncio.create_task(session(i, jobs)) for i in range(args.sessions)]
    while len(delivered) + len(lost) < args.sessions:  # warm-up: every session has had its first job
        await asyncio.sleep(0.1)
    w0, cpu_s0, cpu_c0, cpu_l0 = time.monotonic(), sum(s.cpu() for s in servers), time.process_time(), llm.cpu()
    n0 = len(delivered)
    await asyncio.sleep(args.window_s)
    w1, cpu_s1, cpu_c1, cpu_l1 = time.monotonic(), sum(s.cpu() for s in servers), time.process_time(), llm.cpu()
    window = [d for d in delivered[n0:] if w0 <= d[1] <= w1]
    added = [(end - start) - session_s for start, end, _, _ in window]

    # the fault: server 0 dies (SIGKILL; or SIGSTOP, a node lost: no TCP reset, its sockets hang), a joiner starts
    killed = urls[0]
    if args.fault == "kill":
        servers[0].kill()
    else:
        os.killpg(servers[0].proc.pid, signal.SIGSTOP)
    t_kill = time.monotonic()
    out_after: list[float] = []

    async def watch_out() -> None:
        while fleet is not None and killed in fleet:
            await asyncio.sleep(0.01)
        if fleet is not None:
            out_after.append(time.monotonic() - t_kill)

    watcher = asyncio.create_task(watch_out())
    joiner = start_server(tmp, f"{mode}-joiner", backend, workers, fleet_dir)
    t_join = time.monotonic()
    joiner_url = (await joiner.wait_ready())["url"]
    await asyncio.sleep(max(0.0, t_kill + args.fault_s - time.monotonic()))
    watcher.cancel()
    stop.set()
    t_stop = time.monotonic()
    done, pending = await asyncio.wait(tasks, timeout=2 * session_s + 30)
    stalled = len(pending)
    for t in pending:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await jobs.close()
    if fleet is not None:
        fleet.close()
    for s in [*servers, joiner]:
        s.kill()

    samples = [d[2] for d in delivered]
    to_joiner = [t for t, s in chooser.sent if s == joiner_url]
    res = {
        "mode": mode,
        "jobs_s": len(window) / (w1 - w0),
        "ideal_jobs_s": args.sessions / session_s,
        "added_p50_s": pct(added, 0.50),
        "added_p99_s": pct(added, 0.99),
        "window_jobs": len(window),
        "server_cpu_per_1k_turns_s": (cpu_s1 - cpu_s0) / max(1, len(window) * args.turns) * 1000,
        "client_cpu_per_1k_sessions_s": (cpu_c1 - cpu_c0) / max(1, len(window)) * 1000,
        # cores busy in the window: servers, client, the fake LLM (what the machine's cores must hold)
        "cores_servers": (cpu_s1 - cpu_s0) / (w1 - w0), "cores_client": (cpu_c1 - cpu_c0) / (w1 - w0),
        "cores_fake_llm": (cpu_l1 - cpu_l0) / (w1 - w0),
        "jobs_lost": len(lost),
        "delivered_twice": len(samples) - len(set(samples)),
        "sent_to_killed_after_kill": sum(1 for t, s in chooser.sent if s == killed and t > t_kill + 0.5),
        "killed_out_s": out_after[0] if out_after else None,
        # from the joiner's start: its record is written as it starts listening, which can be before this
        # process sees its ready file (polled every 20 ms), so "after ready" alone can read negative
        "joiner_ready_s": joiner.ready_at - t_join,
        "joiner_first_job_s": (min(to_joiner) - t_join) if to_joiner else None,
        "joiner_jobs": sum(1 for d in delivered if d[3].server == joiner_url),
        "moved_jobs": sum(1 for d in delivered if any(a.server == killed for a in d[3].attempts)),
        "stalled_sessions": stalled,
        "delivered": len(delivered),
        "wall_s": time.monotonic() - t_start,
        "stop_s": time.monotonic() - t_stop,
        "lost_examples": lost[:3],
    }
    return res


def fmt(v, unit: str = "", nd: int = 2) -> str:
    if v is None:
        return "never"
    if isinstance(v, float):
        return "n/a" if v != v else f"{v:.{nd}f}{unit}"
    return f"{v}{unit}"


async def main_async(args) -> None:
    raise_nofile()
    tmp = Path(tempfile.mkdtemp(prefix="fleet-scale-"))
    port_file = tmp / "llm.port.json"
    llm = Proc([sys.executable, "-m", "prorl_server.dev.timed_llm", "--model-dir", str(MODEL_DIR),  # stands for vLLM
                "--turn-s", str(args.turn_s), "--tokens", "8", "--port-file", str(port_file)], port_file,
               tmp / "llm.log")
    backend = f"http://127.0.0.1:{(await llm.wait_ready())['port']}"
    results = []
    try:
        order = ["fleet", "static"] if args.fleet_first else ["static", "fleet"]
        for mode in (order if args.only is None else [args.only]):
            results.append(await run_side(mode, args, backend, llm, tmp))
            r = results[-1]
            print(f"[{mode}] " + json.dumps({k: (round(v, 4) if isinstance(v, float) else v)
                                             for k, v in r.items()}), flush=True)
    finally:
        llm.kill()
    rows = [("jobs/s (ideal)", lambda r: f"{r['jobs_s']:.1f} ({r['ideal_jobs_s']:.1f})"),
            ("added latency p50 / p99", lambda r: f"{fmt(r['added_p50_s'], ' s')} / {fmt(r['added_p99_s'], ' s')}"),
            ("server CPU / 1k turns", lambda r: fmt(r["server_cpu_per_1k_turns_s"], " s")),
            ("client CPU / 1k sessions", lambda r: fmt(r["client_cpu_per_1k_sessions_s"], " s")),
            ("cores: srv/client/LLM", lambda r: f"{r['cores_servers']:.2f}/{r['cores_client']:.2f}/"
                                                 f"{r['cores_fake_llm']:.2f}"),
            ("jobs lost", lambda r: fmt(r["jobs_lost"])),
            ("delivered twice", lambda r: fmt(r["delivered_twice"])),
            ("jobs moved off killed", lambda r: fmt(r["moved_jobs"])),
            ("sent to killed after", lambda r: fmt(r["sent_to_killed_after_kill"])),
            ("killed out of rotation", lambda r: fmt(r["killed_out_s"], " s") if r["mode"] == "fleet" else "never"),
            ("joiner ready / 1st job", lambda r: f"{fmt(r['joiner_ready_s'], ' s')} / "
                                                  f"{fmt(r['joiner_first_job_s'], ' s')} after start"),
            ("joiner's jobs", lambda r: fmt(r["joiner_jobs"])),
            ("stalled sessions", lambda r: fmt(r["stalled_sessions"]))]
    print(f"\n{'':26}" + "".join(f"{r['mode']:>28}" for r in results))
    for name, f in rows:
        print(f"{name:26}" + "".join(f"{f(r):>28}" for r in results))
    by = {r["mode"]: r for r in results}
    load = os.getloadavg()[0]
    f = by.get("fleet")
    s = by.get("static")
    fault = "SIGKILL" if args.fault == "kill" else "SIGSTOP"
    parts = [f"fleet_scale ({fault}): {args.sessions} sessions x {args.turns} turns x {args.turn_s:g} s on "
             f"{args.servers} servers (load {load:.1f})"]
    if f:
        parts.append(f"fleet {f['jobs_s']:.0f}/{f['ideal_jobs_s']:.0f} jobs/s, added p50/p99 "
                     f"{f['added_p50_s']:.2f}/{f['added_p99_s']:.2f} s, server {f['server_cpu_per_1k_turns_s']:.2f} "
                     f"CPU-s/1k turns, client {f['client_cpu_per_1k_sessions_s']:.2f} CPU-s/1k sessions, fault: "
                     f"lost {f['jobs_lost']} twice {f['delivered_twice']} out in {fmt(f['killed_out_s'], ' s')}, "
                     f"joiner first job {fmt(f['joiner_first_job_s'], ' s')} after start (ready at "
                     f"{fmt(f['joiner_ready_s'], ' s')})")
    if s:
        parts.append(f"static servers.json: lost {s['jobs_lost']}, {s['sent_to_killed_after_kill']} attempts to "
                     f"the dead server, {s['stalled_sessions']} sessions stalled, joiner {s['joiner_jobs']} jobs")
    print("; ".join(parts))


def main() -> None:
    import logging

    # one warning per re-submitted job would bury the table (the counts are in it)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("trainer_plugins.jobs").setLevel(logging.ERROR)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=4096)
    p.add_argument("--servers", type=int, default=4)
    p.add_argument("--turn-s", type=float, default=8.0, help="seconds the fake backend takes per turn")
    p.add_argument("--turns", type=int, default=2, help="model turns per session (2-8)")
    p.add_argument("--window-s", type=float, default=24.0)
    p.add_argument("--fault-s", type=float, default=18.0)
    p.add_argument("--only", choices=["fleet", "static"])
    p.add_argument("--fleet-first", action="store_true",
                   help="run the fleet side first (on a shared machine, to see whether a difference follows the order)")
    p.add_argument("--fault", choices=["kill", "stop"], default="kill",
                   help="kill: SIGKILL server 0 (its connections reset); stop: SIGSTOP it, standing for a node lost "
                        "(no reset: requests on it hang)")
    p.add_argument("--quick", action="store_true", help="256 sessions, 2 servers, 2 s turns, short phases")
    args = p.parse_args()
    if args.quick:
        args.sessions, args.servers, args.turn_s, args.window_s, args.fault_s = 256, 2, 2.0, 8.0, 8.0
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
