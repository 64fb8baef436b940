"""The OpenAI Responses API on a gateway session, by translation at the edges.

A harness built on the Responses API (``POST /v1/responses``, e.g. Codex-style agents) is served by the same
session machinery as Chat Completions: its request is translated into the Chat Completions body the gateway
accepts (one tokenization authority, one trajectory store), and the gateway's ``chat.completion`` answer is
translated back into a ``Response`` object (or its stream of events). Served at
``POST {base_url}/responses`` of the session (an OpenAI SDK's ``responses.create`` on the session's
``base_url``).

Request rules (:func:`to_chat_request`):

- ``instructions`` → a leading system message. ``input``: a string → one user message; a list of items:
  ``message`` items (``type`` optional; roles ``user`` / ``system`` / ``developer`` / ``assistant``; content a
  string or ``input_text`` / ``output_text`` / ``refusal`` parts, concatenated) → chat messages;
  ``function_call`` items → ``tool_calls`` of the assistant message right before them (or of a new, empty
  one); ``function_call_output`` items → ``tool`` messages (``tool_call_id`` = ``call_id``; ``output`` a
  string or text parts, concatenated). ``reasoning`` items are dropped (the gateway never answers with them:
  a model's reasoning, if any, is part of its text). Images, files, item references and hosted-tool items
  are refused.
- ``tools``: function tools only → Chat Completions function tools; ``tool_choice`` ``auto`` / ``none`` /
  ``required`` / ``{"type": "function", "name"}`` → the same in Chat Completions form (the gateway itself
  decides which of these it serves; it answers the others with a 400).
- ``max_output_tokens`` → ``max_tokens``; ``temperature``, ``top_p``, ``top_logprobs``,
  ``parallel_tool_calls`` pass on; ``text.format`` ``json_schema`` / ``json_object`` → ``response_format``.
- ``previous_response_id``, ``conversation``, ``prompt`` and ``background: true`` are refused (400): the
  gateway stores no responses, so the client sends the whole conversation in ``input`` every time (as with
  ``store: false``); the session's prefix check then records only the new tokens.
- Accepted and ignored: ``model`` (the session's backend serves its own model), ``store``, ``metadata``
  (echoed), ``include``, ``reasoning`` (echoed; the chat template decides whether the model reasons),
  ``truncation`` (nothing is ever truncated: an overlong conversation is a 400), ``user``,
  ``safety_identifier``, ``prompt_cache_key``, ``prompt_cache_retention``, ``service_tier``,
  ``max_tool_calls``, ``stream_options``.

Answer rules (:func:`to_response`): the text (if any) → one ``message`` output item with one ``output_text``
part, then one ``function_call`` item per tool call (``call_id`` = the call's id, ``arguments`` a JSON
string); no text and no call → one message with empty text. ``status``: ``incomplete``
(``incomplete_details.reason = "max_output_tokens"``) when generation hit the token limit, else
``completed``. ``usage``: ``input_tokens`` = prompt tokens, ``output_tokens`` = generated tokens.

Streaming (:func:`stream_events`, :func:`sse`): the turn is generated whole, so its events come together, with
``sequence_number`` counting from 0: ``response.created``, ``response.in_progress``, per output item
``response.output_item.added``, (message) ``response.content_part.added`` / ``response.output_text.delta`` /
``response.output_text.done`` / ``response.content_part.done``, (function call)
``response.function_call_arguments.delta`` / ``.done``, ``response.output_item.done``; then
``response.completed`` (or ``response.incomplete``).

Errors are the gateway's OpenAI-format :class:`GatewayError` (``{"error": {message, type, param, code}}``).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from prorl_server.gateway.protocol import GatewayError, check_body

_IGNORED = ("model", "store", "include", "truncation", "user", "safety_identifier", "prompt_cache_key",
            "prompt_cache_retention", "service_tier", "max_tool_calls", "stream_options", "metadata", "reasoning")
_REFUSED = {
    "previous_response_id": "previous_response_id is not supported: the gateway stores no responses; send the "
                            "whole conversation in input (as with store=false)",
    "conversation": "conversation is not supported: the gateway stores no conversations; send the whole "
                    "conversation in input",
    "prompt": "prompt (a stored prompt template) is not supported: send instructions and input",
}
_KNOWN = frozenset({"input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature", "top_p",
                    "top_logprobs", "parallel_tool_calls", "text", "stream", "background", *_IGNORED, *_REFUSED})
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}


def _bad(param: str, message: str, code: str = "invalid_parameter") -> GatewayError:
    return GatewayError(400, f"{param}: {message}", code, param)


@dataclass
class ResponsesRequest:
    """A translated ``/v1/responses`` body: ``chat`` is the Chat Completions body for the gateway (without
    ``stream``); ``stream`` whether the client asked for events; ``echo`` the request's settings that a
    ``Response`` object repeats (``instructions``, ``tools``, ``tool_choice``, ``temperature``, ``top_p``,
    ``max_output_tokens``, ``metadata``, ``parallel_tool_calls``, ``text``, ``reasoning``)."""

    chat: dict[str, Any]
    stream: bool = False
    echo: dict[str, Any] = field(default_factory=dict)


def _text(content: Any, where: str) -> str:
    """A string, or text parts concatenated; anything else refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, "must be a string or a list of text parts", "invalid_input")
    parts = []
    for k, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else type(p).__name__
        key = _TEXT_PARTS.get(kind) if isinstance(p, dict) else None
        if key is None or not isinstance(p.get(key), str):
            raise _bad(f"{where}[{k}]", f"only text parts (input_text, output_text, refusal) are supported, got "
                       f"{kind!r}" + (": the gateway serves a text-only model" if kind in
                                      ("input_image", "input_file", "input_audio") else ""), "invalid_input")
        parts.append(p[key])
    return "".join(parts)


