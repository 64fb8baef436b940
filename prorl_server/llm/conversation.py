"""Token-true conversation state of one multi-turn rollout.

The token ids sent to the model are the truth; text is derived from them, never the other way round:

- the first prompt is the model's chat template rendered over the initial messages (transformers
  ``apply_chat_template``) and tokenized once;
- each assistant turn is appended exactly as generated (token ids, logprobs; ``loss_mask`` 1);
- new messages (tool observations, user turns) are appended as a *delta* (``loss_mask`` 0, logprob 0.0):
  only text after the generated turn is ever tokenized, nothing generated is re-tokenized.

How the delta is found depends on what the model family's template does to a generated turn when it renders
the conversation again (:mod:`prorl_server.llm.chat_templates` names the family from the template, or take
``family=``):

- *exact*: the rendering extends the previous one with the generated text verbatim: the delta is the text
  after it (for ChatML/Qwen2.5, Llama 3.x and Mistral with canonical output the final ids equal the
  canonical rendering of the whole conversation);
- *continued*: the template renders the latest turn differently but keeps all of its text (Qwen3's
  ``<think>`` spacing and the empty think block of ``enable_thinking=False``, ``| trim``): the delta is the
  rest of the turn's terminator plus the new messages rendered after a synthetic assistant turn (verl's
  Continuous Token rule, see :mod:`prorl_server.llm.chat_templates`);
- *split*: the template drops generated text (past reasoning) or changes text before the latest turn: the
  current :class:`Trajectory` segment is closed with ``split_reason`` (``"<code>: <why>"``) and a new
  segment starts from a fresh rendering of the whole conversation.

:meth:`Conversation.token_stats` reports how often each happened (the drift report).

Cost per turn is independent of the history length by default (``window=True``): the delta is rendered over
the *head* (messages up to the first user message, plus ``tools``), the previous generated turn and its
observations, the latest generated turn and the new messages. That is exact for templates whose rendering of a
message depends only on the head and its neighbours (all bundled families). ``window=False`` renders the
whole conversation each turn (exact for any template, O(history) per turn).

Context length is enforced: :attr:`Conversation.room` is the generation budget left, and
:meth:`Conversation.add_messages` refuses (returns False, nothing appended) messages that would leave no room
for another generated token.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
import weakref
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Sequence

from prorl_server.llm.chat_templates import FamilySpec, detect_family, family_spec, synthetic_assistant
from prorl_server.types import Trajectory, TurnRecord

if TYPE_CHECKING:
    from prorl_server.llm.client import Completion

# Rendering + tokenizing more than this many characters of new text goes to a worker thread so a large
# observation (a long file, a build log) does not stall the event loop; smaller deltas cost ~0.1 ms inline,
# far less than a thread hop.
OFFLOAD_CHARS = 16_384

_SPACE = re.compile(r"\s+")


def _render_chars(messages: Sequence[dict]) -> int:
    """Characters of ``messages`` a chat template renders at the least: contents and the tool calls' names and
    arguments (180 tool calls of 10 kB arguments beside a short content were rendered and tokenized on the event
    loop: a 3.3 s stall, red team B). Compared with :data:`OFFLOAD_CHARS` to decide on a worker thread."""
    size = 0
    for m in messages:
        size += len(str(m.get("content") or ""))
        for call in m.get("tool_calls") or ():
            fn = call.get("function") if isinstance(call, dict) else None
            size += len(str(fn.get("name") or "")) + len(str(fn.get("arguments") or "")) if isinstance(fn, dict) \
                else len(str(call))
    return size

#: Initial prompts remembered per tokenizer (rendering + token ids): the n samples of a group (GRPO/DAPO) and
#: retried jobs start from the same messages, and rendering + tokenizing a prompt is most of a short turn's
#: CPU (~0.2 ms of 0.5). At most PROMPT_CACHE_SIZE prompts of at most PROMPT_CACHE_MAX_TOKENS tokens each
#: (~36 MB at worst); oldest forgotten first; a tokenizer that is gone takes its entries with it.
PROMPT_CACHE_SIZE = 256
PROMPT_CACHE_MAX_TOKENS = 4096
_prompt_caches: "weakref.WeakKeyDictionary[Any, OrderedDict[str, tuple[str, list[int]]]]" = \
    weakref.WeakKeyDictionary()


#: Short texts' token ids remembered per tokenizer: what a turn appends is mostly the same few strings (the
#: template's turn boundaries around a fixed feedback or user message, a tool's short fixed answer), and the
#: Qwen2-style pre-tokenizer regex costs ~30-60 us on one sentence, a third of a short turn's CPU. Texts of at
#: most ENCODE_CACHE_MAX_CHARS characters, ENCODE_CACHE_SIZE of them per tokenizer, oldest forgotten first.
ENCODE_CACHE_SIZE = 1024
ENCODE_CACHE_MAX_CHARS = 512
_encode_caches: "weakref.WeakKeyDictionary[Any, OrderedDict[str, tuple[int, ...]]]" = weakref.WeakKeyDictionary()


def _squash(text: str) -> str:
    return _SPACE.sub("", text)


class ContextLengthError(ValueError):
    """The initial prompt alone does not fit in the context (tokens >= ``max_context_tokens``)."""


class ChatTokenizer:
    """A transformers tokenizer seen as: chat template rendering, encode (no special tokens added), decode.

    ``tools``: OpenAI-style tool schemas passed to the template (``apply_chat_template(tools=...)``).
    ``chat_template_kwargs``: extra template variables (e.g. ``enable_thinking``).
    ``family``: a key of :data:`prorl_server.llm.chat_templates.FAMILIES`; None: detected from the template.

    Raises:
        ValueError: ``family`` is not a known family.
    """

    def __init__(self, tokenizer: Any, tools: Optional[Sequence[dict]] = None,
                 chat_template_kwargs: Optional[dict[str, Any]] = None, family: Optional[str] = None) -> None:
        self.tokenizer = tokenizer
        self.family: FamilySpec = family_spec(family or detect_family(getattr(tokenizer, "chat_template", None)))
        self.tools = list(tools) if tools else None
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        # The Rust tokenizer directly: same ids as tokenizer.encode, without the Python wrapper's overhead.
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._terminator: Optional[str] = None
        self._terminator_known = False
        try:
            self._encoded: Optional[OrderedDict[str, tuple[int, ...]]] = _encode_caches.setdefault(
                tokenizer, OrderedDict())
        except TypeError:  # a tokenizer that takes no weak reference: no cache
            self._encoded = None

    def assistant_terminator(self) -> Optional[str]:
        """The text the template puts right after an assistant message's content (ChatML: ``"<|im_end|>\\n"``),
        found once by rendering a probe; None if the template could not be probed."""
        if not self._terminator_known:
            probe = "PRORL_PROBE_7f3a"  # no whitespace (nor \x1f, which str.strip removes): survives | trim
            try:
                text = self.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": probe}],
                                   add_generation_prompt=False)
                self._terminator = text[text.rindex(probe) + len(probe):]
            except Exception:  # any template error: fall back to "stop token ends the turn"
                self._terminator = None
            self._terminator_known = True
        return self._terminator

    def render(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tools=self.tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  **self.chat_template_kwargs)

    def render_prompt(self, messages: Sequence[dict]) -> tuple[str, list[int]]:
        """``(text, ids)`` of ``messages`` rendered with the generation prompt and tokenized, remembered per
        tokenizer (:data:`PROMPT_CACHE_SIZE` prompts). ``ids`` is a fresh list the caller may extend."""
        try:
            key = json.dumps([messages, self.tools, self.chat_template_kwargs], sort_keys=True)
            cache = _prompt_caches.setdefault(self.tokenizer, OrderedDict())
        except TypeError:  # a value JSON cannot hold, or a tokenizer that takes no weak reference: no cache
            text = self.render(messages, add_generation_prompt=True)
            return text, self.encode(text)
        hit = cache.get(key)
        if hit is not None:
            try:
                cache.move_to_end(key)
            except KeyError:  # forgotten meanwhile by a worker thread (Conversation.create): still a hit
                pass
            return hit[0], list(hit[1])
        text = self.render(messages, add_generation_prompt=True)
        ids = self.encode(text)
        if len(ids) <= PROMPT_CACHE_MAX_TOKENS:
            cache[key] = (text, ids)
            while len(cache) > PROMPT_CACHE_SIZE:
                try:
                    cache.popitem(last=False)
                except KeyError:
                    break
            return text, list(ids)
        return text, ids

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added): a fresh list the caller may extend. A short text
        seen before is answered from a per-tokenizer cache (:data:`ENCODE_CACHE_SIZE`)."""
        cache = self._encoded
        if cache is None or len(text) > ENCODE_CACHE_MAX_CHARS:
            return self._encode(text)
        hit = cache.get(text)
        if hit is not None:
            return list(hit)
        ids = self._encode(text)
        cache[text] = tuple(ids)
        while len(cache) > ENCODE_CACHE_SIZE:
            try:
                cache.popitem(last=False)
            except KeyError:  # emptied meanwhile by a worker thread's encode
                break
        return ids

    def _encode(self, text: str) -> list[int]:
        if self._backend is not None:
            if len(text) > OFFLOAD_CHARS:
                # the same ids; the Rust tokenizer's batch call releases the GIL (its single encode holds it: a
                # megabyte tokenized in a worker thread still stalled the event loop ~4 s, red team B)
                return self._backend.encode_batch([text], add_special_tokens=False)[0].ids
            return self._backend.encode(text, add_special_tokens=False).ids
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=False)
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


