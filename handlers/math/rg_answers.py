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

import re
from typing import Optional

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
