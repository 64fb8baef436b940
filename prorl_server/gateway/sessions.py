"""Gateway sessions: the session state machine and :class:`Gateway`, which drives one turn per request.

A session is ``open`` until the agent posts ``complete`` (``completed``), the server finalizes it
(``finalized``) or aborts it (``aborted``: its tokens are dropped), or it expires (``expired``: idle past
``idle_timeout_s``, or the server shut down). Ended sessions are kept (``keep_finished``) for finalize and
status.

Each request's messages (normalised by :mod:`prorl_server.gateway.protocol`) are compared with the session's
history as served: a prefix → only the new messages are rendered and tokenized; anything else closes the
current trajectory with a ``split_reason`` naming the first diverging message and starts a new one. The turn
itself (context limit, generation on the session's sticky backend, tool-call parsing) is the shared
:class:`~prorl_server.llm.turn.TurnEngine`'s, the same the server's own agent loop uses.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import secrets
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

from aiohttp import web

from prorl_server.balancer import NoBackendError
from prorl_server.llm.conversation import ContextLengthError, Conversation
from prorl_server.gateway.protocol import (ChatRequest, GatewayError, answer_choice, assistant_message,
                                           chat_completion, check_logit_bias, normalize_message, token_logprobs)
from prorl_server.llm.client import (BackendSource, Completion, LLMRequestError, LLMUnavailableError, ModelInfo,
                                     PoolBackends)
from prorl_server.llm.tool_parser import ParsedTurn
from prorl_server.llm.turn import AUTO, ContextFullError, ContextUnknownError, ToolParserUnavailableError, TurnEngine
from prorl_server.types import TokenStats, Trajectory, TurnRecord

if TYPE_CHECKING:
    from prorl_server.balancer import BackendPool
    from prorl_server.llm.context import LLMContext


class SessionJob(BackendSource, Protocol):
    """What a session uses of the job it is bound to (:class:`prorl_server.job.Job` is one; the gateway does not
    import it, the job's services hold the gateway): the job's sticky backend and turn records
    (:class:`~prorl_server.llm.client.BackendSource`), its id, and where the session's drift report goes."""

    job_id: str

    def add_token_stats(self, stats: TokenStats) -> None:
        """Add ``stats`` to the job's drift report."""
        ...


#: UTF-8 bytes of text per token of the context beyond which a gateway request is refused unread: a token of
#: English averages about 4 bytes, and more than 8 over a whole conversation needs text made of long runs one
#: token each. Bytes, not characters: tokenizing costs per byte, and a CJK character is 3 bytes and may be 3
#: tokens.
MAX_BYTES_PER_TOKEN = 8


def _text_bytes(value: Any) -> int:
    """UTF-8 bytes of ``value`` (a decoded, already bounded JSON value) written as JSON: what a chat template
    renders of it at the least (keys, numbers and escapes included: ``tojson`` writes a control character as
    six characters, and thirty thousand 30-digit numbers in a schema ``enum`` are ~960,000 tokens)."""
    return len(json.dumps(value, ensure_ascii=False, default=_plain).encode("utf-8", "surrogatepass"))


def _plain(v: Any) -> Any:
    return v.model_dump() if hasattr(v, "model_dump") else str(v)


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


def _decoded(conv: Conversation, comp: Completion) -> str:
    """The text of ``comp`` as :meth:`Conversation.add_completion` puts it in the message: a final stop token
    that the template writes after an assistant turn anyway is left out."""
    ids, tok = comp.token_ids, conv.tok
    if comp.finish_reason == "stop" and ids and not isinstance(comp.stop_reason, str):
        last = tok.decode(ids[-1:])
        terminator = tok.assistant_terminator()
        if terminator is None or (last and terminator.startswith(last)):
            return tok.decode(ids[:-1])
    return tok.decode(ids)


def _served_text(text: str, comp: Completion, tok: Any) -> str:
    """``text`` as the agent is answered: without the special stop token the model ended with (an EOS or a
    generation-config stop token such as ``<|endoftext|>`` where the template ends turns with ``<|im_end|>``),
    as vLLM's own answers skip special tokens. The conversation keeps it, so the recorded tokens are still
    exactly what was generated."""
    if comp.finish_reason == "stop" and not isinstance(comp.stop_reason, str) and comp.token_ids:
        last = tok.convert_ids_to_tokens(comp.token_ids[-1])
        if text.endswith(last) and last in tok.all_special_tokens:
            return text[:-len(last)]
    return text


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
    job: Optional[SessionJob] = None
    metadata: dict[str, Any] = field(default_factory=dict)
    state: str = "open"  # open | completed | finalized | aborted | expired
    end_reason: Optional[str] = None
    created: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    reward_info: Optional[dict[str, Any]] = None
    conv: Optional[Conversation] = None
    history: list[dict[str, Any]] = field(default_factory=list)  # conv.messages as served / as received
    tools: Optional[list[dict[str, Any]]] = None
    template_kwargs: Optional[dict[str, Any]] = None  # the conversation's chat_template_kwargs
    awaiting: bool = False  # conv ends with new messages, not yet answered
    # an n > 1 answer not yet continued: (message as served, normalised; its completion; its parsed tool calls)
    # per choice, and when their generation ended (host time.monotonic): the continued turn's record ends there
    choices: Optional[list[tuple[dict[str, Any], Completion, Optional[ParsedTurn]]]] = None
    choices_at: float = 0.0
    done: list[Trajectory] = field(default_factory=list)  # trajectories closed by splits
    split_reasons: list[str] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=lambda: {
        "requests": 0, "generated_tokens": 0, "prompt_tokens_added": 0, "splits": 0, "llm_s": 0.0,
        "backend_http_s": 0.0, "gateway_s": 0.0})
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    completed: asyncio.Event = field(default_factory=asyncio.Event)
    backend_key: Optional[str] = None  # pool assignment of a session without a job
    last_finish: Optional[str] = None
    # drift report of the conversations that gateway splits closed, and those splits by reason code
    past_stats: TokenStats = field(default_factory=TokenStats)
    # turn records of the conversations that gateway splits closed (trajectory_index into trajectories())
    past_turns: list[TurnRecord] = field(default_factory=list)

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

    def turn_records(self) -> list[TurnRecord]:
        """One :class:`~prorl_server.types.TurnRecord` per turn of :meth:`trajectories`, indexing it: an ``n > 1``
        branch trajectory (a copy of its base plus one choice) has a copy of its base's records and one for its
        choice, all with zero times (the request's time is the continued choice's turn's)."""
        out = [t.model_copy() for t in self.past_turns]
        if self.conv is not None and self.conv.num_turns:
            base = len(self.done)
            out += [t.model_copy(update={"trajectory_index": t.trajectory_index + base}) for t in self.conv.turns]
        return out

    def token_stats(self) -> TokenStats:
        """The session's drift report (:class:`~prorl_server.types.TokenStats`): its conversations'
        :meth:`~prorl_server.llm.conversation.Conversation.token_stats` summed, plus the gateway's own splits (a
        request that did not extend the served history) by reason code. ``n > 1`` branches are not splits."""
        if self.conv is None:
            return self.past_stats
        return self.past_stats + TokenStats(**self.conv.token_stats())

    def summary(self) -> dict[str, Any]:
        """The session's state, ``split_reasons``, ``counters`` and ``token_stats`` (the drift report, a
        :class:`~prorl_server.types.TokenStats` dict)."""
        return {"session_id": self.session_id, "state": self.state, "end_reason": self.end_reason,
                "job_id": self.job.job_id if self.job is not None else None, "metadata": self.metadata,
                "num_trajectories": len(self.done) + (1 if self.conv is not None else 0),
                "split_reasons": list(self.split_reasons), "reward_info": self.reward_info,
                "counters": dict(self.counters), "token_stats": self.token_stats().model_dump()}

    def result(self) -> dict[str, Any]:
        """``summary()`` plus ``trajectories`` (wire :class:`Trajectory` dicts) and ``messages`` (the open
        conversation's, as served)."""
        return {**self.summary(), "trajectories": [t.model_dump() for t in self.trajectories()],
                "turns": [t.model_dump() for t in self.turn_records()],
                "messages": [dict(m) for m in self.history]}


