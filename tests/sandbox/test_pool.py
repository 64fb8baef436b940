"""The warm sandbox pool (#36 part 3): handed out once, never dead, bounded and counted like any sandbox, a
pool that cannot refill falls back to cold starts and says so, and a server SIGKILLed with a full pool leaves
nothing after the next server's reap."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys

import psutil
import pytest

from sandbox import Bind, Limits, SandboxSpec, SandboxStartError, make_runtime
from sandbox.pool import SandboxPool
from tests.sandbox.conftest import BWRAP_UNAVAILABLE

pytestmark = [pytest.mark.real, pytest.mark.skipif(bool(BWRAP_UNAVAILABLE), reason=str(BWRAP_UNAVAILABLE))]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPEC = SandboxSpec(network="none", limits=Limits(max_processes=256))


@contextlib.asynccontextmanager
async def full_pool(runtime, size: int = 1, spec: SandboxSpec = SPEC, **kw):
    """A :class:`SandboxPool` of ``runtime`` holding ``size`` started sandboxes of ``spec`` (waited for, 60 s),
    closed on exit."""
    pool = SandboxPool(runtime, size=size, **kw)
    try:
        pool.register(spec)
        await pool.wait_full(spec, 60)
        yield pool
    finally:
        await pool.close()


async def _refilled(pool: SandboxPool, spec: SandboxSpec, n: int) -> None:
    for _ in range(600):
        if pool.ready_count(spec) >= n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"pool did not refill to {n}: {pool.ready_count(spec)} ready, {pool.counters}")


async def test_a_pooled_sandbox_is_handed_out_once_bounded_and_destroyed_after_its_job(bwrap_runtime):
    pool = SandboxPool(bwrap_runtime, size=2)
    try:
        assert pool.register(SPEC)
        await pool.wait_full(SPEC, 60)
        waiting = {h.sandbox_id for h in bwrap_runtime.handles}
        a, b = await pool.acquire(SPEC), await pool.acquire(SPEC)
        assert {a.sandbox_id, b.sandbox_id} == waiting and pool.counters["hits"] == 2
        # fully bounded, and one of the runtime's sandboxes (its watch, leases, records, close_all)
        assert a.bounds.workspace_bytes and a.bounds.tmpfs_bytes and a in bwrap_runtime.handles
        assert (await a.bash("echo $((6*7)) > f; cat f")).output.strip() == "42"
        workspace = a.workspace
        await a.close()  # the job is done with it: destroyed, never put back
        assert not os.path.exists(workspace)
        await _refilled(pool, SPEC, 2)
        later = {(await pool.acquire(SPEC)).sandbox_id for _ in range(2)}
        assert not later & {a.sandbox_id, b.sandbox_id}
    finally:
        await pool.close()


async def test_a_pooled_sandbox_that_died_while_waiting_is_never_handed_out(bwrap_runtime):
    pool = SandboxPool(bwrap_runtime, size=1)
    try:
        pool.register(SPEC)
        await pool.wait_full(SPEC, 60)
        (victim,) = bwrap_runtime.handles
        # killed from outside while it waited (an OOM kill of the node, an admin's kill): its whole group
        server = psutil.Process(victim._client.peer_pid)
        os.killpg(victim.pid, signal.SIGKILL)
        server.wait(10)
        got = await pool.acquire(SPEC)
        assert got.sandbox_id != victim.sandbox_id
        assert (await got.bash("echo alive")).output.strip() == "alive"
        assert pool.counters["dead"] == 1
        for _ in range(100):  # the dead one is closed in the background: leases, cgroup and directories released
            if victim not in bwrap_runtime.handles:
                break
            await asyncio.sleep(0.05)
        assert victim not in bwrap_runtime.handles and not os.path.exists(victim.workspace)
    finally:
        await pool.close()


async def test_a_dead_execution_server_is_caught_even_while_its_launcher_lives(bwrap_runtime):
    pool = SandboxPool(bwrap_runtime, size=1)
    try:
        pool.register(SPEC)
        await pool.wait_full(SPEC, 60)
        (victim,) = bwrap_runtime.handles
        server = psutil.Process(victim._client.peer_pid)
        server.kill()
        # Waited for without running the event loop: the host has not seen the launcher's exit nor the
        # connection's end yet, so only the acquire's own check of the connection can catch the death.
        server.wait(10)
        assert victim.alive
        got = await pool.acquire(SPEC)
        assert got.sandbox_id != victim.sandbox_id and pool.counters["dead"] == 1
    finally:
        await pool.close()


async def test_a_pool_that_cannot_refill_falls_back_to_cold_starts_and_says_so(runtime_options):
    # The workspace root is a file: every start fails to make its workspace (as on a full or read-only disk).
    ws_root = runtime_options["workspace_root"]
    with open(ws_root, "w"):
        pass
    rt = make_runtime("bubblewrap", **runtime_options)
    pool = SandboxPool(rt, size=2, retry_s=0.2)
    try:
        pool.register(SPEC)
        for _ in range(200):
            if pool.degraded:
                break
            await asyncio.sleep(0.05)
        assert pool.degraded == [SPEC] and pool.counters["refill_failures"] >= 1
        with pytest.raises(SandboxStartError):  # the cold start fails too while the disk is broken
            await pool.acquire(SPEC)
        os.unlink(ws_root)  # the disk is back
        h = await pool.acquire(SPEC)
        assert (await h.bash("echo cold")).output.strip() == "cold"
        assert pool.counters["cold_fallbacks"] >= 1 and pool.counters["hits"] == 0
        await _refilled(pool, SPEC, 2)
        assert pool.degraded == []
        await h.close()
    finally:
        await pool.close()
        await rt.close_all()


async def test_specs_with_per_job_host_state_are_never_pooled(bwrap_runtime, short_tmp):
    pool = SandboxPool(bwrap_runtime, size=2)
    try:
        spec = SandboxSpec(binds=[Bind(host=short_tmp, container="/data", ro=True)])
        assert not pool.register(spec)
        h = await pool.acquire(spec)
        assert pool.ready_count() == 0 and bwrap_runtime.handles == [h]
        assert not pool.register(SandboxSpec(workspace=os.path.join(short_tmp, "w")))
        off = SandboxPool(bwrap_runtime, size=0)
        assert not off.register(SPEC)
    finally:
        await pool.close()


# A server that fills a pool of three, prints the sandboxes' launcher pids, and waits to be SIGKILLed.
FULL_POOL_SERVER = r"""
import asyncio, json, sys
from sandbox import Limits, SandboxSpec, make_runtime
from sandbox.pool import SandboxPool

