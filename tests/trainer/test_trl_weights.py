"""Weight push (trainer_plugins/trl/weights.py) and the vLLM worker extension (trainer_plugins/vllm_weights.py).

Real tier: a vLLM CPU server of its own (module scope: it gets new weights, so it is not the session's shared
server, whose logprobs other tests compare with the original model) started with the worker extension; the
served logprobs of a fixed token sequence are compared with a transformers forward pass of the pushed weights.

Fast tier: real rollout servers (the project's app on loopback) and a stand-in for a vLLM server's
development endpoints (``/pause``, ``/collective_rpc``, ``/reset_prefix_cache``, ``/resume``) that fails the
load on request (fault injection: a real vLLM that cannot read the file is covered in the real tier).
"""
from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from trainer_plugins.client import register_backends
from trainer_plugins.trl.weights import WeightPushError, push_weights, save_weights

ROOT = Path(__file__).resolve().parents[2]
EXTENSION = "trainer_plugins.vllm_weights.WeightLoaderExtension"


# ------------------------------------------------------------------ fast tier
@pytest.fixture
def start_fake_vllm(aiohttp_server):
    """``await start_fake_vllm(fail=None|str)`` -> base URL of a stand-in for vLLM's development endpoints
    (see the module docstring). With ``fail``, ``/collective_rpc`` answers what the worker extension answers
    when a load fails: ``{"results": [{"ok": false, "error": fail}]}``. ``calls`` lists the paths it served."""
    from aiohttp import web

    async def start(fail=None):
        calls = []

        async def handle(request):
            calls.append(request.path)
            if request.path == "/collective_rpc":
                body = await request.json()
                if fail:
                    return web.json_response({"results": [{"ok": False, "error": fail}]})
                return web.json_response({"results": [{"ok": True, "loaded": 1, "args": body["args"]}]})
            return web.json_response({})

        app = web.Application()
        for path in ("/pause", "/resume", "/reset_prefix_cache", "/collective_rpc"):
            app.router.add_post(path, handle)
        server = await aiohttp_server(app)
        url = str(server.make_url("")).rstrip("/")
        start.calls[url] = calls
        return url

    start.calls = {}
    return start


async def versions(url):
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/status") as r:
            return {b["address"]: b["weight_version"] for b in (await r.json())["backends"]}


async def test_a_failed_push_leaves_the_old_version_registered_and_says_why(start_llm_server, start_fake_vllm,
                                                                           tmp_path):
    good, bad = await start_fake_vllm(), await start_fake_vllm(fail="FileNotFoundError: step-3.safetensors")
    server = await start_llm_server()
    async with aiohttp.ClientSession() as s:
        await register_backends(s, server, [good, bad], 0)  # what WeightPushCallback.on_train_begin does
        assert await versions(server) == {good: 0, bad: 0}
        with pytest.raises(WeightPushError) as e:
            await push_weights(s, str(tmp_path / "step-3.safetensors"), 3, [good, bad], [server])
    assert bad in str(e.value) and "FileNotFoundError: step-3.safetensors" in str(e.value)
    assert "previous version" in str(e.value)
    assert e.value.failed.keys() == {bad} and e.value.pushed == [good]
    # the backend that loaded the weights serves v3 and says so; the one that did not keeps v0
    assert await versions(server) == {good: 3, bad: 0}
    # the failed backend was resumed all the same, and the good one had its prefix cache reset
    assert start_fake_vllm.calls[bad] == ["/pause", "/collective_rpc", "/resume"]
    assert start_fake_vllm.calls[good] == ["/pause", "/collective_rpc", "/reset_prefix_cache", "/resume"]


