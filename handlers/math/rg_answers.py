"""Which reasoning-gym tasks the ``math`` handler serves, and the answer grammar of each (docs/reward-integrity.md,
I1: nothing the policy wrote is executed or evaluated outside a sandbox).

reasoning-gym's scorers are third-party code, and several evaluate the answer text as Python: ``countdown``
and ``puzzle24`` call sympy's ``parse_expr`` (which ends in ``eval``), ``polynomial_multiplication`` and the two
integration tasks too, and ``string_insertion``, ``spiral_matrix``, ``binary_matrix`` and ``n_queens`` call
``eval`` on an answer that is not an exact match. Run as they are, ``\\boxed{__import__('os').system(...)}``
runs on the host, and an answer can read the target out of the scorer's frame and score 1.0. Running the
scorer in a sandbox would not stop the second: code that runs inside the scorer can forge its verdict. So an
answer reaches such a scorer only if it matches the task's **grammar**, a language in which no Python
expression can call, import, index or look up an attribute:

``arithmetic`` (countdown, puzzle24)
    integers, ``+ - * /``, parentheses and spaces. No ``**`` (no exponent towers), no names at all.
``polynomial`` (polynomial_multiplication)
    integers, one-letter lower-case variables (never a sympy or Python callable), ``+ - * /``, ``**`` with an
    integer exponent of at most two digits, parentheses and spaces.
``calculus`` (simple_integration, intermediate_integration)
    numbers (decimals allowed), one-letter lower-case variables (and the entry's own one-letter variable, which
    the scorer binds to a symbol), the constant ``C``, the functions and
    constants of :data:`CALCULUS_NAMES` (sympy's elementary functions: calling them computes symbolically),
    ``+ - * / **``, parentheses, commas and spaces. No ``_``, no ``.`` after a name, no quotes or brackets.
``no_call`` (string_insertion, spiral_matrix, binary_matrix, n_queens)
    letters, digits, ``_`` and white space: what their exact answers are made of. Without parentheses,
    brackets, quotes, dots or operators, ``eval`` of such text can only look a name up or fail; those scorers
    evaluate only to give partial credit, which the handler scores 0.0 anyway.

Every other served task's scorer was read (reasoning-gym 0.1.25) and compares, parses numbers with ``float`` /
``int`` / ``Fraction`` / ``json`` or runs its own bounded logic on the text: its answers are plain text of at
most ``MAX_ANSWER_CHARS`` (the box's bound). A task reasoning-gym adds later is not served until it is read
and listed here (:data:`PLAIN_TASKS` or :data:`GRAMMAR_OF`); ``composite`` is never a ``source_dataset``.
Whatever a scorer then does with a served answer runs in a CPU pool worker under an address-space limit and a
wall-clock limit (:mod:`prorl_server.cpu_pool`), and an exception it raises scores 0.0.
"""
from __future__ import annotations

import json
import math
import re
from fractions import Fraction
from typing import Any, Callable, Optional

#: Functions and constants a ``calculus`` answer may name (sympy names; each computes symbolically).
CALCULUS_NAMES = frozenset({
    "sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan", "acot", "sinh", "cosh", "tanh", "asinh",
    "acosh", "atanh", "exp", "log", "sqrt", "Abs", "pi", "E", "I", "C",
})

GRAMMAR_OF: dict[str, str] = {
    "countdown": "arithmetic", "puzzle24": "arithmetic",
    "polynomial_multiplication": "polynomial",
    "simple_integration": "calculus", "intermediate_integration": "calculus",
    "string_insertion": "no_call", "spiral_matrix": "no_call", "binary_matrix": "no_call", "n_queens": "no_call",
}
"""Tasks whose scorer evaluates the answer, and the grammar an answer must match to reach it."""

