"""One generation turn, the same for every caller: context limit -> conversation -> complete -> parse tool calls.

:class:`~prorl_server.llm.agent_loop.AgentLoop` (the server drives the tools) and the gateway's
:meth:`~prorl_server.gateway.Gateway.chat` (a black-box agent drives them) both generate through a
:class:`TurnEngine`: the conversation starts under the one context-limit rule (:func:`context_limit`), each
turn's budget is what the context has left (capped by the caller's per-turn ``max_tokens``), the prompt goes
token-in/token-out through the shared :class:`~prorl_server.llm.client.LLMClient` (failover, pause retries and
weight versions are its business), the generated tokens are appended as generated, and tool calls are parsed
from the generated text (:mod:`prorl_server.llm.tool_parser`). What the caller does with a turn (run tools, answer
an HTTP request) is the caller's.

The parser is named once per engine (``"auto"``: the one of the conversation's model family,
:attr:`~prorl_server.llm.chat_templates.FamilySpec.tool_parser`) and built per tokenizer, since vLLM's parsers need
it: :func:`parser_for` builds each (name, tokenizer) pair once per process and keeps it; a vLLM-backed parser is
built in a worker thread (its first build imports vLLM: seconds), never on the event loop.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from prorl_server.llm.conversation import ChatTokenizer, Conversation
from prorl_server.llm.client import Backends, Completion, LLMClient, backend_source
from prorl_server.llm.tool_parser import PARSERS, ParsedTurn, ToolParser, VllmToolParser, get_parser

log = logging.getLogger(__name__)

#: A tokenizer's ``model_max_length`` at or above this is transformers' "no limit" placeholder (1e30), not a
#: context length.
_NO_LIMIT = 10**8


#: The parser setting that picks the model family's parser (:attr:`FamilySpec.tool_parser`).
AUTO = "auto"


class ToolParserUnavailableError(ValueError):
    """The tool-call parser a conversation needs cannot be built: the family's parser is vLLM's and vLLM is
    not installed, or vLLM's parser refuses the tokenizer (its vocabulary lacks the family's markers)."""


def check_parser_name(name: str) -> str:
    """``name`` if it is ``"auto"`` or a :data:`~prorl_server.llm.tool_parser.PARSERS` name (cheap: vLLM is not
    imported). Raises ValueError naming the registered ones."""
    if name != AUTO and name not in PARSERS:
        raise ValueError(f"unknown tool parser {name!r}; registered: {sorted(PARSERS)}, or 'auto' (the model "
                         f"family's)")
    return name


def parser_name_for(setting: str, tokenizer: Any) -> str:
    """The parser name a setting means for ``tokenizer`` (a transformers tokenizer or a
    :class:`~prorl_server.llm.conversation.ChatTokenizer`): ``"auto"`` -> its family's
    :attr:`~prorl_server.llm.chat_templates.FamilySpec.tool_parser` (from the chat template), else ``setting``."""
    if setting != AUTO:
        return setting
    tok = tokenizer if isinstance(tokenizer, ChatTokenizer) else ChatTokenizer(tokenizer)
    return tok.family.tool_parser


#: Parsers of this package's own (no tokenizer, no vLLM): built inline.
_OWN_PARSERS: frozenset[str] = frozenset(getattr(PARSERS, "own", ()))
# tokenizer -> {parser name: parser}; weak, so a tokenizer the server drops takes its parsers with it.
_PARSERS_BY_TOKENIZER: "weakref.WeakKeyDictionary[Any, dict[str, ToolParser]]" = weakref.WeakKeyDictionary()
_BUILD_LOCK = threading.Lock()


def _cached(name: str, tokenizer: Any) -> Optional[ToolParser]:
    try:
        return _PARSERS_BY_TOKENIZER.get(tokenizer, {}).get(name)
    except TypeError:  # a tokenizer that cannot be weakly referenced: never cached
        return None


def _build(name: str, tokenizer: Any) -> ToolParser:
    """Build (or find) vLLM's parser ``name`` for ``tokenizer``, in a worker thread."""
    with _BUILD_LOCK:  # two first turns at once build it once (and import vLLM once)
        parser = _cached(name, tokenizer)
        if parser is not None:
            return parser
        if name not in PARSERS:
            raise ToolParserUnavailableError(
                f"tool parser {name!r} is not available (it is vLLM's and vLLM is not installed: install the "
                f"llm extra, or set the tool parser to one that needs no vLLM, e.g. 'hermes')")
        try:
            parser = get_parser(name, tokenizer)
        except ValueError as e:
            raise ToolParserUnavailableError(str(e)) from e
        _keep(name, tokenizer, parser)
        return parser


