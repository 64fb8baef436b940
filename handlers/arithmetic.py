"""``arithmetic``: a tiny built-in handler that does real work without an LLM, for smoke tests and docs.

Instance: ``{"data_source": "arithmetic", "expression": "2 * (3 + 4)", "answer": 14}``. ``run`` evaluates
the expression with a safe AST walker (numbers, + - * / // % **, unary +/-, parentheses; nothing else);
``eval`` gives reward 1.0 when the value equals ``answer`` (within 1e-9 relative), else 0.0. Without
``answer`` the reward is 0.0 and the value is reported in ``extra["value"]``.

An instance of ``--dataset arithmetic`` may be named by id alone: ``{"data_source": "arithmetic",
"instance_id": "arith-<seed>-<i>"}`` is the i-th instance of that seed's sample (:func:`load_dataset`).
A malformed instance (no ``expression`` string, a non-numeric ``answer``) is refused at submit (HTTP 422).

Raises (inside ``run``): ``ValueError`` for anything that is not a plain arithmetic expression; the pipeline
turns it into a result with ``critical_error="run"``.
"""
from __future__ import annotations

import ast
import functools
import math
import operator
import random
import re
from dataclasses import dataclass
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field

from prorl_server.plugin import AgentHandler, NotRegradableError

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 1000
MAX_EXPONENT = 1000
MAX_INT_BITS = 1 << 16
"""Largest integer an expression may compute, bits (~19,700 digits). ``run`` evaluates on the event loop (it
takes microseconds), so the cost of every step is bounded up front: without this, ``((9**999)**999)**999``
(21 characters) would compute a 3-billion-bit integer and stall every job of the server for minutes."""


def evaluate(expression: str) -> float:
    """Value of a plain arithmetic expression. Raises ValueError for anything else (names, calls, huge
    exponents, integers over :data:`MAX_INT_BITS` bits, nesting too deep, over-long input) and
    ZeroDivisionError for division by zero."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None

    def walk(node: ast.AST):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow):
                if abs(right) > MAX_EXPONENT:
                    raise ValueError(f"exponent larger than {MAX_EXPONENT}")
                if isinstance(left, int) and isinstance(right, int) and left.bit_length() * right > MAX_INT_BITS:
                    raise ValueError(f"result larger than {MAX_INT_BITS} bits")
            value = _BINOPS[type(node.op)](left, right)
            if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:  # products and sums of big ints
                raise ValueError(f"result larger than {MAX_INT_BITS} bits")
            return value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](walk(node.operand))
        raise ValueError(f"unsupported syntax in arithmetic expression: {type(node).__name__}")

    try:
        return walk(tree)
    except RecursionError:
        raise ValueError("expression nested too deeply") from None


class ArithmeticInstance(BaseModel):
    """``{"data_source": "arithmetic", "expression": str, "answer"?: number}``; other keys are allowed."""

    model_config = ConfigDict(extra="allow")

    expression: str = Field(description="a plain arithmetic expression")
    answer: Optional[float] = Field(default=None, allow_inf_nan=False,
                                    description="the expected value (none: reward 0.0)")



@dataclass(slots=True)
class ArithmeticState:
    """What an ``arithmetic`` job carries from run to eval (``job.state``)."""

    value: Optional[float] = None  # the expression's value run computed

class ArithmeticHandler(AgentHandler):
    name = "arithmetic"
    aliases = ("calc",)
    needs_llm = False
    instance_model = ArithmeticInstance
    state_model = ArithmeticState

    def instance_by_id(self, instance_id: str) -> Optional[dict[str, Any]]:
        """``arith-<seed>-<i>``: the i-th instance of ``load_dataset("arithmetic", seed=<seed>)``."""
        m = re.fullmatch(r"arith-(\d{1,9})-(\d{1,4})", instance_id)
        return None if m is None else _sample(int(m[1]))[int(m[2])]

    async def init(self, job) -> None:
        job.messages = [{"role": "user", "content": job.instance["expression"]}]

    async def run(self, job) -> None:
        value = evaluate(job.instance["expression"])
        job.state.value = value
        job.extra["value"] = value
        job.messages.append({"role": "assistant", "content": repr(value)})

    def restore_for_eval(self, job, result) -> None:
        """The value :meth:`run` computed, recorded in ``extra["value"]``."""
        if "value" not in result.extra:
            raise NotRegradableError("the result has no extra.value (the expression's value run computed)")
        job.state.value = result.extra["value"]

    async def eval(self, job) -> None:
        expected = job.instance.get("answer")
        if expected is None:
            job.reward = 0.0
            return
        value = job.state.value
        job.resolved = math.isclose(float(value), float(expected), rel_tol=1e-9, abs_tol=1e-12)
        job.reward = 1.0 if job.resolved else 0.0


@functools.lru_cache(maxsize=4)
def _sample(seed: int) -> tuple[dict[str, Any], ...]:
    """The 10,000 instances of one seed, made once (~0.13 s): ids are resolved at submit, on the event loop,
    so a request must not regenerate up to 10,000 instances each time."""
    return tuple(load_dataset(None, limit=10000, seed=seed))


def load_dataset(arg=None, limit=None, seed: int = 0) -> list[dict]:
    """A seeded sample of arithmetic instances (``limit`` of them, default 16) with their true answers."""
    rng = random.Random(seed)
    out = []
    for i in range(limit or 16):
        a, b, c = rng.randint(1, 99), rng.randint(1, 99), rng.randint(1, 9)
        op = rng.choice(["+", "-", "*"])
        expr = f"({a} {op} {b}) * {c}"
        out.append({"data_source": "arithmetic", "instance_id": f"arith-{seed}-{i}", "expression": expr,
                    "answer": evaluate(expr)})
    return out
