"""verl V1 replay buffer that drops the prompt group of a filtered sample (verl 0.9.1, async trainer modes).

A sample the rollout server marked ``filter: true`` (an infrastructure fault: dead sandbox, unreachable backend,
harness fault, timeout) and that still failed after the agent loop's retries reaches verl as a zero-loss row
with ``extra_fields.prorl.filter`` true (:mod:`trainer_plugins.verl.agent_loop`). The row itself trains
nothing, but GRPO would still count its reward 0 in its group's baseline, so the group's other samples would
get advantages against a reward the model never earned. :class:`ProRLReplayBuffer` evicts such a group when it
is complete, exactly as verl's ``ReplayBufferAsync`` evicts a failed group (a session that raised), and verl
refills one fresh prompt for it. The count is reported as ``training/prorl_filtered/evicted_samples`` (and in
verl's ``training/rollout_failure/evicted_samples``).

It also stops training on a configuration fault: verl's V1 worker catches every exception of a session, so the
agent loop stores a row marked ``extra_fields.prorl.fatal`` (the fault's message) instead of raising, and this
buffer raises :class:`ConfigurationFault` with that message in the trainer process when it reads the row.

Set in ``config/prorl_base.yaml``::

    trainer.v1.sampler.custom_sampler: {path: pkg://trainer_plugins.verl.replay_buffer, name: ProRLReplayBuffer}
    trainer.v1.sampler.sampler_kwargs: {filter_groups_enable: ..., filter_groups_metric: ...}

verl hands a custom sampler no ``filter_groups_metric`` (``PPOTrainer._build_replay_buffer``), so DAPO's
``algorithm.filter_groups`` reaches it through ``sampler_kwargs``; everything else (staleness ``drop``/``wait``,
DAPO filtering, refill) is verl's own ``ReplayBufferAsync``. The sync trainer mode is not supported: its
buffer needs batch sizes verl computes only for its built-in sampler (use verl's sampler there; filtered rows
then keep zero loss but stay in their group).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import transfer_queue as tq
from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync

FILTERED_METRIC = "prorl_filtered/evicted_samples"
#: samples cut to the rollout lengths (masked or filtered, per the agent loop's ``truncation`` setting)
TRUNCATED_METRIC = "prorl_truncated/samples"


def truncation_of(extra_fields: Any) -> Any:
    """``extra_fields.prorl.truncated`` of a stored trajectory (None when it was not cut)."""
    fields = getattr(extra_fields, "data", extra_fields)
    prorl = fields.get("prorl") if isinstance(fields, dict) else None
    return prorl.get("truncated") if isinstance(prorl, dict) else None


class ConfigurationFault(RuntimeError):
    """Raised in the trainer process when a stored row carries ``extra_fields.prorl.fatal``: an agent loop hit
    a fault no retry can fix (see :mod:`trainer_plugins.verl.agent_loop`, "Configuration faults")."""


def fatal_of(extra_fields: Any) -> Any:
    """``extra_fields.prorl.fatal`` of a stored trajectory: the message of a configuration fault, or None."""
    fields = getattr(extra_fields, "data", extra_fields)
    prorl = fields.get("prorl") if isinstance(fields, dict) else None
    return prorl.get("fatal") if isinstance(prorl, dict) else None


def is_filtered(extra_fields: Any) -> bool:
    """Whether a stored trajectory's ``extra_fields`` (a dict, or TransferQueue's ``NonTensorData`` of one)
    marks a filtered sample."""
    fields = getattr(extra_fields, "data", extra_fields)
    prorl = fields.get("prorl") if isinstance(fields, dict) else None
    return bool(isinstance(prorl, dict) and prorl.get("filter"))


class ProRLReplayBuffer(ReplayBufferAsync):
    """``ReplayBufferAsync`` that also evicts (and refills) every complete group holding a filtered row.

    Args:
        sampler_kwargs: ``trainer.v1.sampler.sampler_kwargs``; ``filter_groups_enable`` (bool) and
            ``filter_groups_metric`` (str) carry ``algorithm.filter_groups`` (DAPO) to verl's buffer.
        **kwargs: what verl's trainer passes every sampler (``trainer_mode``, ``refill_fn``, ...).

    Raises:
        ValueError: ``trainer_mode`` is ``sync`` (see the module docstring).
    """

    def __init__(self, *, sampler_kwargs: Any = None, **kwargs: Any) -> None:
        sampler_kwargs = dict(sampler_kwargs or {})
        if kwargs.get("trainer_mode") == "sync":
            raise ValueError("ProRLReplayBuffer serves verl's async trainer modes (colocate_async, "
                             "separate_async); for trainer.v1.trainer_mode=sync unset "
                             "trainer.v1.sampler.custom_sampler")
        if sampler_kwargs.get("filter_groups_enable") and "filter_groups_metric" not in kwargs:
            kwargs["filter_groups_metric"] = str(sampler_kwargs.get("filter_groups_metric") or "acc")
        super().__init__(sampler_kwargs=sampler_kwargs, **kwargs)
        # partition -> {uid: holds a filtered row}; complete groups do not change, so each is read once
        self._filtered_cache: dict[str, dict[str, bool]] = defaultdict(dict)
        self._last_filtered: set[str] = set()  # of the last _terminal_eviction_reasons, for its metric
        self._truncated = 0  # cut samples seen since the last metrics

    def filtered_groups(self, partition_id: str) -> set[str]:
        """uids of the complete groups of ``partition_id`` with at least one filtered row (read from
        TransferQueue's ``extra_fields``; validation groups are never evicted)."""
        if partition_id == "val":
            return set()
        finished = self.finished_keys[partition_id]
        cache = self._filtered_cache[partition_id]
        for uid in cache.keys() - finished:
            del cache[uid]
        new = finished - cache.keys()
        keys = [key for key in self.partitions[partition_id] if key.split("_")[0] in new]
        for uid in new:
            cache[uid] = False
        if keys:
            data = tq.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=["extra_fields"])
            for key, fields in zip(keys, data["extra_fields"], strict=True):
                fatal = fatal_of(fields)
                if fatal:  # a configuration fault in an agent loop worker: stop training with its message
                    raise ConfigurationFault(f"a rollout worker hit a fault no retry can fix, training stops: "
                                             f"{fatal}")
                if is_filtered(fields):
                    cache[key.split("_")[0]] = True
                if truncation_of(fields) and key.endswith("_0"):  # one count per sample (its first segment)
                    self._truncated += 1
        return {uid for uid, filtered in cache.items() if filtered}

    def sample(self, global_steps: int, partition_id: str, batch_size: int):
        batch, metrics = super().sample(global_steps, partition_id, batch_size)
        if partition_id != "val":
            metrics = dict(metrics or {})
            metrics[f"{self._metrics_prefix(partition_id)}/{TRUNCATED_METRIC}"] = self._truncated
            self._truncated = 0
        return batch, metrics

    def _terminal_eviction_reasons(self, global_steps: int, partition_id: str):
        stale, dapo, failed, dapo_counts = super()._terminal_eviction_reasons(global_steps, partition_id)
        self._last_filtered = self.filtered_groups(partition_id)
        return stale, dapo, failed | self._last_filtered, dapo_counts

    def _evict_terminal_groups(self, global_steps: int, partition_id: str, eviction_reasons):
        filtered = self._last_filtered & eviction_reasons[2]
        evicted, stale_count, dapo_count, metrics = super()._evict_terminal_groups(
            global_steps, partition_id, eviction_reasons)
        if filtered & evicted:
            metrics[f"{self._metrics_prefix(partition_id)}/{FILTERED_METRIC}"] = len(filtered & evicted)
            for uid in filtered & evicted:
                self._filtered_cache[partition_id].pop(uid, None)
        return evicted, stale_count, dapo_count, metrics
