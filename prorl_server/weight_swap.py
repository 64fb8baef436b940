"""Weight swaps the rollout server orchestrates: pause every backend in vLLM's keep mode, let the trainer load
new weights, resume under the new ``weight_version``, and lose no work.

A trainer calls, around each weight update::

    POST /weights/pause   {"weight_version": 8, "kv": "keep", "max_staleness": 2, "lease_s": 300}
        -> {"swap_id": "...", "backends": {"http://gpu1:8000": "paused", ...}, "dropped_jobs": 0, ...}
    (the trainer loads the weights into each backend: vLLM's /collective_rpc, NCCL, ...)
    POST /weights/resume  {"swap_id": "...", "weight_version": 8, "failed": {}}

**Pause.** New LLM calls (agent turns of ``/process`` jobs and gateway requests alike) are held inside the
server (:meth:`~prorl_server.balancer.BackendPool.hold`): they wait, nothing is refused. Every registered
backend gets ``POST /pause?mode=keep`` (vLLM >= 0.31, development mode): requests already inside the engine
are frozen with their KV cache and continue after ``/resume``; none is aborted, no generated token is thrown
away. Then the backend is asked how far each frozen request had got (``POST /collective_rpc
{"method": "prorl_progress"}``, the worker extension :class:`trainer_plugins.vllm_progress.ProgressExtension`, included in
:class:`trainer_plugins.vllm_weights.WeightLoaderExtension`),
which splits each of those turns exactly into an old-version prefix and a new-version suffix
(:attr:`~prorl_server.llm.client.Completion.version_runs`); a backend without the extension answers nothing
and such a turn is labelled ``[[None, n]]`` (unknown split) and counted as mixed.

**Staleness.** With ``max_staleness: k``, jobs whose first turn was generated with weights older than
``weight_version - k`` are cancelled at pause time (``failure_kind: cancelled``, filtered; the trainer
resubmits) and counted in ``dropped_jobs``.

**Resume.** Each backend that loaded gets the new version (a turn sent after the resume reads it), then with
``kv: "recompute"`` ``POST /reset_prefix_cache?reset_running_requests=true`` (vLLM preempts the frozen
requests and recomputes their KV with the new weights: no token after the swap attends to KV computed under
the old ones; ``success: false`` is an error), then ``POST /resume``; held calls are released.

**Time.** A job's timeout does not run while a swap holds it: at the resume (or the lease's end) every live
job's running deadline stops at the pause and restarts at the resume with what it had left
(:meth:`~prorl_server.job.Job.hold_deadline`), so a slow load is never a job's ``model_timeout``.

**Faults.** A backend that fails to pause, to load (the trainer lists it in ``failed``), to reset its cache or
to resume is taken out of the rotation with its reason (:meth:`~prorl_server.balancer.BackendPool.withdraw`;
it comes back only when registered again) and the calls it held are re-sent to another backend: no job is
lost. A trainer that never resumes (it died) does not leave the fleet paused: at the lease's deadline the
server resumes every backend in the engine and withdraws it (whether the trainer loaded anything is unknown:
no token is served under a version that may be wrong) until ``/add_llm_server`` registers it again with the
version it serves; jobs wait for it (``backend_wait_s``); a late resume is a 409 ``swap_expired``.

Sources: vLLM's development endpoints (``vllm/entrypoints/serve/dev/rlhf``: ``/pause`` modes abort / wait /
keep, ``/resume``; ``dev/cache``: ``/reset_prefix_cache?reset_running_requests``); PipelineRL (in-flight
weight updates keep the running sequences' KV); ProRL Agent paper, section 3.3 (weight versions).
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, field_validator

from prorl_server.balancer import Backend, BackendPool
from prorl_server.llm.client import REQUEST_ID, LLMClient, SwapMark
from prorl_server.types import StrictInt64, normalise_backend_address

log = logging.getLogger(__name__)

#: The worker-extension method that reports each running request's generated-token count.
PROGRESS_RPC = "prorl_progress"
#: Counters of :attr:`SwapCoordinator.counters` exported on /metrics (key -> (name, help)).
SWAP_COUNTS = {
    "swaps": ("prorl_weight_swaps", "Weight swaps resumed by their trainer"),
    "expired": ("prorl_weight_swaps_expired", "Weight swaps whose lease ran out (backends resumed under their "
                "old version)"),
    "dropped_jobs": ("prorl_weight_swap_dropped_jobs", "Jobs cancelled at a pause for being staler than the "
                     "trainer's max_staleness"),
    "withdrawn_backends": ("prorl_weight_swap_withdrawn_backends", "Backends taken out of the rotation for "
                           "failing a pause, a load, a cache reset or a resume"),
    "split_turns": ("prorl_weight_swap_split_turns", "Requests in flight at a pause (their tokens are split "
                    "between the old and new version)"),
}


class PauseRequest(BaseModel):
    """Body of ``POST /weights/pause``."""

    model_config = ConfigDict(extra="forbid")
    weight_version: StrictInt64 = Field(description="the version the trainer is about to load")
    kv: Literal["keep", "recompute"] = Field("keep", description="keep: frozen requests go on over the KV cache "
                                             "computed with the old weights; recompute: it is recomputed with "
                                             "the new ones at resume")
    max_staleness: Optional[int] = Field(None, ge=0, strict=True, description="cancel jobs whose first turn is older than "
                                         "weight_version - max_staleness")
    lease_s: float = Field(300.0, gt=0, le=3600, strict=True, description="seconds until the server resumes by itself")


class PauseResponse(BaseModel):
    swap_id: str
    weight_version: int
    backends: dict[str, str] = Field(description="address -> 'paused' or why it failed (then withdrawn)")
    held_calls: int = Field(description="LLM calls in flight at the backends when they paused")
    dropped_jobs: int
    deadline: float = Field(description="unix time at which the lease ends")
    pause_s: float


class ResumeRequest(BaseModel):
    """Body of ``POST /weights/resume``."""

    model_config = ConfigDict(extra="forbid")
    swap_id: str = Field(min_length=1, max_length=64)
    weight_version: Optional[StrictInt64] = Field(None, description="default: the pause's")
    failed: dict[str, str] = Field(default_factory=dict, max_length=4096,
                                   description="backends that did not load the weights -> why (addresses as "
                                   "registered; a trailing / or /v1 is ignored)")

    @field_validator("failed")
    @classmethod
    def _addresses(cls, v: dict[str, str]) -> dict[str, str]:
        return {normalise_backend_address(k).lower(): r for k, r in v.items()}


class ResumeResponse(BaseModel):
    weight_version: int
    backends: dict[str, str] = Field(description="address -> 'resumed' or why it failed (then withdrawn)")
    held_s: float = Field(description="seconds from the pause to the resume")
    resume_s: float
    tokens_discarded: int = Field(description="generated tokens thrown away by LLM calls since the server "
                                  "started (aborted turns that were re-sent); 0 when every swap was kept")


class SwapInfo(BaseModel):
    swap_id: str
    weight_version: int
    kv: str
    deadline: float


class BackendWeights(BaseModel):
    address: str
    weight_version: Optional[int]
    healthy: bool
    registered: bool
    paused: bool
    withdrawn: Optional[str] = None


class WeightsState(BaseModel):
    """``GET /weights``."""

    weight_version: Optional[int]
    swap: Optional[SwapInfo]
    backends: list[BackendWeights]
    counters: dict[str, int]


class SwapError(Exception):
    """A swap request that cannot be honoured: ``status`` (409) and ``type``."""

    def __init__(self, status: int, type_: str, message: str) -> None:
        super().__init__(message)
        self.status, self.type = status, type_


@dataclass(eq=False)
class _Swap:
    swap_id: str
    weight_version: int
    kv: str
    deadline: float
    t_paused: float
    marks: dict[str, SwapMark] = field(default_factory=dict)  # address -> its mark (paused backends)
    lease: Optional[asyncio.Task] = None


class SwapCoordinator:
    """The server's side of weight swaps (see the module docstring).

    Args:
        pool: the backend pool (held and released; backends withdrawn).
        client: the server's LLM client (its ``in_flight`` calls are split or moved; its session is used).
        cancel_job: ``async (job_id, reason) -> bool`` cancels a live job (staleness).
        live_jobs: ``() -> iterable of jobs`` with ``job_id``, ``finished`` and ``first_weight_version``.
        timeout_s: per HTTP call to a backend.
    """

    def __init__(self, pool: BackendPool, client: Callable[[], LLMClient], *,
                 live_jobs: Callable[[], Any] = lambda: (), cancel_job: Optional[Callable[..., Any]] = None,
                 timeout_s: float = 15.0) -> None:
        self.pool = pool
        self._client = client
        self._live_jobs = live_jobs
        self._cancel_job = cancel_job
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.current: Optional[_Swap] = None
        self._expired: dict[str, str] = {}  # swap_id -> why (last 64)
        self._lock = asyncio.Lock()
        self.counters = {k: 0 for k in SWAP_COUNTS}
        self.last_version: Optional[int] = None

    # ------------------------------------------------------------------ HTTP to one backend
    async def _post(self, b: Backend, path: str, params: Optional[dict] = None, json: Any = None) -> Any:
        async with self._client().session.post(f"{b.address}{path}", params=params, json=json,
                                               timeout=self.timeout) as r:
            text = await r.text()
            if r.status != 200:
                raise RuntimeError(f"{path} answered HTTP {r.status}: {text[:300]}")
            try:
                import json as _json

                return _json.loads(text) if text else None
            except ValueError:
                return None

    async def _progress(self, b: Backend) -> Optional[dict[str, int]]:
        """Generated tokens of each of our requests running on ``b`` (by our request id), or None when the
        backend cannot say (no worker extension, an error)."""
        try:
            data = await self._post(b, "/collective_rpc", json={"method": PROGRESS_RPC})
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, OSError) as e:
            log.info("%s cannot report its requests' progress (%s): turns it holds get an unknown split",
                     b.address, e)
            return None
        results = data.get("results") if isinstance(data, dict) else None
        if not isinstance(results, list) or not results or not isinstance(results[0], dict):
            return None
        out: dict[str, int] = {}
        for rid, n in results[0].items():
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                log.warning("%s reported progress %r for %r: its report is not used", b.address, n, rid)
                return None  # one impossible count and none of the report is trusted
            m = REQUEST_ID.search(str(rid))
            if m:
                out[m.group(0)] = n
        return out

    def _withdraw(self, b: Backend, reason: str) -> None:
        """Out of the rotation; the calls it holds go elsewhere."""
        self.pool.withdraw(b.address, reason)
        self.counters["withdrawn_backends"] += 1
        for call in list(self._client().in_flight.get(b.address, {}).values()):
            call.move(f"{b.address}: {reason}")

    # ------------------------------------------------------------------ pause
    async def pause(self, req: PauseRequest) -> PauseResponse:
        """Hold new calls, pause every registered backend in keep mode, split the calls it holds, drop stale
        jobs. Raises :class:`SwapError` 409 ``swap_in_progress``."""
        async with self._lock:
            if self.current is not None:
                raise SwapError(409, "swap_in_progress", f"swap {self.current.swap_id} (weights "
                                f"v{self.current.weight_version}) holds the backends until it is resumed or "
                                f"its lease ends in {max(0.0, self.current.deadline - time.time()):.0f} s")
            t0 = time.monotonic()
            swap = _Swap(secrets.token_hex(8), req.weight_version, req.kv, time.time() + req.lease_s, t0)
            self.current = swap
            self.pool.hold()
            self._hold_jobs()
            backends = self.pool.backends
            outcomes = await asyncio.gather(*(self._pause_one(b, swap) for b in backends))
            dropped = await self._drop_stale(req) if req.max_staleness is not None else 0
            swap.lease = asyncio.create_task(self._expire(swap, req.lease_s), name=f"swap-lease-{swap.swap_id}")
            held = sum(n for _, n in outcomes)
            self.counters["split_turns"] += held
            log.info("weight swap %s: paused %d backend(s) for v%d (%d call(s) held, %d stale job(s) dropped)",
                     swap.swap_id, len(swap.marks), req.weight_version, held, dropped)
            return PauseResponse(swap_id=swap.swap_id, weight_version=req.weight_version,
                                 backends={b.address: o for b, (o, _) in zip(backends, outcomes)},
                                 held_calls=held, dropped_jobs=dropped, deadline=swap.deadline,
                                 pause_s=time.monotonic() - t0)

    async def _pause_one(self, b: Backend, swap: _Swap) -> tuple[str, int]:
        try:
            await self._post(b, "/pause", params={"mode": "keep"})
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, OSError) as e:
            reason = f"failed to pause for weights v{swap.weight_version}: {e!r}"
            self._withdraw(b, reason)
            return reason, 0
        mark = SwapMark(b.weight_version)
        swap.marks[b.address] = mark
        progress = await self._progress(b)
        calls = list(self._client().in_flight.get(b.address, {}).values())
        for call in calls:  # a call not running in the engine (queued, or sent during the pause) has 0 tokens
            call.splits.append((progress.get(call.request_id, 0) if progress is not None else None, mark))
        return "paused", len(calls)

    async def _drop_stale(self, req: PauseRequest) -> int:
        threshold = req.weight_version - (req.max_staleness or 0)
        stale = [j for j in self._live_jobs() if not j.finished and j.first_weight_version is not None
                 and j.first_weight_version < threshold]
        if not stale or self._cancel_job is None:
            return 0
        reason = (f"dropped at the swap to weights v{req.weight_version}: first turn generated with weights "
                  "v{v}, more than max_staleness={k} behind")
        done = await asyncio.gather(*(self._cancel_job(j.job_id, reason.format(v=j.first_weight_version,
                                                                               k=req.max_staleness))
                                      for j in stale), return_exceptions=True)
        n = sum(1 for d in done if d is True or (isinstance(d, tuple) and d and d[0] is True))
        self.counters["dropped_jobs"] += n
        return n

    # ------------------------------------------------------------------ resume
    async def resume(self, req: ResumeRequest) -> ResumeResponse:
        """Label the backends that loaded with the new version, recompute KV if asked, resume them, release
        the held calls. Raises :class:`SwapError` 409 ``unknown_swap`` / ``swap_expired``."""
        async with self._lock:
            swap = self.current
            if swap is None or swap.swap_id != req.swap_id:
                if req.swap_id in self._expired:
                    raise SwapError(409, "swap_expired", self._expired[req.swap_id])
                raise SwapError(409, "unknown_swap", f"no weight swap {req.swap_id!r} is in progress"
                                + (f" (swap {swap.swap_id} is)" if swap else ""))
            known = {a.lower(): a for a in swap.marks}
            unknown = sorted(set(req.failed) - set(known))
            if unknown:  # a backend said to have failed must be one this swap paused: never guess which
                raise SwapError(422, "unknown_backend", f"failed names {len(unknown)} address(es) this swap did not "
                                f"pause: {', '.join(u[:200] for u in unknown[:5])}; it paused "
                                f"{', '.join(swap.marks) or 'none'} (the swap is still in progress)")
            t0 = time.monotonic()
            version = req.weight_version if req.weight_version is not None else swap.weight_version
            outcomes = await asyncio.gather(*(self._resume_one(addr, mark, swap, version,
                                                               req.failed.get(addr.lower()))
                                              for addr, mark in swap.marks.items()))
            self._end(swap)
            self._release_jobs(time.monotonic() - swap.t_paused)
            self.counters["swaps"] += 1
            self.last_version = version
            log.info("weight swap %s: v%d resumed on %d backend(s) after %.2f s", swap.swap_id, version,
                     sum(1 for o in outcomes if o == "resumed"), time.monotonic() - swap.t_paused)
            return ResumeResponse(weight_version=version, backends=dict(zip(swap.marks, outcomes)),
                                  held_s=time.monotonic() - swap.t_paused, resume_s=time.monotonic() - t0,
                                  tokens_discarded=self._client().counters.get("tokens_discarded", 0))

    async def _resume_one(self, address: str, mark: SwapMark, swap: _Swap, version: int,
                          failed: Optional[str]) -> str:
        b = self.pool.get(address)
        if b is None:
            return "unknown backend"
        if failed is not None:
            reason = f"did not load weights v{version}: {failed}"
            self._withdraw(b, reason)
            await self._unpause(b, mark, keep_version=True)
            return reason
        b.weight_version = version
        mark.after = version
        try:
            if swap.kv == "recompute":
                data = await self._post(b, "/reset_prefix_cache", params={"reset_running_requests": "true"})
                if not (isinstance(data, dict) and data.get("success") is True):
                    raise RuntimeError(f"/reset_prefix_cache answered {data!r}: the KV cache was not reset")
            mark.resumed = True
            await self._post(b, "/resume")
            mark.resumed_at = time.monotonic()
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, OSError) as e:
            mark.resumed_at = time.monotonic()
            reason = f"failed to resume with weights v{version}: {e!r}"
            self._withdraw(b, reason)
            return reason
        return "resumed"

    async def _unpause(self, b: Backend, mark: SwapMark, keep_version: bool) -> None:
        """Resume ``b`` as it was (its version unchanged; best effort, its calls were moved)."""
        mark.after = mark.before
        mark.resumed = True
        try:
            await self._post(b, "/resume")
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, OSError) as e:
            log.warning("could not resume %s: %r", b.address, e)
        mark.resumed_at = time.monotonic()

    def _end(self, swap: _Swap) -> None:
        if swap.lease is not None and swap.lease is not asyncio.current_task():
            swap.lease.cancel()
        self.current = None
        self.pool.unhold()

    async def _expire(self, swap: _Swap, lease_s: float) -> None:
        await asyncio.sleep(lease_s)
        async with self._lock:
            if self.current is not swap:
                return
            why = (f"the lease of weight swap {swap.swap_id} (weights v{swap.weight_version}) ended after "
                   f"{lease_s:g} s without a resume: whether the trainer loaded anything is unknown, so its "
                   "backends were withdrawn (resumed in the engine, out of the rotation until /add_llm_server "
                   "registers them with the version they serve)")
            log.error("%s", why)
            for addr in swap.marks:
                b = self.pool.get(addr)
                if b is not None:
                    self._withdraw(b, why)
            await self._resume_unlabelled(swap)
            self._expired[swap.swap_id] = why
            while len(self._expired) > 64:
                self._expired.pop(next(iter(self._expired)))
            self.counters["expired"] += 1
            self._end(swap)
            self._release_jobs(time.monotonic() - swap.t_paused)

    def _hold_jobs(self) -> None:
        """A swap's pause is not the jobs' time: every live job's timeout stops (a job timing out because the
        trainer took long to load would be scored as the model's stall) until :meth:`_release_jobs`."""
        for j in self._live_jobs():
            if not j.finished and hasattr(j, "hold_deadline"):
                j.hold_deadline()

    def _release_jobs(self, held_s: float) -> None:
        for j in self._live_jobs():
            if not j.finished and hasattr(j, "release_deadline"):
                j.release_deadline()

    async def close(self) -> None:
        """Server shutdown: a swap in progress ends as if its lease ran out (backends resumed)."""
        swap = self.current
        if swap is not None and swap.lease is not None:
            swap.lease.cancel()
            await self._resume_unlabelled(swap)
            self._end(swap)

    async def _resume_unlabelled(self, swap: _Swap) -> None:
        """Resume the engines ``swap`` paused without labelling them with its version (the swap did not
        complete); a failure to resume is the backend's (withdrawn by :meth:`_unpause`), never the caller's."""
        await asyncio.gather(*(self._unpause(b, mark, keep_version=True) for addr, mark in swap.marks.items()
                               if (b := self.pool.get(addr)) is not None), return_exceptions=True)

    # ------------------------------------------------------------------ state
    def state(self) -> WeightsState:
        swap = self.current
        return WeightsState(
            weight_version=self.last_version,
            swap=SwapInfo(swap_id=swap.swap_id, weight_version=swap.weight_version, kv=swap.kv,
                          deadline=swap.deadline) if swap else None,
            backends=[BackendWeights(address=b.address, weight_version=b.weight_version, healthy=b.healthy,
                                     registered=b.registered, withdrawn=b.withdrawn,
                                     paused=swap is not None and b.address in swap.marks)
                      for b in self.pool.known],
            counters=dict(self.counters))


