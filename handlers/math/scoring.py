"""Reward for the ``math`` handler: the last ``\\boxed{...}`` of the final answer, checked with math-verify
(inline instances) or with reasoning-gym's own ``score_answer`` (reasoning-gym instances).

:func:`score` is CPU-bound (sympy) and may take seconds on an adversarial answer: the handler runs it in the
server's CPU process pool (``job.run_cpu``), never on the event loop. It imports its heavy modules
(math-verify, sympy, reasoning-gym) when first called, so importing this module costs nothing.

The rules an answer must pass (the policy is an adversary; see README.md here, "Scoring rules"):

1. Only the last top-level box counts (``\\boxed{..}`` or ``\\fbox{..}``, balanced braces); a box inside it
   makes the answer ambiguous and scores 0.0; so does an empty box or one longer than
   :data:`MAX_ANSWER_CHARS`.
2. The box's content is parsed as one expression, as a whole: no fallback to a fragment of it (math-verify's
   default extraction would read ``\\boxed{@@ $2$}`` as ``2`` and ``\\boxed{2 \\lor 3}`` as ``3``).
3. Shapes must agree: a set, tuple, interval or matrix answer only matches a gold of a compatible shape,
   and a number only a number (``\\boxed{1, 2, 3}``, ``\\boxed{[1, 3]}``, ``\\boxed{\\{2\\}}`` never match
   gold ``2``); ``x = v`` is read as ``v``.
4. Equality is math-verify's strict symbolic one, and numbers must also agree within a relative
   :data:`REL_TOL` (math-verify alone compares floats at 6 absolute decimals): a free variable the gold does not have never matches
   unless it cancels (``\\boxed{x}`` never matches a number; ``\\sin^2 x + \\cos^2 x`` matches ``1``).
5. Parsing and each comparison run under math-verify's own time limits (``signal.alarm``: the caller must
   be a process's main thread, as a pool worker is); an answer that makes them time out scores 0.0 with
   ``info["reason"]``.
6. reasoning-gym instances: the task's own scorer decides, the reward is 1.0 only when it gives full
   credit (its partial credit, e.g. string similarity, would reward listing candidates; the raw score is
   kept in ``info["scorer_score"]``), and for a numeric gold a boxed set/tuple/interval scores 0.0.
   Several of those scorers evaluate the answer as Python (``eval``, sympy's ``parse_expr``): an answer
   reaches a scorer only if it matches the task's answer grammar (:mod:`handlers.math.rg_answers`, a language
   in which nothing can be called or imported), and a scorer that raises on it scores 0.0. Its full credit
   counts only if the answer also passes the task's soundness check (``rg_answers.soundness_error``: several
   scorers pay wrong answers, such as ``nan`` or a constant).
"""
from __future__ import annotations

import functools
import math
import re
from typing import Any, Optional

CPU_PRELOAD = ("math_verify",)
"""Imported by a CPU pool worker before its first call of :func:`score` (not charged to the call's limit);
reasoning-gym (2 s, 115 MB) is imported on the first reasoning-gym instance only."""
MAX_ANSWER_CHARS = 2000
"""Longest boxed answer scored, characters (a 10x10 matrix of fractions fits; a gold answer is far shorter)."""
PARSE_TIMEOUT_S = 5
"""math-verify's limit for parsing one expression, whole seconds (``signal.alarm``)."""
VERIFY_TIMEOUT_S = 5
REL_TOL = 1e-6
"""Numbers match within this relative tolerance (and math-verify's own equality), never at absolute decimals."""
ZERO_ABS_TOL = 1e-12
"""Against a gold of exactly 0, a number matches within this absolute tolerance."""
"""math-verify's limit for one gold/answer comparison, whole seconds (``signal.alarm``)."""

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_PLAIN_NUMBER = re.compile(r"\s*-?[0-9]{1,40}(?:\.[0-9]{1,40})?\s*")


