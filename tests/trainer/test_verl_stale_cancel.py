"""A prompt group that can no longer be trained has its running jobs cancelled (issue #32 part 2, verl side).

Found with verl 0.9.1's real trainer on CPU: verl never cancels agent-loop tasks and the plugin's
``request_timeout_s`` is null, so a group whose prompt step was past ``max_off_policy_threshold`` ran to
completion on the rollout servers (sandboxes, tools, LLM time) and was then evicted.

Real: the rollout server (the project's app on loopback) and its ``/cancel``, the plugin's agent loop as verl
instantiates it (``test_verl_plugin.make_loop``), the one rollout client, verl's ``ReplayBufferAsync`` under
``ProRLReplayBuffer`` built from the shipped config. Stand-ins, each saying what it stands for:
``test_verl_async.StepStore`` for TransferQueue and the agent loop workers that fill it; a recording canceller
for the Ray call that reaches verl's agent loop worker actors (:class:`trainer_plugins.verl.stale.RayStaleCanceller`,
checked with real Ray actors in the real tier); ``FixedTrajectoryHandler`` (``sleep``) for a slow agent.
"""
from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_h1_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


plugin = _load("test_verl_plugin")
asyncs = _load("test_verl_async")
cfg, worker = plugin.cfg, plugin.worker  # fixtures
N, B = asyncs.N, asyncs.B


def stale_group_rows(store, uid: str) -> None:
    """What the agent loops of a cancelled group store: every sample a zero-loss row marked stale."""
    store.finish(uid, version=1, extra={"filter": True, "stale": True, "failure_kind": "cancelled",
                                        "error": "cancelled by the trainer"})


def test_the_buffer_cancels_groups_past_the_bound_once_and_does_not_count_them_as_faults(compose_verl,
                                                                                        monkeypatch):
    store = asyncs.StepStore()
    buf, cfg_ = asyncs.shipped_buffer(compose_verl, monkeypatch, "prorl_dapo", store)
    assert cfg_.trainer.v1.sampler.max_off_policy_threshold == 2
    asked: list[set[str]] = []

    def canceller(uids):  # stands in for the Ray call into verl's agent loop workers: each cancels N rows
        asked.append(set(uids))
        return N * len(uids)

    buf.stale_canceller = canceller
    slow = set(store.submit(1, 1, status="running"))  # sampled at step 1: trainable at steps 1 and 2 only
    store.submit(B, 1)
    trained, m1 = asyncs.train_step(buf, store, 1)
    assert asked == [] and m1["training/prorl_async/rollouts_cancelled_stale_total"] == 0  # step 2 may train it
    later = set(store.submit(1, 2, status="running"))  # sampled at step 2: trainable at step 3, not cancelled
    store.submit(B, 2)
    trained, m2 = asyncs.train_step(buf, store, 2)
    assert asked == [slow], "a group no step can train any more kept running"
    assert m2["training/prorl_async/rollouts_cancelled_stale_total"] == N
    # the cancelled rows come back: verl evicts the group as stale; it is no fault and no wasted completion
    for uid in slow:
        stale_group_rows(store, uid)
    store.submit(B, 3)
    trained, m3 = asyncs.train_step(buf, store, 3)
    assert not trained & slow and m3["training/off_policy/evicted_samples"] == 1
    assert m3["training/prorl_async/rollouts_discarded_stale_total"] == 0
    assert m3["training/prorl_async/rollouts_completed_total"] == B * N + N  # the step's batch and the refill
    assert "training/prorl_filtered/evicted_samples" not in m3
    assert asked == [slow, later]  # each group once; `later` only now that step 4 cannot train it
    assert not buf.breaker.filtered_groups  # "cancelled" is the trainer's decision, never a fault


def _stale_row(row: dict, uid: str, session: int, step: int = 1) -> dict:
    return {**row, "uid": uid, "session_id": session, "global_steps": step}


async def test_cancelled_stale_rows_cancel_their_jobs_on_the_rollout_server(cfg, worker, tokenizer,
                                                                           start_llm_server, monkeypatch,
                                                                           job_state, fixed):
    from trainer_plugins.verl.stale import cancel_stale_groups

    url = await start_llm_server()
    monkeypatch.setenv("PRORL_SERVERS", url)
    loop = plugin.make_loop(cfg, tokenizer)
    jobs: dict[str, list[str]] = {}
    plugin.spy_on_submissions(monkeypatch, lambda server, body: jobs.setdefault(
        body["group_id"], []).append(body["job_id"]))
    slow = plugin.fixed_row([1, 2], [3], sleep=60)  # an agent that would hold its sandbox for a minute
    quick = plugin.fixed_row([1, 2], [3], sleep=0.5)
    rows = [asyncio.create_task(loop.run({}, **_stale_row(slow, "u-old", s))) for s in range(2)]
    fresh = asyncio.create_task(loop.run({}, **_stale_row(quick, "u-new", 0, step=2)))
    for _ in range(300):
        ids = jobs.get("verl-u-old", [])
        if len(ids) == 2 and all([(await job_state(url, j)).get("state") == "run" for j in ids]):
            break
        await asyncio.sleep(0.02)
    assert cancel_stale_groups(None, ["u-old"]) == 2  # what RayStaleCanceller runs in each worker
    outs = await asyncio.wait_for(asyncio.gather(*rows), 15)  # not the 60 s the jobs would have run
    for out in outs:
        assert len(out) == 1 and out[0].response_mask == [0] and out[0].reward_score == 0.0
        prorl = out[0].extra_fields["prorl"]
        assert prorl["stale"] is True and prorl["failure_kind"] == "cancelled" and prorl["filter"] is True
        assert not prorl.get("fatal")
    for job_id in jobs["verl-u-old"]:  # cancelled on the server (its sandbox and LLM call released), not re-run
        for _ in range(100):
            s = await job_state(url, job_id)
            if s.get("state") == "done":
                break
            await asyncio.sleep(0.02)
        assert s["state"] == "done" and s["result"]["critical_error"] == "cancelled"
    assert len(jobs["verl-u-old"]) == 2
    # a sample of the stale group that starts only now submits nothing
    late = await asyncio.wait_for(loop.run({}, **_stale_row(slow, "u-old", 2)), 5)
    assert late[0].extra_fields["prorl"]["stale"] is True and len(jobs["verl-u-old"]) == 2
    # other groups run on: a fresh group's row is trained as usual
    out = await asyncio.wait_for(fresh, 15)
    assert out[0].extra_fields["prorl"].get("stale") is None and out[0].response_mask == [1]
    # verl's own cancel of a row still raises (it is not a stale cancel)
    task = asyncio.create_task(loop.run({}, **_stale_row(slow, "u-other", 0, step=3)))
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


