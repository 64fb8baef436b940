"""Fault benchmark: does any fault lose a job, hang one, or leave a process or a sandbox directory
behind?

Phase 1: ``--arith-jobs`` (10,000) ``arithmetic`` jobs through ``POST /process`` at ``--arith-concurrency``
(256) against a server process: lost jobs (no well-formed result) and the server's RSS growth per 1000 jobs
(least-squares slope of RSS sampled every 1000 results, the first 1000 left out as warm-up).

Phase 2: bubblewrap sandboxes and a real vLLM CPU backend (the tiny model, ``prorl_server/dev/tiny_model.py``):
for each scenario ``--code-jobs`` (64) ``code`` jobs (HumanEval) at ``--code-concurrency`` (32), with a fault
injected once a quarter of them have ended:

- ``backend_kill``: the vLLM server's process group is SIGKILLed and started again on the same port;
- ``sandbox_kill``: the process tree of a sandbox running a command (5 levels: launcher, the namespace's pid 1,
  the execution server, its shell, the command) is SIGKILLed, ``--sandbox-kills`` times, spaced out;
- ``server_sigterm``: the server gets SIGTERM; a new one is started on the same state directory;
- ``server_sigkill``: the server gets SIGKILL; a new one is started on the same state directory.

The server always runs as a subprocess (``python -m prorl_server --ready-file ...``), so the signals are real.
Clients behave like the trainer's: a request cut by a dying server (connection error, 503) is sent again (same
``job_id``) once a server answers; every result is kept as it came.

Per scenario: ``well_formed`` (jobs whose final answer is a complete job result for that job id), ``lost``
(jobs without one), ``hung`` (a request unanswered past the job's ``timeout_s`` + 120 s), ``resent``
(requests cut by the fault and sent again), ``orphans`` (processes still alive 10 s after the scenario's last
job ended that belong to a dead server's tree, or that are sandbox processes of the live server: its
descendants in another session than its own; this process is a child subreaper, so everything a dying server
leaves behind is re-parented here and found by the process tree, never by name), ``leftover_dirs`` (run
directories, ownership records and workspaces still present in the state and workspace directories at that
time), the results' ``failure_kind`` counts and, for the server faults, how long the server took to exit.

Usage: python benchmarks/faults.py [--arith-jobs 10000] [--arith-concurrency 256] [--code-jobs 64]
       [--code-concurrency 32] [--scenarios backend_kill sandbox_kill server_sigterm server_sigkill]
The last line is one JSON object: {"arith": {...}, "code": {scenario: {...}}, "targets_met": bool}.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCENARIOS = ("backend_kill", "sandbox_kill", "server_sigterm", "server_sigkill")
RESULT_KEYS = {"job_id", "reward", "critical_error", "failure_kind", "filter", "trajectories", "timing", "messages"}
CRITICAL = {None, "init", "run", "eval", "timeout", "cancelled"}
HANG_MARGIN_S = 120.0
ORPHAN_WAIT_S = 10.0
PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Orphans of our descendants (a SIGKILLed server's sandboxes, its pool workers) are re-parented to this
    process instead of init, so they stay findable by the process tree."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def well_formed(res: Any, job_id: str) -> bool:
    """A complete job result for ``job_id`` (the wire contract's keys and types)."""
    return (isinstance(res, dict) and RESULT_KEYS <= res.keys() and res["job_id"] == job_id
            and isinstance(res["reward"], (int, float)) and res["critical_error"] in CRITICAL
            and isinstance(res["filter"], bool) and isinstance(res["trajectories"], list)
            and isinstance(res["timing"], dict) and "counted_s" in res["timing"])


class Server:
    """``python -m prorl_server`` as a subprocess of this one, found through its ready file."""

    def __init__(self, workdir: Path, config: dict[str, Any], name: str, tmpdir: Optional[Path] = None) -> None:
        self.workdir, self.config, self.name = workdir, config, name
        self.env = dict(os.environ, **({"TMPDIR": str(tmpdir)} if tmpdir else {}))
        self.proc: Optional[subprocess.Popen] = None
        self.url: Optional[str] = None
        self.gen = 0

    def start(self) -> None:
        self.gen += 1
        cfg = self.workdir / f"{self.name}.yaml"
        ready = self.workdir / f"{self.name}-{self.gen}.ready.json"
        cfg.write_text(json.dumps({**self.config, "port": 0, "ready_file": str(ready)}))  # JSON is YAML
        log = open(self.workdir / f"{self.name}-{self.gen}.log", "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "prorl_server", "--config", str(cfg)], cwd=str(ROOT),
                                     stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env)
        log.close()
        deadline = time.monotonic() + 300
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start (rc {self.proc.returncode}):\n{self.log_tail()}")
            time.sleep(0.05)
        time.sleep(0.05)  # the file is written whole by the server; a reader racing a partial write retries
        self.url = json.loads(ready.read_text())["url"]

    def log_tail(self, n: int = 3000) -> str:
        p = self.workdir / f"{self.name}-{self.gen}.log"
        return p.read_text(errors="replace")[-n:] if p.exists() else ""

    def signal_and_wait(self, sig: int, timeout_s: float = 120.0) -> Optional[float]:
        """Send ``sig``; seconds until the process exited (None: still alive after ``timeout_s``, then killed)."""
        assert self.proc is not None
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        self.url = None
        try:
            self.proc.wait(timeout_s)
            return round(time.monotonic() - t0, 2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None


def reap_zombies(own_children: set[int]) -> None:
    """Reap re-parented descendants that exited (never our own Popen children: Popen waits for those)."""
    for p in psutil.Process().children():
        if p.pid in own_children:
            continue
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(p.pid, os.WNOHANG)
        except (psutil.NoSuchProcess, ChildProcessError):
            pass


def orphans(server: Server, vllm_pgids: set[int], own_children: set[int]) -> list[dict[str, Any]]:
    """Processes under this one that are neither vLLM's (its process groups) nor the live server nor the live
    server's own workers (descendants in its session): a dead server's leftovers and live sandboxes."""
    reap_zombies(own_children)
    live = server.pid
    live_sid = os.getsid(live) if live else None
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.pid == live or os.getpgid(p.pid) in vllm_pgids or p.status() == psutil.STATUS_ZOMBIE:
                continue
            under_live = live is not None and any(a.pid == live for a in p.parents())
            if under_live and os.getsid(p.pid) == live_sid:
                continue  # the live server's own workers (CPU pool): not a sandbox
            out.append({"pid": p.pid, "ppid": p.ppid(), "cmd": " ".join(p.cmdline())[:160],
                        "under_live_server": under_live})
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
    return out


def leftover_dirs(state_dir: Path, workspace_root: Path) -> list[str]:
    out = []
    for sub, pattern in (("run", "*"), ("sandboxes", "*.json")):
        out += [str(p) for p in (state_dir / sub).glob(pattern)]
    out += [str(p) for p in workspace_root.glob("*")]
    return out


def sandbox_trees(server_pid: int) -> list[list[psutil.Process]]:
    """Each sandbox of the live server as [launcher, *its descendants]: the server's children that lead a
    session of their own (launchers are started with ``start_new_session``)."""
    out = []
    try:
        srv = psutil.Process(server_pid)
        sid = os.getsid(server_pid)
        for c in srv.children():
            try:
                if os.getsid(c.pid) != sid:
                    out.append([c, *c.children(recursive=True)])
            except (psutil.NoSuchProcess, ProcessLookupError):
                continue
    except psutil.NoSuchProcess:
        pass
    return out


def depth_of(p: psutil.Process, root: int) -> int:
    """Levels from ``root`` down to ``p`` (1: ``p`` is the root)."""
    d = 1
    while p is not None and p.pid != root:
        p, d = p.parent(), d + 1
    return d if p is not None else 0


def depth(tree: list[psutil.Process]) -> int:
    """Levels of processes under the tree's root (1: the root alone)."""
    root = tree[0].pid
    levels = {root: 1}
    best = 1
    for p in tree[1:]:
        try:
            chain, q = [], p
            while q is not None and q.pid not in levels:
                chain.append(q)
                q = q.parent()
            if q is None:
                continue
            d = levels[q.pid]
            for x in reversed(chain):
                d += 1
                levels[x.pid] = d
            best = max(best, d)
        except psutil.NoSuchProcess:
            continue
    return best


async def run_jobs(server: Server, bodies: list[dict[str, Any]], concurrency: int, on_done=None) -> dict[str, Any]:
    """Send every body through ``POST /process`` (``concurrency`` at a time). A request cut by the server
    (connection error, 503 while stopping) is sent again once a server answers; a request unanswered past
    its ``timeout_s`` + HANG_MARGIN_S is hung (not sent again)."""
    results: dict[str, Any] = {}
    hung: list[str] = []
    resent = 0
    queue = collections.deque(bodies)

    async def one(http: aiohttp.ClientSession, body: dict[str, Any]) -> None:
        nonlocal resent
        job_id = body["job_id"]
        limit = body.get("timeout_s", 60) + HANG_MARGIN_S
        deadline = time.monotonic() + limit + 600  # room for a server restart
        while True:
            url = server.url
            if url is None:  # between a dying server and its successor
                if time.monotonic() > deadline:
                    results[job_id] = {"lost": "no server answered in time"}
                    return
                await asyncio.sleep(0.2)
                continue
            try:
                async with http.post(f"{url}/process", json=body,
                                     timeout=aiohttp.ClientTimeout(total=limit)) as r:
                    if r.status == 503:
                        raise aiohttp.ClientConnectionError("503")
                    if r.status == 409:  # this job id is in flight on this server (a resend raced it)
                        res = await poll(http, url, job_id, limit)
                    else:
                        res = await r.json(content_type=None)
                results[job_id] = res
                if on_done is not None:
                    on_done(res)
                return
            except asyncio.TimeoutError:
                hung.append(job_id)
                return
            except (aiohttp.ClientError, json.JSONDecodeError):
                if time.monotonic() > deadline:
                    results[job_id] = {"lost": "connection kept failing"}
                    return
                resent += 1
                await asyncio.sleep(0.5)

    async def poll(http, url, job_id, limit) -> dict[str, Any]:
        t_end = time.monotonic() + limit
        while time.monotonic() < t_end:
            async with http.get(f"{url}/jobs/{job_id}") as r:
                data = await r.json(content_type=None)
                if data.get("state") == "done":
                    return data["result"]
            await asyncio.sleep(0.5)
        raise asyncio.TimeoutError

    async def worker(http) -> None:
        while queue:
            await one(http, queue.popleft())

    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    ok = sum(1 for b in bodies if well_formed(results.get(b["job_id"]), b["job_id"]))
    kinds = collections.Counter(str(r.get("failure_kind")) for r in results.values() if isinstance(r, dict)
                                and "lost" not in r)
    return {"jobs": len(bodies), "well_formed": ok, "lost": len(bodies) - ok - len(hung), "hung": len(hung),
            "resent": resent, "failure_kinds": dict(kinds),
            "rewarded": sum(1 for r in results.values() if isinstance(r, dict) and r.get("reward") == 1.0)}


async def arith_phase(args, work: Path, own: set[int]) -> dict[str, Any]:
    from handlers.arithmetic import load_dataset

    config = {"log_level": "WARNING", "init_workers": 64, "run_workers": 64, "eval_workers": 64}
    if args.arith_keep_finished is not None:
        config["keep_finished"] = args.arith_keep_finished
    server = Server(work, config, "arith")
    server.start()
    own.add(server.proc.pid)
    proc = psutil.Process(server.proc.pid)
    instances = load_dataset(limit=1000)
    bodies = [{"job_id": f"a{i}", "instance": instances[i % len(instances)], "timeout_s": 60}
              for i in range(args.arith_jobs)]
    rss: list[tuple[int, float]] = [(0, proc.memory_info().rss / 2**20)]
    done = 0

    def on_done(_res) -> None:
        nonlocal done
        done += 1
        if done % 1000 == 0:
            rss.append((done, proc.memory_info().rss / 2**20))

    t0 = time.monotonic()
    out = await run_jobs(server, bodies, args.arith_concurrency, on_done)
    out["wall_s"] = round(time.monotonic() - t0, 1)
    out["jobs_per_s"] = round(len(bodies) / out["wall_s"], 1)
    pts = [p for p in rss if p[0] >= 1000]
    if len(pts) >= 2:
        mx = sum(x for x, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        out["rss_growth_mib_per_1000_jobs"] = round(slope * 1000, 3)
    out["rss_mib"] = {str(k): round(v, 1) for k, v in rss}
    out["server_exit_s_after_sigterm"] = server.signal_and_wait(signal.SIGTERM)
    await asyncio.sleep(ORPHAN_WAIT_S)
    left = orphans(server, set(), own)
    out["orphans"] = len(left)
    if left:
        out["orphan_list"] = left[:10]
    print(f"arith: {json.dumps(out)}", flush=True)
    return out


class Backend:
    """The tiny model on vLLM CPU, restartable on its port."""

    def __init__(self, work: Path) -> None:
        from prorl_server.dev.tiny_model import build

        self.model = build(ROOT / ".cache" / "tiny-model")
        self.log_dir = work
        self.server = None
        self.pgids: set[int] = set()
        self.port: Optional[int] = None

    def start(self) -> float:
        from prorl_server.dev.vllm_launcher import start_vllm

        t0 = time.monotonic()
        self.server = start_vllm(self.model, port=self.port, max_model_len=4096, max_num_batched_tokens=4096,
                                 log_path=self.log_dir / f"vllm-{len(self.pgids)}.log")
        self.pgids.add(self.server.pid)  # start_new_session: the leader's pid is the group id
        self.port = int(self.server.address.rsplit(":", 1)[1])
        return round(time.monotonic() - t0, 1)

    def sigkill(self) -> None:
        try:
            os.killpg(self.server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.server.proc.wait()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


async def code_scenario(name: str, args, work: Path, backend: Backend, own: set[int]) -> dict[str, Any]:
    from handlers.code.data import load_dataset

    state_dir, ws_root, tmp = work / f"state-{name}", work / f"ws-{name}", work / f"tmp-{name}"
    ws_root.mkdir()
    tmp.mkdir()  # the servers' TMPDIR: host-side files of the handlers (grading directories) land here
    c = args.code_concurrency
    server = Server(work, {"log_level": "WARNING", "backends": [backend.server.address],
                           "sandbox_runtime": "bubblewrap",
                           "sandbox_options": {"state_dir": str(state_dir), "workspace_root": str(ws_root)},
                           "init_workers": c, "run_workers": c, "eval_workers": c, "health_interval_s": 2.0,
                           "backend_wait_s": 30.0}, f"code-{name}", tmpdir=tmp)
    server.start()
    own.add(server.proc.pid)
    problems = load_dataset(limit=args.code_problems)
    bodies = [{"job_id": f"{name}-{i}", "instance": {**problems[i % len(problems)], "max_turns": args.max_turns},
               "sampling_params": {"max_tokens": args.max_tokens, "temperature": 1.0}, "timeout_s": args.job_timeout_s}
              for i in range(args.code_jobs)]
    done = 0
    quarter = asyncio.Event()
    info: dict[str, Any] = {}

    def on_done(_res) -> None:
        nonlocal done
        done += 1
        if done >= max(1, args.code_jobs // 4):
            quarter.set()

    async def inject() -> None:
        await quarter.wait()
        if name == "backend_kill":
            backend.sigkill()
            info["backend_restart_s"] = await asyncio.to_thread(backend.start)
            own.add(backend.server.pid)
            async with aiohttp.ClientSession() as http:  # what a trainer does after restarting a backend
                url = server.url
                if url:
                    async with http.post(f"{url}/add_llm_server", json={"address": backend.server.address}) as r:
                        info["re_add_status"] = r.status
        elif name == "sandbox_kill":
            kills, tries = [], 0
            while len(kills) < args.sandbox_kills and done < args.code_jobs and tries < 20000:
                tries += 1
                # launcher bwrap > bwrap (the namespace's pid 1) > execution server > the tool's shell > a
                # command (a tool call, the grader, the graded program): 5 levels means one is running
                trees = [t for t in sandbox_trees(server.pid) if depth(t) >= 5] if server.pid else []
                if not trees:
                    await asyncio.sleep(0.05)
                    continue
                tree = trees[0]
                try:  # for the report only (which tool or grading process was cut), never to choose
                    what = " ".join(max(tree, key=lambda q: depth_of(q, tree[0].pid)).cmdline())[-120:]
                except psutil.NoSuchProcess:
                    what = "?"
                for p in tree:
                    try:
                        p.send_signal(signal.SIGKILL)
                    except psutil.NoSuchProcess:
                        pass
                kills.append({"processes": len(tree), "at_done": done, "deepest": what})
                await asyncio.sleep(2.0)  # let the pipeline take the fault before the next one
            info["sandbox_trees_killed"] = kills
        else:
            sig = signal.SIGTERM if name == "server_sigterm" else signal.SIGKILL
            old_pid = server.proc.pid
            info["server_exit_s"] = await asyncio.to_thread(server.signal_and_wait, sig)
            info["server_rc"] = server.proc.returncode
            # what the dead server left (its sandboxes, re-parented here): the orphan count below must reach 0
            # from this, so this figure also shows the detector sees them
            info["left_at_server_exit"] = len(orphans(server, backend.pgids, own))
            own.discard(old_pid)
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            await asyncio.to_thread(server.start)  # same config: the same state directory
            own.add(server.proc.pid)
            info["new_server_start_s"] = round(time.monotonic() - t0, 1)
            info["reaped_by_new_server"] = server.log_tail(1 << 20).count("reaped orphan sandbox")

    t0 = time.monotonic()
    fault = asyncio.create_task(inject())
    out = await run_jobs(server, bodies, c, on_done)
    if not fault.done():  # the jobs ended before the fault could be injected (all at once)
        quarter.set()
    await fault
    out["wall_s"] = round(time.monotonic() - t0, 1)
    out.update(info)
    if name == "backend_kill":  # the restarted backend serves again (jobs that ran while it was down failed fast)
        after = await run_jobs(server, [{**b, "job_id": f"{b['job_id']}-after"} for b in bodies[:c]], c)
        out["after_restart"] = {k: after[k] for k in ("jobs", "well_formed", "lost", "hung", "failure_kinds")}
        for k in ("lost", "hung"):
            out[k] += after[k]
    await asyncio.sleep(ORPHAN_WAIT_S)
    left = orphans(server, backend.pgids, own)
    out["orphans"] = len(left)
    if left:
        out["orphan_list"] = left[:10]
    dirs = leftover_dirs(state_dir, ws_root)
    out["leftover_dirs"] = len(dirs)
    if dirs:
        out["leftover_list"] = dirs[:10]
    out["server_exit_s_after_sigterm_end"] = server.signal_and_wait(signal.SIGTERM)
    own.discard(server.proc.pid)
    # what every server of the scenario left in its TMPDIR once the last one has exited
    # torch's compile cache (torchinductor_<user>) is a cache the imports create, not a leftover
    left_tmp = [p for p in tmp.iterdir() if not p.name.startswith("torchinductor_")]
    out["leftover_tmp"] = len(left_tmp)
    if left_tmp:  # kinds, for the report: the name up to its random suffix
        out["leftover_tmp_kinds"] = dict(collections.Counter(p.name.rsplit("-", 1)[0] + "-*" for p in left_tmp))
    print(f"{name}: {json.dumps(out)}", flush=True)
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arith-jobs", type=int, default=10000)
    ap.add_argument("--arith-concurrency", type=int, default=256)
    ap.add_argument("--arith-keep-finished", type=int, default=None,
                    help="the arith server's keep_finished (default: the server's, 10000): a smaller one tells "
                         "retention from a leak")
    ap.add_argument("--code-jobs", type=int, default=64)
    ap.add_argument("--code-concurrency", type=int, default=32)
    ap.add_argument("--code-problems", type=int, default=16, help="HumanEval problems the code jobs cycle over")
    ap.add_argument("--max-turns", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--job-timeout-s", type=float, default=300.0)
    ap.add_argument("--sandbox-kills", type=int, default=3)
    ap.add_argument("--scenarios", nargs="*", default=list(SCENARIOS), choices=SCENARIOS)
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs) for inspection")
    args = ap.parse_args()

    become_subreaper()
    work = Path(tempfile.mkdtemp(prefix="prorl-faults-"))
    own: set[int] = set()
    summary: dict[str, Any] = {"arith": None, "code": {}}
    backend = None
    try:
        if args.arith_jobs:
            summary["arith"] = await arith_phase(args, work, own)
        if args.scenarios and args.code_jobs:
            backend = Backend(work)
            print(f"vLLM ready in {backend.start()} s", flush=True)
            own.add(backend.server.pid)
            for name in args.scenarios:
                summary["code"][name] = await code_scenario(name, args, work, backend, own)
    finally:
        if backend is not None:
            backend.stop()
        time.sleep(1)
        for p in psutil.Process().children(recursive=True):  # cleanup only; counted above
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        reap_zombies(set())
        if args.keep:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    rows = ([summary["arith"]] if summary["arith"] else []) + list(summary["code"].values())
    summary["targets_met"] = all(r["lost"] == 0 and r["hung"] == 0 and r["orphans"] == 0
                                 and r.get("leftover_dirs", 0) == 0 and r.get("leftover_tmp", 0) == 0 for r in rows)
    for r in rows:
        r.pop("orphan_list", None)
        r.pop("leftover_list", None)
    print(json.dumps(summary))


if __name__ == "__main__":
    asyncio.run(main())
