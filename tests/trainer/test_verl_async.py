"""The shipped verl configs train asynchronously within a bound, and every step says what happened to its rollouts
(issue #32 part 1).

Found with verl 0.9.1's real trainer on CPU: the shipped ``max_off_policy_threshold: 1`` made training strictly
on-policy; verl's ``colocate_async`` trainer submits a warm-up batch and then one batch a step, trains one, and
evicts the rest at the next step as stale: in a 40-step run 624 of 1,280 completed rollouts were thrown away,
and no metric said so (verl logs evicted *groups*, not what was completed, trained or wasted).

Real: the shipped Hydra configs as ``main_ppo`` composes them, verl's ``ReplayBufferAsync`` under the plugin's
``ProRLReplayBuffer`` built with the composed sampler settings. Stand-in: :class:`StepStore` for TransferQueue's
KV store (it needs Ray actors) and for the agent loop workers that fill it, driven step by step as verl's
``PPOTrainerColocateAsync`` drives the buffer (warm-up batch, one batch submitted per step, refills at the
current step, the trained rows cleared after the step).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")

_kv_spec = importlib.util.spec_from_file_location("_prorl_kv_store", Path(__file__).with_name("kv_store.py"))
kv_store = importlib.util.module_from_spec(_kv_spec)  # the shared TransferQueue stand-in
_kv_spec.loader.exec_module(kv_store)

N = 4  # rollout.n in these tests
B = 2  # data.train_batch_size (prompt groups a step trains)


class StepStore(kv_store.KVStore):
    """Stands in for TransferQueue's KV store as verl's V1 replay buffer reads it (``kv_list``, ``kv_batch_get``,
    ``kv_clear``) and for verl's agent loop workers writing it: :meth:`submit` adds prompt groups sampled at
    ``step`` (``status`` ``finished``: every session stored, generated with the weights of ``version``; or
    ``running``: its sessions are still out). Rows carry what ``ProRLAgentLoop.to_outputs`` writes."""

    def __init__(self) -> None:
        super().__init__()
        self.made = 0
        self.step = 1

    def submit(self, k: int, step: int, status: str = "finished", version: int | None = None) -> list[str]:
        uids = []
        for _ in range(k):
            uid = f"u{self.made:04d}"
            self.made += 1
            uids.append(uid)
            self.tags[uid] = {"is_prompt": True, "status": status, "global_steps": step}
            if status == "finished":
                self.finish(uid, version=step - 1 if version is None else version)
        return uids

    def finish(self, uid: str, version: int, extra: dict | None = None) -> None:
        self.tags[uid]["status"] = "finished"
        for s in range(N):
            self.tags[f"{uid}_{s}_0"] = {"status": "success", "global_steps": self.tags[uid]["global_steps"],
                                         "min_global_steps": version, "max_global_steps": version}
            prorl = {"filter": False, "failure_kind": None, "error": None, "truncated": None, **(extra or {})}
            acc = float(s % 2)  # mixed rewards: DAPO's filter keeps the group
            self.rows[f"{uid}_{s}_0"] = {"extra_fields": {"reward_extra_info": {"acc": acc, "score": acc},
                                                          "min_global_steps": version,
                                                          "max_global_steps": version, "prorl": prorl}}

    def refill(self, k: int) -> int:  # verl's refill_fn: fresh prompts sampled at the current step
        self.submit(k, self.step)
        return k


def shipped_buffer(compose_verl, monkeypatch, name: str, store: StepStore):
    """``ProRLReplayBuffer`` built from the shipped config ``name`` as verl's ``PPOTrainer._build_replay_buffer``
    builds a custom sampler, reading ``store``."""
    import transfer_queue as tq
    from omegaconf import OmegaConf
    from verl.utils.import_utils import load_extern_type

    cfg = compose_verl(name, f"data.train_batch_size={B}", f"actor_rollout_ref.rollout.n={N}")
    sampler = cfg.trainer.v1.sampler
    store.install(monkeypatch, tq)
    cls = load_extern_type(sampler.custom_sampler.path, sampler.custom_sampler.name)
    return cls(trainer_mode=cfg.trainer.v1.trainer_mode, trainer_config={},
               max_off_policy_threshold=sampler.max_off_policy_threshold,
               max_off_policy_strategy=sampler.max_off_policy_strategy,
               sampler_kwargs=OmegaConf.to_container(sampler.sampler_kwargs, resolve=True),
               refill_fn=store.refill, poll_interval=0.0), cfg


def train_step(buf, store: StepStore, step: int) -> tuple[set[str], dict]:
    """One step of verl's colocate_async loop on the buffer: sample the batch, then clear its rows (as
    ``PPOTrainer.fit`` does after the update). Returns the trained prompt uids and the step's metrics."""
    store.step = step
    batch, metrics = buf.sample(step, "train", B)
    store.kv_clear(batch.keys, "train")
    return {k.split("_")[0] for k in batch.keys}, metrics


