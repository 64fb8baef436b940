"""Fixtures of the gateway tests: a real rollout server (``create_app``, gateway included) on a loopback port,
a real ``openai`` SDK client per session, and a scripted policy server.

``scripted_policy`` is a labelled TEST DOUBLE standing in for a model that writes hermes tool calls (the random
tiny model does not): an OpenAI-compatible ``/v1/completions`` server in vLLM's token-in/token-out dialect that
replays a fixed script of assistant turns, tokenized with the tiny model's real tokenizer. Tests of exact
tokens use the real vLLM server (``vllm_server``) instead.
"""
from __future__ import annotations

import shutil
from typing import Callable

import psutil
import pytest
from aiohttp import web

from handlers.registry import HandlerRegistry

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


def sandbox_processes() -> list[psutil.Process]:
    """Sandbox processes (bwrap launchers and execution servers) below this test process. Used to CHECK
    cleanup only; nothing is ever killed by name."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "sandbox.exec_server" in cmd or p.name() == "bwrap":
            out.append(p)
    return out


@pytest.fixture
def sandbox_procs():
    return sandbox_processes


@pytest.fixture
def bwrap_runtime():
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap; .ci/install does it)")
    from sandbox import make_runtime

    return make_runtime("bubblewrap")


@pytest.fixture
def scripted_policy(aiohttp_server, tokenizer, tiny_model_dir):
    """``async (script) -> base URL``; ``script(prompt_text, turn) -> str`` is assistant turn ``turn``.
    Every completion it returns is appended to ``start.returned`` as ``(token_ids, logprobs)``."""
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def start(script: Callable[[str, int], str]) -> str:
        async def models(request):
            return web.json_response({"data": [{"id": str(tiny_model_dir), "max_model_len": 4096}]})

        async def health(request):
            return web.Response()

        async def completions(request):
            body = await request.json()
            prompt = tokenizer.decode(body["prompt"])
            turn = prompt.count("<|im_start|>assistant") - 1
            ids = tokenizer.encode(script(prompt, turn), add_special_tokens=False) + [end_id]
            lps = [-0.25 - 0.001 * k for k in range(len(ids))]
            start.returned.append((ids, lps))
            return web.json_response({"choices": [{
                "text": tokenizer.decode(ids), "token_ids": ids, "finish_reason": "stop",
                "logprobs": {"tokens": [f"token_id:{i}" for i in ids], "token_logprobs": lps}}]})

        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_get("/health", health)
        app.router.add_post("/v1/completions", completions)
        server = await aiohttp_server(app)
        return str(server.make_url("")).rstrip("/")

    start.returned = []
    return start
