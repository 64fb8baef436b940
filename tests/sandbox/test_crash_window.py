"""A server SIGKILLed while a sandbox is starting leaves nothing the next server cannot clean up (found by the
fault benchmark, benchmarks/faults.py: a server killed under 32 concurrent code jobs left 9 run directories
and workspaces with no ownership record, so no later server could ever find them)."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import psutil
import pytest

from sandbox import make_runtime
from tests.sandbox.conftest import BWRAP_UNAVAILABLE

pytestmark = [pytest.mark.real]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A server that SIGKILLs itself at one point of a bubblewrap sandbox's start: the method named by argv[2] of
# the runtime is replaced by the kill (the crash happens exactly when that step would run).
DYING_SERVER = r"""
import asyncio, json, os, signal, sys
from sandbox import make_runtime

rt = make_runtime(sys.argv[3], **json.loads(sys.argv[1]))

def die(*args, **kwargs):
    if args and isinstance(args[0], dict) and args[0].get("pid"):  # _record_start(record): the launcher's pid
        print(args[0]["pid"], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

if sys.argv[2].startswith("after:"):  # the step runs, then the crash
    step = getattr(rt, sys.argv[2][len("after:"):])
    def step_then_die(*args, **kwargs):
        step(*args, **kwargs)
        die()
    setattr(rt, sys.argv[2][len("after:"):], step_then_die)
else:
    setattr(rt, sys.argv[2], die)
if sys.argv[4:] == ["orphaned_child"]:
    # Stands in for a bwrap launcher that died with its server while its forked child (the namespace's init,
    # with the execution server under it) lost the die-with-parent race: the launcher exits, its child lives on.
    rt.build_command = lambda spec, ctx: ["sh", "-c", "sleep 1000 & exit 0"]
if sys.argv[4:] == ["survivor"]:
    # Stands in for a bwrap launcher that lost its die-with-parent race (its parent died before bwrap set
    # PR_SET_PDEATHSIG): a launcher that outlives its server. The race itself cannot be provoked on demand.
    rt.build_command = lambda spec, ctx: ["sleep", "1000"]
asyncio.run(rt.start())
"""


@pytest.mark.skipif(bool(BWRAP_UNAVAILABLE), reason=str(BWRAP_UNAVAILABLE))
@pytest.mark.parametrize("point", [
    "build_command",   # directories and config written, nothing launched yet
    "launcher_env",    # the same window, one step later
    "_record_start",   # the launcher is running, its pid not yet recorded
])
async def test_a_server_killed_while_a_sandbox_starts_leaves_nothing_after_the_next_reap(runtime_options, point):
    os.makedirs(runtime_options["workspace_root"])
    server = await asyncio.create_subprocess_exec(sys.executable, "-c", DYING_SERVER, json.dumps(runtime_options),
                                                  point, "bubblewrap", cwd=REPO)
    assert await asyncio.wait_for(server.wait(), 120) == -9  # hang guard
    run_root = os.path.join(runtime_options["state_dir"], "run")
    # the crash left the sandbox's directories (otherwise this test proves nothing)
    assert len(os.listdir(run_root)) == 1 and len(os.listdir(runtime_options["workspace_root"])) == 1

    rt = make_runtime("bubblewrap", **runtime_options)
    assert await rt.reap_orphans() == 1
    assert os.listdir(run_root) == []
    assert os.listdir(runtime_options["workspace_root"]) == []
    assert rt.store.records() == []
    assert await rt.reap_orphans() == 0


async def test_a_failed_start_leaves_no_record_and_no_directories(runtime_options, monkeypatch):
    """The provisional record is removed with the directories when a start fails (no stale record)."""
    if BWRAP_UNAVAILABLE:
        pytest.skip(BWRAP_UNAVAILABLE)
    rt = make_runtime("bubblewrap", **runtime_options)

    def refuse(*args, **kwargs):
        raise RuntimeError("launcher refused")

    monkeypatch.setattr(rt, "build_command", refuse)
    with pytest.raises(RuntimeError, match="launcher refused"):
        await rt.start()
    assert os.listdir(os.path.join(runtime_options["state_dir"], "run")) == []
    assert os.listdir(runtime_options["workspace_root"]) == []
    assert rt.store.records() == []


async def test_a_launcher_whose_pid_was_never_recorded_is_found_and_killed(runtime_options):
    """The server dies after launching, before recording the launcher's pid, and the launcher outlives it
    (bubblewrap's die-with-parent races its parent's death: the fault benchmark found such a sandbox alive after
    its server's SIGKILL). The next reap must find it (by the marker the host put in its environment) and kill
    it, with its directories, and nothing else."""
    if BWRAP_UNAVAILABLE:
        pytest.skip(BWRAP_UNAVAILABLE)
    os.makedirs(runtime_options["workspace_root"])
    server = await asyncio.create_subprocess_exec(sys.executable, "-c", DYING_SERVER, json.dumps(runtime_options),
                                                  "_record_start", "bubblewrap", "survivor", cwd=REPO,
                                                  stdout=subprocess.PIPE)
    launcher = int(await asyncio.wait_for(server.stdout.readline(), 120))
    assert await asyncio.wait_for(server.wait(), 120) == -9
    assert psutil.pid_exists(launcher)  # otherwise this test proves nothing
    decoy = subprocess.Popen(["sleep", "1000"])  # not the sandbox's: must be spared
    try:
        await asyncio.sleep(0.5)
        assert psutil.Process(launcher).status() != psutil.STATUS_ZOMBIE  # still alive without its server
        rt = make_runtime("bubblewrap", **runtime_options)
        assert await rt.reap_orphans() == 1
        for _ in range(500):  # hang guard; the launcher was our grandchild: init reaps it
            if not psutil.pid_exists(launcher) or psutil.Process(launcher).status() == psutil.STATUS_ZOMBIE:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError(f"launcher {launcher} survived the reap")
        assert decoy.poll() is None
        assert os.listdir(os.path.join(runtime_options["state_dir"], "run")) == []
        assert os.listdir(runtime_options["workspace_root"]) == []
        assert rt.store.records() == []
    finally:
        decoy.kill()
        decoy.wait()


async def test_a_recorded_launchers_child_that_outlived_it_is_found_and_killed(runtime_options):
    """The server recorded the launcher's pid and died before it learnt the sandbox's pid namespace; the
    launcher is gone but its child lives on (seen in the fault benchmark: bwrap's namespace init and the
    execution server under it, re-parented, after a server SIGKILL). The next reap kills the child."""
    if BWRAP_UNAVAILABLE:
        pytest.skip(BWRAP_UNAVAILABLE)
    os.makedirs(runtime_options["workspace_root"])
    server = await asyncio.create_subprocess_exec(sys.executable, "-c", DYING_SERVER, json.dumps(runtime_options),
                                                  "after:_record_start", "bubblewrap", "orphaned_child", cwd=REPO)
    assert await asyncio.wait_for(server.wait(), 120) == -9
    rt = make_runtime("bubblewrap", **runtime_options)
    [rec] = rt.store.records()
    assert rec["pid"]  # recorded
    child = None
    for _ in range(500):  # hang guard: the launcher's shell forks the child, then exits
        kids = [p for p in psutil.process_iter(["ppid", "environ"]) if p.info["environ"] and
                p.info["environ"].get("PRORL_LAUNCHER_ID") == rec["sandbox_id"]]
        if kids and not psutil.pid_exists(rec["pid"]) or (kids and psutil.Process(rec["pid"]).status() ==
                                                          psutil.STATUS_ZOMBIE):
            child = kids[0]
            break
        await asyncio.sleep(0.01)
    assert child is not None and child.is_running()  # otherwise this test proves nothing
    assert await rt.reap_orphans() == 1
    for _ in range(500):
        if not child.is_running() or child.status() == psutil.STATUS_ZOMBIE:
            break
        await asyncio.sleep(0.01)
    else:
        child.kill()
        raise AssertionError(f"the launcher's child {child.pid} survived the reap")
    assert os.listdir(os.path.join(runtime_options["state_dir"], "run")) == []
    assert rt.store.records() == []
