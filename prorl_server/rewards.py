"""Named reward components (issue #35 part 2): the composition a handler reports, the check the server makes
before it answers, the split over turns, and the host-computed process terms the shipped handlers share.

A result's ``reward`` is the weighted sum of its ``reward_components`` (:class:`~prorl_server.types.RewardComponent`,
``math.fsum`` of ``weight * value``): ``outcome`` (the task's score, weight 1) and the process terms a handler
declares in ``AgentHandler.reward_terms``. A process term's weight is 0 unless the request names it in
``reward_weights``, so by default ``reward`` is the outcome alone, bit for bit, as before components existed.
The design follows NeMo Gym's ``reward_components`` and verifiers' weighted rubrics; the process terms are the
dense penalties of MiniMax's Forge (tool-invocation errors, language mixing).

Every process term here is computed on the host from what the server recorded (the turn records and the
generated text of the assistant messages), never from anything the policy wrote into a sandbox, and every one
here is a penalty (value in [-1, 0]): a constant, empty or silent answer can earn no process credit that a right
answer does not also get. (A handler's own terms may be credits: ``shout``'s ``turn_scores`` is in [0, 1], 0 for
an empty turn.) ``prorl-journal regrade`` recomputes them from the same record
(:func:`prorl_server.pipeline.handler_result` applies :func:`finalize` in both places).
"""
from __future__ import annotations

import asyncio
import collections
import functools
import math
import unicodedata
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional, TypeVar

from pydantic import ValidationError

from prorl_server.types import JobResult, RewardComponent

if TYPE_CHECKING:
    from prorl_server.job import Job

_T = TypeVar("_T")

#: The component every result has: the task's own score (weight 1).
OUTCOME = "outcome"
#: The server's own component of relative completion time (:mod:`prorl_server.completion_time`), added when a
#: request with ``completion_time: true`` names it in ``reward_weights``; no handler may declare it.
SPEED = "speed"
#: Largest ``|reward - sum(weight * value)|`` the server accepts, relative to ``max(1, sum |weight * value|)``.
TOLERANCE = 1e-12

#: Process term: the share of the job's turns whose tool calls did not parse, negated (value in [-1, 0]).
TOOL_CALL_ERRORS = "tool_call_errors"
#: Process term: the mean over assistant turns of the share of letters outside the turn's main script,
#: negated (value in [-1, 0]).
LANGUAGE_MIXING = "language_mixing"
#: The process terms every tool-using shipped handler declares.
STANDARD_TERMS: tuple[str, ...] = (TOOL_CALL_ERRORS, LANGUAGE_MIXING)


class RewardComponentError(ValueError):
    """A handler's components do not make its reward: a non-finite or malformed component, a name it did not
    declare, a ``per_turn`` of the wrong length or sum, or a weighted sum that is not ``reward``. The message
    names the component. The job fails as a handler fault (``failure_kind="handler"``, filtered)."""


def weighted_sum(components: Mapping[str, RewardComponent]) -> float:
    """``math.fsum(weight * value)`` over ``components`` (correctly rounded, so independent of their order)."""
    return math.fsum(c.weight * c.value for c in components.values())


def compose_reward(job: "Job", outcome: float, terms: Optional[Mapping[str, RewardComponent]] = None, *,
                   outcome_per_turn: Optional[list[float]] = None) -> float:
    """Set ``job.reward_components`` to ``outcome`` (weight 1; ``outcome_per_turn``: its split over the job's
    turns, None: all of it on the last turn) plus ``terms``, and ``job.reward`` to their weighted sum, which it
    returns. Call it at the end of ``eval`` instead of setting ``job.reward``.

    Raises:
        ValueError: ``terms`` names ``outcome``.
    """
    if terms and OUTCOME in terms:
        raise ValueError("the outcome is its own argument, not a term")
    components = {OUTCOME: RewardComponent(value=float(outcome), weight=1.0, per_turn=outcome_per_turn),
                  **(terms or {})}
    job.reward_components = components
    job.reward = weighted_sum(components)
    return job.reward


def turn_records(job: "Job") -> list[Any]:
    """The job's turn records (``job.turns``: one per generated turn, in order), or [] without them."""
    turns = getattr(job, "turns", None)
    return list(turns) if isinstance(turns, list) else []


