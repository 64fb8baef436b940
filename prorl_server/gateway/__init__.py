"""OpenAI-compatible gateway for black-box agents: per-session Chat Completions with exact tokens.

A black-box agent is any program that speaks the OpenAI Chat Completions API. It is given a session's
``base_url`` and trained without changing its code; the gateway is the single tokenization authority and
records exactly what the model saw and generated (MiniMax Forge; the verl AgentGateway RFC).

Endpoints (added to the rollout server by :func:`setup_gateway`):

- management (the server's bearer token when one is configured):
  ``POST /sessions`` → ``201 {session_id, base_url, api_key}``; ``GET /sessions/{session_id}`` (state and
  counters); ``POST /sessions/{session_id}/finalize`` → the session's trajectories (ends it; idempotent);
  ``POST /sessions/{session_id}/abort`` (ends it, drops its tokens; idempotent).
- agent-facing, authorized by the per-session capability in the URL and nothing else:
  ``POST {base_url}/chat/completions``, ``GET {base_url}/models``, ``POST /sessions/{ref}/complete``
  ``{reward_info?}``, where ``base_url = {server}/sessions/{ref}/v1`` and ``ref = "{session_id}.{key}"``.

Capability. ``key`` is 32 random bytes (``secrets.token_urlsafe``), compared in constant time; it is the only
secret an agent holds, so it never learns the server's token (which would let it submit or stop jobs). The
server's bearer-token check skips exactly the routes registered with ``auth="capability"``
(:data:`AGENT_ROUTES`, each handler wrapped by :func:`_capability_route`, which checks the capability first); a key works only with its own session id, so one session's
agent can neither read nor write another's. ``OPENAI_API_KEY`` is set to the key too (SDKs insist on one) but
is not what authorizes. Agents started by the ``cli_agent`` handler reach the gateway through a Unix socket
that serves their session alone (:meth:`Gateway.serve_unix`), so inside the sandbox even a leaked key of
another session is useless.

Tokens. Each request's messages are normalised (``content`` None → ``""``, text parts joined, tool-call
arguments parsed from JSON, keys with null values dropped; whitespace kept) and compared with the session's
history as served (generated turns in the form the gateway answered them). A prefix → only the new messages
are rendered and tokenized (:class:`~prorl_server.conversation.Conversation`); anything else (history
compression, rewrite, a sub-agent, changed tools) closes the current trajectory with ``split_reason`` naming
the first diverging message and how it differs, and starts a new one from the request's messages. The
prompt goes token-in/token-out to the session's sticky backend (:class:`~prorl_server.llm_client.LLMClient`);
the answer's tool calls are parsed from the generated text (hermes) while the raw tokens are kept.

``stream=true`` answers in the OpenAI server-sent-events format; the turn is generated whole, so its chunks
arrive together when it is done.

Every chat answer carries a ``Server-Timing`` header (W3C Server Timing): ``backend;dur=`` (ms of HTTP exchange
with the LLM backend) and ``gateway;dur=`` (ms of the gateway's own work on the request).

Errors answer in the OpenAI format ``{"error": {"message", "type", "param", "code"}}``: 400 for malformed
messages or unsupported parameters (``n > 1``, ``tool_choice="required"``, unknown ones...), 403 for a key that is not this session's,
404 for an unknown session, 409 for a finished one, 429 when ``max_sessions`` are open, 503 when no backend
can generate.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import secrets
import time
import uuid
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from prorl_server.routes import Route, add_routes
from prorl_server.balancer import NoBackendError
from prorl_server.conversation import ContextLengthError, Conversation
from prorl_server.llm_client import LLMRequestError, LLMUnavailableError, backend_getter
from prorl_server.tool_parser import get_parser
from prorl_server.types import Trajectory

if TYPE_CHECKING:
    from prorl_server.job import Job
    from prorl_server.llm_context import LLMContext

log = logging.getLogger(__name__)

#: Sampling parameters passed on to vLLM as given (OpenAI names; vLLM extensions top_k, min_p,
#: repetition_penalty, min_tokens).
_PASSED = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
           "repetition_penalty", "min_tokens")
#: Accepted and ignored: they change nothing the gateway records.
_IGNORED = ("model", "user", "metadata", "store", "parallel_tool_calls", "service_tier")
_KNOWN = frozenset({"messages", "tools", "tool_choice", "max_tokens", "max_completion_tokens", "stop", "n",
                    "stream", "stream_options", "logprobs", "top_logprobs", "response_format", *_PASSED, *_IGNORED})
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class GatewayError(Exception):
    """Answered as an OpenAI-format error with HTTP ``status``."""

    def __init__(self, status: int, message: str, code: str, param: Optional[str] = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type_

    def response(self) -> web.Response:
        return web.json_response({"error": {"message": self.message, "type": self.type, "param": self.param,
                                            "code": self.code}}, status=self.status)


# ------------------------------------------------------------------------------------------ normalisation


def normalize_message(m: Any, i: int) -> dict[str, Any]:
    """One OpenAI chat message in the canonical form used for prefix comparison and rendering.

    ``content``: a string (None → ``""``; a list of text parts joined; whitespace kept). ``tool_calls``:
    ``[{"id"?, "type": "function", "function": {"name", "arguments": <parsed JSON object>}}]``. Keys whose
    value is null are dropped (SDKs add ``refusal: null``, ``audio: null``...).

    Raises:
        GatewayError: 400 ``invalid_messages`` naming the field (e.g. ``messages[2].tool_calls[0]``).
    """
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise GatewayError(400, f"{where} must be an object", "invalid_messages", where)
    role = m.get("role")
    if role not in _ROLES:
        raise GatewayError(400, f"{where}.role must be one of {sorted(_ROLES)}, got {role!r}",
                           "invalid_messages", f"{where}.role")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    content = m.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        parts = []
        for k, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise GatewayError(400, f"{where}.content[{k}]: only text parts are supported",
                                   "invalid_messages", f"{where}.content")
            parts.append(p["text"])
        content = "".join(parts)
    elif not isinstance(content, str):
        raise GatewayError(400, f"{where}.content must be a string or a list of text parts",
                           "invalid_messages", f"{where}.content")
    out["content"] = content
    if role == "tool":
        tcid = m.get("tool_call_id")
        if tcid is not None and not isinstance(tcid, str):
            raise GatewayError(400, f"{where}.tool_call_id must be a string", "invalid_messages",
                               f"{where}.tool_call_id")
        if tcid is not None:
            out["tool_call_id"] = tcid
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    calls = m.get("tool_calls")
    if calls:
        if role != "assistant" or not isinstance(calls, list):
            raise GatewayError(400, f"{where}.tool_calls: only an assistant message may carry a list of tool "
                               "calls", "invalid_messages", f"{where}.tool_calls")
        norm = []
        for k, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise GatewayError(400, f"{where}.tool_calls[{k}] needs function.name", "invalid_messages",
                                   f"{where}.tool_calls[{k}]")
            args = fn.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError:
                    raise GatewayError(400, f"{where}.tool_calls[{k}].function.arguments is not valid JSON",
                                       "invalid_messages", f"{where}.tool_calls[{k}].function.arguments") from None
            call = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
            if isinstance(c.get("id"), str):
                call["id"] = c["id"]
            norm.append(call)
        out["tool_calls"] = norm
    return out


def _comparable(m: dict[str, Any]) -> dict[str, Any]:
    """What must match for a message to count as "the same": tool-call ids are left out (an id is not part
    of what the model generated, and some agent frameworks mint their own)."""
    if "tool_calls" not in m:
        return m
    return {**m, "tool_calls": [{k: v for k, v in c.items() if k != "id"} for c in m["tool_calls"]]}


def describe_divergence(history: list[dict], messages: list[dict]) -> Optional[str]:
    """None if ``history`` is a prefix of ``messages``; otherwise which message diverged and how."""
    for i, h in enumerate(history):
        if i >= len(messages):
            return (f"history_truncated: the request has {len(messages)} messages, the session's history "
                    f"{len(history)} (message {i}, {h['role']}, and later are gone)")
        a, b = _comparable(h), _comparable(messages[i])
        if a == b:
            continue
        if a["role"] != b["role"]:
            return f"message_changed: message {i} was {a['role']}, now {b['role']}"
        if a.get("content") != b.get("content"):
            x, y = a.get("content", ""), b.get("content", "")
            k = next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            return (f"message_changed: message {i} ({a['role']}) content differs from character {k} "
                    f"(history {len(x)} characters, request {len(y)})")
        keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        return f"message_changed: message {i} ({a['role']}) differs in {', '.join(keys)}"
    return None


# ------------------------------------------------------------------------------------------ request


@dataclass
class ChatRequest:
    """A validated ``/chat/completions`` body."""

    messages: list[dict[str, Any]]
    tools: Optional[list[dict[str, Any]]]
    parse_tools: bool
    max_tokens: Optional[int]
    sampling: dict[str, Any]
    stream: bool
    logprobs: bool
    include_usage: bool = False


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate a Chat Completions body (OpenAI API reference, "Create chat completion").

    Raises:
        GatewayError: 400 ``invalid_messages`` / ``unsupported_parameter`` / ``invalid_parameter``.
    """
    if not isinstance(body, dict):
        raise GatewayError(400, "the request body must be a JSON object", "invalid_request")
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise GatewayError(400, f"unsupported parameter(s): {', '.join(unknown)}", "unsupported_parameter",
                           unknown[0])
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise GatewayError(400, "messages must be a non-empty list", "invalid_messages", "messages")
    messages = [normalize_message(m, i) for i, m in enumerate(msgs)]
    if messages[-1]["role"] == "assistant":
        raise GatewayError(400, "the last message is an assistant message: continuing a partial assistant "
                           "turn is not supported", "invalid_messages", f"messages[{len(messages) - 1}]")
    n = body.get("n")
    if n not in (None, 1):
        raise GatewayError(400, f"n={n!r} is not supported: one choice per request (n=1)",
                           "unsupported_parameter", "n")
    if body.get("top_logprobs") not in (None, 0):
        raise GatewayError(400, "top_logprobs > 0 is not supported", "unsupported_parameter", "top_logprobs")
    rf = body.get("response_format")
    if rf not in (None, {"type": "text"}):
        raise GatewayError(400, "response_format other than text is not supported", "unsupported_parameter",
                           "response_format")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(
                isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
                and isinstance(t["function"].get("name"), str) for t in tools):
            raise GatewayError(400, 'tools must be a list of {"type": "function", "function": {"name", ...}}',
                               "invalid_parameter", "tools")
        tools = tools or None
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise GatewayError(400, f"tool_choice={choice!r} is not supported (auto or none): the gateway does not "
                           "constrain generation", "unsupported_parameter", "tool_choice")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                   or max_tokens < 1):
        raise GatewayError(400, "max_tokens must be a positive integer", "invalid_parameter", "max_tokens")
    sampling = {k: body[k] for k in _PASSED if body.get(k) is not None}
    for k, v in sampling.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise GatewayError(400, f"{k} must be a number", "invalid_parameter", k)
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 4:
            raise GatewayError(400, "stop must be a string or a list of up to 4 strings", "invalid_parameter",
                               "stop")
        sampling["stop"] = stop
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise GatewayError(400, "stream must be a boolean", "invalid_parameter", "stream")
    opts = body.get("stream_options")
    if opts is not None and (not stream or not isinstance(opts, dict)):
        raise GatewayError(400, "stream_options needs stream=true and must be an object", "invalid_parameter",
                           "stream_options")
    return ChatRequest(messages=messages, tools=tools, parse_tools=bool(tools) and choice != "none",
                       max_tokens=max_tokens, sampling=sampling, stream=stream,
                       logprobs=bool(body.get("logprobs")),
                       include_usage=bool((body.get("stream_options") or {}).get("include_usage")))


