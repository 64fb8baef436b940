"""Every persistent fault stops the trainer with its reason; none spins (issue #32, parts 3 and 4).

Found with verl 0.9.1's real trainer on CPU: a rollout server whose tokenizer loads but is not the policy's made
every turn a vLLM request-validation error, which the relay answered 502: retried as a backend fault, filtered,
evicted, refilled, 0 steps and 1,440 warnings in 6 minutes. Here:

1. the relay answers a request verl's replica refuses as invalid with a 4xx, the rollout server fails the job
   as ``configuration``, and the agent loop stops training with the replica's message (not a filtered row);

Real: the rollout server (the project's app on loopback), its LLM client, verl's real
``FullyAsyncLLMServerClient`` and balancer, the plugin's relay and agent loop as verl instantiates them. Stand-ins
(from ``test_verl_registration.py``, each says what it stands for): Ray actor handles and verl's vLLM replica
actor; :class:`ValidatingReplica` adds vLLM's input validation to the latter.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("verl")

_spec = importlib.util.spec_from_file_location("_verl_registration_helpers",
                                               Path(__file__).with_name("test_verl_registration.py"))
reg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reg)
cfg, turns, rollout_server = reg.cfg, reg.turns, reg.rollout_server  # fixtures

from trainer_plugins.verl import relay as relay_module  # noqa: E402

VOCAB = 4096  # the tiny test model's vocabulary


class ValidatingReplica(reg.ScriptedReplica):
    """Stands in for verl's ``vLLMHttpServer`` replica with vLLM's input validation: a prompt holding a token id
    outside the model's vocabulary raises ``vllm.exceptions.VLLMValidationError`` ("Token id N is out of
    vocabulary", ``vllm/v1/engine/input_processor.py``), wrapped as Ray delivers an actor's exception to the
    caller (``RayTaskError(...).as_instanceof_cause()``)."""

    async def generate(self, prompt_ids, sampling_params, request_id, **kwargs):
        bad = [t for t in prompt_ids if not 0 <= t < VOCAB]
        if bad:
            self.calls.append({"request_id": request_id, "refused": True})
            from ray.exceptions import RayTaskError
            from vllm.exceptions import VLLMValidationError

            raise RayTaskError("generate", "Traceback (most recent call last): ...",
                               VLLMValidationError(f"Token id {max(bad)} is out of vocabulary")).as_instanceof_cause()
        return await super().generate(prompt_ids, sampling_params, request_id, **kwargs)


# ------------------------------------------------------------------------------------------ 1. request faults
async def test_a_request_the_replica_refuses_as_invalid_stops_training_instead_of_a_filtered_retry(
        cfg, tokenizer, rollout_server, monkeypatch):
    # a rollout server whose tokenizer is not the policy's sends token ids the policy's model does not have
    url = await rollout_server()
    monkeypatch.setenv("PRORL_SERVERS", url)
    replica = ValidatingReplica(global_steps=2)
    loop = reg.make_loop(cfg, tokenizer, reg.verl_client(cfg, replica))
    out = await loop.run(reg.SP, **reg.row(prompt_ids=(11, 12, VOCAB + 7)))
    prorl = out[-1].extra_fields["prorl"]
    # before: HTTP 502 -> failure_kind llm_backend -> filtered, re-submitted twice, a filtered row, no reason
    assert prorl.get("fatal"), f"a filtered row instead of a stop: {prorl}"
    assert "out of vocabulary" in prorl["fatal"]
    assert f"Token id {VOCAB + 7}" in prorl["fatal"]
    refused = [c for c in replica.calls if c.get("refused")]
    assert len(refused) == 1, f"the invalid request was retried {len(refused)} times"
    assert loop.relay.stats["generate_errors"] == 0 and loop.relay.stats["request_errors"] == 1


def test_the_relay_maps_vllms_request_errors_to_4xx_and_engine_faults_to_a_failover():
    from ray.exceptions import RayTaskError
    from vllm.exceptions import VLLMNotFoundError, VLLMValidationError
    from vllm.v1.engine.exceptions import EngineDeadError

    status = getattr(relay_module, "request_fault_status", lambda e: 502)

    def ray(e):
        return RayTaskError("generate", "tb", e).as_instanceof_cause()

    assert status(ray(VLLMValidationError("Token id 9999 is out of vocabulary"))) == 400
    assert status(VLLMNotFoundError("no such LoRA")) == 404
    # verl's own check (vLLMHttpServer.generate) and SamplingParams' raw errors: vLLM's serving layer says 400
    assert status(ray(ValueError("Prompt length (70) leaves no room to generate"))) == 400
    assert status(ray(TypeError("unexpected keyword argument 'foo'"))) == 400
    # an engine that died, or anything else, is the backend's fault: 502, the rollout server fails over
    assert status(ray(EngineDeadError())) is None
    assert status(RuntimeError("No available servers in load balancer")) is None


def test_the_server_fails_a_job_whose_backend_refuses_the_request_as_configuration():
    from prorl_server.failures import classify
    from prorl_server.llm.client import LLMRequestError

    e = LLMRequestError(400, "Token id 9999 is out of vocabulary")
    assert classify(e, "run", model_acted=True) == "configuration"
    assert classify(RuntimeError("the agent loop failed"), "run") != "configuration"
    # a backend that is busy (429) or slow (408) is not refusing the request: another backend may serve it
    assert classify(LLMRequestError(429, "too many requests"), "run") == "llm_backend"
