"""The TRL plugin's asynchronous pieces against real rollout servers (the project's app on loopback) serving
the ``fixed`` test-double handler (tests/trainer/conftest.py: it returns the exact trajectory its instance
gives, after sleeping ``sleep`` seconds), and, where named, TRL's real ``GRPOTrainer`` on CPU with the tiny
model:

- ``prefetch=True``: the next step's jobs run while the trainer trains on this one;
- per-token weight versions from the trajectories' ``version_runs``;
- TRL's importance-sampling correction fed with the server's logprobs;
- a run resumed from a checkpoint pushes the checkpoint's weights before labelling the backends with its step.

``fake_vllm`` (a stand-in for a vLLM server's development endpoints, in a thread of its own) records the paths
it served and loads nothing; a real vLLM is in tests/trainer/test_trl_real.py.
"""
from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

import aiohttp
import pytest

from trainer_plugins.trl import ProRLRollout, per_token_versions

EOS = 7


def make_trainer(num_generations: int, step: int = 0):
    """Stand-in for ``trl.GRPOTrainer``: only what the rollout function reads."""
    return SimpleNamespace(num_generations=num_generations, temperature=1.0, state=SimpleNamespace(global_step=step),
                           args=SimpleNamespace(temperature=1.0, top_p=1.0, top_k=None, max_completion_length=12),
                           processing_class=SimpleNamespace(eos_token_id=EOS, pad_token_id=0))


def traj(version=0, logprob=-0.5):
    return {"prompt_ids": [1, 2, 3], "response_ids": [10, 11, 20, 21, 12, 13],
            "response_logprobs": [logprob, logprob, 0.0, 0.0, logprob, logprob], "loss_mask": [1, 1, 0, 0, 1, 1],
            "weight_versions": [version], "num_turns": 2}


def fixed_instance(name, sleep=0.0, **kw):
    return {"data_source": "fixed", "id": name, "prompt": f"say {name}", "rewards": [0.0, 1.0], "sleep": sleep,
            "trajectory": traj(**kw)}


async def call(rollout, prompts, trainer):
    return await asyncio.to_thread(rollout, prompts, trainer)


# ------------------------------------------------------------------ prefetch
async def test_with_prefetch_the_next_steps_jobs_run_while_the_trainer_trains(start_llm_server, fixed):
    url = await start_llm_server()
    instances = [fixed_instance("a", sleep=0.5), fixed_instance("b", sleep=0.5), fixed_instance("c", sleep=0.5)]
    rollout = ProRLRollout([url], instances, max_sample_retries=0, prefetch=True)
    try:
        first = await call(rollout, ["say a"] * 2, make_trainer(2, step=0))
        # the first call returns its own prompts and leaves one batch running (the pipeline's fill)
        assert first["prorl_prompt"] == ["say a"] * 2 and rollout.history[-1].prompt_lag == 0
        assert rollout.jobs_in_flight() == 2
        second = await call(rollout, ["say b"] * 2, make_trainer(2, step=1))
        assert second["prorl_prompt"] == ["say a"] * 2 and rollout.history[-1].prompt_lag == 1
        assert rollout.jobs_in_flight() == 2  # "say b" runs while step 1 trains
        third = await call(rollout, ["say c"] * 2, make_trainer(2, step=2))
        assert third["prorl_prompt"] == ["say b"] * 2
    finally:
        rollout.close()
    assert rollout.jobs_in_flight() == 0  # close cancelled the "say c" batch
    assert fixed.jobs["a"] == 4 and fixed.jobs["b"] == 2
    # a call does not wait for a whole fresh batch: its rows were running during the previous step
    assert all(len(o["completion_ids"]) == 2 for o in (first, second, third))


