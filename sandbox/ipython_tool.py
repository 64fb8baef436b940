"""The ``ipython`` tool: one persistent IPython kernel through jupyter-client's async API
(``AsyncKernelManager`` / ``AsyncKernelClient``), started lazily on the first cell.

The kernel runs as a child of the execution server, in the sandbox, with ``transport="ipc"`` (its sockets and
connection file live in the bound run directory) and without ``JPY_PARENT_PID`` (``independent=True``);
both are needed inside bubblewrap. jupyter-client is asyncio-based, so it lives in its own thread with its own
event loop; results are handed back to the execution server's loop with ``call_soon_threadsafe``.
Message shapes: Jupyter messaging protocol 5.x (``stream``, ``execute_result``, ``display_data``, ``error``,
``status``).
"""
from __future__ import annotations

import os
import queue
import re
import threading
import time
from functools import partial
from typing import Any, Callable, Optional

from .errors import KernelDiedError, ToolError
from .eventloop import EventLoop
from .limits import child_setup
from .sessions import record_session

KERNEL_START_TIMEOUT_S = 60.0
INTERRUPT_GRACE_S = 3.0
#: Characters of a cell's printed output and error kept (the rest is counted): the same 1 MiB as bash's output.
MAX_OUTPUT_CHARS = 1 << 20
#: Images (base64 PNG) kept per cell, and the largest kept, in characters.
MAX_IMAGES = 8
MAX_IMAGE_CHARS = 4 << 20
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

Done = Callable[[Optional[dict[str, Any]], Optional[BaseException]], None]


