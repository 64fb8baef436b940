"""What the reap after an honest crash says (#36 red team row 13). A SIGKILLed server's sandboxes die with it, and
the kernel hands their pid namespaces' inode numbers to the next namespaces created on the node (its proc inum
allocator gives the lowest free number: two ``unshare --pid`` in a row here got the same one). A record whose
namespace number now names another sandbox's namespace is stale, not forged: the reap says so at info, and keeps
its warning for a live namespace in which no process carries a sandbox's launcher marker. Real tier: bubblewrap
sandboxes, a server process SIGKILLed, and an ``unshare --pid`` namespace."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
import time

import psutil
import pytest

from sandbox import Limits, SandboxSpec, make_runtime
from sandbox.ownership import marked_processes, pid_namespace
from tests.sandbox.conftest import BWRAP_UNAVAILABLE
from tests.sandbox.test_reaper import REPO, TWO_SANDBOX_SERVER

pytestmark = [pytest.mark.real, pytest.mark.skipif(bool(BWRAP_UNAVAILABLE), reason=str(BWRAP_UNAVAILABLE))]


def _unmarked_namespace() -> subprocess.Popen:
    """A process in a pid namespace of its own that carries no launcher marker (what a forged record, or a
    number reused by something that is no sandbox, names)."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) to create a pid namespace")
    argv = ["unshare", "--pid", "--fork", "sleep", "60"] if os.geteuid() == 0 else \
        ["unshare", "-Ur", "--pid", "--fork", "sleep", "60"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRORL_")}
    return subprocess.Popen(argv, env=env)


def _child_pidns(p: subprocess.Popen) -> int:
    """The pid namespace of ``unshare``'s child (the namespace's init)."""
    for _ in range(200):
        kids = psutil.Process(p.pid).children()
        if kids and (ns := pid_namespace(kids[0].pid)) is not None:
            return ns
        time.sleep(0.01)
    raise AssertionError("unshare did not start its child")


async def test_the_reap_after_a_crash_calls_a_reused_namespace_stale_and_warns_only_on_an_unmarked_one(
        runtime_options, short_tmp, caplog):
    server = await asyncio.create_subprocess_exec(sys.executable, "-c", TWO_SANDBOX_SERVER,
                                                  json.dumps(runtime_options), cwd=REPO,
                                                  stdout=asyncio.subprocess.PIPE)
    try:
        reused_id, unmarked_id = json.loads(await asyncio.wait_for(server.stdout.readline(), 120))
    finally:
        server.kill()  # an honest crash
    await server.wait()
    for _ in range(500):  # its sandboxes die with it (die-with-parent, the readiness pipe)
        if not set(marked_processes()) & {reused_id, unmarked_id}:
            break
        await asyncio.sleep(0.01)
    # Another server of the node (its own state directory) starts a sandbox, and something that is no sandbox
    # makes a pid namespace. The kernel may or may not have given either the dead ones' numbers (other tests run
    # beside this one), so the records are set to name them: the reuse, made certain.
    other = make_runtime("bubblewrap", state_dir=os.path.join(short_tmp, "other"),
                         uid_lease_dir=os.path.join(short_tmp, "uids"),
                         **{k: v for k, v in runtime_options.items() if k != "state_dir"})
    sandbox = await other.start(SandboxSpec(network="none", limits=Limits(max_processes=256)))
    plain = _unmarked_namespace()
    try:
        await asyncio.sleep(0.3)  # the sandbox's record gets its namespace off the start path
        rt = make_runtime("bubblewrap", **runtime_options)
        for rec in rt.store.records():
            rec["pidns"] = sandbox.pidns if rec["sandbox_id"] == reused_id else _child_pidns(plain)
            rt.store.write(rec)
        with caplog.at_level(logging.INFO, logger="sandbox.runtime"):
            assert await rt.reap_orphans() == 2
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
        # before: both read "... no process carries their launcher marker ...: forged or stale"
        assert not any(reused_id in m for m in warnings), warnings
        assert any(reused_id in m and "stale" in m for m in infos), infos
        assert any(unmarked_id in m and "no process carries" in m for m in warnings), warnings
        assert (await sandbox.bash("echo alive", timeout_s=5)).output.strip() == "alive"  # left alone
    finally:
        plain.kill()
        plain.wait()
        await other.close_all()