def process_terms(job: "Job", names: Iterable[str] = STANDARD_TERMS,
                  texts: Optional[list[str]] = None) -> dict[str, RewardComponent]:
    """The standard process terms ``names`` (of :data:`STANDARD_TERMS`) of ``job``, each weighted with the
    request's ``reward_weights`` (0 when not named there), computed from its turn records and messages.
    ``texts``: the generated text of each turn, when the messages are not the server's own record of it (a
    gateway session's history is what the agent program sent: :func:`generated_texts` decodes the tokens).

    Raises:
        ValueError: a name that is not a standard term.
    """
    weights = getattr(job, "reward_weights", None) or {}
    out: dict[str, RewardComponent] = {}
    for name in names:
        if name == TOOL_CALL_ERRORS:
            value, per_turn = tool_call_error_share(turn_records(job))
        elif name == LANGUAGE_MIXING:
            msgs = job.messages if texts is None else [{"role": "assistant", "content": t} for t in texts]
            value, per_turn = language_mixing(msgs, len(turn_records(job)))
        else:
            raise ValueError(f"{name!r} is not a standard process term ({', '.join(STANDARD_TERMS)})")
        out[name] = RewardComponent(value=value, weight=float(weights.get(name, 0.0)), per_turn=per_turn)
    return out


#: Characters of generated text up to which host scoring runs on the event loop (:func:`off_loop`): the worst
#: such text for :func:`mixing_share` (2,048 distinct letters) costs ~1.2 ms here, a hop to a thread and back
#: ~0.2 ms of CPU (0.4 ms wall) on this 2-core machine.
INLINE_CHARS = 2048


async def off_loop(fn: Callable[..., _T], *args: Any, chars: int) -> _T:
    """``fn(*args)`` off the event loop (``asyncio.to_thread``) when it reads more than :data:`INLINE_CHARS`
    characters (``chars``) of generated text, else inline. For host scoring of what the policy generated: its
    cost grows with the text (a 262,144-character turn of 32,768 distinct letters: ~50 ms of language mixing),
    and on the loop it would stall every other job's I/O for as long. ``fn`` must only read the job (its eval
    awaits the call, so nothing of the job changes meanwhile); from the thread it holds the GIL at most a switch
    interval (``sys.getswitchinterval``, 5 ms) plus its longest C call at a time. Raises what ``fn`` raises."""
    if chars <= INLINE_CHARS:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


async def process_terms_async(job: "Job", names: Iterable[str] = STANDARD_TERMS,
                              texts: Optional[list[str]] = None) -> dict[str, RewardComponent]:
    """:func:`process_terms` (the same values), computed off the event loop when its text is long
    (:func:`off_loop`; only non-ASCII text counts: an ASCII turn costs one ``str.isascii``, O(1) in CPython).
    What a handler's ``eval`` awaits. Raises what :func:`process_terms` raises."""
    seen = texts if texts is not None else [m.get("content") for m in job.messages
                                            if isinstance(m, dict) and m.get("role") == "assistant"]
    chars = sum(len(t) for t in seen if isinstance(t, str) and not t.isascii())
    return await off_loop(process_terms, job, tuple(names), texts, chars=chars)


def tool_call_error_share(turns: list[Any]) -> tuple[float, Optional[list[float]]]:
    """``(value, per_turn)`` of :data:`TOOL_CALL_ERRORS`: turn i gets ``-1/n`` when its tool calls had a parse
    error (``tool_call_errors > 0`` in its record, counted by the server's tool-call parser), else 0; the value
    is their sum. ``(0.0, None)`` for a job without turn records."""
    n = len(turns)
    if not n:
        return 0.0, None
    per = [-1.0 / n if (getattr(t, "tool_call_errors", 0) or 0) > 0 else 0.0 for t in turns]
    return math.fsum(per), per


def generated_texts(trajectories: list[Any], tokenizer: Any) -> list[str]:
    """The text of each generated span (one a turn: the runs of ``loss_mask`` 1, in order) of ``trajectories``,
    decoded from the recorded token ids with ``tokenizer``, whole: a turn is bounded by the tokens the server
    generated for it, and a cut would let padding hide what follows (red team R3)."""
    return [tokenizer.decode(ids, skip_special_tokens=True)
            for t in trajectories for _, ids in t.spans()]


#: Distinct non-ASCII characters :func:`mixing_share` counts one by one (``str.count``, then ``str.replace`` to
#: drop them: O(distinct x length) at C speed); those left after are counted in one ``collections.Counter`` pass.
_COUNT_DISTINCT = 64
#: Characters one ``Counter.update`` call of :func:`mixing_share` counts: a C call holds the GIL throughout (one
#: pass over 262,144 distinct letters: ~25 ms, an event-loop stall even from a worker thread); a chunk ~1.5 ms.
_COUNTER_CHUNK = 1 << 14
#: Unicode scripts that one language writes together, as one group (Japanese mixes Han and kana).
_SCRIPT_GROUP = {"CJK": "CJK", "HIRAGANA": "CJK", "KATAKANA": "CJK", "BOPOMOFO": "CJK", "IDEOGRAPHIC": "CJK",
                 "HALFWIDTH": "CJK", "FULLWIDTH": "LATIN"}
