"""Fixtures of the gateway tests: a real rollout server (``create_app``, gateway included) on a loopback port,
and a real ``openai`` SDK client per session. The scripted policy (a labelled test double standing in for a
model that writes hermes tool calls) and the sandbox fixtures are in tests/conftest.py; tests of exact tokens
use the real vLLM server (``vllm_server``).
"""
from __future__ import annotations

import pytest

from prorl_server.plugin.registry import HandlerRegistry

TOKEN = "server-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def gateway_server(aiohttp_client):
    """``async (backends, registry=None, runtime=None, **settings) -> (client, app)``: a real server with a
    bearer token configured; ``app[GATEWAY]`` is its gateway once started."""
    from prorl_server.app import create_app
    from prorl_server.config import ServerSettings

    async def make(backends, registry=None, runtime=None, **settings):
        settings.setdefault("health_interval_s", 3600)
        settings.setdefault("token", TOKEN)
        app = create_app(ServerSettings(backends=backends, **settings), registry=registry or HandlerRegistry(),
                         sandbox_runtime=runtime)
        client = await aiohttp_client(app)
        return client, app

    return make


@pytest.fixture
async def open_session():
    """``async (client) -> (session_json, AsyncOpenAI)``: POST /sessions with the server token, then an SDK
    client on the returned base_url whose only credential is the session's capability."""
    import openai

    clients = []

    async def make(client, metadata=None):
        r = await client.post("/sessions", json={"metadata": metadata or {}}, headers=AUTH)
        assert r.status == 201, await r.text()
        s = await r.json()
        sdk = openai.AsyncOpenAI(base_url=s["base_url"], api_key="not-the-server-token", max_retries=0,
                                 timeout=120)
        clients.append(sdk)
        return s, sdk

    yield make
    for sdk in clients:
        await sdk.close()


@pytest.fixture
def tap_llm():
    """``tap_llm(gateway) -> calls``: record ``(prompt_ids, Completion)`` of every call the gateway's real LLM
    client makes to vLLM (a spy on the real client, not a stand-in)."""
    def tap(gateway):
        calls = []
        real = gateway.llm.client.complete

        async def complete(prompt_ids, **kw):
            c = await real(prompt_ids, **kw)
            calls.append((list(prompt_ids), c))
            return c

        gateway.llm.client.complete = complete
        return calls
    return tap


class EveryTurnCallsEcho:
    """Tool parser standing for a model that calls ``echo`` every turn (TEST DOUBLE of the model's tool-calling
    skill only): the random tiny model does not write hermes syntax. Generation and tokens stay vLLM's."""

    name = "every-turn-echo"

    def parse(self, text: str):
        from prorl_server.llm.tool_parser import ParsedTurn, ToolCall

        call = ToolCall(name="echo", arguments={"text": text[:24]})
        return ParsedTurn(content=text, calls=[call], items=[call], raw=text)


@pytest.fixture
def echo_every_turn():
    """``echo_every_turn(gateway)``: the gateway reads an ``echo`` call in every turn (:class:`EveryTurnCallsEcho`)."""
    def install(gateway):
        gateway.engine.parser = EveryTurnCallsEcho()
    return install


@pytest.fixture
def one_trajectory_of_vllms_tokens():
    """``check(result, calls) -> Trajectory``: a session result is one trajectory, no split; its loss-masked
    tokens are exactly what vLLM generated (``calls`` from ``tap_llm``), with vLLM's logprobs, and every prompt
    vLLM got is a prefix of it."""
    from prorl_server.types import Trajectory

    def check(result, calls):
        assert result["split_reasons"] == [] and len(result["trajectories"]) == 1
        traj = Trajectory(**result["trajectories"][0])
        assert [t for t, m in zip(traj.response_ids, traj.loss_mask) if m] == \
            [t for _, c in calls for t in c.token_ids]
        assert [lp for lp, m in zip(traj.response_logprobs, traj.loss_mask) if m] == \
            [lp for _, c in calls for lp in c.logprobs]
        ids = traj.prompt_ids + traj.response_ids
        assert all(ids[:len(prompt)] == prompt for prompt, _ in calls)
        return traj
    return check


@pytest.fixture
def canned_server(aiohttp_server):
    """``async (path, body, content_type) -> base URL``: a loopback server answering every ``POST path`` with
    ``body`` (for checking that a real SDK parses what a translation produces)."""
    from aiohttp import web

    async def make(path: str, body: bytes, content_type: str) -> str:
        async def reply(request):
            return web.Response(body=body, content_type=content_type)

        app = web.Application()
        app.router.add_post(path, reply)
        return str((await aiohttp_server(app)).make_url(""))

    return make
