"""Every persistent fault stops the trainer with its reason; none spins (issue #32, parts 3 and 4).

Found with verl 0.9.1's real trainer on CPU: a rollout server whose tokenizer loads but is not the policy's made
every turn a vLLM request-validation error, which the relay answered 502: retried as a backend fault, filtered,
evicted, refilled, 0 steps and 1,440 warnings in 6 minutes. Here:

1. the relay answers a request verl's replica refuses as invalid with a 4xx, the rollout server fails the job
   as ``configuration``, and the agent loop stops training with the replica's message (not a filtered row);
2. a fault that filters every group (a handler that refuses every row, a dead backend) trips a circuit breaker
   in the replay buffer (verl) and the TRL rollout, naming the ``failure_kind``, the count and the last error;
   DAPO's group filter stops training after ``max_num_gen_batches`` batches' worth of groups with no mixed
   reward (verl's V1 trainer ignores that setting: 2,672 jobs, 0 steps, no log line), naming the metric and
   its constant value;
3. each rollout server tells the fingerprint of its tokenizer and chat template (``GET /tokenizer``), and the
   verl relay and the TRL rollout refuse a server whose tokenizer is not the policy's (another vocabulary, or
   the same vocabulary with another chat template: base vs instruct), with both fingerprints in the message.

Real: the rollout server (the project's app on loopback), its LLM client, verl's real
``FullyAsyncLLMServerClient`` and balancer, the plugin's relay and agent loop as verl instantiates them. Stand-ins
(from ``test_verl_registration.py``, each says what it stands for): Ray actor handles and verl's vLLM replica
actor; :class:`ValidatingReplica` adds vLLM's input validation to the latter. For the replay buffer: verl's real
``ReplayBufferAsync`` under the plugin's ``ProRLReplayBuffer``, with TransferQueue's KV store and verl's refill
stood in for by :class:`GroupStore` (TransferQueue needs Ray actors).
"""
from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

pytest.importorskip("verl")

_spec = importlib.util.spec_from_file_location("_verl_registration_helpers",
                                               Path(__file__).with_name("test_verl_registration.py"))
reg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reg)
_kv_spec = importlib.util.spec_from_file_location("_prorl_kv_store", Path(__file__).with_name("kv_store.py"))
kv_store = importlib.util.module_from_spec(_kv_spec)  # the shared TransferQueue stand-in
_kv_spec.loader.exec_module(kv_store)
cfg, turns, rollout_server = reg.cfg, reg.turns, reg.rollout_server  # fixtures

from trainer_plugins.verl import relay as relay_module  # noqa: E402


def _err(module: str, name: str) -> type:
    """``module.name``, looked up when a test runs (on code without it, a class nothing raises: the test then
    fails on its own assertion instead of the whole file failing to import)."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return type(f"Missing{name}", (Exception,), {})

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


# ------------------------------------------------------------------------------------------ 2. the breaker (verl)
class Spun(AssertionError):
    """The buffer kept evicting and refilling past the test's budget: the spin the breaker must stop."""


class GroupStore(kv_store.KVStore):
    """Stands in for TransferQueue's KV store (what verl's V1 replay buffer reads with ``kv_list`` /
    ``kv_batch_get`` / ``kv_clear``) and for verl's refill (``PPOTrainer._add_prompts_to_generate``): every
    group the buffer evicts is replaced by a fresh *finished* group from ``make_group`` (what the agent loop
    workers would store), until ``budget`` groups were made, then :class:`Spun` is raised."""

    def __init__(self, make_group, budget: int = 400, n: int = 4) -> None:
        self.make_group, self.budget, self.n = make_group, budget, n
        super().__init__()
        self.made = 0

    def add_groups(self, k: int) -> None:
        for _ in range(k):
            if self.made >= self.budget:
                raise Spun(f"{self.made} groups generated and evicted, and training never stopped")
            uid = f"g{self.made:05d}"
            self.made += 1
            self.tags[uid] = {"is_prompt": True, "status": "finished", "global_steps": 1}
            for s, fields in enumerate(self.make_group(self.made - 1, self.n)):
                self.tags[f"{uid}_{s}_0"] = {"status": "finished", "global_steps": 1}
                self.rows[f"{uid}_{s}_0"] = {"extra_fields": fields}


