"""The Anthropic Messages API on a gateway session, by translation at the edges.

A harness built on the Anthropic Messages API (``POST /v1/messages``, e.g. Claude-Code-style agents) is
served by the same session machinery as Chat Completions: its request is translated into the Chat
Completions body the gateway accepts (one tokenization authority, one trajectory store), and the gateway's
``chat.completion`` answer is translated back into an Anthropic ``Message`` (or its stream of events).
Served at ``POST {base}/v1/messages``, ``base`` being the session's ``base_url`` less its ``/v1`` suffix
(what an Anthropic SDK takes as its base URL, e.g. ``ANTHROPIC_BASE_URL``); the SDK's ``x-api-key`` header
is not what authorizes, the capability in the path is.

Request rules (:func:`to_chat_request`):

- ``system`` (a string or text blocks) → a leading system message; message-level ``role: "system"`` → a
  system message in place. A text block starting with ``x-anthropic-billing-header`` is dropped: it carries a
  per-request hash, so keeping it would make every turn a history rewrite (a trajectory split).
- Several text blocks of one message are concatenated as they are (no separator), like the text parts of a
  Chat Completions message.
- user ``tool_result`` blocks → ``tool`` messages (``tool_call_id`` = ``tool_use_id``), in block order, text
  around them → user messages. A result's content is a string or text blocks (concatenated); with
  ``is_error: true`` it is prefixed with ``"Error: "`` (Chat Completions has no error flag).
- assistant ``text`` → ``content``, ``tool_use`` → ``tool_calls`` (``arguments`` = the ``input`` as JSON);
  ``thinking`` / ``redacted_thinking`` blocks are dropped (the gateway never answers with them: a model's
  reasoning, if any, is part of its text).
- ``image``, ``document`` and other non-text blocks, server tools (``type`` other than ``custom``) and
  unknown request fields are refused (400, ``invalid_request_error``).
- ``tools`` → function tools (``name``, ``description``, ``parameters`` = ``input_schema``); ``tool_choice``
  ``auto`` / ``any`` / ``tool`` / ``none`` → ``"auto"`` / ``"required"`` / ``{"type": "function", ...}`` /
  ``"none"`` (the gateway itself decides which of these it serves; it answers the others with a 400);
  ``disable_parallel_tool_use`` → ``parallel_tool_calls: false``.
- ``max_tokens`` passes on; ``stop_sequences`` → ``stop``;
  ``output_config.format`` (``json_schema``) → ``response_format`` (``json_schema`` named ``output``).
- Accepted and ignored: ``model`` (the session's backend serves its own model); ``metadata``,
  ``service_tier``, ``speed``, ``inference_geo``, ``diagnostics``, ``user_profile_id``, ``workspace_id``
  (accounting and routing of Anthropic's service); ``cache_control`` (top level and on blocks: nothing is
  cached per client); ``thinking`` and ``output_config.effort`` (the chat template decides whether the model
  reasons; there is no budget to enforce). ``temperature``, ``top_p`` and ``top_k``, which older clients
  send, pass on.

Answer rules (:func:`to_message`): the text (if any) → one ``text`` block, then one ``tool_use`` block per
tool call (``input`` = the parsed arguments, ``id`` = the call's id); no text and no call → one empty text
block. ``stop_reason``: ``tool_calls`` → ``tool_use``, ``length`` → ``max_tokens``, ``stop`` →
``stop_sequence`` when the choice names the matched string in ``stop_reason`` (vLLM's field, which the
session's chat answers carry), else ``end_turn``. ``usage``: ``input_tokens`` = prompt tokens,
``output_tokens`` = generated tokens.

Streaming (:func:`stream_events`, :func:`sse`): the turn is generated whole, so its events come together:
``message_start``, per block ``content_block_start`` / ``content_block_delta`` (``text_delta`` or
``input_json_delta``) / ``content_block_stop``, ``message_delta`` (stop reason, usage), ``message_stop``.

Errors: :class:`AnthropicError` (a :class:`~prorl_server.gateway.protocol.GatewayError`), answered as
``{"type": "error", "error": {"type", "message"}}``; :func:`from_gateway_error` converts the gateway's
OpenAI-format errors.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from prorl_server.gateway.protocol import GatewayError
from sandbox.bounded_json import decode

#: Fields accepted and not translated (see the module docstring).
_IGNORED = ("model", "metadata", "service_tier", "cache_control", "thinking", "speed", "inference_geo", "diagnostics",
            "user_profile_id", "workspace_id")
_KNOWN = frozenset({"max_tokens", "messages", "system", "stop_sequences", "stream", "temperature", "top_p",
                    "top_k", "tools", "tool_choice", "output_config", *_IGNORED})
_BILLING_HEADER = "x-anthropic-billing-header"
#: Anthropic error ``type`` by HTTP status (Anthropic API reference, "Errors").
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error"}


class AnthropicError(GatewayError):
    """A gateway error answered in the Anthropic format ``{"type": "error", "error": {"type", "message"}}``
    with HTTP ``status``; ``type`` defaults to the Anthropic type of that status (``invalid_request_error``
    for 400)."""

    def __init__(self, status: int, message: str, type_: Optional[str] = None) -> None:
        kind = type_ or _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        super().__init__(status, message, kind, type_=kind)

    def body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": self.type, "message": self.message}}


def from_gateway_error(e: GatewayError) -> AnthropicError:
    """The Anthropic form of a gateway error: same status, the Anthropic error type of that status, the message
    with the gateway's error code appended (an :class:`AnthropicError` is returned as it is)."""
    if isinstance(e, AnthropicError):
        return e
    return AnthropicError(e.status, f"{e.message} ({e.code})" if e.code else e.message)


