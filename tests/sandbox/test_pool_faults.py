"""Pool faults of #36 that a red team left open (row 11): a co-tenant of the same uid SIGSTOPs the warm shell of a
pooled sandbox. Acquire must not hand such a sandbox out, and a job whose shell is stopped after acquire, before
the model's first command ran in it, fails as the system's (``failure_kind="sandbox"``, ``filter: true``), not
as a scored zero after the first call's timeout."""
from __future__ import annotations

import asyncio
import time

import psutil
import pytest

from prorl_server.failures import classify, is_filtered
from sandbox import SandboxError, SandboxStartError
from sandbox.system_time import system_seconds
from tests.sandbox.conftest import BWRAP_UNAVAILABLE
from tests.sandbox.test_pool import SPEC, full_pool

pytestmark = [pytest.mark.real, pytest.mark.skipif(bool(BWRAP_UNAVAILABLE), reason=str(BWRAP_UNAVAILABLE))]


def _warm_shell(h) -> psutil.Process:
    """The pooled sandbox's persistent shell: the execution server's bash child (started by the pool's warm-up)."""
    server = psutil.Process(h._client.peer_pid)
    for _ in range(500):
        shells = [p for p in server.children() if p.name() == "bash"]
        if shells:
            return shells[0]
        time.sleep(0.01)
    raise AssertionError("the pooled sandbox has no warm shell")


async def _stop(p: psutil.Process) -> None:
    """SIGSTOP ``p`` as a co-tenant of the same uid would, and wait until the kernel has stopped it."""
    p.suspend()
    for _ in range(200):
        if p.status() == psutil.STATUS_STOPPED:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{p} did not stop")


async def test_a_pooled_sandbox_whose_warm_shell_was_stopped_is_replaced_not_handed_out(bwrap_runtime):
    async with full_pool(bwrap_runtime) as pool:
        (victim,) = bwrap_runtime.handles
        await _stop(_warm_shell(victim))  # the execution server itself still runs and answers
        got = await asyncio.wait_for(pool.acquire(SPEC), 20)
        # before: the stopped one was handed out and its first bash call waited out its timeout
        assert got.sandbox_id != victim.sandbox_id and pool.counters["dead"] == 1
        assert (await got.bash("echo alive", timeout_s=5)).output.strip() == "alive"
        await got.close()


async def test_a_shell_stopped_after_acquire_fails_the_models_first_call_as_the_systems(bwrap_runtime):
    async with full_pool(bwrap_runtime) as pool:
        h = await pool.acquire(SPEC)
        await _stop(_warm_shell(h))  # after acquire, before the model's first command
        t0 = time.monotonic()
        with system_seconds():  # the call is made on the model's behalf (as the agent loop makes it)
            with pytest.raises(SandboxStartError) as err:  # before: a "[timed out]" observation after ~7 s
                await asyncio.wait_for(h.bash("echo hi", timeout_s=3), 30)
        assert time.monotonic() - t0 < 1.0
        # the run stage ends with it after the model's first turn: still the system's, filtered
        kind = classify(err.value, "run", model_acted=True)
        assert kind == "sandbox" and is_filtered(kind)
        await h.close()


async def test_a_stop_after_the_models_first_command_stays_the_models(bwrap_runtime):
    # The model can stop its own shell (`kill -STOP $$`); the host cannot tell that from a co-tenant's stop once
    # the model's code ran in the sandbox, so it stays the command's timeout, shown to the model (scored).
    async with full_pool(bwrap_runtime) as pool:
        h = await pool.acquire(SPEC)
        with system_seconds():
            assert (await h.bash("echo first", timeout_s=5)).output.strip() == "first"
            await _stop(_warm_shell(h))
            r = await asyncio.wait_for(h.bash("echo hi", timeout_s=1), 30)
        assert r.timed_out
        await h.close()


# A server whose pool refills all the time: it fills a pool of 3 (2 starts at once), then takes and closes what
# is ready, so that a SIGKILL at any moment finds starts at every step (prepare, launcher, bwrap, the execution
# server's imports and readiness write, warm-up, the shell's spawn).
CHURNING_SERVER = r"""
import asyncio, json, sys
from sandbox import Limits, SandboxSpec, make_runtime
from sandbox.pool import SandboxPool

async def main():
    rt = make_runtime("bubblewrap", **json.loads(sys.argv[1]))
    pool = SandboxPool(rt, size=3, refill_concurrency=2)
    spec = SandboxSpec(network="none", limits=Limits(max_processes=256))
    pool.register(spec)
    await pool.wait_full(spec, 120)  # past the first start's one-time work (the Python view, the seccomp filter)
    print("full", flush=True)
    while True:
        if pool.ready_count(spec):
            h = await pool.acquire(spec)
            await h.close(grace_s=0.0)
        await asyncio.sleep(0.01)

asyncio.run(main())
"""

