"""The OpenAI Chat Completions wire of the gateway: request validation and normalisation, the answer and its
stream chunks, and the OpenAI error format.

Everything here is pure (no session state, no I/O): :mod:`prorl_server.gateway.sessions` decides what a
request means for a session, :mod:`prorl_server.gateway.routes` carries it over HTTP. References: the OpenAI
API reference, "Create chat completion" and "The chat completion chunk object".
"""
from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from prorl_server.llm.tool_parser import ARGUMENTS_BOUNDS, ParsedTurn
from prorl_server.types import MAX_SAMPLING_ENTRIES, MAX_TOKEN_ID
from sandbox.bounded_json import SCAN_CHUNK_BYTES, JsonBoundError, JsonBounds, aloads, loads

#: Sampling parameters passed on to vLLM as given (OpenAI names; vLLM extensions top_k, min_p,
#: repetition_penalty, min_tokens).
_PASSED = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
           "repetition_penalty", "min_tokens")
#: Accepted and ignored: they change nothing the gateway records.
_IGNORED = ("model", "user", "metadata", "store", "parallel_tool_calls", "service_tier")
_KNOWN = frozenset({"messages", "tools", "tool_choice", "max_tokens", "max_completion_tokens", "stop", "n",
                    "stream", "stream_options", "logprobs", "top_logprobs", "response_format", "logit_bias",
                    "reasoning_effort", "chat_template_kwargs", *_PASSED, *_IGNORED})
#: Most choices one request may ask for (``n``), and most alternatives per token (``top_logprobs``, OpenAI's
#: limit).
MAX_N = 16
MAX_TOP_LOGPROBS = 20
#: Most tools one request may offer (OpenAI's limit: 128 functions).
MAX_TOOLS = 128
#: Bounds of a gateway request body (``sandbox.bounded_json``): 2 MiB, some 500k tokens of text, more than
#: the context of the models served here, decoded in at most ~7.5 ms on the event loop (strings dense in
#: escapes, ~3.6 ms per MB; plain text ~1 ms per MB); 32768 items (arrays, objects, strings, commas), a few
#: thousand messages with tool calls, ~4 ms at the worst (integers past int64). Tool-call arguments inside
#: it, JSON text in a string, are decoded within :data:`~prorl_server.llm.tool_parser.ARGUMENTS_BOUNDS` each.
BODY_BOUNDS = JsonBounds(max_bytes=2 << 20, max_items=1 << 15)
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
#: Tool-call formats a forced tool call (``tool_choice`` ``"required"`` or named) can be constrained to, by
#: parser name: the text before the call's JSON object, the key of its arguments, the text after it. The
#: object is ``{"name": <tool>, "<arguments key>": <the tool's parameters schema>}``, the family's template
#: form (hermes: Qwen2.5/Qwen3, NousHermes, ``<tool_call>\n{...}\n</tool_call>``).
CONSTRAINED_TOOL_FORMATS: dict[str, tuple[str, str, str]] = {
    "hermes": ("<tool_call>\n", "arguments", "\n</tool_call>"),
}
#: Most consecutive whitespace characters between the tokens of constrained JSON (a response format, a forced
#: tool call's object): room for pretty-printing, but a weak policy cannot spend its whole budget on
#: whitespace, which vLLM's plain ``json`` constraint lets it do.
JSON_MAX_WHITESPACE = 16


def _structural_tag(fmt: dict[str, Any]) -> dict[str, Any]:
    """vLLM ``structured_outputs`` holding an xgrammar structural tag whose ``format`` is ``fmt``."""
    return {"structural_tag": json.dumps({"type": "structural_tag", "format": fmt})}


def _json_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": JSON_MAX_WHITESPACE}


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


def json_error(e: JsonBoundError, what: str, code: str = "", param: Optional[str] = None) -> GatewayError:
    """The answer to JSON refused by its bounds (``what`` names it in the message): 413 ``request_too_large``
    for its size, else 400 with ``code`` (default ``invalid_json`` for invalid JSON, ``json_too_complex`` for
    too many items, too deep a nesting or too long a number)."""
    if e.reason == "too_large":
        return GatewayError(413, f"{what} {e}", "request_too_large", param)
    return GatewayError(400, f"{what} {e}", code or ("invalid_json" if e.reason == "invalid" else "json_too_complex"),
                        param)