_ASCII_BYTES = bytes(range(128))
_ASCII_LETTERS = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"  # the ASCII characters str.isalpha accepts


def _script_group(ch: str) -> str:
    """The script group of the non-ASCII letter ``ch``: the first word of its Unicode name, grouped by
    :data:`_SCRIPT_GROUP`."""
    word = unicodedata.name(ch, "UNKNOWN").split(" ", 1)[0]
    return _SCRIPT_GROUP.get(word, word)


#: :func:`_script_group` of the letters of turns with few distinct characters, remembered: a pure function of the
#: character, so exact; bounded (a language's letters are a few hundred; a miss costs only the lookup), and the
#: many-distinct path of :func:`mixing_share` bypasses it so one adversarial turn does not flush it.
_cached_script_group = functools.lru_cache(maxsize=4096)(_script_group)


def mixing_share(text: str) -> float:
    """The share of the letters of ``text`` that are not in its most frequent script, in [0, 1); 0.0 for text with
    no letter or in one script. A letter's script is the first word of its Unicode name (``LATIN``, ``CYRILLIC``,
    ``GREEK``, ``ARABIC``, ``HANGUL``, ...; Han, kana and Bopomofo count as one CJK script), from the standard
    library's ``unicodedata``.

    The whole text is read (red team R3: reading only its first 16,384 characters let 16,400 ASCII letters of
    padding hide any mixing); ``text`` is one generated turn, bounded by the tokens the server generated. The
    cost is linear at C speed: an ASCII turn is one ``str.isascii`` call, other text C-speed counts and one
    Unicode-name lookup per distinct letter (``benchmarks/reward_components.py`` measures a 256k-character turn).
    """
    if text.isascii():  # the common case, at C speed: every letter is Latin
        return 0.0
    # Iterating a non-ASCII str makes one object per character (~35 ns each: 30 us of an 850-character turn), so
    # the counting stays in C: the ASCII letters (all Latin) through bytes, then each distinct non-ASCII
    # character with str.count. Dropping ASCII bytes from UTF-8 keeps every multi-byte sequence whole.
    ascii_part = text.encode("ascii", "ignore")
    latin = len(ascii_part) - len(ascii_part.translate(None, _ASCII_LETTERS))
    counts: dict[str, int] = {"LATIN": latin} if latin else {}
    rest = text.encode("utf-8", "surrogatepass").translate(None, _ASCII_BYTES).decode("utf-8", "surrogatepass")
    counted = ""  # a character counted but left in ``rest`` (see below)
    for _ in range(_COUNT_DISTINCT):
        if not rest:
            break
        ch = rest[0]
        k = rest.count(ch)
        if ch.isalpha():
            group = _cached_script_group(ch)
            counts[group] = counts.get(group, 0) + k
        if k * _COUNT_DISTINCT < len(rest):
            # A rare character: many distinct ones are likely left, and each further pass would copy all of
            # ``rest`` to drop little of it (a 256k-character turn of 32k distinct letters: 35 of its ~110 ms).
            counted = ch
            break
        rest = rest.replace(ch, "")
    if rest:  # many distinct characters: Counter passes (C) over the rest
        counter: collections.Counter[str] = collections.Counter()
        for i in range(0, len(rest), _COUNTER_CHUNK):
            counter.update(rest[i:i + _COUNTER_CHUNK])
        for ch, k in counter.items():
            if ch.isalpha() and ch != counted:
                group = _script_group(ch)
                counts[group] = counts.get(group, 0) + k
    total = sum(counts.values())
    return 0.0 if total == 0 else 1.0 - max(counts.values()) / total


def language_mixing(messages: list[dict[str, Any]], n_turns: int) -> tuple[float, Optional[list[float]]]:
    """``(value, per_turn)`` of :data:`LANGUAGE_MIXING`: minus the mean :func:`mixing_share` of the assistant
    messages' text (the generated text, recorded by the server). ``per_turn`` when there is one assistant
    message per turn (``n_turns``, the tool agent loop), else None (the value is the last turn's)."""
    texts = [m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "assistant"]
    texts = [t if isinstance(t, str) else "" for t in texts]
    if not texts:
        return 0.0, ([0.0] * n_turns if n_turns else None)
    per = [(0.0 - mixing_share(t)) / len(texts) for t in texts]  # 0.0, never -0.0, for a clean turn
    return math.fsum(per), (per if len(per) == n_turns else None)