def row_fields(acc: float = 0.0, failure_kind=None, error=None) -> dict:
    """``extra_fields`` of one stored row as ``ProRLAgentLoop.to_outputs`` writes it."""
    filtered = failure_kind is not None
    return {"reward_extra_info": {"acc": acc, "score": acc}, "min_global_steps": 1, "max_global_steps": 1,
            "prorl": {"filter": filtered, "failure_kind": failure_kind, "error": error, "truncated": None}}


@pytest.fixture
def group_buffer(monkeypatch):
    """``group_buffer(make_group, **sampler_kwargs)`` -> (ProRLReplayBuffer as verl builds it, its GroupStore)."""
    import transfer_queue as tq

    from trainer_plugins.verl.replay_buffer import ProRLReplayBuffer

    def make(make_group, initial: int = 8, **sampler_kwargs):
        store = GroupStore(make_group)
        store.install(monkeypatch, tq)
        buf = ProRLReplayBuffer(trainer_mode="colocate_async", trainer_config={}, max_off_policy_threshold=None,
                                max_off_policy_strategy="drop", sampler_kwargs=sampler_kwargs,
                                refill_fn=store.add_groups, poll_interval=0.0)
        store.add_groups(initial)
        return buf, store

    return make


def test_a_handler_that_fails_every_row_stops_verl_training_with_its_kind_and_last_error(group_buffer):
    def failing(i, n):  # every sample filtered: the rollout server's backend is gone
        return [row_fields(failure_kind="llm_backend", error=f"job {i}.{s}: LLM call failed 3 times; last: "
                           "http://10.0.0.7:8000: connection refused") for s in range(n)]

    buf, store = group_buffer(failing, filter_groups_enable=False)
    with pytest.raises(_err("trainer_plugins.breaker", "PersistentFaultError")) as e:
        buf.sample(1, "train", 4)
    message = str(e.value)
    assert "failure_kind='llm_backend'" in message and "8 prompt groups in a row" in message, message
    assert "connection refused" in message and "http://10.0.0.7:8000" in message  # the last error
    assert store.made <= 16, f"{store.made} groups generated before the stop"


def test_occasional_filtered_groups_train_and_a_mostly_failing_window_stops(group_buffer):
    from trainer_plugins.breaker import FaultBreaker, PersistentFaultError, Sample

    # every third group loses one sample to a dead sandbox: a fault that passes, training goes on
    def flaky(i, n):
        return [row_fields(acc=float(s % 2), failure_kind="sandbox" if (i % 3 == 0 and s == 0) else None,
                           error="sandbox died") for s in range(n)]

    buf, store = group_buffer(flaky, initial=12, filter_groups_enable=False)
    batch, _ = buf.sample(1, "train", 4)
    assert len({k.split("_")[0] for k in batch.keys}) == 4
    # the share rule on its own (the rule of groups in a row off): 15 of 16 groups' samples filtered, 1 clean
    b = FaultBreaker(consecutive=0, window=64, max_share=0.9)
    with pytest.raises(PersistentFaultError, match=r"60 of the last 64 samples were filtered for failure_kind='timeout'"):
        for i in range(40):
            b.record_group([Sample("timeout", "job ran out of time")] * 4 if i % 16 else [Sample()] * 4)
    # cancelled samples are the trainer's own decision: they never trip it
    b = FaultBreaker(consecutive=2, window=0)
    for _ in range(10):
        b.record_group([Sample("cancelled", "stale")] * 4)


