"""A stand-in for TransferQueue's KV store (a Ray controller and storage actors, not started in the fast tier), as
verl 0.9.1's V1 replay buffer reads it and its agent loop workers write it: tags and rows of one partition
(``"train"``), answered through the synchronous ``kv_list`` / ``kv_batch_get`` / ``kv_clear``. Shared by the
replay-buffer and worker tests, which load it by path (``tests`` is not a package here, and verl's wheel installs
one of that name)."""
from __future__ import annotations


class KVStore:
    def __init__(self) -> None:
        self.tags: dict[str, dict] = {}
        self.rows: dict[str, dict] = {}

    def kv_list(self, partition_id=None):
        return {"train": {k: dict(v) for k, v in self.tags.items()}}

    def kv_batch_get(self, keys, partition_id, select_fields=None):
        return {f: [self.rows[k][f] for k in keys] for f in select_fields}

    def kv_clear(self, keys, partition_id):
        for k in [keys] if isinstance(keys, str) else keys:
            self.tags.pop(k, None)
            self.rows.pop(k, None)

    def install(self, monkeypatch, tq) -> None:
        """Answer ``tq``'s (the ``transfer_queue`` module's) synchronous reads from this store."""
        for name in ("kv_list", "kv_batch_get", "kv_clear"):
            monkeypatch.setattr(tq, name, getattr(self, name))