def _closing_brace(text: str, i: int) -> Optional[int]:
    """Index of the ``}`` closing the group opened just before ``text[i]``; escaped braces (``\\{``) do not
    count. None if it never closes."""
    depth, n = 1, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2  # \{ \} \\ : an escaped character, never a group delimiter
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def last_boxed(text: str) -> Optional[str]:
    """Content of the last top-level ``\\boxed{...}`` / ``\\fbox{...}`` in ``text`` (balanced braces), or None
    (no box, or the last box never closes). A box nested in another is part of the outer one's content."""
    pos, last = 0, None
    while True:
        m = _BOX_OPEN.search(text, pos)
        if m is None:
            return last
        end = _closing_brace(text, m.end())
        if end is None:
            return None
        last, pos = text[m.end():end], end + 1


def _shape(x: Any) -> str:
    """``number``, ``set``, ``tuple``, ``interval``, ``matrix``, ``relation`` or ``text`` (a str); ``v`` for
    ``x = v`` (an equation whose left side is not a number)."""
    from sympy import Basic, MatrixBase, Number, Set, Tuple
    from sympy.core.relational import Equality, Relational
    from sympy.logic.boolalg import BooleanAtom, BooleanFunction

    if isinstance(x, str):
        return "text"
    if isinstance(x, MatrixBase):
        return "matrix"
    if isinstance(x, Equality) and not isinstance(x.lhs, Number):
        return _shape(x.rhs)
    if isinstance(x, (Relational, BooleanFunction, BooleanAtom)):  # not Boolean: a Symbol is one too
        return "relation"
    if isinstance(x, Tuple):
        return "tuple"
    if isinstance(x, Set):
        from sympy import FiniteSet

        return "set" if isinstance(x, FiniteSet) or x.is_empty else "interval"
    return "number" if isinstance(x, Basic) else "text"


# Which answer shapes may match which gold shapes. "(a, b)" parses as an open interval whether it means an
# interval or a point, so tuple and interval are compatible; an inequality denotes an interval.
_COMPATIBLE = {
    "number": {"number"},
    "set": {"set"},
    "tuple": {"tuple", "interval", "matrix"},
    "interval": {"interval", "tuple", "relation", "matrix"},
    "matrix": {"matrix", "tuple", "interval"},
    "relation": {"relation", "interval"},
    "text": {"text"},
}


def _free_symbols(x: Any) -> set:
    """The free symbols of a value: of ``v`` for ``x = v``, of the elements of a set or tuple; none for an
    inequality (its variable is bound: ``1 <= x <= 3`` is the interval ``[1, 3]``)."""
    from sympy import FiniteSet, Number, Tuple
    from sympy.core.relational import Equality, Relational
    from sympy.logic.boolalg import BooleanFunction

    if isinstance(x, Equality) and not isinstance(x.lhs, Number):
        return _free_symbols(x.rhs)
    if isinstance(x, (Relational, BooleanFunction)):
        return set()
    if isinstance(x, (FiniteSet, Tuple)):
        return set().union(*(_free_symbols(e) for e in x.args))
    return set(getattr(x, "free_symbols", ()) or ())


def _numbers_close(gold: Any, pred: Any) -> bool:
    """Whether the numbers of two values math-verify found equal are also within a relative
    :data:`REL_TOL` (rule 4): math-verify compares floats at 6 absolute decimals, so ``4e-7`` equals a gold of
    ``1e-7``. Elements of tuples, matrices and intervals are compared in order, of sets each with its closest;
    what is not a number (an expression with variables, text) is left to math-verify."""
    from sympy import Basic, FiniteSet, Interval, MatrixBase, N, Number, Tuple
    from sympy.core.relational import Equality

    if isinstance(gold, Equality) and not isinstance(gold.lhs, Number):
        gold = gold.rhs
    if isinstance(pred, Equality) and not isinstance(pred.lhs, Number):
        pred = pred.rhs
    if isinstance(gold, (Tuple, MatrixBase)) and isinstance(pred, (Tuple, MatrixBase)):
        g, p = list(gold) if isinstance(gold, Tuple) else list(gold), list(pred)
        return len(g) != len(p) or all(_numbers_close(a, b) for a, b in zip(g, p))
    if isinstance(gold, Interval) and isinstance(pred, Interval):
        return _numbers_close(gold.start, pred.start) and _numbers_close(gold.end, pred.end)
    if isinstance(gold, FiniteSet) and isinstance(pred, FiniteSet):
        return (all(any(_numbers_close(a, b) for a in gold) for b in pred)
                and all(any(_numbers_close(a, b) for b in pred) for a in gold))
    if not (isinstance(gold, Basic) and isinstance(pred, Basic) and gold.is_number and pred.is_number):
        return True
    try:
        g, p = complex(N(gold, 30)), complex(N(pred, 30))
    except (TypeError, ValueError, OverflowError):
        return True  # beyond a float's range: math-verify's exact comparison stands
    if not (math.isfinite(abs(g)) and math.isfinite(abs(p))):
        return g == p
    return abs(g - p) <= (ZERO_ABS_TOL if g == 0 else REL_TOL * max(abs(g), abs(p)))


