"""The TRL plugin's staleness bound (issue #32 part 2): with ``prefetch`` the swap gets a default
``max_staleness``, prefetched prompt groups the trainer has moved past the bound are cancelled on the rollout
servers and submitted again, and at the end of training the prefetched jobs are cancelled, each counted.

Real rollout servers (the project's app on loopback) serve the ``fixed`` test-double handler
(tests/trainer/conftest.py: it returns its instance's trajectory after sleeping ``sleep`` seconds, so a slow
instance stands for a long multi-turn job still running at the servers).
"""
from __future__ import annotations

import asyncio
import importlib.util
import time
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest

from trainer_plugins.trl import ProRLRollout, WeightPushCallback
from trainer_plugins.trl.rollout import versions_per_call

_spec = importlib.util.spec_from_file_location("_trl_async_helpers", Path(__file__).with_name("test_trl_async.py"))
_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_helpers)
_ThreadedApp, call, fixed_instance, make_trainer = (_helpers._ThreadedApp, _helpers.call, _helpers.fixed_instance,
                                                    _helpers.make_trainer)

SLOW_S = 60.0  # a job that is still running whenever the test looks (the test never waits for it)


async def _in_flight(url: str) -> int:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/status") as r:
            return int((await r.json())["jobs_in_flight"])


