"""Data for the ``math`` handler.

Two kinds of instance:
- inline: ``{"data_source": "math", "question": str, "answer": str}``, scored with math-verify;
- reasoning-gym: ``{"data_source": "math", "question", "answer", "rg_entry": {...}}`` where ``rg_entry`` is the
  generator's entry (question/answer/metadata) and is scored with reasoning-gym's own ``score_answer`` for its
  ``metadata.source_dataset``. ``prorl-run --dataset reasoning-gym:<task>`` builds them from any of
  reasoning-gym's procedural tasks (default ``gsm_symbolic``), seeded.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from prorl_server.plugin import DatasetError
from handlers.math.rg_answers import grammar_error, task_error
from handlers.math.scoring import MAX_ANSWER_CHARS

DEFAULT_TASK = "gsm_symbolic"


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str))


def load_reasoning_gym(task: Optional[str] = None, limit: Optional[int] = None, seed: int = 0) -> list[dict]:
    """``limit`` (default 16) problems of reasoning-gym task ``task`` generated with ``seed``.

    Raises:
        ValueError: reasoning-gym has no task of that name (the message lists a few that exist), or the
            ``math`` handler does not serve it (:mod:`handlers.math.rg_answers`).
    """
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    task = task or DEFAULT_TASK
    if task not in DATASETS:
        raise ValueError(f"reasoning-gym has no task {task!r}; e.g. {', '.join(sorted(DATASETS)[:12])}, ...")
    refused = task_error(task)
    if refused is not None:
        raise ValueError(refused)
    limit = limit or 16
    # reasoning-gym seeds entry i from seed + i, so a longer dataset starts with the same entries; the margin
    # replaces entries whose own gold the answer's bounds or the task's answer grammar refuse (intermediate_integration's gold is
    # sometimes an unevaluated ``Integral(...)``, which no answer may name): such an instance pays nothing.
    ds = reasoning_gym.create_dataset(task, size=2 * limit + 8, seed=seed)
    out = []
    for i, entry in enumerate(ds):
        entry = _jsonable(entry)
        gold = entry.get("answer")
        if gold is not None and (len(str(gold)) > MAX_ANSWER_CHARS  # a long tower_of_hanoi plan: over the box's bound
                                 or grammar_error(task, str(gold), (entry.get("metadata") or {}).get("variable"))):
            continue
        out.append({"data_source": "math", "instance_id": f"rg-{task}-{seed}-{i}", "question": entry["question"],
                    "answer": str(gold), "rg_entry": entry})
        if len(out) == limit:
            break
    return out


def load_dataset(arg: Optional[str] = None, limit: Optional[int] = None, seed: int = 0) -> list[dict]:
    """Entry point for ``prorl-run --dataset reasoning-gym[:task]``."""
    try:
        return load_reasoning_gym(arg, limit=limit, seed=seed)
    except ValueError as e:
        raise DatasetError(str(e)) from None
