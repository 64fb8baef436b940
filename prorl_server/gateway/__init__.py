"""OpenAI-compatible gateway for black-box agents: per-session Chat Completions with exact tokens.

A black-box agent is any program that speaks the OpenAI Chat Completions API. It is given a session's
``base_url`` and trained without changing its code; the gateway is the single tokenization authority and
records exactly what the model saw and generated.

Modules: :mod:`~prorl_server.gateway.protocol` (the Chat Completions wire: request validation, answers, stream
chunks, errors), :mod:`~prorl_server.gateway.sessions` (:class:`Session`, :class:`Gateway`: the session state
machine and the turn per request), :mod:`~prorl_server.gateway.routes` (aiohttp handlers and route table).
The composition root (:func:`prorl_server.app.create_app`) builds the :class:`Gateway`, serves it with
:func:`add_gateway_routes`, starts and closes it, and hands it to every job (``job.services.gateway``).

Endpoints:

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
(:data:`AGENT_ROUTES`, each handler checks the capability first); a key works only with its own session id, so
one session's agent can neither read nor write another's. ``OPENAI_API_KEY`` is set to the key too (SDKs insist on one) but
is not what authorizes. Agents started by the ``cli_agent`` handler reach the gateway through a Unix socket
that serves their session alone (:meth:`Gateway.serve_unix`), so inside the sandbox even a leaked key of
another session is useless.

Tokens. Each request's messages are normalised (``content`` None → ``""``, text parts joined, tool-call
arguments parsed from JSON, keys with null values dropped; whitespace kept) and compared with the session's
history as served (generated turns in the form the gateway answered them). A prefix → only the new messages
are rendered and tokenized (:class:`~prorl_server.llm.conversation.Conversation`); anything else (history
compression, rewrite, a sub-agent, changed tools) closes the current trajectory with ``split_reason`` naming
the first diverging message and how it differs, and starts a new one from the request's messages. The
prompt goes token-in/token-out to the session's sticky backend (:class:`~prorl_server.llm.client.LLMClient`);
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

from prorl_server.gateway.protocol import (ChatRequest, CreateSessionRequest, GatewayError, SessionCreated,
                                           assistant_message, chat_completion, normalize_message,
                                           parse_chat_request, server_timing, stream_chunks, token_logprobs)
from prorl_server.gateway.routes import (AGENT_ROUTES, GATEWAY, MANAGEMENT_ROUTES, ONLY_SESSION, add_gateway_routes,
                                         agent_app)
from prorl_server.gateway.sessions import Gateway, Session, describe_divergence

__all__ = ["AGENT_ROUTES", "GATEWAY", "MANAGEMENT_ROUTES", "ONLY_SESSION", "ChatRequest", "CreateSessionRequest",
           "Gateway", "GatewayError", "Session", "SessionCreated", "add_gateway_routes", "agent_app",
           "assistant_message", "chat_completion", "describe_divergence", "normalize_message",
           "parse_chat_request", "server_timing", "stream_chunks", "token_logprobs"]
