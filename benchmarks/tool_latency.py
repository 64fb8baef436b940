"""Tool latency through the whole path (host asyncio client → Unix socket → execution server in a bubblewrap
sandbox → pty bash / IPython kernel / editor), each beside its floor measured in this same run, plus the
tmux send-keys/capture-pane bash that other rollout systems use as the baseline.

Floors: a bare persistent pty bash driven directly by this process (no socket, no sandbox); a bare
jupyter-client AsyncKernelManager/AsyncKernelClient in this process; an asyncio Unix-socket JSON-line echo;
a bare bwrap running /bin/true and one running ``python -S -c pass`` (the least any Python-served sandbox
costs to start). The machine's load moves all of these together: compare ratios, not absolute numbers.
Targets (issue 3): bash builtin p50 < 1 ms and >= 10x faster than tmux; ipython within 1.5x of bare
jupyter-client; bubblewrap sandbox start p50 < 50 ms (kernel started lazily, so not included).

Usage: python benchmarks/tool_latency.py [--n 200] [--starts 30]
Prints medians, p95 and ratios; the last line is one JSON object.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sandbox import SandboxSpec, make_runtime  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def summary(xs: list[float]) -> dict[str, float]:
    return {"p50": statistics.median(xs), "p95": pct(xs, 0.95), "n": len(xs)}


# --------------------------------------------------------------------------------------------------- floors
def floor_pty_bash(n: int, command: str) -> list[float]:
    """Bare persistent bash on a pty, same prompt-marker technique, no socket and no sandbox (ms)."""
    import ptyprocess

    nonce = secrets.token_hex(8)
    marker = re.compile((r"\x1e" + nonce + r":(\d+)\x1f").encode())
    p = ptyprocess.PtyProcess.spawn(["/bin/bash", "--noediting", "--norc", "--noprofile", "-i"], echo=False)

    def until_marker() -> None:
        buf = b""
        while not marker.search(buf):
            buf += os.read(p.fd, 65536)

    os.write(p.fd, f"PS1=$'\\x1e'{nonce}:'$?'$'\\x1f'; PS2=''; stty -echo\n".encode())
    until_marker()
    out = []
    line = (command + "\n").encode()
    for _ in range(n + 10):
        t0 = time.perf_counter()
        os.write(p.fd, line)
        until_marker()
        out.append((time.perf_counter() - t0) * 1000)
    p.terminate(force=True)
    return out[10:]


async def floor_ipython(n: int) -> list[float]:
    """Bare jupyter-client (in-process async API), ``1+1`` until the kernel is idle again (ms)."""
    from jupyter_client import AsyncKernelManager

    km = AsyncKernelManager()
    await km.start_kernel()
    kc = km.client()
    kc.start_channels()
    await kc.wait_for_ready(timeout=60)
    out = []
    try:
        for _ in range(n + 5):
            t0 = time.perf_counter()
            msg_id = kc.execute("1+1")
            while True:
                msg = await kc.get_iopub_msg(timeout=30)
                if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                        and msg["content"]["execution_state"] == "idle"):
                    break
            out.append((time.perf_counter() - t0) * 1000)
    finally:
        kc.stop_channels()
        await km.shutdown_kernel(now=True)
    return out[5:]


async def floor_uds(n: int) -> list[float]:
    """asyncio Unix-socket JSON-line echo round trip (ms)."""
    d = tempfile.mkdtemp(prefix="prorl-uds-")
    path = os.path.join(d, "s")

    async def echo(reader, writer):
        while line := await reader.readline():
            writer.write(json.dumps(json.loads(line)).encode() + b"\n")

    server = await asyncio.start_unix_server(echo, path)
    reader, writer = await asyncio.open_unix_connection(path)
    out = []
    for i in range(n + 10):
        t0 = time.perf_counter()
        writer.write(json.dumps({"id": i, "op": "ping"}).encode() + b"\n")
        json.loads(await reader.readline())
        out.append((time.perf_counter() - t0) * 1000)
    writer.close()
    server.close()
    shutil.rmtree(d, ignore_errors=True)
    return out[10:]


async def floor_bwrap(n: int, python: bool) -> list[float]:
    """Bare ``bwrap --unshare-all --die-with-parent`` of the host root running ``/bin/true`` or
    ``python -S -c pass``, spawned from asyncio and waited for (ms): the floor of a sandbox start."""
    cmd = ["bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev"]
    cmd += [sys.executable, "-S", "-c", "pass"] if python else ["/bin/true"]
    out = []
    for _ in range(n + 2):
        t0 = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(*cmd)
        await proc.wait()
        out.append((time.perf_counter() - t0) * 1000)
    return out[2:]


def tmux_bash(n: int) -> list[float]:
    """The baseline: tmux send-keys, then capture-pane polled (no sleep between polls) until the command's
    end marker shows (ms)."""
    sock = f"prorl-bench-{os.getpid()}"
    tmux = ["tmux", "-L", sock]
    subprocess.run(tmux + ["new-session", "-d", "-s", "b", "-x", "200", "-y", "50", "bash --norc --noprofile"],
                   check=True)
    out = []
    try:
        for i in range(n + 3):
            mark = f"DONE{i}x"
            t0 = time.perf_counter()
            subprocess.run(tmux + ["send-keys", "-t", "b", f"echo hi; echo {mark[:4]}''{mark[4:]}", "Enter"],
                           check=True)
            while True:
                cap = subprocess.run(tmux + ["capture-pane", "-p", "-t", "b"], capture_output=True, text=True).stdout
                if re.search(rf"^{mark}$", cap, re.M):
                    break
            out.append((time.perf_counter() - t0) * 1000)
            if i % 20 == 0:
                subprocess.run(tmux + ["send-keys", "-t", "b", "clear", "Enter"], check=True)
                subprocess.run(tmux + ["clear-history", "-t", "b"], check=True)
    finally:
        subprocess.run(tmux + ["kill-server"], capture_output=True)
    return out[3:]


# -------------------------------------------------------------------------------------------------- project
async def timed(n: int, fn) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


async def project(n: int, starts: int, state_dir: str) -> dict[str, list[float]]:
    rt = make_runtime("bubblewrap", state_dir=state_dir, workspace_root=os.path.join(state_dir, "ws"))
    res: dict[str, list[float]] = {"start": [], "close": []}
    for _ in range(starts + 2):
        t0 = time.perf_counter()
        h = await rt.start(SandboxSpec())
        t1 = time.perf_counter()
        await h.close()
        res["start"].append((t1 - t0) * 1000)
        res["close"].append((time.perf_counter() - t1) * 1000)
    res["start"], res["close"] = res["start"][2:], res["close"][2:]
    h = await rt.start(SandboxSpec())
    try:
        await h.bash("true")
        await h.editor("create", "f.py", file_text="".join(f"line {i}\n" for i in range(100)))
        await timed(10, lambda: h.bash("echo hi"))
        res["bash_builtin"] = await timed(n, lambda: h.bash("echo hi"))
        res["bash_fork"] = await timed(n, lambda: h.bash("/bin/true"))
        res["editor_view"] = await timed(n, lambda: h.editor("view", "f.py"))
        await h.ipython("1+1")  # starts the kernel (lazy)
        await timed(5, lambda: h.ipython("1+1"))
        res["ipython"] = await timed(n, lambda: h.ipython("1+1"))
    finally:
        await h.close()
    return res


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=200, help="calls per tool")
    ap.add_argument("--starts", type=int, default=30, help="sandbox start/close cycles")
    args = ap.parse_args()
    state_dir = tempfile.mkdtemp(prefix="prorl-bench-")
    try:
        floors = {"bash_builtin": floor_pty_bash(args.n, "echo hi"), "bash_fork": floor_pty_bash(args.n, "/bin/true"),
                  "ipython": await floor_ipython(args.n), "uds": await floor_uds(args.n),
                  "bwrap_true": await floor_bwrap(args.starts, python=False),
                  "bwrap_python": await floor_bwrap(args.starts, python=True)}
        proj = await project(args.n, args.starts, state_dir)
        tmux = tmux_bash(min(args.n, 100)) if shutil.which("tmux") else None
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)

    rows = [("bash builtin `echo hi`", "bash_builtin", "bash_builtin"),
            ("bash fork+exec `/bin/true`", "bash_fork", "bash_fork"),
            ("ipython `1+1`", "ipython", "ipython"),
            ("editor view (100 lines)", "editor_view", "uds"),
            ("sandbox start (bwrap, until ready)", "start", "bwrap_python"),
            ("sandbox close (no process left)", "close", None)]
    print(f"{'measure':38} {'p50 ms':>9} {'p95 ms':>9} {'floor p50':>10} {'ratio':>7}")
    for label, key, fkey in rows:
        s = summary(proj[key])
        f = summary(floors[fkey])["p50"] if fkey else None
        fs = f"{f:.3f}" if f is not None else "-"
        ratio = f"{s['p50'] / f:.2f}x" if f else "-"
        print(f"{label:38} {s['p50']:9.3f} {s['p95']:9.3f} {fs:>10} {ratio:>7}")
    for label, key in (("floor: UDS JSON-line echo", "uds"), ("floor: bwrap /bin/true", "bwrap_true"),
                       ("floor: bwrap python -S -c pass", "bwrap_python")):
        print(f"{label:38} {summary(floors[key])['p50']:9.3f} {summary(floors[key])['p95']:9.3f}")
    builtin = summary(proj["bash_builtin"])["p50"]
    if tmux:
        t = summary(tmux)
        print(f"{'baseline: tmux send-keys/capture-pane':38} {t['p50']:9.3f} {t['p95']:9.3f} {'':>10} "
              f"{'':>7}\n  -> project bash builtin is {t['p50'] / builtin:.1f}x faster than tmux (target >= 10x)")
    ip, fip = summary(proj["ipython"])["p50"], summary(floors["ipython"])["p50"]
    print(f"  -> bash builtin p50 {builtin:.3f} ms (target < 1 ms); ipython {ip / fip:.2f}x bare jupyter-client "
          f"(target <= 1.5x); start p50 {summary(proj['start'])['p50']:.1f} ms (target < 50 ms)")
    print(json.dumps({
        "bash_builtin_p50_ms": round(builtin, 4),
        "bash_builtin_p95_ms": round(summary(proj["bash_builtin"])["p95"], 4),
        "bash_fork_p50_ms": round(summary(proj["bash_fork"])["p50"], 4),
        "ipython_p50_ms": round(ip, 4),
        "editor_view_p50_ms": round(summary(proj["editor_view"])["p50"], 4),
        "tmux_bash_p50_ms": round(summary(tmux)["p50"], 4) if tmux else None,
        "sandbox_start_p50_ms": round(summary(proj["start"])["p50"], 4),
        "sandbox_close_p50_ms": round(summary(proj["close"])["p50"], 4),
        "floor_bash_p50_ms": round(summary(floors["bash_builtin"])["p50"], 4),
        "floor_bash_fork_p50_ms": round(summary(floors["bash_fork"])["p50"], 4),
        "floor_ipython_p50_ms": round(fip, 4),
        "floor_uds_p50_ms": round(summary(floors["uds"])["p50"], 4),
        "floor_bwrap_true_p50_ms": round(summary(floors["bwrap_true"])["p50"], 4),
        "floor_bwrap_python_p50_ms": round(summary(floors["bwrap_python"])["p50"], 4),
        "tmux_over_bash_builtin": round(summary(tmux)["p50"] / builtin, 2) if tmux else None,
        "ipython_over_floor": round(ip / fip, 3),
    }))


if __name__ == "__main__":
    asyncio.run(main())
