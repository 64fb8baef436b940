"""Reaping what dead servers of this node left (red team F8): a server that is already running reaps it too, not
only the next one to start; and a record is a claim, never a licence: forged records (same uid, in the private
state directory; a planted link or FIFO) never make the reaper kill a live sandbox, delete a directory that is
not a dead sandbox's workspace, or hang."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from sandbox import Limits, SandboxSpec, make_runtime
from sandbox.ownership import node_identity
from tests.sandbox.conftest import BWRAP_UNAVAILABLE

pytestmark = [pytest.mark.real, pytest.mark.skipif(bool(BWRAP_UNAVAILABLE), reason=str(BWRAP_UNAVAILABLE))]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A server of this node that starts two sandboxes and then waits (the test SIGKILLs it).
TWO_SANDBOX_SERVER = r"""
import asyncio, json, sys
from sandbox import Limits, SandboxSpec, make_runtime

async def main():
    rt = make_runtime("bubblewrap", **json.loads(sys.argv[1]))
    spec = SandboxSpec(network="none", limits=Limits(max_processes=256))
    hs = [await rt.start(spec) for _ in range(2)]
    print(json.dumps([h.sandbox_id for h in hs]), flush=True)
    await asyncio.sleep(1000)

asyncio.run(main())
"""


async def test_a_running_server_reaps_what_a_server_that_died_beside_it_left(runtime_options):
    rt = make_runtime("bubblewrap", reap_interval_s=0.2, **runtime_options)
    rt.start_reaper()  # this server runs from before the other one's death to after it
    mine = await rt.start(SandboxSpec(network="none", limits=Limits(max_processes=256)))
    other = await asyncio.create_subprocess_exec(sys.executable, "-c", TWO_SANDBOX_SERVER,
                                                 json.dumps(runtime_options), cwd=REPO,
                                                 stdout=asyncio.subprocess.PIPE)
    try:
        ids = json.loads(await asyncio.wait_for(other.stdout.readline(), 120))
    finally:
        other.kill()
    await other.wait()
    run_root = os.path.join(runtime_options["state_dir"], "run")
    try:
        def state():
            left = [n for n in os.listdir(runtime_options["workspace_root"]) if any(i in n for i in ids)]
            return sorted(os.listdir(run_root)), left, [r["sandbox_id"] for r in rt.store.records()]

        # A reap removes the directories first and the record last (the record is how they are found), each in
        # a thread: wait for all three, not for the first (CI at 6877312 read the record between the two).
        for _ in range(300):
            if state() == ([mine.sandbox_id], [], [mine.sandbox_id]):
                break
            await asyncio.sleep(0.05)
        assert state() == ([mine.sandbox_id], [], [mine.sandbox_id])
        assert (await mine.bash("echo mine")).output.strip() == "mine"  # its own live sandbox untouched
    finally:
        await rt.close_all()


def _dead_owner() -> dict:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return {"owner_pid": p.pid, "owner_create_time": 1.0}


async def test_forged_records_never_make_the_reaper_kill_a_live_sandbox_or_delete_other_files(
        bwrap_runtime, short_tmp):
    rt = bwrap_runtime
    h = await rt.start(SandboxSpec(network="none", limits=Limits(max_processes=256)))
    victim = os.path.join(short_tmp, "precious")  # a directory of the user's that is no sandbox's workspace
    os.makedirs(victim)
    with open(os.path.join(victim, "data"), "w") as f:
        f.write("keep")
    # a workspace-shaped directory reached through a symbolic link on its path
    real = os.path.join(short_tmp, "real")
    os.makedirs(os.path.join(real, "prorl-sb-forged3-0123abcd"))
    os.symlink(real, os.path.join(short_tmp, "link"))
    # a workspace-shaped directory that a record of another node names (that server may be alive there)
    remote_ws = os.path.join(short_tmp, "prorl-sb-remote-89abcdef")
    os.makedirs(remote_ws)
    # ... and one that a server in another pid namespace of this node names (a container: its pids mean nothing)
    other_ns_ws = os.path.join(short_tmp, "prorl-sb-otherns-76543210")
    os.makedirs(other_ns_ws)
    dead = _dead_owner()
    forged = {
        # every handle of this server's live sandbox, under a dead owner
        "sb-forged1": {"pid": h.pid, "create_time": h.create_time, "pidns": h.pidns, "workspace": h.workspace,
                       "workspace_created": True, "run_dir": h._ctx.run_dir, "cgroup": h.bounds.cgroup},
        # a user's directory as workspace and run directory
        "sb-forged2": {"pid": None, "workspace": victim, "workspace_created": True, "run_dir": victim},
        "sb-forged3": {"pid": None, "workspace": os.path.join(short_tmp, "link", "prorl-sb-forged3-0123abcd"),
                       "workspace_created": True},
        "sb-remote": {"pid": None, "workspace": remote_ws, "workspace_created": True, "node": "another-node",
                      "boot_id": "x"},
        "sb-otherns": {"pid": None, "workspace": other_ns_ws, "workspace_created": True,
                       **{**node_identity(), "owner_pidns": 1}},
        # the live sandbox's own record, overwritten as a dead server's
        h.sandbox_id: {"pid": h.pid, "create_time": h.create_time, "pidns": h.pidns, "workspace": h.workspace,
                       "workspace_created": True, "run_dir": h._ctx.run_dir},
    }
    for sid, rec in forged.items():
        with open(os.path.join(rt.store.dir, f"{sid}.json"), "w") as f:
            json.dump({"sandbox_id": sid, "runtime": "bubblewrap", "started_at": 0, **dead, **rec}, f)
    # a record reached through a link (pointing at a workspace-shaped directory of the user's), and a FIFO
    linked_ws = os.path.join(short_tmp, "prorl-sb-linked-00112233")
    os.makedirs(linked_ws)
    elsewhere = os.path.join(short_tmp, "elsewhere.json")
    with open(elsewhere, "w") as f:
        json.dump({"sandbox_id": "sb-linked", "pid": None, "workspace": linked_ws, "workspace_created": True,
                   **dead}, f)
    os.symlink(elsewhere, os.path.join(rt.store.dir, "sb-linked.json"))
    os.mkfifo(os.path.join(rt.store.dir, "sb-fifo.json"))

    await asyncio.wait_for(rt.reap_orphans(), 60)

    assert (await h.bash("echo alive", timeout_s=5)).output.strip() == "alive"
    assert os.path.isdir(h.workspace) and os.path.isdir(h._ctx.run_dir)
    assert open(os.path.join(victim, "data")).read() == "keep"
    assert os.path.isdir(os.path.join(real, "prorl-sb-forged3-0123abcd"))
    assert os.path.isdir(remote_ws) and os.path.isdir(linked_ws) and os.path.isdir(other_ns_ws)
    await h.close()
    assert not os.path.exists(h.workspace)


def _forged_pidns_record(sid: str, pidns: int, dead: dict) -> dict:
    return {"sandbox_id": sid, "runtime": "bubblewrap", "pid": None, "create_time": None, "started_at": 0,
            "workspace_created": False, "pidns": pidns, **node_identity(), **dead}


async def test_a_record_naming_only_another_servers_sandbox_pid_namespace_kills_nothing(runtime_options,
                                                                                       short_tmp, caplog):
    """Red team #36 (pidns2.py): a fresh record id, a dead owner and ``pidns`` = the namespace of a live sandbox
    of another live server (its own state directory): the reaper killed every process in it. Now a namespace
    is killed only when one of its processes carries the record's launcher marker; thousands of such records
    log one line, not one warning each (5,003 lines seen)."""
    rt = make_runtime("bubblewrap", **runtime_options)
    other = make_runtime("bubblewrap", **{**runtime_options, "state_dir": os.path.join(short_tmp, "other")})
    try:
        victim = await other.start(SandboxSpec(network="none"))
        assert victim.pidns is not None
        dead = _dead_owner()
        for i in range(40):
            with open(os.path.join(rt.store.dir, f"sb-ns{i:04d}.json"), "w") as f:
                json.dump(_forged_pidns_record(f"sb-ns{i:04d}", victim.pidns, dead), f)
        caplog.set_level("INFO", logger="sandbox")
        await asyncio.wait_for(rt.reap_orphans(), 120)
        assert (await victim.bash("echo alive", timeout_s=5)).output.strip() == "alive"
        noisy = [r for r in caplog.records if r.levelno >= 30 and "sb-ns" in r.getMessage()]
        assert len(noisy) <= 1, [r.getMessage() for r in noisy[:3]]
    finally:
        await rt.close_all()
        await other.close_all()


async def test_a_live_servers_record_copied_as_a_dead_servers_does_not_kill_its_sandbox(runtime_options,
                                                                                        short_tmp, caplog):
    """Red team #36 (same uid): server B's live record copied into A's state directory with a dead owner made
    A kill B's live sandbox (id, launcher and marker all match). Defence in depth: a launcher whose parent is
    alive and is not an adopter of orphans (init, or a subreaper above this server) belongs to a live server."""
    rt = make_runtime("bubblewrap", **runtime_options)
    other = make_runtime("bubblewrap", **{**runtime_options, "state_dir": os.path.join(short_tmp, "other")})
    try:
        victim = await other.start(SandboxSpec(network="none"))
        rec = json.load(open(os.path.join(other.store.dir, f"{victim.sandbox_id}.json")))
        with open(os.path.join(rt.store.dir, f"{victim.sandbox_id}.json"), "w") as f:
            json.dump({**rec, **_dead_owner()}, f)
        await asyncio.wait_for(rt.reap_orphans(), 60)
        assert (await victim.bash("echo alive", timeout_s=5)).output.strip() == "alive"
        assert os.path.isdir(victim.workspace)
        caplog.clear()  # the record is kept: the next periodic reaps say nothing more of it
        await asyncio.wait_for(rt.reap_orphans(), 60)
        assert not [r for r in caplog.records if victim.sandbox_id in r.getMessage()]
    finally:
        await rt.close_all()
        await other.close_all()
