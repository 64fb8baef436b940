"""Token-in/token-out client for vLLM's OpenAI-compatible ``/v1/completions`` endpoint.

One request = one generation turn: ``prompt`` is the full context as a list of token ids, and the answer
gives the generated token ids with one logprob each (``logprobs=0`` + ``return_tokens_as_token_ids``; see
vLLM ``entrypoints/openai/completion/protocol.py``). Text is never sent, so nothing is re-tokenized on the
server side.

Failure handling (one :meth:`LLMClient.complete` call never appends partial output, so a retry can neither
duplicate nor lose tokens):

- connection refused/reset, server disconnect, 5xx, per-call timeout: the backend is excluded for this call
  (and, after repeated connection failures, taken out of the pool until its health probe answers)
  (and, for connection failures, marked unhealthy in the pool); the next backend comes from the job
  (``job.backend(exclude=...)``) or pool; after ``max_attempts`` failures :class:`LLMUnavailableError`.
- a backend that is paused for weight sync: vLLM's ``/pause`` (mode ``abort``) ends in-flight requests with
  ``finish_reason="abort"`` and queues new ones until ``/resume``; an abort, or a 503 / "paused" answer, is
  retried on the same backend (sticky: its prefix cache) after a back-off, up to ``pause_wait_s``.
- 4xx (bad request, prompt too long): :class:`LLMRequestError`, not retried.

Weight versions (DESIGN.md "The training loop"): each turn records the version of the weights that generated
it: an integer top-level ``weight_version`` in the completions answer when the backend gives one (a trainer's
per-worker relay does; with a ``weight_versions`` list for a turn that spans a weight update), else the backend's registered ``weight_version`` when the request was sent. A
backend re-registered after a weight update is the same :class:`~prorl_server.balancer.Backend` object, so a
job's next turn reads the new version.

Use one :class:`LLMClient` (one ``aiohttp.ClientSession``) per process, not one per call.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional, Union

import aiohttp

from prorl_server.balancer import Backend, BackendPool, NoBackendError

if TYPE_CHECKING:
    from prorl_server.job import Job

log = logging.getLogger(__name__)

BackendGetter = Callable[[frozenset], Awaitable[Backend]]
"""``async (exclude: frozenset[str]) -> Backend``: the job's sticky backend, or a new one outside ``exclude``."""

BackendSource = Union["Job", Backend, BackendGetter, str]

# Keys the client sets itself; a caller's sampling_params cannot override them.
_RESERVED = frozenset({"prompt", "model", "stream", "echo", "n", "logprobs", "return_tokens_as_token_ids",
                       "return_token_ids", "max_tokens", "add_special_tokens", "prompt_logprobs"})
_TOKEN_PREFIX = "token_id:"


#: Seconds an idle keep-alive connection to a backend is kept (below vLLM's 5 s server-side timeout).
KEEPALIVE_S = 4.0

class LLMError(RuntimeError):
    """Base of the client's errors."""


class LLMUnavailableError(LLMError):
    """No backend could serve the call (every attempt failed, or none is registered)."""


