"""Fixtures of the trainer-side tests: real rollout servers (the project's aiohttp app on a loopback TCP port,
reached by the client over HTTP) serving a handler whose samples differ in reward and duration.

``VariedHandler`` is a test double for a real task handler (math, code): it does no task work. Each job of an
instance is the k-th one the server has seen for that instance id and gets ``rewards[k % len]`` after
sleeping ``sleeps[k % len]`` seconds in run, so a group of n samples has scripted rewards and one slow
sample can be made to straddle a training step.
"""
from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from handlers.arithmetic import ArithmeticHandler
from handlers.base import AgentHandler
from handlers.registry import HandlerRegistry
from prorl_server.app import create_app
from prorl_server.config import ServerSettings


class VariedHandler(AgentHandler):
    """``{"data_source": "varied", "id": "p1", "rewards": [0, 1], "sleeps": [0, 5]}`` (see module doc).
    ``self.started`` counts jobs per instance id; ``self.seen`` lists job ids in arrival order."""

    name = "varied"
    needs_llm = False

    def __init__(self) -> None:
        self.started: Counter = Counter()
        self.seen: list[str] = []

    async def init(self, job):
        key = str(job.instance.get("id"))
        job.state["k"] = self.started[key]
        self.started[key] += 1
        self.seen.append(job.job_id)

    async def run(self, job):
        sleeps = job.instance.get("sleeps") or [0]
        delay = sleeps[job.state["k"] % len(sleeps)]
        if delay:
            await asyncio.sleep(delay)

    async def eval(self, job):
        rewards = job.instance.get("rewards") or [1.0]
        job.reward = float(rewards[job.state["k"] % len(rewards)])
        job.resolved = job.reward > 0


@pytest.fixture
def varied():
    return VariedHandler()


@pytest.fixture
def start_server(aiohttp_server, varied):
    """``await start_server(**settings)`` -> base URL of a real rollout server on loopback."""

    async def start(**settings):
        registry = HandlerRegistry()
        registry.register(ArithmeticHandler)
        registry.register(varied)
        settings.setdefault("health_interval_s", 3600)
        server = await aiohttp_server(create_app(ServerSettings(**settings), registry=registry))
        return str(server.make_url("")).rstrip("/")

    return start


@pytest.fixture
def job_state():
    """``await job_state(url, job_id)`` -> ``GET /jobs/{job_id}`` on a server, as the server sees it."""
    import aiohttp

    async def get(url: str, job_id: str) -> dict:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{url}/jobs/{job_id}") as r:
                return await r.json()

    return get
