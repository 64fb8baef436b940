"""Start and stop a real vLLM OpenAI-compatible server on CPU (tests, benchmarks, ``prorl-run``'s default).

The server runs as ``python -m vllm.entrypoints.openai.api_server --model DIR --enforce-eager --dtype
float32`` in its own session (so its process group holds the API server and its engine-core child), on a
free loopback port, with ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache) and ``HF_HUB_OFFLINE=1``. It is ready
when ``GET /health`` answers 200 (measured here: 40-55 s, ~3 GB RAM for the tiny model). It is stopped by
signalling its own process group (SIGTERM, then SIGKILL after a grace period), never by process name.

``VLLM_SERVER_DEV_MODE=1`` (default on) enables ``/pause``, ``/resume``, ``/is_paused``,
``/reset_prefix_cache`` and ``/collective_rpc`` (used for weight sync).

Show the plan without running it::

    python -m prorl_server.dev.vllm_launcher --model DIR --dry-run
"""
from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence


class VLLMStartError(RuntimeError):
    """The server exited or did not answer ``/health`` in time; the message ends with its log tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it; a race with other binders remains)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    """True if something accepts connections on ``host:port``.

    vLLM's server binds with ``SO_REUSEPORT``, so starting a second server on a port that one already
    listens on does not fail: both would share the port and split the requests. Hence this check."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


@dataclass
class LaunchPlan:
    """What :func:`start_vllm` would run: argv, the environment it adds, and where the log goes."""

    argv: list[str]
    env: dict[str, str]
    host: str
    port: int
    log_path: Path

    def describe(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return f"{env} {shlex.join(self.argv)} > {self.log_path} 2>&1"


def plan_vllm(model: os.PathLike | str, *, host: str = "127.0.0.1", port: Optional[int] = None,
              python: str = sys.executable, max_model_len: Optional[int] = None,
              max_num_batched_tokens: Optional[int] = None, served_model_name: Optional[str] = None, kvcache_gib: float = 1, dev_mode: bool = True,
              extra_args: Sequence[str] = (), extra_env: Optional[dict[str, str]] = None,
              log_path: Optional[os.PathLike | str] = None) -> LaunchPlan:
    """Build the command line and environment for one CPU vLLM server (nothing is started).

    ``max_num_batched_tokens``: set it to ``max_model_len`` when requests carry a per-request ``seed``:
    with vllm-cpu 0.31.0 a seeded request whose prompt is prefilled in several chunks (longer than this
    budget, 2048 by default) kills the engine (``RuntimeError: CPU Generator does not use offset`` in
    ``gpu_model_runner._bookkeeping_sync``).
    """
    port = port or free_port(host)
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", host,
            "--port", str(port), "--enforce-eager", "--dtype", "float32",
            # each answer says how long the engine queued it (a full batch, a paused scheduler): the LLM client
            # charges that to the system, not to the model's t_llm_s (prorl_server.llm.client.engine_times)
            "--enable-per-request-metrics"]
    if max_model_len:
        argv += ["--max-model-len", str(max_model_len)]
    if max_num_batched_tokens:
        argv += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    argv += list(extra_args)
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kvcache_gib), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    env.update(extra_env or {})
    if log_path is None:
        log_path = Path(tempfile.gettempdir()) / f"prorl-vllm-{os.getpid()}-{port}.log"
    return LaunchPlan(argv=argv, env=env, host=host, port=port, log_path=Path(log_path))


_live: "weakref.WeakSet[VLLMServer]" = weakref.WeakSet()