def _generated_view(message: dict) -> dict:
    """What the template sees of a *generated* assistant turn: its raw text only. Its tool calls are inside
    that text verbatim; a ``tool_calls`` key added for information would be rendered a second time."""
    if "tool_calls" in message:
        return {k: v for k, v in message.items() if k != "tool_calls"}
    return message


def _head_len(messages: Sequence[dict]) -> int:
    for i, m in enumerate(messages):
        if m.get("role") == "user":
            return i + 1
    return len(messages)


@dataclass
class _Segment:
    prompt_len: int
    ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    num_turns: int = 0
    weight_versions: list[int] = field(default_factory=list)
    version_runs: list[list[Optional[int]]] = field(default_factory=list)
    mixed_version_turns: int = 0
    finish_reason: Optional[str] = None
    split_reason: Optional[str] = None
    #: routed experts (R3) of this segment's row positions [0, len(routes)); None: none reported (or a gap)
    routes: Optional[list[Any]] = None
    routes_lost: bool = False

    def add_routes(self, start: int, routes: Optional[list[Any]]) -> None:
        """Record a turn's routes for row positions ``[start, start + len(routes))`` of this segment (the turn's
        request was this segment's ``ids`` then): positions from ``start`` on are the latest answer's word, the
        ones before it stay. A turn with no record, or one that leaves a gap, ends the record (a row with
        holes would replay zeros as routes)."""
        if self.routes_lost:
            return
        held = self.routes or []
        if routes is None or start > len(held) or (
                held and routes and (len(routes[0]) != len(held[0]) or len(routes[0][0]) != len(held[0][0]))):
            # no record, a gap, or another [layers][top_k] shape than the positions held (each answer's record
            # was checked on its own by the client; a row must have one shape throughout)
            self.routes, self.routes_lost = None, self.routes is not None or routes is not None
            return
        self.routes = held[:start] + routes

    def to_trajectory(self) -> Trajectory:
        traj = Trajectory(prompt_ids=self.ids[:self.prompt_len], response_ids=self.ids[self.prompt_len:],
                          response_logprobs=list(self.logprobs), loss_mask=list(self.mask),
                          num_turns=self.num_turns, weight_versions=list(self.weight_versions),
                          version_runs=[list(r) for r in self.version_runs],
                          mixed_version_turns=self.mixed_version_turns,
                          finish_reason=self.finish_reason, split_reason=self.split_reason)
        if self.routes is not None:
            # Set, not validated again: every answer's record was checked off the event loop by the client
            # (route_shape_error), and add_routes only slices and joins records of one shape within the row's
            # positions. Checking the joined record here ran on the event loop (~0.1 s per million ints:
            # ~0.4 s for a 10k-token row of a 48-layer top-8 model).
            traj.routed_experts = list(self.routes)
        return traj