async def decode_arguments(body: Any) -> None:
    """Decode, in place, the JSON-string ``arguments`` of the tool calls in ``body["messages"]`` (a Chat
    Completions body), each within :data:`~prorl_server.llm.tool_parser.ARGUMENTS_BOUNDS` and yielding to the
    event loop between them every :data:`~sandbox.bounded_json.SCAN_CHUNK_BYTES`, so that
    :func:`normalize_message`, which decodes the strings it still finds on the calling thread, has only
    decoded values left. Anything not of that shape is left for :func:`parse_chat_request` to refuse.

    Raises:
        GatewayError: 400 ``invalid_messages`` (413 ``request_too_large``) naming the arguments' field.
    """
    msgs = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(msgs, list):
        return
    since_yield = 0
    for i, m in enumerate(msgs):
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        for k, c in enumerate(calls if isinstance(calls, list) else ()):
            fn = c.get("function") if isinstance(c, dict) else None
            args = fn.get("arguments") if isinstance(fn, dict) else None
            if not isinstance(args, str) or not args.strip():
                continue
            where = f"messages[{i}].tool_calls[{k}].function.arguments"
            try:
                fn["arguments"] = await aloads(args, ARGUMENTS_BOUNDS)
            except JsonBoundError as e:
                raise json_error(e, where, "invalid_messages", where) from None
            since_yield += len(args)
            if since_yield > SCAN_CHUNK_BYTES:
                since_yield = 0
                await asyncio.sleep(0)


# ------------------------------------------------------------------------------------------ request


