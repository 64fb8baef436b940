"""A fake vLLM server: it stands for a real vLLM's HTTP API (``/v1/completions`` token in / token out and the
development endpoints a weight swap uses) in tests and benchmarks that need hundreds of requests or faults a
real engine cannot be made to show on cue. Not a model: it generates one token per request per engine step.

What it implements, as vLLM 0.31 does:
- ``POST /v1/completions`` (``prompt`` as token ids, ``max_tokens``, ``logprobs``, ``X-Request-Id``); the
  answer has ``choices[0].token_ids`` / ``logprobs.tokens`` (``token_id:N``) / ``finish_reason``.
- ``POST /pause?mode=keep|abort``: keep freezes running requests (they go on at ``/resume``); abort ends them
  with ``finish_reason: "abort"`` and the tokens generated so far. New requests wait while paused.
- ``POST /resume``, ``GET /is_paused``, ``GET /health``, ``GET /v1/models``.
- ``POST /reset_prefix_cache?reset_running_requests=true``: the running requests' KV is recomputed with the
  weights loaded when they next run (vLLM preempts them); without it, only the prefix cache is cleared.
- ``POST /collective_rpc`` methods ``prorl_progress`` (tokens generated per running request, as
  :class:`trainer_plugins.vllm_progress.ProgressExtension`) and ``fake_load`` (args ``[version]``: new
  weights; stands for ``prorl_load_weights``).

Scripted turns: with ``script`` (``prompt token ids -> token ids``), a request generates the script's tokens
for its prompt, one per engine step, and ends ``"stop"`` after the last (a model whose turns are fixed, e.g. a
scripted agent's tool calls, at a fixed per-token step time). :meth:`FakeVLLM.crash` stands for a backend dying
mid-turn: the connections of the running requests are dropped and every later request's connection is closed at
once, as a killed process's would be.

What a test can check, and a real engine cannot show: the token id generated at each step is
``1000 + version`` of the weights that generated it, and the answer carries ``fake.kv_versions``: for each
generated token, the oldest weight version among the KV entries it attended to (the prompt's KV included; a
prefix-cache hit keeps the version it was computed with).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from aiohttp import web

TOKEN_BASE = 1000


@dataclass(eq=False)
class _Req:
    rid: str
    prompt: list[int]
    max_tokens: int
    kv: list[int]  # weight version each context position's KV was computed with
    tokens: list[int] = field(default_factory=list)
    kv_min: list[int] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    finish: str = "length"
    recompute: bool = False
    script: Optional[list[int]] = None  # the tokens this request generates (with FakeVLLM.script)
    transport: Optional[asyncio.BaseTransport] = None
    arrived: float = 0.0  # time.monotonic() when the request reached the server
    scheduled: Optional[float] = None  # ... and when the engine step that gave it its first token began
    first_token_at: float = 0.0  # when the steps that gave it its first and its last token ended
    last_token_at: float = 0.0


class FakeVLLM:
    """One fake backend. ``step_s``: seconds per engine step (every running request gets one token);
    ``version``: the weights' version; ``progress``: whether ``prorl_progress`` is offered (a vLLM started
    without the worker extension answers an error); ``fail``: endpoint paths (``/pause``, ``/resume``,
    ``/reset_prefix_cache``) that answer 500, to inject faults; ``script``: ``prompt ids -> generated ids`` (see
    the module docstring; None: ``TOKEN_BASE + version`` until ``max_tokens``); ``per_request_metrics``: answers
    carry ``metrics`` as vLLM 0.31 started with ``--enable-per-request-metrics`` does: ``queue_time_ms`` (from
    the request's arrival, a paused engine's wait included, to the start of the step that gave it its first
    token), ``time_to_first_token_ms`` (to that step's end) and ``generation_time_ms`` (from there to the end of
    the step that gave it its last token), on the engine's step clock;
    ``catch_up``: steps keep to the clock, ``step_s`` apart, whatever the host's load (an accelerator's step time
    does not depend on the host's CPU): a step the event loop woke late for is made with the ones it missed."""

    def __init__(self, *, step_s: float = 0.01, version: int = 0, progress: bool = True,
                 model: str = "fake", script: Optional[Callable[[list[int]], list[int]]] = None,
                 per_request_metrics: bool = False, catch_up: bool = False) -> None:
        self.step_s, self.version, self.progress, self.model = step_s, version, progress, model
        self.script, self.per_request_metrics, self.catch_up = script, per_request_metrics, catch_up
        self.dead = False
        self.paused: Optional[str] = None
        self.running: dict[str, _Req] = {}
        self.prefix_cache: dict[tuple[int, ...], list[int]] = {}
        self.fail: set[str] = set()
        self.finished: list[_Req] = []  # every request that ended, in order (tests read tokens and kv_min)
        self.counts = {"requests": 0, "aborted": 0, "pauses": 0, "resumes": 0}
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._work = asyncio.Event()
        self._engine: Optional[asyncio.Task] = None

    def app(self) -> web.Application:
        app = self._app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_post("/pause", self._pause)
        app.router.add_post("/resume", self._resume)
        app.router.add_get("/is_paused", self._is_paused)
        app.router.add_post("/reset_prefix_cache", self._reset)
        app.router.add_post("/collective_rpc", self._rpc)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self._engine = asyncio.create_task(self._loop())

    async def _stop(self, app: web.Application) -> None:
        if self._engine is not None:
            self._engine.cancel()

    # ------------------------------------------------------------------ engine
    async def _loop(self) -> None:
        due: Optional[float] = None  # with catch_up: when the step under way ends (time.monotonic)
        while True:
            if not self._unpaused.is_set():
                await self._unpaused.wait()
                due = None
            if not self.running:
                self._work.clear()
                await self._work.wait()
                due = None
                continue
            now = time.monotonic()
            if due is None:
                due = now + self.step_s
            await asyncio.sleep(max(0.0, due - now))
            if self.paused:
                due = None
                continue
            starts = [due - self.step_s]  # when each step this wake-up makes began
            if self.catch_up:  # a late wake-up makes the steps it missed
                late = time.monotonic()
                while late - due >= self.step_s and len(starts) < 10_000:
                    due += self.step_s
                    starts.append(due - self.step_s)
                due += self.step_s
            else:
                due = None
            for start in starts:
                self._step(start)

    def _step(self, start: float) -> None:
        """One engine step that began at ``start`` (time.monotonic): one token for every running request (with
        ``catch_up``, those that had arrived by then)."""
        for r in list(self.running.values()):
            if self.catch_up and r.arrived > start:
                continue
            if r.recompute:  # preempted by a reset: its KV is computed again with today's weights
                r.kv = [self.version] * len(r.kv)
                r.recompute = False
            if r.scheduled is None:
                r.scheduled = max(r.arrived, start)
                r.first_token_at = start + self.step_s
            r.last_token_at = start + self.step_s
            r.tokens.append(TOKEN_BASE + self.version if r.script is None else r.script[len(r.tokens)])
            r.kv_min.append(min(r.kv) if r.kv else self.version)
            r.kv.append(self.version)
            if r.script is not None and len(r.tokens) >= len(r.script):
                self._end(r, "stop")
            elif len(r.tokens) >= r.max_tokens:
                self._end(r, "length")

    def _end(self, r: _Req, finish: str) -> None:
        r.finish = finish
        self.running.pop(r.rid, None)
        self.finished.append(r)
        key = tuple(r.prompt[:16])
        self.prefix_cache.setdefault(key, r.kv[:len(key)])
        r.done.set()

    # ------------------------------------------------------------------ HTTP
    def crash(self) -> None:
        """Die mid-turn: drop the running requests' connections (the client sees the server disconnect) and
        close every later request's connection unanswered."""
        self.dead = True
        for r in list(self.running.values()):
            if r.transport is not None:
                r.transport.close()
            self._end(r, "abort")

    async def _completions(self, request: web.Request) -> web.Response:
        if self.dead:
            if request.transport is not None:
                request.transport.close()
            raise web.HTTPServiceUnavailable()  # not seen: the connection is gone
        arrived = time.monotonic()
        body = await request.json()
        await self._unpaused.wait()  # a paused engine queues new requests
        prompt = [int(t) for t in body["prompt"]]
        rid = request.headers.get("X-Request-Id") or f"fake-{id(body)}"
        rid = f"cmpl-{rid}-0-{self.counts['requests']:08x}"
        self.counts["requests"] += 1
        cached = self.prefix_cache.get(tuple(prompt[:16]))
        kv = (list(cached) + [self.version] * (len(prompt) - len(cached))) if cached else [self.version] * len(prompt)
        r = _Req(rid, prompt, int(body.get("max_tokens") or 16), kv, transport=request.transport, arrived=arrived)
        if self.script is not None:
            r.script = list(self.script(prompt)) or None
        self.running[rid] = r
        self._work.set()
        try:
            await r.done.wait()
        except asyncio.CancelledError:  # the client went away: vLLM aborts the request
            self.running.pop(rid, None)
            raise
        metrics = None
        if self.per_request_metrics:
            scheduled = r.scheduled if r.scheduled is not None else time.monotonic()
            metrics = {"queue_time_ms": 1000.0 * (scheduled - r.arrived)}
            if r.tokens:
                metrics.update(time_to_first_token_ms=1000.0 * (r.first_token_at - scheduled),
                               generation_time_ms=1000.0 * (r.last_token_at - r.first_token_at))
        return web.json_response({
            "id": rid, "object": "text_completion", "model": self.model, "metrics": metrics,
            "choices": [{"index": 0, "text": "", "token_ids": r.tokens, "finish_reason": r.finish,
                         "stop_reason": None,
                         "logprobs": {"tokens": [f"token_id:{t}" for t in r.tokens],
                                      "token_logprobs": [-0.5] * len(r.tokens)}}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(r.tokens)},
            "fake": {"kv_versions": r.kv_min}})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": self.model, "max_model_len": 1 << 20}]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({})

    def _failing(self, path: str) -> Optional[web.Response]:
        return web.json_response({"error": f"fake fault on {path}"}, status=500) if path in self.fail else None

    async def _pause(self, request: web.Request) -> web.Response:
        if (bad := self._failing("/pause")) is not None:
            return bad
        mode = request.query.get("mode", "abort")
        self.counts["pauses"] += 1
        self.paused = mode
        if mode == "abort":
            for r in list(self.running.values()):
                self.counts["aborted"] += 1
                self._end(r, "abort")
        self._unpaused.clear()
        return web.json_response({"status": "paused"})

    async def _resume(self, request: web.Request) -> web.Response:
        if (bad := self._failing("/resume")) is not None:
            return bad
        self.counts["resumes"] += 1
        self.paused = None
        self._unpaused.set()
        return web.json_response({"status": "resumed"})

    async def _is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.paused is not None})

    async def _reset(self, request: web.Request) -> web.Response:
        if (bad := self._failing("/reset_prefix_cache")) is not None:
            return bad
        self.prefix_cache.clear()
        if request.query.get("reset_running_requests", "false").lower() == "true":
            for r in self.running.values():
                r.recompute = True
        return web.json_response({"success": True})

    async def _rpc(self, request: web.Request) -> web.Response:
        body = await request.json()
        method = body.get("method")
        if method == "prorl_progress" and self.progress:
            return web.json_response({"results": [{rid: len(r.tokens) for rid, r in self.running.items()}]})
        if method == "fake_load":
            self.version = int(body["args"][0])
            return web.json_response({"results": [None]})
        return web.json_response({"error": f"method {method!r} not found"}, status=500)


async def start_fake_vllm(**kwargs) -> tuple[FakeVLLM, web.AppRunner, str]:
    """Start a :class:`FakeVLLM` on a free loopback port: ``(fake, runner, address)``; ``runner.cleanup()``
    stops it."""
    fake = FakeVLLM(**kwargs)
    runner = web.AppRunner(fake.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return fake, runner, f"http://127.0.0.1:{port}"
