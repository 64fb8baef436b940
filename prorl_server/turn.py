"""One generation turn, the same for every caller: context limit -> conversation -> complete -> parse tool calls.

:class:`~prorl_server.agent_loop.AgentLoop` (the server drives the tools) and the gateway's
:meth:`~prorl_server.gateway.Gateway.chat` (a black-box agent drives them) both generate through a
:class:`TurnEngine`: the conversation starts under the one context-limit rule (:func:`context_limit`), each
turn's budget is what the context has left (capped by the caller's per-turn ``max_tokens``), the prompt goes
token-in/token-out through the shared :class:`~prorl_server.llm_client.LLMClient` (failover, pause retries and
weight versions are its business), the generated tokens are appended as generated, and tool calls are parsed
from the generated text (:mod:`prorl_server.tool_parser`). What the caller does with a turn (run tools, answer
an HTTP request) is the caller's.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from prorl_server.conversation import Conversation
from prorl_server.llm_client import Backends, Completion, LLMClient, backend_source
from prorl_server.tool_parser import ParsedTurn, ToolParser, get_parser

log = logging.getLogger(__name__)

#: A tokenizer's ``model_max_length`` at or above this is transformers' "no limit" placeholder (1e30), not a
#: context length.
_NO_LIMIT = 10**8


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
        parser: a :class:`~prorl_server.tool_parser.ToolParser` or its name (``"hermes"``).
    """

    def __init__(self, client: LLMClient, parser: "str | ToolParser" = "hermes") -> None:
        self.client = client
        self.parser = get_parser(parser) if isinstance(parser, str) else parser

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
            prorl_server.conversation.ContextLengthError: the prompt alone fills the context.
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
            backends: where to generate (:data:`~prorl_server.llm_client.Backends`; a job or a session's pool
                assignment: failover through it, each kept turn recorded on it).
            max_tokens: the caller's per-turn limit (tokens); the turn gets at most what the context has left.
            sampling_params: passed to vLLM (the client's own keys are ignored).
            timeout_s: per-attempt timeout of the HTTP call (None: the client's default).
            parse: parse tool calls from the generated text (``Turn.parsed``).
            accept: called with the completion before it is appended; it raises to drop the turn (the
                conversation is then left as it was, e.g. a gateway session that ended meanwhile).

        Raises:
            ContextFullError: no room is left for a generated token (nothing was sent).
            prorl_server.llm_client.LLMUnavailableError: no backend could generate the turn.
            prorl_server.llm_client.LLMRequestError: the backend refused the request (4xx).
        """
        room = conv.room
        if room < 1:
            raise ContextFullError(conv.num_tokens)
        budget = min(max_tokens, room) if max_tokens else room
        comp = await self.client.complete(conv.token_ids, backend=backends, max_tokens=budget,
                                          sampling_params=sampling_params, timeout_s=timeout_s)
        if accept is not None:
            accept(comp)
        msg = conv.add_completion(comp)
        return Turn(completion=comp, message=msg, parsed=self.parser.parse(msg["content"]) if parse else None)
