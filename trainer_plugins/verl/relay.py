"""Per-worker relay: verl's own weight-synced inference servers serve the rollout servers' jobs, with the
weight version of every generated turn (ProRL Agent paper, section 3.3).

Each verl ``AgentLoopWorker`` process (a Ray actor) runs one :class:`Relay`: a small aiohttp server that
answers the subset of vLLM's OpenAI API the rollout server's LLM client uses (``prorl_server/llm/client.py``)
on top of the worker's ``server_manager.generate`` (verl's ``LLMServerClient``):

- ``POST /v1/completions``: ``prompt`` as a token id list, ``max_tokens`` and sampling parameters in; the
  generated ``token_ids``, one logprob per token (``logprobs.token_logprobs``, ``logprobs.tokens`` as
  ``token_id:N``), ``finish_reason`` out, plus a top-level integer ``weight_version``: the trainer step whose
  weights generated the turn (``TokenOutput.extra_fields["min_global_steps"]``), and ``weight_versions``
  (``[min, max]`` of the turn; two values only when a partial rollout resumed the turn after an update);
- ``GET /v1/models``: the model (its path: the rollout server loads the tokenizer from it) and
  ``max_model_len``; ``GET /health``; ``GET /relay/status``: version, turns served, registrations.
  With MoE routing replay on (verl's ``enable_rollout_routing_replay``), the answer also carries
  ``routed_experts`` (``TokenOutput.routed_experts`` as ``[positions][layers][top_k]`` ints, positions of the
  turn's prompt + generated tokens) and ``routed_experts_start`` (the first position it covers: the request's
  ``routed_experts_prompt_start``, the positions the rollout server already holds, else 0).

The relay registers itself with every rollout server (``POST /add_llm_server {address, weight_version}``,
servers on this node first) once it knows the version, re-registers when a turn reports a newer version
(the weights were updated), and every ``heartbeat_s`` seconds (a restarted rollout server learns it back).
Given a fleet (:class:`trainer_plugins.fleet.Fleet`: ``prorl.servers`` names a fleet directory), it follows it:
a member that joins later is registered with within a poll of the fleet (0.25 s), through the one
:class:`trainer_plugins.client.FleetRegistrar`.

Why a relay, not verl's replica addresses (verl 0.9.1, read in ``workers/rollout/``):

- verl's vLLM replicas do serve vLLM's OpenAI app, but calls to it bypass what makes a call safe during
  training: ``vLLMHttpServer.generate`` (the Ray path) parks requests behind the submission gate while weights
  are synced (``_park_until_admitted``), and in ``colocate_async`` the trainer aborts and *sleeps* every
  replica after sampling (``PPOTrainerColocateAsync.on_sample_end``): an HTTP call then reaches a sleeping
  engine. Through ``server_manager.generate`` a turn waits for the wake-up instead, and with verl's
  ``FullyAsyncLLMServerClient`` (``colocate_async``/``separate_async``) an aborted turn is resumed.
- The version: the HTTP answer carries none, and the step is known only in the trainer process (it calls
  ``set_global_steps`` on the replicas). ``TokenOutput.extra_fields`` carries ``global_steps`` (and
  ``min_global_steps``/``max_global_steps``) for every turn, so the relay reports the exact version of the
  weights that generated each turn, with no hook in verl's trainer.
- verl's global load balancer (least in-flight, sticky ``request_id``) spreads the jobs over every replica;
  the relay's ``request_id`` (:class:`StickyKeys`) is the hash of a job's whole first prompt, carried on to
  its later turns (recognised by their context extending an earlier turn's prompt and output), so the
  samples of one group (same prompt) and every turn of a job stay on one replica (its prefix cache), while
  different prompts spread by load. (A hash of the first 256 tokens, as before, sent every job whose prompts
  share a long system prompt and tool schema to one replica: 1/N of the rollout throughput.)

Registration is ``add`` without ``clear``: every worker's relay is registered with every rollout server (each
relay reaches every replica through verl's balancer, so which relay a rollout server uses decides only one
local hop; a ``clear`` by one relay would drop the others). A rollout server that already serves a backend
with no weight version (a vLLM started from a fixed model) is refused with :class:`RelayError`: jobs there
would look on-policy. A missing version from verl is an error answer (HTTP 500), never a guess.

A request verl's replica refuses as invalid (a token id outside the vocabulary, a prompt longer than the
context, bad sampling parameters: :func:`request_fault_status`, vLLM's own 4xx rule) is answered 4xx, not 502:
the rollout server's LLM client does not fail over on a 4xx (no replica would take it), the job fails with
``failure_kind="configuration"`` and the trainer stops with the message (a wrong-but-loadable tokenizer on a
rollout server otherwise spun as filtered, retried, evicted and refilled rows: 0 steps in 6 minutes).

A sleeping or training replica (issue #32 part 5): verl parks a turn while its replicas are asleep or syncing
weights (``_park_until_admitted``; in ``colocate`` the trainer sleeps them for every training step), and the
rollout server's job deadline kept counting through it: a long multi-turn job ended as ``model_timeout``. Now a
turn still inside verl after ``probe_after_s`` makes the relay ask verl whether its replicas admit work (one
1-token turn, as :meth:`Relay.probe_version`, shared by every waiting turn: at most one per ``probe_after_s``); when that probe is not answered
within ``probe_s``, the relay answers the turn HTTP 503 ``paused`` and keeps it running in verl under the
request's ``X-Request-Id``. The rollout server's LLM client re-sends a paused turn under the same id (the relay
hands the kept turn back: nothing is generated twice) and holds the job's deadline from the first paused answer
until the turn is answered (``prorl_server/llm/client.py``). A turn verl aborted (``stop_reason="aborted"``)
is answered ``finish_reason="abort"``, which holds the deadline the same way. The relay learns the state from
verl alone (its own probe through ``server_manager``), never from anything a sandbox writes; up to
``probe_after_s + probe_s`` of a parked turn is still counted before the paused answer. A replica too saturated
to schedule a 1-token turn within ``probe_s`` is also answered paused: queueing is the system's time too. Kept
turns nobody takes back are dropped ``KEPT_TTL_S`` after verl answers them (at most ``MAX_KEPT``).

The relay has no authentication, like verl's own replica servers: it binds the node's address (Ray's node IP)
unless ``host`` says otherwise.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from collections import Counter
from typing import Any, Optional, Sequence

import aiohttp
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from prorl_server.types import TokenizerFingerprint
from trainer_plugins.client import FleetRegistrar, register_backends
from trainer_plugins.fleet import Fleet
from trainer_plugins.jobs import ConfigurationError
from trainer_plugins.tokenizer_check import NotYet, TokenizerMismatchError, check_tokenizer

log = logging.getLogger(__name__)

#: sampling parameters passed through to verl (vLLM ``SamplingParams`` fields); the relay owns the others
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
                 "include_stop_str_in_output", "skip_special_tokens")
#: contexts :class:`StickyKeys` remembers (one per job in flight; the oldest are forgotten first)
STICKY_MAX_CONTEXTS = 65536
#: turns answered "paused" and kept for their re-send (by X-Request-Id); the oldest go first past this
MAX_KEPT = 4096
#: seconds a kept turn verl has answered waits for its re-send before it is dropped
KEPT_TTL_S = 120.0
_HASH_MOD = (1 << 61) - 1
_HASH_BASE = 1_000_003


class StickyKeys:
    """verl's sticky ``request_id`` for each turn, per job, from the token ids alone (the rollout server sends
    no job id to a backend).

    A turn whose prompt extends a context remembered earlier (an earlier turn's prompt + its generated tokens:
    the rollout server keeps tokens as generated and appends only new messages) gets that context's id: every
    turn of a job reaches the same replica. A prompt that extends none is a job's first turn; its id is the
    hash of the whole prompt, so the n samples of one group (same prompt) share one replica and its prefix
    cache, and different prompts are spread by verl's least-in-flight choice.

    Cost: one pass over the prompt and output (a rolling hash), O(tokens) per turn.
    """

    def __init__(self, max_contexts: int = STICKY_MAX_CONTEXTS) -> None:
        self.max_contexts = int(max_contexts)
        self._ids: dict[tuple[int, int], str] = {}  # (length, hash of the first `length` tokens) -> request id
        self._lengths: Counter = Counter()  # lengths of the remembered contexts
        self.stats: Counter = Counter()  # new_jobs, continued

    @staticmethod
    def _roll(h: int, tokens: Sequence[int]) -> int:
        for t in tokens:
            h = (h * _HASH_BASE + int(t) + 1) % _HASH_MOD
        return h

    def key(self, prompt: Sequence[int]) -> tuple[str, Optional[tuple[int, int]]]:
        """``(request_id, the remembered context it continues or None)`` for a turn with ``prompt``."""
        h, found = 0, None
        lengths = self._lengths
        for i, t in enumerate(prompt, 1):
            h = (h * _HASH_BASE + int(t) + 1) % _HASH_MOD
            if i in lengths and (i, h) in self._ids:
                found = (i, h)  # the longest match wins (the job's latest turn)
        if found is not None:
            self.stats["continued"] += 1
            return self._ids[found], found
        self.stats["new_jobs"] += 1
        return f"prorl-{len(prompt)}-{h:016x}", None

    def remember(self, prompt: Sequence[int], output: Sequence[int], request_id: str,
                 continues: Optional[tuple[int, int]] = None) -> None:
        """After a turn: the context ``prompt + output`` carries ``request_id`` (the context the turn continued
        is forgotten: a job keeps one entry)."""
        if continues is not None and self._ids.pop(continues, None) is not None:
            self._drop_length(continues[0])
        key = (len(prompt) + len(output), self._roll(self._roll(0, prompt), output))
        if key not in self._ids:
            self._lengths[key[0]] += 1
        self._ids[key] = request_id
        while len(self._ids) > self.max_contexts:  # dicts keep insertion order: the oldest go first
            old = next(iter(self._ids))
            del self._ids[old]
            self._drop_length(old[0])

    def _drop_length(self, length: int) -> None:
        self._lengths[length] -= 1
        if self._lengths[length] <= 0:
            del self._lengths[length]


class _Kept:
    """A turn answered "paused" and kept running in verl for its re-send: its task, the digest of its
    request (prompt and sampling parameters: a re-send must be the same request), its sticky id and context."""

    __slots__ = ("task", "digest", "request_id", "continues", "t0")

    def __init__(self, task: asyncio.Future, digest: str, request_id: str, continues: Optional[tuple[int, int]],
                 t0: float) -> None:
        self.task, self.digest, self.request_id, self.continues, self.t0 = task, digest, request_id, continues, t0


def _turn_digest(prompt: Sequence[int], sp: dict[str, Any]) -> str:
    return hashlib.blake2b(json.dumps([list(prompt), sp], sort_keys=True, default=repr).encode(),
                           digest_size=16).hexdigest()


class RelayError(RuntimeError):
    """The relay cannot serve as a versioned backend: verl reports no weight version, or a rollout server
    cannot be registered with (unreachable, refused, or it already serves a backend without a version)."""


class CompletionRequest(BaseModel):
    """The part of vLLM's ``/v1/completions`` body the relay serves (token ids in, token ids out)."""

    model_config = ConfigDict(extra="allow")
    prompt: list[int] = Field(min_length=1)
    max_tokens: Optional[int] = Field(default=None, ge=1)
    n: int = 1
    stream: bool = False
    echo: bool = False
    request_id: Optional[str] = None
    user: Optional[str] = None


