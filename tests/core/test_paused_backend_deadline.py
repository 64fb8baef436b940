"""A backend that answers "paused" (HTTP 503) while it sleeps holds the job's deadline (issue #32 part 5): a
multi-turn job whose second turn meets a backend asleep for twice its ``timeout_s`` ends scored on its merits,
not as ``model_timeout``, and the time asleep is not in its counted time.

The server is the real one (pipeline, LLM client, ``shout`` handler with the tiny model's tokenizer); the
backend is :class:`SleepingVLLM`, a :class:`prorl_server.dev.fake_vllm.FakeVLLM` that stands for a backend
whose engine is asleep or training (verl's replica behind the relay, which answers so; a vLLM behind a proxy
that does): from its request after ``sleep_at`` served ones it answers 503 ``paused`` for ``asleep_s`` seconds.
"""
from __future__ import annotations

import asyncio
import time

from aiohttp import web

from handlers.shout.handler import ShoutHandler
from prorl_server.app import create_app
from prorl_server.config import ServerSettings
from prorl_server.dev.fake_vllm import FakeVLLM
from prorl_server.plugin.registry import HandlerRegistry

TIMEOUT_S = 2.0


class SleepingVLLM(FakeVLLM):
    """See the module docstring. ``paused_answers`` counts the 503s; ``ids`` the X-Request-Id of each request."""

    def __init__(self, asleep_s: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.asleep_s = asleep_s
        self.asleep_until = None
        self.sleep_at = None
        self.served = 0
        self.paused_answers = 0
        self.ids: list[str] = []

    async def _completions(self, request: web.Request) -> web.Response:
        self.ids.append(request.headers.get("X-Request-Id", ""))
        if self.served == self.sleep_at and self.asleep_until is None:
            self.asleep_until = time.monotonic() + self.asleep_s  # the trainer sleeps it mid-job
        if self.asleep_until is not None and time.monotonic() < self.asleep_until:
            self.paused_answers += 1
            return web.json_response({"error": {"message": "the engine is paused (asleep for a training step)",
                                                "type": "BackendPaused", "code": 503}}, status=503)
        self.served += 1
        return await super()._completions(request)


async def test_a_sleeping_backends_paused_answers_hold_the_jobs_deadline(aiohttp_client, tiny_model_dir):
    fake = SleepingVLLM(asleep_s=2 * TIMEOUT_S, step_s=0.002)
    runner = web.AppRunner(fake.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    address = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    try:
        reg = HandlerRegistry()
        reg.register(ShoutHandler)
        app = create_app(ServerSettings(tokenizer=str(tiny_model_dir), health_interval_s=3600, backends=[]),
                         registry=reg)
        client = await aiohttp_client(app)
        r = await client.post("/add_llm_server", json={"address": address, "weight_version": 0})
        assert r.status == 200
        body = {"instance": {"data_source": "shout", "prompt": "Say something.", "turns": 3},
                "sampling_params": {"max_tokens": 8, "temperature": 1.0}}
        r = await client.post("/process", json=body)  # loads the tokenizer: not what this test times
        assert (await r.json())["failure_kind"] is None
        fake.sleep_at, fake.ids = fake.served + 1, []  # asleep from the timed job's second turn on
        r = await client.post("/process", json={**body, "timeout_s": TIMEOUT_S})
        result = await r.json()
    finally:
        await runner.cleanup()
    assert r.status == 200, result
    assert fake.paused_answers >= 2 and fake.served == 6  # it slept mid-job, and every turn ran after all
    assert result["failure_kind"] is None and result["critical_error"] is None, result["error"]
    assert not result["timing"]["timeout_triggered"] and result["timing"]["counted_s"] < TIMEOUT_S
    assert result["trajectories"] and result["trajectories"][-1]["num_turns"] == 3
    # a paused turn is sent again under its request id (a backend that kept it running hands it back)
    paused_turn = fake.ids[1:1 + fake.paused_answers + 1]
    assert len(set(paused_turn)) == 1, fake.ids