#: Seconds after the server's pool was first full (its refills then run all the time) at which it is SIGKILLed.
KILL_POINTS_S = (0.0, 0.01, 0.03, 0.06, 0.1, 0.15, 0.25, 0.4, 0.7, 1.1)
#: Seconds within which nothing of a SIGKILLed server's sandboxes may be left, with nobody reaping.
GONE_WITHIN_S = 5.0


def _sandbox_processes(ids: set[str], namespaces: set[int]) -> list[int]:
    """Live processes of the sandboxes ``ids``, found as the reaper finds them (sandbox/ownership.py): by the
    launcher marker in their environment, and by the pid namespaces those marked processes live in (the shell
    carries no marker). Adds the namespaces seen to ``namespaces``."""
    from sandbox.ownership import marked_processes, pid_namespace

    own = pid_namespace()
    pids = []
    for sid, procs in marked_processes().items():
        if sid in ids:
            pids += [m.pid for m in procs]
            namespaces.update(m.pidns for m in procs if m.pidns not in (None, own))
    for pid in psutil.pids():
        if pid not in pids and pid_namespace(pid) in namespaces:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    pids.append(pid)
            except psutil.Error:
                pass
    return pids


async def test_a_server_sigkilled_at_any_point_of_its_refills_leaves_no_sandbox_process(runtime_options):
    # Guards the readiness pipe (c4e0019: the execution server ends itself when the host's end is gone): with
    # that taken out of sandbox/exec_server.py, 5 of 14 kill points left bwrap and the execution server running
    # past GONE_WITHIN_S (--die-with-parent alone did not end them).
    import json
    import os
    import sys

    from sandbox import make_runtime
    from tests.sandbox.test_pool import REPO

    run_root = os.path.join(runtime_options["state_dir"], "run")
    left: dict[float, list[str]] = {}
    started, worst = 0, 0.0
    for delay in KILL_POINTS_S:
        server = await asyncio.create_subprocess_exec(sys.executable, "-c", CHURNING_SERVER,
                                                      json.dumps(runtime_options), cwd=REPO,
                                                      stdout=asyncio.subprocess.PIPE)
        try:
            assert (await asyncio.wait_for(server.stdout.readline(), 120)).strip() == b"full"
            await asyncio.sleep(delay)
        finally:
            server.kill()
        await server.wait()
        ids = set(os.listdir(run_root)) if os.path.isdir(run_root) else set()
        started += len(ids)
        namespaces: set[int] = set()
        deadline = time.monotonic() + GONE_WITHIN_S
        alive = _sandbox_processes(ids, namespaces)
        while alive and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            alive = _sandbox_processes(ids, namespaces)
        worst = max(worst, GONE_WITHIN_S - (deadline - time.monotonic()))
        if alive:
            left[delay] = [" ".join(psutil.Process(p).cmdline()[:3]) for p in alive if psutil.pid_exists(p)]
        # the next server's reap (not counted above) clears the directories for the next kill point
        await make_runtime("bubblewrap", **runtime_options).reap_orphans()
    print(f"{started} sandboxes under way at {len(KILL_POINTS_S)} kill points; all gone within {worst:.3f} s")
    assert left == {}, f"processes outlived their SIGKILLed server by {GONE_WITHIN_S} s: {left}"
    assert started >= len(KILL_POINTS_S), "the kills found too few sandboxes under way to prove anything"