def _parse_answer(answer: str, timeout_s: int) -> list:
    """math-verify's parse of the box's content as one expression: ``[sympy_value, text]`` or ``[text]``.

    Raises:
        math_verify.errors.TimeoutException: parsing ran past ``timeout_s``.
    """
    from math_verify import LatexExtractionConfig, parse
    from math_verify.errors import TimeoutException

    try:
        # Boxed extraction only, first match only: the whole box parses or nothing does (never a fragment).
        return parse(f"\\boxed{{{answer}}}", extraction_config=[LatexExtractionConfig(boxed_match_priority=0)],
                     fallback_mode="first_match", extraction_mode="first_match",
                     parsing_timeout=timeout_s, raise_on_error=True)
    except TimeoutException:
        raise
    except Exception:  # unparsable: math-verify's own non-raising mode gives [] here too
        return []


@functools.lru_cache(maxsize=256)
def _parse_gold(gold: str, timeout_s: int) -> list:
    """math-verify's parse of the gold answer, or ``[gold]`` (compared as text). Cached: a worker scores a
    group's n answers against one gold, and a long gold (a grid) costs 0.1 s to parse. A timeout is not cached;
    the list is shared, never to be changed."""
    from math_verify import parse
    from math_verify.errors import TimeoutException

    try:
        return parse(f"${gold}$", parsing_timeout=timeout_s, raise_on_error=True)
    except TimeoutException:
        raise
    except Exception:  # not math: compared as text
        return [gold]


@functools.lru_cache(maxsize=None)
def _score_fn(task: str):
    """reasoning-gym's ``score_answer`` of ``task``, built once per worker: building it constructs the task's
    dataset with its default configuration (``group_anagrams`` loads a word list: 0.26 s a call)."""
    from reasoning_gym import get_score_answer_fn

    return get_score_answer_fn(task)


def _compare(gold: list, pred: list, timeout_s: int) -> tuple[bool, Optional[str]]:
    """Whether any (gold, answer) pair matches under the rules; else the reason of the most telling refusal."""
    from math_verify import verify
    from math_verify.errors import TimeoutException

    reason = None
    for g in gold:
        for p in pred:
            gs, ps = _shape(g), _shape(p)
            if (gs == "text") != (ps == "text"):
                continue  # a parsed value never equals a raw string
            if gs not in _COMPATIBLE[ps]:
                reason = reason or f"the answer is a {ps}, the gold answer a {gs}"
                continue
            try:
                if verify(g, p, timeout_seconds=timeout_s, raise_on_error=True):
                    if _numbers_close(g, p):
                        return True, None
                    reason = reason or f"a number further than a relative {REL_TOL:g} from the gold's"
                    continue
            except TimeoutException:
                reason = f"math-verify timed out comparing the answer ({timeout_s} s)"
                continue
            except Exception:  # math-verify's own non-raising mode reads an error as "not equal"
                pass
            # Equality is symbolic (strict mode): a variable the gold lacks only matches if it cancels
            # (sin^2 x + cos^2 x = 1). Named here because it is the usual way of covering many values.
            extra = _free_symbols(p) - _free_symbols(g)
            if extra:
                reason = reason or f"free variables the gold answer does not have: {sorted(map(str, extra))}"
    return False, reason


