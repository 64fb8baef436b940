"""Soundness battery of the ``math`` handler's scorers (docs/reward-integrity.md, "sound scorers"): every
served task's scorer, over many instances, gives no full credit to a generic wrong answer.

Safety (I1) says an answer cannot run code in the scorer; soundness says a wrong answer cannot earn 1.0. A
policy finds a constant worth 1.0 in a few steps: before this battery, ``game_of_life_halting`` paid any
non-empty answer, ``complex_arithmetic`` paid ``nan``, ``coin_flip`` paid ``0``, ``puzzle24`` paid any four
numbers making 24, ``word_sorting`` paid the sorted list plus junk, and an inline gold of ``1e-7`` was matched by
``4e-7`` (math-verify's 6 absolute decimals).

The wrong answers are generic, the same for every task: constants (``0``, ``1``, ``-1``, ``24``, ``yes``,
``no``, ``True``, ``False``, ``None``, ``no idea``), non-finite numbers, the gold with junk or an extra item
appended, and in-range values that are not the instance's (the golds of the task's other instances). A
candidate that is the gold (same text or same number) or another instance's gold for the same question is
not asked; neither is one the task's own checker (:data:`RIGHT`) finds right, for tasks with many right
answers. Everything is real: reasoning-gym's generators and scorers, math-verify, the handler's ``score``.

Run ``python tests/handlers/test_scorer_soundness.py [TASK ...]`` for the table (full-credit wrong answers
and the largest partial credit per task): do it for a new task before serving it.
"""
from __future__ import annotations

import json
import math
import os
import re
import sys
from decimal import Decimal
from functools import lru_cache
from typing import Callable, Optional

import pytest

from handlers.math.data import load_reasoning_gym
from handlers.math.rg_answers import SERVED_TASKS, SOUNDNESS_CHECKS
from handlers.math.scoring import score

INSTANCES = int(os.environ.get("PRORL_SOUNDNESS_INSTANCES", "3"))
"""Instances per task (reasoning-gym seeds each instance separately); the script run takes 8 for a new task."""
SLOW_TASKS = {"knight_swap": 2}
"""Tasks whose generator is slow (knight_swap: 0.65 s an instance), with their own count."""

CONSTANTS = ["0", "1", "-1", "24", "yes", "no", "Yes", "True", "False", "true", "None", "no idea", "unknown",
             "nan", "NaN", "inf", "-inf", "Infinity", "1e999", "0.0", "0 + 0i", "nan + nani"]


def _number(text: str) -> Optional[float]:
    try:
        return float(text.strip())
    except ValueError:
        return None


def _with_extra(gold: str) -> list[str]:
    """The gold with junk or one extra item appended, in the gold's own list syntax where it has one."""
    out = [gold + " 0", gold + " junk", gold + "\nno idea"]
    try:
        value = json.loads(gold)
    except ValueError:
        value = None
    if isinstance(value, list):
        out.append(json.dumps(value + [value[-1] if value else 0]))
    if ", " in gold:
        out += [gold + ", " + gold.split(", ")[-1], gold + ", zzz"]
    elif "," in gold:
        out += [gold + "," + gold.split(",")[-1], gold + ",zzz"]
    if "\n" in gold:
        out.append(gold + "\n" + gold.split("\n")[-1])
    return out


#: Tasks whose question itself asks for a coarse answer: a near miss within what it asks for is right there.
COARSE_BY_QUESTION = {"power_function": "asks for 3 significant figures"}


def _numeric_neighbours(gold: str, near: bool = True) -> list[str]:
    """For a gold that is one number: its negation, and (``near``) one unit up and down in its last decimal
    place shown and a relative 1e-5 up and down (red team B: ``gsm_symbolic`` paid ``-57`` for ``57``,
    ``decimal_arithmetic`` paid ``25.414`` for ``25.413`` and ``8.27343551523`` for ``8.27243551523``). Those
    within a relative 1e-6 of the gold are the gold's value, not wrong (dropped)."""
    text = gold.strip()
    if not re.fullmatch(r"-?[0-9]+(?:\.[0-9]+)?", text):
        return []
    value = Decimal(text)
    out = [-value] if value else []
    if near:
        unit = Decimal(1).scaleb(value.as_tuple().exponent)
        out += [value + unit, value - unit, value * Decimal("1.00001"), value * Decimal("0.99999")]
    return [str(v) for v in out if not math.isclose(float(v), float(value), rel_tol=1e-6, abs_tol=0.0)]


