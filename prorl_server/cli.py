"""``prorl-server`` / ``python -m prorl_server``: run the rollout server.

Settings come from defaults, then ``--config FILE`` (YAML or TOML), then ``PRORL_TOKEN``, then flags.
The bearer token never travels in argv (every local user can read a command line: ``ps``,
``/proc/PID/cmdline``): it comes from ``--token-file PATH`` (mode 600) or ``PRORL_TOKEN``; ``--token VALUE`` is
refused with a usage error.
SIGTERM and SIGINT stop it cleanly: in-flight jobs are cancelled at once (a blocking ``/process`` answers its
client the cancelled result), every sandbox it started is closed, then the process exits.

``--processes N`` (N > 1; 0 = one per CPU core) runs N server processes, each its own member of the fleet
with its own port (``port``, ``port + 1``, ...; or a free port each with ``--port 0``), under this process
as a supervisor. One event loop uses one core; the members share nothing but the node-wide sandbox leases
(:mod:`sandbox.leases`) and the per-user sandbox records (a member reaps only the sandboxes of servers that
are gone). Why not one port shared with ``SO_REUSEPORT``: the API is stateful per process (a job's
``GET /jobs/{id}`` and ``/cancel``, gateway sessions, ``/add_llm_server`` and the backend load counts of
sticky routing), and the kernel would hand each connection to any process. The ready file lists the members
(``members: [{host, port, pid, url}]``; its ``url`` is the first one's); trainers spread jobs over them as over
any servers. The supervisor forwards SIGTERM/SIGINT to every member, and stops them all when one dies.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from typing import Any, Coroutine, Optional, Sequence

from aiohttp import web
from pydantic import ValidationError

from prorl_server.app import FLEET, PIPELINE, POOL, create_app, write_ready_file
from prorl_server.config import ServerSettings, build_settings
from prorl_server.membership import TOKEN_IN_ARGV

log = logging.getLogger("prorl_server")

#: Seconds the server waits, after SIGTERM cancelled every job, for open HTTP requests to finish.
SHUTDOWN_TIMEOUT_S = 3.0
#: The event-loop lag prorl-server keeps by admission control unless told otherwise, ms (prorl_server.admission):
#: at 1,024 jobs in flight on this 2-core machine it took the loop lag p99 from ~490 ms to ~5 ms.
DEFAULT_ADMISSION_TARGET_LAG_MS = 5.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prorl-server", description="ProRL rollout server (aiohttp).")
    p.add_argument("--config", help="settings file (.yaml/.yml/.toml); flags override it")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8080; 0 = a free port, see --ready-file)")
    p.add_argument("--init-workers", type=int, help="init stage pool size (default 32)")
    p.add_argument("--run-workers", type=int, help="run stage pool size (default 32)")
    p.add_argument("--eval-workers", type=int, help="eval stage pool size (default 32)")
    p.add_argument("--default-timeout-s", type=float, help="job timeout when a job sets none (default 3600)")
    p.add_argument("--token-file", metavar="PATH",
                   help="file holding the bearer token required by every endpoint but /health (a regular file "
                   "of mode 600), or set PRORL_TOKEN; never a token on the command line")
    # kept only to refuse it by name (else argparse would take "--token" as an abbreviation of --token-file)
    p.add_argument("--token", help=argparse.SUPPRESS)
    p.add_argument("--backend", action="append", dest="backends", metavar="URL",
                   help="LLM backend to register at start (repeatable)")
    p.add_argument("--tokenizer", help="tokenizer directory or name (default: the backend's model path from "
                   "GET /v1/models, loaded from local files only)")
    p.add_argument("--sandbox-runtime", choices=["auto", "bubblewrap", "bwrap", "singularity", "apptainer", "local",
                                                 "none"],
                   help="sandbox runtime for handlers that need one (default auto: bubblewrap where bwrap is "
                   "installed, else none, said at start)")
    p.add_argument("--sandbox-image", help="default sandbox image (.sif for singularity, rootfs dir for bubblewrap)")
    p.add_argument("--sandbox-pool-size", type=int, help="started sandboxes kept ready per pooled spec (default 4; "
                   "0 = off)")
    p.add_argument("--journal", help="SQLite journal of jobs, results and completions: a path, 'auto' (the "
                   "default: ~/.local/state/prorl/journal/<host>_<port>.sqlite) or 'off'")
    p.add_argument("--journal-prealloc-wal", action=argparse.BooleanOptionalAction, default=None,
                   help="write the journal's WAL (97 MiB) before the first commit so commits overwrite "
                   "allocated space (default on; lower commit p99)")
    p.add_argument("--ready-file", help="write {host, port, pid, url} as JSON here once listening")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    p.add_argument("--event-loop", choices=["auto", "uvloop", "asyncio"],
                   help="auto (default): uvloop when installed, else asyncio's")
    p.add_argument("--listen-backlog", type=int,
                   help="connections the kernel queues before they are accepted (default 4096; capped by "
                   "net.core.somaxconn)")
    p.add_argument("--processes", type=int,
                   help="server processes, each its own member on its own port (default 1; 0 = one per CPU "
                   "core); the ready file lists them under members")
    p.add_argument("--fleet-dir", help="fleet directory (shared file system): hold a leased record there, drain "
                   "on SIGTERM, exit when the trainer writes its end sentinel (see prorl_server.membership)")
    p.add_argument("--fleet-ttl-s", type=float, help="lease of the fleet record, seconds (default 5)")
    p.add_argument("--advertise-host", help="address written to the fleet record (default: PRORL_ADVERTISE_HOST, "
                   "the bind address, or this host's address for a wildcard bind)")
    p.add_argument("--drain-timeout-s", type=float,
                   help="seconds a draining server waits for its jobs before cancelling them (default 20)")
    p.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=None,
                   help="freeze long-lived objects out of the garbage collector's view (default on)")
    p.add_argument("--gc-gen0-threshold", type=int,
                   help="allocations between generation-0 collections (default 50000; Python's: 700)")
    p.add_argument("--admission-target-lag-ms", type=float,
                   help="admit jobs into their stages adaptively so the event loop stays within this lag, ms "
                   f"(default {DEFAULT_ADMISSION_TARGET_LAG_MS:g}; 0: off, every job starts at once; see "
                   "prorl_server.admission)")
    p.add_argument("--admission-min-jobs", type=int,
                   help="the admission limit never goes below this many jobs (default 16)")
    return p


def settings_from_args(argv: Optional[Sequence[str]] = None) -> ServerSettings:
    """Parse flags into settings. Exits with status 2 and a clear message on a bad setting."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.token is not None:
        parser.error(TOKEN_IN_ARGV)
    overrides = {k: v for k, v in vars(args).items() if k not in ("config", "token")}
    try:
        settings = build_settings(args.config, overrides)
        if settings.journal is None:  # the server journals by default (an app built in code does not)
            settings = settings.model_copy(update={"journal": "auto"})
        if settings.journal_prealloc_wal is None:  # likewise: tests build apps in code and open many journals
            settings = settings.model_copy(update={"journal_prealloc_wal": True})
        if settings.admission_target_lag_ms is None:  # likewise admission control (tests build apps in code)
            settings = settings.model_copy(update={"admission_target_lag_ms": DEFAULT_ADMISSION_TARGET_LAG_MS})
        return settings
    except (ValidationError, ValueError, OSError) as e:
        parser.error(str(e))
        raise  # unreachable


