"""Fixtures for the server-core tests: a real aiohttp server on loopback with fault-injecting handlers.

The handlers below are test doubles for real task handlers: they do no task work, they sleep, fail or
hold a backend on command, so every point of the job lifecycle can be hit deterministically.
"""
from __future__ import annotations

import asyncio

import pytest

from handlers.arithmetic import ArithmeticHandler
from prorl_server.plugin.handler import AgentHandler
from prorl_server.plugin.registry import HandlerRegistry
from prorl_server.app import create_app
from prorl_server.config import ServerSettings


class ScriptedHandler(AgentHandler):
    """Fault injection: ``instance = {"data_source": "scripted", "sleep": {"run": 5}, "fail_in": "eval",
    "callback_raises": true, "handler_timeout_in": "run"}``. Records every call in ``self.events``
    and registers a closer per job that stands in for a sandbox, so tests see when resources close."""

    name = "scripted"
    needs_llm = False

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.closed: list[str] = []

    async def _stage(self, job, stage: str) -> None:
        self.events.append((job.job_id, stage))
        if stage == "init":
            async def close(jid=job.job_id):
                self.closed.append(jid)
            job.add_closer(close, "run")
        delay = job.instance.get("sleep", {}).get(stage, 0)
        if delay:
            await asyncio.sleep(delay)
        if job.instance.get("handler_timeout_in") == stage:
            raise TimeoutError("the handler's own timeout (e.g. a tool call), not the job's")
        if job.instance.get("fail_in") == stage:
            raise RuntimeError(f"injected failure in {stage}")
        if stage == "run" and "malformed_tool_calls" in job.instance:
            job.extra["agent"] = {"malformed_tool_calls": job.instance["malformed_tool_calls"]}
        if stage == "eval":
            job.reward = float(job.instance.get("reward", 1.0))
            job.resolved = job.reward > 0

    async def init(self, job):
        await self._stage(job, "init")

    async def run(self, job):
        await self._stage(job, "run")

    async def eval(self, job):
        await self._stage(job, "eval")

    async def _exc(self, job, exc, stage):
        self.events.append((job.job_id, f"{stage}_exception"))
        if job.instance.get("callback_raises"):
            raise ValueError("exception callback failed too")
        job.extra["seen_exception"] = type(exc).__name__

    async def init_exception(self, job, exc):
        await self._exc(job, exc, "init")

    async def run_exception(self, job, exc):
        await self._exc(job, exc, "run")

    async def eval_exception(self, job, exc):
        await self._exc(job, exc, "eval")


class BackendHoldingHandler(AgentHandler):
    """Stands in for an LLM handler: takes its sticky backend several times, holds it for ``hold_s``."""

    name = "llm_holder"
    needs_llm = True

    async def run(self, job):
        seen = {(await job.backend()).address for _ in range(3)}
        job.extra["backends_seen"] = sorted(seen)
        await asyncio.sleep(job.instance.get("hold_s", 0))


@pytest.fixture
def registry():
    r = HandlerRegistry()
    r.register(ArithmeticHandler)
    r.register(ScriptedHandler())
    r.register(BackendHoldingHandler)
    return r


@pytest.fixture
def make_client(aiohttp_client, registry):
    async def make(**settings):
        settings.setdefault("health_interval_s", 3600)
        app = create_app(ServerSettings(**settings), registry=registry)
        return await aiohttp_client(app)
    return make


@pytest.fixture
def scripted(registry):
    return registry.resolve("scripted")[1]


async def _wait_done(client, job_id: str, patience_s: float = 120.0) -> dict:
    """Poll ``GET /jobs/{id}`` until done; returns the result (a guard against a hang, not a timing
    assertion). Raises AssertionError after ``patience_s`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience_s
    s: dict = {}
    while loop.time() < deadline:
        s = await (await client.get(f"/jobs/{job_id}")).json()
        if s["state"] == "done":
            return s["result"]
        await asyncio.sleep(0.02)
    raise AssertionError(f"job {job_id} did not end within {patience_s} s: {s}")


@pytest.fixture
def wait_done():
    """``await wait_done(client, job_id, patience_s=120)`` -> the job's result once it is done."""
    return _wait_done
