"""Fixtures of the trainer-side tests: real rollout servers (the project's aiohttp app on a loopback TCP port,
reached by the client over HTTP) with test-double handlers:

- ``VariedHandler`` stands in for a real task handler (math, code) and does no task work. Each job of an
  instance is the k-th one the server has seen for that instance id and gets ``rewards[k % len]`` after
  sleeping ``sleeps[k % len]`` seconds in run, so a group of n samples has scripted rewards and one slow
  sample can be made to straddle a training step.
- ``FixedTrajectoryHandler`` stands in for an LLM handler with no LLM: it returns the trajectory the instance
  gives (exact token ids, logprobs, mask, weight versions), or several segments (a rollout split by a context
  rewrite); it can fail its first jobs with a dead sandbox (fault injection).
- ``ChatHandler`` is the math handler without sandbox tools: one real LLM turn, math-verify reward.
"""
from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from handlers.arithmetic import ArithmeticHandler
from prorl_server.plugin.handler import AgentHandler
from prorl_server.plugin.registry import HandlerRegistry
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


def pytest_configure(config):
    config.addinivalue_line("markers", "verl_cpu: the real verl run on CPU (run_cpu.sh; select alone with -m verl_cpu)")


@pytest.fixture
def varied():
    return VariedHandler()


@pytest.fixture
def serve_handlers(aiohttp_server):
    """``await serve_handlers(*handlers, backends=(), sandbox_runtime=None, middlewares=(), **settings)`` ->
    base URL of a real rollout server (the project's app on a loopback port) serving exactly ``handlers``
    (classes or instances) with the LLM ``backends`` registered (weight version 0). ``middlewares``: aiohttp
    middlewares added to the app (to observe requests), ``settings``: more :class:`ServerSettings` fields
    (``health_interval_s`` defaults to 3600: no health probe during a test)."""

    async def start(*handlers, backends=(), sandbox_runtime=None, middlewares=(), **settings):
        registry = HandlerRegistry()
        for handler in handlers:
            registry.register(handler)
        settings.setdefault("health_interval_s", 3600)
        app = create_app(ServerSettings(backends=list(backends), **settings), registry=registry,
                         sandbox_runtime=sandbox_runtime)
        app.middlewares[:0] = middlewares  # outermost: they see the answers as clients get them
        server = await aiohttp_server(app)
        return str(server.make_url("")).rstrip("/")

    return start


@pytest.fixture
def compose_verl(tiny_model_dir):
    """``compose_verl(name="prorl_dapo", *overrides, prompt_length=64, response_length=16)`` -> a shipped
    verl config (``trainer_plugins/verl/config/{name}.yaml``) composed by Hydra as ``verl.trainer.main_ppo``
    composes it, with the tiny model, the given prompt/response lengths (tokens), our agent loop YAML and
    ``overrides`` (Hydra override strings)."""

    def compose_(name: str = "prorl_dapo", *overrides: str, prompt_length: int = 64, response_length: int = 16):
        from hydra import compose, initialize_config_dir

        from trainer_plugins.verl import CONFIG_DIR

        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            return compose(config_name=name, overrides=[
                f"actor_rollout_ref.model.path={tiny_model_dir}",
                f"actor_rollout_ref.rollout.prompt_length={prompt_length}",
                f"actor_rollout_ref.rollout.response_length={response_length}",
                f"actor_rollout_ref.rollout.agent.agent_loop_config_path={CONFIG_DIR / 'agent_loop.yaml'}",
                *overrides,
            ])

    return compose_


@pytest.fixture
def start_server(serve_handlers, varied):
    """``await start_server(**settings)`` -> base URL of a real rollout server on loopback."""

    async def start(**settings):
        return await serve_handlers(ArithmeticHandler, varied, **settings)

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


class FixedTrajectoryHandler(AgentHandler):
    """Stands in for an LLM handler when no LLM runs: returns the trajectory given in the instance
    (``{"data_source": "fixed", "trajectory": {prompt_ids, response_ids, response_logprobs, loss_mask,
    weight_versions}, "reward": 1.0, "sleep": 0}``; ``"rewards": [1, 0]`` instead gives the k-th job of the
    instance's ``id`` ``rewards[k % len]``), or the segments of ``"trajectories": [...]`` (a rollout
    split by a template or context rewrite), after sleeping ``sleep`` seconds in run, so the verl adapter's
    conversion, truncation and cancellation can be checked exactly.

    Fault injection: with ``"fail_first": k`` the first k jobs of the instance's ``id`` raise
    :class:`sandbox.errors.SandboxDeadError` in run: they stand for a job whose sandbox died under it (the
    server gives them ``failure_kind="sandbox"``, ``filter: true``). ``self.jobs`` counts jobs per ``id``."""

    name = "fixed"
    needs_llm = False

    def __init__(self) -> None:
        self.jobs: Counter = Counter()

    async def run(self, job):
        key = str(job.instance.get("id"))
        self.jobs[key] += 1
        job.state["k"] = self.jobs[key] - 1
        if self.jobs[key] <= int(job.instance.get("fail_first", 0)):
            from sandbox.errors import SandboxDeadError

            raise SandboxDeadError(f"injected: the sandbox of job {job.job_id} died (attempt {self.jobs[key]})")
        if job.instance.get("sleep"):
            await asyncio.sleep(job.instance["sleep"])
        from prorl_server.types import Trajectory

        segments = job.instance.get("trajectories") or [job.instance["trajectory"]]
        job.trajectories = [Trajectory(**t) for t in segments]
        job.messages = list(job.instance.get("messages") or [])

    async def eval(self, job):
        rewards = job.instance.get("rewards")  # per job of the id, cycled: a group with varied rewards
        k = job.state.get("k", 0)
        job.reward = float(rewards[k % len(rewards)] if rewards else job.instance.get("reward", 0.0))
        job.resolved = job.reward > 0


class ChatHandler(AgentHandler):
    """Stands in for the ``math`` handler without its sandbox tools: one assistant turn from the real LLM
    backend through the project's token-in/token-out agent loop, scored by the math handler's scorer
    (math-verify on the last ``\\boxed{}``; a random tiny model scores 0)."""

    name = "chat"
    needs_llm = True

    async def run(self, job):
        from prorl_server.plugin.toolkit import run_agent
        from prorl_server.llm.agent_loop import AgentConfig

        await run_agent(job, job.instance["messages"], {}, AgentConfig(max_turns=1, finish_tool=None))

    async def eval(self, job):
        from handlers.math.scoring import score

        text = next((m["content"] for m in reversed(job.messages) if m["role"] == "assistant"), "")
        job.reward, _ = score(job.instance, text)
        job.resolved = job.reward > 0


@pytest.fixture
def fixed():
    """The ``FixedTrajectoryHandler`` every server of a test shares (its ``jobs`` counter)."""
    return FixedTrajectoryHandler()


@pytest.fixture
def start_llm_server(serve_handlers, fixed):
    """``await start_llm_server(backends)`` -> base URL of a real rollout server serving ``fixed`` and
    ``chat`` with the given LLM backends registered (weight version 0)."""

    async def start(backends=(), **settings):
        return await serve_handlers(fixed, ChatHandler, backends=backends, **settings)

    return start