# ------------------------------------------------------------------------------ real tier: Ray + TransferQueue
@pytest.fixture(scope="module")
def transfer_queue():
    """A local Ray and TransferQueue, as verl's V1 trainer starts them."""
    ray = pytest.importorskip("ray")
    import transfer_queue as tq

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    tq.init()
    yield tq
    tq.close()
    ray.shutdown()


class TrainerStandIn:
    """Stands in for verl's ``PPOTrainer`` (which needs GPUs, or the CPU platform and minutes): what the replay
    buffer reaches through its ``refill_fn``, the trainer's ``agent_loop_manager.agent_loop_workers`` (here
    verl's real ``AgentLoopWorkerTQ`` Ray actor)."""

    def __init__(self, workers) -> None:
        self.agent_loop_manager = type("Manager", (), {"agent_loop_workers": workers})()
        self.refills: list[int] = []

    def _add_prompts_to_generate(self, num_prompts: int) -> int:
        self.refills.append(num_prompts)
        return num_prompts


@pytest.mark.real
async def test_the_buffer_cancels_a_stale_group_running_in_verls_ray_agent_loop_worker(
        transfer_queue, compose_verl, start_llm_server, fixed):
    import uuid

    import numpy as np
    from verl.trainer.ppo.v1 import agent_loop_tq
    from verl.utils import tensordict_utils as tu
    from verl.utils.import_utils import load_extern_type

    tq = transfer_queue
    url = await start_llm_server()
    cfg = compose_verl("prorl_dapo", "actor_rollout_ref.rollout.n=2", prompt_length=64, response_length=16)
    worker = agent_loop_tq.AgentLoopWorkerTQ.options(
        runtime_env={"env_vars": {"PRORL_SERVERS": url, "HF_HUB_OFFLINE": "1"}}).remote(cfg, None)
    instance = {"data_source": "fixed", "id": "slow", "sleep": 120,
                "trajectory": {"prompt_ids": list(range(20, 30)), "response_ids": [100, 101],
                               "response_logprobs": [-0.5, -0.5], "loss_mask": [1, 1], "weight_versions": [0]}}
    uid = str(uuid.uuid4())
    batch = tu.get_tensordict({
        "raw_prompt": np.array([np.array([{"role": "user", "content": "slow"}], dtype=object), None],
                               dtype=object)[:-1],
        "data_source": np.array(["fixed"], dtype=object),
        "extra_info": np.array([{"index": 0, "instance": instance}], dtype=object),
        "index": np.array([0], dtype=object), "uid": np.array([uid], dtype=object)})
    tu.assign_non_tensor_data(batch, "global_steps", 1)
    tq.kv_batch_put(keys=[uid], partition_id="train",
                    tags=[{"is_prompt": True, "status": "pending", "global_steps": 1}])
    await worker.generate_sequences.remote(batch)
    for _ in range(600):
        if fixed.jobs["slow"] == 2:
            break
        await asyncio.sleep(0.1)
    assert fixed.jobs["slow"] == 2

    sampler = cfg.trainer.v1.sampler
    trainer = TrainerStandIn([worker])
    buffer = load_extern_type(sampler.custom_sampler.path, sampler.custom_sampler.name)(
        trainer_mode=cfg.trainer.v1.trainer_mode, trainer_config={},
        max_off_policy_threshold=sampler.max_off_policy_threshold,
        max_off_policy_strategy=sampler.max_off_policy_strategy, sampler_kwargs=sampler.sampler_kwargs,
        refill_fn=trainer._add_prompts_to_generate, poll_interval=0.1)
    buffer._sync_metadata_from_transfer_queue()  # as every sample() starts
    assert await asyncio.to_thread(buffer.cancel_stale, 1, "train") == 0  # step 2 may still train it
    assert await asyncio.to_thread(buffer.cancel_stale, 2, "train") == 2  # step 3 may not: both rows cancelled
    for _ in range(300):  # the group finishes now, not after the 120 s its jobs would have run
        tags = (await tq.async_kv_list(partition_id="train"))["train"]
        if tags[uid]["status"] in ("finished", "failure"):
            break
        await asyncio.sleep(0.1)
    assert tags[uid]["status"] == "finished"
    rows = tq.kv_batch_get(keys=[f"{uid}_{s}_0" for s in range(2)], partition_id="train",
                           select_fields=["extra_fields"])["extra_fields"]
    for fields in rows:
        prorl = getattr(fields, "data", fields)["prorl"]
        assert prorl["stale"] is True and prorl["failure_kind"] == "cancelled"
    assert fixed.jobs["slow"] == 2  # cancelled, not re-submitted