PLAIN_TASKS = frozenset({
    "ab", "acre", "advanced_geometry", "aiw", "arc_1d", "arc_agi", "base_conversion", "basic_arithmetic", "bf",
    "binary_alternation", "bitwise_arithmetic", "boxnet", "caesar_cipher", "calendar_arithmetic", "chain_sum",
    "circuit_logic", "codeio", "coin_flip", "color_cube_rotation", "complex_arithmetic", "count_bits",
    "count_primes", "course_schedule", "cryptarithm", "decimal_arithmetic", "decimal_chain_sum", "dice",
    "emoji_mystery", "family_relationships", "figlet_font", "fraction_simplification", "futoshiki",
    "game_of_life", "game_of_life_halting", "gcd", "graph_color", "group_anagrams", "gsm_symbolic",
    "isomorphic_strings", "jugs", "kakurasu", "knight_swap", "knights_knaves", "largest_island", "lcm",
    "leg_counting", "letter_counting", "letter_jumble", "list_functions", "mahjong_puzzle", "manipulate_matrix",
    "maze", "mini_sudoku", "modulo_grid", "needle_haystack", "number_filtering", "number_format",
    "number_sequence", "number_sorting", "palindrome_generation", "palindrome_partitioning", "path_star",
    "polynomial_equations", "pool_matrix", "power_function", "prime_factorization", "products",
    "propositional_logic", "quantum_lock", "ransom_note", "rearc", "rectangle_count", "rotate_matrix",
    "rotten_oranges", "rubiks_cube", "rush_hour", "self_reference", "sentence_reordering", "shortest_path",
    "simple_equations", "simple_geometry", "sokoban", "spell_backward", "string_manipulation", "string_splitting",
    "string_synthesis", "sudoku", "survo", "syllogism", "time_intervals", "tower_of_hanoi", "tsumego",
    "word_ladder", "word_sequence_reversal", "word_sorting", "zebra_puzzles",
})
"""Tasks whose scorer does not evaluate the answer (read in reasoning-gym 0.1.25): ``basic_arithmetic``,
``bitwise_arithmetic`` and ``number_sorting`` evaluate only the gold answer or the problem (the instance's,
the trainer's data), ``codeio`` and ``bf`` only in generation; ``propositional_logic`` parses with its own
recursive parser (a ``RecursionError`` on a deep answer scores 0.0)."""

SERVED_TASKS = frozenset(GRAMMAR_OF) | PLAIN_TASKS

_NUMBER = r"[0-9]{1,30}"
_TOKENS = {
    "arithmetic": re.compile(rf"\s+|{_NUMBER}|[-+*/()]", re.ASCII),
    "polynomial": re.compile(rf"\s+|{_NUMBER}|\*\*|[a-z](?![A-Za-z0-9_])|[-+*/()]", re.ASCII),
    "calculus": re.compile(rf"\s+|{_NUMBER}(?:\.[0-9]{{1,30}})?|\*\*|[A-Za-z]+(?![A-Za-z0-9_])|[-+*/(),]",
                           re.ASCII),
    "no_call": re.compile(r"[A-Za-z0-9_\s]+", re.ASCII),
}
_MAX_DEPTH = 32  # parentheses nested in one answer
# ``a ** b ** c`` (right-associative: an exponent tower sympy would compute eagerly on numbers). What remains
# costly (powers of parenthesised powers) is bounded by the CPU pool's time and memory limits: a 0.0.
_POWER = re.compile(r"\*\s*\*")
_SPLIT_POWER = re.compile(r"\*\s+\*")
# What may follow ``**`` in a calculus answer: -3, 2.5, x, (3/2), (-1/2), (x/2): never a number that makes an
# integer power eager and huge.
_POLY_EXPONENT = re.compile(r"[0-9]{1,2}(?![0-9])", re.ASCII)
_EXPONENT = re.compile(r"\s*-?\s*(?:[0-9]{1,3}(?:\.[0-9]{1,3})?(?![0-9.])|[A-Za-z](?![A-Za-z0-9])"
                       r"|\(\s*-?[0-9a-z]{1,3}(?:\s*/\s*[0-9a-z]{1,3})?\s*\))", re.ASCII)
_CHAINED_POWER = re.compile(r"\*\*\s*-?\s*(?:[0-9.]+|[A-Za-z]+|\([^()]*\))\s*(?:\*\*|\^)", re.ASCII)


def _grid_as_tuples(entry: dict) -> dict:
    metadata = dict(entry["metadata"])
    metadata["output"] = tuple(tuple(row) for row in metadata["output"])
    return {**entry, "metadata": metadata}