def test_a_dapo_filter_that_never_passes_stops_naming_the_metric_and_its_value(group_buffer):
    def all_wrong(i, n):  # every sample of every group scores acc 0: no group has a learning signal
        return [row_fields(acc=0.0) for _ in range(n)]

    buf, store = group_buffer(all_wrong, filter_groups_enable=True, filter_groups_metric="acc",
                              filter_groups_max_num_gen_batches=3, train_batch_size=4)
    with pytest.raises(_err("trainer_plugins.verl.replay_buffer", "DapoFilterExhausted")) as e:
        buf.sample(1, "train", 4)
    message = str(e.value)
    dropped = int(re.search(r"dropped (\d+) prompt groups", message).group(1))
    assert "metric 'acc'" in message and f"{{0.0: {dropped}}}" in message and "max_num_gen_batches=3" in message
    assert 3 * 4 <= dropped <= store.made <= 3 * 4 + 8, (dropped, store.made)  # stopped at the cap, not later


def test_dapo_groups_with_mixed_rewards_still_train_and_reset_the_cap(group_buffer):
    def half(i, n):  # groups alternate: all-zero (dropped by DAPO) and mixed (trained)
        return [row_fields(acc=float(s % 2) if i % 2 else 0.0) for s in range(n)]

    buf, store = group_buffer(half, initial=8, filter_groups_enable=True, filter_groups_metric="acc",
                              filter_groups_max_num_gen_batches=1, train_batch_size=4)
    for step in range(1, 4):  # as many groups dropped as trained per step: the cap's 4 is reached, with a batch
        if step > 1:
            store.add_groups(8)  # the next step's rollouts (verl's workers keep generating)
        batch, metrics = buf.sample(step, "train", 4)
        assert len({k.split("_")[0] for k in batch.keys}) == 4


# ------------------------------------------------------------------------------------------ 2. the breaker (TRL)
async def test_a_handler_that_fails_every_row_stops_trl_training_with_its_kind_and_last_error(start_llm_server,
                                                                                              fixed, tokenizer):
    import asyncio

    from trainer_plugins.trl import ProRLRollout

    trl_tests = importlib.util.module_from_spec(spec := importlib.util.spec_from_file_location(
        "_trl_rollout_helpers", Path(__file__).with_name("test_trl_rollout.py")))
    spec.loader.exec_module(trl_tests)
    url = await start_llm_server()
    # the real rollout server; every job's sandbox dies before the model acts (FixedTrajectoryHandler's fault
    # injection): failure_kind sandbox, filter true, on every attempt
    instances = [trl_tests.fixed_instance(name, fail_first=10 ** 6) for name in "abcd"]
    rollout = ProRLRollout([url], instances, max_sample_retries=0)
    prompts = [f"say {name}" for name in "abcd" for _ in range(2)]  # 4 groups of 2 a call
    calls = 0
    try:
        with pytest.raises(_err("trainer_plugins.breaker", "PersistentFaultError")) as e:
            for step in range(6):  # before: 6 steps of rows TRL cannot learn from, and no error
                calls += 1
                await asyncio.to_thread(rollout, prompts, trl_tests.make_trainer(2, step=step, tokenizer=tokenizer))
    finally:
        rollout.close()
    message = str(e.value)
    assert "failure_kind='sandbox'" in message and "8 prompt groups in a row" in message, message
    assert "injected: the sandbox of job" in message  # the last error, as the server gave it
    assert calls == 2  # the second call's groups reached 8