def _same(a: str, b: str) -> bool:
    """Whether two answer texts are the same answer (same text up to white space and case, or same number)."""
    if " ".join(a.split()).lower() == " ".join(b.split()).lower():
        return True
    x, y = _number(a), _number(b)
    return x is not None and y is not None and (x == y or (math.isnan(x) and math.isnan(y)))


def _puzzle24_right(answer: str, entry: dict) -> bool:
    """An arithmetic expression that uses exactly the instance's four numbers and makes 24 (independent of
    the handler: the numbers are read as text, the value with Fraction arithmetic over a tiny parser)."""
    if sorted(int(n) for n in re.findall(r"\d+", answer)) != sorted(entry["metadata"]["numbers"]):
        return False
    return _arith(answer) == 24


def _arith(text: str):
    from fractions import Fraction
    import ast

    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in (ast.Add, ast.Sub, ast.Mult, ast.Div):
            a, b = ev(node.left), ev(node.right)
            return {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b}.get(type(node.op)) if not isinstance(
                node.op, ast.Div) else (a / b if b else None)
        raise ValueError(text)

    try:
        return ev(ast.parse(text, mode="eval").body)
    except (ValueError, SyntaxError, TypeError, ZeroDivisionError):
        return None


RIGHT: dict[str, Callable[[str, dict], bool]] = {
    "puzzle24": _puzzle24_right,
}
"""Tasks with many right answers: the battery's own check that a candidate is right for the instance (then it
is not a wrong answer and is not asked)."""


@lru_cache(maxsize=None)
def instances(task: str) -> list[dict]:
    return load_reasoning_gym(task, limit=SLOW_TASKS.get(task, INSTANCES), seed=33)


def wrong_answers(inst: dict, others: list[dict]) -> list[tuple[str, str]]:
    """``(kind, answer)`` pairs that are wrong for ``inst``: constants, the gold with extra items, and the
    golds of ``others`` (instances of the same task)."""
    gold = str(inst["answer"])
    out = [("constant", c) for c in CONSTANTS] + [("gold+extra", a) for a in _with_extra(gold)]
    task = (inst.get("rg_entry") or {}).get("metadata", {}).get("source_dataset")
    out += [("numeric neighbour", a) for a in _numeric_neighbours(gold, near=task not in COARSE_BY_QUESTION)]
    out += [("another instance's gold", str(o["answer"])) for o in others
            if o is not inst and o["question"] != inst["question"]]
    right = RIGHT.get((inst.get("rg_entry") or {}).get("metadata", {}).get("source_dataset"))
    seen, kept = set(), []
    for kind, a in out:
        if a in seen or _same(a, gold) or (right is not None and right(a, inst["rg_entry"])):
            continue
        seen.add(a)
        kept.append((kind, a))
    return kept


def run_battery(cases: list[tuple[dict, list[dict]]]) -> dict:
    """Scores every wrong answer of every case: ``{asked, full: [(answer, kind, info)], partial: max raw
    scorer score below 1.0, honest: golds scoring 1.0, instances}``."""
    row = {"asked": 0, "full": [], "partial": 0.0, "honest": 0, "instances": len(cases)}
    for inst, others in cases:
        row["honest"] += score(inst, "\\boxed{" + str(inst["answer"]) + "}")[0] == 1.0
        for kind, answer in wrong_answers(inst, others):
            reward, info = score(inst, "\\boxed{" + answer + "}")
            row["asked"] += 1
            raw = info.get("scorer_score", reward)
            if reward >= 1.0:
                row["full"].append((answer, kind, gold_of(inst)))
            elif raw < 1.0:
                row["partial"] = max(row["partial"], raw)
    return row