#: What the trip through JSON (a /process request, the journal) changed in an entry that its scorer needs as it
#: was: ``arc_agi`` and ``rearc`` compare the parsed answer (a tuple of tuples) with ``metadata["output"]``
#: by ``==``, and JSON turns that into a list of lists, so even the gold scored 0.05.
_ENTRY_FROM_JSON: dict[str, Callable[[dict], dict]] = {"arc_agi": _grid_as_tuples, "rearc": _grid_as_tuples}


def entry_for_scorer(source_dataset: str, entry: dict) -> dict:
    """``entry`` (reasoning-gym's, after JSON) as ``source_dataset``'s scorer needs it (a copy where it differs).

    Raises:
        KeyError, TypeError: a malformed entry (the scorer's caller scores that 0.0 like any scorer error)."""
    restore = _ENTRY_FROM_JSON.get(source_dataset)
    return entry if restore is None else restore(entry)


def task_error(source_dataset: object) -> Optional[str]:
    """Why a reasoning-gym entry of ``source_dataset`` cannot be served (None if it can)."""
    if source_dataset in SERVED_TASKS:
        return None
    return (f"reasoning-gym task {source_dataset!r} is not served by the math handler: its scorer has not been "
            "checked for evaluating the answer (handlers/math/rg_answers.py lists the tasks that were)")


def grammar_error(source_dataset: str, answer: str, variable: Optional[str] = None) -> Optional[str]:
    """Why ``answer`` may not reach ``source_dataset``'s scorer, or None if it may. ``variable``: the entry's
    ``metadata["variable"]`` (the integration tasks name it; the scorer binds it to a symbol): a one-letter
    upper-case variable is then allowed too.

    Cost: one regular-expression scan, linear in ``len(answer)`` (the caller bounds it by
    ``MAX_ANSWER_CHARS``); nothing is evaluated."""
    error = task_error(source_dataset)
    if error is not None:
        return error
    grammar = GRAMMAR_OF.get(source_dataset)
    if grammar is None:
        return None
    pattern, pos, depth = _TOKENS[grammar], 0, 0
    while pos < len(answer):
        m = pattern.match(answer, pos)
        if m is None:
            return (f"the answer is outside the {grammar!r} answer grammar of {source_dataset} at "
                    f"{answer[pos:pos + 20]!r}")
        tok = m.group(0)
        if grammar == "calculus" and tok[0].isalpha() and len(tok) > 1 and tok not in CALCULUS_NAMES:
            return f"the answer names {tok!r}, which the {grammar!r} answer grammar does not allow"
        if (grammar == "calculus" and tok[0].isalpha() and len(tok) == 1
                and not (tok.islower() or tok in "CEI" or tok == variable)):
            return f"the answer names {tok!r}, which the {grammar!r} answer grammar does not allow"
        depth += (tok == "(") - (tok == ")")
        if depth > _MAX_DEPTH:
            return f"parentheses nested deeper than {_MAX_DEPTH}"
        pos = m.end()
    if grammar == "arithmetic" and _POWER.search(answer):
        return "an exponent (**): the arithmetic answer grammar has none"
    if grammar in ("polynomial", "calculus") and _SPLIT_POWER.search(answer):
        return "a spaced-out operator (* *)"
    if grammar == "polynomial" and any(not _POLY_EXPONENT.match(answer, m.end()) for m in _POWER.finditer(answer)):
        return "an exponent that is not an integer of at most two digits"
    if grammar == "calculus" and any(not _EXPONENT.match(answer, m.end()) for m in _POWER.finditer(answer)):
        return ("an exponent that is not a number of at most three digits, a variable or a short "
                "parenthesised fraction")
    if grammar in ("polynomial", "calculus") and _CHAINED_POWER.search(answer):
        return "a chained exponent (a ** b ** c): a tower of powers is not an answer to these tasks"
    return None


