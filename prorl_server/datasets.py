"""Dataset specs for ``prorl-run``: a name (``arithmetic``, ``humaneval``, ``reasoning-gym:<task>``) or a path
to a JSONL file with one instance (a JSON object with ``data_source``) per line.

Named datasets come from loaders that live beside their handlers; :data:`LOADERS` maps a name (the part before
``:``) to ``"module:function"``, called as ``fn(arg, limit=..., seed=...) -> list[dict]``.
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any, Optional

LOADERS: dict[str, str] = {
    "arithmetic": "handlers.arithmetic:load_dataset",
    "humaneval": "handlers.code.data:load_dataset",
    "reasoning-gym": "handlers.math.data:load_dataset",
}


class DatasetError(ValueError):
    """The dataset spec names nothing loadable, or a file holds a malformed instance."""


def load_dataset(spec: str, limit: Optional[int] = None, seed: int = 0) -> list[dict[str, Any]]:
    """Instances for ``spec`` (at most ``limit``), each a dict with ``data_source`` and ``instance_id``.

    Raises:
        DatasetError: unknown name, missing file, or a line that is not a JSON object with ``data_source``.
    """
    path = Path(spec)
    if spec.endswith(".jsonl") or path.is_file():
        return _load_jsonl(path, limit)
    name, _, arg = spec.partition(":")
    target = LOADERS.get(name)
    if target is None:
        raise DatasetError(f"unknown dataset {spec!r}: use one of {sorted(LOADERS)} "
                           "(reasoning-gym takes reasoning-gym:<task>) or a path to a .jsonl file")
    module, _, fn = target.partition(":")
    instances = getattr(importlib.import_module(module), fn)(arg or None, limit=limit, seed=seed)
    return instances[:limit] if limit is not None else instances


def _load_jsonl(path: Path, limit: Optional[int]) -> list[dict[str, Any]]:
    if not path.is_file():
        raise DatasetError(f"dataset file {path} does not exist")
    out = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                inst = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            if not isinstance(inst, dict) or not isinstance(inst.get("data_source"), str):
                raise DatasetError(f"{path}:{lineno}: an instance must be a JSON object with a data_source")
            inst.setdefault("instance_id", f"{path.stem}-{lineno}")
            out.append(inst)
            if limit is not None and len(out) >= limit:
                break
    return out