def normalize_message(m: Any, i: int) -> dict[str, Any]:
    """One OpenAI chat message in the canonical form used for prefix comparison and rendering.

    ``content``: a string (None → ``""``; a list of text parts joined; whitespace kept). ``tool_calls``:
    ``[{"id"?, "type": "function", "function": {"name", "arguments": <parsed JSON object>}}]`` (arguments
    given as a JSON string are decoded within :data:`~prorl_server.llm.tool_parser.ARGUMENTS_BOUNDS`). Keys whose
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
                field = f"{where}.tool_calls[{k}].function.arguments"
                try:
                    args = loads(args, ARGUMENTS_BOUNDS) if args.strip() else {}
                except JsonBoundError as e:
                    raise json_error(e, field, "invalid_messages", field) from None
            call = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
            if isinstance(c.get("id"), str):
                call["id"] = c["id"]
            norm.append(call)
        out["tool_calls"] = norm
    return out


@dataclass
class ChatRequest:
    """A validated ``/chat/completions`` body.

    ``sampling``: what is passed to vLLM as given (OpenAI sampling names, ``stop``). ``n``: choices to
    generate (1..:data:`MAX_N`). ``top_logprobs``: alternatives per generated token (0..20; only answered
    with ``logprobs``, which the Responses route does not send: there it changes nothing). ``tool_choice``:
    ``"auto"``, ``"none"`` or ``"required"`` (``tool_name`` set: that tool, named). ``response_format``: the
    structured-output constraint it asks for in vLLM's ``structured_outputs`` form (an xgrammar structural tag: the JSON schema, or ``{"type": "object"}`` for
    ``json_object``, with whitespace runs of at most :data:`JSON_MAX_WHITESPACE`), None for text.
    ``logit_bias``: token id -> bias in [-100, 100], at most :data:`~prorl_server.types.MAX_SAMPLING_ENTRIES`
    ids, each at most :data:`~prorl_server.types.MAX_TOKEN_ID` (and checked against the vocabulary by the
    session, :func:`check_logit_bias`). ``chat_template_kwargs``: extra variables of the chat template render
    (``reasoning_effort`` lands here as ``reasoning_effort``).
    """

    messages: list[dict[str, Any]]
    tools: Optional[list[dict[str, Any]]]
    parse_tools: bool
    max_tokens: Optional[int]
    sampling: dict[str, Any]
    stream: bool
    logprobs: bool
    include_usage: bool = False
    n: int = 1
    top_logprobs: int = 0
    tool_choice: str = "auto"
    tool_name: Optional[str] = None
    response_format: Optional[dict[str, Any]] = None
    logit_bias: Optional[dict[int, float]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None

    def structured_outputs(self, parser: str) -> Optional[dict[str, Any]]:
        """vLLM's ``structured_outputs`` for this request with tool-call parser ``parser`` (None: free text).

        A forced tool call (``tool_choice`` ``"required"``: one call of any offered tool; named: one call of
        that tool) becomes a ``structural_tag``: the parser's call format (:data:`CONSTRAINED_TOOL_FORMATS`)
        around a JSON object whose ``name`` is the tool's and whose arguments follow the tool's
        ``parameters`` schema; generation ends after the one call.

        Raises:
            GatewayError: 400 ``unsupported_parameter`` (param ``tool_choice``) when ``parser`` is not one of
                :data:`CONSTRAINED_TOOL_FORMATS`.
        """
        if self.tool_choice != "required":
            return self.response_format
        if parser not in CONSTRAINED_TOOL_FORMATS:
            raise GatewayError(400, f"tool_choice 'required' or a named tool needs a tool-call format the gateway "
                               f"can constrain generation to (parsers {sorted(CONSTRAINED_TOOL_FORMATS)}); this "
                               f"server parses {parser!r} calls", "unsupported_parameter", "tool_choice")
        before, args_key, after = CONSTRAINED_TOOL_FORMATS[parser]
        options = []
        for t in self.tools or ():
            fn = t["function"]
            if self.tool_name is not None and fn["name"] != self.tool_name:
                continue
            params = fn.get("parameters") or {"type": "object"}
            options.append({"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: params},
                            "required": ["name", args_key], "additionalProperties": False})
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return _structural_tag({"type": "sequence", "elements": [
            {"type": "const_string", "value": before}, _json_format(schema),
            {"type": "const_string", "value": after}]})


def check_logit_bias(bias: Optional[dict[int, float]], vocab_size: int) -> Optional[dict[str, float]]:
    """``bias`` in vLLM's form (``{"<token id>": bias}``), every id checked to be below ``vocab_size``.

    Raises:
        GatewayError: 400 ``invalid_parameter`` (param ``logit_bias``) naming the first id out of range.
    """
    if not bias:
        return None
    for tid in bias:
        if tid >= vocab_size:
            raise GatewayError(400, f"logit_bias: token id {tid} is not in the model's vocabulary "
                               f"(0..{vocab_size - 1})", "invalid_parameter", "logit_bias")
    return {str(k): v for k, v in bias.items()}


def check_body(body: Any, known: frozenset[str]) -> None:
    """An OpenAI-API request body: a JSON object whose keys are all in ``known``.

    Raises:
        GatewayError: 400 ``invalid_request`` (not an object) or ``unsupported_parameter`` naming the first
            unknown key.
    """
    if not isinstance(body, dict):
        raise GatewayError(400, "the request body must be a JSON object", "invalid_request")
    unknown = sorted(set(body) - known)
    if unknown:
        raise GatewayError(400, f"unsupported parameter(s): {', '.join(unknown)}", "unsupported_parameter",
                           unknown[0])


def _bad(param: str, message: str) -> GatewayError:
    return GatewayError(400, f"{param} {message}", "invalid_parameter", param)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    """A finite float or a signed 64-bit int (what vLLM's sampling parameters are)."""
    if _is_int(v):
        return -2**63 <= v < 2**63
    return isinstance(v, float) and math.isfinite(v)


def _response_format(rf: Any) -> Optional[dict[str, Any]]:
    """``response_format`` as vLLM ``structured_outputs`` (None for text)."""
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return _structural_tag(_json_format({"type": "object"}))
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise _bad("response_format", 'json_schema needs {"json_schema": {"name", "schema": {...}}}')
        return _structural_tag(_json_format(schema))
    raise GatewayError(400, f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
                       "unsupported_parameter", "response_format")


def _tool_choice(choice: Any, tools: Optional[list[dict[str, Any]]]) -> tuple[str, Optional[str]]:
    """(``"auto"`` | ``"none"`` | ``"required"``, the named tool or None)."""
    if choice in (None, "auto", "none"):
        return choice or "auto", None
    names = [t["function"]["name"] for t in tools or ()]
    if choice == "required":
        if not names:
            raise _bad("tool_choice", "'required' needs tools")
        return "required", None
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise _bad("tool_choice", 'must be "auto", "none", "required" or {"type": "function", "function": '
                   '{"name"}}')
    if fn["name"] not in names:
        raise _bad("tool_choice", f"names {fn['name']!r}, which is not among the tools ({names})")
    return "required", fn["name"]


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate a Chat Completions body (OpenAI API reference, "Create chat completion"; vLLM's
    ``chat_template_kwargs`` and sampling extensions).

    Raises:
        GatewayError: 400 ``invalid_messages`` / ``unsupported_parameter`` / ``invalid_parameter``.
    """
    check_body(body, _KNOWN)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise GatewayError(400, "messages must be a non-empty list", "invalid_messages", "messages")
    messages = [normalize_message(m, i) for i, m in enumerate(msgs)]
    if messages[-1]["role"] == "assistant":
        raise GatewayError(400, "the last message is an assistant message: continuing a partial assistant "
                           "turn is not supported", "invalid_messages", f"messages[{len(messages) - 1}]")
    n = body.get("n")
    n = 1 if n is None else n
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise _bad("n", f"must be an integer from 1 to {MAX_N}")
    top = body.get("top_logprobs") or 0
    if not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise _bad("top_logprobs", f"must be an integer from 0 to {MAX_TOP_LOGPROBS}")
    response_format = _response_format(body.get("response_format"))
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(
                isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
                and isinstance(t["function"].get("name"), str) for t in tools):
            raise GatewayError(400, 'tools must be a list of {"type": "function", "function": {"name", ...}}',
                               "invalid_parameter", "tools")
        if len(tools) > MAX_TOOLS:
            raise _bad("tools", f"holds {len(tools)} tools, more than {MAX_TOOLS}")
        tools = tools or None
    choice, tool_name = _tool_choice(body.get("tool_choice"), tools)
    if choice == "required" and response_format is not None:
        raise GatewayError(400, "a forced tool call (tool_choice) and a response_format cannot constrain the "
                           "same answer", "unsupported_parameter", "response_format")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise GatewayError(400, "max_tokens must be a positive integer", "invalid_parameter", "max_tokens")
    sampling = {k: body[k] for k in _PASSED if body.get(k) is not None}
    for k, v in sampling.items():
        if not _is_number(v):
            raise GatewayError(400, f"{k} must be a finite number (integers: 64-bit)", "invalid_parameter", k)
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 4:
            raise GatewayError(400, "stop must be a string or a list of up to 4 strings", "invalid_parameter",
                               "stop")
        sampling["stop"] = stop
    bias = body.get("logit_bias")
    logit_bias: Optional[dict[int, float]] = None
    if bias is not None:
        if not isinstance(bias, dict):
            raise _bad("logit_bias", "must be an object {token id: bias}")
        if len(bias) > MAX_SAMPLING_ENTRIES:
            raise _bad("logit_bias", f"has {len(bias)} entries, more than {MAX_SAMPLING_ENTRIES}")
        logit_bias = {}
        for k, v in bias.items():
            # Every key is range-checked before it becomes an int dict key: ints that differ by multiples of
            # 2**61 - 1 hash alike (a megabyte of them: seconds of quadratic inserts).
            tid = int(k) if isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 10 else None
            if tid is None or tid > MAX_TOKEN_ID or not _is_number(v) or not -100 <= v <= 100:
                raise _bad("logit_bias", f"entry {str(k)[:24]!r}: {str(v)[:24]}: keys are token ids (integers 0.."
                           f"{MAX_TOKEN_ID}), values numbers from -100 to 100")
            logit_bias[tid] = float(v)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs", "must be an object")
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in _EFFORTS:
            raise _bad("reasoning_effort", f"must be one of {list(_EFFORTS)}")
        kwargs = {"reasoning_effort": effort, **(kwargs or {})}
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
                       include_usage=bool((body.get("stream_options") or {}).get("include_usage")),
                       n=n, top_logprobs=top, tool_choice=choice, tool_name=tool_name,
                       response_format=response_format, logit_bias=logit_bias,
                       chat_template_kwargs=kwargs or None)


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


def token_logprobs(tokens: list[str], logprobs: list[float],
                   top: Optional[list[list[tuple[str, float]]]] = None) -> dict[str, Any]:
    """The choice's ``logprobs`` object: one entry per generated token (its text form and logprob) with its
    ``top_logprobs``: ``top[i]``, the ``(token, logprob)`` alternatives at position ``i``, most likely first
    (``[]`` when ``top`` is None)."""
    return {"content": [{"token": t, "logprob": lp, "bytes": None,
                         "top_logprobs": [{"token": a, "logprob": alp, "bytes": None} for a, alp in top[i]]
                         if top is not None else []}
                        for i, (t, lp) in enumerate(zip(tokens, logprobs))]}


def answer_choice(index: int, message: dict[str, Any], finish_reason: str, *,
                  logprobs: Optional[dict[str, Any]] = None, stop_reason: Any = None) -> dict[str, Any]:
    """One ``choices[i]`` of a ``chat.completion``; ``stop_reason``: vLLM's, the stop string or stop token id
    that ended the turn (None: end of sequence or length), as vLLM's own chat answers carry it."""
    return {"index": index, "message": message, "finish_reason": finish_reason, "logprobs": logprobs,
            "stop_reason": stop_reason}


def chat_completion(choices: list[dict[str, Any]], *, model: str, prompt_tokens: int,
                    completion_tokens: int) -> dict[str, Any]:
    """A ``chat.completion`` object with ``choices`` (:func:`answer_choice`); ``usage`` counts tokens
    (``completion_tokens``: of all choices)."""
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def stream_chunks(answer: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """A whole ``chat.completion`` as ``chat.completion.chunk`` objects (OpenAI streaming format), per choice
    in order: the role, the content, one chunk per tool call, the finish reason; then the usage if asked for.
    The turn is generated whole (token-in/token-out), so the chunks come together once it is done."""
    head = {"id": answer["id"], "object": "chat.completion.chunk", "created": answer["created"],
            "model": answer["model"]}
    out = []
    for choice in answer["choices"]:
        msg = choice["message"]

        def chunk(delta: dict[str, Any], finish: Optional[str] = None) -> dict[str, Any]:
            c = {"index": choice["index"], "delta": delta, "finish_reason": finish,
                 "logprobs": choice["logprobs"] if finish else None}
            if finish:
                c["stop_reason"] = choice.get("stop_reason")
            return {**head, "choices": [c]}

        out.append(chunk({"role": "assistant", "content": ""}))
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
