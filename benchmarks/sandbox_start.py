"""Sandbox start latency with every bound on (tmpfs sizes, memory cgroup where the host offers one, workspace
quota watch, seccomp filter, Python view), where its time goes, and what a warm pool hands out, each beside
the unbounded bubblewrap floor measured in this same run (issue #36).

Measured, in interleaved rounds (a slice of each per round, so a change of machine load moves a measurement
and its floor together):
- floor: a bare ``bwrap --unshare-all --die-with-parent`` of the host root running ``python -S -c pass``
  (the least any Python-served sandbox costs to start) and one running ``/bin/true``;
- cold start: ``runtime.start(spec)`` until the execution server answers, alone, with the per-step breakdown
  the runtime records (:attr:`sandbox.runtime.SandboxHandle.start_steps`);
- 64 concurrent cold starts: the wall time until all answer, and each start's latency;
- warm acquire: :meth:`sandbox.pool.SandboxPool.acquire` under 32 concurrent acquires from a full pool.
The spec is the math handler's (no network, 256 processes, 8 GiB address space). Closes are not timed.
Targets (#36): cold p50 < 20 ms, p99 < 40 ms; 64 concurrent starts < 1.5 s on 2 cores; acquire p50 < 2 ms,
p99 < 10 ms.

Usage: python benchmarks/sandbox_start.py [--starts 40] [--rounds 5] [--concurrent 64] [--acquires 32]
Prints a table and the breakdown; the last line is one JSON object.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from prorl_server.stats import percentile  # noqa: E402
from sandbox import Limits, SandboxSpec, make_runtime  # noqa: E402
from tool_latency import bwrap_floor  # noqa: E402 (benchmarks/, the script's folder): the bare bwrap floor

SPEC = SandboxSpec(network="none", limits=Limits(max_processes=256, max_memory_bytes=8 << 30))


class ArgvRecorder:
    """Wraps the runtime's ``build_command`` to keep the last launcher argv and environment, so that the parts of
    ``ready`` can be replayed with the same mounts (see :func:`replay`)."""

    def __init__(self, rt) -> None:
        self.rt, self.argv, self.env = rt, None, None
        build, launcher_env = rt.build_command, rt.launcher_env

        def build_command(spec, ctx):
            argv = build(spec, ctx)
            self.argv = list(argv)
            return argv

        def env(ctx):
            self.env = launcher_env(ctx)
            return self.env

        rt.build_command, rt.launcher_env = build_command, env


async def replay(rec: ArgvRecorder, tail: list[str]) -> float:
    """The recorded bwrap argv (same namespaces, mounts, seccomp filter) with ``tail`` in place of the execution
    server, spawned and waited for (ms): what ``ready`` spends before the server's own code runs."""
    argv = list(rec.argv)
    fds = []
    if "--seccomp" in argv:
        i = argv.index("--seccomp")
        fd = rec.rt.seccomp_fd()
        fds.append(fd)
        argv[i + 1] = str(fd)
    argv = argv[:argv.index("--") + 1] + tail
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(*argv, env=rec.env, pass_fds=fds, stdout=asyncio.subprocess.DEVNULL,
                                                stderr=asyncio.subprocess.DEVNULL)
    for fd in fds:
        os.close(fd)
    await proc.wait()
    return (time.perf_counter() - t0) * 1000


async def cold_starts(rt, rec: ArgvRecorder, n: int, steps: dict[str, list[float]]) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        h = await rt.start(SPEC)
        out.append((time.perf_counter() - t0) * 1000)
        for k, v in h.start_steps.items():
            steps.setdefault(k, []).append(v * 1000)
        # ready, replayed in parts while this sandbox's directories exist: bwrap's namespaces and mounts alone,
        # plus the interpreter's start, plus the execution server's imports (the rest of ready: its config,
        # listen, the host's connect and the first answer).
        python = rec.argv[rec.argv.index("--") + 1]
        for name, tail in (("ready.bwrap_mounts", ["/bin/true"]), ("ready.+python", [python, "-S", "-c", "pass"]),
                           ("ready.+imports", [python, "-S", "-c", "import sandbox.exec_server"])):
            steps.setdefault(name, []).append(await replay(rec, tail))
        await h.close()
    return out


async def concurrent_starts(rt, n: int) -> tuple[float, list[float]]:
    """Wall time (ms) of ``n`` starts at once, and each start's latency (ms)."""
    async def one() -> tuple[float, object]:
        t0 = time.perf_counter()
        h = await rt.start(SPEC)
        return (time.perf_counter() - t0) * 1000, h

    t0 = time.perf_counter()
    res = await asyncio.gather(*(one() for _ in range(n)))
    wall = (time.perf_counter() - t0) * 1000
    await asyncio.gather(*(h.close() for _, h in res))
    return wall, [ms for ms, _ in res]