def gold_of(inst: dict) -> str:
    return str(inst["answer"])[:40]


def rg_cases(task: str) -> list[tuple[dict, list[dict]]]:
    insts = instances(task)
    return [(i, insts) for i in insts]


# Inline instances (math-verify): golds of every shape the handler accepts, each with in-range wrong values
# of its own (a small gold's multiples, a near miss that differs in the 4th significant digit).
INLINE = [
    ("2", ["3", "2.001", "20", "0.2"]),
    ("0", ["0.001", "1e-3", "-0.0001"]),
    ("-3", ["3", "-3.003"]),
    ("0.0000001", ["0.0000004", "4 \\times 10^{-7}", "0", "1e-6"]),
    ("1.5e-9", ["3e-9", "0", "1.5e-8"]),
    ("3 \\times 10^{-8}", ["0", "2 \\times 10^{-8}"]),
    ("123456789", ["123456790", "123457000"]),
    ("6.02 \\times 10^{23}", ["6.03 \\times 10^{23}", "6.02 \\times 10^{22}"]),
    ("\\frac{1}{3}", ["0.334", "\\frac{1}{4}"]),
    ("\\sqrt{2}", ["1.414", "1.4142", "2"]),
    ("\\pi", ["3.14", "3.1416"]),
    ("(0.0000001, 2)", ["(0.0000004, 2)"]),
    ("\\{1, 2\\}", ["\\{1, 3\\}", "\\{1, 2, 3\\}"]),
    ("x + 1", ["x", "x + 2", "y + 1"]),
    ("[1, 3]", ["[1, 4]", "(1, 3)"]),
]


def inline_cases() -> list[tuple[dict, list[str]]]:
    golds = [g for g, _ in INLINE]
    return [({"answer": g}, own + [o for o in golds if o != g]) for g, own in INLINE]


def run_inline() -> dict:
    row = {"asked": 0, "full": [], "partial": 0.0, "honest": 0, "instances": len(INLINE)}
    for inst, own in inline_cases():
        gold = inst["answer"]
        row["honest"] += score(inst, "\\boxed{" + gold + "}")[0] == 1.0
        for kind, answer in [("constant", c) for c in CONSTANTS] + [("gold+extra", a) for a in _with_extra(gold)] \
                + [("in-range value", a) for a in own]:
            if _same(answer, gold) or _same_value(answer, gold):
                continue
            reward, info = score(inst, "\\boxed{" + answer + "}")
            row["asked"] += 1
            if reward >= 1.0:
                row["full"].append((answer, kind, gold))
    return row


def _same_value(answer: str, gold: str) -> bool:
    """Whether math-verify reads both as the same value exactly (``0 + 0i``, ``0 x`` and ``0 0`` are 0)."""
    from math_verify import parse
    from sympy import Basic, simplify

    try:
        (a, *_), (g, *_) = parse("$" + answer + "$"), parse("$" + gold + "$")
        return isinstance(a, Basic) and isinstance(g, Basic) and simplify(a - g) == 0
    except Exception:  # no value, or values sympy cannot subtract: not the same
        return False


def format_row(task: str, row: dict) -> str:
    examples = "; ".join(f"{a!r} ({k}; gold {g!r})" for a, k, g in row["full"][:3])
    return (f"{task:28} {row['instances']:3} {row['honest']:3} {row['asked']:6} {len(row['full']):5} "
            f"{row['partial']:8.3f}  {examples}")


HEADER = f"{'task':28} {'n':>3} {'ok':>3} {'wrong':>6} {'1.0':>5} {'partial':>8}  full-credit wrong answers"


