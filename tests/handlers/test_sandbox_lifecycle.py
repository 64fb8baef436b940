"""Sandboxes opened through a job are closed for the handler whatever ends the job: success, cancel,
timeout, /stop, SIGTERM or SIGKILL of the server. Real bubblewrap; the handler is a labelled test double that
opens a sandbox and then waits (standing in for a long agent run)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request

import psutil
import pytest

from prorl_server.plugin.handler import AgentHandler

pytestmark = pytest.mark.real


class HoldSandbox(AgentHandler):
    """Opens a sandbox in init, runs a command in it, then holds for ``hold_s`` in run."""

    name = "hold_sandbox"
    needs_llm = False

    async def init(self, job):
        handle = await job.open_sandbox()
        job.state["pid"] = handle.pid
        r = await handle.bash("echo ready")
        assert r.output.strip().startswith("ready")

    async def run(self, job):
        await asyncio.sleep(job.instance.get("hold_s", 0))

    async def eval(self, job):
        job.reward = 1.0


@pytest.fixture
def hold_client(rollout_server, registry):
    registry.register(HoldSandbox)

    async def make(**settings):
        return await rollout_server([], **settings)
    return make


async def _wait_state(client, job_id, state):
    for _ in range(500):
        s = await (await client.get(f"/jobs/{job_id}")).json()
        if s.get("state") == state:
            return s
        await asyncio.sleep(0.02)
    raise AssertionError(f"{job_id} never reached {state}: {s}")


@pytest.mark.parametrize("ending", ["success", "cancel", "timeout", "stop"])
async def test_job_sandbox_is_closed_however_the_job_ends(hold_client, sandbox_procs, ending):
    client = await hold_client()
    hold = 0 if ending == "success" else 60
    body = {"instance": {"data_source": "hold_sandbox", "hold_s": hold}}
    if ending == "timeout":
        body["timeout_s"] = 1.5
    job_id = (await (await client.post("/jobs", json=body)).json())["job_id"]
    if ending != "success":
        await _wait_state(client, job_id, "run")
        assert sandbox_procs(), "the sandbox should be running while the job runs"
        if ending == "cancel":
            await client.post("/cancel", json={"job_id": job_id})
        elif ending == "stop":
            await client.post("/stop")
    s = await _wait_state(client, job_id, "done")
    expected = {"success": None, "cancel": "cancelled", "timeout": "timeout", "stop": "cancelled"}[ending]
    assert s["result"]["critical_error"] == expected
    assert not sandbox_procs()


SERVER = textwrap.dedent("""
    import asyncio, sys
    from prorl_server.plugin import AgentHandler, register_handler

    class Hold(AgentHandler):
        name = "hold"
        needs_llm = False

        async def init(self, job):
            await job.open_sandbox()

        async def run(self, job):
            await asyncio.sleep(3600)

    register_handler(Hold)
    from prorl_server.cli import main
    sys.exit(main())
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_server_signal_leaves_no_sandbox_process(tmp_path, sig):
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    ready = tmp_path / "ready.json"
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}  # this server's own ownership records
    # With the warm pool on (its default): a refill may be mid-start when the signal lands, and its sandbox must go
    # with the server too (the execution server ends itself when its host's readiness pipe has no reader; see
    # tests/sandbox/test_pool.py::test_a_server_killed_mid_refill_leaves_no_sandbox_process).
    proc = subprocess.Popen([sys.executable, str(script), "--port", "0", "--ready-file", str(ready),
                             "--sandbox-runtime", "bubblewrap", "--log-level", "warning"],
                            env=env)
    try:
        for _ in range(400):
            if ready.exists():
                break
            time.sleep(0.025)
        url = json.loads(ready.read_text())["url"]
        req = urllib.request.Request(url + "/jobs", data=json.dumps({"instance": {"data_source": "hold"}}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        job_id = json.load(urllib.request.urlopen(req, timeout=10))["job_id"]
        for _ in range(400):
            state = json.load(urllib.request.urlopen(f"{url}/jobs/{job_id}", timeout=10))["state"]
            if state == "run":
                break
            time.sleep(0.025)
        sandbox = [p for p in psutil.Process(proc.pid).children(recursive=True)]
        assert sandbox, "the job's sandbox should be running"
        proc.send_signal(sig)
        rc = proc.wait(timeout=20)
        assert rc == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            alive = [p for p in sandbox if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            if not alive:
                break
            time.sleep(0.1)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
