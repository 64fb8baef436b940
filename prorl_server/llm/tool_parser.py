"""Tool-call parsers: turn one generated assistant text into tool calls (the raw tokens are kept as generated).

A parser implements :class:`ToolParser` (``parse(text) -> ParsedTurn``). Malformed calls do not raise: they
come back in ``ParsedTurn.errors`` so the agent loop can answer them with an error observation and count
them. :func:`get_parser` builds one by name; :data:`PARSERS` maps every name to its factory.

Names, per model family (the text must be decoded with the family's marker tokens kept, i.e. without
skipping special tokens):

- Hermes-2-Pro, Qwen2.5, Qwen3: ``hermes`` (the default), ``<tool_call>{"name", "arguments"}</tool_call>``.
- Qwen3-Coder and other Qwen3 XML templates: ``qwen3_coder`` (= ``qwen3_xml``),
  ``<tool_call><function=f><parameter=p>v</parameter></function></tool_call>``.
- Llama 3.1-3.3 JSON tool calling: ``llama3_json``, ``{"name", "parameters"}`` (maybe after ``<|python_tag|>``).
- Llama 3.2 / Llama 4 pythonic: ``pythonic`` / ``llama4_pythonic``, ``[f(a=1), g(b="x")]``.
- Mistral, Mixtral, Devstral: ``mistral``, ``[TOOL_CALLS][{...}]`` or ``[TOOL_CALLS]f[ARGS]{...}``.
- DeepSeek-V3 / R1: ``deepseek_v3``; DeepSeek-V3.1: ``deepseek_v31``.
- Kimi-K2: ``kimi_k2``.
- any other family vLLM supports: its vLLM ``--tool-call-parser`` name (:func:`vllm_parser_names`).

``hermes`` is parsed here (:class:`HermesToolParser`); every other name is vLLM's own parser
(``vllm.tool_parsers.ToolParserManager``) behind :class:`VllmToolParser`, which needs the model's tokenizer
(``get_parser(name, tokenizer=tok, tools=schemas)``); ``vllm:<name>`` forces vLLM's parser for any name,
``vllm:hermes`` included.

Why hermes stays hand-written (measured on this repository's 2-core machine, vLLM 0.31, Python 3.11):

- vLLM's parsers are all-or-nothing per turn: one block they cannot read and the whole turn comes back as
  plain content, the well-formed calls beside it dropped; ``content`` is the text before the first call
  only. Of the 14 hermes inputs of ``tests/llm/test_tool_parser.py``, ``vllm:hermes`` (with this module's
  error layer on top) answers 10 differently: 3 lose well-formed calls (a call without ``"arguments"``
  drops all three calls of its turn; a malformed or unclosed block drops the good one after it), 6 lose
  the text after a call from ``content``, 1 misses a stray ``</tool_call>``.
- Importing ``vllm.tool_parsers`` takes 6 s warm, 12-29 s cold (it imports torch);
  ``import prorl_server.llm.tool_parser`` takes 0.08 s and imports none of it. A parse: 5.5 µs hand-written
  against 41 µs through vLLM's (well-formed, one call); vLLM also logs a traceback per malformed call,
  which :class:`VllmToolParser` silences.

vLLM is imported lazily, once per process, when the first vLLM-backed parser is built (never per parse);
the names come from vLLM's registry table without importing it, so validating a setting costs nothing.

Tool-call ids (:func:`new_call_id`) follow what the family's chat template accepts: Mistral templates raise
unless an id is 9 alphanumeric characters; the others take ``call_<12 hex>``.

The hermes format (NousResearch Hermes-2-Pro; also Qwen2.5/Qwen3's chat templates)::

    <tool_call>
    {"name": "<function-name>", "arguments": {<args-json-object>}}
    </tool_call>

any number of times per turn, with free text before, between and after the calls.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import logging
import re
import secrets
import string
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Optional, Protocol, Sequence, runtime_checkable

from sandbox.bounded_json import JsonBoundError, JsonBounds, loads

_ALNUM = string.ascii_letters + string.digits

#: Bounds of one tool call's JSON (the hermes ``{"name", "arguments"}`` object, or arguments given as a JSON
#: string; ``sandbox.bounded_json``): 1 MiB, a file of some 250k tokens written in one call, and 32768 items;
#: nesting as the decoder allows (200 levels). The model writes this text: beyond a bound the call is a
#: malformed one, shown to the model, never an exception. Decoding is on the calling thread: a few ms at the
#: worst (scan ~1-3 ms per MB, decode ~1-3.6 ms per MB of strings, ~4 ms for 32768 big integers).
ARGUMENTS_BOUNDS = JsonBounds(max_bytes=1 << 20, max_items=1 << 15)


def new_call_id(parser: str = "hermes") -> str:
    """A fresh tool-call id in the form the chat template of ``parser``'s family accepts.

    ``mistral`` (also ``vllm:mistral``): 9 random alphanumeric characters (Mistral templates and
    mistral-common reject any other id). Every other name: ``call_`` + 12 random hex digits.
    """
    if parser.removeprefix("vllm:") == "mistral":
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return f"call_{secrets.token_hex(6)}"


@dataclass
class ToolCall:
    """One well-formed call. ``arguments`` is a JSON object; ``raw`` is the text it was parsed from ("" when
    the parser reports no span, as vLLM's do). ``id``: see :func:`new_call_id`."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=new_call_id)
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
    id: str = field(default_factory=new_call_id)


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
            args = loads(args, ARGUMENTS_BOUNDS) if args.strip() else {}
        except JsonBoundError as e:
            raise ValueError(f'"arguments" is a string that is not JSON it can read: it {e}') from None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ValueError(f'"arguments" must be a JSON object, got {type(args).__name__}')
    return name, args


class HermesToolParser:
    """``<tool_call>{json}</tool_call>`` blocks (see the module docstring).

    Errors reported: invalid JSON or JSON past :data:`ARGUMENTS_BOUNDS` (too large, too many items, nested
    too deep), a JSON value that is not ``{"name", "arguments"}``, a ``<tool_call>`` without its closing tag
    (e.g. the turn was cut by ``max_tokens``), a stray ``</tool_call>``.
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
                obj = loads(body, ARGUMENTS_BOUNDS)
                name, args = _coerce_call(obj)
            except JsonBoundError as e:  # not JSON, or past a bound: too large, too many items, too deep
                errors.append(ToolCallError(raw=raw, message=f"tool call {e}"))
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


@dataclass(frozen=True)
class _Markers:
    """How a family's attempts show in the text, for reporting what vLLM's parser silently drops.

    ``start``/``end``: the tags around one call (``end`` None: no closing tag). ``per_call``: ``start``
    opens every call (not once per turn). ``section``: a tag opening the run of calls, before the first
    ``start``. ``inner``: (open, close) tag pairs inside a call that must balance too. ``attempt``: a
    pattern matching a call attempt in a family that has no marker (pythonic, bare JSON).
    """

    start: Optional[str] = None
    end: Optional[str] = None
    per_call: bool = True
    section: Optional[str] = None
    attempt: Optional[re.Pattern[str]] = None
    inner: tuple[tuple[str, str], ...] = ()


_JSON_ATTEMPT = re.compile(r'^\s*(<\|python_tag\|>)?\s*\{\s*"name"')
_PYTHONIC_ATTEMPT = re.compile(r"^\s*(<\|python_start\|>)?\s*\[\s*[A-Za-z_][\w.]*\s*\(")
_QWEN3_INNER = (("<function=", "</function>"), ("<parameter=", "</parameter>"))
_MARKERS: dict[str, _Markers] = {
    "hermes": _Markers("<tool_call>", "</tool_call>"),
    "qwen3_xml": _Markers("<tool_call>", "</tool_call>", inner=_QWEN3_INNER),
    "qwen3_coder": _Markers("<tool_call>", "</tool_call>", inner=_QWEN3_INNER),
    "mimo": _Markers("<tool_call>", "</tool_call>", inner=_QWEN3_INNER),
    "llama3_json": _Markers("<|python_tag|>", per_call=False, attempt=_JSON_ATTEMPT),
    "llama4_json": _Markers("<|python_tag|>", per_call=False, attempt=_JSON_ATTEMPT),
    "pythonic": _Markers(attempt=_PYTHONIC_ATTEMPT),
    "llama4_pythonic": _Markers(attempt=_PYTHONIC_ATTEMPT),
    "mistral": _Markers("[TOOL_CALLS]", per_call=False),
    "deepseek_v3": _Markers("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", section="<｜tool▁calls▁begin｜>"),
    "deepseek_v31": _Markers("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", section="<｜tool▁calls▁begin｜>"),
    "kimi_k2": _Markers("<|tool_call_begin|>", "<|tool_call_end|>", section="<|tool_calls_section_begin|>"),
}


class _QuietWhileParsing(logging.Filter):
    """Drops vLLM parser log records emitted inside :meth:`VllmToolParser.parse` on this thread.

    vLLM logs a traceback at ERROR for every malformed call; here a malformed call is an expected model
    output, reported in :attr:`ParsedTurn.errors` instead.
    """

    local = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(self.local, "active", False)


_QUIET = _QuietWhileParsing()


@lru_cache(maxsize=1)
def _vllm() -> tuple[Any, Any]:
    """``(ToolParserManager, ChatCompletionRequest)``, imported once (seconds: vLLM imports torch)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    return ToolParserManager, ChatCompletionRequest


@lru_cache(maxsize=1)
def vllm_parser_names() -> tuple[str, ...]:
    """The tool-parser names vLLM registers (its ``--tool-call-parser`` choices), sorted.

    Read from vLLM's registration table without importing vLLM; if that table cannot be read (another vLLM
    layout), vLLM is imported and its ``ToolParserManager`` asked. Empty when vLLM is not installed.
    """
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return ()
    try:
        init = Path(next(iter(spec.submodule_search_locations))) / "tool_parsers" / "__init__.py"
        for node in ast.parse(init.read_text()).body:
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and getattr(node.targets[0], "id", None) == "_TOOL_PARSERS_TO_REGISTER"):
                return tuple(sorted(ast.literal_eval(node.value)))
    except (OSError, SyntaxError, ValueError, StopIteration):
        pass
    return tuple(_vllm()[0].list_registered())


