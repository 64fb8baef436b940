"""Journalled results as the trainers' rows: verl, TRL and plain JSONL (``prorl-journal export``).

The rows are what the trainer plugins make of a live result, with nothing cut or re-tokenized (the journal
holds the exact token ids):

- **verl** (:func:`verl_rows`): one row per trajectory segment, the fields of the ``AgentLoopOutput``
  ``trainer_plugins.verl.agent_loop.ProRLAgentLoop.to_outputs`` returns: ``prompt_ids``, ``response_ids``,
  ``response_mask`` (the server's ``loss_mask``), ``response_logprobs`` (per response token, 0.0 outside the
  mask; verl's batch calls them ``rollout_log_probs``), ``reward_score`` (the job's reward, on every segment
  as the V1 worker does), ``acc`` (``reward_extra_info.acc``: 1.0 when resolved), ``num_turns``,
  ``min_global_steps`` / ``max_global_steps`` (the segment's weight versions, else the job's; None when the
  server knew none), plus the job's identity. Unlike the live plugin, nothing is capped to a rollout length.
- **TRL** (:func:`trl_row`): one row per job, the last segment (TRL takes one sequence per prompt entry), the
  keys ``trainer_plugins.trl.rollout.ProRLRollout`` returns per entry: ``prompt_ids``, ``completion_ids``,
  ``logprobs``, ``env_mask`` and the ``prorl_*`` fields (``prorl_token_versions``: each completion token's
  weight version, None on environment tokens).
- **JSONL** (:func:`result_row`): the recorded ``JobResult``, one per line.

verl and TRL rows are made only of results a trainer would train on: ``filter`` false and at least one
segment with prompt tokens (:func:`trainable`); the others are counted, not written.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterable, Optional, Sequence

from prorl_server.types import JobResult, Trajectory

FORMATS = ("jsonl", "verl", "trl")

#: verl columns in order, with their Arrow types (the Parquet schema).
VERL_COLUMNS = (("job_id", "string"), ("instance_id", "string"), ("handler", "string"), ("segment", "int32"),
                ("segments", "int32"), ("prompt_ids", "list<int32>"), ("response_ids", "list<int32>"),
                ("response_mask", "list<int32>"), ("response_logprobs", "list<double>"),
                ("reward_score", "double"), ("acc", "double"), ("num_turns", "int32"),
                ("min_global_steps", "int64"), ("max_global_steps", "int64"), ("failure_kind", "string"),
                ("finish_reason", "string"))


class InvalidRecordError(ValueError):
    """A recorded trajectory whose arrays disagree in length (the message names the job and segment)."""


def trainable(result: JobResult) -> bool:
    """Whether a trainer trains on ``result``: not filtered, and a segment with prompt tokens."""
    return not result.filter and any(t.prompt_ids for t in result.trajectories)


def _checked(result: JobResult, i: int, t: Trajectory) -> tuple[list[int], list[float]]:
    """``(mask, logprobs)`` of segment ``i``, each of length ``len(response_ids)`` (logprobs 0.0 when none were
    recorded). Raises :class:`InvalidRecordError`."""
    n = len(t.response_ids)
    mask = [int(m) for m in t.loss_mask]
    logprobs = [float(x) for x in t.response_logprobs] or [0.0] * n
    if len(mask) != n or len(logprobs) != n:
        raise InvalidRecordError(f"job {result.job_id} segment {i}: {n} response tokens, {len(mask)} mask "
                                 f"entries, {len(logprobs)} logprobs")
    return mask, logprobs


def verl_rows(result: JobResult) -> list[dict[str, Any]]:
    """One verl row per segment of a :func:`trainable` result (see the module docstring), in order.

    Raises:
        InvalidRecordError: a segment's mask or logprobs do not match its response tokens.
    """
    segments = [t for t in result.trajectories if t.prompt_ids]
    reward = float(result.reward)
    acc = 1.0 if result.resolved else 0.0
    rows = []
    for i, t in enumerate(segments):
        mask, logprobs = _checked(result, i, t)
        versions = [v for v in t.weight_versions if isinstance(v, int)] or \
            ([result.weight_version] if result.weight_version is not None else [])
        rows.append({"job_id": result.job_id, "instance_id": result.instance_id, "handler": result.handler,
                     "segment": i, "segments": len(segments), "prompt_ids": list(t.prompt_ids),
                     "response_ids": list(t.response_ids), "response_mask": mask, "response_logprobs": logprobs,
                     "reward_score": reward, "acc": acc,
                     "num_turns": int(t.num_turns or 0) or len(result.messages) or 2,
                     "min_global_steps": min(versions) if versions else None,
                     "max_global_steps": max(versions) if versions else None,
                     "failure_kind": result.failure_kind, "finish_reason": t.finish_reason})
    return rows


def token_versions(t: Trajectory, mask: Sequence[int], versions: Sequence[int]) -> list[Optional[int]]:
    """The weight version of each response token (length ``len(mask)``): from ``version_runs`` over the
    generated tokens, else the one version of ``versions`` when there is exactly one; None on environment tokens
    and where unknown (``trainer_plugins.trl.rollout.per_token_versions``).

    Raises:
        InvalidRecordError: ``version_runs`` covers another number of tokens than ``mask`` marks generated.
    """
    if t.version_runs:
        flat = t.token_versions()
        if len(flat) != sum(1 for m in mask if m):
            raise InvalidRecordError(f"version_runs covers {len(flat)} tokens, the loss mask marks "
                                     f"{sum(1 for m in mask if m)} generated")
        it = iter(flat)
        return [next(it) if m else None for m in mask]
    only = versions[0] if len(set(versions)) == 1 else None
    return [only if m else None for m in mask]


def trl_row(result: JobResult) -> dict[str, Any]:
    """The TRL row of a :func:`trainable` result: its last segment (see the module docstring).

    Raises:
        InvalidRecordError: the segment's mask, logprobs or version runs do not match its tokens.
    """
    segments = [t for t in result.trajectories if t.prompt_ids]
    seg = segments[-1]
    ids = list(seg.response_ids)
    mask = [int(m) for m in seg.loss_mask] or [1] * len(ids)
    logprobs = [float(x) for x in seg.response_logprobs]
    if len(mask) != len(ids) or len(logprobs) != len(ids):
        raise InvalidRecordError(f"job {result.job_id}: {len(ids)} response tokens, {len(mask)} mask entries, "
                                 f"{len(logprobs)} logprobs")
    versions = list(seg.weight_versions) or ([result.weight_version] if result.weight_version is not None else [])
    return {"prompt_ids": list(seg.prompt_ids), "completion_ids": ids, "logprobs": logprobs, "env_mask": mask,
            "prorl_reward": float(result.reward), "prorl_weight_versions": versions,
            "prorl_token_versions": token_versions(seg, mask, versions),
            "prorl_mixed_version_turns": int(seg.mixed_version_turns or 0), "prorl_job_id": result.job_id,
            "prorl_instance_id": result.instance_id, "prorl_filtered": False,
            "prorl_failure_kind": result.failure_kind,
            "prorl_tokens_discarded": sum(sum(s.loss_mask) for s in segments[:-1])}


def result_row(result_json: bytes) -> dict[str, Any]:
    """The recorded result as a dict (its JSON parsed, nothing dropped)."""
    return json.loads(result_json)


def parquet_available() -> bool:
    try:
        import pyarrow  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        return False
    return True


class RowWriter:
    """Writes rows to ``path`` as JSON lines, or as Parquet (``parquet=True``: pyarrow, in row groups of
    ``batch`` rows, with :data:`VERL_COLUMNS`' schema when ``columns`` is it). The file is written to
    ``path + ".partial"`` and renamed on :meth:`close`, so an interrupted export leaves no truncated file under
    the name asked for. Use as a context manager; leaving with an exception removes the partial file."""

    def __init__(self, path: str, *, parquet: bool = False, columns: Optional[Sequence[tuple[str, str]]] = None,
                 batch: int = 1000) -> None:
        self.path, self.parquet, self.columns, self.batch = path, parquet, columns, batch
        self.partial = path + ".partial"
        self.rows = 0
        self._buf: list[dict[str, Any]] = []
        self._writer: Any = None
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        # mode 0600 whatever the umask, as the journal's own files: the rows hold its token ids and rewards,
        # which other local users must not read (pyarrow truncates the file made here and keeps its mode)
        fd = os.open(self.partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        os.fchmod(fd, 0o600)  # a partial file left by an earlier run keeps its mode otherwise
        if parquet:
            os.close(fd)
        self._f = None if parquet else os.fdopen(fd, "w", encoding="utf-8")

    def __enter__(self) -> "RowWriter":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def write(self, row: dict[str, Any]) -> None:
        self.rows += 1
        if self._f is not None:
            self._f.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n")
            return
        self._buf.append(row)
        if len(self._buf) >= self.batch:
            self._flush()

    def write_all(self, rows: Iterable[dict[str, Any]]) -> None:
        for r in rows:
            self.write(r)

    def _schema(self) -> Any:
        import pyarrow as pa

        types = {"string": pa.string(), "int32": pa.int32(), "int64": pa.int64(), "double": pa.float64(),
                 "list<int32>": pa.list_(pa.int32()), "list<double>": pa.list_(pa.float64())}
        return pa.schema([(name, types[t]) for name, t in self.columns]) if self.columns else None

    def _flush(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self._buf:
            return
        table = pa.Table.from_pylist(self._buf, schema=self._schema())
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.partial, table.schema)
        self._writer.write_table(table)
        self._buf = []

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
        else:
            if self._writer is None:  # no rows: an empty file with the schema
                import pyarrow as pa
                import pyarrow.parquet as pq

                schema = self._schema()
                self._writer = pq.ParquetWriter(self.partial, schema if schema is not None else pa.schema([]))
            self._flush()
            self._writer.close()
        os.replace(self.partial, self.path)

    def abort(self) -> None:
        try:
            if self._f is not None:
                self._f.close()
            elif self._writer is not None:
                self._writer.close()
        finally:
            try:
                os.unlink(self.partial)
            except OSError:
                pass