async def main():
    rt = make_runtime("bubblewrap", **json.loads(sys.argv[1]))
    pool = SandboxPool(rt, size=3)
    spec = SandboxSpec(network="none", limits=Limits(max_processes=256))
    pool.register(spec)
    await pool.wait_full(spec, 120)
    print(json.dumps([h.pid for h in rt.handles]), flush=True)
    await asyncio.sleep(1000)

asyncio.run(main())
"""


async def test_a_server_killed_with_a_full_pool_leaves_nothing_after_the_next_reap(runtime_options):
    server = await asyncio.create_subprocess_exec(sys.executable, "-c", FULL_POOL_SERVER,
                                                  json.dumps(runtime_options), cwd=REPO,
                                                  stdout=asyncio.subprocess.PIPE)
    try:
        line = await asyncio.wait_for(server.stdout.readline(), 120)
    finally:
        server.kill()
    await server.wait()
    pids = json.loads(line)
    assert len(pids) == 3
    run_root = os.path.join(runtime_options["state_dir"], "run")
    assert len(os.listdir(run_root)) == 3  # the crash left the pool's directories (else this proves nothing)

    rt = make_runtime("bubblewrap", **runtime_options)
    assert await rt.reap_orphans() == 3
    assert os.listdir(run_root) == [] and os.listdir(runtime_options["workspace_root"]) == []
    assert rt.store.records() == []
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == []
    shutil.rmtree(runtime_options["state_dir"], ignore_errors=True)


async def test_the_server_pools_its_handlers_sandboxes_and_counts_on_metrics(runtime_options):
    from handlers.code.task import sandbox_spec
    from prorl_server.app import build_components
    from prorl_server.config import ServerSettings
    from prorl_server.plugin.registry import HandlerRegistry

    assert ServerSettings().sandbox_pool_size > 0  # on by default
    c = build_components(ServerSettings(sandbox_runtime="bubblewrap", sandbox_options=runtime_options,
                                        sandbox_pool_size=1), HandlerRegistry())
    try:
        spec = sandbox_spec()  # the code handler's run sandbox
        first = await c.services.sandbox_opener(spec)  # a cold start; the spec is pooled from now on
        await c.sandbox_pool.wait_full(spec, 60)
        second = await c.services.sandbox_opener(sandbox_spec())
        assert second.sandbox_id != first.sandbox_id
        text = c.metrics.render().decode()
        assert "prorl_sandbox_pool_hits_total 1.0" in text and "prorl_sandbox_pool_misses_total 1.0" in text
    finally:
        await c._close_sandboxes()
    assert c.runtime.handles == []


# Fault injection: stands for a launcher that the scheduler holds up before bwrap arms --die-with-parent (the
# window a SIGKILL of the server can land in: bwrap's PR_SET_PDEATHSIG then names init, not the dead server).
SLOW_LAUNCHER = """#!/bin/sh
if [ "$1" != "--help" ]; then echo $$ >> {pids}; sleep {delay}; fi
exec {bwrap} "$@"
"""

# A server whose pool refill is under way (its launcher held up) when the test SIGKILLs it.
REFILLING_SERVER = r"""
import asyncio, json, sys
from sandbox import Limits, SandboxSpec, make_runtime
from sandbox.pool import SandboxPool

