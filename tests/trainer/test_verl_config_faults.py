"""Configuration faults stop the trainer with the server's message, under verl's V1 worker as under the legacy
worker; job faults are retried (issue #22 item 3, trainer side).

Before: verl's V1 ``AgentLoopWorkerTQ._run_prompt`` caught every exception of a session and marked the group
failed; verl's replay buffer then evicted and refilled it, forever, so a rollout server that cannot run the
handler (no sandbox runtime: every ``math`` job), a wrong token or an unknown handler spun the same loop
silently. Now the agent loop stores a row marked ``extra_fields.prorl.fatal`` and ``ProRLReplayBuffer`` raises
it in the trainer process.

Real: the rollout server (the project's app on loopback) with the real ``math`` handler and no sandbox runtime,
verl's ``AgentLoopWorkerTQ`` code and the plugin's replay buffer on top of verl's ``ReplayBufferAsync``.
Stand-in: TransferQueue's KV store (``KVStore`` of ``test_verl_v1_worker.py``: TransferQueue needs Ray actors).
"""
from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")

_spec = importlib.util.spec_from_file_location("_verl_v1_helpers", Path(__file__).with_name("test_verl_v1_worker.py"))
v1 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(v1)
v1_cfg, tq_worker = v1.v1_cfg, v1.tq_worker  # fixtures

import numpy as np  # noqa: E402
import uuid  # noqa: E402

from handlers.math.handler import MathHandler  # noqa: E402
from trainer_plugins import jobs  # noqa: E402
from trainer_plugins.verl import replay_buffer  # noqa: E402

# (looked up when a test runs, so that on code without them each test fails on its own assertion)
def _err(module, name):
    return getattr(module, name, type(f"Missing{name}", (Exception,), {}))
from verl.utils import tensordict_utils as tu  # noqa: E402


@pytest.fixture
def no_sandbox_server(aiohttp_server):
    """``await no_sandbox_server(**settings)`` -> base URL of a real rollout server with the real ``math`` handler
    and ``sandbox_runtime: none`` (what ``run_gpu.sh`` started before: no runtime given, and none by default)."""
    from prorl_server.app import create_app
    from prorl_server.config import ServerSettings
    from prorl_server.plugin.registry import HandlerRegistry

    async def start(**settings):
        registry = HandlerRegistry()
        registry.register(MathHandler)
        try:
            app = create_app(ServerSettings(sandbox_runtime="none", health_interval_s=3600, **settings),
                             registry=registry)
        except ValueError:  # a server from before "none" was a runtime name: its default was no runtime
            app = create_app(ServerSettings(health_interval_s=3600, **settings), registry=registry)
        server = await aiohttp_server(app)
        return str(server.make_url("")).rstrip("/")

    return start


def math_batch(data_source: str = "math", step: int = 3):
    """One verl row of a math problem (as verl's gsm8k preprocessing writes it), as the V1 trainer submits it."""
    rows = {"raw_prompt": np.array([np.array([{"role": "user", "content": "What is 2 + 3?"}], dtype=object), None],
                                   dtype=object)[:-1],
            "data_source": np.array([data_source], dtype=object),
            "reward_model": np.array([{"style": "rule", "ground_truth": "5"}], dtype=object),
            "extra_info": np.array([{"index": 0}], dtype=object),
            "index": np.array([0], dtype=object), "uid": np.array([str(uuid.uuid4())], dtype=object)}
    batch = tu.get_tensordict(rows)
    tu.assign_non_tensor_data(batch, "global_steps", step)
    return batch


def buffer_of(cfg):
    from verl.utils.import_utils import load_extern_type

    sampler = cfg.trainer.v1.sampler
    return load_extern_type(sampler.custom_sampler.path, sampler.custom_sampler.name)(
        trainer_mode="colocate_async", trainer_config={}, max_off_policy_threshold=1,
        max_off_policy_strategy="drop", sampler_kwargs={"filter_groups_enable": False}, refill_fn=lambda n: None)


async def run_v1(tq_worker, batch) -> list[dict]:
    uid = list(batch["uid"])[0]
    tq_worker.store.tags[uid] = {"is_prompt": True, "status": "pending", "global_steps": 3}
    await tq_worker.generate_sequences(batch)
    await asyncio.wait_for(asyncio.gather(*list(tq_worker.background_tasks)), 60)
    return [row for key, row in tq_worker.store.rows.items() if key.startswith(uid)]


