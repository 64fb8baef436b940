"""The gateway over HTTP: aiohttp handlers and their :class:`~prorl_server.routes.Route` declarations.

:func:`add_gateway_routes` puts the agent routes (authorized by the session capability in the path) and the
management routes (the server's bearer token) on the rollout server's app; :func:`agent_app` is an app with the
agent routes alone, for one session (the Unix socket a ``cli_agent`` sandbox reaches). Handlers find the
:class:`~prorl_server.gateway.sessions.Gateway` under :data:`GATEWAY` and answer errors in the OpenAI format.
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import time
from types import ModuleType
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from aiohttp import web

from prorl_server.gateway import anthropic as anthropic_api, responses as responses_api
from prorl_server.gateway.protocol import (BODY_BOUNDS, CreateSessionRequest, GatewayError, SessionCreated,
                                           decode_arguments, json_error, parse_chat_request, server_timing,
                                           stream_chunks)
from prorl_server.failures import JobEndedError
from prorl_server.routes import Route, add_routes
from sandbox.bounded_json import JsonBoundError, aloads

if TYPE_CHECKING:
    from prorl_server.gateway.sessions import Gateway, Session

log = logging.getLogger("prorl_server.gateway")

#: The app's gateway (set by :func:`add_gateway_routes` / :func:`agent_app`).
GATEWAY: "web.AppKey[Gateway]" = web.AppKey("gateway")
#: On a per-session listener: the one session it serves.
ONLY_SESSION = web.AppKey("gateway_only_session", str)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _json_body(request: web.Request) -> Any:
    """The request's JSON body, decoded within :data:`~prorl_server.gateway.protocol.BODY_BOUNDS` (scanned
    with yields to the event loop first: a dense, deep or oversized body is refused before anything is
    built). No body reads as {}; whitespace only is invalid JSON, as in ``parse_body``.

    Raises:
        GatewayError: 413 ``request_too_large``; 400 ``invalid_json`` or ``json_too_complex``.
    """
    limit = BODY_BOUNDS.max_bytes
    if request.content_length is not None and request.content_length > limit:
        raise GatewayError(413, f"the request body is {request.content_length} bytes, more than the limit of "
                           f"{limit} bytes", "request_too_large")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as e:  # the app's client_max_size (max_body_mb), if below the limit
        raise GatewayError(413, f"the request body is too large: {e.text}", "request_too_large") from None
    if not raw:
        return {}
    try:
        return await aloads(raw, BODY_BOUNDS)
    except JsonBoundError as e:
        raise json_error(e, "the request body") from None


def _capability_route(fn: Callable[[web.Request, "Gateway", "Session"], Awaitable[web.StreamResponse]],
                      convert: Callable[[GatewayError], GatewayError] = lambda e: e) -> Handler:
    """An agent route: authorized by the capability in ``{ref}`` (checked first, always), errors in the
    OpenAI format (or the one ``convert`` gives them). Register it with ``auth="capability"`` (the server's
    bearer-token check then skips it)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            gw = request.app[GATEWAY]
            s = gw.authorize(request.match_info["ref"], request.app.get(ONLY_SESSION))
            return await fn(request, gw, s)
        except GatewayError as e:
            return convert(e).response()
        except JobEndedError as e:  # the system is ending the session's job (cancel, timeout, shutdown): no bug
            return convert(GatewayError(409, f"the session's job is ending: {e}", "job_ended")).response()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug: still answer in the format the agent's SDK understands
            log.exception("gateway error in session %s", request.match_info.get("ref", "").partition(".")[0])
            return convert(GatewayError(500, f"{type(e).__name__}: {e}", "internal_error",
                                        type_="server_error")).response()

    handler.__name__ = fn.__name__
    handler.__doc__ = fn.__doc__
    return handler


def _management_route(fn: Callable[[web.Request, "Gateway"], Awaitable[web.StreamResponse]]) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            return await fn(request, request.app[GATEWAY])
        except GatewayError as e:
            return e.response()

    handler.__name__ = fn.__name__
    handler.__doc__ = fn.__doc__
    return handler