async def test_prefetch_2_keeps_two_steps_of_jobs_at_the_servers(start_llm_server, fixed):
    url = await start_llm_server()
    instances = [fixed_instance(n, sleep=0.3) for n in "abcd"]
    rollout = ProRLRollout([url], instances, max_sample_retries=0, prefetch=2)
    got, lags, in_flight = [], [], []
    try:
        for step, name in enumerate("abcd"):
            out = await call(rollout, [f"say {name}"] * 2, make_trainer(2, step=step))
            got.append(out["prorl_prompt"][0])
            lags.append(rollout.history[-1].prompt_lag)
            in_flight.append(rollout.jobs_in_flight())
    finally:
        rollout.close()
    # the pipeline fills with the first prompts (3 times), then each call returns the batch of 2 calls before
    assert got == ["say a", "say a", "say a", "say b"] and lags == [0, 1, 2, 2]
    # the batch a call submits is at the servers while the trainer trains (and the one before it, unless it
    # finished already)
    assert all(2 <= k <= 4 for k in in_flight), in_flight
    assert rollout.jobs_in_flight() == 0


async def test_without_prefetch_each_call_returns_its_own_prompts_and_leaves_nothing_running(start_llm_server):
    url = await start_llm_server()
    rollout = ProRLRollout([url], [fixed_instance("a"), fixed_instance("b")], max_sample_retries=0)
    try:
        out = await call(rollout, ["say b"] * 2, make_trainer(2))
    finally:
        rollout.close()
    assert out["prorl_prompt"] == ["say b"] * 2 and rollout.jobs_in_flight() == 0


# ------------------------------------------------------------------ per-token versions
def test_version_runs_give_each_generated_token_its_version():
    seg = SimpleNamespace(version_runs=[[3, 3], [4, 2]])
    mask = [1, 1, 0, 0, 1, 1, 1]
    assert per_token_versions(seg, mask, [3, 4]) == [3, 3, None, None, 3, 4, 4]
    # an unknown split stays unknown, never the trainer's version
    assert per_token_versions(SimpleNamespace(version_runs=[[None, 5]]), [1] * 5, [3, 4]) == [None] * 5
    # an older server's trajectory: its one version, or None when the turns had several
    assert per_token_versions(SimpleNamespace(), [1, 0, 1], [2]) == [2, None, 2]
    assert per_token_versions(SimpleNamespace(), [1, 0, 1], [2, 3]) == [None, None, None]
    with pytest.raises(ValueError, match="covers 4 tokens"):
        per_token_versions(SimpleNamespace(version_runs=[[1, 4]]), [1, 1, 1], [1])


async def test_rows_carry_per_token_versions_from_the_servers_trajectories(start_llm_server):
    from prorl_server.types import Trajectory

    if "version_runs" not in Trajectory.model_fields:
        pytest.skip("this rollout server's Trajectory has no version_runs yet")
    url = await start_llm_server()
    inst = fixed_instance("a")
    inst["trajectory"].update(weight_versions=[3, 4], version_runs=[[3, 3], [4, 1]], mixed_version_turns=1)
    rollout = ProRLRollout([url], [inst], max_sample_retries=0)
    try:
        out = await call(rollout, ["say a"], make_trainer(1))
    finally:
        rollout.close()
    assert out["prorl_token_versions"] == [[3, 3, None, None, 3, 4]]
    assert out["prorl_mixed_version_turns"] == [1]
    assert rollout.history[-1].token_versions == {3: 3, 4: 1} and rollout.history[-1].mixed_version_turns == 1


# ------------------------------------------------------------------ importance sampling with TRL
def _train_one_step(url, tiny_model_dir, tmp_path, **config):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from trainer_plugins.trl import server_reward

    instances = [fixed_instance("a")]
    rollout = ProRLRollout([url], instances, max_sample_retries=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, num_generations=2,
                      max_completion_length=6, learning_rate=1e-3, max_steps=1, beta=0.0, logging_steps=1,
                      report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, **config)
    trainer = GRPOTrainer(model=model, reward_funcs=server_reward, args=args,
                          train_dataset=Dataset.from_list(ProRLRollout.dataset_rows(instances)),
                          processing_class=AutoTokenizer.from_pretrained(tiny_model_dir), rollout_func=rollout)
    try:
        trainer.train()
    finally:
        rollout.close()
    logged = {}
    for entry in trainer.state.log_history:
        logged.update(entry)
    return logged


