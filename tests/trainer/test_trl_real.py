"""The TRL plugin with real components: a vLLM CPU server with the weight-loader worker extension, rollout
servers in their own processes (``python -m prorl_server``, the ``shout`` handler), and TRL's GRPOTrainer.

The vLLM server is this module's own (module scope): it gets new weights, so it is not the session's shared
server, whose logprobs other tests compare with the original model. Served logprobs of a fixed token sequence
(vLLM ``prompt_logprobs``) are compared with a transformers forward pass of the weights that were pushed.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest

from trainer_plugins.trl.weights import save_weights

pytestmark = pytest.mark.real

ROOT = Path(__file__).resolve().parents[2]
IDS = list(range(100, 140))


@pytest.fixture(scope="module")
def ext_vllm(vllm_ext_server):
    """The session's vLLM CPU server with the worker extension (tests/conftest.py): tests that need the base
    weights push them first (:func:`push_original`), and the other users of the server restore them."""
    return vllm_ext_server


class RolloutServerProcess:
    """``python -m prorl_server`` in its own process group with ``backend`` registered; ``kill()`` is SIGKILL
    (a crashed node), ``stop()`` a clean stop."""

    def __init__(self, backend: str, *extra_args: str) -> None:
        ready = Path(tempfile.mkdtemp(prefix="trl-real-")) / "ready.json"
        self.log = ROOT / ".cache" / "logs" / f"rollout-trl-{os.getpid()}-{time.monotonic_ns()}.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "prorl_server", "--port", "0", "--ready-file",
                                          str(ready), "--backend", backend, "--log-level", "WARNING", *extra_args], cwd=ROOT,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        for _ in range(1200):
            if ready.exists() or self.proc.poll() is not None:
                break
            time.sleep(0.1)
        if not ready.exists():
            self.stop()
            raise RuntimeError(f"rollout server did not start: {self.log.read_text()[-2000:]}")
        self.url = json.loads(ready.read_text())["url"]

    def status(self) -> dict:
        with urllib.request.urlopen(f"{self.url}/status", timeout=10) as r:
            return json.loads(r.read())

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def rollout_server(ext_vllm):
    servers = []

    def start(*extra_args):
        servers.append(RolloutServerProcess(ext_vllm.address, *extra_args))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def post(url, body=None, timeout=120):
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def served_logprobs(server, model_dir):
    """vLLM's logprob of each token of IDS given the ones before it (``prompt_logprobs``)."""
    import torch

    out = post(f"{server.address}/v1/completions", {"model": str(model_dir), "prompt": IDS, "max_tokens": 1,
                                                   "prompt_logprobs": 0, "temperature": 0})
    rows = out["choices"][0]["prompt_logprobs"][1:]
    return torch.tensor([rows[k][str(IDS[k + 1])]["logprob"] for k in range(len(IDS) - 1)])


def hf_logprobs(model):
    import torch

    was = model.training
    model.eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([IDS])).logits[0].float(), -1)
    model.train(was)
    return torch.stack([lp[k, IDS[k + 1]] for k in range(len(IDS) - 1)])


async def _load(backend, path, sha="", reset_cache=False):
    from trainer_plugins.trl.weights import load_into_backend, reset_prefix_cache

    async with aiohttp.ClientSession() as s:
        await load_into_backend(s, backend, str(path), sha)
        if reset_cache:
            await reset_prefix_cache(s, backend)


def push_original(ext_vllm, tiny_model_dir):
    """Put the tiny model's own weights back (each test starts from them), and drop the prefix cache: the
    server is the session's (tests/conftest.py), and KV another test's weights computed for a shared prefix (the
    shout system prompt) would otherwise be reused under these weights."""
    asyncio.run(_load(ext_vllm.address, Path(tiny_model_dir) / "model.safetensors", reset_cache=True))


