"""A labelled TEST DOUBLE standing in for a GPU vLLM server whose turns take seconds (issue #24's fleet tests):
an OpenAI-compatible ``/v1/completions`` in vLLM's token-in/token-out dialect that sleeps ``--turn-s`` seconds
and answers 8 fixed token ids of the tiny model's vocabulary with a logprob each (``finish_reason: length``),
``/v1/models`` naming the tiny model's directory (so the rollout server loads its real tokenizer), and
``/health``. Writes its port to ``--port-file`` once listening.

    python tests/trainer/fleet_fake_llm.py --model-dir .cache/tiny-model --turn-s 0.5 --port-file P
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os

from aiohttp import web

TOKENS = [72, 101, 108, 111, 32, 119, 114, 100]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", required=True)
    p.add_argument("--turn-s", type=float, default=0.5)
    p.add_argument("--port-file", required=True)
    args = p.parse_args()

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model",
                                                               "root": args.model_dir, "max_model_len": 16384}]})

    async def completions(request):
        body = await request.json()
        n = min(int(body.get("max_tokens") or 8), len(TOKENS))
        await asyncio.sleep(args.turn_s)
        return web.json_response({"id": "cmpl", "object": "text_completion", "model": "tiny", "choices": [{
            "index": 0, "text": "", "token_ids": TOKENS[:n], "finish_reason": "length", "stop_reason": None,
            "logprobs": {"token_logprobs": [-1.0] * n}}]})

    async def serve():
        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_get("/health", lambda r: web.Response())
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        # thousands of sessions connect at once (benchmarks/fleet_scale.py): a backlog of 128 would drop SYNs
        await web.TCPSite(runner, "127.0.0.1", 0, backlog=8192).start()
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"port": runner.addresses[0][1]}, f)
        os.replace(tmp, args.port_file)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
