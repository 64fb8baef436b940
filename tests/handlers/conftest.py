"""Fixtures for the handler tests: a rollout server with the shipped handlers on real bubblewrap sandboxes, and
a scripted policy server.

``scripted_policy`` is a labelled TEST DOUBLE standing in for a capable model: an OpenAI-compatible
``/v1/completions`` server (the vLLM token-in/token-out dialect: ``prompt`` = token ids, ``token_ids`` and
``logprobs`` in the answer) that replays a fixed script of assistant turns, tokenized with the tiny model's
real tokenizer. Everything else in those tests is real: server, pipeline, agent loop, sandboxes, evaluation.
"""
from __future__ import annotations

import shutil
from typing import Callable

import psutil
import pytest
from aiohttp import web

from handlers.registry import HandlerRegistry


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
    """The :func:`sandbox_processes` check, for tests."""
    return sandbox_processes


@pytest.fixture
def bwrap_runtime():
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap; .ci/install does it)")
    from sandbox import make_runtime

    return make_runtime("bubblewrap")


@pytest.fixture
def registry():
    r = HandlerRegistry()
    r.load_entry_points()
    return r


@pytest.fixture
def rollout_server(aiohttp_client, registry, bwrap_runtime):
    """``async (backends: list[str], **settings) -> client`` of a real server with the shipped handlers."""
    from prorl_server.app import create_app
    from prorl_server.config import ServerSettings

    async def make(backends, **settings):
        settings.setdefault("health_interval_s", 3600)
        app = create_app(ServerSettings(backends=backends, **settings), registry=registry,
                         sandbox_runtime=bwrap_runtime)
        return await aiohttp_client(app)

    return make


@pytest.fixture
def scripted_policy(aiohttp_server, tokenizer, tiny_model_dir):
    """``async (script) -> base URL``; ``script(prompt_text, turn) -> str`` gives assistant turn ``turn``
    (0-based) of the conversation whose rendered prompt is ``prompt_text``."""
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def start(script: Callable[[str, int], str]) -> str:
        async def models(request):
            return web.json_response({"data": [{"id": str(tiny_model_dir), "max_model_len": 16384}]})

        async def health(request):
            return web.Response()

        async def completions(request):
            body = await request.json()
            prompt = tokenizer.decode(body["prompt"])
            turn = prompt.count("<|im_start|>assistant") - 1
            ids = tokenizer.encode(script(prompt, turn), add_special_tokens=False) + [end_id]
            finish = "stop"
            if len(ids) > body["max_tokens"]:
                ids, finish = ids[:body["max_tokens"]], "length"
            return web.json_response({"choices": [{
                "text": tokenizer.decode(ids), "token_ids": ids, "finish_reason": finish,
                "logprobs": {"tokens": [f"token_id:{i}" for i in ids], "token_logprobs": [-0.25] * len(ids)}}]})

        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_get("/health", health)
        app.router.add_post("/v1/completions", completions)
        server = await aiohttp_server(app)
        return str(server.make_url("")).rstrip("/")

    return start