class Gateway:
    """Sessions of one rollout server.

    Args:
        llm: the server's :class:`~prorl_server.llm.context.LLMContext` (shared client, tokenizer).
        pool: the backend pool (a session without a job holds one backend, sticky, until it ends).
        max_sessions: open sessions at most (``POST /sessions`` answers 429 beyond).
        idle_timeout_s: an open session unused this long (seconds) expires (its tokens are kept for finalize).
        keep_finished: ended sessions kept for ``finalize`` / status (oldest dropped first).
        parser: tool-call parser name (:mod:`prorl_server.llm.tool_parser`); ``"auto"``: the served model
            family's (:attr:`~prorl_server.llm.chat_templates.FamilySpec.tool_parser`).
        on_token_stats: called with the drift report (:meth:`Session.token_stats`) of each session without a
            job that ends with its tokens kept (not aborted); a job's sessions add theirs to the job's
            ``token_stats`` instead, reported with the job. The server counts them on ``/metrics``.

    :meth:`start` (on a running loop) starts the janitor that expires idle sessions; :meth:`close` stops it and
    ends every open session.
    """

    def __init__(self, llm: "LLMContext", pool: "BackendPool", *, max_sessions: int = 1024,
                 idle_timeout_s: float = 900.0, keep_finished: int = 1024, parser: str = AUTO,
                 on_token_stats: Optional[Callable[[TokenStats], None]] = None,
                 agent_app: Optional[Callable[["Gateway", str], web.Application]] = None) -> None:
        self.llm = llm
        #: ``(gateway, session_id) -> app`` of :meth:`serve_unix` (``prorl_server.gateway.routes.agent_app``,
        #: given by the composition root: the HTTP routes import this module, not the other way round)
        self.agent_app = agent_app
        self.on_token_stats = on_token_stats
        self.pool = pool
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.keep_finished = keep_finished
        self.engine = TurnEngine(llm.client, parser)
        self.open: dict[str, Session] = {}
        self.finished: "OrderedDict[str, Session]" = OrderedDict()
        self.counters: dict[str, float] = {"sessions": 0, "requests": 0, "splits": 0, "expired": 0,
                                           "rejected_sessions": 0}
        self._janitor: Optional[asyncio.Task] = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start expiring idle sessions (every ``idle_timeout_s / 4``, between 0.05 and 30 s). Idempotent."""
        if self._janitor is None:
            self._janitor = asyncio.get_running_loop().create_task(self._expire_forever(), name="gateway-janitor")

    async def _expire_forever(self) -> None:
        while True:
            await asyncio.sleep(max(0.05, min(30.0, self.idle_timeout_s / 4)))
            self.expire_idle()

    async def close(self) -> None:
        """Stop the janitor and end every open session (``expired``, ``server_shutdown``; tokens kept)."""
        if self._janitor is not None:
            self._janitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._janitor
            self._janitor = None
        for s in list(self.open.values()):
            self._end(s, "expired", "server_shutdown")

    def create_session(self, job: Optional[SessionJob] = None, metadata: Optional[dict[str, Any]] = None) -> Session:
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
        self._resolve_choices(s, None)
        if s.conv is not None and s.last_finish is not None:
            s.conv.finish(s.last_finish)
        if state == "aborted":
            s.conv, s.done, s.history, s.past_turns = None, [], [], []
        else:  # the drift report goes with the tokens: into the job's result, or to on_token_stats
            stats = s.token_stats()
            if s.job is not None:
                s.job.add_token_stats(stats)
            elif self.on_token_stats is not None:
                self.on_token_stats(stats)
        self.open.pop(s.session_id, None)
        self.finished[s.session_id] = s
        while len(self.finished) > self.keep_finished:
            self.finished.popitem(last=False)
        if s.backend_key is not None:
            self.pool.release(s.backend_key)
            journal = self.llm.client.journal
            if journal is not None and s.job is None:  # its turns end: the journal drops its last context
                journal.forget_owner(s.backend_key)
        journal = self.llm.client.journal
        if journal is not None and s.job is None:  # its rows may go once they are the oldest
            journal.gateway_session_ended(s.session_id)
        s.completed.set()

    def complete(self, s: Session, reward_info: Optional[dict[str, Any]] = None) -> None:
        """The agent says it is done (``POST .../complete``); the tokens stay for finalize.

        Raises:
            GatewayError: 409 the session has ended.
        """
        if not s.is_open:
            raise GatewayError(409, f"session {s.session_id} has ended ({s.state})", "session_finished")
        s.reward_info = reward_info
        self._end(s, "completed", "complete")

    def finalize(self, s: Session, reason: str = "finalize") -> dict[str, Any]:
        """End the session (if open) and return :meth:`Session.result`. Idempotent.

        Raises:
            GatewayError: 409 the session was aborted (its tokens are gone).
        """
        self._end(s, "finalized", reason)
        if s.state == "aborted":
            raise GatewayError(409, f"session {s.session_id} was aborted; its tokens are gone", "session_aborted")
        return s.result()

    def abort(self, s: Session, reason: str = "abort") -> None:
        """End the session and drop its tokens. Idempotent."""
        self._end(s, "aborted", reason)

    def expire_idle(self, now: Optional[float] = None) -> int:
        """Expire open sessions idle longer than ``idle_timeout_s`` (not those inside a request, nor those of a
        job: the job's timeout and cancellation bound them). Returns how many expired."""
        now = time.monotonic() if now is None else now
        stale = [s for s in self.open.values()
                 if s.job is None and now - s.last_used > self.idle_timeout_s and not s.lock.locked()]
        for s in stale:
            self._end(s, "expired", "idle_timeout")
        self.counters["expired"] += len(stale)
        return len(stale)

    # ------------------------------------------------------------------ generation
    def backends(self, s: Session) -> BackendSource:
        """Where ``s`` generates: its job (the job's sticky backend; its result records each turn), else a pool
        assignment under the session's own key, held until the session ends."""
        if s.job is not None:
            return s.job
        s.backend_key = f"gateway:{s.session_id}"
        return PoolBackends(self.pool, s.backend_key)

    async def model_card(self, s: Session) -> ModelInfo:
        """The model ``s``'s backend serves (``GET .../v1/models``).

        Raises:
            GatewayError: 503 no backend answers.
        """
        try:
            b = await self.backends(s).acquire(frozenset())
            return await self.llm.client.model_info(b.address)
        except Exception as e:
            raise GatewayError(503, f"no LLM backend: {e}", "no_backend", type_="server_error") from None

    async def chat(self, s: Session, req: ChatRequest) -> tuple[dict[str, Any], float]:
        """Answer one Chat Completions request of session ``s`` (serialised per session).

        ``n > 1``: the ``n`` choices are ``n`` completions of the same prompt (``n`` concurrent requests to
        the session's backend; with a ``seed``, choice ``i`` is sampled with ``seed + i``). The session's
        conversation continues with the choice whose message the agent's next request carries after the
        history (the first choice when it carries none of them, or when the session ends first); every other
        choice is recorded then as a complete branch: a trajectory of the continued trajectory's tokens so far
        and that choice's generated tokens, ``split_reason`` ``"branch: ..."``, with its turn records
        (:meth:`Session.turn_records`).

        Returns:
            ``(answer, backend_http_s)``: the ``chat.completion`` object and the seconds this turn spent in
            HTTP exchanges with the backend (all attempts, all choices).

        Raises:
            GatewayError: 409 session ended; 400 context full, backend refusal, a forced tool call this
                server's tool-call parser cannot be constrained to, a ``logit_bias`` id outside the vocabulary;
                503 no backend.
        """
        async with s.lock:
            if not s.is_open:
                raise GatewayError(409, f"session {s.session_id} has ended ({s.state}: {s.end_reason})",
                                   "session_finished")
            t0 = time.perf_counter()
            s.last_used = time.monotonic()
            s.counters["requests"] += 1
            self.counters["requests"] += 1
            source = self.backends(s)
            try:
                backend = await source.acquire(frozenset())
                tok = await self.llm.tokenizer(backend)
                info = await self.llm.client.model_info(backend.address)
            except (NoBackendError, LLMUnavailableError) as e:
                raise GatewayError(503, f"no LLM backend: {e}", "no_backend", type_="server_error") from None
            sampling = self._sampling(req, tok)
            if s.conv is not None and s.conv.turns and not s.awaiting and s.choices is None:
                # since the last answer the agent program ran (its tool calls): the model's side, #35 (after an
                # n > 1 answer the continued choice is charged once it joins: _resolve_choices)
                s.conv.record_tools(s.conv.since_last_turn())
            await self._advance(s, req, tok, info.max_model_len)
            conv = s.conv
            assert conv is not None

            def still_open(_: Optional[Completion] = None) -> None:
                if not s.is_open:  # aborted or finalized while generating: the turn is not recorded
                    raise GatewayError(409, f"session {s.session_id} ended while this turn was generated "
                                       f"({s.state})", "session_finished")

            t_llm = time.perf_counter()
            try:
                if req.n == 1:
                    turn = await self.engine.turn(conv, source, max_tokens=req.max_tokens, sampling_params=sampling,
                                                  parse=req.parse_tools, accept=still_open)
                    text = _served_text(turn.message["content"], turn.completion, tok)
                    parsed = turn.parsed
                    if parsed is not None and text != turn.message["content"]:
                        parsed = await self.engine.parse(conv, text)
                    generated = [(turn.completion, text, parsed)]
                else:
                    generated = await self._sample(conv, source, req, sampling, tok)
                    s.choices_at = time.monotonic()
                    still_open()
            except ContextFullError as e:
                raise GatewayError(400, str(e), "context_length_exceeded") from None
            except LLMUnavailableError as e:
                raise GatewayError(503, str(e), "backend_unavailable", type_="server_error") from None
            except LLMRequestError as e:
                raise GatewayError(400, f"the backend refused the request: {e}", "backend_rejected") from None
            except ToolParserUnavailableError as e:
                raise GatewayError(500, str(e), "tool_parser_unavailable", type_="server_error") from None
            finally:
                if not s.is_open and s.backend_key is not None:  # ended meanwhile: a retry may have re-acquired
                    self.pool.release(s.backend_key)
            llm_s = time.perf_counter() - t_llm
            s.awaiting = False
            choices, served = [], []
            for i, (comp, text, parsed) in enumerate(generated):
                message, finish = assistant_message(text, parsed, comp.finish_reason)
                served.append((normalize_message(message, len(s.history)), comp, parsed))
                logprobs = None
                if req.logprobs:
                    top = None
                    if req.top_logprobs and comp.top_logprobs is not None:
                        top = [list(zip(tok.convert_ids_to_tokens([a for a, _ in alts[:req.top_logprobs]]),
                                        [lp for _, lp in alts[:req.top_logprobs]])) for alts in comp.top_logprobs]
                    logprobs = token_logprobs(tok.convert_ids_to_tokens(comp.token_ids), comp.logprobs, top)
                choices.append(answer_choice(i, message, finish, logprobs=logprobs, stop_reason=comp.stop_reason))
            if req.n == 1:
                s.history.append(served[0][0])
                s.last_finish = generated[0][0].finish_reason
            else:  # recorded once the agent's next request says which choice it continues
                s.choices = served
            completion_tokens = sum(len(c.token_ids) for c, _, _ in generated)
            s.counters["generated_tokens"] += completion_tokens
            s.counters["llm_s"] += llm_s
            http_s = sum(c.http_s for c, _, _ in generated)
            s.counters["backend_http_s"] += http_s
            s.counters["gateway_s"] += time.perf_counter() - t0 - llm_s
            s.last_used = time.monotonic()
            prompt_tokens = conv.num_tokens - (len(generated[0][0].token_ids) if req.n == 1 else 0)
            answer = chat_completion(choices, model=info.id, prompt_tokens=prompt_tokens,
                                     completion_tokens=completion_tokens)
            return answer, http_s

    def _sampling(self, req: ChatRequest, tok: Any) -> dict[str, Any]:
        """The request's vLLM parameters: sampling, ``logit_bias`` (ids checked against ``tok``'s
        vocabulary), ``structured_outputs`` (response format or forced tool call), ``top_logprobs``.

        Raises:
            GatewayError: 400 (see :meth:`ChatRequest.structured_outputs`, :func:`check_logit_bias`).
        """
        sampling = dict(req.sampling)
        if req.logit_bias:  # len(tok) builds the whole vocabulary: only when there is something to check
            sampling["logit_bias"] = check_logit_bias(req.logit_bias, len(tok))
        # the parser's name only matters to a forced tool call ("auto" reads the family from the template)
        constraint = req.structured_outputs(self.engine.parser_name(tok) if req.tool_choice == "required" else "")
        if constraint is not None:
            sampling["structured_outputs"] = constraint
        if req.logprobs and req.top_logprobs:
            sampling["top_logprobs"] = req.top_logprobs
        return sampling

    async def _sample(self, conv: Conversation, source: BackendSource, req: ChatRequest, sampling: dict[str, Any],
                      tok: Any) -> list[tuple[Completion, str, Optional[ParsedTurn]]]:
        """``req.n`` completions of ``conv``'s prompt, none appended: ``(completion, text, parsed calls)`` per
        choice (``text`` as :meth:`Conversation.add_completion` would decode it, then :func:`_served_text`).

        Raises:
            ContextFullError, LLMUnavailableError, LLMRequestError: as :meth:`TurnEngine.turn`.
        """
        room = conv.room
        if room < 1:
            raise ContextFullError(conv.num_tokens)
        budget = min(req.max_tokens, room) if req.max_tokens else room
        prompt = list(conv.token_ids)

        def params(i: int) -> dict[str, Any]:
            return {**sampling, "seed": sampling["seed"] + i} if "seed" in sampling else sampling

        results = await asyncio.gather(*(self.llm.client.complete(prompt, backend=source, max_tokens=budget,
                                                                  sampling_params=params(i))
                                         for i in range(req.n)), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        out = []
        for comp in results:
            text = _served_text(_decoded(conv, comp), comp, tok)
            out.append((comp, text, await self.engine.parse(conv, text) if req.parse_tools else None))
        return out

    def _resolve_choices(self, s: Session, messages: Optional[list[dict[str, Any]]]) -> None:
        """Record a pending ``n > 1`` answer: the choice ``messages`` continues with (the message after the
        history; the first choice if none matches or ``messages`` is None) joins the conversation, the others
        become branch trajectories (a copy of the base plus that choice), each with its turn records: copies of
        the base's and one for the choice, with zero times. The continued choice's record is timed like an
        ``n = 1`` turn: generation until :attr:`Session.choices_at`, then (when the agent's next request resolves
        it) the agent program's time since as its ``t_tool_s``."""
        pending, s.choices = s.choices, None
        if not pending or s.conv is None:
            return
        k, at = 0, len(s.history)
        if messages is not None and len(messages) > at and describe_divergence(s.history, messages[:at]) is None:
            nxt = _comparable(messages[at])
            k = next((i for i, (m, _, _) in enumerate(pending) if _comparable(m) == nxt), 0)
        segments = s.conv.trajectories()
        base, seg = segments[-1], len(segments) - 1
        base_turns = [t for t in s.conv.turns if t.trajectory_index == seg]
        for i, (_, c, parsed) in enumerate(pending):
            if i == k:
                continue
            # the choices were sampled side by side in one request whose time the continued turn carries, and
            # the base's turns' time is the base's: a branch's records carry spans and counts, no second time
            index, zero = len(s.done), {"t_llm_s": 0.0, "t_tool_s": 0.0, "t_tool_critical_s": 0.0, "t_wait_s": 0.0}
            s.past_turns += [t.model_copy(update={**zero, "trajectory_index": index, "reward": 0.0})
                             for t in base_turns]
            s.past_turns.append(TurnRecord(
                trajectory_index=index, response_start=len(base.response_ids),
                response_end=len(base.response_ids) + len(c.token_ids),
                weight_version=c.weight_versions[-1] if c.weight_versions else None, finish_reason=c.finish_reason,
                tool_calls=len(parsed.calls) if parsed is not None else 0,
                tool_call_errors=len(parsed.errors) if parsed is not None else 0))
            s.done.append(Trajectory(
                prompt_ids=base.prompt_ids, response_ids=base.response_ids + c.token_ids,
                response_logprobs=base.response_logprobs + c.logprobs,
                loss_mask=base.loss_mask + [1] * len(c.token_ids), num_turns=base.num_turns + 1,
                weight_versions=list(dict.fromkeys([*base.weight_versions, *c.weight_versions])),
                version_runs=[*base.version_runs, *(c.version_runs or ([[None, len(c.token_ids)]]
                                                                      if c.token_ids else []))],
                mixed_version_turns=base.mixed_version_turns + (len(c.version_runs) > 1),
                finish_reason=c.finish_reason,
                split_reason=f"branch: choice {i} of {len(pending)}, not continued (the agent went on with "
                             f"choice {k})"))
        message, comp, parsed = pending[k]
        s.conv.add_completion(comp, at=s.choices_at)
        if parsed is not None:  # the record's counts, as the turn engine sets them for an n = 1 turn
            s.conv.turns[-1].tool_calls = len(parsed.calls)
            s.conv.turns[-1].tool_call_errors = len(parsed.errors)
        s.history.append(message)
        s.last_finish = comp.finish_reason
        if messages is not None:  # the agent's next request: its time since the answer was its own, as for n = 1
            s.conv.record_tools(s.conv.since_last_turn())

    async def _advance(self, s: Session, req: ChatRequest, tok: Any, max_model_len: Optional[int]) -> None:
        """Bring ``s.conv`` in step with ``req.messages``: append the new ones, or split.

        A request whose text (messages and tool schemas written as JSON: keys, numbers, escapes) is longer than
        :data:`MAX_BYTES_PER_TOKEN` UTF-8 bytes per token of the context cannot fit and is refused before it is
        rendered or tokenized (tokenizing a megabyte costs ~1.7 s of CPU: an agent in a sandbox could stall the
        server with a few)."""
        messages = req.messages
        if max_model_len:
            size = _text_bytes(messages) + _text_bytes(req.tools)
            if size > max_model_len * MAX_BYTES_PER_TOKEN:
                raise GatewayError(400, f"the request's {size} bytes of text cannot fit in the model's context of "
                                   f"{max_model_len} tokens (more than {MAX_BYTES_PER_TOKEN} bytes per token)",
                                   "context_length_exceeded", "messages")
        reason: Optional[str] = None
        self._resolve_choices(s, messages)
        if s.conv is not None:
            if req.tools != s.tools:
                reason = "tools_changed: the request's tools differ from the session's"
            elif req.chat_template_kwargs != s.template_kwargs:
                reason = "chat_template_kwargs_changed: the request's chat_template_kwargs differ from the session's"
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
                s.past_turns = s.turn_records()
                s.done.extend(trajs)
            s.split_reasons.append(reason)
            s.past_stats += TokenStats(**s.conv.token_stats()) + TokenStats(splits={reason.split(":", 1)[0]: 1})
            s.counters["splits"] += 1
            self.counters["splits"] += 1
            s.conv = None
        try:
            s.conv = await self.engine.start(tok, messages, caps=(max_model_len,), tools=req.tools,
                                             chat_template_kwargs=req.chat_template_kwargs)
        except ContextUnknownError as e:
            raise GatewayError(500, str(e), "no_context_length", type_="server_error") from None
        except ContextLengthError as e:
            raise GatewayError(400, str(e), "context_length_exceeded", "messages") from None
        except Exception as e:  # the chat template refused these messages (e.g. roles out of order)
            raise GatewayError(400, f"the model's chat template cannot render these messages: "
                               f"{type(e).__name__}: {e}", "invalid_messages", "messages") from None
        s.history = list(messages)
        s.tools = req.tools
        s.template_kwargs = req.chat_template_kwargs
        s.awaiting = True
        s.counters["prompt_tokens_added"] += s.conv.num_tokens

    # ------------------------------------------------------------------ per-session listener
    async def serve_unix(self, session: Session, path: str,
                         owner: Optional[tuple[int, int]] = None) -> web.AppRunner:
        """Serve ``session``'s agent routes (and nothing else) on a Unix socket at ``path``, mode 0700: only
        its owner connects (the server's user, or ``owner`` = ``(uid, gid)``, the sandbox's user when a root
        server runs its sandboxes as another uid; the socket is chowned to it). Put it in a 0700 directory of
        that user too. Returns the runner; ``await runner.cleanup()`` stops it.

        Raises:
            RuntimeError: the gateway was built without an ``agent_app`` (outside :func:`prorl_server.app.create_app`).
        """
        if self.agent_app is None:
            raise RuntimeError("this gateway has no agent_app to serve a session with: build it with "
                               "Gateway(..., agent_app=prorl_server.gateway.agent_app)")
        runner = web.AppRunner(self.agent_app(self, session.session_id), access_log=None, handle_signals=False)
        await runner.setup()
        site = web.UnixSite(runner, path)
        await site.start()
        os.chmod(path, 0o700)
        if owner is not None:
            os.chown(path, *owner)
        return runner