@pytest.mark.parametrize("task", sorted(SERVED_TASKS))
def test_no_wrong_answer_gets_full_credit_on_a_reasoning_gym_task(task):
    row = run_battery(rg_cases(task))
    print("\n" + HEADER + "\n" + format_row(task, row))
    assert row["asked"] > 0
    assert not row["full"], format_row(task, row)
    if task in SOUNDNESS_CHECKS:  # a check that refused the gold too would be sound and useless
        assert row["honest"] == row["instances"], format_row(task, row)


HONEST_VARIANTS = {
    "puzzle24": lambda e: [e["answer"].replace(" ", ""), "(" + e["answer"] + ")"],
    "coin_flip": lambda e: ["{numerator}/{denominator}".format(**e["rg_entry"]["metadata"]["rational"])],
    "complex_arithmetic": lambda e: [e["answer"].replace(" ", "")],
    "game_of_life": lambda e: [json.dumps(json.loads(e["answer"]))],
    "game_of_life_halting": lambda e: [e["answer"].lower(), " " + e["answer"].upper()],
    "word_sorting": lambda e: [e["answer"].replace(", ", ",")],
    "knights_knaves": lambda e: [" and ".join(reversed(e["answer"].rstrip(".").split(", and ")))],
}


@pytest.mark.parametrize("task", sorted(HONEST_VARIANTS))
def test_the_checks_keep_honest_answers_in_other_forms(task):
    for inst in instances(task):
        for answer in HONEST_VARIANTS[task](inst):
            reward, info = score(inst, "\\boxed{" + answer + "}")
            assert reward == 1.0, (answer, info)


REFERENCE_ANSWER: dict[str, Callable[[dict], str]] = {
    "graph_color": lambda m: json.dumps(m["possible_answer"]),
    "propositional_logic": lambda m: m["example_answer"],
    "rubiks_cube": lambda m: m["example_correct_answer"],
}
"""Tasks without a gold (their scorer verifies an answer against the puzzle): a right answer their metadata holds."""
NO_REFERENCE = {"boxnet": "a plan (no reference plan in the entry)", "rush_hour": "a move list (only min_moves)"}
"""Tasks with neither a gold nor a reference answer: their metadata must at least survive JSON unchanged."""


@pytest.mark.parametrize("task", sorted(SERVED_TASKS))
def test_a_right_answer_scores_one_after_the_trip_through_json(task):
    """A task that never pays a right answer teaches nothing: ``arc_agi`` and ``rearc`` paid their own gold
    0.05 (JSON made the scorer's tuple grid a list), ``graph_color`` refused its valid colourings as "a set,
    the gold answer a number" (the missing gold, the text "None", parsed as a product of symbols)."""
    for inst in instances(task):
        wire = json.loads(json.dumps(inst))  # what a /process request and the journal carry
        metadata = wire["rg_entry"]["metadata"]
        if task in NO_REFERENCE:
            assert wire["rg_entry"]["answer"] is None and metadata == inst["rg_entry"]["metadata"], NO_REFERENCE[task]
            continue
        answer = REFERENCE_ANSWER[task](metadata) if task in REFERENCE_ANSWER else wire["answer"]
        reward, info = score(wire, "\\boxed{" + answer + "}")
        assert reward == 1.0, (answer[:80], info)


def test_no_wrong_answer_gets_full_credit_on_an_inline_gold():
    row = run_inline()
    print("\n" + HEADER + "\n" + format_row("inline (math-verify)", row))
    assert row["honest"] == row["instances"], row
    assert not row["full"], format_row("inline (math-verify)", row)


if __name__ == "__main__":
    os.environ.setdefault("PRORL_SOUNDNESS_INSTANCES", "8")
    INSTANCES = int(os.environ["PRORL_SOUNDNESS_INSTANCES"])
    tasks = sys.argv[1:] or sorted(SERVED_TASKS)
    print(HEADER)
    failing = []
    for t in tasks:
        r = run_battery(rg_cases(t))
        print(format_row(t, r), flush=True)
        failing += [t] if r["full"] else []
    r = run_inline()
    print(format_row("inline (math-verify)", r))
    failing += ["inline"] if r["full"] else []
    print(f"\n{len(failing)} unsound: {' '.join(failing)}")