@_capability_route
async def chat_completions(request: web.Request, gw: "Gateway", s: "Session") -> web.StreamResponse:
    """``POST /sessions/{ref}/v1/chat/completions``.

    The answer carries a ``Server-Timing`` header (W3C Server Timing): ``backend;dur=`` the milliseconds of
    the turn's HTTP exchanges with the LLM backend, ``gateway;dur=`` the rest of the time in this handler
    (body parsing, prefix check, tokenization, parsing, recording).
    """
    t0 = time.perf_counter()
    body = await _json_body(request)
    await decode_arguments(body)
    req = parse_chat_request(body)
    _journal_room(gw, s)
    answer, backend_s = await gw.chat(s, req)
    timing = server_timing(backend_s, time.perf_counter() - t0 - backend_s)
    text = json.dumps(answer)
    await _journal(request, gw, s, body, text)
    if not req.stream:
        return web.Response(text=text, content_type="application/json", headers={"Server-Timing": timing})
    return await _stream(request, answer, req.include_usage, timing)


def _journal_room(gw: "Gateway", s: "Session") -> None:
    """Refuse a turn of a session whose job (or the session itself, without a job) has journalled its cap
    (:meth:`~prorl_server.journal.store.Journal.gateway_full`): the journal never grows without bound because
    of what an agent sends. The agent's doing, so a 400 the agent sees (its job is scored as it ends).

    Raises:
        GatewayError: 400 ``journal_cap_exceeded``.
    """
    journal = gw.llm.client.journal
    if journal is None:
        return
    if s.job is None:
        journal.gateway_session(s.session_id, f"gateway:{s.session_id}")
        why = journal.gateway_full(s.session_id, f"gateway:{s.session_id}")
    else:
        why = journal.gateway_full(s.job.job_id)
    if why is not None:
        raise GatewayError(400, f"session {s.session_id} can make no more requests: {why}", "journal_cap_exceeded")


async def _journal(request: web.Request, gw: "Gateway", s: "Session", body: Any, answer: str) -> None:
    """Record the exchange in the server's journal (if it has one): the decoded request ``body`` (stored
    compact, its messages after those the previous request had), the SHA-256 of the body as sent, and the
    answer, under the session's job id (else the session id), numbered in the session."""
    journal = gw.llm.client.journal
    if journal is not None:
        raw = await request.read()  # aiohttp keeps the body it read: no second read from the socket
        owner = s.job.job_id if s.job is not None else s.session_id
        journal.gateway_exchange(owner, s.counters["requests"], hashlib.sha256(raw).hexdigest(), body,
                                 answer.encode())


async def _stream(request: web.Request, answer: dict[str, Any], include_usage: bool,
                  timing: str) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "Server-Timing": timing})
    await resp.prepare(request)
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in stream_chunks(answer, include_usage))
    await resp.write((body + "data: [DONE]\n\n").encode())
    await resp.write_eof()
    return resp


async def _translated(request: web.Request, gw: "Gateway", s: "Session", api: ModuleType) -> web.StreamResponse:
    """One turn of another API on the session's chat path: ``api`` (:mod:`~prorl_server.gateway.anthropic`,
    :mod:`~prorl_server.gateway.responses`) translates the body into a Chat Completions body and the
    ``chat.completion`` answer back (whole, or as its server-sent events). ``Server-Timing`` as for chat."""
    t0 = time.perf_counter()
    body = await _json_body(request)
    req = api.to_chat_request(body)
    await decode_arguments(req.chat)
    chat = parse_chat_request(req.chat)
    _journal_room(gw, s)
    answer, backend_s = await gw.chat(s, chat)
    out = api.from_chat_completion(answer, req)
    timing = server_timing(backend_s, time.perf_counter() - t0 - backend_s)
    text = json.dumps(out)
    await _journal(request, gw, s, body, text)
    if not req.stream:
        return web.Response(text=text, content_type="application/json", headers={"Server-Timing": timing})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "Server-Timing": timing})
    await resp.prepare(request)
    await resp.write(api.sse(api.stream_events(out)))
    await resp.write_eof()
    return resp


@functools.partial(_capability_route, convert=anthropic_api.from_gateway_error)
async def messages(request: web.Request, gw: "Gateway", s: "Session") -> web.StreamResponse:
    """``POST /sessions/{ref}/v1/messages``: the Anthropic Messages API (errors in its format)."""
    return await _translated(request, gw, s, anthropic_api)


@_capability_route
async def responses(request: web.Request, gw: "Gateway", s: "Session") -> web.StreamResponse:
    """``POST /sessions/{ref}/v1/responses``: the OpenAI Responses API (no stored responses)."""
    return await _translated(request, gw, s, responses_api)