# ------------------------------------------------------------------------------------------ sessions


@dataclass
class Session:
    """One agent's session: its conversation(s) and what it is owed. Fields are the gateway's; read them.

    ``counters``: ``requests``; ``generated_tokens``; ``prompt_tokens_added`` (tokens the gateway rendered and
    tokenized itself); ``splits``; seconds: ``llm_s`` (in the token-in/token-out client), ``backend_http_s``
    (its HTTP exchanges with the backend), ``gateway_s`` (everything else of a request inside the gateway).
    """

    session_id: str
    key: str
    job: Optional["Job"] = None
    metadata: dict[str, Any] = field(default_factory=dict)
    state: str = "open"  # open | completed | finalized | aborted | expired
    end_reason: Optional[str] = None
    created: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    reward_info: Optional[dict[str, Any]] = None
    conv: Optional[Conversation] = None
    history: list[dict[str, Any]] = field(default_factory=list)  # conv.messages as served / as received
    tools: Optional[list[dict[str, Any]]] = None
    awaiting: bool = False  # conv ends with new messages, not yet answered
    done: list[Trajectory] = field(default_factory=list)  # trajectories closed by splits
    split_reasons: list[str] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=lambda: {
        "requests": 0, "generated_tokens": 0, "prompt_tokens_added": 0, "splits": 0, "llm_s": 0.0,
        "backend_http_s": 0.0, "gateway_s": 0.0})
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    completed: asyncio.Event = field(default_factory=asyncio.Event)
    backend_key: Optional[str] = None  # pool assignment of a session without a job
    last_finish: Optional[str] = None

    @property
    def ref(self) -> str:
        """The capability path segment: ``{session_id}.{key}``."""
        return f"{self.session_id}.{self.key}"

    @property
    def is_open(self) -> bool:
        return self.state == "open"

    def trajectories(self) -> list[Trajectory]:
        """Closed segments, then the open conversation's (its last segment carries the last turn's
        finish reason)."""
        out = list(self.done)
        if self.conv is not None and self.conv.num_turns:
            out += self.conv.trajectories()
        return out

    def summary(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "state": self.state, "end_reason": self.end_reason,
                "job_id": self.job.job_id if self.job is not None else None, "metadata": self.metadata,
                "num_trajectories": len(self.done) + (1 if self.conv is not None else 0),
                "split_reasons": list(self.split_reasons), "reward_info": self.reward_info,
                "counters": dict(self.counters)}

    def result(self) -> dict[str, Any]:
        """``summary()`` plus ``trajectories`` (wire :class:`Trajectory` dicts) and ``messages`` (the open
        conversation's, as served)."""
        return {**self.summary(), "trajectories": [t.model_dump() for t in self.trajectories()],
                "messages": [dict(m) for m in self.history]}


