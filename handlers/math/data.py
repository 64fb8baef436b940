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
from handlers.math.rg_answers import task_error

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
    ds = reasoning_gym.create_dataset(task, size=limit or 16, seed=seed)
    out = []
    for i, entry in enumerate(ds):
        entry = _jsonable(entry)
        out.append({"data_source": "math", "instance_id": f"rg-{task}-{seed}-{i}", "question": entry["question"],
                    "answer": str(entry["answer"]), "rg_entry": entry})
    return out


def load_dataset(arg: Optional[str] = None, limit: Optional[int] = None, seed: int = 0) -> list[dict]:
    """Entry point for ``prorl-run --dataset reasoning-gym[:task]``."""
    try:
        return load_reasoning_gym(arg, limit=limit, seed=seed)
    except ValueError as e:
        raise DatasetError(str(e)) from None