async def test_trl_corrects_with_the_servers_logprobs_when_they_differ_from_the_trainers(
        start_llm_server, tiny_model_dir, tmp_path):
    pytest.importorskip("trl")
    url = await start_llm_server()
    # the server says it sampled each token with logprob -0.5; the random tiny model gives them about -8.3
    logged = await asyncio.to_thread(_train_one_step, url, tiny_model_dir, tmp_path,
                                     vllm_importance_sampling_mode="token_truncate",
                                     vllm_importance_sampling_clip_max=2.0)
    assert logged["sampling/sampling_logp_difference/mean"] > 5.0
    # the ratio exp(trainer - sampling) is ~exp(-7.8): the loss of those tokens is scaled down, not trusted
    assert logged["sampling/importance_sampling_ratio/max"] < 1e-2
    off = await asyncio.to_thread(_train_one_step, url, tiny_model_dir, tmp_path / "off",
                                  vllm_importance_sampling_correction=False)
    assert "sampling/importance_sampling_ratio/mean" not in off  # the user's setting is respected


# ------------------------------------------------------------------ resume from a checkpoint
class _ThreadedApp:
    """An aiohttp app served on its own event loop thread (the callback blocks the calling thread)."""

    def __init__(self, app):
        from aiohttp import web

        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app)
        ready = threading.Event()

        def run():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.runner.setup())
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            self.loop.run_until_complete(site.start())
            self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        ready.wait(30)

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _fake_vllm_app(calls: list):
    """Stand-in for a vLLM server's development endpoints: records ``(path, body)``; every load succeeds."""
    from aiohttp import web

    async def handle(request):
        body = await request.json() if request.can_read_body else None
        calls.append((request.path, body))
        if request.path == "/collective_rpc":
            return web.json_response({"results": [{"ok": True, "loaded": 1}]})
        if request.path == "/reset_prefix_cache":
            return web.json_response({"success": True})
        if request.path == "/v1/models":
            return web.json_response({"data": [{"id": "m", "max_model_len": 1024}]})
        return web.json_response({})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


def test_a_resumed_run_pushes_the_checkpoint_weights_before_labelling_them_with_its_step(tiny_model_dir,
                                                                                        tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from prorl_server.app import create_app
    from prorl_server.config import ServerSettings
    from trainer_plugins.trl import WeightPushCallback

    calls: list = []
    vllm = _ThreadedApp(_fake_vllm_app(calls))
    server = _ThreadedApp(create_app(ServerSettings(backends=[vllm.url], health_interval_s=3600)))
    rollout = ProRLRollout([server.url], [fixed_instance("a")])
    try:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        with torch.no_grad():
            model.model.norm.weight.add_(1.0)  # "the checkpoint's weights": not what vLLM was started with
        cb = WeightPushCallback(rollout, [vllm.url], weights_dir=tmp_path / "w")
        state = SimpleNamespace(global_step=5, is_world_process_zero=True)
        cb.on_train_begin(SimpleNamespace(output_dir=str(tmp_path)), state, None, model=model)

        async def backends():
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{server.url}/status") as r:
                    return {b["address"]: b["weight_version"] for b in (await r.json())["backends"]}

        versions = asyncio.run(backends())
    finally:
        rollout.close()
        server.close()
        vllm.close()
    loads = [body for path, body in calls if path == "/collective_rpc" and body["method"] == "prorl_load_weights"]
    assert len(loads) == 1, calls
    saved = load_file(loads[0]["args"][0])
    assert torch.equal(saved["model.norm.weight"], model.model.norm.weight.detach())
    assert versions == {vllm.url: 5} and rollout.weight_version == 5
    assert [(r.version, r.mode) for r in cb.reports] == [(5, "swap")]  # the server's swap, not a re-registration
    paths = [path for path, _ in calls]
    load_at = next(i for i, (path, body) in enumerate(calls)
                   if path == "/collective_rpc" and body["method"] == "prorl_load_weights")
    assert paths.index("/pause") < load_at < paths.index("/resume")  # loaded while the server held the backend
