"""The OpenAI Chat Completions wire of the gateway: request validation and normalisation, the answer and its
stream chunks, and the OpenAI error format.

Everything here is pure (no session state, no I/O): :mod:`prorl_server.gateway.sessions` decides what a
request means for a session, :mod:`prorl_server.gateway.routes` carries it over HTTP. References: the OpenAI
API reference, "Create chat completion" and "The chat completion chunk object".
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from prorl_server.tool_parser import ParsedTurn

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
    """Answered as an OpenAI-format error ``{"error": {message, type, param, code}}`` with HTTP ``status``."""

    def __init__(self, status: int, message: str, code: str, param: Optional[str] = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type_

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


# ------------------------------------------------------------------------------------------ request


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


# ------------------------------------------------------------------------------------------ answer


def assistant_message(text: str, parsed: Optional[ParsedTurn], finish_reason: str) -> tuple[dict[str, Any], str]:
    """The assistant message as served, and the answer's ``finish_reason``.

    ``parsed``: the tool calls parsed from ``text`` (None when the request's tools are not parsed: no tools,
    or ``tool_choice="none"``). With well-formed calls the message carries them as ``tool_calls`` (arguments
    as JSON strings) and ``finish_reason`` is ``"tool_calls"``; its ``content`` is the text outside the calls
    (None when empty), or, when some attempts were malformed, the whole text but the well-formed calls, so the
    agent sees what it wrote. Otherwise ``content`` is ``text`` verbatim and ``finish_reason`` is passed on.
    """
    if parsed is None or not parsed.calls:
        return {"role": "assistant", "content": text}, finish_reason
    content = text
    if parsed.errors:  # keep the malformed attempts visible to the agent, as generated
        for c in parsed.calls:
            content = content.replace(c.raw, "", 1)
        content = content.strip()
    else:
        content = parsed.content
    return ({"role": "assistant", "content": content or None,
             "tool_calls": [c.to_openai() for c in parsed.calls]}, "tool_calls")


def token_logprobs(tokens: list[str], logprobs: list[float]) -> dict[str, Any]:
    """The choice's ``logprobs`` object: one entry per generated token (its text form and logprob; no
    alternatives: ``top_logprobs`` is not supported)."""
    return {"content": [{"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
                        for t, lp in zip(tokens, logprobs)]}


def chat_completion(message: dict[str, Any], finish_reason: str, *, model: str, prompt_tokens: int,
                    completion_tokens: int, logprobs: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """A ``chat.completion`` object with one choice; ``usage`` counts tokens."""
    choice = {"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": logprobs}
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


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


def server_timing(backend_s: float, gateway_s: float) -> str:
    """A ``Server-Timing`` header value (W3C Server Timing, durations in milliseconds)."""
    return f"backend;dur={backend_s * 1e3:.3f}, gateway;dur={gateway_s * 1e3:.3f}"


# ------------------------------------------------------------------------------------------ management bodies


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
