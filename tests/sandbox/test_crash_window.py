"""A server SIGKILLed while a sandbox is starting leaves nothing the next server cannot clean up (found by the
fault benchmark, benchmarks/faults.py: a server killed under 32 concurrent code jobs left 9 run directories
and workspaces with no ownership record, so no later server could ever find them)."""
from __future__ import annotations

import asyncio
import json
import os
import sys

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

rt = make_runtime("bubblewrap", **json.loads(sys.argv[1]))

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

setattr(rt, sys.argv[2], die)
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
                                                  point, cwd=REPO)
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