def _keep(name: str, tokenizer: Any, parser: ToolParser) -> None:
    try:
        _PARSERS_BY_TOKENIZER.setdefault(tokenizer, {})[name] = parser
    except TypeError:  # a tokenizer that cannot be weakly referenced: never cached
        pass


async def parser_for(setting: "str | ToolParser", tokenizer: Any) -> ToolParser:
    """The parser that ``setting`` (a name, ``"auto"``, or a parser, returned as is) means for ``tokenizer``,
    built once per (name, tokenizer) and cached; vLLM's parsers are built in a worker thread.

    Raises:
        ToolParserUnavailableError: the parser needs vLLM and it is not installed, or refuses the tokenizer.
    """
    if not isinstance(setting, str):
        return setting
    tok = tokenizer.tokenizer if isinstance(tokenizer, ChatTokenizer) else tokenizer
    name = parser_name_for(setting, tokenizer)
    parser = _cached(name, tok)
    if parser is not None:
        return parser
    if name in _OWN_PARSERS:  # hand-written (hermes): microseconds, no vLLM, no lock (a vLLM build may hold it)
        parser = get_parser(name)
        _keep(name, tok, parser)
        return parser
    return await asyncio.to_thread(_build, name, tok)


class ContextUnknownError(ValueError):
    """No context length is known for the served model: no cap was given, the backend reported no
    ``max_model_len`` and the tokenizer has no ``model_max_length``."""


class ContextFullError(ValueError):
    """The conversation fills the context: there is no room for one generated token."""

    def __init__(self, num_tokens: int) -> None:
        super().__init__(f"the conversation fills the model's context ({num_tokens} tokens)")
        self.num_tokens = num_tokens


def context_limit(tokenizer: Any, *caps: Optional[int]) -> int:
    """The context length a conversation may use, in tokens: the smallest of the ``caps`` that are set (a
    configured cap, the backend's ``max_model_len``) and the tokenizer's ``model_max_length`` when that is a
    real limit (transformers puts 1e30 there when the model declares none).

    Raises:
        ContextUnknownError: none of them is known.
    """
    limits = [c for c in caps if c]
    model_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(model_max, int) and model_max < _NO_LIMIT:
        limits.append(model_max)
    if not limits:
        raise ContextUnknownError("no context length known for the served model")
    return min(limits)


@dataclass
class Turn:
    """One generated turn.

    ``completion``: what the backend generated (token ids, logprobs, finish reason, backend, weight versions,
    HTTP seconds). ``message``: the assistant message appended to the conversation (``content`` is the
    generated text verbatim; a caller may add keys for information, the template never sees them).
    ``parsed``: the tool calls parsed from that text (None when the caller did not ask for parsing).
    """

    completion: Completion
    message: dict[str, Any]
    parsed: Optional[ParsedTurn]