async def _until(pred, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await pred():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


async def _slow_batch_at_the_servers(url, fixed, rollout):
    """Two calls: the first fills the pipeline with fast "say a" batches, the second takes one and leaves the
    slow "say b" batch (2 jobs) running at the server."""
    await call(rollout, ["say a"] * 2, make_trainer(2, step=0))
    await call(rollout, ["say b"] * 2, make_trainer(2, step=1))

    async def running():
        return fixed.jobs["b"] == 2 and await _in_flight(url) == 2

    await _until(running)


def test_versions_per_call_follow_trls_generation_frequency():
    assert versions_per_call(None) == 1
    assert versions_per_call(SimpleNamespace(gradient_accumulation_steps=4, steps_per_generation=4,
                                             num_iterations=1)) == 1
    # one generation batch trained over 2 optimizer steps, each twice: 4 weight versions per call
    assert versions_per_call(SimpleNamespace(gradient_accumulation_steps=2, steps_per_generation=4,
                                             num_iterations=2)) == 4


def test_prefetch_is_the_default_staleness_bound_of_the_swap(tmp_path):
    import torch
    from aiohttp import web

    pauses: list = []

    async def handle(request):
        body = await request.json() if request.can_read_body else None
        if request.path == "/weights/pause":
            pauses.append(body)
            return web.json_response({"swap_id": "s1", "backends": {}, "dropped_jobs": 0, "held_calls": 0})
        return web.json_response({"backends": {}})  # GET /weights, /weights/resume

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    server = _ThreadedApp(app)  # stands in for a rollout server's /weights endpoints
    rollout = ProRLRollout([server.url], [fixed_instance("a")], prefetch=2)
    try:
        cb = WeightPushCallback(rollout, [], weights_dir=tmp_path / "w", protocol="swap")
        state = SimpleNamespace(global_step=1, is_world_process_zero=True)
        cb.on_step_end(SimpleNamespace(output_dir=str(tmp_path)), state, None, model=torch.nn.Linear(2, 2))
        # a rollout without prefetch has no bound of its own, and the user's bound wins over the default
        plain = ProRLRollout([server.url], [fixed_instance("a")])
        assert WeightPushCallback(plain, [], protocol="swap").staleness_bound is None
        assert WeightPushCallback(rollout, [], protocol="swap", max_staleness=5).staleness_bound == 5
        plain.close()
    finally:
        rollout.close()
        server.close()
    assert [p["max_staleness"] for p in pauses] == [2]


async def test_training_end_cancels_the_prefetched_jobs_and_counts_them(start_llm_server, fixed, tmp_path):
    url = await start_llm_server()
    rollout = ProRLRollout([url], [fixed_instance("a"), fixed_instance("b", sleep=SLOW_S)], max_sample_retries=0,
                           prefetch=2)
    try:
        await _slow_batch_at_the_servers(url, fixed, rollout)
        cb = WeightPushCallback(rollout, ["http://127.0.0.1:9"], weights_dir=tmp_path / "w")
        t0 = time.monotonic()
        await asyncio.to_thread(cb.on_train_end, SimpleNamespace(output_dir=str(tmp_path)),
                                SimpleNamespace(global_step=2, is_world_process_zero=True), None)
        # the slow group could never be trained: its jobs end at the server now, not after their SLOW_S
        assert await _in_flight(url) == 0 and time.monotonic() - t0 < SLOW_S / 2
        assert rollout.stale_cancelled == 2 and rollout.jobs_in_flight() == 0
    finally:
        rollout.close()


async def test_a_prefetched_group_past_the_bound_is_cancelled_and_submitted_again(start_llm_server, fixed):
    url = await start_llm_server()
    rollout = ProRLRollout([url], [fixed_instance("a"), fixed_instance("b", sleep=SLOW_S), fixed_instance("c")],
                           max_sample_retries=0, prefetch=2, max_staleness=1)
    try:
        await _slow_batch_at_the_servers(url, fixed, rollout)  # "say b" submitted at weight version 0
        rollout.weight_version = 2  # two pushes later: the "say b" group would be trained 2 versions stale
        n = await asyncio.to_thread(rollout.cancel_stale)
        assert n == 2 and rollout.stale_cancelled == 2

        async def resubmitted():  # the old jobs ended at the server, the group runs again at the new version
            return fixed.jobs["b"] == 4 and await _in_flight(url) == 2

        await _until(resubmitted)
        trainer = make_trainer(2, step=2)
        trainer._metrics = {"train": {}}  # GRPOTrainer's metrics of the step (trl 1.16), logged at its end
        out = await call(rollout, ["say c"] * 2, trainer)
        assert out["prorl_prompt"] == ["say a"] * 2  # the pipeline keeps its order
        assert rollout.history[-1].stale_cancelled == 2  # counted in the step that followed the cancel
        assert trainer._metrics["train"]["prorl/stale_cancelled"] == [2.0]
        assert rollout.cancel_stale() == 0  # nothing is past the bound now
    finally:
        rollout.close()


@pytest.mark.parametrize("kwargs", [dict(prefetch=1.5), dict(prefetch="2"), dict(prefetch=-1),
                                    dict(prefetch=True, max_staleness=0), dict(prefetch=2, max_staleness=1.5),
                                    dict(prefetch=2, max_staleness=-3)])
def test_settings_that_would_be_truncated_or_cancel_every_batch_are_refused(kwargs):
    """Red team: ``prefetch=1.5`` ran as 1 and ``"2"`` as 2 without a word, and ``max_staleness=0`` with prefetch
    cancelled and re-sent every prefetched batch."""
    with pytest.raises(ValueError, match="prefetch|max_staleness"):
        ProRLRollout(["http://127.0.0.1:9"], [fixed_instance("a")], **kwargs)


@pytest.mark.parametrize("value,rollout_kwargs", [(-1, dict(prefetch=2)), (0, dict(prefetch=2)), (2.7, dict(prefetch=2)),
                                                  ("x", dict(prefetch=2)), (True, dict(prefetch=2)),
                                                  (3, dict(prefetch=2, max_staleness=1))])
def test_the_callbacks_bound_gets_the_rollouts_checks(value, rollout_kwargs):
    """Red team (session 11): ``WeightPushCallback(max_staleness=...)`` took -1 and 0 (with prefetch) that
    ProRLRollout refuses, wrote them into the rollout and sent them to the servers; 2.7 became 2 on the rollout
    and 2.7 on the wire; a second bound different from the rollout's own was kept beside it."""
    rollout = ProRLRollout(["http://127.0.0.1:9"], [fixed_instance("a")], **rollout_kwargs)
    try:
        with pytest.raises(ValueError, match="max_staleness"):
            WeightPushCallback(rollout, ["http://127.0.0.1:9"], protocol="swap", max_staleness=value)
        assert rollout.max_staleness == rollout_kwargs.get("max_staleness")  # untouched
    finally:
        rollout.close()