def _fault(result: JobResult, why: str) -> JobResult:
    return result.model_copy(update={
        "reward": 0.0, "resolved": False, "failure_kind": "handler", "filter": True,
        "critical_error": result.critical_error or "eval",
        "error": f"reward components: {why}",
        "reward_components": {OUTCOME: RewardComponent(value=0.0, weight=1.0)}})


def _check(result: JobResult, raw: Any, declared: Iterable[str], n_turns: int) -> dict[str, RewardComponent]:
    """``raw`` (name -> RewardComponent or its dict) validated against ``result`` (see
    :class:`RewardComponentError`)."""
    if not isinstance(raw, Mapping):
        raise RewardComponentError(f"must be a mapping of name to component, not {type(raw).__name__}")
    allowed = {OUTCOME, *declared}
    comps: dict[str, RewardComponent] = {}
    for name, c in raw.items():
        if name not in allowed:
            raise RewardComponentError(f"component {str(name)[:64]!r} is not one the handler declares "
                                       f"(AgentHandler.reward_terms: {sorted(allowed)})")
        try:
            comp = RewardComponent.model_validate(c.model_dump() if isinstance(c, RewardComponent) else c)
        except ValidationError as e:
            raise RewardComponentError(f"component {name!r} is malformed or not finite: "
                                       f"{e.errors(include_url=False)[0]['msg']}") from None
        if comp.per_turn is not None:
            if len(comp.per_turn) != n_turns:
                raise RewardComponentError(f"component {name!r} has {len(comp.per_turn)} per-turn values for "
                                           f"{n_turns} turns")
            if abs(math.fsum(comp.per_turn) - comp.value) > TOLERANCE * max(1.0, math.fsum(map(abs, comp.per_turn))):
                raise RewardComponentError(f"component {name!r}: its per-turn values sum to "
                                           f"{math.fsum(comp.per_turn)!r}, not its value {comp.value!r}")
        comps[name] = comp
    if OUTCOME not in comps:
        raise RewardComponentError(f"there is no {OUTCOME!r} component")
    total = weighted_sum(comps)
    scale = max(1.0, math.fsum(abs(c.weight * c.value) for c in comps.values()))
    if not math.isfinite(total) or abs(total - result.reward) > TOLERANCE * scale:
        terms = " + ".join(f"{c.weight!r} * {n}={c.value!r}" for n, c in comps.items())
        raise RewardComponentError(f"reward {result.reward!r} is not the weighted sum of the components "
                                   f"({terms} = {total!r})")
    return comps


def finalize(result: JobResult, raw: Any, declared: Iterable[str] = ()) -> JobResult:
    """``result`` with its ``reward_components`` checked and each turn record's ``reward`` filled.

    ``raw``: what the handler reported (``job.reward_components``, or the components its own ``final_result``
    put on the result); None: ``{"outcome": {value: reward, weight: 1}}``, as for a handler written before
    components. A failed job (a ``failure_kind``) keeps only its outcome: a failure earns no process term.
    Components that do not make the reward (:class:`RewardComponentError`) fail the job as a handler fault:
    reward 0.0, ``failure_kind="handler"``, ``filter: true``, ``error`` naming the component.

    Turn ``i``'s ``reward`` is ``sum(weight * per_turn[i])`` over the components with ``per_turn``, the last turn
    also taking ``weight * value`` of those without, and the rounding rest, so the turns sum to ``reward``
    (``math.fsum``) to one rounding step, within :data:`TOLERANCE`.
    """
    turns = list(getattr(result, "turns", None) or [])
    if result.failure_kind is not None or raw is None:
        comps = {OUTCOME: RewardComponent(value=result.reward, weight=1.0)}
    else:
        try:
            comps = _check(result, raw, declared, len(turns))
        except RewardComponentError as e:
            result, comps = _fault(result, str(e)), None
            turns = list(getattr(result, "turns", None) or [])
    if comps is None:
        comps = dict(result.reward_components)
    update: dict[str, Any] = {"reward_components": comps}
    if turns:
        shares = [math.fsum(c.weight * c.per_turn[i] for c in comps.values() if c.per_turn is not None)
                  for i in range(len(turns))]
        shares[-1] = result.reward - math.fsum(shares[:-1])
        update["turns"] = [t.model_copy(update={"reward": s}) for t, s in zip(turns, shares)]
    return result.model_copy(update=update)