def _bad(where: str, message: str) -> AnthropicError:
    return AnthropicError(400, f"{where}: {message}")


# ------------------------------------------------------------------------------------------ request


@dataclass
class MessagesRequest:
    """A translated ``/v1/messages`` body: ``chat`` is the Chat Completions body for the gateway (without
    ``stream``: the answer is translated back whole); ``stream`` whether the client asked for events."""

    chat: dict[str, Any]
    stream: bool = False
    stop_sequences: list[str] = field(default_factory=list)


def _text_of(blocks: Any, where: str, *, drop_billing: bool = False) -> str:
    """A string, or text blocks concatenated; anything else refused."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise _bad(where, "must be a string or a list of text blocks")
    parts = []
    for k, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise _bad(f"{where}.{k}", f"only text blocks are supported here, got {kind!r}")
        if drop_billing and b["text"].startswith(_BILLING_HEADER):
            continue
        parts.append(b["text"])
    return "".join(parts)


def _tool_result(b: dict[str, Any], where: str) -> dict[str, Any]:
    tid = b.get("tool_use_id")
    if not isinstance(tid, str) or not tid:
        raise _bad(f"{where}.tool_use_id", "must be a non-empty string")
    content = b.get("content", "")
    text = _text_of(content, f"{where}.content") if content is not None else ""
    is_error = b.get("is_error", False)
    if not isinstance(is_error, bool):
        raise _bad(f"{where}.is_error", "must be a boolean")
    return {"role": "tool", "tool_call_id": tid, "content": f"Error: {text}" if is_error else text}


def _convert_message(m: Any, i: int) -> list[dict[str, Any]]:
    """One Anthropic message → one or more chat messages (a user turn with tool results splits)."""
    where = f"messages.{i}"
    if not isinstance(m, dict):
        raise _bad(where, "must be an object")
    role = m.get("role")
    if role not in ("user", "assistant", "system"):
        raise _bad(f"{where}.role", f"must be 'user', 'assistant' or 'system', got {role!r}")
    content = m.get("content")
    if role == "system":
        return [{"role": "system", "content": _text_of(content, f"{where}.content", drop_billing=True)}]
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}.content", "must be a string or a list of content blocks")
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []

    def flush_user_text() -> None:
        if texts:
            out.append({"role": "user", "content": "".join(texts)})
            texts.clear()

    for k, b in enumerate(content):
        bw = f"{where}.content.{k}"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            if not isinstance(b.get("text"), str):
                raise _bad(f"{bw}.text", "must be a string")
            texts.append(b["text"])
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue
        elif kind == "tool_use" and role == "assistant":
            name, args, cid = b.get("name"), b.get("input", {}), b.get("id")
            if not isinstance(name, str) or not isinstance(args, dict) or not isinstance(cid, str):
                raise _bad(bw, "a tool_use block needs id (string), name (string) and input (object)")
            calls.append({"id": cid, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            flush_user_text()
            out.append(_tool_result(b, bw))
        elif kind in ("image", "document"):
            raise _bad(bw, f"{kind} blocks are not supported: the gateway serves a text-only model")
        else:
            raise _bad(bw, f"{'an' if role == 'assistant' else 'a'} {role} message cannot carry a {kind!r} "
                       "block here (supported: text, "
                       + ("tool_use, thinking)" if role == "assistant" else "tool_result)"))
    if role == "user":
        flush_user_text()
        if not out:
            out.append({"role": "user", "content": ""})
        return out
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    return [msg]


def _convert_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise _bad("tools", "must be a list")
    out = []
    for k, t in enumerate(tools):
        if not isinstance(t, dict):
            raise _bad(f"tools.{k}", "must be an object")
        if t.get("type") not in (None, "custom"):
            raise _bad(f"tools.{k}.type", f"server tool {t.get('type')!r} is not supported: only custom tools "
                       "(name, description, input_schema)")
        name, schema = t.get("name"), t.get("input_schema")
        if not isinstance(name, str) or not name:
            raise _bad(f"tools.{k}.name", "must be a non-empty string")
        if not isinstance(schema, dict):
            raise _bad(f"tools.{k}.input_schema", "must be a JSON schema object")
        fn: dict[str, Any] = {"name": name}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        fn["parameters"] = schema
        out.append({"type": "function", "function": fn})
    return out


def _convert_tool_choice(choice: Any, chat: dict[str, Any]) -> None:
    if not isinstance(choice, dict):
        raise _bad("tool_choice", "must be an object {type: auto | any | tool | none}")
    kind = choice.get("type")
    if kind == "auto":
        chat["tool_choice"] = "auto"
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "none":
        chat["tool_choice"] = "none"
    elif kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise _bad("tool_choice.name", "must be a string")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise _bad("tool_choice.type", f"must be 'auto', 'any', 'tool' or 'none', got {kind!r}")
    if choice.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False


def _convert_output_config(config: Any, chat: dict[str, Any]) -> None:
    if not isinstance(config, dict):
        raise _bad("output_config", "must be an object {effort?, format?}")
    fmt = config.get("format")
    if fmt is None:
        return
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise _bad("output_config.format", "must be {type: json_schema, schema: object}")
    chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def to_chat_request(body: Any) -> MessagesRequest:
    """Translate an Anthropic Messages request body into the gateway's Chat Completions body (rules in the
    module docstring). Only the shape needed to translate is checked here; the gateway validates the rest.

    Raises:
        AnthropicError: 400 ``invalid_request_error`` naming the field (e.g. ``messages.2.content.0``).
    """
    if not isinstance(body, dict):
        raise AnthropicError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise AnthropicError(400, f"unsupported field(s): {', '.join(unknown)}")
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise _bad("max_tokens", "a positive integer is required")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "a non-empty list is required")
    messages: list[dict[str, Any]] = []
    if body.get("system") is not None:
        system = _text_of(body["system"], "system", drop_billing=True)
        if system:
            messages.append({"role": "system", "content": system})
    for i, m in enumerate(msgs):
        messages.extend(_convert_message(m, i))
    chat: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens}
    for k in ("temperature", "top_p", "top_k"):
        if body.get(k) is not None:
            chat[k] = body[k]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise _bad("stop_sequences", "must be a list of strings")
        if stops:
            chat["stop"] = stops
    if body.get("tools"):
        chat["tools"] = _convert_tools(body["tools"])
    if body.get("tool_choice") is not None:
        _convert_tool_choice(body["tool_choice"], chat)
    if body.get("output_config") is not None:
        _convert_output_config(body["output_config"], chat)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream", "must be a boolean")
    return MessagesRequest(chat=chat, stream=stream, stop_sequences=list(stops or ()))


# ------------------------------------------------------------------------------------------ answer

_STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}


def to_message(answer: dict[str, Any], stop_sequences: Optional[list[str]] = None) -> dict[str, Any]:
    """Translate the gateway's ``chat.completion`` answer into an Anthropic ``Message`` dict.

    Args:
        answer: ``{"id", "model", "choices": [{"message": {"content", "tool_calls"?}, "finish_reason",
            "stop_reason"?}], "usage": {"prompt_tokens", "completion_tokens"}}``.
        stop_sequences: the request's; a ``stop_reason`` string among them makes ``stop_sequence``.

    Returns:
        ``{"id": "msg_…", "type": "message", "role": "assistant", "model", "content": [blocks],
        "stop_reason", "stop_sequence", "usage": {"input_tokens", "output_tokens"}}``.

    Raises:
        AnthropicError: 500 ``api_error`` for a tool call whose arguments are not a JSON object.
    """
    choice = answer["choices"][0]
    msg = choice["message"]
    content: list[dict[str, Any]] = []
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or ():
        args = call["function"]["arguments"]
        args = decode(args) if isinstance(args, str) else args  # the gateway's own JSON of bounded arguments
        if not isinstance(args, dict):
            raise AnthropicError(500, f"tool call {call['function']['name']!r} has arguments that are not a JSON "
                                 "object")
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": args})
    if not content:
        content.append({"type": "text", "text": ""})
    finish = choice.get("finish_reason") or "stop"
    stop_reason, stop_sequence = _STOP_REASONS.get(finish, "end_turn"), None
    matched = choice.get("stop_reason")
    if finish == "stop" and isinstance(matched, str) and matched in (stop_sequences or ()):
        stop_reason, stop_sequence = "stop_sequence", matched
    rid = str(answer["id"])
    usage = answer.get("usage") or {}
    return {"id": "msg_" + rid.removeprefix("chatcmpl-"), "type": "message", "role": "assistant",
            "model": answer["model"], "content": content, "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": {"input_tokens": usage.get("prompt_tokens", 0),
                      "output_tokens": usage.get("completion_tokens", 0)}}


def from_chat_completion(answer: dict[str, Any], req: MessagesRequest) -> dict[str, Any]:
    """:func:`to_message` with the request's stop sequences (the signature both translated APIs share)."""
    return to_message(answer, req.stop_sequences)


