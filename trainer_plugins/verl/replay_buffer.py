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

Persistent faults stop training too (issue #32). A filtered group is evicted and refilled, which is right for a
fault that passes and a spin for one that does not, so every complete group is also shown to a
:class:`trainer_plugins.breaker.FaultBreaker`: ``breaker_consecutive_groups`` (default 8) groups in a row
filtered for one ``failure_kind``, or more than ``breaker_max_share`` (0.9) of the last ``breaker_window``
(64) samples, raise :class:`trainer_plugins.breaker.PersistentFaultError` naming the kind, the count and the last
error. And DAPO's cap, which verl's V1 trainer ignores (``algorithm.filter_groups.max_num_gen_batches``: it only
logs that it does), is enforced here: when ``max_num_gen_batches * train_batch_size`` groups have been
dropped by DAPO's filter (every sample's metric equal) since the last training step, training stops with
:class:`DapoFilterExhausted`, naming the metric and the values the groups had (verl's legacy DAPO trainer stops
the same way; training on what is there instead would train groups whose advantages are all 0, i.e. nothing).
``max_num_gen_batches: 0`` waits forever, as in verl.

Async bookkeeping and stale work (issue #32). Every step's metrics say what happened to the rollouts
(``training/prorl_async/``: completed, trained, discarded as stale, cancelled while stale, and the staleness
histogram of the trained rows; see :data:`COMPLETED_METRIC`). After each step's sample the groups still in
flight that verl's staleness rule must evict at the next step are cancelled in the agent loop workers
(:mod:`trainer_plugins.verl.stale`; ``sampler_kwargs.cancel_stale: false`` turns it off); their rows come back
marked ``extra_fields.prorl.stale`` and are evicted as stale, never counted as filtered or as faults.

Set in ``config/prorl_base.yaml``::

    trainer.v1.sampler.custom_sampler: {path: pkg://trainer_plugins.verl.replay_buffer, name: ProRLReplayBuffer}
    trainer.v1.sampler.sampler_kwargs: {filter_groups_enable: ..., filter_groups_metric: ...,
                                        filter_groups_max_num_gen_batches: ..., train_batch_size: ...,
                                        breaker_consecutive_groups: 8, breaker_window: 64, breaker_max_share: 0.9}

verl hands a custom sampler no ``filter_groups_metric`` (``PPOTrainer._build_replay_buffer``), so DAPO's
``algorithm.filter_groups`` reaches it through ``sampler_kwargs``; everything else (staleness ``drop``/``wait``,
DAPO filtering, refill) is verl's own ``ReplayBufferAsync``. The sync trainer mode is not supported: its
buffer needs batch sizes verl computes only for its built-in sampler (use verl's sampler there; filtered rows
then keep zero loss but stay in their group).
"""
from __future__ import annotations

import logging
import math
from collections import Counter, defaultdict
from typing import Any, Callable, Optional

import transfer_queue as tq
from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync

from trainer_plugins.breaker import FaultBreaker, PersistentFaultError, Sample
from trainer_plugins.verl.stale import RayStaleCanceller

logger = logging.getLogger(__name__)

FILTERED_METRIC = "prorl_filtered/evicted_samples"
#: per-step async metrics (``training/`` + these): samples (a sample is one session of a prompt group, however
#: many segments it has) completed since the last step, trained in this step's batch, completed but discarded
#: as stale (their group's prompt step is past ``max_off_policy_threshold``), and stale samples cancelled while
#: they ran (never completed). Names end in ``_total`` so verl's ``MetricsAggregator`` sums them over the
#: ``parameter_sync_step`` iterations of a step instead of averaging them.
COMPLETED_METRIC = "prorl_async/rollouts_completed_total"
TRAINED_METRIC = "prorl_async/rollouts_trained_total"
DISCARDED_STALE_METRIC = "prorl_async/rollouts_discarded_stale_total"
CANCELLED_STALE_METRIC = "prorl_async/rollouts_cancelled_stale_total"
#: ``training/prorl_async/staleness_total/{k}``: trained rows whose oldest weights are ``k`` versions behind the
#: policy being trained (``global_steps - 1 - min_global_steps``: verl's ``trajectory_staleness_worst``)
STALENESS_HIST_METRIC = "prorl_async/staleness_total"
#: samples cut to the rollout lengths (masked or filtered, per the agent loop's ``truncation`` setting)
TRUNCATED_METRIC = "prorl_truncated/samples"
#: ``training/prorl_reward/{name}``: the mean weighted reward component (``weight * value``, issue #35 part 4)
#: over the samples completed since the last step that report it
REWARD_COMPONENT_METRIC = "prorl_reward"


def reward_components_of(extra_fields: Any) -> dict[str, float]:
    """``extra_fields.prorl.reward_components`` of a stored trajectory (name -> weighted term; finite floats
    only, the server checked them), ``{}`` when it has none."""
    fields = getattr(extra_fields, "data", extra_fields)
    prorl = fields.get("prorl") if isinstance(fields, dict) else None
    comps = prorl.get("reward_components") if isinstance(prorl, dict) else None
    if not isinstance(comps, dict):
        return {}
    return {str(k): float(v) for k, v in comps.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


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


class DapoFilterExhausted(RuntimeError):
    """DAPO's group filter dropped ``max_num_gen_batches`` batches' worth of groups since the last
    training step (every sample of each had the same metric): the message names the metric and its values."""


def sample_of(extra_fields: Any) -> Sample:
    """The :class:`trainer_plugins.breaker.Sample` of a stored trajectory: its ``failure_kind`` when it is a
    filtered row (``"truncated"`` for a sample filtered for its length), None when it can be trained on."""
    fields = getattr(extra_fields, "data", extra_fields)
    prorl = fields.get("prorl") if isinstance(fields, dict) else None
    if not (isinstance(prorl, dict) and prorl.get("filter")):
        return Sample()
    kind = prorl.get("failure_kind") or ("truncated" if prorl.get("truncated") else "filtered")
    error = prorl.get("error") or (f"cut to the rollout lengths: {prorl.get('truncated')}"
                                   if prorl.get("truncated") else None)
    return Sample(str(kind), None if error is None else str(error))


def is_stale_cancelled(extra_fields: Any) -> bool:
    """Whether a stored trajectory is a sample the trainer cancelled because its group had become stale
    (``extra_fields.prorl.stale``, written by the agent loop; its ``failure_kind`` is ``cancelled``)."""
    fields = getattr(extra_fields, "data", extra_fields)
    prorl = fields.get("prorl") if isinstance(fields, dict) else None
    return bool(isinstance(prorl, dict) and prorl.get("stale"))


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
        self.breaker = FaultBreaker(consecutive=int(sampler_kwargs.get("breaker_consecutive_groups", 8)),
                                    window=int(sampler_kwargs.get("breaker_window", 64)),
                                    max_share=float(sampler_kwargs.get("breaker_max_share", 0.9)),
                                    what="training (ProRLReplayBuffer)")
        self.max_num_gen_batches = int(sampler_kwargs.get("filter_groups_max_num_gen_batches") or 0)
        self.train_batch_size: Optional[int] = (int(sampler_kwargs["train_batch_size"])
                                                if sampler_kwargs.get("train_batch_size") else None)
        self._dapo_dropped: Counter = Counter()  # metric value -> DAPO-dropped groups since the last step
        self._batch_size: Optional[int] = None  # groups the sample in progress needs
        # partition -> {uid: holds a filtered row}; complete groups do not change, so each is read once
        self._filtered_cache: dict[str, dict[str, bool]] = defaultdict(dict)
        self._last_filtered: set[str] = set()  # of the last _terminal_eviction_reasons, for its metric
        self._truncated = 0  # cut samples seen since the last metrics
        self._completed = 0  # samples of groups that finished since the last metrics (stale-cancelled ones not)
        self._components: dict[str, list[float]] = defaultdict(list)  # name -> weighted terms since the last step
        self._discarded_stale = 0  # completed samples of groups evicted as stale since the last metrics
        self._cancelled_rows: dict[str, dict[str, int]] = defaultdict(dict)  # partition -> uid -> cancelled samples
        # stale work cancelled (trainer_plugins/verl/stale.py): only where verl drops stale groups
        self.stale_canceller: Optional[Callable[[set[str]], int]] = None
        if (sampler_kwargs.get("cancel_stale", True) and self.max_off_policy_threshold is not None
                and self.max_off_policy_strategy == "drop"):
            self.stale_canceller = RayStaleCanceller(kwargs.get("refill_fn"))
        self._cancel_sent: set[str] = set()  # uids handed to the canceller, while they are still in flight

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
            groups: dict[str, list[Sample]] = defaultdict(list)
            for key, fields in zip(keys, data["extra_fields"], strict=True):
                fatal = fatal_of(fields)
                if fatal:  # a configuration fault in an agent loop worker: stop training with its message
                    raise ConfigurationFault(f"a rollout worker hit a fault no retry can fix, training stops: "
                                             f"{fatal}")
                uid = key.split("_")[0]
                if key.endswith("_0") and is_stale_cancelled(fields):
                    # the trainer's own decision, not a fault: verl evicts the group as stale; never a
                    # filtered eviction, and not a completed rollout
                    self._cancelled_rows[partition_id][uid] = self._cancelled_rows[partition_id].get(uid, 0) + 1
                    groups[uid].append(sample_of(fields))
                    continue
                if is_filtered(fields):
                    cache[uid] = True
                if key.endswith("_0"):  # one count per sample (its first segment; a filtered sample has one)
                    groups[uid].append(sample_of(fields))
                    self._completed += 1
                    for name, term in reward_components_of(fields).items():
                        self._components[name].append(term)
                    if truncation_of(fields):
                        self._truncated += 1
            for samples in groups.values():  # each complete group once: a persistent fault stops training
                self.breaker.record_group(samples)
        return {uid for uid, filtered in cache.items() if filtered}

    def sample(self, global_steps: int, partition_id: str, batch_size: int):
        if partition_id != "val":
            self._batch_size = int(batch_size)
        batch, metrics = super().sample(global_steps, partition_id, batch_size)
        if partition_id != "val":
            self._dapo_dropped.clear()  # a step's batch was found: DAPO's cap counts per step
            metrics = dict(metrics or {})
            prefix = self._metrics_prefix(partition_id)
            metrics[f"{prefix}/{TRUNCATED_METRIC}"] = self._truncated
            metrics.update(self.async_metrics(global_steps, prefix, batch))
            metrics[f"{prefix}/{CANCELLED_STALE_METRIC}"] = self.cancel_stale(global_steps, partition_id)
            metrics.update({f"{prefix}/{REWARD_COMPONENT_METRIC}/{name}": sum(v) / len(v)
                            for name, v in sorted(self._components.items())})
            self._components.clear()
            self._truncated = self._completed = self._discarded_stale = 0
        return batch, metrics

    def stale_in_flight(self, global_steps: int, partition_id: str) -> set[str]:
        """uids of the prompt groups still pending or running (the last TransferQueue snapshot) that the next
        sample, at step ``global_steps + 1``, must evict: verl's rule ``step - s + 1 > max_off_policy_threshold``
        for a group sampled at step ``s``, one step ahead. Empty unless the strategy is ``drop``."""
        if partition_id == "val" or self.max_off_policy_threshold is None or self.max_off_policy_strategy != "drop":
            return set()
        steps = self.prompt_global_steps[partition_id]
        in_flight = self.pending_keys[partition_id] | self.running_keys[partition_id]
        return {uid for uid in in_flight
                if global_steps + 1 - steps.get(uid, global_steps) + 1 > self.max_off_policy_threshold}

    def cancel_stale(self, global_steps: int, partition_id: str) -> int:
        """After step ``global_steps``'s batch was sampled: hand the groups :meth:`stale_in_flight` names (each
        once) to :attr:`stale_canceller`, which cancels their running jobs (:mod:`trainer_plugins.verl.stale`).
        Returns how many samples were cancelled."""
        in_flight = self.pending_keys[partition_id] | self.running_keys[partition_id]
        self._cancel_sent &= in_flight
        stale = self.stale_in_flight(global_steps, partition_id) - self._cancel_sent
        if not stale or self.stale_canceller is None:
            return 0
        self._cancel_sent |= stale
        cancelled = int(self.stale_canceller(stale))
        logger.info("step %d: %d prompt groups can no longer be trained (max_off_policy_threshold=%d): %d running "
                    "samples cancelled", global_steps, len(stale), self.max_off_policy_threshold, cancelled)
        return cancelled

    def async_metrics(self, global_steps: int, prefix: str, batch: Any) -> dict[str, float]:
        """This step's async bookkeeping (see :data:`COMPLETED_METRIC` and the names after it): samples
        completed since the last step, trained in ``batch`` (verl's ``KVBatchMeta``: ``keys``
        ``{uid}_{session}_{index}`` and their ``tags``), discarded as stale, and the staleness histogram of the
        trained rows (each row counted; staleness in weight versions, ``global_steps - 1 - min_global_steps``)."""
        hist: Counter = Counter()
        for tag in batch.tags:
            if tag.get("is_padding") or tag.get("min_global_steps") is None:
                continue
            hist[max(0, int(global_steps) - 1 - int(tag["min_global_steps"]))] += 1
        metrics: dict[str, float] = {
            f"{prefix}/{COMPLETED_METRIC}": self._completed,
            f"{prefix}/{TRAINED_METRIC}": sum(1 for key in batch.keys if key.endswith("_0")),
            f"{prefix}/{DISCARDED_STALE_METRIC}": self._discarded_stale,
        }
        metrics.update({f"{prefix}/{STALENESS_HIST_METRIC}/{k}": n for k, n in sorted(hist.items())})
        return metrics

    def _terminal_eviction_reasons(self, global_steps: int, partition_id: str):
        stale, dapo, failed, dapo_counts = super()._terminal_eviction_reasons(global_steps, partition_id)
        self._last_filtered = self.filtered_groups(partition_id)
        return stale, dapo, failed | self._last_filtered, dapo_counts

    def _evict_terminal_groups(self, global_steps: int, partition_id: str, eviction_reasons):
        filtered = self._last_filtered & eviction_reasons[2]
        if partition_id != "val" and eviction_reasons[0]:  # completed samples of the groups evicted as stale
            stale, cancelled = eviction_reasons[0], self._cancelled_rows[partition_id]
            samples = sum(1 for key in self.partitions[partition_id]
                          if key.endswith("_0") and key.split("_")[0] in stale)
            self._discarded_stale += max(0, samples - sum(cancelled.get(uid, 0) for uid in stale))
        self._count_dapo_drops(partition_id, eviction_reasons[1] - self._last_filtered,
                               len(self._sampleable_terminal_keys(partition_id, eviction_reasons)))
        evicted, stale_count, dapo_count, metrics = super()._evict_terminal_groups(
            global_steps, partition_id, eviction_reasons)
        if filtered & evicted:
            metrics[f"{self._metrics_prefix(partition_id)}/{FILTERED_METRIC}"] = len(filtered & evicted)
            for uid in filtered & evicted:
                self._filtered_cache[partition_id].pop(uid, None)
        for uid in evicted:
            self._cancelled_rows[partition_id].pop(uid, None)
        return evicted, stale_count, dapo_count, metrics

    def _count_dapo_drops(self, partition_id: str, uids: set[str], sampleable: int) -> None:
        """Count the groups DAPO's filter drops now (their metric value, read before verl clears them); at
        ``max_num_gen_batches * train_batch_size`` groups since the last step while fewer than a batch
        (``sampleable`` groups) can be trained, raise :class:`DapoFilterExhausted`."""
        if not uids or partition_id == "val":
            return
        cache = self._dapo_classification_cache[partition_id]
        self._dapo_dropped.update(cache.get(uid) for uid in uids)
        dropped = sum(self._dapo_dropped.values())
        need = self._batch_size or self.train_batch_size or 0
        cap = self.max_num_gen_batches * (self.train_batch_size or need)
        if self.max_num_gen_batches > 0 and cap and dropped >= cap and sampleable < need:
            metric = self.filter_groups_metric
            values = ", ".join(f"{v!r}: {n}" for v, n in self._dapo_dropped.most_common())
            raise DapoFilterExhausted(
                f"training stops: DAPO's group filter (algorithm.filter_groups, metric {metric!r}) dropped {dropped} "
                f"prompt groups since the last training step: max_num_gen_batches="
                f"{self.max_num_gen_batches} batches of train_batch_size={self.train_batch_size}: every sample of "
                f"each group had the same {metric!r} (groups per value: {{{values}}}), so no group has a learning "
                "signal. The tasks are too hard (all 0) or too easy (all 1) for this policy, or the metric never "
                "varies: use other data, raise rollout.n, check the reward, or set "
                "algorithm.filter_groups.max_num_gen_batches=0 to wait without a cap")