def score(instance: dict[str, Any], response: str, *, parse_timeout_s: int = PARSE_TIMEOUT_S,
          verify_timeout_s: int = VERIFY_TIMEOUT_S) -> tuple[float, dict[str, Any]]:
    """Reward, 0.0 or 1.0, for ``response`` (the agent's final text), and details for the result.

    Args:
        instance: ``{"answer": str, "rg_entry"?: {...}}`` (see :mod:`handlers.math.data`).
        parse_timeout_s / verify_timeout_s: math-verify's limits, whole seconds; they use ``signal.alarm``,
            so this must run in a process's main thread (a CPU pool worker does).

    Returns:
        ``(reward, info)``; info: ``extracted_answer``, ``scorer`` (``math_verify`` / ``reasoning_gym``),
        ``reason`` when the reward is 0.0 for a reason other than a plainly different value, and
        ``scorer_score`` (reasoning-gym's raw score).
    """
    answer = last_boxed(response)
    info: dict[str, Any] = {"extracted_answer": answer}
    if answer is None:
        info["reason"] = "no \\boxed{} answer"
        return 0.0, info
    if not answer.strip():
        info["reason"] = "empty \\boxed{}"
        return 0.0, info
    if len(answer) > MAX_ANSWER_CHARS:
        info["extracted_answer"] = answer[:200] + "..."
        info["reason"] = f"boxed answer longer than {MAX_ANSWER_CHARS} characters"
        return 0.0, info
    if _BOX_OPEN.search(answer):
        info["reason"] = "a box inside the answer box (several candidate answers)"
        return 0.0, info

    from math_verify.errors import TimeoutException

    entry = instance.get("rg_entry")
    info["scorer"] = "reasoning_gym" if entry is not None else "math_verify"
    if entry is not None:
        from handlers.math.rg_answers import grammar_error

        metadata = entry.get("metadata") or {}
        task, variable = metadata.get("source_dataset"), metadata.get("variable")
        refused = grammar_error(task, answer, variable if isinstance(variable, str) else None)
        if refused is not None:  # never handed to a scorer that would evaluate it
            info["reason"] = refused
            return 0.0, info
    try:
        # A reasoning-gym task with no gold (graph_color, boxnet, rush_hour...: its scorer verifies the answer
        # against the puzzle) has the text "None" here; math-verify reads that as a product of symbols, a
        # "number", and the shape check below refused every right answer.
        no_gold = entry is not None and entry.get("answer") is None
        gold = [] if no_gold else _parse_gold(str(instance["answer"]), parse_timeout_s)
        gold_shapes = {_shape(g) for g in gold} - {"text"}
        # A reasoning-gym answer is parsed only to refuse a set/tuple for a numeric gold: a plain number is
        # one, and against any other gold the parse (the costliest step) decides nothing.
        pred = ([] if entry is not None and (gold_shapes != {"number"} or _PLAIN_NUMBER.fullmatch(answer))
                else _parse_answer(answer, parse_timeout_s))
    except TimeoutException:
        info["reason"] = f"math-verify timed out parsing ({parse_timeout_s} s)"
        return 0.0, info

    if entry is not None:
        pred_shapes = {_shape(p) for p in pred} - {"text"}
        if gold_shapes == {"number"} and pred_shapes and pred_shapes != {"number"}:
            info["reason"] = f"the answer is a {pred_shapes.pop()}, the gold answer a number"
            return 0.0, info
        fn = _score_fn(task)
        from handlers.math.rg_answers import entry_for_scorer

        try:
            raw = float(fn(answer, entry_for_scorer(task, entry)))
        except Exception as e:  # the scorer choked on the answer (RecursionError, MemoryError...): the answer's 0.0
            info["reason"] = f"the reasoning-gym scorer raised {type(e).__name__} on the answer"
            return 0.0, info
        info["scorer_score"] = raw
        if raw < 1.0 and raw > 0.0:
            info["reason"] = "partial credit from the reasoning-gym scorer counts as 0.0"
        if raw >= 1.0:
            # Its full credit is not proof (rule 7): the task's own check must agree (rg_answers.SOUNDNESS_CHECKS).
            from handlers.math.rg_answers import soundness_error

            unsound = soundness_error(task, answer, entry)
            if unsound is not None:
                info["reason"] = f"the scorer's full credit does not count: {unsound}"
                return 0.0, info
        return (1.0 if raw >= 1.0 else 0.0), info

    ok, reason = _compare(gold, pred, verify_timeout_s)
    if not ok and reason:
        info["reason"] = reason
    return (1.0 if ok else 0.0), info