async def serve(settings: ServerSettings, app: Optional[web.Application] = None) -> None:
    """Serve until SIGTERM/SIGINT, then shut down cleanly (jobs cancelled, sandboxes closed)."""
    app = app or create_app(settings)
    # Jobs are cancelled in on_shutdown (create_app), so open /process requests answer at once; the timeout
    # bounds how long any other open request (a gateway call) may delay the exit.
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    somaxconn = _somaxconn()
    if somaxconn is not None and settings.listen_backlog > somaxconn:
        log.warning("listen_backlog %d is above the kernel's net.core.somaxconn %d: the kernel queues at most %d "
                    "connections (raise it with sysctl to queue more)", settings.listen_backlog, somaxconn,
                    somaxconn)
    site = web.TCPSite(runner, settings.host, settings.port, backlog=settings.listen_backlog)
    await site.start()
    port = runner.addresses[0][1]
    log.info("prorl-server listening on http://%s:%d (workers init/run/eval = %d/%d/%d, auth %s)",
             settings.host, port, settings.init_workers, settings.run_workers, settings.eval_workers,
             "on" if settings.token else "off")
    if settings.ready_file:
        write_ready_file(settings.ready_file, settings.host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    fleet = app[FLEET]
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    membership = None
    if settings.fleet_dir:
        # in a fleet SIGTERM drains (0 jobs aborted); a second SIGTERM, or SIGINT, stops at once
        draining = set()  # the drain task, referenced until it ends
        loop.add_signal_handler(signal.SIGTERM, lambda: stop.set() if fleet.draining
                                else draining.add(loop.create_task(fleet.start_drain())))
        membership = await _join_fleet(app, settings, port, stop)
    try:
        exit_wait = asyncio.ensure_future(fleet.exit_requested.wait())
        stop_wait = asyncio.ensure_future(stop.wait())
        await asyncio.wait({exit_wait, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        exit_wait.cancel()
        stop_wait.cancel()
        if fleet.draining and not stop.is_set():
            log.info("draining: no new jobs; waiting up to %g s for %d job(s)", settings.drain_timeout_s,
                     app[PIPELINE].in_flight)
            await fleet.wait_drained(lambda: app[PIPELINE].in_flight, settings.drain_timeout_s, stop)
        log.info("shutting down: cancelling jobs and closing sandboxes")
    finally:
        if membership is not None:
            await membership.close()
        await runner.cleanup()


async def _join_fleet(app: web.Application, settings: ServerSettings, port: int, stop: asyncio.Event):
    """Start this process's leased record in ``settings.fleet_dir`` (:class:`prorl_server.membership.Membership`)."""
    from prorl_server.membership import Membership

    host = settings.advertise_host or os.environ.get("PRORL_ADVERTISE_HOST") or settings.host
    if host in ("0.0.0.0", "::", ""):
        host = _host_address()
    url_host = f"[{host}]" if ":" in host else host
    pool, pipeline = app[POOL], app[PIPELINE]

    def status() -> tuple[int, Optional[int], int]:
        live = [b for b in pool.backends if b.in_rotation]
        versions = [b.weight_version for b in live if b.weight_version is not None]
        return len(live), (max(versions) if versions else None), pipeline.in_flight

    membership = Membership(settings.fleet_dir, url=f"http://{url_host}:{port}", host=host, port=port,
                            ttl_s=settings.fleet_ttl_s, capacity=settings.run_workers, status=status,
                            on_end=stop.set, token=settings.token)
    app[FLEET].membership = membership
    await membership.start()
    return membership


def _host_address() -> str:
    """This host's first non-loopback IPv4 address (the one a route to the outside would use), else its name."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent: UDP connect only picks the route
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


def _somaxconn() -> Optional[int]:
    try:
        with open("/proc/sys/net/core/somaxconn") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    settings = settings_from_args(argv)
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    processes = settings.processes or os.cpu_count() or 1
    if processes > 1:
        return supervise(settings, processes)
    if not _serve_or_refuse(settings):
        return 2
    _ignore_late_sigterm(settings)
    return 0


def _serve_or_refuse(settings: ServerSettings) -> bool:
    """Serve until stopped; False (after one error line naming the path and the fix) when shared node state
    is refused at start: a journal path another user planted or may read, a fleet directory others may
    rearrange (:class:`~prorl_server.journal.store.JournalError`, :class:`~prorl_server.membership.FleetDirError`):
    a setting to fix, not a crash to read a traceback of."""
    from prorl_server.journal.store import JournalError
    from prorl_server.membership import FleetDirError

    try:
        run_event_loop(serve(settings), settings.event_loop)
    except (JournalError, FleetDirError) as e:
        log.error("cannot start: %s", e)
        return False
    return True


def _ignore_late_sigterm(settings: ServerSettings) -> None:
    """After a fleet member shut down (drained, or saw the end sentinel), a SIGTERM from the launcher stopping
    its step must not turn the clean exit into a death by signal (status 143)."""
    if settings.fleet_dir:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


# ------------------------------------------------------------------------------------------ several processes


def member_settings(settings: ServerSettings, processes: int, ready_dir: str) -> list[ServerSettings]:
    """The settings of each of ``processes`` members: ports ``port + i`` (0 stays 0: a free port each), one
    process each, ready files ``<ready_dir>/member-<i>.json``.

    Raises:
        ValueError: the ports would run past 65535.
    """
    if settings.port and settings.port + processes - 1 > 65535:
        raise ValueError(f"--processes {processes} from port {settings.port} needs ports up to "
                         f"{settings.port + processes - 1}, past 65535")
    def journal(i: int) -> Optional[str]:  # one journal per member ("auto" names it by the member's port)
        j = settings.journal
        if j is None or j.lower() in ("auto", "off", "none", "false", "") or processes == 1:
            return j
        root, ext = os.path.splitext(j)
        return f"{root}-member{i}{ext}"

    return [settings.model_copy(update={"processes": 1, "port": settings.port + i if settings.port else 0,
                                        "ready_file": os.path.join(ready_dir, f"member-{i}.json"),
                                        "journal": journal(i)})
            for i in range(processes)]


def _member_main(settings_json: str) -> None:
    """A member process (multiprocessing spawn target): serve until signalled; dies with its supervisor."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:  # PR_SET_PDEATHSIG: a supervisor killed with SIGKILL still takes its members down
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
        except OSError:
            pass
    settings = ServerSettings.model_validate_json(settings_json)
    logging.basicConfig(level=settings.log_level,
                        format=f"%(asctime)s %(levelname)s [member {os.getpid()}] %(name)s: %(message)s")
    if not _serve_or_refuse(settings):
        sys.exit(2)
    _ignore_late_sigterm(settings)


def supervise(settings: ServerSettings, processes: int, poll_s: float = 0.2) -> int:
    """Run ``processes`` members (:func:`member_settings`) until SIGTERM/SIGINT (forwarded to each) or until
    one exits by itself (the others are then stopped too). Writes ``settings.ready_file`` with every member
    once all listen. Returns the exit status: 0 after a signal, 1 when a member died first."""
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that may already hold threads
    stopping = False

    def on_signal(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    with tempfile.TemporaryDirectory(prefix="prorl-members-") as ready_dir:
        try:
            members = member_settings(settings, processes, ready_dir)
        except ValueError as e:
            log.error("%s", e)
            return 2
        procs = [ctx.Process(target=_member_main, args=(m.model_dump_json(),), name=f"prorl-server-{i}")
                 for i, m in enumerate(members)]
        for p in procs:
            p.start()
        ready: dict[int, dict] = {}
        rc = 0
        while not stopping:
            for i, m in enumerate(members):
                if i not in ready and os.path.exists(m.ready_file):
                    with open(m.ready_file) as f:
                        ready[i] = json.load(f)
                    if len(ready) == len(members):
                        _write_members(settings, [ready[k] for k in range(len(members))])
            dead = [p for p in procs if not p.is_alive()]
            if settings.fleet_dir and dead and all(p.exitcode == 0 for p in dead):
                # in a fleet a member that drained (POST /drain) or saw the end sentinel leaves alone, cleanly
                if len(dead) == len(procs):
                    break
                time.sleep(poll_s)
                continue
            if dead:
                log.error("member %s exited (status %s): stopping the others", dead[0].name, dead[0].exitcode)
                rc = 1
                break
            time.sleep(poll_s)
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S + 30 + (settings.drain_timeout_s if settings.fleet_dir
                                                                 else 0.0)
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                log.error("member %s did not stop in time: killed", p.name)
                p.kill()
                p.join()
    return rc


def _write_members(settings: ServerSettings, members: list[dict]) -> None:
    log.info("prorl-server: %d members listening: %s", len(members), ", ".join(m["url"] for m in members))
    if settings.ready_file:
        first = members[0]
        tmp = f"{settings.ready_file}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"host": first["host"], "port": first["port"], "pid": os.getpid(), "url": first["url"],
                       "members": members}, f)
        os.replace(tmp, settings.ready_file)


def run_event_loop(main: Coroutine[Any, Any, Any], event_loop: str = "auto") -> Any:
    """Run ``main`` to completion on uvloop (``"uvloop"``, or ``"auto"`` when it is installed) or on
    asyncio's default loop.

    Raises:
        SystemExit: ``"uvloop"`` was asked for and is not installed.
    """
    if event_loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if event_loop == "uvloop":
                main.close()
                raise SystemExit("prorl-server: --event-loop uvloop, but uvloop is not installed "
                                 "(pip install uvloop)") from None
        else:
            return uvloop.run(main)
    return asyncio.run(main)


if __name__ == "__main__":
    sys.exit(main())