# --- Soundness: what a scorer's full credit must also pass -----------------------------------------------------
#
# Safety (above) keeps an answer from running code in a scorer; soundness keeps a wrong answer from earning its
# full credit. Several scorers pay answers that are not right (found by tests/handlers/test_scorer_soundness.py,
# reasoning-gym 0.1.25): ``game_of_life_halting`` compares ``bool(answer)`` with the truthiness of the gold
# string (any non-empty answer), ``complex_arithmetic`` gives ``exp(-distance)`` = 1.0 for ``nan``,
# ``coin_flip``'s prefix credit gives 1.0 to ``0``, ``puzzle24`` checks four numbers in range and the value 24
# but not that they are the puzzle's, ``word_sorting``'s positional credit is 1.0 for the sorted list plus junk,
# ``spell_backward`` and ``letter_jumble`` sum per-character credit to 1.0000001, and many read the answer's
# first match of a pattern, ignoring what follows (``8 junk``, a grid plus a line, a move list plus a move).
# So a full credit counts only if the answer also passes its task's check here: the answer's own form read
# strictly (what the task's prompt asks for, whole), and for the tasks above the fact the scorer missed.

REL_TOL = 1e-6
"""Relative tolerance of a numeric comparison (``math.isclose``); a gold of 0 takes :data:`ZERO_ABS_TOL`."""
ZERO_ABS_TOL = 1e-12
"""Absolute tolerance against a gold of exactly 0 (a relative one would ask for exactly 0)."""

_NUM = r"[-+]?(?:[0-9]{1,40}(?:\.[0-9]{0,40})?|\.[0-9]{1,40})(?:[eE][-+]?[0-9]{1,3})?"
_NONFINITE = re.compile(r"(?i)(?<![a-z])(?:nan|inf|infinity)(?![a-z])")
_BOOLEAN = re.compile(r"(?i)\s*(true|false)\s*")
_FRACTION = re.compile(r"\s*\$?\s*(?:\\d?frac\s*\{\s*[0-9]{1,40}\s*\}\s*\{\s*[0-9]{1,40}\s*\}"
                       r"|[0-9]{1,40}\s*/\s*[0-9]{1,40})\s*\$?\s*")
_NUMBER = re.compile(rf"\s*{_NUM}\s*")
_NUMBER_OR_FRACTION = re.compile(rf"\s*(?:{_NUM}|[0-9]{{1,40}}\s*/\s*[0-9]{{1,40}})\s*")
_NUMBER_LIST = re.compile(rf"\s*{_NUM}(?:\s*,\s*{_NUM})*\s*")
_POINT = re.compile(rf"\s*\(?\s*{_NUM}\s*,\s*{_NUM}\s*\)?\s*")
_ANGLE = re.compile(rf"\s*{_NUM}\s*(?:°|\^\\circ|\^{{\\circ}})?\s*")
_ASSIGNMENTS = re.compile(r"\s*[A-Z]\s*=\s*[0-9](?:\s*,\s*[A-Z]\s*=\s*[0-9])*\s*")
_KNIGHTS = re.compile(r"\s*[A-Z][a-z]+ is an? [a-z]+(?:\s*(?:,\s*and|,|and)\s+[A-Z][a-z]+ is an? [a-z]+)*\s*\.?\s*")
_MOVES = re.compile(r"\s*[UDLR]+\s*")
_BUTTONS = re.compile(r"\s*[A-C](?:\s*(?:→|->|,)\s*[A-C])*\s*")


def _isclose(answer: float, gold: float) -> bool:
    return math.isclose(answer, gold, rel_tol=REL_TOL, abs_tol=ZERO_ABS_TOL if gold == 0 else 0.0)


def _value(text: str) -> Optional[float]:
    """A decimal or ``a/b`` (commas as thousands separators dropped), finite, or None."""
    try:
        v = float(Fraction(text.replace(",", "").strip()))
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    return v if math.isfinite(v) else None


def _form(pattern: re.Pattern, what: str) -> Callable[[str, dict], Optional[str]]:
    def check(answer: str, entry: dict) -> Optional[str]:
        return None if pattern.fullmatch(answer) else f"the answer is not {what}"
    return check


def _lines(text: str) -> list[list[str]]:
    return [line.split() for line in text.strip().splitlines() if line.strip()]