# ------------------------------------------------------------------ the worker extension
def test_pushed_weights_are_served_as_a_transformers_forward_pass_computes_them(ext_vllm, tiny_model_dir,
                                                                                  tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    push_original(ext_vllm, tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    before = served_logprobs(ext_vllm, tiny_model_dir)
    assert (before - hf_logprobs(model)).abs().max() < 1e-4
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # every tensor changes: embeddings, every projection, norms, LM head
            p.add_(torch.randn_like(p) * 0.05)
    expected = hf_logprobs(model)
    assert (expected - before).abs().max() > 0.1  # the change is visible in the logprobs

    path = tmp_path / "step-1.safetensors"
    asyncio.run(_load(ext_vllm.address, path, save_weights(model, path)))
    after = served_logprobs(ext_vllm, tiny_model_dir)
    assert (after - expected).abs().max() < 1e-4, (after - expected).abs().max()


def test_a_torn_or_foreign_weights_file_is_refused_and_the_served_weights_stay(ext_vllm, tiny_model_dir, tmp_path):
    import torch
    from safetensors.torch import save_file

    before = served_logprobs(ext_vllm, tiny_model_dir)
    good = tmp_path / "w.safetensors"
    save_file({"model.norm.weight": torch.zeros(128)}, str(good))
    from trainer_plugins.vllm_weights import weights_digest

    other = tmp_path / "other.safetensors"  # the same tensor names and shapes, another push
    save_weights(torch.nn.Linear(2, 2), other)
    save_file({"model.norm.weight": torch.ones(128)}, str(other))
    with pytest.raises(RuntimeError, match="digest"):  # another file's digest: refused before loading
        asyncio.run(_load(ext_vllm.address, good, weights_digest(other)))
    with pytest.raises(RuntimeError, match="digest"):  # a full SHA-256 of another file: the same
        asyncio.run(_load(ext_vllm.address, good, "0" * 64))
    with pytest.raises(RuntimeError, match="does not exist"):
        asyncio.run(_load(ext_vllm.address, tmp_path / "missing.safetensors"))
    foreign = tmp_path / "gpt2.safetensors"  # another model's names: refused whole, nothing loaded
    save_file({"model.norm.weight": torch.zeros(128), "transformer.h.0.attn.c_attn.weight": torch.zeros(4, 4)},
              str(foreign))
    with pytest.raises(RuntimeError, match="transformer.h.0.attn.c_attn.weight"):
        asyncio.run(_load(ext_vllm.address, foreign))
    after = served_logprobs(ext_vllm, tiny_model_dir)
    assert (after - before).abs().max() < 1e-6
    # vLLM still generates after the refused loads (it was resumed each time)
    out = post(f"{ext_vllm.address}/v1/completions", {"model": str(tiny_model_dir), "prompt": IDS[:5],
                                                     "max_tokens": 2})
    assert len(out["choices"][0]["text"]) >= 0 and out["usage"]["completion_tokens"] == 2


# ------------------------------------------------------------------ three GRPO steps through the service
def test_three_trl_steps_change_the_served_weights_and_every_turn_carries_its_version(
        ext_vllm, tiny_model_dir, rollout_server, tmp_path):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from handlers.shout import load_dataset
    from trainer_plugins.trl import ProRLRollout, WeightPushCallback

    push_original(ext_vllm, tiny_model_dir)
    server = rollout_server()
    before = served_logprobs(ext_vllm, tiny_model_dir)
    instances = load_dataset(limit=4)
    rollout = ProRLRollout([server.url], instances, max_tokens=6, measure_ratio=True, request_timeout_s=300)
    push = WeightPushCallback(rollout, [ext_vllm.address], weights_dir=tmp_path / "weights")
    seen_versions = []

    def reward(prompts, completions, prorl_reward, prorl_weight_versions, **kw):
        seen_versions.append(list(prorl_weight_versions))  # what the reward function receives per row
        return prorl_reward

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    config = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4,
                        max_completion_length=6, learning_rate=1e-2, lr_scheduler_type="constant", max_steps=3,
                        beta=0.0, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
                        disable_tqdm=True, bf16=False)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config,
                          train_dataset=Dataset.from_list(ProRLRollout.dataset_rows(instances)),
                          processing_class=AutoTokenizer.from_pretrained(tiny_model_dir), rollout_func=rollout,
                          callbacks=[push])
    try:
        trainer.train()
    finally:
        rollout.close()

    # each batch was generated by the weights of the step before it, and its rows say so
    assert [h.versions for h in rollout.history] == [[0], [1], [2]]
    assert [sorted({v for vs in rows for v in vs}) for rows in seen_versions] == [[0], [1], [2]]
    assert all(len(rows) == 8 and all(vs for vs in rows) for rows in seen_versions)
    # the rollout server's backend is registered with the version of the weights it serves now
    assert {b["address"]: b["weight_version"] for b in server.status()["backends"]} == {ext_vllm.address: 3}
    assert [r.version for r in push.reports] == [1, 2, 3] and all(not r.failed for r in push.reports)
    # the first batch's importance ratio is 1: vLLM served what the trainer computes
    # (fp32 on both sides: bf16=False, as vLLM runs --dtype float32; TRL's default bf16 autocast alone makes
    # it ~1e-3 on this model; measured 1.5e-7 in fp32)
    assert rollout.history[0].ratio_dev < 1e-5
    # vLLM serves the trained weights: different from the start, and what a transformers forward pass of the
    # trainer's parameters computes (a fresh model: the trainer's own instance is left as TRL configured it)
    after = served_logprobs(ext_vllm, tiny_model_dir)
    assert (after - before).abs().max() > 1e-3
    trained = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    trained.load_state_dict(trainer.model.state_dict())
    assert (after - hf_logprobs(trained)).abs().max() < 1e-4
    # every row is a two-turn episode: model tokens, the environment's message (mask 0), model tokens
    assert rollout.history[0].tokens_generated == 8 * 2 * 6


