"""``prorl-server`` / ``python -m prorl_server``: run the rollout server.

Settings come from defaults, then ``--config FILE`` (YAML or TOML), then ``PRORL_TOKEN``, then flags.
SIGTERM and SIGINT stop it cleanly: in-flight jobs are cancelled at once (a blocking ``/process`` answers its
client the cancelled result), every sandbox it started is closed, then the process exits.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import Any, Coroutine, Optional, Sequence

from aiohttp import web
from pydantic import ValidationError

from prorl_server.app import create_app, write_ready_file
from prorl_server.config import ServerSettings, build_settings

log = logging.getLogger("prorl_server")

#: Seconds the server waits, after SIGTERM cancelled every job, for open HTTP requests to finish.
SHUTDOWN_TIMEOUT_S = 3.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prorl-server", description="ProRL rollout server (aiohttp).")
    p.add_argument("--config", help="settings file (.yaml/.yml/.toml); flags override it")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8080; 0 = a free port, see --ready-file)")
    p.add_argument("--init-workers", type=int, help="init stage pool size (default 32)")
    p.add_argument("--run-workers", type=int, help="run stage pool size (default 32)")
    p.add_argument("--eval-workers", type=int, help="eval stage pool size (default 32)")
    p.add_argument("--default-timeout-s", type=float, help="job timeout when a job sets none (default 3600)")
    p.add_argument("--token", help="bearer token required by every endpoint but /health (or PRORL_TOKEN)")
    p.add_argument("--backend", action="append", dest="backends", metavar="URL",
                   help="LLM backend to register at start (repeatable)")
    p.add_argument("--tokenizer", help="tokenizer directory or name (default: the backend's model path from "
                   "GET /v1/models, loaded from local files only)")
    p.add_argument("--sandbox-runtime", choices=["auto", "bubblewrap", "bwrap", "singularity", "apptainer", "local",
                                                 "none"],
                   help="sandbox runtime for handlers that need one (default auto: bubblewrap where bwrap is "
                   "installed, else none, said at start)")
    p.add_argument("--sandbox-image", help="default sandbox image (.sif for singularity, rootfs dir for bubblewrap)")
    p.add_argument("--ready-file", help="write {host, port, pid, url} as JSON here once listening")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    p.add_argument("--event-loop", choices=["auto", "uvloop", "asyncio"],
                   help="auto (default): uvloop when installed, else asyncio's")
    return p


def settings_from_args(argv: Optional[Sequence[str]] = None) -> ServerSettings:
    """Parse flags into settings. Exits with status 2 and a clear message on a bad setting."""
    parser = build_parser()
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if k != "config"}
    try:
        return build_settings(args.config, overrides)
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
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    port = runner.addresses[0][1]
    log.info("prorl-server listening on http://%s:%d (workers init/run/eval = %d/%d/%d, auth %s)",
             settings.host, port, settings.init_workers, settings.run_workers, settings.eval_workers,
             "on" if settings.token else "off")
    if settings.ready_file:
        write_ready_file(settings.ready_file, settings.host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        log.info("shutting down: cancelling jobs and closing sandboxes")
    finally:
        await runner.cleanup()


def main(argv: Optional[Sequence[str]] = None) -> int:
    settings = settings_from_args(argv)
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_event_loop(serve(settings), settings.event_loop)
    return 0


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