class VllmToolParser:
    """vLLM's tool parser ``name`` (one of :func:`vllm_parser_names`), reporting malformed calls.

    vLLM's parsers return either the calls of a turn or none (the turn as plain content), and log the
    failure. On top of them this class reports, as :class:`ToolCallError`: a call whose arguments are not a
    JSON object (or whose name is empty); a family marker (:data:`_MARKERS`) opened and never closed (e.g.
    cut by ``max_tokens``; the partial call vLLM may still return from it is dropped); more marked calls
    than parsed ones; and a turn with a call attempt but no call. Calls keep vLLM's order; errors follow
    them (vLLM reports no positions). ``content``: the text before the family's first call marker, as
    written; vLLM's content for families without markers; the whole text when nothing was attempted.
    Ids: :func:`new_call_id` of ``name``. Building the first one imports vLLM (seconds, blocking): build
    parsers at startup, not on an event loop serving requests.

    Args:
        name: a vLLM tool-parser name (``vllm:`` prefix allowed).
        tokenizer: the model's tokenizer (transformers, or vLLM's ``MistralTokenizer``); the parsers look
            their marker tokens up in its vocabulary.
        tools: the request's tools, OpenAI ``{"type": "function", "function": {...}}`` schemas (some
            parsers convert argument types from them, e.g. ``qwen3_xml``'s ``"3"`` -> ``3``).

    Raises:
        ValueError: ``tokenizer`` is None, or vLLM's parser refuses it (e.g. its vocabulary lacks the
            family's marker tokens).
        KeyError: vLLM has no parser ``name``.
    """

    def __init__(self, name: str, tokenizer: Any, tools: Optional[Sequence[dict[str, Any]]] = None) -> None:
        self.name = name
        self.vllm_name = name.removeprefix("vllm:")
        if tokenizer is None:
            raise ValueError(f"tool parser {name!r} is vLLM's and needs the model's tokenizer: "
                             f"get_parser({name!r}, tokenizer=...)")
        manager, self._request_cls = _vllm()
        try:
            cls = manager.get_tool_parser(self.vllm_name)
        except KeyError:
            raise KeyError(f"unknown tool parser {name!r}; registered: {sorted(PARSERS)}") from None
        self._request = self._make_request(tools)
        try:
            self._parser = cls(tokenizer, self._request.tools)
        except (RuntimeError, ValueError, AttributeError, TypeError) as e:
            raise ValueError(f"vLLM's tool parser {self.vllm_name!r} cannot use this tokenizer: {e}") from e
        for logger_name in list(logging.Logger.manager.loggerDict):  # each vLLM module logs under its name
            if logger_name.startswith(("vllm.tool_parsers", "vllm.parser")):
                logging.getLogger(logger_name).addFilter(_QUIET)
        self._markers = _MARKERS.get(self.vllm_name, _Markers())

    def _make_request(self, tools: Optional[Sequence[dict[str, Any]]]) -> Any:
        """A minimal vLLM ``ChatCompletionRequest`` carrying ``tools`` (what vLLM's parsers read of it)."""
        return self._request_cls(model="", messages=[{"role": "user", "content": ""}],
                                 tools=list(tools or []) or None)

    def parse(self, text: str, *, tools: Optional[Sequence[dict[str, Any]]] = None) -> ParsedTurn:
        """Parse one turn. ``tools``: this request's tool schemas, if not those given at construction."""
        request = self._make_request(tools) if tools is not None else self._request
        errors: list[ToolCallError] = []
        _QUIET.local.active = True
        try:
            info = self._parser.extract_tool_calls(text, request)
            vllm_calls, vllm_content, called = list(info.tool_calls), info.content, info.tools_called
        except Exception as e:  # a parser bug must not end the rollout: the model is told its call failed
            vllm_calls, vllm_content, called = [], None, True
            errors.append(ToolCallError(raw=text, message=f"tool call could not be parsed: {e}",
                                        id=new_call_id(self.name)))
        finally:
            _QUIET.local.active = False
        per_call: list[ToolCall | ToolCallError] = []  # one per call vLLM returned, in its order
        for c in vllm_calls:
            try:
                args = loads(c.function.arguments, ARGUMENTS_BOUNDS) if (c.function.arguments or "").strip() else {}
                name, args = _coerce_call({"name": c.function.name, "arguments": args})
            except ValueError as e:  # JsonBoundError included
                per_call.append(ToolCallError(raw=f"{c.function.name}({c.function.arguments})",
                                              message=f"malformed tool call: arguments {e}"
                                              if isinstance(e, JsonBoundError) else f"malformed tool call: {e}",
                                              id=new_call_id(self.name)))
                continue
            per_call.append(ToolCall(name=name, arguments=args, id=new_call_id(self.name)))
        errors += self._marker_errors(text, per_call, called)
        calls = [c for c in per_call if isinstance(c, ToolCall)]
        errors = [e for e in per_call if isinstance(e, ToolCallError)] + errors
        m = self._markers
        firsts = [text.index(t) for t in (m.section, m.start) if t and t in text]
        if not calls and not errors:  # vLLM's content may drop tags (qwen3's </think>) even without a call
            content = text.strip()
        elif firsts:  # the text before the calls as written (vLLM's drops qwen3's </think> there too)
            content = text[:min(firsts)].strip()
        elif not calls and m.attempt and m.attempt.match(text):
            content = ""
        else:
            content = (vllm_content or "").strip()
        return ParsedTurn(content=content, calls=calls, errors=errors, raw=text, items=[*calls, *errors])

    def _marker_errors(self, text: str, per_call: list["ToolCall | ToolCallError"],
                       called: bool) -> list[ToolCallError]:
        """Attempts vLLM's parser dropped. Trims ``per_call`` of what it parsed from a block left open."""
        m, errors, n_parsed = self._markers, [], len(per_call)
        opened = text.count(m.start) if m.start else 0
        pairs = ([(m.start, m.end)] if m.start and m.end else []) + list(m.inner)
        unclosed = [(a, b) for a, b in pairs if text.count(a) > text.count(b)]
        if unclosed:
            del per_call[min(text.count(b) for _, b in pairs):]  # past the closed blocks: from an open one
            a, b = unclosed[0]
            errors.append(ToolCallError(raw=text[text.rindex(a):], message=f"unterminated {a} (no {b}): the "
                                        "call was cut off or never closed", id=new_call_id(self.name)))
        elif m.per_call and opened > n_parsed:
            errors.append(ToolCallError(raw=text[text.index(m.start):], message=f"{opened - n_parsed} of "
                                        f"{opened} tool calls could not be parsed", id=new_call_id(self.name)))
        elif not n_parsed and (called or opened or (m.attempt is not None and m.attempt.match(text))):
            raw = text[text.index(m.start):] if opened else text
            errors.append(ToolCallError(raw=raw, message="tool call could not be parsed",
                                        id=new_call_id(self.name)))
        return errors


