"""Process ownership and faults: close leaves nothing, outside kills and hangs become clear errors, limits
hold, and a crashed server's sandboxes are reaped (exactly those) by the next one."""
from __future__ import annotations

import asyncio
import fcntl
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from sandbox import (SandboxClosedError, SandboxDeadError, SandboxError, SandboxSpec, SandboxStartError,
                     ToolTimeout, make_runtime)
from sandbox.ownership import process_identity

pytestmark = [pytest.mark.real]


async def test_close_leaves_no_process_even_daemonised_ones(bwrap_runtime, procs):
    h = await bwrap_runtime.start()
    await h.bash("sleep 1000 & nohup sleep 1001 >/dev/null 2>&1 & setsid sleep 1002 & disown -a")
    await h.ipython("import subprocess; p = subprocess.Popen(['sleep', '1003'])")
    pids = {p.pid for p in procs.of(h)}
    names = [psutil.Process(p).name() for p in pids]
    assert names.count("sleep") == 4 and len(pids) >= 7  # bwrap x2, server, bash, kernel, sleeps
    await h.close()
    procs.assert_gone(pids)
    assert not os.path.exists(h.workspace)
    assert bwrap_runtime.store.records() == []
    uid_leases = bwrap_runtime._uid_lease_dir
    assert not os.path.exists(uid_leases) or os.listdir(uid_leases) == []  # its uid is free again


async def test_close_is_idempotent_and_later_calls_raise_closed(bwrap_runtime):
    h = await bwrap_runtime.start()
    await asyncio.gather(h.close(), h.close())
    await h.close()
    assert not h.alive
    with pytest.raises(SandboxClosedError, match="closed"):
        await h.bash("echo hi")


@pytest.mark.parametrize("victim", ["process group", "execution server"])
async def test_sandbox_killed_from_outside_mid_command_raises_dead_error(bwrap_runtime, procs, victim):
    h = await bwrap_runtime.start()
    pids = {p.pid for p in procs.of(h)}
    task = asyncio.create_task(h.bash("sleep 60", timeout_s=60))
    await asyncio.sleep(0.5)
    live = procs.of(h)
    pids |= {p.pid for p in live}
    if victim == "process group":
        os.killpg(h.pid, signal.SIGKILL)
    else:  # e.g. the OOM killer picking the server inside
        [server] = [p for p in live if p.name().startswith("python")]
        server.kill()
    t0 = time.monotonic()
    with pytest.raises(SandboxDeadError, match="died"):
        await task
    assert time.monotonic() - t0 < 5
    assert not h.alive
    with pytest.raises(SandboxDeadError):
        await h.bash("echo hi")
    await h.close()
    procs.assert_gone(pids)


async def test_frozen_sandbox_raises_tool_timeout_instead_of_hanging(bwrap_runtime, monkeypatch, procs):
    import sandbox.runtime

    monkeypatch.setattr(sandbox.runtime, "SERVER_GRACE_S", 1.0)
    h = await bwrap_runtime.start()
    frozen = procs.of(h)
    for p in frozen:
        p.suspend()
    t0 = time.monotonic()
    with pytest.raises(ToolTimeout, match="unresponsive"):
        await h.bash("echo hi", timeout_s=0.5)
    assert time.monotonic() - t0 < 5
    for p in frozen:
        p.resume()
    await h.close()
    procs.assert_gone({p.pid for p in frozen})


async def test_fork_bomb_is_held_to_max_processes(bwrap_runtime, procs):
    h = await bwrap_runtime.start(SandboxSpec(limits={"max_processes": 40}))
    # A bounded bomb (300 forks) so that a broken limit cannot take the test machine down with it.
    r = await h.bash("for i in $(seq 300); do sleep 100 & done; echo spawned", timeout_s=3)
    live = procs.of(h)
    assert len(live) <= 40 + 3, f"{len(live)} processes despite max_processes=40"  # + bwrap x2 (root)
    assert "Resource temporarily unavailable" in r.output
    pids = {p.pid for p in live}
    await h.close()
    procs.assert_gone(pids)


async def test_process_limit_of_one_sandbox_does_not_starve_another(bwrap_runtime):
    spec = SandboxSpec(limits={"max_processes": 30})
    full, other = await bwrap_runtime.start(spec), await bwrap_runtime.start(spec)
    r = await full.bash("for i in $(seq 60); do sleep 100 & done", timeout_s=2)
    assert "Resource temporarily unavailable" in r.output
    r = await other.bash("for i in $(seq 10); do sleep 100 & done; jobs | wc -l", timeout_s=5)
    assert r.output.strip().endswith("10") and "unavailable" not in r.output
    await full.close()
    await other.close()


async def test_memory_limit_stops_allocation_not_the_sandbox(bwrap_runtime):
    h = await bwrap_runtime.start(SandboxSpec(limits={"max_memory_bytes": 512 * 1024 * 1024}))
    r = await h.bash("python3 -c \"b = bytearray(2 * 1024**3)\"")
    assert r.exit_code != 0 and "MemoryError" in r.output
    assert (await h.bash("echo still-here")).output == "still-here\n"
    await h.close()


async def test_start_failure_reports_launcher_log_and_leaves_nothing(bwrap_runtime, short_tmp):
    empty_root = os.path.join(short_tmp, "emptyroot")
    os.makedirs(empty_root)
    with pytest.raises(SandboxStartError, match="did not start") as e:
        await bwrap_runtime.start(SandboxSpec(image=empty_root))
    assert "launcher log" in str(e.value)
    assert bwrap_runtime.store.records() == []
    assert os.listdir(os.path.join(bwrap_runtime.state_dir, "run")) == []