async def test_an_unreachable_backend_is_a_push_error_and_keeps_its_version(start_llm_server, start_fake_vllm,
                                                                           tmp_path):
    from prorl_server.vllm_launcher import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    server = await start_llm_server()
    async with aiohttp.ClientSession() as s:
        await register_backends(s, server, [dead], 0)
        with pytest.raises(WeightPushError, match=dead):
            await push_weights(s, str(tmp_path / "w.safetensors"), 1, [dead], [server])
    assert await versions(server) == {dead: 0}


def test_saved_weights_are_written_whole_with_their_checksum(tmp_path):
    import hashlib

    import torch

    model = torch.nn.Linear(3, 2)
    path = tmp_path / "w" / "step-1.safetensors"
    sha = save_weights(model, path)
    assert sha == hashlib.sha256(path.read_bytes()).hexdigest()
    assert [p.name for p in path.parent.iterdir()] == ["step-1.safetensors"]  # no temporary left behind


# ------------------------------------------------------------------ real tier: vLLM CPU + the extension
@pytest.fixture(scope="module")
def ext_vllm(tiny_model_dir):
    pytest.importorskip("vllm")
    from prorl_server.vllm_launcher import start_vllm

    server = start_vllm(tiny_model_dir, max_model_len=1024, max_num_batched_tokens=1024, timeout_s=300,
                        log_path=ROOT / ".cache" / "logs" / f"vllm-weights-{os.getpid()}.log",
                        extra_args=["--worker-extension-cls", EXTENSION])
    yield server
    server.stop()


IDS = list(range(100, 140))


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
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

    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([IDS])).logits[0].float(), -1)
    return torch.stack([lp[k, IDS[k + 1]] for k in range(len(IDS) - 1)])


@pytest.mark.real
def test_pushed_weights_are_served_as_a_transformers_forward_pass_computes_them(ext_vllm, tiny_model_dir,
                                                                                  tmp_path):
    import asyncio

    import torch
    from transformers import AutoModelForCausalLM

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
    sha = save_weights(model, path)

    async def push():
        async with aiohttp.ClientSession() as s:
            from trainer_plugins.trl.weights import load_into_backend

            await load_into_backend(s, ext_vllm.address, str(path), sha)

    asyncio.run(push())
    after = served_logprobs(ext_vllm, tiny_model_dir)
    assert (after - expected).abs().max() < 1e-4, (after - expected).abs().max()


@pytest.mark.real
def test_a_torn_or_foreign_weights_file_is_refused_and_the_served_weights_stay(ext_vllm, tiny_model_dir, tmp_path):
    import asyncio

    import torch
    from safetensors.torch import save_file

    before = served_logprobs(ext_vllm, tiny_model_dir)
    good = tmp_path / "w.safetensors"
    save_file({"model.norm.weight": torch.zeros(128)}, str(good))

    async def load(path, sha=""):
        from trainer_plugins.trl.weights import load_into_backend

        async with aiohttp.ClientSession() as s:
            await load_into_backend(s, ext_vllm.address, str(path), sha)

    with pytest.raises(RuntimeError, match="sha256"):  # checksum of another file: refused before loading
        asyncio.run(load(good, "0" * 64))
    with pytest.raises(RuntimeError, match="does not exist"):
        asyncio.run(load(tmp_path / "missing.safetensors"))
    foreign = tmp_path / "gpt2.safetensors"  # another model's names: refused whole, nothing loaded
    save_file({"model.norm.weight": torch.zeros(128), "transformer.h.0.attn.c_attn.weight": torch.zeros(4, 4)},
              str(foreign))
    with pytest.raises(RuntimeError, match="transformer.h.0.attn.c_attn.weight"):
        asyncio.run(load(foreign))
    after = served_logprobs(ext_vllm, tiny_model_dir)
    assert (after - before).abs().max() < 1e-6
    # vLLM still generates after the refused loads (it was resumed)
    out = post(f"{ext_vllm.address}/v1/completions", {"model": str(tiny_model_dir), "prompt": IDS[:5],
                                                     "max_tokens": 2})
    assert out["choices"][0]["text"] is not None