# ------------------------------------------------------------------ rollouts in flight across the swaps
def test_with_prefetch_swaps_hold_requests_in_flight_lose_no_token_and_split_versions_cleanly(
        ext_vllm, tiny_model_dir, rollout_server, tmp_path):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from handlers.shout import load_dataset
    from trainer_plugins.trl import ProRLRollout, WeightPushCallback

    push_original(ext_vllm, tiny_model_dir)
    # One run worker (rows run one after another) and 3 turns of exactly 16 tokens: generating a batch takes
    # about as long as a training step here, so the next batch is generating when the step's swap comes (the
    # benchmark's recipe, benchmarks/learning_curve.py).
    server = rollout_server("--run-workers", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the trainer's share of the 2 cores; vLLM's OpenMP threads spin on the other
    instances = [{**inst, "turns": 3} for inst in load_dataset(limit=4)]
    rollout = ProRLRollout([server.url], instances, max_tokens=16, sampling_params={"min_tokens": 16},
                           request_timeout_s=300, prefetch=True)
    push = WeightPushCallback(rollout, [ext_vllm.address], weights_dir=tmp_path / "weights")
    rows = []

    def reward(prompts, completions, prorl_reward, prorl_token_versions, **kw):
        rows.append(prorl_token_versions)  # what the trainer sees per row
        return prorl_reward

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    config = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4,
                        max_completion_length=16, learning_rate=1e-2, lr_scheduler_type="constant", max_steps=4,
                        beta=0.0, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
                        disable_tqdm=True, vllm_importance_sampling_mode="token_truncate")
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config,
                          train_dataset=Dataset.from_list(ProRLRollout.dataset_rows(instances * 4)),
                          processing_class=AutoTokenizer.from_pretrained(tiny_model_dir), rollout_func=rollout,
                          callbacks=[push])
    try:
        trainer.train()
    finally:
        rollout.close()
        torch.set_num_threads(threads)
    assert [r.mode for r in push.reports] == ["swap"] * 4 and all(not r.failed for r in push.reports)
    # swaps came with the next batch generating (how many depends on the machine's timing, at least one),
    # and the server threw no generated token away at any of them
    in_flight = any(r.jobs_in_flight for r in push.reports)  # timing: a batch may generate faster than a step
    assert [r.tokens_discarded for r in push.reports] == [0] * 4
    # every row's tokens: an old-version prefix, then the new version, never back, never unknown
    for step_rows in rows:
        for versions in step_rows:
            generated = [v for v in versions if v is not None]
            assert generated == sorted(generated) and len(generated) == 3 * 16, versions
    for h in rollout.history[1:]:  # one step off-policy at most
        assert set(h.token_versions) <= {h.weight_version - 1, h.weight_version}, h.token_versions
    assert rollout.history[0].token_versions == {0: 8 * 3 * 16}
    # TRL's importance-sampling correction ran on the server's logprobs
    logged = {}
    for entry in trainer.state.log_history:
        logged.update(entry)
    assert "sampling/importance_sampling_ratio/mean" in logged
    if not in_flight:  # every check above passed; only the in-flight part was not exercised
        pytest.skip("no swap found rollouts in flight on this machine's timing (the swap with work in flight is "
                    "tested deterministically in tests/llm/test_weight_swap_vllm.py)")