# ------------------------------------------------------------------------------------------ 3. tokenizer handshake
@pytest.fixture(scope="module")
def other_tokenizers(tiny_model_dir, tmp_path_factory):
    """Tokenizer directories that load but are not the policy's (the tiny model's): ``template``: the same
    vocabulary with a base model's chat template (no roles, no generation prompt); ``vocab``: one token added."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("tokenizers")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    tok.save_pretrained(root / "template")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.add_tokens(["<not_in_the_policy>"])
    tok.save_pretrained(root / "vocab")
    return {"template": str(root / "template"), "vocab": str(root / "vocab")}


async def test_the_server_tells_the_fingerprint_of_the_tokenizer_its_jobs_use(rollout_server, tokenizer,
                                                                            tiny_model_dir, other_tokenizers):
    import aiohttp

    from prorl_server.types import TokenizerFingerprint

    same, other = await rollout_server(tokenizer=str(tiny_model_dir)), await rollout_server(
        tokenizer=other_tokenizers["template"])
    async with aiohttp.ClientSession() as s:
        answers = []
        for url in (same, other):
            async with s.get(f"{url}/tokenizer") as r:
                assert r.status == 200, await r.text()
                answers.append(await r.json())
        async with s.get(f"{same}/tokenizer", params={"backend": "http://127.0.0.1:9"}) as r:
            assert r.status == 404 and "unknown_backend" in await r.text()
    policy = TokenizerFingerprint.of(tokenizer)
    assert TokenizerFingerprint.model_validate(answers[0]["fingerprint"]) == policy
    theirs = TokenizerFingerprint.model_validate(answers[1]["fingerprint"])
    assert policy.differences(theirs) == ["chat template"]  # same vocabulary, other template
    assert answers[1]["name"] == other_tokenizers["template"]


@pytest.mark.parametrize("other,differs", [("template", "chat template"), ("vocab", "vocabulary")])
async def test_the_relay_refuses_a_rollout_server_whose_tokenizer_is_not_the_policys(
        other, differs, cfg, tokenizer, rollout_server, other_tokenizers, monkeypatch):
    url = await rollout_server(tokenizer=other_tokenizers[other])
    monkeypatch.setenv("PRORL_SERVERS", url)
    loop = reg.make_loop(cfg, tokenizer, reg.verl_client(cfg, reg.ScriptedReplica(global_steps=1)))
    out = await loop.run(reg.SP, **reg.row())
    fatal = out[-1].extra_fields["prorl"].get("fatal")
    # before: the jobs ran and were trained on, tokenized and rendered by a tokenizer that is not the policy's
    assert fatal, f"trained with a tokenizer that is not the policy's: {out[-1].extra_fields['prorl']}"
    assert f"the {differs} differ" in fatal and "RelayError" in fatal and url in fatal, fatal
    assert "Policy: vocab 4096 tokens" in fatal and f"Server: vocab {4097 if other == 'vocab' else 4096} tokens" in fatal
    assert "--tokenizer" in fatal  # the fix


async def test_with_external_backends_the_agent_loop_refuses_a_server_whose_tokenizer_is_not_the_policys(
        cfg, tokenizer, rollout_server, other_tokenizers, monkeypatch):
    url = await rollout_server(tokenizer=other_tokenizers["template"])
    monkeypatch.setenv("PRORL_SERVERS", url)
    loop = reg.make_loop(cfg, tokenizer, None, backends="external")
    out = await loop.run(reg.SP, **reg.row())
    fatal = out[-1].extra_fields["prorl"].get("fatal")
    assert fatal and "TokenizerMismatchError" in fatal and "the chat template differ" in fatal, \
        out[-1].extra_fields["prorl"]


async def test_the_trl_rollout_refuses_a_rollout_server_whose_chat_template_is_not_the_policys(
        start_llm_server, tokenizer, other_tokenizers):
    import asyncio

    from trainer_plugins.trl import ProRLRollout

    trl_tests = importlib.util.module_from_spec(spec := importlib.util.spec_from_file_location(
        "_trl_rollout_helpers", Path(__file__).with_name("test_trl_rollout.py")))
    spec.loader.exec_module(trl_tests)
    url = await start_llm_server(tokenizer=other_tokenizers["template"])
    rollout = ProRLRollout([url], [trl_tests.fixed_instance("a")], max_sample_retries=0)
    try:
        with pytest.raises(_err("trainer_plugins.tokenizer_check", "TokenizerMismatchError"),
                           match=r"the chat template differ.*Policy: vocab 4096.*Server: vocab 4096"):
            await asyncio.to_thread(rollout, ["say a", "say a"], trl_tests.make_trainer(2, tokenizer=tokenizer))
    finally:
        rollout.close()