@dataclass(eq=False)
class VLLMServer:
    """A running vLLM server this process started. ``address`` is its base URL (``http://host:port``)."""

    plan: LaunchPlan
    proc: subprocess.Popen
    started_at: float = field(default_factory=time.monotonic)
    ready_s: Optional[float] = None

    @property
    def address(self) -> str:
        return f"http://{self.plan.host}:{self.plan.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n_chars: int = 4000) -> str:
        try:
            data = self.plan.log_path.read_bytes()
        except OSError:
            return ""
        return data[-n_chars:].decode("utf-8", "replace")

    def healthy(self, timeout_s: float = 2.0) -> bool:
        """One ``GET /health`` probe (blocking)."""
        try:
            with urllib.request.urlopen(f"{self.address}/health", timeout=timeout_s) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def wait_ready(self, timeout_s: float = 300.0, poll_s: float = 0.5) -> float:
        """Block until ``/health`` answers 200. Returns seconds since start.

        Raises:
            VLLMStartError: the process exited, or ``timeout_s`` passed (the server is then stopped).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive():
                raise VLLMStartError(f"vLLM exited with {self.proc.returncode} before becoming healthy; "
                                     f"log {self.plan.log_path}:\n{self.log_tail()}")
            if self.healthy():
                self.ready_s = time.monotonic() - self.started_at
                return self.ready_s
            if time.monotonic() > deadline:
                self.stop()
                raise VLLMStartError(f"vLLM not healthy after {timeout_s:.0f} s; log {self.plan.log_path}:\n"
                                     f"{self.log_tail()}")
            time.sleep(poll_s)

    async def wait_ready_async(self, timeout_s: float = 300.0, poll_s: float = 0.5) -> float:
        """:meth:`wait_ready` without blocking the event loop."""
        return await asyncio.to_thread(self.wait_ready, timeout_s, poll_s)

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after ``grace_s``. Idempotent."""
        pgid = self.proc.pid  # start_new_session=True: the group id is the leader's pid
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            self.proc.poll()
            if self.proc.returncode is not None and not _group_alive(pgid):
                break
            time.sleep(0.1)
        else:
            _signal_group(pgid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        _live.discard(self)

    async def stop_async(self, grace_s: float = 20.0) -> None:
        await asyncio.to_thread(self.stop, grace_s)

    def kill(self) -> None:
        """SIGKILL the whole group at once (fault injection: a backend that dies mid-request)."""
        _signal_group(self.proc.pid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        _live.discard(self)

    def __enter__(self) -> "VLLMServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start_vllm(model: os.PathLike | str, *, wait: bool = True, timeout_s: float = 300.0, port_retries: int = 2,
               **plan_kwargs) -> VLLMServer:
    """Start a CPU vLLM server for ``model`` (a local model directory) and, by default, wait until healthy.

    Keyword arguments go to :func:`plan_vllm` (``host``, ``port``, ``max_model_len``, ``kvcache_gib``,
    ``dev_mode``, ``extra_args``, ``extra_env``, ``log_path``, ...). The child's stdout/stderr go to the
    plan's log file. Servers still running at interpreter exit are stopped.

    Raises:
        VLLMStartError: the requested port is in use (see :func:`port_in_use`), or the server did not become
            healthy (after ``port_retries`` retries on a fresh port when the log says the port was taken).
    """
    for attempt in range(port_retries + 1):
        plan = plan_vllm(model, **plan_kwargs)
        if port_in_use(plan.host, plan.port):
            if plan_kwargs.get("port") or attempt == port_retries:
                raise VLLMStartError(f"{plan.host}:{plan.port} is already in use")
            continue
        env = dict(os.environ)
        env.update(plan.env)
        plan.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(plan.log_path, "wb") as log:
            proc = subprocess.Popen(plan.argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        server = VLLMServer(plan=plan, proc=proc)
        _live.add(server)
        if not wait:
            return server
        try:
            server.wait_ready(timeout_s)
            return server
        except VLLMStartError:
            server.stop()
            port_taken = "address already in use" in server.log_tail().lower()
            if not port_taken or attempt == port_retries or plan_kwargs.get("port"):
                raise
    raise AssertionError("unreachable")


async def start_vllm_async(model: os.PathLike | str, **kwargs) -> VLLMServer:
    """:func:`start_vllm` in a worker thread (the start takes ~1 min; the event loop keeps running)."""
    return await asyncio.to_thread(start_vllm, model, **kwargs)


@atexit.register
def _stop_leftovers() -> None:
    for server in list(_live):
        server.stop(grace_s=5)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Start a CPU vLLM OpenAI server for a local model directory.")
    ap.add_argument("--model", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--kvcache-gib", type=float, default=1)
    ap.add_argument("--dry-run", action="store_true", help="print the command and exit")
    args = ap.parse_args(argv)
    kw = dict(host=args.host, port=args.port, max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_num_batched_tokens, kvcache_gib=args.kvcache_gib)
    if args.dry_run:
        plan = plan_vllm(args.model, **kw)
        print(plan.describe())
        return 0
    server = start_vllm(args.model, **kw)
    print(json.dumps({"address": server.address, "pid": server.pid, "ready_s": round(server.ready_s or 0, 1),
                      "log": str(server.plan.log_path)}), flush=True)
    stop = {"flag": False}

    def _on_signal(*_):
        stop["flag"] = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        while not stop["flag"] and server.alive():
            time.sleep(0.5)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