# ------------------------------------------------------------------ a rollout server killed mid-step
def test_a_rollout_server_killed_mid_step_gives_its_jobs_back_failed_and_they_run_elsewhere(
        ext_vllm, tiny_model_dir, rollout_server, tokenizer):
    from handlers.shout import load_dataset
    from trainer_plugins.trl import ProRLRollout

    push_original(ext_vllm, tiny_model_dir)
    a, b = rollout_server(), rollout_server()
    instances = load_dataset(limit=2)
    rollout = ProRLRollout([a.url, b.url], instances, max_tokens=4, max_sample_retries=1, request_timeout_s=300)
    trainer = SimpleNamespace(num_generations=2, temperature=1.0, state=SimpleNamespace(global_step=0),
                              args=SimpleNamespace(temperature=1.0, top_p=1.0, top_k=None, max_completion_length=4),
                              processing_class=tokenizer)  # stand-in for GRPOTrainer's attributes
    prompts = [instances[0]["prompt"]] * 2 + [instances[1]["prompt"]] * 2
    # vLLM holds every request (pause mode "keep") so both servers are mid-job when one is killed
    post(f"{ext_vllm.address}/pause?mode=keep")
    result = {}
    thread = threading.Thread(target=lambda: result.update(out=rollout(prompts, trainer)), daemon=True)
    try:
        thread.start()
        for _ in range(600):
            if a.status()["jobs_in_flight"] == 2 and b.status()["jobs_in_flight"] == 2:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the jobs did not reach both servers")
        a.kill()
    finally:
        post(f"{ext_vllm.address}/resume")
    thread.join(timeout=240)
    rollout.close()
    assert not thread.is_alive(), "the step hung"
    out = result["out"]
    assert out["prorl_filtered"] == [False] * 4
    stats = rollout.history[-1]
    assert stats.retries == 2 and stats.failure_kinds == {"rollout_server": 2}
    # Every row is a whole shout episode: two generated turns with the feedback between, each of max_tokens=4
    # tokens unless the policy sampled EOS sooner (the tiny model at temperature 1 can: the real tier failed
    # once on a `sum(mask) == 8` check after other tests had trained the shared vLLM's weights and put them back)
    stops = set(tokenizer.all_special_ids)  # EOS or the chat template's end-of-turn token
    for ids, m in zip(out["completion_ids"], out["env_mask"]):
        runs, at = [], 0
        while at < len(m):
            if m[at]:
                end = at
                while end < len(m) and m[end]:
                    end += 1
                runs.append(ids[at:end])
                at = end
            else:
                at += 1
        assert len(runs) == 2 and 0 in m, (ids, m)
        assert all(len(r) == 4 or (1 <= len(r) < 4 and r[-1] in stops) for r in runs), (ids, m)