async def warm_acquires(rt, n: int) -> tuple[list[float], dict]:
    """``n`` concurrent acquires from a pool of ``n`` started sandboxes (ms each), and the pool's counters."""
    from sandbox.pool import SandboxPool

    pool = SandboxPool(rt, size=n)
    pool.register(SPEC)
    await pool.wait_full(SPEC, timeout_s=120)

    async def one() -> tuple[float, object]:
        t0 = time.perf_counter()
        h = await pool.acquire(SPEC)
        return (time.perf_counter() - t0) * 1000, h

    res = await asyncio.gather(*(one() for _ in range(n)))
    stats = dict(pool.counters)
    await asyncio.gather(*(h.close() for _, h in res))
    await pool.close()
    return [ms for ms, _ in res], stats


def stat(xs: list[float]) -> dict[str, float]:
    # min beside the percentiles: on a shared host other load moves p50/p99 by tens of ms, the least far less
    return {"min": round(min(xs), 2), "p50": round(percentile(xs, 50), 2), "p99": round(percentile(xs, 99), 2),
            "n": len(xs)}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--starts", type=int, default=40, help="sequential cold starts")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrent", type=int, default=64, help="cold starts at once")
    ap.add_argument("--acquires", type=int, default=32, help="concurrent acquires from a full warm pool")
    ap.add_argument("--no-pool", action="store_true", help="skip the warm pool (a tree without sandbox.pool)")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="prorl-sb-")
    rt = make_runtime("bubblewrap", state_dir=os.path.join(tmp, "s"), workspace_root=os.path.join(tmp, "w"),
                      loopback_dir=os.path.join(tmp, "l"))
    k = max(1, args.starts // args.rounds)
    rec = ArgvRecorder(rt)
    got: dict[str, list[float]] = {}
    steps: dict[str, list[float]] = {}
    try:
        await rt.close_all()
        h = await rt.start(SPEC)  # the Python view and the bytecode are built once per server: not measured
        await h.close()
        for _ in range(args.rounds):
            for key, xs in (("floor_bwrap_python", await bwrap_floor(k, python=True)),
                            ("floor_bwrap_true", await bwrap_floor(k, python=False)),
                            ("cold", await cold_starts(rt, rec, k, steps))):
                got.setdefault(key, []).extend(xs)
        wall, each = await concurrent_starts(rt, args.concurrent)
        got["concurrent"] = each
        warm, counters = ([], {}) if args.no_pool else await warm_acquires(rt, args.acquires)
    finally:
        await rt.close_all()
        shutil.rmtree(tmp, ignore_errors=True)
    s = {key: stat(xs) for key, xs in got.items()}
    if warm:
        s["warm_acquire"] = stat(warm)
    print(f"{'measure':44} {'min ms':>9} {'p50 ms':>9} {'p99 ms':>9} {'n':>5}")
    for key, label in (("cold", "cold start, alone (all bounds on)"),
                       ("concurrent", f"cold start, {args.concurrent} at once (each)"),
                       ("warm_acquire", f"warm acquire, {args.acquires} at once"),
                       ("floor_bwrap_python", "floor: bwrap python -S -c pass"),
                       ("floor_bwrap_true", "floor: bwrap /bin/true")):
        if key in s:
            print(f"{label:44} {s[key]['min']:>9.2f} {s[key]['p50']:>9.2f} {s[key]['p99']:>9.2f} {s[key]['n']:>5}")
    print(f"{args.concurrent} concurrent starts: all ready in {wall:.0f} ms (target < 1500 ms on 2 cores)")
    print("breakdown of a cold start (p50 ms per step, sum of p50s "
          f"{sum(percentile(v, 50) for n, v in steps.items() if '.' not in n):.1f}; ready.* replay ready's "
          "parts, each including the one before):")
    for name, xs in steps.items():
        print(f"  {name:10} {percentile(xs, 50):7.2f}")
    if counters:
        print(f"pool counters: {counters}")
    print(json.dumps({
        "cold_p50_ms": s["cold"]["p50"], "cold_p99_ms": s["cold"]["p99"], "cold_min_ms": s["cold"]["min"],
        "concurrent_n": args.concurrent, "concurrent_wall_ms": round(wall, 1),
        "concurrent_p50_ms": s["concurrent"]["p50"], "concurrent_p99_ms": s["concurrent"]["p99"],
        "warm_acquire_p50_ms": s.get("warm_acquire", {}).get("p50"),
        "warm_acquire_p99_ms": s.get("warm_acquire", {}).get("p99"),
        "floor_bwrap_python_p50_ms": s["floor_bwrap_python"]["p50"],
        "floor_bwrap_true_p50_ms": s["floor_bwrap_true"]["p50"],
        "floor_bwrap_python_min_ms": s["floor_bwrap_python"]["min"],
        "cold_over_floor": round(s["cold"]["p50"] / s["floor_bwrap_python"]["p50"], 2),
        "steps_p50_ms": {n: round(percentile(v, 50), 2) for n, v in steps.items()},
        "cpus": os.cpu_count(), "load1": round(os.getloadavg()[0], 2)}))


if __name__ == "__main__":
    asyncio.run(main())