class IPythonSession:
    """Runs cells; ``run`` returns at once and calls ``done(result, error)`` on the server loop, ``result`` a
    dict of :class:`sandbox.spec.IPythonResult` fields, ``error`` a :class:`KernelDiedError` if the kernel
    died mid-cell (the next cell starts a fresh kernel)."""

    def __init__(self, loop: EventLoop, *, workspace: str, env: dict[str, str], run_dir: str,
                 limits: dict[str, Optional[int]], sessions_file: Optional[str] = None) -> None:
        self._loop = loop
        self._workspace = workspace
        self._env = {k: v for k, v in env.items() if k != "JPY_PARENT_PID"}
        # IPython's profile and Jupyter's runtime files go to the run directory, not into the agent's workspace
        # (HOME is the workspace) and not to a home directory that a leased sandbox uid does not have.
        for var, sub in (("IPYTHONDIR", "ipython"), ("JUPYTER_RUNTIME_DIR", "jupyter"),
                         ("JUPYTER_DATA_DIR", "jupyter"), ("JUPYTER_CONFIG_DIR", "jupyter"),
                         ("MPLCONFIGDIR", "matplotlib")):
            self._env.setdefault(var, os.path.join(run_dir, sub))
            os.environ.setdefault(var, os.path.join(run_dir, sub))
        os.environ.setdefault("HOME", run_dir)
        self._run_dir = run_dir
        self._limits = limits
        self._sessions_file = sessions_file
        self._aloop = None
        self._thread: Optional[threading.Thread] = None
        self._km = None
        self._kc = None

    @property
    def kernel_pid(self) -> Optional[int]:
        km = self._km
        prov = getattr(km, "provisioner", None) if km is not None else None
        return getattr(prov, "pid", None)

    def _ensure_thread(self) -> None:
        if self._thread is not None:
            return
        import asyncio

        self._aloop = asyncio.new_event_loop()
        ready = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(self._aloop)
            self._aloop.call_soon(ready.set)
            self._aloop.run_forever()

        self._thread = threading.Thread(target=main, name="ipython-kernel-client", daemon=True)
        self._thread.start()
        ready.wait()

    def run(self, code: str, timeout_s: float, done: Done) -> None:
        import asyncio

        self._ensure_thread()
        fut = asyncio.run_coroutine_threadsafe(self._execute(code, float(timeout_s)), self._aloop)

        def deliver(f) -> None:
            exc = f.exception()
            self._loop.call_soon_threadsafe(lambda: done(None, exc) if exc else done(f.result(), None))

        fut.add_done_callback(deliver)

    def close(self, timeout_s: float = 3.0) -> None:
        """Shut the kernel down (blocking, at most ``timeout_s``) and stop the thread."""
        if self._thread is None:
            return
        import asyncio

        fut = asyncio.run_coroutine_threadsafe(self._drop_kernel(), self._aloop)
        try:
            fut.result(timeout_s)
        except Exception:  # noqa: BLE001 - best effort: the sandbox is being torn down
            pid = self.kernel_pid
            if pid:
                try:
                    os.killpg(pid, 9)
                except OSError:
                    pass
        self._aloop.call_soon_threadsafe(self._aloop.stop)
        self._thread.join(timeout_s)
        self._thread = None

    # ------------------------------------------------------------------------------ in the kernel thread
    async def _ensure_kernel(self) -> None:
        if self._km is not None:
            return
        from jupyter_client import AsyncKernelManager

        km = AsyncKernelManager(transport="ipc", connection_file=os.path.join(self._run_dir, "kernel.json"))
        km.ip = os.path.join(self._run_dir, "kernel-ipc")
        await km.start_kernel(env=self._env, cwd=self._workspace, independent=True,
                              preexec_fn=partial(child_setup, self._limits))
        if self._sessions_file and getattr(km.provisioner, "pid", None):
            record_session(self._sessions_file, "kernel", km.provisioner.pid)
        kc = km.client()
        kc.start_channels()
        try:
            await kc.wait_for_ready(timeout=KERNEL_START_TIMEOUT_S)
        except RuntimeError as e:
            kc.stop_channels()
            await km.shutdown_kernel(now=True)
            raise ToolError(f"the IPython kernel did not start: {e}") from None
        self._km, self._kc = km, kc

    async def _drop_kernel(self) -> None:
        km, kc = self._km, self._kc
        self._km = self._kc = None
        if kc is not None:
            kc.stop_channels()
        if km is not None:
            try:
                if await km.is_alive():
                    await km.shutdown_kernel(now=True)
                else:
                    await km.cleanup_resources()
            except Exception:  # noqa: BLE001 - the kernel is gone or going; nothing else to do
                pass

    async def _execute(self, code: str, timeout_s: float) -> dict[str, Any]:
        t0 = time.monotonic()
        await self._ensure_kernel()
        km, kc = self._km, self._kc
        msg_id = kc.execute(code, store_history=True, allow_stdin=False)
        text: list[str] = []
        images: list[str] = []
        kept, dropped = 0, 0  # characters of output kept / beyond MAX_OUTPUT_CHARS (counted, not kept)

        def add(s: str) -> None:
            nonlocal kept, dropped
            room = MAX_OUTPUT_CHARS - kept
            if len(s) > room:
                dropped += len(s) - max(room, 0)
                s = s[:max(room, 0)]
            if s:
                text.append(s)
                kept += len(s)
        error: Optional[str] = None
        timed_out = False
        deadline = time.monotonic() + timeout_s
        interrupt_deadline: Optional[float] = None
        while True:
            now = time.monotonic()
            if not timed_out and now >= deadline:
                timed_out = True
                await km.interrupt_kernel()
                interrupt_deadline = now + INTERRUPT_GRACE_S
            if timed_out and now >= interrupt_deadline:
                await self._drop_kernel()
                error = (f"TimeoutError: the cell ran longer than {timeout_s:g} s and ignored the interrupt; "
                         "the kernel was restarted (its state is lost)")
                break
            wait = min(0.5, max(0.001, (interrupt_deadline if timed_out else deadline) - now))
            try:
                msg = await kc.get_iopub_msg(timeout=wait)
            except queue.Empty:
                if not await km.is_alive():
                    await self._drop_kernel()
                    partial_text = "".join(text)
                    raise KernelDiedError(
                        "The IPython kernel died while running the cell (its state is lost; the next cell starts a "
                        "fresh kernel)." + (f" Output before it died:\n{partial_text}" if partial_text else ""))
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                add(content.get("text", ""))
            elif kind in ("execute_result", "display_data"):
                data = content.get("data", {})
                if "image/png" in data and len(images) < MAX_IMAGES and len(data["image/png"]) <= MAX_IMAGE_CHARS:
                    images.append(data["image/png"].replace("\n", ""))
                if "text/plain" in data and (kind == "execute_result" or "image/png" not in data):
                    add(data["text/plain"] + "\n")
            elif kind == "error":
                tb = _ANSI.sub("", "\n".join(content.get("traceback", [])))
                error = f"{content.get('ename')}: {content.get('evalue')}\n{tb}"
            elif kind == "status" and content.get("execution_state") == "idle":
                break
        if timed_out and error is None or (timed_out and error and error.startswith("KeyboardInterrupt")):
            error = f"TimeoutError: the cell ran longer than {timeout_s:g} s and was interrupted"
        if dropped:
            text.append(f"\n[... {dropped} characters of output not kept]\n")
        if error is not None and len(error) > MAX_OUTPUT_CHARS:
            error = error[:MAX_OUTPUT_CHARS] + f"\n[... {len(error) - MAX_OUTPUT_CHARS} characters not kept]"
        return {"text": "".join(text), "images": images, "error": error, "timed_out": timed_out,
                "duration_s": time.monotonic() - t0}