def _error(status: int, message: str, type_: str = "BadRequestError") -> web.Response:
    return web.json_response({"error": {"message": message, "type": type_, "code": status}}, status=status)


def _cause(exc: BaseException) -> BaseException:
    """The exception a Ray actor raised, under Ray's ``RayTaskError`` wrapper (``.cause``), else ``exc``."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def request_fault_status(exc: BaseException) -> Optional[int]:
    """The 4xx status of a request-validation error raised by verl's ``generate`` (None: a backend fault, 502).

    The rule is vLLM's own (``vllm/entrypoints/serve/exception_handling/error_response.py``, 0.31):
    ``VLLMValidationError`` and other ``VLLMClientError`` are 400 (``VLLMNotFoundError`` 404,
    ``VLLMUnprocessableEntityError`` 422), ``VLLMServerError`` (engine dead, generation error) is 5xx, and a
    raw ``ValueError`` / ``TypeError`` / ``OverflowError`` is 400 (verl's ``vLLMHttpServer.generate`` raises
    ``ValueError`` for a prompt that leaves no room, vLLM for a token id outside the vocabulary, and
    ``SamplingParams`` for bad parameters). Classes are read by name through the MRO, so the relay needs no
    vLLM import and Ray's dual ``RayTaskError(ValueError)`` classes and its ``.cause`` are both read.
    """
    for e in (exc, _cause(exc)):
        names = {c.__name__ for c in type(e).__mro__}
        if "VLLMServerError" in names or "EngineDeadError" in names:
            return None
        if "VLLMNotFoundError" in names:
            return 404
        if "VLLMUnprocessableEntityError" in names:
            return 422
        if "VLLMClientError" in names:
            return 400
    if isinstance(_cause(exc), (ValueError, TypeError, OverflowError)) or isinstance(exc, (ValueError, TypeError,
                                                                                             OverflowError)):
        return 400
    return None


def _route_lists(routes: Any) -> list:
    """verl's ``TokenOutput.routed_experts`` (an array ``[positions, layers, top_k]`` of expert indices for the
    turn's prompt + generated tokens from position 0, vLLM's ``routed_experts``) as nested int lists for JSON."""
    import numpy as np  # verl's dependency

    return np.asarray(routes).astype(np.int64, copy=False).tolist()


def _node_ip() -> str:
    """Ray's address of this node when Ray runs (verl's replicas advertise the same), else loopback."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address().strip("[]")
    except Exception:  # Ray missing or not started: a local run
        pass
    return "127.0.0.1"


