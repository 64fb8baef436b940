"""Helpers shared by the benchmarks that talk to a vLLM server (run as scripts: ``python benchmarks/X.py``)."""
from __future__ import annotations

import contextlib
import subprocess
import time
from typing import Any, Iterator, Optional


@contextlib.contextmanager
def vllm_address(address: Optional[str], model_dir: str, **start_kwargs: Any) -> Iterator[str]:
    """The base URL of ``address`` if given, else of a CPU vLLM server started for the tiny model (built in
    ``model_dir`` if missing; ``start_kwargs`` go to :func:`prorl_server.dev.vllm_launcher.start_vllm`) and
    stopped on exit."""
    if address is not None:
        yield address.rstrip("/")
        return
    from prorl_server.dev import tiny_model
    from prorl_server.dev.vllm_launcher import start_vllm

    tiny_model.build(model_dir)
    t0 = time.monotonic()
    server = start_vllm(model_dir, **start_kwargs)
    print(f"vLLM ready at {server.address} in {time.monotonic() - t0:.0f} s", flush=True)
    try:
        yield server.address
    finally:
        server.stop()


def stop_process(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM ``proc`` (a server: it cancels its jobs and closes its sandboxes), SIGKILL it if it is still
    running after ``grace_s``, and reap it."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def print_table(rows: list[dict[str, Any]], cols: list[str]) -> None:
    """``rows`` as a fixed-width table of ``cols`` (floats with 2 decimals)."""
    print(" ".join(f"{c:>14}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]:>14.2f}" if isinstance(r[c], float) else f"{r[c]:>14}" for c in cols))
