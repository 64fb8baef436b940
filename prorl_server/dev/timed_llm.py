"""A labelled TEST DOUBLE standing for a GPU vLLM server at a fixed speed: the fleet tests and the scale
benchmarks (``benchmarks/server_scale.py``, ``benchmarks/fleet_scale.py``) need thousands of turns whose time is
set, which the CPU vLLM of the real-component tests cannot give. Not a model.

What it serves, in vLLM's token-in/token-out dialect:

- ``POST /v1/completions``: after ``turn_s + per_token_s * max_tokens`` seconds, the first
  ``min(max_tokens, tokens)`` of 16 fixed token ids of the tiny test model's vocabulary (4,096 ids), each with
  logprob -1.0, ``finish_reason: "length"``;
- ``GET /v1/models``: one model whose ``root`` is ``model_dir`` (the rollout server loads that tokenizer);
- ``GET /health``.

It listens on a free loopback port with a backlog of 8,192 (thousands of sessions connect at once: a backlog
of 128 drops SYNs) and writes ``{"port": N}`` to ``port_file`` once listening (atomically). Runs on uvloop
when installed.

    python -m prorl_server.dev.timed_llm --model-dir .cache/tiny-model --turn-s 0.5 --port-file P
        [--per-token-s 0.001] [--tokens 8]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
from typing import Optional

import orjson
from aiohttp import web

#: The answer's token ids (the first ``tokens`` of them): ids of the tiny model's vocabulary.
TOKENS = [72, 101, 108, 111, 32, 119, 114, 100, 33, 1200, 2048, 3001, 77, 88, 99, 400]


def app(model_dir: str, turn_s: float, per_token_s: float = 0.0, tokens: int = len(TOKENS)) -> web.Application:
    """The aiohttp application (see the module docstring); ``tokens`` in 1..16."""
    if not 1 <= tokens <= len(TOKENS):
        raise ValueError(f"tokens must be in 1..{len(TOKENS)}")
    models_body = orjson.dumps({"object": "list", "data": [{"id": "tiny", "object": "model", "root": model_dir,
                                                             "max_model_len": 16384}]})

    async def models(request: web.Request) -> web.Response:
        return web.Response(body=models_body, content_type="application/json")

    async def completions(request: web.Request) -> web.Response:
        asked = int(orjson.loads(await request.read()).get("max_tokens") or tokens)
        n = min(asked, tokens)
        await asyncio.sleep(turn_s + per_token_s * asked)
        return web.Response(body=orjson.dumps({
            "id": "cmpl", "object": "text_completion", "model": "tiny",
            "choices": [{"index": 0, "text": "", "token_ids": TOKENS[:n], "finish_reason": "length",
                         "stop_reason": None, "logprobs": {"token_logprobs": [-1.0] * n}}]}),
            content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    a = web.Application(client_max_size=64 << 20)
    a.router.add_get("/v1/models", models)
    a.router.add_get("/health", health)
    a.router.add_post("/v1/completions", completions)
    return a


async def serve(port_file: str, **kwargs) -> None:
    """Serve :func:`app` (``kwargs``) until cancelled; write the port to ``port_file`` once listening."""
    runner = web.AppRunner(app(**kwargs), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0, backlog=8192).start()
        tmp = port_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"port": runner.addresses[0][1]}, f)
        os.replace(tmp, port_file)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m prorl_server.dev.timed_llm", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True, help="the tokenizer's directory, named by /v1/models")
    p.add_argument("--turn-s", type=float, default=0.5, help="seconds per answer (default 0.5)")
    p.add_argument("--per-token-s", type=float, default=0.0, help="plus seconds per requested token (default 0)")
    p.add_argument("--tokens", type=int, default=len(TOKENS), help="token ids per answer at most (1..16)")
    p.add_argument("--port-file", required=True, help='written as {"port": N} once listening')
    args = p.parse_args(argv)
    coro = serve(args.port_file, model_dir=args.model_dir, turn_s=args.turn_s, per_token_s=args.per_token_s,
                 tokens=args.tokens)
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)


if __name__ == "__main__":
    main()
