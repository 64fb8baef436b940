"""Dataset specs for ``prorl-run``: a name (``arithmetic``, ``humaneval``, ``reasoning-gym:<task>``) or a path
to a JSONL file with one instance (a JSON object with ``data_source``) per line.

Named datasets are plugins, like handlers: a Python entry point in the group ``prorl_server.datasets``
(``my_data = my_package.data:load_dataset``; the shipped ones are in setup.cfg) names a loader, called as
``fn(arg, limit=..., seed=...) -> list[dict]`` with ``arg`` the part of the spec after ``:`` (or None). A
loader raises :class:`DatasetError` for an argument it cannot load. Naming a problem by ``instance_id`` alone
in a request is the handler's business (``AgentHandler.instance_by_id``), not this module's.
"""
from __future__ import annotations

import json
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Callable, Optional

ENTRY_POINT_GROUP = "prorl_server.datasets"

Loader = Callable[..., list[dict[str, Any]]]


class DatasetError(ValueError):
    """The dataset spec names nothing loadable, or a file holds a malformed instance."""


def dataset_names() -> list[str]:
    """The names of the datasets registered in the ``prorl_server.datasets`` entry-point group."""
    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def dataset_loader(name: str) -> Loader:
    """The loader registered under ``name``.

    Raises:
        DatasetError: no dataset of that name is registered, or its entry point does not import.
    """
    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not found:
        raise DatasetError(f"unknown dataset {name!r}: use one of {dataset_names()} "
                           "(reasoning-gym takes reasoning-gym:<task>) or a path to a .jsonl file")
    try:
        return found[0].load()
    except Exception as e:
        raise DatasetError(f"dataset {name!r} ({found[0].value}) cannot be loaded: {type(e).__name__}: {e}") from e


def load_dataset(spec: str, limit: Optional[int] = None, seed: int = 0) -> list[dict[str, Any]]:
    """Instances for ``spec`` (at most ``limit``), each a dict with ``data_source`` and ``instance_id``.

    Raises:
        DatasetError: unknown name, missing file, or a line that is not a JSON object with ``data_source``.
    """
    path = Path(spec)
    if spec.endswith(".jsonl") or path.is_file():
        return _load_jsonl(path, limit)
    name, _, arg = spec.partition(":")
    instances = dataset_loader(name)(arg or None, limit=limit, seed=seed)
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