@pytest.mark.parametrize("fault", ["no_sandbox_runtime", "wrong_token", "unknown_handler"])
async def test_a_configuration_fault_stops_v1_training_with_the_servers_message(
        fault, tq_worker, v1_cfg, no_sandbox_server, monkeypatch):
    # a rollout server with the real math handler and no sandbox runtime (the recipe's old default)
    url = await no_sandbox_server(**({"token": "right"} if fault == "wrong_token" else {}))
    monkeypatch.setenv("PRORL_SERVERS", url)
    if fault == "wrong_token":
        monkeypatch.setenv("PRORL_TOKEN", "wrong")
    expected = {"no_sandbox_runtime": r"HandlerUnavailableError.*cannot run the 'math' handler.*sandbox",
                "wrong_token": r"RolloutAuthError.*401",
                "unknown_handler": r"no 'no_such_handler' handler"}[fault]
    rows = await run_v1(tq_worker, math_batch("no_such_handler" if fault == "unknown_handler" else "math"))
    uid = list(tq_worker.store.tags)[0]
    # the sessions did not raise (V1 would only mark the group failed): each stored a row carrying the fault
    assert tq_worker.store.tags[uid]["status"] == "finished"
    assert len(rows) == v1.N and all(r["response_mask"].sum() == 0 for r in rows)
    fatal = rows[0]["extra_fields"]["prorl"]["fatal"]
    assert fatal and __import__("re").search(expected, fatal), fatal
    # the trainer process stops with that message when its sampler reads the group
    with pytest.raises(_err(replay_buffer, "ConfigurationFault"), match=expected):
        buffer_of(v1_cfg).get_sampleable_count(3, "train")


async def test_under_the_legacy_worker_the_fault_is_raised_with_the_servers_message(
        v1_cfg, tokenizer, no_sandbox_server, monkeypatch):
    import importlib

    plugin_spec = importlib.util.spec_from_file_location("_verl_plugin_helpers2",
                                                         Path(__file__).with_name("test_verl_plugin.py"))
    plugin = importlib.util.module_from_spec(plugin_spec)
    plugin_spec.loader.exec_module(plugin)
    url = await no_sandbox_server()
    monkeypatch.setenv("PRORL_SERVERS", url)
    from verl.experimental.agent_loop import agent_loop as verl_agent_loop
    from omegaconf import OmegaConf
    from trainer_plugins.verl import CONFIG_DIR

    monkeypatch.setitem(verl_agent_loop._agent_loop_registry, "prorl", OmegaConf.load(CONFIG_DIR / "agent_loop.yaml")[0])
    loop = plugin.make_loop(v1_cfg, tokenizer)
    row = {"raw_prompt": np.array([{"role": "user", "content": "What is 2 + 3?"}], dtype=object),
           "data_source": "math", "reward_model": {"ground_truth": "5"}, "extra_info": {"index": 0}}
    with pytest.raises(_err(jobs, "HandlerUnavailableError"), match="handler_unavailable.*sandbox"):
        await loop.run({}, **row)  # no session_id: verl's legacy AgentLoopWorker, which raises it to the trainer


async def test_job_client_tells_configuration_faults_from_instance_faults(no_sandbox_server):
    from prorl_server.types import ProcessRequest
    from trainer_plugins.jobs import CONFIGURATION_FAULTS, HandlerUnavailableError, InvalidInstanceError, JobSubmitter
    from trainer_plugins.jobs import RolloutAuthError, UnknownHandlerError

    url = await no_sandbox_server()
    async with JobSubmitter() as jobs:
        with pytest.raises(HandlerUnavailableError) as e:
            await jobs.submit(url, ProcessRequest(instance={"data_source": "math", "question": "1+1?", "answer": "2"},
                                                  job_id="a"))
        assert not isinstance(e.value, InvalidInstanceError) and isinstance(e.value, CONFIGURATION_FAULTS)
        with pytest.raises(UnknownHandlerError) as e:
            await jobs.submit(url, ProcessRequest(instance={"data_source": "nope"}, job_id="b"))
        assert isinstance(e.value, InvalidInstanceError)  # what callers caught before still catches it
    assert issubclass(RolloutAuthError, CONFIGURATION_FAULTS)