def _convert_input(items: Any) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _bad("input", "must be a string or a non-empty list of items", "invalid_input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(where, "must be an object", "invalid_input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{where}.role", f"must be user, system, developer or assistant, got {role!r}",
                           "invalid_input")
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            name, args, cid = item.get("name"), item.get("arguments"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(args, str) or not isinstance(cid, str):
                raise _bad(where, "a function_call item needs call_id, name and arguments (strings)",
                           "invalid_input")
            call = {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            cid = item.get("call_id")
            if not isinstance(cid, str) or not cid:
                raise _bad(f"{where}.call_id", "must be a non-empty string", "invalid_input")
            out.append({"role": "tool", "tool_call_id": cid, "content": _text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            continue
        elif kind == "item_reference":
            raise _bad(where, "item_reference is not supported: the gateway stores no items; send them in full",
                       "invalid_input")
        else:
            raise _bad(f"{where}.type", f"input items of type {kind!r} are not supported (message, function_call, "
                       "function_call_output, reasoning)", "invalid_input")
    return out


def _convert_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise _bad("tools", "must be a list")
    out = []
    for k, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise _bad(f"tools[{k}]", f"only function tools are supported, got {kind!r}")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise _bad(f"tools[{k}].name", "must be a non-empty string")
        fn: dict[str, Any] = {"name": t["name"]}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        if t.get("parameters") is not None:
            fn["parameters"] = t["parameters"]
        out.append({"type": "function", "function": fn})
    return out


def _convert_tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("tool_choice", 'must be "auto", "none", "required" or {"type": "function", "name"}')


def _convert_text(text: Any) -> Optional[dict[str, Any]]:
    """``text.format`` → a Chat Completions ``response_format`` (None for plain text)."""
    if not isinstance(text, dict):
        raise _bad("text", "must be an object {format?, verbosity?}")
    fmt = text.get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema"), dict):
            raise _bad("text.format", "a json_schema format needs name (string) and schema (object)")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if fmt.get(k) is not None}}
    raise _bad("text.format", "must be {type: text | json_object | json_schema}")


def to_chat_request(body: Any) -> ResponsesRequest:
    """Translate a Responses API request body into the gateway's Chat Completions body (rules in the module
    docstring). Only the shape needed to translate is checked here; the gateway validates the rest.

    Raises:
        GatewayError: 400 ``invalid_input`` (naming the item, e.g. ``input[3].content[0]``),
            ``unsupported_parameter`` or ``invalid_parameter``.
    """
    check_body(body, _KNOWN)
    for k, why in _REFUSED.items():
        if body.get(k) is not None:
            raise GatewayError(400, why, "unsupported_parameter", k)
    if body.get("background"):
        raise GatewayError(400, "background responses are not supported: the gateway answers in the request",
                           "unsupported_parameter", "background")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad("instructions", "must be a string")
        messages.append({"role": "system", "content": instructions})
    if "input" not in body:
        raise _bad("input", "is required", "invalid_input")
    messages.extend(_convert_input(body["input"]))
    chat: dict[str, Any] = {"messages": messages}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for k in ("temperature", "top_p", "top_logprobs", "parallel_tool_calls"):
        if body.get(k) is not None:
            chat[k] = body[k]
    if body.get("tools"):
        chat["tools"] = _convert_tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _convert_tool_choice(body["tool_choice"])
    if body.get("text") is not None:
        fmt = _convert_text(body["text"])
        if fmt is not None:
            chat["response_format"] = fmt
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise _bad("stream", "must be a boolean")
    echo = {"instructions": instructions, "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice") or "auto", "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata") or {}, "reasoning": body.get("reasoning"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
            "text": body.get("text") or {"format": {"type": "text"}}}
    return ResponsesRequest(chat=chat, stream=stream, echo=echo)


# ------------------------------------------------------------------------------------------ answer


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def to_response(answer: dict[str, Any], echo: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Translate the gateway's ``chat.completion`` answer into a Responses API ``Response`` dict.

    Args:
        answer: ``{"id", "created", "model", "choices": [{"message": {"content", "tool_calls"?},
            "finish_reason"}], "usage": {"prompt_tokens", "completion_tokens", "total_tokens"}}``.
        echo: :attr:`ResponsesRequest.echo` (the request's settings the ``Response`` repeats).

    Returns:
        ``{"id": "resp_…", "object": "response", "created_at", "model", "status", "output": [items],
        "usage": {...}, "incomplete_details", ...echo}``.
    """
    choice = answer["choices"][0]
    msg = choice["message"]
    calls = msg.get("tool_calls") or []
    output: list[dict[str, Any]] = []
    if msg.get("content") or not calls:
        output.append({"id": _item_id("msg"), "type": "message", "role": "assistant", "status": "completed",
                       "content": [{"type": "output_text", "text": msg.get("content") or "", "annotations": []}]})
    for call in calls:
        args = call["function"]["arguments"]
        output.append({"id": _item_id("fc"), "type": "function_call", "call_id": call["id"],
                       "name": call["function"]["name"],
                       "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
                       "status": "completed"})
    incomplete = choice.get("finish_reason") == "length"
    usage = answer.get("usage") or {}
    inp, outp = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {"id": "resp_" + str(answer["id"]).removeprefix("chatcmpl-"), "object": "response",
            "created_at": answer["created"], "model": answer["model"],
            "status": "incomplete" if incomplete else "completed", "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": output, "previous_response_id": None,
            **{"instructions": None, "tools": [], "tool_choice": "auto", "parallel_tool_calls": True,
               "metadata": {}, "text": {"format": {"type": "text"}}, **(echo or {})},
            "usage": {"input_tokens": inp, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                      "output_tokens": outp,
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": usage.get("total_tokens", inp + outp)}}


def from_chat_completion(answer: dict[str, Any], req: ResponsesRequest) -> dict[str, Any]:
    """:func:`to_response` echoing the request's settings (the signature both translated APIs share)."""
    return to_response(answer, req.echo)


def stream_events(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A whole ``Response`` (from :func:`to_response`) as Responses streaming events, ``sequence_number``
    0, 1, ... (order in the module docstring). The created / in-progress snapshots have ``status:
    "in_progress"``, no output and no usage; the last event carries the response as answered."""
    events: list[dict[str, Any]] = []

    def emit(kind: str, **fields: Any) -> None:
        events.append({"type": kind, "sequence_number": len(events), **fields})

    pending = {**response, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    emit("response.created", response=pending)
    emit("response.in_progress", response=pending)
    for k, item in enumerate(response["output"]):
        if item["type"] == "message":
            emit("response.output_item.added", output_index=k, item={**item, "status": "in_progress", "content": []})
            for c, part in enumerate(item["content"]):
                ids = {"item_id": item["id"], "output_index": k, "content_index": c}
                emit("response.content_part.added", **ids, part={**part, "text": ""})
                if part["text"]:
                    emit("response.output_text.delta", **ids, delta=part["text"], logprobs=[])
                emit("response.output_text.done", **ids, text=part["text"], logprobs=[])
                emit("response.content_part.done", **ids, part=part)
        else:
            emit("response.output_item.added", output_index=k,
                 item={**item, "status": "in_progress", "arguments": ""})
            ids = {"item_id": item["id"], "output_index": k}
            emit("response.function_call_arguments.delta", **ids, delta=item["arguments"])
            emit("response.function_call_arguments.done", **ids, arguments=item["arguments"])
        emit("response.output_item.done", output_index=k, item=item)
    emit("response.incomplete" if response["status"] == "incomplete" else "response.completed", response=response)
    return events


def sse(events: list[dict[str, Any]]) -> bytes:
    """Events in the server-sent-events form of the Responses API: ``event: <type>`` then ``data: <json>``."""
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False)}\n\n" for e in events).encode()
