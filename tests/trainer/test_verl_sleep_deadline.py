"""Time the model did not spend is not charged (issue #32 part 5): a job whose turn waits on verl's replica
while the trainer has it asleep for a training step longer than the job's ``timeout_s`` ends scored on its
merits, not as ``model_timeout``.

The pieces are those of tests/trainer/test_verl_registration.py: the relay on verl's REAL
``FullyAsyncLLMServerClient`` and balancer, a REAL rollout server (the project's app on loopback) serving the
``turns`` handler (3 LLM turns through the server's real LLM client), and :class:`ScriptedReplica` standing for
verl's vLLM replica actor (a GPU engine): ``abort_all_requests`` is what ``PPOTrainerColocateAsync`` does to
every replica at the end of sampling before it sleeps them and trains (in-flight turns end ``aborted``, which
verl's client resumes; new turns park at the submission gate), ``resume_generation`` what it does after the
wake-up and the weight update.
"""
from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import aiohttp
import pytest

pytest.importorskip("verl")

_spec = importlib.util.spec_from_file_location("_verl_registration_helpers_sleep",
                                               Path(__file__).with_name("test_verl_registration.py"))
reg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reg)
cfg, turns, rollout_server = reg.cfg, reg.turns, reg.rollout_server  # fixtures

TIMEOUT_S = 3.0
ASLEEP_S = 2 * TIMEOUT_S  # the training step: longer than the job's whole budget


@pytest.mark.parametrize("when", ["parked", "in_flight"])
async def test_a_turn_waiting_on_a_sleeping_replica_does_not_time_the_job_out(cfg, tokenizer, rollout_server,
                                                                              turns, monkeypatch, when):
    url = await rollout_server()
    monkeypatch.setenv("PRORL_SERVERS", url)
    replica = reg.ScriptedReplica(global_steps=1)
    loop = reg.make_loop(cfg, tokenizer, reg.verl_client(cfg, replica))
    await loop.run(reg.SP, **reg.row())  # starts the relay and registers it
    relay = loop.relay
    relay.probe_after_s, relay.probe_s = 0.2, 0.3  # quick to notice (the defaults are 1 s each)
    turns.gates[1] = asyncio.Event()
    body = {"instance": {"data_source": "turns", "turns": 3, "prompt_ids": [21, 22, 23]},
            "sampling_params": {"temperature": 1.0}, "timeout_s": TIMEOUT_S}
    async with aiohttp.ClientSession() as s:
        job = asyncio.ensure_future(s.post(f"{url}/process", json=body))
        await reg.reached(turns, 1, job)
        if when == "parked":
            await replica.abort_all_requests()  # asleep before turn 1 is sent: it parks at verl's gate
            turns.gates[1].set()
        else:
            replica.hold_after = 2  # turn 1 is generating (2 tokens in) when the trainer aborts it and sleeps
            turns.gates[1].set()
            await asyncio.wait_for(replica.held.wait(), 30)
            await replica.abort_all_requests()  # aborted mid-turn; verl's client re-sends it, and it parks
        await asyncio.sleep(ASLEEP_S)  # the training step
        await replica.set_global_steps(2)
        await replica.resume_generation()  # woken, weights updated, gate open
        r = await asyncio.wait_for(job, 60)
        result = await r.json()
    assert r.status == 200, result
    assert result["failure_kind"] is None and result["critical_error"] is None, result["error"]
    assert result["reward"] == 1.0 and not result["timing"]["timeout_triggered"]
    assert len(result["trajectories"]) == 3  # every turn ran, the last ones on the new weights
    assert result["trajectories"][2]["weight_versions"] == [2]
    # what the relay told the server, and that the kept turn was handed back rather than generated again
    assert relay.stats["paused_answers"] >= 1 and relay.stats["paused_resent"] >= 1
    # the time asleep was not charged: the job's counted time stays within its budget
    assert result["timing"]["counted_s"] < TIMEOUT_S