def _same_grid(answer: str, entry: dict) -> Optional[str]:
    """A grid of numbers with the gold's rows and columns, nothing else."""
    a, g = _lines(answer), _lines(str(entry["answer"]))
    if [len(r) for r in a] != [len(r) for r in g] or not all(re.fullmatch(r"-?[0-9]{1,40}", c) for r in a for c in r):
        return "the answer is not a grid of numbers of the gold's size"
    return None


def _same_skeleton(answer: str, entry: dict) -> Optional[str]:
    """The gold's form with other digits: ``68 days, 04:12`` for ``3 days, 11:05`` (white space collapsed)."""
    def skeleton(s: str) -> str:
        return re.sub(r"[0-9]+", "0", " ".join(s.split()))
    return None if skeleton(answer) == skeleton(str(entry["answer"])) else "the answer is not in the gold's form"


def _same_word_count(answer: str, entry: dict) -> Optional[str]:
    return (None if len(answer.split()) == len(str(entry["answer"]).split())
            else "the answer has another number of words than asked")


def _json_grid_of_gold_shape(answer: str, entry: dict) -> Optional[str]:
    try:
        a, g = json.loads(answer), json.loads(str(entry["answer"]))
    except ValueError:
        return "the answer is not JSON"

    def shape(x: Any) -> Any:
        return [shape(e) for e in x] if isinstance(x, list) else type(x).__name__
    return None if shape(a) == shape(g) else "the answer's grid is not the gold's size"


def _halting(answer: str, entry: dict) -> Optional[str]:
    m = _BOOLEAN.fullmatch(answer)
    if m is None:
        return "the answer is not True or False"
    return None if m.group(1).lower() == str(entry["answer"]).strip().lower() else "wrong"


_COMPLEX = re.compile(rf"\s*(?:{_NUM}(?:\s*[-+]\s*(?:[0-9.]{{1,40}}\s*\*?\s*)?[ij])?|[-+]?(?:{_NUM}\s*\*?\s*)?[ij])\s*")


def _complex(answer: str, entry: dict) -> Optional[str]:
    if _NONFINITE.search(answer) or re.search(r"[eE]\+?[0-9]{3}", answer):
        return "a non-finite number"
    return None if _COMPLEX.fullmatch(answer) else "the answer is not one complex number a + bi"


def _close_number(form: re.Pattern, what: str) -> Callable[[str, dict], Optional[str]]:
    """A check: the answer is ``what`` (``form``, thousands separators aside) and within a relative
    :data:`REL_TOL` of the gold, sign included."""
    def check(answer: str, entry: dict) -> Optional[str]:
        if not form.fullmatch(answer.replace(",", "")):
            return f"the answer is not {what}"
        a, g = _value(answer), _value(str(entry["answer"]))
        if a is None or g is None or not _isclose(a, g):
            return f"the answer is not within a relative {REL_TOL:g} of the gold"
        return None
    return check


#: ``coin_flip``: its prefix credit paid ``0``.
_coin_flip = _close_number(_NUMBER_OR_FRACTION, "one number or fraction")


#: ``gsm_symbolic``'s scorer reads the first match of ``\\b-?\\d+...`` and a word boundary never precedes
#: ``-``, so ``-57`` paid for ``57``; ``decimal_arithmetic``'s accepts an absolute ``10**-places`` (``25.414`` for
#: ``25.413``) where its question asks for 12 significant digits (red team B).
_same_number = _close_number(_NUMBER, "one number")


def _puzzle24(answer: str, entry: dict) -> Optional[str]:
    used = sorted(int(n) for n in re.findall(r"[0-9]+", answer))
    return None if used == sorted(int(n) for n in entry["metadata"]["numbers"]) else \
        "the answer does not use exactly the puzzle's four numbers"


def _word_sorting(answer: str, entry: dict) -> Optional[str]:
    return None if [w.strip() for w in re.split(r",\s*", answer.strip())] == entry["metadata"]["sorted_words"] \
        else "the answer is not exactly the sorted list"


def _exact_text(answer: str, entry: dict) -> Optional[str]:
    """Case-insensitive equality with the gold (tasks with one right answer, scored by per-character credit)."""
    return None if answer.strip().lower() == str(entry["answer"]).strip().lower() else "not the answer"