def _version_of(extra_fields: dict[str, Any]) -> list[int]:
    """``[min, max]`` weight versions of one ``TokenOutput`` (deduplicated; empty when verl has none)."""
    gs = extra_fields.get("global_steps")
    lo = extra_fields.get("min_global_steps", gs)
    hi = extra_fields.get("max_global_steps", gs)
    out = [int(v) for v in (lo, hi) if isinstance(v, int) and not isinstance(v, bool)]
    return sorted(set(out))


class Relay:
    """One worker's relay (see the module docstring).

    Args:
        server_manager: verl's ``LLMServerClient`` of this worker (``AgentLoopBase.server_manager``):
            ``await generate(request_id, prompt_ids=list[int], sampling_params=dict) -> TokenOutput``.
        servers: rollout server base URLs, same-node first. headers: their bearer token.
        model: the served model's name/path (``/v1/models`` id; the rollout server loads its tokenizer).
        max_model_len: context length in tokens (prompt + generated).
        default_max_tokens: ``max_tokens`` when a request gives none.
        tokenizer: decodes the turn's ``text`` (optional; token ids are what the rollout server uses).
        stop_token_ids: ids that end a turn (EOS): a turn of exactly ``max_tokens`` tokens ending in one is
            ``"stop"``, not ``"length"``.
        host: bind and advertise address (default: the node's IP, see :func:`_node_ip`); port: 0 = free port.
        heartbeat_s: seconds between re-registrations (None: only at start and on a new version).
        probe_timeout_s: seconds a rollout server and this relay get to answer at registration.
        check_tokenizer: compare each rollout server's tokenizer for this relay (``GET /tokenizer``) with
            ``tokenizer``'s, at its first registration (:mod:`trainer_plugins.tokenizer_check`); a mismatch is a
            :class:`RelayError` at start, and :attr:`refused` for a server that joins later.
        probe_after_s: seconds a turn may stay inside verl before the relay asks whether the replicas admit
            work (module docstring, "A sleeping or training replica").
        probe_s: seconds verl has to answer that 1-token probe before the turn is answered HTTP 503 paused.
    """

    def __init__(self, server_manager: Any, *, servers: Sequence[str], headers: Optional[dict[str, str]] = None,
                 model: str, max_model_len: int, default_max_tokens: int, tokenizer: Any = None,
                 stop_token_ids: Sequence[int] = (), host: Optional[str] = None, port: int = 0,
                 heartbeat_s: Optional[float] = 30.0, probe_timeout_s: float = 30.0,
                 check_tokenizer: bool = True, probe_after_s: float = 1.0, probe_s: float = 1.0) -> None:
        if not servers and not isinstance(servers, Fleet):  # a fleet may have no member yet: they join
            raise ValueError("the relay needs at least one rollout server")
        self.server_manager = server_manager
        self.servers: Sequence[str] = servers if isinstance(servers, Fleet) else [s.rstrip("/") for s in servers]
        #: with a fleet: registers this relay with members that join later (the same registration as register)
        self.registrar: Optional[FleetRegistrar] = (
            FleetRegistrar(servers, lambda u, b, v: self._register_with(u, v)) if isinstance(servers, Fleet) else None)
        self.headers = dict(headers or {})
        self.model = model
        self.max_model_len = int(max_model_len)
        self.default_max_tokens = int(default_max_tokens)
        self.tokenizer = tokenizer
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        bind = host or _node_ip()
        self.host = bind
        self.advertise_host = _node_ip() if bind in ("0.0.0.0", "::", "") else bind
        self.port = port
        self.heartbeat_s = heartbeat_s
        self.probe_timeout_s = probe_timeout_s
        self.version: Optional[int] = None
        self.stats: Counter = Counter()
        self.sticky = StickyKeys()
        #: a fault no retry can fix seen while serving (a turn with no version); the agent loop stops on it
        self.fatal: Optional[str] = None
        #: a rollout server refused by the tokenizer handshake (one that joined a fleet later); the agent loop
        #: stops on it
        self.refused: Optional[str] = None
        self.check_tokenizer = check_tokenizer and tokenizer is not None and hasattr(tokenizer, "get_vocab")
        self.policy_fingerprint: Optional[TokenizerFingerprint] = None
        self._checked: set[str] = set()  # rollout servers whose tokenizer matched (or predate the check)
        self._registered: dict[str, int] = {}  # rollout server -> version it has for us
        self._runner: Optional[web.AppRunner] = None
        self._session: Optional[aiohttp.ClientSession] = None
        self._register_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self.probe_after_s = float(probe_after_s)
        self.probe_s = float(probe_s)
        self._kept: dict[str, _Kept] = {}  # X-Request-Id -> a turn answered "paused", for its re-send
        self._probe: Optional[asyncio.Task] = None
        self._probe_t0 = 0.0
        self._probe_done_at = 0.0

    # ------------------------------------------------------------------ lifecycle
    @property
    def address(self) -> str:
        """Base URL the rollout servers use (``http://host:port``)."""
        host = f"[{self.advertise_host}]" if ":" in self.advertise_host else self.advertise_host
        return f"http://{host}:{self.port}"

    def create_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 ** 2)  # a long context is a long id list
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/relay/status", self._status)
        return app

    async def start(self) -> "Relay":
        """Serve, learn the weight version from verl, register with every rollout server.

        Raises:
            RelayError: verl reports no version, or a rollout server could not be registered with (the
                relay is closed again).
        """
        self._runner = web.AppRunner(self.create_app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]  # the free port the OS picked when port=0
        self._session = aiohttp.ClientSession(headers=self.headers)
        try:
            if self.check_tokenizer and self.policy_fingerprint is None:
                self.policy_fingerprint = await asyncio.to_thread(TokenizerFingerprint.of, self.tokenizer)
            if self.version is None:
                await self.probe_version()
            await self.register()
        except BaseException:
            await self.close()
            raise
        if self.heartbeat_s:
            self._spawn(self._heartbeat())
        if self.registrar is not None:
            self._spawn(self.registrar.follow())
        log.info("relay %s serves verl's replicas at weight version %s to %s", self.address, self.version,
                 ", ".join(self.servers))
        return self

    async def close(self) -> None:
        """Stop serving (idempotent). The rollout servers' health probes then take the relay out."""
        for k in list(self._kept.values()):
            k.task.cancel()
        self._kept.clear()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    # ------------------------------------------------------------------ versions and registration
    async def probe_version(self) -> int:
        """One 1-token greedy turn through verl, to read the version the replicas serve now.

        Raises:
            RelayError: verl's answer carries no ``global_steps`` (the trainer never set one).
        """
        token = next((t for t in (getattr(self.tokenizer, "eos_token_id", None), *self.stop_token_ids)
                      if isinstance(t, int)), 0)
        out = await self.server_manager.generate(
            f"prorl-relay-probe-{uuid.uuid4().hex}", prompt_ids=[token],
            sampling_params={"max_tokens": 1, "temperature": 0.0, "logprobs": True})
        versions = _version_of(out.extra_fields or {})
        if not versions:
            raise RelayError("verl's replicas report no weight version (TokenOutput.extra_fields.global_steps "
                             "is None): the trainer never called update_weights(global_steps); refusing to "
                             "serve rollouts with no version")
        self.version = versions[-1]
        return self.version

    async def register(self) -> None:
        """Register the relay with every rollout server at :attr:`version` (add, never clear).

        Raises:
            RelayError: a server is unreachable, refused, or already serves a backend with no weight
                version; or the relay's own address did not answer ``GET /health`` (probed first).
        """
        async with self._register_lock:
            version = self.version
            if version is None:
                raise RelayError("relay has no weight version yet")
            for server in list(self.servers):  # a fleet: its members of this moment (joiners: the registrar)
                await self._register_with(server, version)
            if self.registrar is not None:
                self.registrar.set([self.address], version, registered=[u for u, v in self._registered.items()
                                                                        if v == version])

    async def _register_with(self, server: str, version: int) -> None:
        """Register with one rollout server (refusing one that serves a backend with no version first).

        Raises:
            RelayError: as :meth:`register` (a ``RuntimeError``: the fleet's registrar logs it and retries).
        """
        if server not in self._registered:
            await self._refuse_versionless(server)
        try:
            await register_backends(self._session, server, [self.address], version, clear=False,
                                    probe_timeout_s=self.probe_timeout_s)
        except RuntimeError as e:  # BackendUnreachableError too
            raise RelayError(f"relay {self.address} could not register with {server}: {e}") from None
        if self.policy_fingerprint is not None and server not in self._checked:
            try:
                await check_tokenizer(self._session, server, self.policy_fingerprint, backend=self.address,
                                      timeout_s=max(self.probe_timeout_s, 120.0))
            except TokenizerMismatchError as e:
                self.refused = str(e)  # a fleet joiner: the registrar only logs; the agent loop stops on this
                raise RelayError(str(e)) from None
            except (ConfigurationError, NotYet) as e:  # NotYet: the server stopped answering since it registered us
                raise RelayError(str(e)) from None
            self._checked.add(server)
        self._registered[server] = version
        self.stats["registrations"] += 1

    async def _refuse_versionless(self, server: str) -> None:
        try:
            async with self._session.get(f"{server}/status",
                                         timeout=aiohttp.ClientTimeout(total=self.probe_timeout_s)) as r:
                if r.status != 200:
                    raise RelayError(f"rollout server {server} answered GET /status with {r.status}: "
                                     f"{(await r.text())[:300]}")
                status = await r.json()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise RelayError(f"rollout server {server} is unreachable (GET /status: {e!r})") from None
        bare = [b["address"] for b in status.get("backends") or ()
                if b.get("weight_version") is None and b.get("healthy", True)]
        if bare:
            raise RelayError(
                f"rollout server {server} already serves LLM backend(s) with no weight version: "
                f"{', '.join(bare)}. Jobs there would be trained as on-policy. For training, start the rollout "
                "servers without a vLLM of their own (slurm/launch_rollout.sh --no-vllm, or prorl-server "
                "without --backend).")

    def _observe(self, versions: list[int]) -> None:
        """A turn reported ``versions``: a newer one means the weights were updated; re-register."""
        if versions and (self.version is None or versions[-1] > self.version):
            old, self.version = self.version, versions[-1]
            self.stats["version_changes"] += 1
            log.info("relay %s: weights v%s -> v%s; re-registering", self.address, old, self.version)
            self._spawn(self._reregister())

    async def _reregister(self) -> None:
        try:
            await self.register()
        except RelayError as e:  # the turn itself carries its exact version; the next heartbeat retries
            self.stats["registration_failures"] += 1
            log.warning("%s", e)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            await self._reregister()

    # ------------------------------------------------------------------ routes
    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "owned_by": "verl", "max_model_len": self.max_model_len}]})

    # ------------------------------------------------------------------ sleeping replicas
    async def _replicas_serving(self) -> bool:
        """Whether verl's replicas admit work now: a 1-token probe turn (one at a time, shared by every waiting
        turn) answered within ``probe_s`` of being sent; an answer less than ``probe_after_s`` old counts."""
        now = time.monotonic()
        if self._probe is not None and self._probe.done():
            if now - self._probe_done_at < self.probe_after_s:
                return True
            self._probe = None
        if self._probe is None:
            self._probe_t0 = now
            self._probe = self._spawn(self._probe_turn())
        left = self.probe_s - (now - self._probe_t0)
        if left > 0:
            await asyncio.wait({self._probe}, timeout=left)
        return self._probe.done()

    async def _probe_turn(self) -> None:
        token = next((t for t in (getattr(self.tokenizer, "eos_token_id", None), *self.stop_token_ids)
                      if isinstance(t, int)), 0)
        try:
            await self.server_manager.generate(f"prorl-relay-probe-{uuid.uuid4().hex}", prompt_ids=[token],
                                               sampling_params={"max_tokens": 1, "temperature": 0.0,
                                                                "logprobs": True})
        except Exception as e:  # an error is an answer: the turn's own call reports what went wrong
            log.debug("relay %s: probe turn failed: %r", self.address, e)
        finally:
            self._probe_done_at = time.monotonic()
            self.stats["probes"] += 1

    def _keep(self, rid: str, kept: _Kept) -> None:
        """Keep a turn answered "paused" for its re-send (dropped ``KEPT_TTL_S`` after verl answers it)."""
        self._kept[rid] = kept
        while len(self._kept) > MAX_KEPT:
            old = self._kept.pop(next(iter(self._kept)))
            old.task.cancel()
        loop = asyncio.get_running_loop()

        def expire(task: asyncio.Future) -> None:
            if not task.cancelled():
                task.exception()  # retrieved: a kept turn nobody takes back is not an unhandled error
            loop.call_later(KEPT_TTL_S, lambda: self._kept.pop(rid, None) if self._kept.get(rid) is kept else None)

        kept.task.add_done_callback(expire)

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response({"address": self.address, "weight_version": self.version,
                                  "registered": self._registered, "stats": dict(self.stats),
                                  "sticky": dict(self.sticky.stats)})

    async def _completions(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "body must be a JSON object")
        try:
            req = CompletionRequest.model_validate(body)
        except ValidationError as e:
            return _error(400, f"prompt must be a non-empty list of token ids and max_tokens >= 1: "
                               f"{e.errors()[0]['loc']}: {e.errors()[0]['msg']}")
        if req.n != 1 or req.stream or req.echo:
            return _error(400, "the relay serves n=1, stream=false, echo=false")
        prompt = req.prompt
        room = self.max_model_len - len(prompt)
        if room < 1:
            return _error(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                               f"you requested {len(prompt)} tokens in the prompt.")
        max_tokens = min(req.max_tokens or self.default_max_tokens, room)
        extra = req.model_extra or {}
        sp = {k: extra[k] for k in SAMPLING_KEYS if extra.get(k) is not None}
        sp.update(max_tokens=max_tokens, logprobs=True)
        rid = request.headers.get("X-Request-Id", "")[:128]
        digest = _turn_digest(prompt, sp) if rid else ""
        kept = self._kept.pop(rid, None) if rid else None
        if kept is not None and kept.digest != digest:
            kept = None  # the same id with another request: not the turn that was kept (it ends on its own)
        if kept is not None:  # the re-send of a turn answered "paused": hand back the one verl is running
            task, request_id, continues, t0 = kept.task, kept.request_id, kept.continues, kept.t0
            self.stats["paused_resent"] += 1
        else:
            continues = None
            request_id = req.request_id or req.user
            if not request_id:
                request_id, continues = self.sticky.key(prompt)
            t0 = time.perf_counter()
            task = asyncio.ensure_future(
                self.server_manager.generate(request_id, prompt_ids=list(prompt), sampling_params=sp))
        try:
            while rid and not task.done():
                await asyncio.wait({task}, timeout=self.probe_after_s)
                if task.done() or await self._replicas_serving():
                    continue
                self._keep(rid, _Kept(task, digest, request_id, continues, t0))
                self.stats["paused_answers"] += 1
                return _error(503, "verl's replicas are paused (asleep, training or syncing weights): the turn "
                                   "is kept running; send it again with the same X-Request-Id", "BackendPaused")
            out = await task
        except asyncio.CancelledError:
            if rid not in self._kept or self._kept[rid].task is not task:
                task.cancel()  # the rollout server gave up on this turn (its job ended)
            raise
        except Exception as e:
            status = request_fault_status(e)
            if status is not None:  # the request is wrong for this model: no other replica would take it
                self.stats["request_errors"] += 1
                log.warning("relay %s: verl's replica refused the request (HTTP %d): %s", self.address, status, e)
                return _error(status, f"verl's replica refused the request ({type(_cause(e)).__name__}: "
                                      f"{str(_cause(e))[:500]}); the rollout server's tokenizer, max_model_len or "
                                      "sampling parameters do not fit the policy's model", "BadRequestError")
            self.stats["generate_errors"] += 1  # the rollout server fails over to another backend on a 5xx
            log.warning("relay %s: verl generate failed: %r", self.address, e)
            return _error(502, f"verl generate failed: {e!r}", "BackendError")
        versions = _version_of(out.extra_fields or {})
        if not versions:
            self.stats["unversioned"] += 1
            self.fatal = ("verl's replica reported no weight version for a turn (TokenOutput.extra_fields."
                          "global_steps is None): the trainer never set a step on its replicas")
            return _error(500, "verl's replica reported no weight version for this turn "
                               "(TokenOutput.extra_fields.global_steps is None)", "MissingWeightVersion")
        ids = [int(t) for t in out.token_ids]
        if out.stop_reason in ("aborted", "abort"):
            # Interrupted by a weight update with no resume: the rollout server's client retries the turn
            # (as with vLLM's /pause); the partial tokens are dropped, so no turn mixes two versions.
            finish, ids, logprobs = "abort", [], []
        else:
            logprobs = list(out.log_probs) if out.log_probs is not None else None
            if logprobs is None or len(logprobs) != len(ids):
                self.stats["generate_errors"] += 1
                return _error(502, f"verl returned {len(ids)} tokens and "
                                   f"{'no' if logprobs is None else len(logprobs)} logprobs", "BackendError")
            if out.stop_reason == "length" or (len(ids) >= max_tokens and ids[-1] not in self.stop_token_ids):
                finish = "length"
            else:
                finish = "stop"
        text = ""
        if self.tokenizer is not None and ids:
            text = await asyncio.to_thread(self.tokenizer.decode, ids)
        routes, routes_start = None, 0
        if ids and getattr(out, "routed_experts", None) is not None:
            # the positions the rollout server already holds are not sent again (vLLM's parameter name)
            held = extra.get("routed_experts_prompt_start")
            routes_start = held if type(held) is int and 0 <= held <= len(prompt) else 0
            routes = await asyncio.to_thread(_route_lists, out.routed_experts[routes_start:])
            self.stats["route_positions"] += len(routes)
        self.sticky.remember(prompt, ids, request_id, continues)
        self.stats["turns"] += 1
        self.stats["tokens"] += len(ids)
        self._observe(versions)
        return web.json_response({
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": self.model,
            "choices": [{"index": 0, "text": text, "token_ids": ids, "finish_reason": finish,
                         "stop_reason": None,
                         "logprobs": {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": logprobs}}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                      "total_tokens": len(prompt) + len(ids)},
            "weight_version": versions[0],
            "weight_versions": versions,
            "relay_s": round(time.perf_counter() - t0, 6),
            **({"routed_experts": routes, "routed_experts_start": routes_start} if routes is not None else {}),
        })


# ------------------------------------------------------------------------------------------------ per process
# verl instantiates one agent loop per row, but every row of a worker process shares its server_manager: the
# relay belongs to that (one per process in practice), so it is kept here rather than on a loop instance.
_RELAYS: dict[int, Relay] = {}
_STARTING: dict[int, asyncio.Future] = {}


async def ensure_relay(server_manager: Any, **settings: Any) -> Relay:
    """The running relay of ``server_manager`` (started with ``settings``, see :class:`Relay`, on first use).

    Concurrent first calls share one start; a failed start raises :class:`RelayError` to each of them and
    the next call tries again.
    """
    key = id(server_manager)
    relay = _RELAYS.get(key)
    if relay is not None:
        return relay
    fut = _STARTING.get(key)
    if fut is None:
        fut = _STARTING[key] = asyncio.ensure_future(Relay(server_manager, **settings).start())
        fut.add_done_callback(lambda f: _STARTING.pop(key, None))
    relay = await asyncio.shield(fut)
    _RELAYS[key] = relay
    return relay


async def close_relays() -> None:
    """Close every relay of this process (tests; verl ends the worker process otherwise)."""
    relays = list(_RELAYS.values())
    _RELAYS.clear()
    await asyncio.gather(*(r.close() for r in relays))



def resolve_relay_host(setting: Optional[str]) -> Optional[str]:
    """The address this node's relay binds and advertises, from one setting shared by every node:

    - None or ``""``: None (the relay uses Ray's IP of this node, :func:`_node_ip`);
    - a network interface name of this node (``ib0``, ``eth0``): its IPv4 address (else IPv6);
    - a network in CIDR form (``10.1.0.0/16``): this node's address in it;
    - anything else: itself (an address or host name: one machine, or a setting per node).

    Raises:
        RelayError: an interface or network this node does not have.
    """
    if setting in (None, ""):
        return None
    import ipaddress
    import socket

    import psutil

    interfaces = psutil.net_if_addrs()
    if setting in interfaces:
        addrs = [a.address.split("%")[0] for a in interfaces[setting] if a.family in (socket.AF_INET, socket.AF_INET6)]
        addrs.sort(key=lambda a: ":" in a)  # IPv4 first
        if not addrs:
            raise RelayError(f"relay_host={setting!r}: interface {setting} of this node has no IP address")
        return addrs[0]
    if "/" in setting:
        try:
            net = ipaddress.ip_network(setting, strict=False)
        except ValueError:
            return setting
        for addrs in interfaces.values():
            for a in addrs:
                try:
                    if ipaddress.ip_address(a.address.split("%")[0]) in net:
                        return a.address.split("%")[0]
                except ValueError:
                    continue
        raise RelayError(f"relay_host={setting!r}: this node ({socket.gethostname()}) has no address in {net}")
    return setting


async def relay_for_loop(loop: Any, servers: Sequence[str], headers: dict[str, str]) -> Relay:
    """The relay of a ``ProRLAgentLoop``'s worker process, started from the loop's verl config on first use:
    model id ``tokenizer_path`` (else ``actor_rollout_ref.model.path``), ``max_model_len`` from the rollout config (else prompt + response
    length), EOS from the tokenizer, the loop's ``relay_host`` / ``relay_heartbeat_s`` settings."""
    rollout = loop.rollout_config
    max_model_len = rollout.get("max_model_len") or int(rollout.prompt_length) + int(rollout.response_length)
    eos = getattr(loop.tokenizer, "eos_token_id", None)
    return await ensure_relay(
        loop.server_manager, servers=servers if isinstance(servers, Fleet) else list(servers), headers=headers,
        model=str(getattr(loop, "tokenizer_path", None) or loop.config.actor_rollout_ref.model.path),
        max_model_len=int(max_model_len),
        default_max_tokens=int(rollout.response_length), tokenizer=loop.tokenizer,
        stop_token_ids=[eos] if isinstance(eos, int) else list(eos or ()),
        host=resolve_relay_host(loop.relay_host),
        heartbeat_s=loop.relay_heartbeat_s)
