"""Tool-call parsers: turn one generated assistant text into tool calls (the raw tokens are kept as generated).

A parser implements :class:`ToolParser` (``parse(text) -> ParsedTurn``). Malformed calls do not raise: they
come back in ``ParsedTurn.errors`` so the agent loop can answer them with an error observation and count
them. Parsers register by name in :data:`PARSERS` (``get_parser("hermes")``).

The hermes format (NousResearch Hermes-2-Pro; also Qwen2.5/Qwen3's chat templates)::

    <tool_call>
    {"name": "<function-name>", "arguments": {<args-json-object>}}
    </tool_call>

any number of times per turn, with free text before, between and after the calls.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable


@dataclass
class ToolCall:
    """One well-formed call. ``arguments`` is a JSON object; ``raw`` is the text it was parsed from."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:12]}")
    raw: str = ""

    def to_openai(self) -> dict[str, Any]:
        """As an OpenAI Chat Completions ``tool_calls`` entry (arguments JSON-encoded)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


@dataclass
class ToolCallError:
    """A call the model attempted but that could not be parsed. ``message`` is shown to the model."""

    raw: str
    message: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:12]}")


@dataclass
class ParsedTurn:
    """What one assistant turn asked for.

    ``content``: the text outside tool-call blocks (stripped). ``calls``: well-formed calls in order.
    ``errors``: malformed attempts in order. ``items``: calls and errors together, in text order (the order
    the agent loop answers them in). ``raw``: the full text as generated.
    """

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[ToolCallError] = field(default_factory=list)
    raw: str = ""
    items: list["ToolCall | ToolCallError"] = field(default_factory=list)

    @property
    def attempted(self) -> bool:
        """True if the model tried to call a tool at all (well-formed or not)."""
        return bool(self.calls or self.errors)


@runtime_checkable
class ToolParser(Protocol):
    """Parses one assistant turn's text. Must never raise on model output."""

    name: str

    def parse(self, text: str) -> ParsedTurn: ...


def _coerce_call(obj: Any) -> tuple[str, dict[str, Any]]:
    """``{"name": str, "arguments": dict | JSON-string-of-dict}`` -> (name, arguments); ValueError if not."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError('missing "name" (a non-empty string)')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models double-encode the arguments
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f'"arguments" is a string that is not JSON: {e.msg}') from None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ValueError(f'"arguments" must be a JSON object, got {type(args).__name__}')
    return name, args


class HermesToolParser:
    """``<tool_call>{json}</tool_call>`` blocks (see the module docstring).

    Errors reported: invalid JSON, a JSON value that is not ``{"name", "arguments"}``, a ``<tool_call>``
    without its closing tag (e.g. the turn was cut by ``max_tokens``), a stray ``</tool_call>``.
    """

    name = "hermes"
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def __init__(self) -> None:
        self._block = re.compile(re.escape(self.open_tag) + r"(.*?)" + re.escape(self.close_tag), re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        calls: list[ToolCall] = []
        errors: list[ToolCallError] = []
        items: list[ToolCall | ToolCallError] = []
        outside: list[str] = []
        pos = 0
        for m in self._block.finditer(text):
            outside.append(text[pos:m.start()])
            pos = m.end()
            body = m.group(1).strip()
            raw = m.group(0)
            if self.open_tag in body:  # "<tool_call><tool_call>{...}</tool_call>": an unclosed first block
                errors.append(ToolCallError(raw=raw, message="nested <tool_call> (a previous one was not closed)"))
                items.append(errors[-1])
                body = body[body.rindex(self.open_tag) + len(self.open_tag):].strip()
            try:
                obj = json.loads(body)
                name, args = _coerce_call(obj)
            except json.JSONDecodeError as e:
                errors.append(ToolCallError(raw=raw, message=f"tool call is not valid JSON: {e.msg} "
                                                             f"(line {e.lineno} column {e.colno})"))
                items.append(errors[-1])
                continue
            except ValueError as e:
                errors.append(ToolCallError(raw=raw, message=f"malformed tool call: {e}"))
                items.append(errors[-1])
                continue
            calls.append(ToolCall(name=name, arguments=args, raw=raw))
            items.append(calls[-1])
        tail = text[pos:]
        if self.open_tag in tail:
            i = tail.index(self.open_tag)
            errors.append(ToolCallError(raw=tail[i:], message="unterminated <tool_call> (no </tool_call>)"))
            items.append(errors[-1])
            tail = tail[:i]
        outside.append(tail)
        for k, piece in enumerate(outside):
            if self.close_tag in piece:
                errors.append(ToolCallError(raw=self.close_tag, message="</tool_call> without <tool_call>"))
                items.append(errors[-1])
                outside[k] = piece.replace(self.close_tag, "")
        return ParsedTurn(content="".join(outside).strip(), calls=calls, errors=errors, raw=text, items=items)


PARSERS: dict[str, Callable[[], ToolParser]] = {"hermes": HermesToolParser}


def get_parser(parser: "str | ToolParser") -> ToolParser:
    """A parser instance by registered name (or the instance itself).

    Raises:
        KeyError: unknown name (the message lists the registered ones).
    """
    if not isinstance(parser, str):
        return parser
    try:
        return PARSERS[parser]()
    except KeyError:
        raise KeyError(f"unknown tool parser {parser!r}; registered: {sorted(PARSERS)}") from None
