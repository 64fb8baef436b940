"""Dataset specs for ``prorl-run``: a name (``arithmetic``, ``humaneval``, ``reasoning-gym:<task>``) or a path
to a JSONL file with one instance (a JSON object with ``data_source``) per line.

Named datasets come from loaders that live beside their handlers; :data:`LOADERS` maps a name (the part before
``:``) to ``"module:function"``, called as ``fn(arg, limit=..., seed=...) -> list[dict]``.
"""
from __future__ import annotations

import functools
import importlib
import json
import re
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


# ------------------------------------------------------------------------------ instances by id

#: Shipped datasets whose problems a request may name by ``instance_id`` alone: data source (handler name or
#: alias) -> (the content keys an inline instance carries, ``"module:function"`` that maps an id to the
#: shipped instance or None).
BY_ID: dict[str, tuple[tuple[str, ...], str]] = {
    "code": (("prompt", "tests", "entry_point"), "prorl_server.datasets:_humaneval_by_id"),
    "humaneval": (("prompt", "tests", "entry_point"), "prorl_server.datasets:_humaneval_by_id"),
    "arithmetic": (("expression",), "prorl_server.datasets:_arithmetic_by_id"),
}


def resolve_instance(instance: dict[str, Any]) -> dict[str, Any]:
    """``instance`` completed from its data source's shipped dataset when it names a problem only by id.

    An instance of a :data:`BY_ID` data source that has an ``instance_id`` but none of the content keys gets
    the shipped problem's fields; keys the request sets (``max_turns``, ...) win. Any other instance is
    returned unchanged (inline problems are the handler's to check), and so is one whose id is not in the
    shipped dataset: its handler refuses it as an invalid instance (``failure_kind="invalid_instance"`` in a
    200 result, like any other malformed problem), since the request itself fits the schema.
    """
    entry = BY_ID.get(instance.get("data_source"))  # type: ignore[arg-type]
    iid = instance.get("instance_id")
    if entry is None or not isinstance(iid, str) or any(k in instance for k in entry[0]):
        return instance
    module, _, fn = entry[1].partition(":")
    shipped = getattr(importlib.import_module(module), fn)(iid)
    return instance if shipped is None else {**shipped, **instance}


def _humaneval_by_id(instance_id: str) -> Optional[dict[str, Any]]:
    from handlers.code.data import to_instance

    problem = _humaneval().get(instance_id)
    return None if problem is None else to_instance(problem)


@functools.lru_cache(maxsize=1)
def _humaneval() -> dict[str, dict[str, Any]]:
    from handlers.code.data import humaneval_problems

    return humaneval_problems()


def _arithmetic_by_id(instance_id: str) -> Optional[dict[str, Any]]:
    """``arith-<seed>-<i>``: the i-th instance of ``load_dataset("arithmetic", seed=<seed>)``."""
    m = re.fullmatch(r"arith-(\d{1,9})-(\d{1,4})", instance_id)
    if m is None:
        return None
    return _arithmetic(int(m[1]))[int(m[2])]


@functools.lru_cache(maxsize=4)
def _arithmetic(seed: int) -> tuple[dict[str, Any], ...]:
    """The 10,000 instances of one seed, made once (~0.13 s): ids are resolved during request validation, on
    the event loop, so a request must not regenerate up to 10,000 instances each time."""
    from handlers.arithmetic import load_dataset as arithmetic

    return tuple(arithmetic(None, limit=10000, seed=seed))
