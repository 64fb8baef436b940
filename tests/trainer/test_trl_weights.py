"""Weight push (trainer_plugins/trl/weights.py), fast tier; the vLLM worker extension itself is tested against a
real vLLM CPU server in tests/trainer/test_trl_real.py and tests/trainer/test_trl_models.py.

Real rollout servers (the project's app on loopback) and a stand-in for a vLLM server's
development endpoints (``/pause``, ``/collective_rpc``, ``/reset_prefix_cache``, ``/resume``) that fails the
load or the prefix-cache reset on request (fault injection: a real vLLM that cannot read the file is covered in
the real tier; a real failed reset needs requests holding KV blocks at the moment of the reset).
"""
from __future__ import annotations

import aiohttp
import pytest

from trainer_plugins.client import register_backends
from trainer_plugins.trl.weights import WeightPushError, push_weights, save_weights


# ------------------------------------------------------------------ fast tier
@pytest.fixture
def start_fake_vllm(aiohttp_server):
    """``await start_fake_vllm(fail=None|str, reset_success=True)`` -> base URL of a stand-in for vLLM's
    development endpoints (see the module docstring). With ``fail``, ``/collective_rpc`` answers what the worker
    extension answers when a load fails: ``{"results": [{"ok": false, "error": fail}]}``; ``/reset_prefix_cache``
    answers ``{"success": reset_success}`` as vLLM does. ``calls`` lists the paths it served."""
    from aiohttp import web

    async def start(fail=None, reset_success=True):
        calls = []

        async def handle(request):
            calls.append(request.path)
            if request.path == "/collective_rpc":
                body = await request.json()
                if fail:
                    return web.json_response({"results": [{"ok": False, "error": fail}]})
                return web.json_response({"results": [{"ok": True, "loaded": 1, "args": body["args"]}]})
            if request.path == "/reset_prefix_cache":  # vLLM's answer (entrypoints/serve/dev/cache)
                return web.json_response({"success": reset_success})
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


async def test_a_prefix_cache_reset_that_vllm_reports_failed_is_a_push_error(start_llm_server, start_fake_vllm,
                                                                            tmp_path):
    # vLLM answers {"success": false} when blocks are still held: the old weights' KV would be reused
    stuck = await start_fake_vllm(reset_success=False)
    server = await start_llm_server()
    async with aiohttp.ClientSession() as s:
        await register_backends(s, server, [stuck], 0)
        with pytest.raises(WeightPushError, match="success=false"):
            await push_weights(s, str(tmp_path / "w.safetensors"), 1, [stuck], [server])
    assert await versions(server) == {stuck: 0}
    assert start_fake_vllm.calls[stuck][-1] == "/resume"


def test_saved_weights_are_written_whole_with_a_digest_the_worker_checks_cheaply(tmp_path):
    import torch

    from trainer_plugins.vllm_weights import check_digest, weights_digest

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    path = tmp_path / "w" / "step-1.safetensors"
    digest = save_weights(model, path, metadata={"prorl_version": 1})
    assert [p.name for p in path.parent.iterdir()] == ["step-1.safetensors"]  # no temporary left behind
    assert digest == weights_digest(path) and digest.startswith("prorl-sampled-v1:")
    check_digest([path], digest)
    # the same weights written again (the next push) have another nonce: a stale file is refused
    again = tmp_path / "again.safetensors"
    assert save_weights(model, again) != digest
    data = path.read_bytes()
    torn = tmp_path / "torn.safetensors"
    torn.write_bytes(data[:-100])
    with pytest.raises(ValueError, match="torn or truncated"):
        check_digest([torn], digest)
    # a tensor's first bytes changed (the weight is 64x64 float32 = 16 KiB: its head and tail are sampled)
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        assert sorted(f.keys()) == ["bias", "weight"] and f.metadata()["prorl_version"] == "1"
    header_len = 8 + int.from_bytes(data[:8], "little")
    flipped = bytearray(data)
    flipped[header_len + 4 * 64 + 1] ^= 0xFF  # first bytes of "weight" (after the 64 bias floats)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match="digest"):
        check_digest([bad], digest)
    # what it does not catch (documented): a byte in the middle of a tensor larger than 8 KiB
    middle = bytearray(data)
    middle[header_len + 4 * 64 + 8 * 1024] ^= 0xFF
    bad.write_bytes(bytes(middle))
    check_digest([bad], digest)
    # a full SHA-256 still reads every byte and catches it
    import hashlib

    with pytest.raises(ValueError, match="digest"):
        check_digest([bad], hashlib.sha256(data).hexdigest())
