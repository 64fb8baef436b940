"""The verl plugin under verl's V1 trainer: ``AgentLoopWorkerTQ`` (verl 0.9.1) runs the plugin's agent loop for
whole prompt groups and stores every output in TransferQueue; verl's V1 GRPO advantage and replay buffer then
read them back. A failed job, a split rollout and a normal group go through together.

Fast tier: verl's real ``AgentLoopWorkerTQ`` code (``generate_sequences`` -> ``_run_prompt`` ->
``_run_agent_loop`` -> ``_agent_loop_postprocess``) on real rollout servers, with TransferQueue's KV calls
answered by :class:`KVStore` (TransferQueue needs Ray and its actors, which this tier does not start).
Real tier: the worker as a real Ray actor, real TransferQueue, and the plugin's ``ProRLReplayBuffer`` sampling
from it.
"""
from __future__ import annotations

import asyncio
import importlib.util
import uuid
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl.experimental.agent_loop import agent_loop as verl_agent_loop  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl.trainer.ppo.core_algos import AdvantageEstimator  # noqa: E402
from verl.trainer.ppo.v1 import agent_loop_tq  # noqa: E402
from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402
from verl.utils.dataset.rl_dataset import RLHFDataset  # noqa: E402
from verl.utils.import_utils import resolve_config_path  # noqa: E402

_kv_spec = importlib.util.spec_from_file_location("_prorl_kv_store", Path(__file__).with_name("kv_store.py"))
kv_store = importlib.util.module_from_spec(_kv_spec)  # the shared TransferQueue stand-in
_kv_spec.loader.exec_module(kv_store)


PROMPT_LEN, RESPONSE_LEN, N = 64, 16, 2
TQWorker = agent_loop_tq.AgentLoopWorkerTQ.__ray_actor_class__  # the class under verl's @ray.remote


@pytest.fixture
def v1_cfg(compose_verl):
    return compose_verl("prorl_dapo", f"actor_rollout_ref.rollout.n={N}", prompt_length=PROMPT_LEN,
                        response_length=RESPONSE_LEN)


def traj(prompt, response, versions=(3,), mask=None):
    return {"prompt_ids": list(prompt), "response_ids": list(response),
            "response_logprobs": [-0.5] * len(response), "loss_mask": mask or [1] * len(response),
            "weight_versions": list(versions)}


def rows():
    """Three prompts as verl's dataloader gives them: a normal group (rewards 1, 0), a rollout split in two
    segments by a context rewrite (rewards 1, 0), and a job whose sandbox dies on every attempt."""
    instances = [
        {"data_source": "fixed", "id": "normal", "rewards": [1.0, 0.0],
         "trajectory": traj(range(20, 30), range(100, 108))},
        {"data_source": "fixed", "id": "split", "rewards": [1.0, 0.0],
         "trajectories": [traj(range(20, 30), range(200, 206), versions=(3,)),
                          traj(range(40, 44), range(300, 305), versions=(3, 4), mask=[1, 1, 0, 1, 1])]},
        {"data_source": "fixed", "id": "dead", "fail_first": 1000, "trajectory": traj(range(20, 30), [7])},
    ]
    return {
        "raw_prompt": np.array([np.array([{"role": "user", "content": f"task {i['id']}"}], dtype=object)
                                for i in instances] + [None], dtype=object)[:-1],
        "data_source": np.array(["fixed"] * 3, dtype=object),
        "extra_info": np.array([{"index": k, "instance": i} for k, i in enumerate(instances)], dtype=object),
        "index": np.array([0, 1, 2], dtype=object),
        "uid": np.array([str(uuid.uuid4()) for _ in instances], dtype=object),
    }


def v1_batch(step: int = 3):
    """The batch ``PPOTrainer._next_train_batch`` submits (a TensorDict with ``global_steps``)."""
    batch = tu.get_tensordict(rows())
    tu.assign_non_tensor_data(batch, "global_steps", step)
    return batch


class KVStore(kv_store.KVStore):
    """Stands for TransferQueue's KV store (a Ray controller and storage actors): keeps what
    ``AgentLoopWorkerTQ`` writes through ``tq.async_kv_put`` / ``tq.async_kv_batch_put``, tags and rows, and
    answers the synchronous ``kv_list`` / ``kv_batch_get`` / ``kv_clear`` verl's replay buffer reads it with
    (one partition)."""

    async def kv_put(self, key, partition_id, fields=None, tag=None):
        self.tags[key] = {**self.tags.get(key, {}), **(tag or {})}

    async def kv_batch_put(self, keys, partition_id, fields=None, tags=None):
        for i, key in enumerate(keys):
            self.tags[key] = tags[i]
            self.rows[key] = fields[i]