CRASHING_SERVER = r"""
import asyncio, json, sys
from sandbox import make_runtime, SandboxSpec

async def main():
    opts = json.loads(sys.argv[1])
    out = {}
    for kind in ("bubblewrap", "local"):
        h = await make_runtime(kind, **opts).start(SandboxSpec(network="loopback"))
        await h.bash("sleep 1000 & nohup sleep 1001 > /dev/null 2>&1 &")
        await h.ipython("1")
        out[kind] = {"pid": h.pid, "sandbox_id": h.sandbox_id, "address": h.address}
    print(json.dumps(out), flush=True)
    await asyncio.sleep(1000)

asyncio.run(main())
"""


def _lease_is_free(lease_dir: str, address: str) -> bool:
    path = os.path.join(lease_dir, address)
    if not os.path.exists(path):
        return True
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


async def test_crashed_server_sandboxes_are_reaped_and_nothing_else(runtime_options, procs):
    server = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CRASHING_SERVER, json.dumps(runtime_options), stdout=subprocess.PIPE,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    started = json.loads(await asyncio.wait_for(server.stdout.readline(), 60))
    sandbox_pids = set()
    for info in started.values():
        root = psutil.Process(info["pid"])
        sandbox_pids |= {root.pid} | {c.pid for c in root.children(recursive=True)}
    # Decoys that reaping must not touch: same names as the sandbox's processes, and a forged record whose pid
    # is alive but belongs to a different process (pid reuse) and whose owner is gone.
    decoy = subprocess.Popen(["sleep", "1000"])
    decoy2 = subprocess.Popen(["sleep", "1001"])
    rt = make_runtime("bubblewrap", **runtime_options)
    server_ct = process_identity(server.pid)
    rt.store.write({"sandbox_id": "sb-forged", "runtime": "local", "pid": decoy.pid,
                    "create_time": process_identity(decoy.pid) - 100, "owner_pid": server.pid,
                    "owner_create_time": server_ct})
    # A record of a live server (this test process) is not an orphan either.
    rt.store.write({"sandbox_id": "sb-live-owner", "runtime": "local", "pid": decoy2.pid,
                    "create_time": process_identity(decoy2.pid), "owner_pid": os.getpid(),
                    "owner_create_time": process_identity(os.getpid())})

    # A local execution server ends itself and its tools when its host is gone (the readiness pipe): stopped, it
    # stands for one that cannot (hung), whose processes only the next server's reap ends.
    os.kill(started["local"]["pid"], signal.SIGSTOP)
    server.kill()  # the crash: no close, no cleanup
    await server.wait()
    await asyncio.sleep(0.5)
    survivors = [p for p in sandbox_pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert survivors, "the local sandbox should outlive its crashed server (otherwise this test proves nothing)"
    assert not _lease_is_free(runtime_options["loopback_dir"], started["local"]["address"])

    try:
        reaped = await rt.reap_orphans()
        assert reaped == 3  # bubblewrap + local + the forged record (whose process is spared)
        procs.assert_gone(sandbox_pids)
        assert decoy.poll() is None and decoy2.poll() is None
        assert [r["sandbox_id"] for r in rt.store.records()] == ["sb-live-owner"]
        for info in started.values():
            assert _lease_is_free(runtime_options["loopback_dir"], info["address"])
        assert await rt.reap_orphans() == 0
    finally:
        decoy.kill()
        decoy2.kill()
        decoy.wait()
        decoy2.wait()


@pytest.mark.parametrize("phase", ["preparing directories", "recording ownership", "waiting for the server"])
async def test_start_cancelled_midway_leaves_nothing_behind(bwrap_runtime, monkeypatch, phase):
    # Slow down the step the cancel should land in (they run in worker threads that a cancel cannot stop).
    slow = {"preparing directories": "_prepare", "recording ownership": "_record_start"}.get(phase)
    if slow:
        real = getattr(bwrap_runtime, slow)

        def delayed(*a, **kw):
            time.sleep(0.1)
            return real(*a, **kw)

        monkeypatch.setattr(bwrap_runtime, slow, delayed)
    task = asyncio.create_task(bwrap_runtime.start())
    await asyncio.sleep(0.05 if slow else 0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await bwrap_runtime.close_all()
    await asyncio.sleep(0.2)  # let anything still running in the background show up
    assert bwrap_runtime.store.records() == []
    for d in (os.path.join(bwrap_runtime.state_dir, "run"), bwrap_runtime.workspace_root):
        assert not os.path.exists(d) or os.listdir(d) == []
    mine = []  # launchers of this runtime carry its state dir on their command line
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and any(bwrap_runtime.state_dir in a for a in p.cmdline()):
                mine.append(p.pid)
        except psutil.Error:
            pass
    assert mine == []


async def test_shell_that_cannot_start_is_an_error_not_a_hang(bwrap_runtime):
    # With one process allowed, the shell's own set-up cannot fork: it never becomes ready.
    h = await bwrap_runtime.start(SandboxSpec(limits={"max_processes": 1}))
    t0 = time.monotonic()
    with pytest.raises(SandboxError, match="did not become ready"):
        await h.bash("echo hi", timeout_s=1.5)
    assert time.monotonic() - t0 < 5
    await h.close()
