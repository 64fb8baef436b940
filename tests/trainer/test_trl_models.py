"""The weight push on real model families (trainer_plugins/trl/weights.py, trainer_plugins/vllm_weights.py):
tied embeddings, fused MoE experts, FSDP-sharded models, the rank-0 guard.

Models are tiny random ones built here from transformers' own classes (nothing is downloaded): the project's
tiny Qwen2 (``prorl_server/dev/tiny_model.py``) with ``tie_word_embeddings=True`` (what Qwen2.5 <= 3B, Qwen3 <= 4B
and Llama-3.2 ship), and tiny Qwen3-MoE / Mixtral configs (transformers 5 fuses their experts into
``mlp.experts.gate_up_proj`` / ``down_proj``; checkpoints and vLLM name them per expert).

The FSDP test runs two real processes on CPU joined by torch.distributed (gloo) with the model sharded by
FSDP2's ``fully_shard``. TRL/accelerate do not run FSDP on CPU, so the callback's ``push`` is called as
``on_step_end`` calls it, with a stand-in for the rollout (``RecordingRollout``: it stands for
``ProRLRollout``'s event loop and HTTP calls, which the other tests cover; here only who pushes matters).

The real tier (``-m real``) starts a vLLM CPU server on the tied model with the weight-loader extension and
checks that what the trainer pushes is what vLLM serves.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXTENSION = "trainer_plugins.vllm_weights.WeightLoaderExtension"


def _keys(path: Path) -> set:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return set(f.keys())


@pytest.fixture(scope="module")
def tied_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny Qwen2 model with tied input/output embeddings, saved with ``save_pretrained`` (its checkpoint
    has ``model.embed_tokens.weight`` and no ``lm_head.weight``), tokenizer files beside it."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tmp_path_factory.mktemp("tied-model")
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.tie_word_embeddings = True
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(out)
    for f in Path(tiny_model_dir).iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "generation_config.json"):
            shutil.copy(f, out / f.name)
    return out


# ------------------------------------------------------------------ tied embeddings
def test_a_tied_model_is_saved_under_the_names_of_its_checkpoint(tied_model_dir, tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from trainer_plugins.trl.weights import save_weights

    model = AutoModelForCausalLM.from_pretrained(tied_model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1.0)  # the tied LM head moves with it
    path = tmp_path / "step-1.safetensors"
    save_weights(model, path)
    # the names vLLM's checkpoint check knows: embed_tokens, not lm_head (safetensors' save_model kept lm_head)
    assert _keys(path) == _keys(tied_model_dir / "model.safetensors")
    assert "lm_head.weight" not in _keys(path)
    saved = load_file(str(path))
    assert torch.equal(saved["model.embed_tokens.weight"], model.lm_head.weight.detach())


# ------------------------------------------------------------------ fused MoE experts
def _tiny_moe(kind: str):
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, num_experts_per_tok=2)
    torch.manual_seed(0)
    if kind == "qwen3_moe":
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(moe_intermediate_size=16, num_experts=4, **common))
    return MixtralForCausalLM(MixtralConfig(num_local_experts=4, **common))


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_fused_moe_experts_are_saved_per_expert_as_the_checkpoint_names_them(kind, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from trainer_plugins.trl.weights import save_weights

    model = _tiny_moe(kind)
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in model.state_dict())  # fused in memory
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    path = tmp_path / "step-1.safetensors"
    save_weights(model, path)
    names = _keys(path)
    assert names == _keys(ckpt / "model.safetensors")
    assert not any("gate_up_proj" in n for n in names)
    # the values are the model's: transformers' own loader reads the file back into an equal model
    import shutil

    shutil.copy(path, ckpt / "model.safetensors")
    back = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_per_expert_names_are_the_ones_vllms_moe_loader_maps(tmp_path):
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    from trainer_plugins.trl.weights import save_weights

    path = tmp_path / "moe.safetensors"
    save_weights(_tiny_moe("qwen3_moe"), path)
    # the mapping vLLM's Qwen3-MoE loader builds (vllm/model_executor/models/qwen3_moe.py)
    mapping = RoutedExperts.build_expert_params_mapping("gate_proj", "down_proj", "up_proj", num_experts=4)
    experts = [n for n in _keys(path) if ".experts." in n]
    assert len(experts) == 2 * 4 * 3
    for name in experts:
        assert any(weight_name in name for _param, weight_name, _e, _shard in mapping), name


# ------------------------------------------------------------------ FSDP and the rank-0 guard
FSDP_SCRIPT = textwrap.dedent('''
    """Two gloo processes: the tiny model sharded by FSDP2, WeightPushCallback.push as on_step_end calls it."""
    import json, os, sys
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    MODEL, OUT, PORT, FAIL = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "fail"


    class RecordingRollout:
        """Stands for ProRLRollout: its event loop (run_async) and version; records who pushed."""
        urls, headers, weight_version = ["http://rollout"], {}, 0

        def __init__(self):
            self.pushed = []

        def jobs_in_flight(self):
            return 0

        def run_async(self, coro):
            coro.close()
            self.pushed.append(dist.get_rank())
            if FAIL:
                from trainer_plugins.trl.weights import WeightPushError
                raise WeightPushError("injected: backend b refused", {"http://b": "refused"}, [], 1)
            from trainer_plugins.trl.weights import PushReport
            return PushReport(version=1, path="", pushed=["http://b"])


    def run(rank):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=PORT)
        dist.init_process_group("gloo", rank=rank, world_size=2)
        from transformers import AutoModelForCausalLM
        from torch.distributed.fsdp import fully_shard
        from trainer_plugins.trl.weights import WeightPushCallback, WeightPushError

        model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
        reference = {k: v.clone() for k, v in model.state_dict().items()}
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        sharded = all(type(p).__name__ == "DTensor" for p in model.parameters())
        rollout = RecordingRollout()
        cb = WeightPushCallback(rollout, ["http://b"], weights_dir=os.path.join(OUT, f"rank{rank}"),
                                protocol="swap")
        error = None
        try:
            report = cb.push(model, 1, None, main=rank == 0)
        except WeightPushError as e:
            report, error = None, str(e)
        files = sorted(os.listdir(os.path.join(OUT, f"rank{rank}"))) if os.path.isdir(
            os.path.join(OUT, f"rank{rank}")) else []
        same = None
        if rank == 0 and files:
            from safetensors.torch import load_file
            saved = load_file(os.path.join(OUT, "rank0", files[0]))
            same = sorted(saved) == sorted(reference) and all(torch.equal(saved[k], reference[k]) for k in saved)
        with open(os.path.join(OUT, f"result{rank}.json"), "w") as f:
            json.dump({"sharded": sharded, "pushed_by": rollout.pushed, "files": files, "same": same,
                       "report": report is not None, "error": error}, f)
        dist.destroy_process_group()


    if __name__ == "__main__":
        mp.spawn(run, nprocs=2)
''')


@pytest.mark.parametrize("fail", [False, True], ids=["push", "failed-push"])
def test_an_fsdp_sharded_model_is_pushed_whole_by_rank_0_alone(tiny_model_dir, tmp_path, fail):
    from prorl_server.dev.vllm_launcher import free_port

    script = tmp_path / "fsdp_push.py"
    script.write_text(FSDP_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(script), str(tiny_model_dir), str(tmp_path), str(free_port()),
                           "fail" if fail else "ok"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"result{k}.json").read_text()) for k in (0, 1))
    assert r0["sharded"] and r1["sharded"]
    # only the main process wrote the file and pushed; rank 1 took part in the gather and waited
    assert r0["pushed_by"] == [0] and r1["pushed_by"] == []
    assert r0["files"] == ["step-000001.safetensors"] and r1["files"] == []
    if not fail:
        assert r0["same"] is True  # the whole model, unsharded, with its checkpoint names and values
        assert r0["report"] and not r1["report"] and r0["error"] is None is r1["error"]
    else:
        # a failed push stops every rank, not only the one that saw it
        assert "injected" in r0["error"] and "injected" in r1["error"]


# ------------------------------------------------------------------ the real vLLM on a tied model
@pytest.fixture(scope="module")
def tied_vllm(tied_model_dir):
    pytest.importorskip("vllm")
    from prorl_server.dev.vllm_launcher import start_vllm

    server = start_vllm(tied_model_dir, max_model_len=512, max_num_batched_tokens=512, timeout_s=300,
                        log_path=ROOT / ".cache" / "logs" / f"vllm-tied-{os.getpid()}.log",
                        extra_args=["--worker-extension-cls", EXTENSION])
    yield server
    server.stop()


@pytest.mark.real
def test_a_tied_models_pushed_weights_are_what_vllm_serves(tied_vllm, tied_model_dir, tmp_path):
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    from trainer_plugins.trl.weights import load_into_backend, save_weights

    ids = list(range(100, 140))

    def served():
        import urllib.request

        req = urllib.request.Request(f"{tied_vllm.address}/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": str(tied_model_dir), "prompt": ids, "max_tokens": 1,
                                                      "prompt_logprobs": 0, "temperature": 0}).encode())
        with urllib.request.urlopen(req, timeout=120) as r:
            rows = json.loads(r.read())["choices"][0]["prompt_logprobs"][1:]
        return torch.tensor([rows[k][str(ids[k + 1])]["logprob"] for k in range(len(ids) - 1)])

    def expected(m):
        with torch.no_grad():
            lp = torch.log_softmax(m(torch.tensor([ids])).logits[0].float(), -1)
        return torch.stack([lp[k, ids[k + 1]] for k in range(len(ids) - 1)])

    async def load(path, digest=""):
        import aiohttp

        async with aiohttp.ClientSession() as s:
            return await load_into_backend(s, tied_vllm.address, str(path), digest)

    model = AutoModelForCausalLM.from_pretrained(tied_model_dir, dtype=torch.float32).eval()
    before = served()
    assert (before - expected(model)).abs().max() < 1e-4
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # the tied embedding too: input and output both move
            p.add_(torch.randn_like(p) * 0.05)
    # what safetensors' save_model writes for a tied model (lm_head.weight instead of the embedding) is refused
    # whole, with the reason, and nothing is loaded
    old_style = tmp_path / "save_model.safetensors"
    save_model(model, str(old_style))
    assert "lm_head.weight" in _keys(old_style) and "model.embed_tokens.weight" not in _keys(old_style)
    with pytest.raises(RuntimeError, match="tied output embedding"):
        asyncio.run(load(old_style))
    assert (served() - before).abs().max() < 1e-6
    # the push's file loads, and vLLM serves what transformers computes with the new weights
    path = tmp_path / "step-1.safetensors"
    report = asyncio.run(load(path, save_weights(model, path)))
    assert report["loaded"] == len(_keys(tied_model_dir / "model.safetensors"))
    after = served()
    assert (after - expected(model)).abs().max() < 1e-4, (after - expected(model)).abs().max()
    assert (after - before).abs().max() > 0.1