@pytest.fixture
def tq_worker(v1_cfg, tokenizer, monkeypatch):
    """verl's ``AgentLoopWorkerTQ`` without Ray (``object.__new__``, as verl's own CPU tests build workers),
    its agent loop registry read from our YAML, TransferQueue's KV calls answered by a :class:`KVStore`."""
    cfg = v1_cfg
    w = object.__new__(TQWorker)
    w.config = cfg
    w.llm_client = w.teacher_client = w.reward_loop_worker_handles = None
    w.rollout_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    w.dataset_cls, w.tokenizer, w.processor, w.hf_model_type = RLHFDataset, tokenizer, None, "qwen2"
    w.mm_processor_kwargs, w.distillation_enabled, w.tools = {}, False, []
    w.background_tasks = set()
    for entry in OmegaConf.load(resolve_config_path(w.rollout_config.agent.agent_loop_config_path)):
        monkeypatch.setitem(verl_agent_loop._agent_loop_registry, entry.name, entry)
    store = KVStore()
    monkeypatch.setattr(agent_loop_tq.tq, "async_kv_put", store.kv_put)
    monkeypatch.setattr(agent_loop_tq.tq, "async_kv_batch_put", store.kv_batch_put)
    store.install(monkeypatch, agent_loop_tq.tq)
    w.store = store
    return w