class Gateway:
    """Sessions of one rollout server.

    Args:
        llm: the server's :class:`~prorl_server.llm_context.LLMContext` (shared client, tokenizer).
        pool: the backend pool (a session without a job holds one backend, sticky, until it ends).
        max_sessions: open sessions at most (``POST /sessions`` answers 429 beyond).
        idle_timeout_s: an open session unused this long (seconds) expires (its tokens are kept for finalize).
        keep_finished: ended sessions kept for ``finalize`` / status (oldest dropped first).
        parser: tool-call parser name (:mod:`prorl_server.tool_parser`).
    """

    def __init__(self, llm: "LLMContext", pool: Any, *, max_sessions: int = 1024, idle_timeout_s: float = 900.0,
                 keep_finished: int = 1024, parser: str = "hermes") -> None:
        self.llm = llm
        self.pool = pool
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.keep_finished = keep_finished
        self.parser = get_parser(parser)
        self.open: dict[str, Session] = {}
        self.finished: "OrderedDict[str, Session]" = OrderedDict()
        self.counters: dict[str, float] = {"sessions": 0, "requests": 0, "splits": 0, "expired": 0,
                                           "rejected_sessions": 0}

    # ------------------------------------------------------------------ lifecycle
    def create_session(self, job: Optional["Job"] = None, metadata: Optional[dict[str, Any]] = None) -> Session:
        """Open a session (bound to ``job``: its sticky backend; else one from the pool on first use).

        Raises:
            GatewayError: 429 when ``max_sessions`` are open.
        """
        if len(self.open) >= self.max_sessions:
            self.counters["rejected_sessions"] += 1
            raise GatewayError(429, f"{len(self.open)} sessions are open (max_sessions={self.max_sessions}); "
                               "finalize or abort some", "too_many_sessions", type_="rate_limit_error")
        s = Session(session_id="sess_" + uuid.uuid4().hex, key=secrets.token_urlsafe(32), job=job,
                    metadata=dict(metadata or {}))
        self.open[s.session_id] = s
        self.counters["sessions"] += 1
        return s

    def lookup(self, session_id: str) -> Session:
        """Raises GatewayError 404 for an unknown (or long forgotten) session."""
        s = self.open.get(session_id) or self.finished.get(session_id)
        if s is None:
            raise GatewayError(404, f"no session {session_id!r} (never created, or expired and forgotten)",
                               "unknown_session", type_="not_found_error")
        return s

    def authorize(self, ref: str, only: Optional[str] = None) -> Session:
        """The session named by a capability ``ref`` (``{session_id}.{key}``); ``only``: the one session this
        listener serves.

        Raises:
            GatewayError: 404 unknown session; 403 a key that is not this session's.
        """
        sid, _, key = ref.partition(".")
        if only is not None and sid != only:
            raise GatewayError(404, "this endpoint serves one other session only", "unknown_session",
                               type_="not_found_error")
        s = self.lookup(sid)
        if not key or not hmac.compare_digest(key.encode(), s.key.encode()):
            raise GatewayError(403, f"the key in the URL is not session {sid!r}'s", "invalid_session_key",
                               type_="permission_error")
        return s

    def _end(self, s: Session, state: str, reason: str) -> None:
        if not s.is_open:
            return
        s.state, s.end_reason = state, reason
        if s.conv is not None and s.last_finish is not None:
            s.conv.finish(s.last_finish)
        if state == "aborted":
            s.conv, s.done, s.history = None, [], []
        self.open.pop(s.session_id, None)
        self.finished[s.session_id] = s
        while len(self.finished) > self.keep_finished:
            self.finished.popitem(last=False)
        if s.backend_key is not None:
            self.pool.release(s.backend_key)
        s.completed.set()

    def complete(self, s: Session, reward_info: Optional[dict[str, Any]] = None) -> None:
        """The agent says it is done (``POST .../complete``); the tokens stay for finalize."""
        if not s.is_open:
            raise GatewayError(409, f"session {s.session_id} has ended ({s.state})", "session_finished")
        s.reward_info = reward_info
        self._end(s, "completed", "complete")

    def finalize(self, s: Session, reason: str = "finalize") -> dict[str, Any]:
        """End the session (if open) and return :meth:`Session.result`. Idempotent."""
        self._end(s, "finalized", reason)
        if s.state == "aborted":
            raise GatewayError(409, f"session {s.session_id} was aborted; its tokens are gone", "session_aborted")
        return s.result()

    def abort(self, s: Session, reason: str = "abort") -> None:
        """End the session and drop its tokens. Idempotent."""
        self._end(s, "aborted", reason)

    def expire_idle(self, now: Optional[float] = None) -> int:
        """Expire open sessions idle longer than ``idle_timeout_s`` (not those inside a request, nor those of a
        job: the job's timeout and cancellation bound them)."""
        now = time.monotonic() if now is None else now
        stale = [s for s in self.open.values()
                 if s.job is None and now - s.last_used > self.idle_timeout_s and not s.lock.locked()]
        for s in stale:
            self._end(s, "expired", "idle_timeout")
        self.counters["expired"] += len(stale)
        return len(stale)

    async def close(self) -> None:
        for s in list(self.open.values()):
            self._end(s, "expired", "server_shutdown")

    # ------------------------------------------------------------------ generation
    def _backend_source(self, s: Session) -> Any:
        if s.job is not None:
            return s.job
        s.backend_key = f"gateway:{s.session_id}"
        return backend_getter(None, self.pool, s.backend_key)

    async def chat(self, s: Session, req: ChatRequest) -> tuple[dict[str, Any], float]:
        """Answer one Chat Completions request of session ``s`` (serialised per session).

        Returns:
            ``(answer, backend_http_s)``: the ``chat.completion`` object and the seconds this turn spent in
            HTTP exchanges with the backend (all attempts).

        Raises:
            GatewayError: 409 session ended; 400 context full or backend refusal; 503 no backend.
        """
        async with s.lock:
            if not s.is_open:
                raise GatewayError(409, f"session {s.session_id} has ended ({s.state}: {s.end_reason})",
                                   "session_finished")
            t0 = time.perf_counter()
            s.last_used = time.monotonic()
            s.counters["requests"] += 1
            self.counters["requests"] += 1
            get = backend_getter(self._backend_source(s))
            try:
                backend = await get(frozenset())
                tok = await self.llm.tokenizer(backend)
                info = await self.llm.client.model_info(backend.address)
            except (NoBackendError, LLMUnavailableError) as e:
                raise GatewayError(503, f"no LLM backend: {e}", "no_backend", type_="server_error") from None
            await self._advance(s, req, tok, info.max_model_len)
            conv = s.conv
            assert conv is not None
            room = conv.room
            if room < 1:
                raise GatewayError(400, f"the conversation fills the model's context ({conv.num_tokens} tokens)",
                                   "context_length_exceeded")
            max_tokens = min(req.max_tokens or room, room)
            t_llm = time.perf_counter()
            try:
                comp = await self.llm.client.complete(conv.token_ids, backend=get, max_tokens=max_tokens,
                                                      sampling_params=req.sampling)
            except LLMUnavailableError as e:
                raise GatewayError(503, str(e), "backend_unavailable", type_="server_error") from None
            except LLMRequestError as e:
                raise GatewayError(400, f"the backend refused the request: {e}", "backend_rejected") from None
            finally:
                if not s.is_open and s.backend_key is not None:  # ended meanwhile: a retry may have re-acquired
                    self.pool.release(s.backend_key)
            if not s.is_open:  # aborted or finalized while generating: the turn is not recorded
                raise GatewayError(409, f"session {s.session_id} ended while this turn was generated "
                                   f"({s.state})", "session_finished")
            llm_s = time.perf_counter() - t_llm
            msg = conv.add_completion(comp)
            s.awaiting = False
            s.last_finish = comp.finish_reason
            answer, finish = self._answer(msg["content"], req, comp.finish_reason)
            s.history.append(normalize_message(answer, len(s.history)))
            s.counters["generated_tokens"] += len(comp.token_ids)
            s.counters["llm_s"] += llm_s
            s.counters["backend_http_s"] += comp.http_s
            s.counters["gateway_s"] += time.perf_counter() - t0 - llm_s
            s.last_used = time.monotonic()
            choice: dict[str, Any] = {"index": 0, "message": answer, "finish_reason": finish, "logprobs": None}
            if req.logprobs:
                choice["logprobs"] = {"content": [
                    {"token": tok.convert_ids_to_tokens(i), "logprob": lp, "bytes": None, "top_logprobs": []}
                    for i, lp in zip(comp.token_ids, comp.logprobs)]}
            prompt_len = conv.num_tokens - len(comp.token_ids)
            return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                    "model": info.id, "choices": [choice],
                    "usage": {"prompt_tokens": prompt_len, "completion_tokens": len(comp.token_ids),
                              "total_tokens": conv.num_tokens}}, comp.http_s

    def _answer(self, text: str, req: ChatRequest, finish: str) -> tuple[dict[str, Any], str]:
        """The assistant message as served: text outside well-formed tool calls, and those calls."""
        if not req.parse_tools:
            return {"role": "assistant", "content": text}, finish
        parsed = self.parser.parse(text)
        if not parsed.calls:
            return {"role": "assistant", "content": text}, finish
        content = text
        if parsed.errors:  # keep the malformed attempts visible to the agent, as generated
            for c in parsed.calls:
                content = content.replace(c.raw, "", 1)
            content = content.strip()
        else:
            content = parsed.content
        return ({"role": "assistant", "content": content or None,
                 "tool_calls": [c.to_openai() for c in parsed.calls]}, "tool_calls")

    async def _advance(self, s: Session, req: ChatRequest, tok: Any, max_model_len: Optional[int]) -> None:
        """Bring ``s.conv`` in step with ``req.messages``: append the new ones, or split."""
        messages = req.messages
        reason: Optional[str] = None
        if s.conv is not None:
            if req.tools != s.tools:
                reason = "tools_changed: the request's tools differ from the session's"
            else:
                reason = describe_divergence(s.history, messages)
            if reason is None:
                new = messages[len(s.history):]
                if not new:
                    if s.awaiting:
                        return  # a retry after a failed generation: the same prompt again
                    raise GatewayError(400, "no new message after the assistant's last answer",
                                       "invalid_messages", "messages")
                if s.awaiting:
                    reason = "unanswered_messages: new messages after messages that were never answered"
                else:
                    before = s.conv.num_tokens
                    if not await s.conv.add_messages(new):
                        raise GatewayError(400, "the new messages do not fit in the model's context",
                                           "context_length_exceeded", "messages")
                    s.history.extend(new)
                    s.awaiting = True
                    s.counters["prompt_tokens_added"] += s.conv.num_tokens - before
                    return
            # split: close the current conversation's last segment with the reason
            trajs = s.conv.trajectories() if s.conv.num_turns else []
            if trajs:
                trajs[-1].finish_reason = "split"
                trajs[-1].split_reason = reason
                s.done.extend(trajs)
            s.split_reasons.append(reason)
            s.counters["splits"] += 1
            self.counters["splits"] += 1
            s.conv = None
        limit = _context_limit(tok, max_model_len)
        try:
            s.conv = await Conversation.create(tok, messages, max_context_tokens=limit,
                                               tools=req.tools)
        except ContextLengthError as e:
            raise GatewayError(400, str(e), "context_length_exceeded", "messages") from None
        except Exception as e:  # the chat template refused these messages (e.g. roles out of order)
            raise GatewayError(400, f"the model's chat template cannot render these messages: "
                               f"{type(e).__name__}: {e}", "invalid_messages", "messages") from None
        s.history = list(messages)
        s.tools = req.tools
        s.awaiting = True
        s.counters["prompt_tokens_added"] += s.conv.num_tokens

    # ------------------------------------------------------------------ per-session listener
    async def serve_unix(self, session: Session, path: str,
                         owner: Optional[tuple[int, int]] = None) -> web.AppRunner:
        """Serve ``session``'s agent routes (and nothing else) on a Unix socket at ``path``, mode 0700: only
        its owner connects (the server's user, or ``owner`` = ``(uid, gid)``, the sandbox's user when a root
        server runs its sandboxes as another uid; the socket is chowned to it). Put it in a 0700 directory of
        that user too. Returns the runner; ``await runner.cleanup()`` stops it."""
        sub = web.Application()
        sub[GATEWAY] = self
        sub[ONLY_SESSION] = session.session_id
        _add_agent_routes(sub)
        runner = web.AppRunner(sub, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.UnixSite(runner, path)
        await site.start()
        os.chmod(path, 0o700)
        if owner is not None:
            os.chown(path, *owner)
        return runner


def _context_limit(tok: Any, max_model_len: Optional[int]) -> int:
    limits = [max_model_len]
    model_max = getattr(tok, "model_max_length", None)
    if isinstance(model_max, int) and model_max < 10**8:
        limits.append(model_max)
    known = [x for x in limits if x]
    if not known:
        raise GatewayError(500, "no context length known for the served model", "no_context_length",
                           type_="server_error")
    return min(known)


# ------------------------------------------------------------------------------------------ aiohttp glue

GATEWAY = web.AppKey("gateway", Gateway)
ONLY_SESSION = web.AppKey("gateway_only_session", str)
_BY_LLM: "weakref.WeakKeyDictionary[Any, Gateway]" = weakref.WeakKeyDictionary()


def gateway_for(job: "Job") -> Gateway:
    """The gateway of the server running ``job`` (for handlers such as ``cli_agent``).

    Raises:
        RuntimeError: the server has no gateway (``setup_gateway`` was not called on its app).
    """
    gw = _BY_LLM.get(job.llm) if job.llm is not None else None
    if gw is None:
        raise RuntimeError("this server has no gateway (prorl_server.gateway.setup_gateway(app) in create_app)")
    return gw


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _json_body(request: web.Request) -> Any:
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except ValueError as e:
        raise GatewayError(400, f"the request body is not valid JSON: {e}", "invalid_json") from None


def _capability_route(fn: Callable[[web.Request, Gateway, Session], Awaitable[web.StreamResponse]]) -> Handler:
    """An agent route: authorized by the capability in ``{ref}`` (checked first, always), errors in the
    OpenAI format. Register it with ``auth="capability"`` (the server's bearer-token check then skips it)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            gw = request.app[GATEWAY]
            s = gw.authorize(request.match_info["ref"], request.app.get(ONLY_SESSION))
            return await fn(request, gw, s)
        except GatewayError as e:
            return e.response()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug: still answer in the format the agent's SDK understands
            log.exception("gateway error in session %s", request.match_info.get("ref", "").partition(".")[0])
            return GatewayError(500, f"{type(e).__name__}: {e}", "internal_error", type_="server_error").response()

    handler.__name__ = fn.__name__
    handler.__doc__ = fn.__doc__
    return handler


def _management_route(fn: Callable[[web.Request, Gateway], Awaitable[web.StreamResponse]]) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            return await fn(request, request.app[GATEWAY])
        except GatewayError as e:
            return e.response()

    handler.__name__ = fn.__name__
    handler.__doc__ = fn.__doc__
    return handler


@_capability_route
async def chat_completions(request: web.Request, gw: Gateway, s: Session) -> web.StreamResponse:
    """``POST /sessions/{ref}/v1/chat/completions``.

    The answer carries a ``Server-Timing`` header (W3C Server Timing): ``backend;dur=`` the milliseconds of
    the turn's HTTP exchanges with the LLM backend, ``gateway;dur=`` the rest of the time in this handler
    (body parsing, prefix check, tokenization, parsing, recording).
    """
    t0 = time.perf_counter()
    req = parse_chat_request(await _json_body(request))
    answer, backend_s = await gw.chat(s, req)
    timing = server_timing(backend_s, time.perf_counter() - t0 - backend_s)
    if not req.stream:
        return web.json_response(answer, headers={"Server-Timing": timing})
    return await _stream(request, answer, req.include_usage, timing)


def server_timing(backend_s: float, gateway_s: float) -> str:
    """A ``Server-Timing`` header value (W3C Server Timing, durations in milliseconds)."""
    return f"backend;dur={backend_s * 1e3:.3f}, gateway;dur={gateway_s * 1e3:.3f}"


def stream_chunks(answer: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """A whole ``chat.completion`` as ``chat.completion.chunk`` objects (OpenAI streaming format): the role,
    the content, one chunk per tool call, the finish reason, and the usage if asked for. The turn is generated
    whole (token-in/token-out), so the chunks come together once it is done."""
    choice = answer["choices"][0]
    msg = choice["message"]
    head = {"id": answer["id"], "object": "chat.completion.chunk", "created": answer["created"],
            "model": answer["model"]}

    def chunk(delta: dict[str, Any], finish: Optional[str] = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                     "logprobs": choice["logprobs"] if finish else None}]}

    out = [chunk({"role": "assistant", "content": ""})]
    if msg.get("content"):
        out.append(chunk({"content": msg["content"]}))
    for k, call in enumerate(msg.get("tool_calls") or ()):
        out.append(chunk({"tool_calls": [{"index": k, **call}]}))
    out.append(chunk({}, choice["finish_reason"]))
    if include_usage:
        out.append({**head, "choices": [], "usage": answer["usage"]})
    return out


async def _stream(request: web.Request, answer: dict[str, Any], include_usage: bool,
                  timing: str) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "Server-Timing": timing})
    await resp.prepare(request)
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in stream_chunks(answer, include_usage))
    await resp.write((body + "data: [DONE]\n\n").encode())
    await resp.write_eof()
    return resp


@_capability_route
async def models(request: web.Request, gw: Gateway, s: Session) -> web.StreamResponse:
    """``GET /sessions/{ref}/v1/models``: the model the session's backend serves."""
    try:
        b = await backend_getter(gw._backend_source(s))(frozenset())
        info = await gw.llm.client.model_info(b.address)
    except Exception as e:
        raise GatewayError(503, f"no LLM backend: {e}", "no_backend", type_="server_error") from None
    return web.json_response({"object": "list", "data": [{"id": info.id, "object": "model", "created": 0,
                                                          "owned_by": "prorl", "max_model_len": info.max_model_len}]})


@_capability_route
async def complete(request: web.Request, gw: Gateway, s: Session) -> web.StreamResponse:
    """``POST /sessions/{ref}/complete`` ``{reward_info?: object}``: the agent is done."""
    body = await _json_body(request)
    info = body.get("reward_info") if isinstance(body, dict) else None
    if info is not None and not isinstance(info, dict):
        raise GatewayError(400, "reward_info must be an object", "invalid_parameter", "reward_info")
    async with s.lock:
        gw.complete(s, info)
    return web.json_response({"session_id": s.session_id, "state": s.state})


class CreateSessionRequest(BaseModel):
    """Body of ``POST /sessions`` (may be empty): ``metadata`` is kept with the session and returned by
    finalize."""

    model_config = ConfigDict(extra="allow")
    metadata: dict[str, Any] = Field(default_factory=dict)


class SessionCreated(BaseModel):
    """Answer of ``POST /sessions`` (201): ``base_url`` is the OpenAI base URL the agent is given, with the
    capability in its path; ``api_key`` the key it sends."""

    session_id: str
    base_url: str
    api_key: str


@_management_route
async def create_session(request: web.Request, gw: Gateway) -> web.StreamResponse:
    """``POST /sessions`` ``{metadata?}`` → ``201 {session_id, base_url, api_key}``."""
    body = await _json_body(request)
    if not isinstance(body, dict) or not isinstance(body.get("metadata", {}), dict):
        raise GatewayError(400, "body must be {metadata?: object}", "invalid_parameter", "metadata")
    s = gw.create_session(metadata=body.get("metadata"))
    base = f"{request.url.origin()}/sessions/{s.ref}/v1"
    return web.Response(body=SessionCreated(session_id=s.session_id, base_url=base, api_key=s.key)
                        .model_dump_json(), status=201, content_type="application/json")


@_management_route
async def session_status(request: web.Request, gw: Gateway) -> web.StreamResponse:
    """``GET /sessions/{session_id}``: state, split reasons and counters (no tokens)."""
    return web.json_response(gw.lookup(request.match_info["session_id"]).summary())


@_management_route
async def finalize(request: web.Request, gw: Gateway) -> web.StreamResponse:
    """``POST /sessions/{session_id}/finalize`` → summary + ``trajectories`` + ``messages``."""
    s = gw.lookup(request.match_info["session_id"])
    async with s.lock:
        return web.json_response(gw.finalize(s))


@_management_route
async def abort(request: web.Request, gw: Gateway) -> web.StreamResponse:
    """``POST /sessions/{session_id}/abort``."""
    s = gw.lookup(request.match_info["session_id"])
    gw.abort(s)
    return web.json_response({"session_id": s.session_id, "state": s.state})


#: Agent routes: authorized by the session capability ``{ref}`` = ``{session_id}.{key}`` in the path.
AGENT_ROUTES: tuple[Route, ...] = tuple(Route(*r, auth="capability", openai_errors=True, errors=(503,)) for r in (
    ("POST", "/sessions/{ref}/v1/chat/completions", chat_completions,
     "Chat Completions (OpenAI format) for the session's agent; exact tokens recorded"),
    ("GET", "/sessions/{ref}/v1/models", models, "The model the session's backend serves"),
    ("POST", "/sessions/{ref}/complete", complete, "The agent is done ({reward_info?})"),
))
#: Management routes: the server's bearer token.
MANAGEMENT_ROUTES: tuple[Route, ...] = (
    Route("POST", "/sessions", create_session, "Open a gateway session", CreateSessionRequest, SessionCreated,
          openai_errors=True, status=201, errors=(503,)),
) + tuple(Route(*r, openai_errors=True) for r in (
    ("GET", "/sessions/{session_id}", session_status, "A session's state, split reasons and counters"),
    ("POST", "/sessions/{session_id}/finalize", finalize, "End a session and return its trajectories"),
    ("POST", "/sessions/{session_id}/abort", abort, "End a session and drop its tokens"),
))


def _add_agent_routes(app: web.Application) -> None:
    for r in AGENT_ROUTES:
        app.router.add_route(r.method, r.path, r.handler)


def setup_gateway(app: web.Application, *, max_sessions: int = 1024, idle_timeout_s: float = 900.0,
                  keep_finished: int = 1024, parser: str = "hermes") -> None:
    """Add the gateway's routes and its lifetime to an app built by
    :func:`prorl_server.app.create_app` (call it last there: the pipeline must start before it). The limits are
    :class:`Gateway`'s arguments (``create_app`` passes the ``gateway_*`` server settings). The agent routes
    are registered with ``auth="capability"``, so the server's bearer-token check lets them through to their
    handler, which authorizes by the capability in the path.
    """
    from prorl_server.app import PIPELINE, POOL

    add_routes(app, AGENT_ROUTES + MANAGEMENT_ROUTES)

    async def lifetime(app: web.Application):
        pipeline = app[PIPELINE]
        gw = Gateway(pipeline.llm, app[POOL], max_sessions=max_sessions, idle_timeout_s=idle_timeout_s,
                     keep_finished=keep_finished, parser=parser)
        app[GATEWAY] = gw
        _BY_LLM[pipeline.llm] = gw

        async def janitor() -> None:
            while True:
                await asyncio.sleep(max(0.05, min(30.0, idle_timeout_s / 4)))
                gw.expire_idle()

        task = asyncio.create_task(janitor(), name="gateway-janitor")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await gw.close()

    app.cleanup_ctx.append(lifetime)