# ------------------------------------------------------------------------------------------ HTTP routes
def add_weight_routes(app: Any, swaps: SwapCoordinator, metrics: Any = None) -> None:
    """Serve ``POST /weights/pause``, ``POST /weights/resume`` and ``GET /weights`` (bearer-protected, like
    every management route) for ``swaps`` on ``app``; export its counters on ``metrics`` if given; a swap
    still in progress when the app shuts down is ended (backends resumed)."""
    from aiohttp import web

    from prorl_server.routes import ApiError, Route, add_routes, json_response, parse_body

    async def pause(request: web.Request) -> web.Response:
        req = await parse_body(request, PauseRequest)
        try:
            return json_response(await swaps.pause(req))
        except SwapError as e:
            raise ApiError(e.status, e.type, str(e)) from None

    async def resume(request: web.Request) -> web.Response:
        req = await parse_body(request, ResumeRequest)
        try:
            return json_response(await swaps.resume(req))
        except SwapError as e:
            raise ApiError(e.status, e.type, str(e)) from None

    async def state(request: web.Request) -> web.Response:
        return json_response(swaps.state())

    async def close(app: Any) -> None:
        await swaps.close()

    add_routes(app, (
        Route("POST", "/weights/pause", pause, "Hold new LLM calls and pause every backend in keep mode for a "
              "weight update (409 while another swap holds them)", PauseRequest, PauseResponse),
        Route("POST", "/weights/resume", resume, "Label the backends with the new weight version and resume "
              "them (409 for an unknown or expired swap)", ResumeRequest, ResumeResponse),
        Route("GET", "/weights", state, "Weight versions, the swap in progress and each backend's state", None,
              WeightsState),
    ))
    app.on_shutdown.append(close)
    if metrics is not None:
        metrics.export_counts(SWAP_COUNTS, lambda: swaps.counters)