class TurnEngine:
    """Generates turns of conversations with one LLM client and one tool-call parser (reusable, safe to use
    from concurrent rollouts: it keeps no per-conversation state).

    Args:
        client: the shared token-in/token-out client.
        parser: a :class:`~prorl_server.llm.tool_parser.ToolParser`, or its name (``"hermes"``, ``"llama3_json"``,
            ...) or ``"auto"`` (each conversation's model family's, :attr:`FamilySpec.tool_parser`): a name is
            built for each conversation's tokenizer on its first parsed turn (:func:`parser_for`).

    Raises:
        ValueError: ``parser`` names no parser.
    """

    def __init__(self, client: LLMClient, parser: "str | ToolParser" = AUTO) -> None:
        self.client = client
        self.parser: "str | ToolParser" = check_parser_name(parser) if isinstance(parser, str) else parser

    async def parser_for(self, conv: Conversation) -> ToolParser:
        """The parser of ``conv``'s turns (see :func:`parser_for`).

        Raises:
            ToolParserUnavailableError: it needs vLLM and vLLM is not installed, or refuses the tokenizer.
        """
        return await parser_for(self.parser, conv.tok)

    def parser_name(self, tokenizer: Any) -> str:
        """The name of the parser this engine reads ``tokenizer``'s turns with (nothing is built): ``"auto"``
        resolved to the family's (see :func:`parser_name_for`), a parser object's ``name``."""
        p = self.parser
        return parser_name_for(p, tokenizer) if isinstance(p, str) else getattr(p, "name", type(p).__name__)

    async def parse(self, conv: Conversation, text: str) -> ParsedTurn:
        """Tool calls in ``text``, a turn generated for ``conv`` (not necessarily appended to it), read by
        :meth:`parser_for` ``conv``.

        Raises:
            ToolParserUnavailableError: as :meth:`parser_for`.
        """
        return _parse(await self.parser_for(conv), conv, text)

    async def served_max_len(self, backends: Backends) -> Optional[int]:
        """The ``max_model_len`` (tokens) the caller's backend reports, None when it does not answer (the
        first generation call then fails over, or fails, properly)."""
        try:
            b = await backend_source(backends).acquire(frozenset())
            return (await self.client.model_info(b.address)).max_model_len
        except Exception as e:
            log.debug("could not read the backend's max_model_len: %r", e)
            return None

    async def start(self, tokenizer: Any, messages: Sequence[dict], *, caps: Sequence[Optional[int]] = (),
                    tools: Optional[Sequence[dict]] = None, chat_template_kwargs: Optional[dict[str, Any]] = None,
                    window: bool = True) -> Conversation:
        """A conversation over ``messages`` rendered with ``tokenizer``'s chat template (``tools`` given to
        it), limited to :func:`context_limit` of ``caps`` (tokens).

        Raises:
            ContextUnknownError: no context length is known.
            prorl_server.llm.conversation.ContextLengthError: the prompt alone fills the context.
            Exception: the chat template refused the messages (e.g. roles out of order).
        """
        limit = context_limit(tokenizer, *caps)
        return await Conversation.create(tokenizer, messages, max_context_tokens=limit, tools=tools,
                                         chat_template_kwargs=chat_template_kwargs, window=window)

    async def turn(self, conv: Conversation, backends: Backends, *, max_tokens: Optional[int] = None,
                   sampling_params: Optional[dict[str, Any]] = None, timeout_s: Optional[float] = None,
                   parse: bool = True, accept: Optional[Callable[[Completion], None]] = None) -> Turn:
        """Generate the next assistant turn of ``conv`` and append it.

        Args:
            backends: where to generate (:data:`~prorl_server.llm.client.Backends`; a job or a session's pool
                assignment: failover through it, each kept turn recorded on it).
            max_tokens: the caller's per-turn limit (tokens); the turn gets at most what the context has left.
            sampling_params: passed to vLLM (the client's own keys are ignored).
            timeout_s: per-attempt timeout of the HTTP call (None: the client's default).
            parse: parse tool calls from the generated text (``Turn.parsed``).
            accept: called with the completion before it is appended; it raises to drop the turn (the
                conversation is then left as it was, e.g. a gateway session that ended meanwhile).

        Raises:
            ContextFullError: no room is left for a generated token (nothing was sent).
            prorl_server.llm.client.LLMUnavailableError: no backend could generate the turn.
            prorl_server.llm.client.LLMRequestError: the backend refused the request (4xx).
            ToolParserUnavailableError: ``parse`` and the parser cannot be built (checked before generating).
        """
        parser = await self.parser_for(conv) if parse else None
        room = conv.room
        if room < 1:
            raise ContextFullError(conv.num_tokens)
        budget = min(max_tokens, room) if max_tokens else room
        if conv.routes_held:  # a backend that reports routes (R3) need not send the ones this row holds again
            sampling_params = {**(sampling_params or {}), "routed_experts_prompt_start": conv.routes_held}
        comp = await self.client.complete(conv.token_ids, backend=backends, max_tokens=budget,
                                          sampling_params=sampling_params, timeout_s=timeout_s)
        if accept is not None:
            accept(comp)
        msg = conv.add_completion(comp)
        parsed = _parse(parser, conv, msg["content"]) if parser is not None else None
        if parsed is not None and conv.turns:  # the turn record's counts (#35): the model's calls, parse errors
            conv.turns[-1].tool_calls = len(parsed.calls)
            conv.turns[-1].tool_call_errors = len(parsed.errors)
        return Turn(completion=comp, message=msg, parsed=parsed)


def _parse(parser: ToolParser, conv: Conversation, text: str) -> ParsedTurn:
    if isinstance(parser, VllmToolParser):  # some type arguments from the conversation's tool schemas
        return parser.parse(text, tools=conv.tok.tools)
    return parser.parse(text)