def padded(values: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(values, batch_first=True, padding_value=0)


async def test_v1_worker_stores_every_segment_and_a_zero_loss_row_for_a_failed_job(
        tq_worker, start_llm_server, monkeypatch, fixed):
    url = await start_llm_server()
    monkeypatch.setenv("PRORL_SERVERS", url)
    batch = v1_batch()
    uids = list(batch["uid"])
    store = tq_worker.store
    # what PPOTrainer._submit_batch_to_rollout tags before the worker runs
    store.tags.update({u: {"is_prompt": True, "status": "pending", "global_steps": 3} for u in uids})
    await tq_worker.generate_sequences(batch)
    await asyncio.gather(*list(tq_worker.background_tasks))

    # no session raised: V1 marks every group finished (an exception would fail the whole group)
    assert [store.tags[u]["status"] for u in uids] == ["finished"] * 3
    normal, split, dead = uids
    keys = sorted(k for k in store.rows)
    assert keys == sorted([f"{normal}_{s}_0" for s in range(N)] + [f"{dead}_{s}_0" for s in range(N)]
                          + [f"{split}_{s}_{i}" for s in range(N) for i in range(2)])

    # the split rollout: both segments of every session, each with its own tokens and versions
    for s in range(N):
        first, second = store.rows[f"{split}_{s}_0"], store.rows[f"{split}_{s}_1"]
        assert first["prompts"].tolist() == list(range(20, 30))
        assert first["responses"].tolist() == list(range(200, 206))
        assert second["prompts"].tolist() == list(range(40, 44))
        assert second["responses"].tolist() == list(range(300, 305))
        assert second["response_mask"].tolist() == [1, 1, 0, 1, 1]
        assert store.tags[f"{split}_{s}_0"]["max_global_steps"] == 3
        assert (store.tags[f"{split}_{s}_1"]["min_global_steps"],
                store.tags[f"{split}_{s}_1"]["max_global_steps"]) == (3, 4)
        # each segment carries the episode's reward at its last response position
        assert first["rm_scores"][-1] == second["rm_scores"][-1]
    # the failed job: retried (max_sample_retries=2: 3 attempts a session), then a row with nothing to train
    assert fixed.jobs["dead"] == 3 * N
    for s in range(N):
        row = store.rows[f"{dead}_{s}_0"]
        assert row["response_mask"].sum() == 0 and row["rm_scores"].abs().sum() == 0
        assert row["responses"].numel() >= 1
        prorl = row["extra_fields"]["prorl"]
        assert prorl["filter"] is True and prorl["failure_kind"] == "sandbox" and len(prorl["attempts"]) == 3

    # verl's V1 GRPO advantage over everything stored: the failed rows get none, every split segment gets its
    # session's advantage on its generated tokens
    order = sorted(store.rows)
    data = DataProto.from_single_dict({
        "response_mask": padded([store.rows[k]["response_mask"] for k in order]),
        "token_level_rewards": padded([store.rows[k]["rm_scores"] for k in order]),
        "uid": np.array([k.split("_")[0] for k in order], dtype=object)})
    data = compute_advantage_for_multi_trajectories(data, batch_keys=order, adv_estimator=AdvantageEstimator.GRPO,
                                                    num_repeat=N)
    adv = dict(zip(order, data.batch["advantages"]))
    for s in range(N):
        assert adv[f"{dead}_{s}_0"].abs().sum() == 0
        a0, a1 = adv[f"{split}_{s}_0"], adv[f"{split}_{s}_1"]
        assert a0[0] != 0 and torch.allclose(a0[:6], a0[0].expand(6))
        assert torch.allclose(a1[:5], a0[0] * torch.tensor([1.0, 1, 0, 1, 1]))

    # the shipped V1 sampler evicts the group with the filtered rows and asks verl for one fresh prompt
    from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync
    from verl.utils.import_utils import load_extern_type

    from trainer_plugins.verl.replay_buffer import FILTERED_METRIC

    sampler = tq_worker.config.trainer.v1.sampler
    kwargs = dict(trainer_mode="colocate_async", trainer_config={}, max_off_policy_threshold=1,
                  max_off_policy_strategy="drop", sampler_kwargs={"filter_groups_enable": False})
    # (DAPO off here, so only the filtered rows decide; verl's own buffer would train all three groups)
    assert ReplayBufferAsync(**kwargs).get_sampleable_count(3, "train") == 3
    refills = []
    buffer = load_extern_type(sampler.custom_sampler.path, sampler.custom_sampler.name)(
        **kwargs, refill_fn=refills.append)
    meta, metrics = buffer.sample(global_steps=3, partition_id="train", batch_size=2)
    assert refills == [1] and metrics[f"training/{FILTERED_METRIC}"] == 1
    assert {k.split("_")[0] for k in meta.keys} == {normal, split} and dead not in store.tags


# ------------------------------------------------------------------------------ real tier: Ray + TransferQueue
@pytest.fixture(scope="module")
def transfer_queue():
    """A local Ray (logical CPUs: TransferQueue's controller and storage units are actors) and TransferQueue,
    as verl's V1 trainer starts them."""
    ray = pytest.importorskip("ray")
    import transfer_queue as tq

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    tq.init()
    yield tq
    tq.close()
    ray.shutdown()


@pytest.mark.real
async def test_v1_trainer_path_with_ray_transfer_queue_and_the_plugins_replay_buffer(
        transfer_queue, v1_cfg, start_llm_server, fixed):
    from trainer_plugins.verl.replay_buffer import FILTERED_METRIC
    from verl.utils.import_utils import load_extern_type

    tq = transfer_queue
    url = await start_llm_server()
    cfg = v1_cfg
    # the worker as verl's AgentLoopManagerTQ starts it: a Ray actor of AgentLoopWorkerTQ
    worker = agent_loop_tq.AgentLoopWorkerTQ.options(
        runtime_env={"env_vars": {"PRORL_SERVERS": url, "HF_HUB_OFFLINE": "1"}}).remote(cfg, None)
    batch = v1_batch(step=0)
    uids = list(batch["uid"])
    # submitted as PPOTrainer._submit_batch_to_rollout does: prompt tags first, then the worker
    tq.kv_batch_put(keys=uids, partition_id="train",
                    tags=[{"is_prompt": True, "status": "pending", "global_steps": 0} for _ in uids])
    await worker.generate_sequences.remote(batch)
    for _ in range(600):
        tags = (await tq.async_kv_list(partition_id="train"))["train"]
        if all(tags[u]["status"] in ("finished", "failure") for u in uids):
            break
        await asyncio.sleep(0.2)
    assert [tags[u]["status"] for u in uids] == ["finished"] * 3

    # verl's trainer builds the shipped custom sampler from the config, with the kwargs it gives any sampler
    sampler = cfg.trainer.v1.sampler
    cls = load_extern_type(sampler.custom_sampler.path, sampler.custom_sampler.name)
    refills = []
    buffer = cls(trainer_mode=cfg.trainer.v1.trainer_mode, trainer_config={},
                 max_off_policy_threshold=sampler.max_off_policy_threshold,
                 max_off_policy_strategy=sampler.max_off_policy_strategy, sampler_kwargs=sampler.sampler_kwargs,
                 refill_fn=refills.append, poll_interval=0.1)
    meta, metrics = buffer.sample(global_steps=0, partition_id="train", batch_size=2)
    normal, split, dead = uids
    assert refills == [1]  # the group with the filtered row was evicted and one fresh prompt asked for
    assert metrics[f"training/{FILTERED_METRIC}"] == 1
    assert sorted(meta.keys) == sorted([f"{normal}_{s}_0" for s in range(N)]
                                       + [f"{split}_{s}_{i}" for s in range(N) for i in range(2)])
    # the advantage exactly as PPOTrainer._compute_advantage computes it from TransferQueue
    data = tq.kv_batch_get(keys=meta.keys, partition_id="train", select_fields=["uid", "response_mask", "rm_scores"])
    data = DataProto(batch=data.to_padded_tensor())
    data.batch["token_level_rewards"] = data.batch["rm_scores"]
    data.non_tensor_batch["uid"] = np.array(data.batch.pop("uid").tolist(), dtype=object)
    data = compute_advantage_for_multi_trajectories(data, batch_keys=meta.keys,
                                                    adv_estimator=AdvantageEstimator.GRPO, num_repeat=N)
    adv = dict(zip(meta.keys, data.batch["advantages"]))
    for s in range(N):
        assert adv[f"{split}_{s}_0"][0] != 0 and adv[f"{split}_{s}_1"][0] == adv[f"{split}_{s}_0"][0]
    assert fixed.jobs["dead"] == 3 * N