class _Parsers(Mapping[str, Callable[..., ToolParser]]):
    """Every parser name -> its factory ``(tokenizer=None, tools=None) -> ToolParser``.

    ``hermes`` (this module's), each of :func:`vllm_parser_names`, and ``vllm:<name>`` for each of those.
    Iterating lists the plain names (and ``vllm:`` for names this module parses itself).
    """

    own: dict[str, Callable[[], ToolParser]] = {"hermes": HermesToolParser}

    def __getitem__(self, name: str) -> Callable[..., ToolParser]:
        if name in self.own:
            own = self.own[name]
            return lambda tokenizer=None, tools=None: own()
        if name.removeprefix("vllm:") in vllm_parser_names():
            return lambda tokenizer=None, tools=None: VllmToolParser(name, tokenizer, tools)
        raise KeyError(name)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self.own or name.removeprefix("vllm:") in vllm_parser_names())

    def __iter__(self) -> Iterator[str]:
        yield from self.own
        yield from (f"vllm:{n}" for n in self.own if n in vllm_parser_names())
        yield from (n for n in vllm_parser_names() if n not in self.own)

    def __len__(self) -> int:
        return sum(1 for _ in self)


PARSERS: Mapping[str, Callable[..., ToolParser]] = _Parsers()


def get_parser(parser: "str | ToolParser", tokenizer: Any = None, *,
               tools: Optional[Sequence[dict[str, Any]]] = None) -> ToolParser:
    """A parser instance by name (see :data:`PARSERS` and the module docstring), or ``parser`` itself.

    Args:
        tokenizer: the model's tokenizer; required by vLLM's parsers (every name but ``hermes``), which
            import vLLM on first use (seconds, once per process).
        tools: the tools offered to the model (OpenAI schemas); used by vLLM's parsers that type arguments.

    Raises:
        KeyError: unknown name (the message lists the registered ones).
        ValueError: a vLLM parser without a tokenizer, or with one lacking the family's marker tokens.
    """
    if not isinstance(parser, str):
        return parser
    try:
        factory = PARSERS[parser]
    except KeyError:
        raise KeyError(f"unknown tool parser {parser!r}; registered: {sorted(PARSERS)}") from None
    return factory(tokenizer=tokenizer, tools=tools)