def stream_events(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A whole ``Message`` (from :func:`to_message`) as Anthropic streaming events, in order:
    ``message_start`` (empty content, no stop reason, ``output_tokens`` 0), per content block
    ``content_block_start`` (a text block with ``""`` or a tool_use block with ``input: {}``),
    ``content_block_delta`` (all its text as one ``text_delta`` / its input as one ``input_json_delta``),
    ``content_block_stop``; then ``message_delta`` (``stop_reason``, ``stop_sequence``, ``usage``) and
    ``message_stop``."""
    usage = message["usage"]
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": usage["input_tokens"], "output_tokens": 0}}
    out: list[dict[str, Any]] = [{"type": "message_start", "message": start}]
    for k, block in enumerate(message["content"]):
        if block["type"] == "text":
            first, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:
            first = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
        out.append({"type": "content_block_start", "index": k, "content_block": first})
        if block != {"type": "text", "text": ""}:  # an empty text block has no delta
            out.append({"type": "content_block_delta", "index": k, "delta": delta})
        out.append({"type": "content_block_stop", "index": k})
    out.append({"type": "message_delta",
                "delta": {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]},
                "usage": {"output_tokens": usage["output_tokens"]}})
    out.append({"type": "message_stop"})
    return out


def sse(events: list[dict[str, Any]]) -> bytes:
    """Events in the server-sent-events form Anthropic's SDKs read: ``event: <type>`` then ``data: <json>``."""
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False)}\n\n" for e in events).encode()