class LLMRequestError(LLMError):
    """The backend rejected the request (4xx: invalid parameters, prompt longer than the context, ...)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class _BackendFailed(Exception):
    def __init__(self, reason: str, connection: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.connection = connection


class _Paused(Exception):
    pass


@dataclass
class Completion:
    """One generated turn.

    ``token_ids``: list[int] of length T (as vLLM generated them, the stop token included when the model
    emitted one). ``logprobs``: list[float] of length T (the sampled tokens' logprobs under the raw model
    distribution, vLLM's default ``logprobs_mode``). ``finish_reason``: ``"stop"`` or ``"length"``.
    ``stop_reason``: the stop token id / string that ended it, None for EOS or length.
    ``weight_versions``: the version(s) of the weights that generated the turn: the integer
    ``weight_version`` the backend put in its answer (a relay in front of a trainer's inference engine knows
    it exactly), followed by any other integers of the answer's ``weight_versions`` list (a turn resumed after
    a weight update: ``[min, max]``); else ``[v]``, the backend's registered version when the kept attempt's
    request was sent; ``[]`` when none is known.
    ``http_s``: seconds spent in HTTP exchanges for this turn, failed and aborted attempts included (so a
    caller can tell its own overhead from the server's time).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    stop_reason: Any
    backend: str
    weight_versions: list[int] = field(default_factory=list)
    attempts: int = 1
    failovers: int = 0
    pause_retries: int = 0
    http_s: float = 0.0
    text: str = ""


@dataclass
class ModelInfo:
    """``GET /v1/models`` of one backend: the served model name and its context length (tokens)."""

    id: str
    max_model_len: Optional[int]


def backend_getter(source: BackendSource, pool: Optional[BackendPool] = None,
                   job_id: Optional[str] = None) -> BackendGetter:
    """Normalise where backends come from into one ``async (exclude) -> Backend`` callable.

    ``source`` may be a :class:`~prorl_server.job.Job` (its sticky ``job.backend(exclude=...)``), a fixed
    :class:`Backend`, a base URL string, or such a callable already. With ``source=None`` and a ``pool`` +
    ``job_id``, the pool's sticky assignment is used.
    """
    if source is None:
        if pool is None or job_id is None:
            raise ValueError("give a job, a backend, an address, a getter, or pool + job_id")
        return lambda exclude: pool.acquire(job_id, exclude=exclude)
    if hasattr(source, "backend") and callable(getattr(source, "backend")):
        return _JobBackend(source)
    if isinstance(source, str):
        source = Backend(address=source.rstrip("/"))
    if isinstance(source, Backend):
        fixed = source

        async def _fixed(exclude: frozenset) -> Backend:
            if fixed.address in exclude:
                raise NoBackendError(f"the only backend {fixed.address} failed")
            return fixed

        return _fixed
    if callable(source):
        return source
    raise TypeError(f"cannot get backends from {type(source).__name__}")


def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else []


class _JobBackend:
    """A job's sticky backend as a getter that also tells the job which backend and weight version generated
    each turn (:meth:`prorl_server.job.Job.record_turn`), so its result's ``weight_version`` is the last
    turn's."""

    __slots__ = ("job",)

    def __init__(self, job: Any) -> None:
        self.job = job

    def __call__(self, exclude: frozenset) -> Awaitable[Backend]:
        return self.job.backend(exclude=exclude)

    def record_turn(self, completion: "Completion") -> None:
        record = getattr(self.job, "record_turn", None)
        if callable(record):
            record(completion.backend, completion.weight_versions[-1] if completion.weight_versions else None)


class LLMClient:
    """Token-in/token-out completions client over one shared ``aiohttp.ClientSession``.

    Args:
        session: a session to share (the app's); if None, one is created lazily and closed by :meth:`close`.
        pool: if given, backends whose connection fails are marked unhealthy there (its health probe
            brings them back).
        request_timeout_s: default per-call timeout (whole HTTP exchange), seconds.
        connect_timeout_s: TCP connect timeout, seconds.
        max_attempts: backend failures tolerated per call before :class:`LLMUnavailableError`.
        pause_wait_s: how long one call keeps retrying a paused/aborting backend, seconds.
        pause_backoff_s: first back-off after an abort/paused answer (doubles up to 2 s).
        model: the ``model`` field to send; default: asked once per backend from ``/v1/models``.
    """

    def __init__(self, session: Optional[aiohttp.ClientSession] = None, *, pool: Optional[BackendPool] = None,
                 request_timeout_s: float = 600.0, connect_timeout_s: float = 10.0, max_attempts: int = 3,
                 pause_wait_s: float = 600.0, pause_backoff_s: float = 0.05,
                 model: Optional[str] = None) -> None:
        self._session = session
        self._own_session = session is None
        self.pool = pool
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_attempts = max_attempts
        self.pause_wait_s = pause_wait_s
        self.pause_backoff_s = pause_backoff_s
        self.model = model
        self._models: dict[str, ModelInfo] = {}
        self.counters: dict[str, int] = {"requests": 0, "backend_failures": 0, "failovers": 0,
                                         "pause_retries": 0, "request_errors": 0}

    # ------------------------------------------------------------------ session
    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # Connection reuse matters (keep-alive to each backend); no per-host limit below vLLM's own. Idle
            # connections are dropped after KEEPALIVE_S, before vLLM's server closes them (uvicorn,
            # VLLM_HTTP_TIMEOUT_KEEP_ALIVE = 5 s): reusing one the server is closing fails the request.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=KEEPALIVE_S),
                json_serialize=json.dumps)
            self._own_session = True
        return self._session

    async def close(self) -> None:
        if self._own_session and self._session is not None and not self._session.closed:
            await self._session.close()

    async def __aenter__(self) -> "LLMClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ------------------------------------------------------------------ model info
    async def model_info(self, address: str, timeout_s: float = 30.0) -> ModelInfo:
        """The backend's served model (cached per address).

        Raises:
            LLMUnavailableError: the backend did not answer.
        """
        info = self._models.get(address)
        if info is not None:
            return info
        try:
            async with self.session.get(f"{address}/v1/models",
                                        timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                r.raise_for_status()
                data = await r.json()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise LLMUnavailableError(f"{address}/v1/models: {e!r}") from e
        card = data["data"][0]
        info = ModelInfo(id=card["id"], max_model_len=card.get("max_model_len"))
        self._models[address] = info
        return info

    # ------------------------------------------------------------------ generation
    async def complete(self, prompt_ids: list[int], *, backend: BackendSource, max_tokens: int,
                       sampling_params: Optional[dict[str, Any]] = None, timeout_s: Optional[float] = None,
                       ) -> Completion:
        """Generate one turn from ``prompt_ids`` (list[int], the whole context).

        Args:
            backend: a Job, Backend, base URL or ``async (exclude) -> Backend`` getter
                (see :func:`backend_getter`).
            max_tokens: generation budget of this turn (tokens, >= 1); the caller keeps
                ``len(prompt_ids) + max_tokens`` within the model's context.
            sampling_params: passed through to vLLM (temperature, top_p, top_k, seed, stop_token_ids, ...);
                the keys the client owns (prompt, logprobs, n, stream, ...) are ignored.
            timeout_s: this call's timeout per attempt (default ``request_timeout_s``).

        Raises:
            LLMUnavailableError: every attempt failed or no backend is available.
            LLMRequestError: the backend rejected the request (4xx).
        """
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        get = backend_getter(backend)
        body: dict[str, Any] = {k: v for k, v in (sampling_params or {}).items() if k not in _RESERVED}
        body.update(prompt=prompt_ids, max_tokens=max_tokens, logprobs=0, return_tokens_as_token_ids=True,
                    n=1, stream=False, echo=False, add_special_tokens=False)
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.request_timeout_s, connect=self.connect_timeout_s)

        exclude: set[str] = set()
        failures = 0
        failovers = 0
        pause_retries = 0
        pause_deadline: Optional[float] = None
        http_s = 0.0
        backoff = self.pause_backoff_s
        last_error = "no attempt made"
        while True:
            try:
                b = await get(frozenset(exclude))
            except NoBackendError as e:
                if not exclude:
                    raise LLMUnavailableError(f"no LLM backend available ({e}); last error: {last_error}") from e
                # Every backend left has failed this call once. A single failure is often transient (a
                # keep-alive connection the server just closed): try them again after a short back-off
                # rather than ending the rollout; max_attempts still bounds the call.
                exclude.clear()
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)
                continue
            try:
                if self.model is None and b.address not in self._models:
                    await self.model_info(b.address)
                body["model"] = self.model or self._models[b.address].id
                # Read as the request leaves: a trainer may re-register the backend (same object, new
                # version) at any await before this point.
                version_sent = b.weight_version
                t0 = time.perf_counter()
                try:
                    data = await self._post(b.address, body, timeout)
                finally:
                    http_s += time.perf_counter() - t0
                choice = data["choices"][0]
                if choice.get("finish_reason") == "abort":
                    raise _Paused()
            except _Paused:
                pause_retries += 1
                self.counters["pause_retries"] += 1
                now = time.monotonic()
                pause_deadline = pause_deadline or now + self.pause_wait_s
                if now > pause_deadline:
                    raise LLMUnavailableError(f"{b.address} stayed paused for more than {self.pause_wait_s} s")
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)
                continue
            except (_BackendFailed, LLMUnavailableError) as e:
                reason = e.reason if isinstance(e, _BackendFailed) else str(e)
                connection = e.connection if isinstance(e, _BackendFailed) else True
                failures += 1
                self.counters["backend_failures"] += 1
                last_error = f"{b.address}: {reason}"
                log.warning("LLM call failed on %s (%s); attempt %d/%d", b.address, reason, failures,
                            self.max_attempts)
                if connection and self.pool is not None:
                    self.pool.report_failure(b.address, reason)
                self._models.pop(b.address, None)
                if failures >= self.max_attempts:
                    raise LLMUnavailableError(f"LLM call failed {failures} times; last: {last_error}") from None
                exclude.add(b.address)
                failovers += 1
                self.counters["failovers"] += 1
                continue
            self.counters["requests"] += 1
            if self.pool is not None:
                self.pool.report_success(b.address)
            completion = self._completion(data, choice, b, version_sent, http_s, failures + pause_retries + 1,
                                          failovers, pause_retries)
            record = getattr(get, "record_turn", None)
            if record is not None:
                record(completion)
            return completion

    async def _post(self, address: str, body: dict[str, Any], timeout: aiohttp.ClientTimeout) -> dict[str, Any]:
        try:
            async with self.session.post(f"{address}/v1/completions", json=body, timeout=timeout) as r:
                raw = await r.read()
                status = r.status
        except asyncio.TimeoutError:
            raise _BackendFailed(f"timed out after {timeout.total} s", connection=False) from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as e:
            raise _BackendFailed(repr(e), connection=True) from None
        if status == 200:
            try:
                return json.loads(raw)
            except ValueError:
                raise _BackendFailed("200 with a body that is not JSON", connection=False) from None
        text = raw[:2000].decode("utf-8", "replace")
        if "paused" in text.lower():
            raise _Paused()
        if status >= 500:
            raise _BackendFailed(f"HTTP {status}: {text[:300]}", connection=False)
        self.counters["request_errors"] += 1
        try:
            message = json.loads(text).get("error", {}).get("message", text)
        except (ValueError, AttributeError):
            message = text
        raise LLMRequestError(status, str(message))

    @staticmethod
    def _completion(data: dict[str, Any], choice: dict[str, Any], b: Backend, version_sent: Optional[int],
                    http_s: float, attempts: int, failovers: int, pause_retries: int) -> Completion:
        lp = choice.get("logprobs") or {}
        ids = choice.get("token_ids")
        if ids is None:
            n = len(_TOKEN_PREFIX)
            ids = [int(t[n:]) for t in lp.get("tokens", ())]
        logprobs = [0.0 if x is None else x for x in lp.get("token_logprobs", ())]
        if len(logprobs) != len(ids):
            raise LLMError(f"{b.address} returned {len(ids)} tokens but {len(logprobs)} logprobs")
        reported = [v for v in (data.get("weight_version"), *_as_list(data.get("weight_versions")))
                    if isinstance(v, int) and not isinstance(v, bool)]
        if reported:  # the engine's own word on the weights that generated this answer
            versions = list(dict.fromkeys(reported))
        else:
            versions = [] if version_sent is None else [version_sent]
        return Completion(token_ids=ids, logprobs=logprobs, finish_reason=choice.get("finish_reason") or "stop",
                          stop_reason=choice.get("stop_reason"), backend=b.address, weight_versions=versions,
                          attempts=attempts, failovers=failovers, pause_retries=pause_retries, http_s=http_s,
                          text=choice.get("text", ""))
