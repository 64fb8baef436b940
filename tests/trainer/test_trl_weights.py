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
    from prorl_server.dev.vllm_launcher import free_port

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


# ------------------------------------------------------------------ the rollout server's swap
@pytest.fixture
def start_swap_server(aiohttp_server):
    """``await start_swap_server(pause_status=200, resume_status=200)`` -> base URL of a labelled STAND-IN for
    a rollout server's swap endpoints (``GET /weights``, ``POST /weights/pause``, ``POST /weights/resume``,
    ``POST /add_llm_server``) as the server's API specifies them, used to inject the faults a real server only
    shows under a race (another trainer's swap holding the lease: 409 ``swap_in_progress``; a lease that ran out
    before the resume: 409 ``swap_expired``). The happy path runs against the real server in
    tests/trainer/test_trl_async.py (the resume test) and tests/trainer/test_trl_real.py. ``start_swap_server.events`` is one log shared by every stand-in started
    (``(url, path, body)`` in arrival order)."""
    from aiohttp import web

    async def start(pause_status=200, resume_status=200, backends=()):
        url_box = []

        async def handle(request):
            body = await request.json() if request.can_read_body else None
            start.events.append((url_box[0], request.path, body))
            if request.path == "/weights/pause":
                if pause_status != 200:
                    return web.json_response({"error": {"type": "swap_in_progress", "message": "held"}},
                                             status=pause_status)
                return web.json_response({"swap_id": f"swap-{len(start.events)}",
                                          "weight_version": body["weight_version"],
                                          "backends": {b: "paused" for b in backends}, "dropped_jobs": 1,
                                          "deadline": 0.0, "pause_s": 0.01})
            if request.path == "/weights/resume":
                if resume_status != 200:
                    return web.json_response({"error": {"type": "swap_expired", "message": "lease ran out"}},
                                             status=resume_status)
                return web.json_response({"weight_version": body["weight_version"], "held_s": 0.5,
                                          "resume_s": 0.01, "tokens_discarded": 0,
                                          "backends": {b: "resumed" for b in backends if b not in body["failed"]}})
            if request.path == "/weights":
                return web.json_response({"weight_version": 0, "swap": None, "backends": []})
            return web.json_response({})

        app = web.Application()
        app.router.add_get("/weights", handle)
        for path in ("/weights/pause", "/weights/resume", "/add_llm_server"):
            app.router.add_post(path, handle)
        server = await aiohttp_server(app)
        url_box.append(str(server.make_url("")).rstrip("/"))
        return url_box[0]

    start.events = []
    return start


async def test_a_swap_pauses_every_server_loads_each_backend_once_and_resumes_every_server(
        start_swap_server, start_fake_vllm, tmp_path):
    from trainer_plugins.trl.weights import swap_weights

    a, b = await start_fake_vllm(), await start_fake_vllm()
    s1, s2 = await start_swap_server(backends=[a, b]), await start_swap_server(backends=[a, b])
    async with aiohttp.ClientSession() as s:
        report = await swap_weights(s, str(tmp_path / "w.safetensors"), 4, [a, b], [s1, s2], digest="d",
                                    kv="recompute", max_staleness=2)
    events = start_swap_server.events
    assert [(u, p) for u, p, _ in events] == [(s1, "/weights/pause"), (s2, "/weights/pause"),
                                              (s1, "/weights/resume"), (s2, "/weights/resume")]
    assert events[0][2] == {"weight_version": 4, "kv": "recompute", "max_staleness": 2, "lease_s": 300.0}
    assert events[2][2]["swap_id"] == "swap-1" and events[3][2]["swap_id"] == "swap-2"
    assert events[2][2]["failed"] == {} and events[2][2]["weight_version"] == 4
    # each backend loaded once, without a pause or reset of the trainer's own (the servers did those)
    assert start_fake_vllm.calls[a] == ["/collective_rpc"] and start_fake_vllm.calls[b] == ["/collective_rpc"]
    assert report.mode == "swap" and sorted(report.pushed) == sorted([a, b]) and report.dropped_jobs == 2
    assert report.tokens_discarded == 0 and report.held_s == 0.5


async def test_a_backend_that_fails_its_load_is_reported_to_every_server_at_resume(start_swap_server,
                                                                                 start_fake_vllm, tmp_path):
    from trainer_plugins.trl.weights import swap_weights

    good, bad = await start_fake_vllm(), await start_fake_vllm(fail="ValueError: digest mismatch")
    server = await start_swap_server(backends=[good, bad])
    async with aiohttp.ClientSession() as s:
        with pytest.raises(WeightPushError, match="digest mismatch") as e:
            await swap_weights(s, str(tmp_path / "w.safetensors"), 1, [good, bad], [server])
    resume = [body for _u, p, body in start_swap_server.events if p == "/weights/resume"]
    assert len(resume) == 1 and list(resume[0]["failed"]) == [bad] and "digest mismatch" in resume[0]["failed"][bad]
    assert e.value.pushed == [good] and list(e.value.failed) == [bad]


async def test_a_server_that_refuses_to_pause_stops_the_swap_before_any_load(start_swap_server, start_fake_vllm,
                                                                            tmp_path):
    from trainer_plugins.trl.weights import SwapRefusedError, swap_weights

    backend = await start_fake_vllm()
    ok, busy = await start_swap_server(backends=[backend]), await start_swap_server(pause_status=409)
    async with aiohttp.ClientSession() as s:
        with pytest.raises(SwapRefusedError, match="swap_in_progress"):
            await swap_weights(s, str(tmp_path / "w.safetensors"), 7, [backend], [ok, busy], previous_version=6)
    assert start_fake_vllm.calls[backend] == []  # nothing was loaded while a server could still send turns
    # the server that had paused is resumed under the version its backends still serve
    resumes = [(u, body) for u, p, body in start_swap_server.events if p == "/weights/resume"]
    assert resumes == [(ok, {"swap_id": "swap-1", "weight_version": 6, "failed": {}})]


async def test_a_resume_after_the_lease_ran_out_relabels_the_backends_that_loaded(start_swap_server,
                                                                                 start_fake_vllm, tmp_path):
    from trainer_plugins.trl.weights import swap_weights

    backend = await start_fake_vllm()
    server = await start_swap_server(resume_status=409, backends=[backend])
    async with aiohttp.ClientSession() as s:
        with pytest.raises(WeightPushError, match="lease_s"):
            await swap_weights(s, str(tmp_path / "w.safetensors"), 3, [backend], [server], lease_s=0.5)
    # the server resumed the backend under its old version at the deadline; it serves v3: say so
    registered = [body for _u, p, body in start_swap_server.events if p == "/add_llm_server"]
    assert registered and registered[-1]["address"] == backend and registered[-1]["weight_version"] == 3
