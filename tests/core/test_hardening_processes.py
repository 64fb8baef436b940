"""Hardening with real processes: SIGTERM of ``python -m prorl_server`` cancels in-flight
``/process`` jobs and exits; a SIGKILLed LLM backend fails its jobs fast with the reason."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import aiohttp
import pytest

from prorl_server.plugin.handler import AgentHandler
from prorl_server.plugin.registry import HandlerRegistry
from prorl_server.app import create_app
from prorl_server.config import ServerSettings

REPO = Path(__file__).resolve().parents[2]

# A fake vLLM OpenAI server. It stands in for a real vLLM (which would take minutes to start on CPU and cannot
# be made to hang or to answer on command): "hang" accepts every completion request and never answers (a long
# generation), "answer" answers each with two tokens. It prints one line per request received.
FAKE_VLLM = textwrap.dedent('''
    import asyncio, sys
    from aiohttp import web

    async def models(request):
        return web.json_response({"data": [{"id": "fake", "max_model_len": 4096}]})

    async def health(request):
        return web.Response(text="ok")

    async def completions(request):
        await request.read()
        print("request", flush=True)
        if sys.argv[1] == "hang":
            await asyncio.sleep(3600)
        return web.json_response({"choices": [{"text": "", "token_ids": [5, 6], "finish_reason": "stop",
                                               "logprobs": {"token_logprobs": [-0.1, -0.2]}}]})

    async def main():
        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_get("/health", health)
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        print(runner.addresses[0][1], flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
''')


async def start_fake_vllm(tmp_path: Path, mode: str):
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_VLLM)
    proc = await asyncio.create_subprocess_exec(sys.executable, str(script), mode, stdout=asyncio.subprocess.PIPE)
    port = int(await asyncio.wait_for(proc.stdout.readline(), 60))
    return proc, f"http://127.0.0.1:{port}"


class GenerateHandler(AgentHandler):
    """One generation turn through the server's real LLM client (token-in/token-out) on the job's backend."""

    name = "generate"
    needs_llm = True

    async def run(self, job):
        c = await job.llm.client.complete([1, 2, 3], backend=job, max_tokens=2)
        job.state["tokens"] = c.token_ids

    async def eval(self, job):
        job.reward = 1.0 if job.state.get("tokens") == [5, 6] else 0.0



async def test_sigkilled_backend_fails_its_jobs_fast_with_the_reason_and_a_swap_still_waits(
        aiohttp_client, tmp_path, wait_done):
    registry = HandlerRegistry()
    registry.register(GenerateHandler)
    fake, url = await start_fake_vllm(tmp_path, "hang")
    live = None
    try:
        # backend_wait_s far above the hang guard: a job that waits for the dead backend fails the test
        app = create_app(ServerSettings(backends=[url], backend_wait_s=600, health_interval_s=3600,
                                        default_timeout_s=None), registry=registry)
        client = await aiohttp_client(app)
        ids = []
        for i in range(4):
            r = await client.post("/jobs", json={"job_id": f"j{i}", "instance": {"data_source": "generate"}})
            ids.append((await r.json())["job_id"])
        for _ in ids:  # every job's request reached the backend
            assert await asyncio.wait_for(fake.stdout.readline(), 60) == b"request\n"
        fake.send_signal(signal.SIGKILL)
        await fake.wait()
        for job_id in ids:
            res = await wait_done(client, job_id)
            assert res["critical_error"] == "run" and res["failure_kind"] == "llm_backend", res
            assert res["filter"] is True
            assert url in res["error"]
            assert "Disconnected" in res["error"] or "Connect" in res["error"], res["error"]
        status = await (await client.get("/status")).json()
        assert [b["in_flight"] for b in status["backends"]] == [0]

        # a new job while the only backend is down fails at once too, naming it
        r = await client.post("/process", json={"instance": {"data_source": "generate"}})
        res = await r.json()
        assert res["failure_kind"] == "llm_backend" and url in res["error"]

        # a weight swap (clear -> add) is not a dead backend: a job submitted in between waits for the add
        await client.post("/clear_llm_server")
        r = await client.post("/jobs", json={"job_id": "swap", "instance": {"data_source": "generate"}})
        assert r.status == 202
        live, live_url = await start_fake_vllm(tmp_path, "answer")
        s = await (await client.get("/jobs/swap")).json()
        assert s["state"] != "done", s  # still waiting for a backend (the pool is empty)
        await client.post("/add_llm_server", json={"address": live_url, "weight_version": 2})
        res = await wait_done(client, "swap")
        assert res["critical_error"] is None and res["reward"] == 1.0 and res["backend"] == live_url
    finally:
        for p in (fake, live):
            if p is not None and p.returncode is None:
                p.kill()
                await p.wait()


SLOW_HANDLER = textwrap.dedent('''
    """A handler plugin (entry point) standing in for a long rollout: run sleeps for an hour. Its init
    registers a job-scoped closer standing in for a sandbox; the closer writes a marker file when it runs."""
    import asyncio, os
    from pathlib import Path
    from prorl_server.plugin.handler import AgentHandler

    class SlowHandler(AgentHandler):
        name = "slow_plugin"
        needs_llm = False

        async def init(self, job):
            async def close():
                Path(os.environ["SLOW_CLOSED_DIR"], job.job_id).touch()
            job.add_closer(close, "job")

        async def run(self, job):
            await asyncio.sleep(3600)
''')


def _write_plugin(root: Path) -> None:
    """A real installed-distribution layout (dist-info + entry point) so ``python -m prorl_server`` loads the
    handler the way it loads any third-party handler."""
    (root / "slow_plugin_handler.py").write_text(SLOW_HANDLER)
    dist = root / "slow_plugin-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: slow-plugin\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text("[prorl_server.handlers]\nslow_plugin = slow_plugin_handler:SlowHandler\n")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_sigterm_cancels_in_flight_process_jobs_closes_resources_and_exits(tmp_path, sig):
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    _write_plugin(plugin)
    closed = tmp_path / "closed"
    closed.mkdir()
    ready = tmp_path / "ready.json"
    env = dict(os.environ, PYTHONPATH=f"{plugin}{os.pathsep}{REPO}", SLOW_CLOSED_DIR=str(closed))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "prorl_server", "--port", "0", "--ready-file", str(ready), "--log-level", "WARNING",
        cwd=str(tmp_path), env=env)
    try:
        for _ in range(6000):  # hang guard while the server imports and binds
            if ready.exists() or proc.returncode is not None:
                break
            await asyncio.sleep(0.01)
        url = json.loads(ready.read_text())["url"]
        async with aiohttp.ClientSession() as http:
            blocking = [asyncio.create_task(http.post(f"{url}/process", json={
                "job_id": f"slow{i}", "instance": {"data_source": "slow_plugin"}})) for i in range(2)]
            for i in range(2):
                for _ in range(6000):
                    async with http.get(f"{url}/jobs/slow{i}") as r:
                        if r.status == 200 and (await r.json())["state"] == "run":
                            break
                    await asyncio.sleep(0.01)
            t0 = time.monotonic()
            proc.send_signal(sig)
            rc = await asyncio.wait_for(proc.wait(), 30)  # hang guard: before the fix it took 60 s
            exit_s = time.monotonic() - t0
            print(f"server exited {exit_s:.2f} s after {sig.name}")
            assert rc == 0
            for i, task in enumerate(blocking):
                resp = await task
                assert resp.status == 200
                res = await resp.json()
                assert res["job_id"] == f"slow{i}" and res["critical_error"] == "cancelled"
                assert res["failure_kind"] == "cancelled" and res["filter"] is True and res["reward"] == 0.0
                assert "shutting down" in res["error"]
        assert sorted(p.name for p in closed.iterdir()) == ["slow0", "slow1"]  # resources closed
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