def _geometry(answer: str, entry: dict) -> Optional[str]:
    kind = (entry.get("metadata") or {}).get("task_type")
    pattern = _POINT if kind == "orthocenter" else _ANGLE
    return None if pattern.fullmatch(answer) else "the answer is not one number (or one point)"


def _assignments(answer: str, entry: dict) -> Optional[str]:
    if not _ASSIGNMENTS.fullmatch(answer):
        return "the answer is not a list of LETTER=DIGIT"
    letters = re.findall(r"[A-Z]", answer)
    return None if len(letters) == len(set(letters)) else "a letter is assigned twice"


def _polynomial_roots(answer: str, entry: dict) -> Optional[str]:
    if not _NUMBER_LIST.fullmatch(answer):
        return "the answer is not a comma-separated list of numbers"
    count = len([x for x in str(entry["answer"]).split(",") if x.strip()])
    return None if len(answer.split(",")) == count else "the answer has another number of roots than the gold"


def _partitions(answer: str, entry: dict) -> Optional[str]:
    try:
        value = json.loads(answer)
        parts = [tuple(p) for p in value]
    except (ValueError, TypeError):
        return "the answer is not a JSON list of partitions"
    return None if len(parts) == len(set(parts)) else "a partition is listed twice"


def _jugs(answer: str, entry: dict) -> Optional[str]:
    """Stops when the target is reached: no shorter prefix of the moves already solves the puzzle."""
    from reasoning_gym.algorithmic.jugs import verify_solution

    try:
        moves = json.loads(answer)
        if not isinstance(moves, list):
            return "the answer is not a JSON list of moves"
        for n in range(len(moves)):
            if verify_solution(entry["metadata"]["puzzle"], moves[:n])[0]:
                return "moves after the puzzle is solved"
    except Exception:  # its verifier choked on the answer: the scorer will say so too
        return "the answer is not a list of moves"
    return None


SOUNDNESS_CHECKS: dict[str, Callable[[str, dict], Optional[str]]] = {
    "game_of_life_halting": _halting,
    "complex_arithmetic": _complex,
    "coin_flip": _coin_flip,
    "puzzle24": _puzzle24,
    "word_sorting": _word_sorting,
    "spell_backward": _exact_text,
    "letter_jumble": _exact_text,
    "advanced_geometry": _geometry,
    "cryptarithm": _assignments,
    "fraction_simplification": _form(_FRACTION, "one fraction"),
    "game_of_life": _json_grid_of_gold_shape,
    "gsm_symbolic": _same_number,
    "decimal_arithmetic": _same_number,
    "jugs": _jugs,
    "kakurasu": _same_grid,
    "survo": _same_grid,
    "knights_knaves": _form(_KNIGHTS, "a list of 'NAME is a ROLE'"),
    "palindrome_partitioning": _partitions,
    "polynomial_equations": _polynomial_roots,
    "quantum_lock": _form(_BUTTONS, "a sequence of buttons A-C"),
    "sokoban": _form(_MOVES, "a string of moves U, D, L, R"),
    "time_intervals": _same_skeleton,
}
"""Tasks whose scorer gave full credit to a wrong answer in the soundness battery, and the check a full credit
must also pass (``check(answer, entry)`` -> why it fails, or None). Cost: each is a regular-expression scan or
a parse of at most ``MAX_ANSWER_CHARS`` characters (``jugs``: one replay per prefix, quadratic in at most a
few hundred moves); all run in the CPU pool with the scorer."""


def soundness_error(source_dataset: str, answer: str, entry: dict) -> Optional[str]:
    """Why a full credit from ``source_dataset``'s scorer for ``answer`` does not count, or None if it does.

    An answer with ``nan``/``inf`` where the gold has digits and none (a non-finite number that comparisons
    read as equal or close) never counts."""
    gold = str(entry.get("answer"))
    if re.search(r"[0-9]", gold) and not _NONFINITE.search(gold) and _NONFINITE.search(answer):
        return "a non-finite number (nan, inf) where the gold answer is finite"
    check = SOUNDNESS_CHECKS.get(source_dataset)
    return None if check is None else check(answer, entry)