async def main():
    rt = make_runtime("bubblewrap", **json.loads(sys.argv[1]))
    pool = SandboxPool(rt, size=1)
    pool.register(SandboxSpec(network="none", limits=Limits(max_processes=256)))
    await asyncio.sleep(1000)

asyncio.run(main())
"""


async def test_a_server_killed_mid_refill_leaves_no_sandbox_process(runtime_options, short_tmp):
    pids_file = os.path.join(short_tmp, "launchers")
    launcher = os.path.join(short_tmp, "slow-bwrap")
    with open(launcher, "w") as f:
        f.write(SLOW_LAUNCHER.format(pids=pids_file, delay=1, bwrap=shutil.which("bwrap")))
    os.chmod(launcher, 0o755)
    options = {**runtime_options, "bwrap": launcher, "uid_lease_dir": os.path.join(short_tmp, "uids")}
    server = await asyncio.create_subprocess_exec(sys.executable, "-c", REFILLING_SERVER, json.dumps(options),
                                                  cwd=REPO)
    seen: set[psutil.Process] = set()
    try:
        for _ in range(600):
            if os.path.exists(pids_file) and open(pids_file).read().strip():
                break
            await asyncio.sleep(0.05)
        server.kill()  # while the refill's launcher is held up, before bwrap's --die-with-parent
        await server.wait()
        launcher = psutil.Process(int(open(pids_file).read().split()[0]))
        seen.add(launcher)
        went_on = False  # the launcher exec'd bwrap (same pid) after the server's death
        deadline = asyncio.get_running_loop().time() + 15
        while asyncio.get_running_loop().time() < deadline:
            try:
                went_on = went_on or launcher.name() == "bwrap"
            except psutil.Error:
                pass
            for p in list(seen):
                try:
                    seen.update(p.children(recursive=True))
                except psutil.Error:
                    pass
            alive = [p for p in seen if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            if not alive:
                break
            await asyncio.sleep(0.005)  # bwrap lives at least an interpreter's start (~15 ms): seen
        # the launcher did go on into the sandbox (else this proves nothing) and nothing of it outlived the server
        assert went_on, "the held-up launcher never started its sandbox"
        assert alive == [], [p.cmdline() for p in alive]
    finally:
        if server.returncode is None:
            server.kill()
        for p in seen:
            try:
                p.kill()
            except psutil.Error:
                pass
        await make_runtime("bubblewrap", **options).reap_orphans()


async def test_a_pooled_sandbox_whose_server_was_stopped_is_replaced_not_handed_out(bwrap_runtime):
    # Red team F6: a SIGSTOPped execution server keeps its connection open, so the poll check passed it and the
    # job that got it waited out its first call's timeout (30 s counted).
    pool = SandboxPool(bwrap_runtime, size=1)
    try:
        pool.register(SPEC)
        await pool.wait_full(SPEC, 60)
        (victim,) = bwrap_runtime.handles
        server = psutil.Process(victim._client.peer_pid)
        server.suspend()  # SIGSTOP by the same uid, while it waits in the pool
        for _ in range(200):  # the stop lands when the kernel next schedules it
            if server.status() == psutil.STATUS_STOPPED:
                break
            await asyncio.sleep(0.01)
        got = await asyncio.wait_for(pool.acquire(SPEC), 20)
        assert got.sandbox_id != victim.sandbox_id and pool.counters["dead"] == 1
        assert (await got.bash("echo alive", timeout_s=5)).output.strip() == "alive"
        for _ in range(200):  # the stopped one is closed in the background (SIGKILL ends a stopped process)
            if victim not in bwrap_runtime.handles:
                break
            await asyncio.sleep(0.05)
        assert victim not in bwrap_runtime.handles and not os.path.exists(victim.workspace)
        await got.close()
    finally:
        await pool.close()


async def test_closing_a_full_pool_is_bounded_and_waits_for_no_grace(runtime_options):
    # Red team F9: a server's SIGTERM with a full pool took 2.7 s under load, each waiting sandbox granted its
    # SIGTERM grace (2 s by default) though nothing of a job is inside one. Fault injection: one execution
    # server stopped (SIGSTOP) stands for one a loaded machine does not schedule within the grace.
    rt = make_runtime("bubblewrap", **{**runtime_options, "close_grace_s": 2.0})
    pool = SandboxPool(rt, size=8, refill_concurrency=4)
    try:
        pool.register(SPEC)
        await pool.wait_full(SPEC, 120)
        psutil.Process(rt.handles[0]._client.peer_pid).suspend()
        workspaces = [h.workspace for h in rt.handles]
        t0 = asyncio.get_running_loop().time()
        await pool.close()
        took = asyncio.get_running_loop().time() - t0
        print(f"closing a pool of 8 took {took:.3f} s")
        assert took < 1.0, f"closing a pool of 8 took {took:.2f} s"  # before: >= 1.0 (half the grace, always)
        assert rt.handles == [] and not any(os.path.exists(w) for w in workspaces)
    finally:
        await pool.close()
        await rt.close_all()