@_capability_route
async def models(request: web.Request, gw: "Gateway", s: "Session") -> web.StreamResponse:
    """``GET /sessions/{ref}/v1/models``: the model the session's backend serves."""
    info = await gw.model_card(s)
    return web.json_response({"object": "list", "data": [{"id": info.id, "object": "model", "created": 0,
                                                          "owned_by": "prorl", "max_model_len": info.max_model_len}]})


@_capability_route
async def complete(request: web.Request, gw: "Gateway", s: "Session") -> web.StreamResponse:
    """``POST /sessions/{ref}/complete`` ``{reward_info?: object}``: the agent is done."""
    body = await _json_body(request)
    info = body.get("reward_info") if isinstance(body, dict) else None
    if info is not None and not isinstance(info, dict):
        raise GatewayError(400, "reward_info must be an object", "invalid_parameter", "reward_info")
    async with s.lock:
        gw.complete(s, info)
    return web.json_response({"session_id": s.session_id, "state": s.state})


@_management_route
async def create_session(request: web.Request, gw: "Gateway") -> web.StreamResponse:
    """``POST /sessions`` ``{metadata?}`` → ``201 {session_id, base_url, api_key}``."""
    body = await _json_body(request)
    if not isinstance(body, dict) or not isinstance(body.get("metadata", {}), dict):
        raise GatewayError(400, "body must be {metadata?: object}", "invalid_parameter", "metadata")
    s = gw.create_session(metadata=body.get("metadata"))
    base = f"{request.url.origin()}/sessions/{s.ref}/v1"
    return web.Response(body=SessionCreated(session_id=s.session_id, base_url=base, api_key=s.key)
                        .model_dump_json(), status=201, content_type="application/json")


@_management_route
async def session_status(request: web.Request, gw: "Gateway") -> web.StreamResponse:
    """``GET /sessions/{session_id}``: state, split reasons and counters (no tokens)."""
    return web.json_response(gw.lookup(request.match_info["session_id"]).summary())


@_management_route
async def finalize(request: web.Request, gw: "Gateway") -> web.StreamResponse:
    """``POST /sessions/{session_id}/finalize`` → summary + ``trajectories`` + ``messages``."""
    s = gw.lookup(request.match_info["session_id"])
    async with s.lock:
        return web.json_response(gw.finalize(s))


@_management_route
async def abort(request: web.Request, gw: "Gateway") -> web.StreamResponse:
    """``POST /sessions/{session_id}/abort``."""
    s = gw.lookup(request.match_info["session_id"])
    gw.abort(s)
    return web.json_response({"session_id": s.session_id, "state": s.state})


#: Agent routes: authorized by the session capability ``{ref}`` = ``{session_id}.{key}`` in the path.
AGENT_ROUTES: tuple[Route, ...] = tuple(Route(*r, auth="capability", openai_errors=True, errors=(503,)) for r in (
    ("POST", "/sessions/{ref}/v1/chat/completions", chat_completions,
     "Chat Completions (OpenAI format) for the session's agent; exact tokens recorded"),
    ("POST", "/sessions/{ref}/v1/messages", messages,
     "Anthropic Messages API for the session's agent (errors in the Anthropic format); same session and tokens"),
    ("POST", "/sessions/{ref}/v1/responses", responses,
     "OpenAI Responses API for the session's agent (no stored responses); same session and tokens"),
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


def add_gateway_routes(app: web.Application, gateway: "Gateway") -> None:
    """Serve ``gateway`` on ``app`` (the rollout server's): its agent and management routes, listed in
    ``/openapi.json``. The agent routes are registered with ``auth="capability"``, so the server's
    bearer-token check lets them through to their handler, which authorizes by the capability in the path.
    Starting and closing the gateway is the caller's (:meth:`~prorl_server.gateway.sessions.Gateway.start`,
    :meth:`~prorl_server.gateway.sessions.Gateway.close`)."""
    app[GATEWAY] = gateway
    add_routes(app, AGENT_ROUTES + MANAGEMENT_ROUTES)


def agent_app(gateway: "Gateway", session_id: str) -> web.Application:
    """An app serving the agent routes of session ``session_id`` alone (any other session: 404), with no
    middleware: the capability in the path is the only credential."""
    app = web.Application()
    app[GATEWAY] = gateway
    app[ONLY_SESSION] = session_id
    for r in AGENT_ROUTES:
        app.router.add_route(r.method, r.path, r.handler)
    return app
