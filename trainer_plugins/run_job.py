"""``prorl-run``: the main job. Roll out a dataset through a rollout server and report.

Loads a dataset (see :mod:`prorl_server.datasets`), starts a rollout server in this process (or uses those
given by ``--server URL``, repeatable, or the fleet of ``--fleet-dir DIR``), registers LLM backends
(``--backend URL``), submits N instances x n samples with bounded
concurrency, shows a progress bar with live throughput and mean reward, and writes ``trajectories.jsonl`` (one
job result per line, token ids included) and ``summary.json`` to ``--out``, then prints a summary table.
Ctrl-C (SIGINT) or SIGTERM cancels the outstanding jobs on the server and still writes what finished.

Every job goes through the one rollout client, :class:`trainer_plugins.jobs.JobSubmitter` (its cancel also
stops a job whose request has not reached the server yet). With one server a job is not re-submitted, a 503 is
not waited out, and a server that gives no result (no answer, 5xx, 503) ends the run with an error, as a
refused job does. With several servers, or a fleet (issue #24: servers join, drain and die during the run), a
job a server gave no result for is re-submitted elsewhere (``--max-sample-retries``, default 2), a 503 is offered
again for 30 s, and only a job still without a result after its retries ends the run; with a fleet, each job
goes to the members of that moment (:class:`trainer_plugins.fleet.Fleet`) and the ``--backend`` URLs are
registered with every member, those that join later included
(:class:`trainer_plugins.client.FleetRegistrar`). prorl-run never ends a fleet (no end sentinel): the fleet
belongs to whoever started it.
It lives in ``trainer_plugins`` (the top layer) because it is a client of the server; it starts the server in
process through :mod:`prorl_server.app`.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import aiohttp
from tqdm import tqdm

from prorl_server.datasets import DatasetError, load_dataset
from prorl_server.membership import TOKEN_IN_ARGV, read_token_file
from prorl_server.types import JobResult
from prorl_server.stats import percentile
from trainer_plugins.client import FleetRegistrar
from trainer_plugins.fleet import Fleet, open_fleet
from trainer_plugins.jobs import (DRAINING, ROLLOUT_SERVER, InvalidInstanceError, JobSubmitter, open_session,
                                  process_request)

log = logging.getLogger("prorl_run")
DEFAULT_MODEL_DIR = Path(os.environ.get("PRORL_CACHE", Path(__file__).resolve().parent.parent / ".cache")) / "tiny-model"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prorl-run", description="Roll out a dataset through a ProRL rollout server.")
    p.add_argument("--dataset", default="arithmetic",
                   help="arithmetic | humaneval | reasoning-gym:<task> | path/to/instances.jsonl "
                        "(default: arithmetic, the built-in LLM-free sample)")
    p.add_argument("--limit", type=int, default=None, help="first N instances (default: all)")
    p.add_argument("--samples", "-n", type=int, default=1, help="samples per instance (a group), default 1")
    p.add_argument("--concurrency", type=int, default=8, help="jobs in flight at once, default 8")
    p.add_argument("--server", action="append", default=[], metavar="URL",
                   help="URL of a running rollout server (repeatable: jobs spread over them, and a job one of them "
                        "fails goes to another; default: start one in this process)")
    p.add_argument("--fleet-dir", metavar="DIR",
                   help="follow the fleet of rollout servers in DIR (prorl-server --fleet-dir, or the launcher's "
                        "PRORL_FLEET_DIR): jobs go to its members as they join, drain and die")
    p.add_argument("--max-sample-retries", type=int, default=None,
                   help="re-submissions of a job a server gave no result for (default: 0 with one server, 2 with "
                        "several or a fleet)")
    p.add_argument("--token-file", metavar="PATH",
                   help="file holding the bearer token of --server / the fleet (mode 600; default: the PRORL_TOKEN "
                        "environment variable, else DIR/token of the fleet); never a token on the command line")
    # kept only to refuse it by name (else argparse would take "--token" as an abbreviation of --token-file)
    p.add_argument("--token", dest="token_in_argv", help=argparse.SUPPRESS)
    p.add_argument("--backend", action="append", default=[], metavar="URL", help="LLM backend (repeatable)")
    p.add_argument("--sandbox-runtime", default=None,
                   help="runtime of the in-process server: bubblewrap (default where bwrap exists), local, singularity")
    p.add_argument("--model", default=None,
                   help="model directory for the embedded vLLM CPU server, used when the dataset needs an LLM and "
                        "no --backend/--server is given (default: the tiny test model, built locally on first use "
                        "into .cache/tiny-model)")
    p.add_argument("--max-model-len", type=int, default=4096, help="context length of the embedded vLLM server")
    p.add_argument("--timeout-s", type=float, default=None, help="per-job timeout in seconds")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=256, help="max new tokens per turn")
    p.add_argument("--seed", type=int, default=0, help="dataset seed (generated datasets)")
    p.add_argument("--out", default="out", help="output directory (default ./out)")
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--max-connections", type=int, default=0,
                   help="HTTP connections to the server at most (default 0: no cap; --concurrency bounds what is "
                   "in flight)")
    return p


class Summary:
    """Aggregates job results into the printed table and summary.json."""

    def __init__(self) -> None:
        self.results: list[JobResult] = []

    def add(self, r: JobResult) -> None:
        self.results.append(r)

    @property
    def mean_reward(self) -> float:
        return statistics.fmean(r.reward for r in self.results) if self.results else 0.0

    def to_dict(self, wall_s: float, submitted: int) -> dict[str, Any]:
        rs = self.results
        failures: dict[str, int] = {}
        for r in rs:
            if r.critical_error:
                failures[r.critical_error] = failures.get(r.critical_error, 0) + 1
        phases = {}
        for ph in ("queue_s", "init_s", "run_s", "eval_s", "counted_s"):
            xs = [getattr(r.timing, ph) for r in rs]
            phases[ph] = {"p50": percentile(xs, 50) if xs else 0.0, "p95": percentile(xs, 95) if xs else 0.0}
        return {"jobs_submitted": submitted, "jobs_finished": len(rs), "mean_reward": self.mean_reward,
                "resolved_rate": (sum(bool(r.resolved) for r in rs) / len(rs)) if rs else 0.0,
                "failures_by_phase": failures, "phase_seconds": phases, "wall_s": wall_s,
                "rollouts_per_s": len(rs) / wall_s if wall_s > 0 else 0.0}

    @staticmethod
    def table(s: dict[str, Any]) -> str:
        lines = [f"jobs            {s['jobs_finished']}/{s['jobs_submitted']} finished",
                 f"mean reward     {s['mean_reward']:.3f}",
                 f"resolved rate   {s['resolved_rate']:.3f}",
                 f"failures        {json.dumps(s['failures_by_phase']) if s['failures_by_phase'] else 'none'}",
                 f"rollouts/s      {s['rollouts_per_s']:.2f}  (wall {s['wall_s']:.1f} s)",
                 "phase           p50 s      p95 s"]
        for ph, v in s["phase_seconds"].items():
            lines.append(f"  {ph:<13}{v['p50']:<11.4f}{v['p95']:.4f}")
        return "\n".join(lines)


def _needs_llm(instances: list[dict[str, Any]]) -> bool:
    from prorl_server.plugin.registry import UnknownHandlerError, default_registry

    default_registry.load_entry_points()
    for ds in {i["data_source"] for i in instances}:
        try:
            if default_registry.resolve(ds)[1].needs_llm:
                return True
        except UnknownHandlerError:
            continue  # the server answers with the list of known handlers
    return False


async def start_embedded_llm(model: Optional[str], max_model_len: int, out: Path):
    """The embedded default backend: a real vLLM CPU server for ``model`` (default: the tiny test model, built
    here with no download). Returns the running :class:`~prorl_server.dev.vllm_launcher.VLLMServer`."""
    from prorl_server.dev.tiny_model import build
    from prorl_server.dev.vllm_launcher import start_vllm_async

    if model is None:
        if not (Path(DEFAULT_MODEL_DIR) / "prorl_tiny_model.json").exists():  # built (its marker is last) or not
            print("building the tiny test model (first run only) ...", file=sys.stderr)
        model = str(await asyncio.to_thread(build, DEFAULT_MODEL_DIR))
    print(f"starting an embedded vLLM CPU server for {model} (about a minute) ...", file=sys.stderr)
    server = await start_vllm_async(model, max_model_len=max_model_len, max_num_batched_tokens=max_model_len,
                                    log_path=out / "vllm.log", timeout_s=600)
    print(f"vLLM ready at {server.address}", file=sys.stderr)
    return server


async def _start_local_server(stack: contextlib.AsyncExitStack, args: argparse.Namespace,
                              backends: list[str]) -> str:
    """A rollout server in this process on a free loopback port; returns its URL."""
    from aiohttp import web

    from prorl_server.app import create_app
    from prorl_server.config import ServerSettings

    runtime = args.sandbox_runtime or ("bubblewrap" if shutil.which("bwrap") else "local")
    settings = ServerSettings(port=0, backends=backends, sandbox_runtime=runtime, init_workers=args.concurrency,
                              run_workers=args.concurrency, eval_workers=args.concurrency)
    runner = web.AppRunner(create_app(settings), access_log=None)
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    await web.TCPSite(runner, "127.0.0.1", 0, backlog=settings.listen_backlog).start()
    return f"http://127.0.0.1:{runner.addresses[0][1]}"


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the main job; returns the summary (also written to ``OUT/summary.json``).

    Raises:
        DatasetError: the dataset spec is unknown or malformed.
        trainer_plugins.jobs.InvalidInstanceError: the server or its handler refused an instance (e.g. an
            unknown handler). RuntimeError: the server gave no result (no backend: 503, 5xx, no answer), or
            refused the token (:class:`~trainer_plugins.jobs.RolloutAuthError`).
    """
    instances = load_dataset(args.dataset, limit=args.limit, seed=args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sampling = {"temperature": args.temperature, "max_tokens": args.max_tokens}
    jobs = [(inst, k) for inst in instances for k in range(args.samples)]
    summary = Summary()
    stop = asyncio.Event()
    error: Optional[BaseException] = None  # what stopped the run, when a worker did
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with contextlib.AsyncExitStack() as stack:
        backends = list(args.backend)
        remote = bool(args.server or args.fleet_dir)
        if not remote and not backends and _needs_llm(instances):
            embedded = await start_embedded_llm(args.model, args.max_model_len, out)
            stack.push_async_callback(embedded.stop_async)
            backends = [embedded.address]
        token = read_token(args)
        fleet: Optional[Fleet] = None
        if args.fleet_dir:  # members must prove they hold the token we send them (trainer_plugins.fleet)
            fleet = open_fleet(args.fleet_dir, token=token)
            stack.callback(fleet.close)
        headers = {"Authorization": f"Bearer {token}"} if token and remote else {}
        if fleet is not None and not headers:
            headers = fleet.headers
        servers: Sequence[str]
        if fleet is not None:
            servers = fleet
        elif args.server:
            servers = [u.rstrip("/") for u in args.server]
        else:
            servers = [await _start_local_server(stack, args, backends)]
        several = fleet is not None or len(servers) > 1
        retries = args.max_sample_retries if args.max_sample_retries is not None else (2 if several else 0)
        http = await stack.enter_async_context(
            open_session(headers, max_connections=args.max_connections,
                         timeout=aiohttp.ClientTimeout(total=None)))
        client = JobSubmitter(session=http, unavailable_retry_s=30.0 if several else 0.0, fleet=fleet)
        stack.push_async_callback(client.close)  # its fleet lease watch; the session is closed by the stack

        async def add_backends(server: str, bs: Sequence[str], version: int = 0) -> None:
            for b in bs:  # a fixed model: registered with no weight version
                async with http.post(f"{server}/add_llm_server", json={"address": b}) as r:
                    if r.status != 200:
                        raise RuntimeError(f"{server}/add_llm_server {b} answered {r.status}: {await r.text()}")

        if fleet is not None:
            if not fleet:  # servers may still be starting (a launcher submitted beside this run): wait, and say so
                where = Path(args.fleet_dir)
                print(f"waiting up to 60 s for a rollout server to join the fleet {where}"
                      + ("" if where.is_dir() else " (no such directory yet: is the path right?)") + " ...",
                      file=sys.stderr)
                members = asyncio.ensure_future(fleet.wait_for_members(60.0))
                stopper = asyncio.ensure_future(stop.wait())
                await asyncio.wait([members, stopper], return_when=asyncio.FIRST_COMPLETED)
                for t in (members, stopper):
                    await _cancel(t)
                if stop.is_set():  # Ctrl-C / SIGTERM during the wait: nothing was submitted
                    raise Interrupted(f"interrupted while waiting for the fleet {where}; no job was submitted")
                if not members.result():
                    raise RuntimeError(f"no rollout server in the fleet {args.fleet_dir} after 60 s")
            if backends:  # every member, those that join later included
                registrar = FleetRegistrar(fleet, add_backends)
                registrar.set(backends, 0)
                await registrar.sync()
                follower = asyncio.create_task(registrar.follow())
                stack.push_async_callback(_cancel, follower)
        elif args.server:
            for u in servers:
                await add_backends(u, backends)
        sink = stack.enter_context((out / "trajectories.jsonl").open("w"))
        bar = stack.enter_context(tqdm(total=len(jobs), unit="rollout", dynamic_ncols=True, file=sys.stderr,
                                       mininterval=0.5))
        queue = iter(jobs)
        t0 = time.monotonic()

        async def worker() -> None:
            for inst, k in queue:
                if stop.is_set():
                    return
                # no await between the stop check and the request's registration in the client: a Ctrl-C
                # either stops this job here or finds it open and cancels it
                request = process_request(inst, sampling, timeout_s=args.timeout_s or None)
                name = inst.get("instance_id", "job")
                outcome = await client.run(servers, request, max_sample_retries=retries, job_prefix=f"{name}-s{k}",
                                           what=f"instance {name!r}")
                result = outcome.result
                if result.failure_kind in (ROLLOUT_SERVER, DRAINING):
                    raise RuntimeError(f"job {result.job_id}: {result.error}")
                summary.add(result)
                sink.write(result.model_dump_json() + "\n")
                bar.update(1)
                bar.set_postfix(mean_reward=f"{summary.mean_reward:.3f}",
                                rps=f"{len(summary.results) / (time.monotonic() - t0):.2f}")

        workers = [asyncio.create_task(worker()) for _ in range(max(1, args.concurrency))]
        stopper = asyncio.create_task(stop.wait())
        all_done = asyncio.gather(*workers)
        await asyncio.wait([stopper, all_done], return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            print(f"\ninterrupted: cancelling {len(client.open_jobs())} outstanding job(s)", file=sys.stderr)
            await client.cancel_open()
            await asyncio.wait(workers, timeout=30)  # their /process calls return the cancelled results
            for w in workers:
                w.cancel()
            await asyncio.gather(all_done, return_exceptions=True)
        else:
            stopper.cancel()
            error = all_done.exception()  # a worker stopped the run (no server could run its job)
            if error is not None:
                # the other workers' jobs are cancelled; what finished is still summarised below
                await client.cancel_open()
                await asyncio.wait(workers, timeout=30)
                for w in workers:
                    w.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
        wall = time.monotonic() - t0
    s = summary.to_dict(wall, len(jobs))
    s.update({"dataset": args.dataset, "samples": args.samples, "interrupted": stop.is_set(),
              "error": None if error is None else f"{type(error).__name__}: {error}"})
    (out / "summary.json").write_text(json.dumps(s, indent=2))
    print(Summary.table(s))
    print(f"wrote {out / 'trajectories.jsonl'} and {out / 'summary.json'}")
    if error is not None:
        raise error
    return s


class Interrupted(Exception):
    """SIGINT or SIGTERM before any job was submitted (exit 130)."""


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def read_token(args: argparse.Namespace) -> Optional[str]:
    """The bearer token: ``--token-file`` (a regular file of mode 600), else ``$PRORL_TOKEN``, else None.

    Raises:
        ValueError: the token file others may read, or not a regular file. OSError: it cannot be read.
    """
    if getattr(args, "token_file", None):
        return read_token_file(args.token_file)
    return os.environ.get("PRORL_TOKEN") or None


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.token_in_argv is not None:
        parser.error(TOKEN_IN_ARGV)
    try:
        read_token(args)
    except (OSError, ValueError) as e:
        parser.error(f"--token-file: {e}")
    if args.server and args.fleet_dir:
        parser.error("--server and --fleet-dir are exclusive: a fleet's members are its servers")
    for url in (args.server or []) + list(args.backend or []):
        if not url.startswith(("http://", "https://")):
            parser.error(f"{url!r}: --server and --backend take URLs that start with http:// or https:// "
                         f"(e.g. http://{url})")
    if args.max_sample_retries is not None and args.max_sample_retries < 0:
        parser.error(f"--max-sample-retries must be >= 0, got {args.max_sample_retries}")
    if args.max_connections < 0:
        parser.error(f"--max-connections must be >= 0 (0: no cap), got {args.max_connections}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        s = asyncio.run(run(args))
    except DatasetError as e:
        print(f"prorl-run: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        print(f"prorl-run: {e}", file=sys.stderr)
        return 130
    except (RuntimeError, ValueError, InvalidInstanceError, aiohttp.ClientError, OSError) as e:
        print(f"prorl-run: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 130 if s["interrupted"] else 0


if __name__ == "__main__":
    sys.exit(main())