@dataclass
class _Pending:
    """The latest generated turn, not yet followed by new messages."""

    index: int  # position of its message in Conversation.messages
    content: str
    stop_text: str


class Conversation:
    """Token ids, logprobs and loss mask of one rollout, kept in step with its messages.

    Args:
        tokenizer: a transformers tokenizer with a chat template (or a :class:`ChatTokenizer`).
        messages: initial messages (system/user...), OpenAI format. Copied.
        tools: tool schemas rendered by the template (``tools=``).
        max_context_tokens: the model's context (tokens); prompt + all turns never exceed it.
        window: render only head + the latest two turns per step (O(1) in history); False: whole conversation.
        family: the model family (a key of :data:`prorl_server.llm.chat_templates.FAMILIES`); None: detected from
            the tokenizer's chat template. Ignored when ``tokenizer`` is a :class:`ChatTokenizer`.

    Raises:
        ContextLengthError: the initial prompt already fills the context.
        ValueError: no messages, or an unknown ``family``.

    Use :meth:`create` from async code: it tokenizes a long initial prompt in a worker thread.
    """

    def __init__(self, tokenizer: Any, messages: Sequence[dict], *, max_context_tokens: int,
                 tools: Optional[Sequence[dict]] = None, chat_template_kwargs: Optional[dict[str, Any]] = None,
                 window: bool = True, family: Optional[str] = None) -> None:
        self.tok = tokenizer if isinstance(tokenizer, ChatTokenizer) else ChatTokenizer(
            tokenizer, tools, chat_template_kwargs, family)
        self.messages: list[dict] = [dict(m) for m in messages]
        if not self.messages:
            raise ValueError("a conversation needs at least one message")
        self.max_context_tokens = int(max_context_tokens)
        self.window = window
        self._generated: set[int] = set()  # id() of the assistant messages this conversation generated
        self._head = self.messages[:_head_len(self.messages)]
        text, ids = self.tok.render_prompt(self._views(self.messages))
        if len(ids) >= self.max_context_tokens:
            raise ContextLengthError(f"prompt is {len(ids)} tokens; the context holds {self.max_context_tokens}")
        self._prefix_text = text  # window=False: render(messages so far, add_generation_prompt=True)
        self._win_start = len(self._head)  # window=True: first message after the head that the window renders
        # window=True: (win_start, end, text) of the last rendering of head + messages[win_start:end] with the
        # generation prompt; the first delta's "before" is the initial prompt's rendering (one render saved)
        self._win_text: Optional[tuple[int, int, str]] = (len(self._head), len(self.messages), text)
        self._seg = _Segment(prompt_len=len(ids), ids=ids)
        self._done: list[_Segment] = []
        self._pending: Optional[_Pending] = None
        self.finish_reason: Optional[str] = None
        self.metrics: dict[str, int] = {"segments": 1, "splits": 0, "generated_tokens": 0,
                                        "observation_tokens": 0, "refused_messages": 0}
        self._split_reasons: Counter[str] = Counter()
        self._continued = 0
        self._rerendered_chars = 0
        #: one :class:`~prorl_server.types.TurnRecord` per generated turn (``trajectory_index``: the segment's
        #: index in :meth:`trajectories`); their times (``t_llm_s + t_tool_critical_s + t_wait_s``) partition
        #: this conversation's life from its creation to
        #: the last :meth:`add_completion` / :meth:`record_tools` (host ``time.monotonic``)
        self.turns: list[TurnRecord] = []
        self._mark = time.monotonic()

    @classmethod
    async def create(cls, tokenizer: Any, messages: Sequence[dict], **kwargs: Any) -> "Conversation":
        """Like the constructor; a long initial prompt is rendered and tokenized off the event loop."""
        if _render_chars(messages) > OFFLOAD_CHARS:
            return await asyncio.to_thread(cls, tokenizer, messages, **kwargs)
        return cls(tokenizer, messages, **kwargs)

    # ------------------------------------------------------------------ state
    @property
    def token_ids(self) -> list[int]:
        """The current context (prompt + response of the open segment): what the next turn is sent.
        The live list; do not modify it."""
        return self._seg.ids

    @property
    def num_tokens(self) -> int:
        return len(self._seg.ids)

    @property
    def routes_held(self) -> int:
        """Positions of the open segment whose routed experts (R3) are recorded (0: none): a turn may ask the
        backend for the routes from there on only (``routed_experts_prompt_start``)."""
        return len(self._seg.routes) if self._seg.routes is not None else 0

    @property
    def room(self) -> int:
        """Tokens that may still be generated before the context is full."""
        return self.max_context_tokens - len(self._seg.ids)

    @property
    def num_turns(self) -> int:
        """Assistant turns generated so far (all segments)."""
        return self._seg.num_turns + sum(s.num_turns for s in self._done)

    # ------------------------------------------------------------------ turns
    def add_completion(self, completion: "Completion", at: Optional[float] = None) -> dict:
        """Append one generated turn as-is; returns its assistant message (appended to :attr:`messages`).

        The message's ``content`` is the decoded generated text (special tokens kept; a final stop token
        that the template writes after the content anyway is left out). Tool calls stay inside it verbatim; callers may add an informational ``tool_calls`` key.
        ``at``: when the turn's generation ended (host ``time.monotonic`` seconds, not before the previous turn's
        end; default now), for a turn appended later than it was generated (a gateway ``n > 1`` choice joins
        when the agent's next request says which it continued): its record's times end there.

        Raises:
            RuntimeError: the turn does not fit (the caller must cap ``max_tokens`` at :attr:`room`).
        """
        ids = completion.token_ids
        if len(ids) > self.room:
            raise RuntimeError(f"{len(ids)} generated tokens exceed the {self.room} left in the context")
        content = None
        stop_text = ""
        # vLLM keeps the EOS / stop_token_ids token in token_ids; a stop *string* is ordinary text. The stop
        # token is left out of the message's content only if it is what the template writes after an
        # assistant turn anyway (ChatML's <|im_end|>); another one (e.g. <|endoftext|>) stays in the content,
        # so rendering the messages reproduces the tokens.
        if completion.finish_reason == "stop" and ids and not isinstance(completion.stop_reason, str):
            last = self.tok.decode(ids[-1:])
            terminator = self.tok.assistant_terminator()
            if terminator is None or (last and terminator.startswith(last)):
                content, stop_text = self.tok.decode(ids[:-1]), last
        if content is None:
            content = self.tok.decode(ids)
        seg = self._seg
        start = len(seg.ids) - seg.prompt_len
        now = time.monotonic() if at is None else max(self._mark, min(at, time.monotonic()))
        llm_s = max(0.0, min(completion.llm_s, now - self._mark))
        # everything since the previous turn's end that was not generation is the system's: the client's
        # waits (completion.wait_s: queue, swap hold, failover), rendering the observations in between
        self.turns.append(TurnRecord(
            trajectory_index=len(self._done), response_start=start, response_end=start + len(ids),
            weight_version=completion.weight_versions[-1] if completion.weight_versions else None,
            finish_reason=completion.finish_reason, t_llm_s=llm_s, t_wait_s=now - self._mark - llm_s))
        self._mark = now
        seg.add_routes(completion.routed_experts_start, completion.routed_experts)
        seg.ids.extend(ids)
        seg.logprobs.extend(completion.logprobs)
        seg.mask.extend([1] * len(ids))
        seg.num_turns += 1
        for v in completion.weight_versions:
            if v not in seg.weight_versions:
                seg.weight_versions.append(v)
        runs = completion.version_runs or ([[completion.weight_versions[-1] if completion.weight_versions else
                                              None, len(ids)]] if ids else [])
        if len(runs) > 1 or (runs and runs[0][0] is None and len(completion.weight_versions) > 1):
            seg.mixed_version_turns += 1
        for v, k in runs:
            if seg.version_runs and seg.version_runs[-1][0] == v:
                seg.version_runs[-1][1] += k
            else:
                seg.version_runs.append([v, k])
        message = {"role": "assistant", "content": content}
        self.messages.append(message)
        self._generated.add(id(message))
        self._pending = _Pending(index=len(self.messages) - 1, content=content, stop_text=stop_text)
        self.metrics["generated_tokens"] += len(ids)
        return message

    async def add_messages(self, new: Sequence[dict]) -> bool:
        """Append new messages (tool observations, user turns) after the latest generated turn, ending with
        the template's generation prompt for the next turn.

        Returns:
            False if they would leave no room to generate (nothing is appended: the rollout should stop with
            ``finish_reason="length"``); True otherwise.

        Raises:
            RuntimeError: not preceded by :meth:`add_completion` (every batch of new messages follows a turn).
        """
        if self._pending is None:
            raise RuntimeError("add_messages must follow add_completion (send all of a turn's messages at once)")
        new = [dict(m) for m in new]
        if _render_chars(new) > OFFLOAD_CHARS:
            plan = await asyncio.to_thread(self._plan_delta, new)
        else:
            plan = self._plan_delta(new)
        kind, ids, text, reason, rerendered = plan
        if kind == "split":
            if len(ids) >= self.max_context_tokens:
                self.metrics["refused_messages"] += len(new)
                return False
            self._seg.finish_reason = "split"
            self._seg.split_reason = reason
            self._done.append(self._seg)
            self._seg = _Segment(prompt_len=len(ids), ids=ids)
            self.metrics["segments"] += 1
            self.metrics["splits"] += 1
            self._split_reasons[reason.split(":", 1)[0]] += 1
        else:
            if len(self._seg.ids) + len(ids) >= self.max_context_tokens:
                self.metrics["refused_messages"] += len(new)
                return False
            seg = self._seg
            seg.ids.extend(ids)
            seg.logprobs.extend([0.0] * len(ids))
            seg.mask.extend([0] * len(ids))
            self.metrics["observation_tokens"] += len(ids)
            if kind == "continue":
                self._continued += 1
                self._rerendered_chars += rerendered
        self._win_start = self._pending.index
        self.messages.extend(new)
        if not self.window:
            self._prefix_text = text
        self._pending = None
        return True

    def _views(self, messages: Sequence[dict]) -> list[dict]:
        """What the template is given: generated turns as their raw text; tool observations in the role the
        family has for them (Gemma has no tool role: a ``user`` turn)."""
        gen = self._generated
        role = self.tok.family.tool_role
        return [_generated_view(m) if id(m) in gen else
                {**m, "role": role} if role != "tool" and m.get("role") == "tool" else m for m in messages]

    def _plan_delta(self, new: list[dict]) -> tuple[str, list[int], str, Optional[str], int]:
        """(kind, ids, rendering of everything with the generation prompt, split reason, re-rendered chars):
        ("append", delta ids, ...) when the template renders the latest turn verbatim, ("continue", delta ids,
        ...) when it renders it differently but keeps its text, ("split", full prompt ids, ..., reason)."""
        p = self._pending
        assert p is not None
        render = self.tok.render
        new = self._views(new)
        if self.window:
            ctx = self._head + self._views(self.messages[self._win_start:p.index])
            cached = self._win_text
            if cached is not None and cached[0] == self._win_start and cached[1] == p.index:
                before = cached[2]
            else:
                before = render(ctx, add_generation_prompt=True)
        else:
            ctx = self._views(self.messages[:p.index])
            before = self._prefix_text
        turn = self._views(self.messages[p.index:p.index + 1])
        text = render(ctx + turn + new, add_generation_prompt=True)
        if text.startswith(before) and text.startswith(p.content, len(before)):
            pos = len(before) + len(p.content)
            if p.stop_text and text.startswith(p.stop_text, pos):
                pos += len(p.stop_text)
            return "append", self.tok.encode(text[pos:]), text, None, 0
        # The template renders the latest turn differently from what was generated: keep the generated tokens
        # if it only reformats them, split if it drops some of them or changes what came before.
        hist = render(ctx, add_generation_prompt=False)
        reason = None
        appends = text.startswith(hist)
        squashed = _squash(text[len(hist):] if appends else text)
        shown = [p.content] if appends else [m["content"] for m in self.messages[self._win_start:p.index + 1]
                                             if id(m) in self._generated] + [p.content]
        if not all(_squash(c) in squashed for c in shown):
            reason = "template_drops_generated_text: the template leaves out text the model generated " \
                     f"({self.tok.family.rewrites_history or 'e.g. its reasoning'})"
        elif not appends:
            reason = "template_not_append_only: the new rendering changes text before the latest turn"
        else:
            delta = self._continuation(new, p)
            if delta is None:
                reason = "template_not_append_only: the new messages do not extend a rendered assistant turn"
            else:
                return "continue", self.tok.encode(delta), text, None, len(p.content)
        full = text if not self.window else render(self._views(self.messages) + new, add_generation_prompt=True)
        return "split", self.tok.encode(full), full, reason, 0

    def _continuation(self, new: list[dict], p: "_Pending") -> Optional[str]:
        """Text following a generated turn that the template would render differently: the rest of the
        assistant terminator the model did not generate, then ``new`` and the generation prompt as rendered
        after a synthetic assistant turn (verl's ``ContinuousTokenBuilder`` rule). None: the template renders
        nothing that extends such a turn."""
        terminator = self.tok.assistant_terminator() or ""
        if p.stop_text and terminator.startswith(p.stop_text):
            boundary = terminator[len(p.stop_text):]
        else:
            boundary = terminator
        for max_calls in (None, 1):  # Llama 3.1 renders one tool call per assistant turn
            ctx = self._head + [synthetic_assistant(new, max_calls)]
            try:
                a = self.tok.render(ctx, add_generation_prompt=False)
                b = self.tok.render(ctx + new, add_generation_prompt=True)
            except Exception:  # the template refuses the synthetic turn (jinja raise_exception)
                continue
            if b.startswith(a):
                return boundary + b[len(a):]
        return None

    def token_stats(self) -> dict[str, Any]:
        """How true the token stream stayed to the chat template (the drift report).

        Returns:
            ``{"family": str, "turns": int, "splits": {reason_code: count}, "continued": int,
            "rerendered_chars": int}``: ``turns`` generated turns; ``splits`` segments closed because the template
            rewrote history, by reason code (the ``split_reason`` text before ``":"``); ``continued`` turns the
            template would render differently (reformatting only) that were kept as generated;
            ``rerendered_chars`` characters of generated text in those turns.
        """
        return {"family": self.tok.family.name, "turns": self.num_turns, "splits": dict(self._split_reasons),
                "continued": self._continued, "rerendered_chars": self._rerendered_chars}

    def since_last_turn(self) -> float:
        """Seconds (host ``time.monotonic``) since the latest turn was appended or charged with its tools."""
        return time.monotonic() - self._mark

    def record_tools(self, t_tool_s: float, t_tool_critical_s: Optional[float] = None) -> None:
        """Charge the latest turn with its tool calls: ``t_tool_s`` seconds (their sum), ``t_tool_critical_s``
        their critical path, the wall time they took (default ``t_tool_s``: run one after another). The rest of
        the time since the turn was appended is its ``t_wait_s``, so ``t_llm_s + t_tool_critical_s + t_wait_s``
        partition the conversation's life (calls run side by side make the sum ``t_tool_s`` longer than the
        wall time they took). Does nothing before the first turn. Times: host ``time.monotonic`` seconds
        measured by the caller around the calls, never a value a tool returned."""
        if not self.turns:
            return
        now = time.monotonic()
        span = now - self._mark
        crit = max(0.0, min(t_tool_s if t_tool_critical_s is None else t_tool_critical_s, span))
        rec = self.turns[-1]
        rec.t_tool_s += max(crit, t_tool_s)
        rec.t_tool_critical_s += crit
        rec.t_wait_s += span - crit
        self._mark = now

    # ------------------------------------------------------------------ results
    def finish(self, reason: str) -> None:
        """Record why the rollout ended ("stop", "length", "max_turns", ...) on the open segment."""
        self.finish_reason = reason
        self._seg.finish_reason = reason

    def trajectories(self) -> list[Trajectory]:
        """All segments in order (one unless the template forced a split), as wire ``Trajectory`` objects."""
        return [s.to_trajectory() for s in [*self._done, self._seg]]