@pytest.mark.parametrize("name", ["prorl_dapo", "prorl_cispo"])
def test_shipped_configs_train_the_previous_steps_rollouts_instead_of_discarding_them(compose_verl, monkeypatch,
                                                                                      name):
    store = StepStore()
    buf, cfg = shipped_buffer(compose_verl, monkeypatch, name, store)
    # off-policy within a bound, corrected by importance sampling on the rollout log-probs
    assert cfg.trainer.v1.trainer_mode in ("colocate_async", "separate_async")
    assert cfg.trainer.v1.sampler.max_off_policy_threshold >= 2
    assert cfg.trainer.v1.sampler.max_off_policy_strategy == "drop"
    assert cfg.algorithm.rollout_correction.rollout_is == "token"
    assert cfg.actor_rollout_ref.rollout.calculate_log_probs

    # step 1: verl's warm-up batch and the step's own batch, both sampled at step 1 with weights v0
    step1 = set(store.submit(B, 1)) | set(store.submit(B, 1))
    trained, m1 = train_step(buf, store, 1)
    assert len(trained) == B and trained <= step1
    assert m1["training/prorl_async/rollouts_completed_total"] == 2 * B * N
    assert m1["training/prorl_async/rollouts_trained_total"] == B * N
    assert m1["training/prorl_async/rollouts_discarded_stale_total"] == 0
    assert m1["training/prorl_async/staleness_total/0"] == B * N
    # step 2: one more batch sampled (finished with weights v1); the step-1 leftovers are one version old
    store.submit(B, 2)
    leftovers = step1 - trained
    trained, m2 = train_step(buf, store, 2)
    assert trained == leftovers, "the previous step's completed rollouts were discarded instead of trained"
    assert m2["training/prorl_async/rollouts_discarded_stale_total"] == 0
    assert "training/off_policy/evicted_samples" not in m2
    assert m2["training/prorl_async/rollouts_completed_total"] == B * N
    assert m2["training/prorl_async/rollouts_trained_total"] == B * N
    assert m2["training/prorl_async/staleness_total/1"] == B * N  # generated by v0, trained after v1
    assert "training/prorl_async/staleness_total/0" not in m2


def test_rollouts_past_the_bound_are_discarded_and_counted_as_such(compose_verl, monkeypatch):
    store = StepStore()
    buf, cfg = shipped_buffer(compose_verl, monkeypatch, "prorl_dapo", store)
    bound = cfg.trainer.v1.sampler.max_off_policy_threshold
    old = set(store.submit(B, 1, status="running"))  # a slow group sampled at step 1
    for step in range(1, bound + 2):
        store.submit(B, step)
        trained, metrics = train_step(buf, store, step)
        assert not trained & old
    for uid in old:  # it completes only now, at step bound + 2: past the bound
        store.finish(uid, version=1)
    store.submit(B, bound + 2)
    trained, metrics = train_step(buf, store, bound + 2)
    assert not trained & old
    assert metrics["training/prorl_async/rollouts_discarded_stale_total"] == B * N
    assert metrics["training/off_policy/evicted_samples"] == B  # verl's own count, in groups