async def test_a_code_job_whose_pooled_shell_was_stopped_after_acquire_is_filtered_not_scored(
        aiohttp_client, scripted_policy, runtime_options):
    """Through the whole server (pipeline, code handler, agent loop, HTTP): the job's sandbox comes from the
    warm pool; while its first turn is generated (after acquire, before the model's first command) a co-tenant
    stops the warm shells. Before: the bash call waited out its limit and came back to the model as a
    ``[timed out]`` observation (scored). Now the job fails at that call as the system's, at once."""
    import json

    from handlers.code.data import humaneval_problems, to_instance
    from handlers.code.task import sandbox_spec
    from prorl_server.app import COMPONENTS, create_app
    from prorl_server.config import ServerSettings
    from prorl_server.plugin.registry import HandlerRegistry

    stopped: list[psutil.Process] = []
    components = []

    def script(prompt, turn):
        if turn == 0:  # the run sandbox is open: a co-tenant of the same uid stops every warm shell
            for h in components[0].runtime.handles:
                for p in psutil.Process(h._client.peer_pid).children():
                    if p.name() == "bash":
                        p.suspend()
                        stopped.append(p)
            return "<tool_call>\n" + json.dumps({"name": "bash", "arguments": {"command": "echo alive"}}) + \
                "\n</tool_call>"
        return "<tool_call>\n" + json.dumps({"name": "finish", "arguments": {"answer": "done"}}) + "\n</tool_call>"

    registry = HandlerRegistry()
    registry.load_entry_points()
    app = create_app(ServerSettings(backends=[await scripted_policy(script)], health_interval_s=3600,
                                    sandbox_runtime="bubblewrap", sandbox_options=runtime_options,
                                    sandbox_pool_size=1), registry=registry)
    client = await aiohttp_client(app)
    c = app[COMPONENTS]
    components.append(c)
    assert c.sandbox_pool.register(sandbox_spec())
    await c.sandbox_pool.wait_full(sandbox_spec(), 60)
    t0 = time.monotonic()
    r = await client.post("/process", json={"instance": to_instance(humaneval_problems()["HumanEval/0"]),
                                            "sampling_params": {"max_tokens": 512}, "timeout_s": 60})
    body = await r.json()
    took = time.monotonic() - t0
    assert stopped and c.sandbox_pool.counters["hits"] == 1, (stopped, c.sandbox_pool.counters)
    assert (body["critical_error"], body["failure_kind"], body["filter"]) == ("run", "sandbox", True), body
    assert "SandboxStartError" in body["error"] and "stopped" in body["error"]
    assert took < 20, f"the job took {took:.1f} s"


async def test_a_cold_sandbox_killed_before_the_models_first_call_fails_it_as_the_systems(bwrap_runtime):
    # No process list is recorded for a cold start, but a sandbox already dead at the model's first call died of
    # something else's doing (here a co-tenant's SIGKILL of its execution server); before, the call raised
    # SandboxDeadError, which after the model's first turn is scored (model_crashed_sandbox).
    h = await bwrap_runtime.start(SPEC)
    try:
        psutil.Process(h._client.peer_pid).kill()
        for _ in range(500):
            if not h.alive:
                break
            await asyncio.sleep(0.01)
        assert not h.alive
        with system_seconds():
            with pytest.raises(SandboxStartError):
                await asyncio.wait_for(h.bash("echo hi", timeout_s=3), 30)
            with pytest.raises(SandboxStartError) as err:
                await h.editor("view", ".")
        kind = classify(err.value, "run", model_acted=True)
        assert kind == "sandbox" and is_filtered(kind)
    finally:
        await h.close()


async def test_a_death_after_the_models_first_command_stays_the_models(bwrap_runtime):
    h = await bwrap_runtime.start(SPEC)
    try:
        with system_seconds():
            assert (await h.bash("echo first", timeout_s=5)).output.strip() == "first"
            psutil.Process(h._client.peer_pid).kill()  # what `kill -9 $PPID` from its own shell does
            with pytest.raises(SandboxError) as err:
                await asyncio.wait_for(h.bash("echo hi", timeout_s=3), 30)
        assert not isinstance(err.value, SandboxStartError)
        assert classify(err.value, "run", model_acted=True) == "model_crashed_sandbox"
    finally:
        await h.close()


async def test_a_shell_that_cannot_start_before_the_models_first_call_is_the_systems(bwrap_runtime, monkeypatch):
    h = await bwrap_runtime.start(SPEC)
    real_call = h._call

    async def shell_cannot_start(op, args, timeout_s):
        # stands for a shell whose start fails inside the sandbox (a tool module missing from the view, a pty
        # the node refuses): the lazy start's no-op command is answered with the server's error
        if op == "bash" and args.get("command") == ":":
            raise SandboxError("the shell could not be spawned")
        return await real_call(op, args, timeout_s)

    monkeypatch.setattr(h, "_call", shell_cannot_start)
    try:
        with system_seconds():
            with pytest.raises(SandboxStartError) as err:  # before: a plain SandboxError, scored after a turn
                await h.bash("echo hi", timeout_s=3)
        assert classify(err.value, "run", model_acted=True) == "sandbox"
    finally:
        await h.close()
