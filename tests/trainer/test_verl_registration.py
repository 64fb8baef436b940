"""The trainer's own inference servers serve the rollouts, with exact weight versions:
the verl plugin's per-worker relay (``trainer_plugins/verl/relay.py``) on top of verl's REAL
``FullyAsyncLLMServerClient`` and ``GlobalRequestLoadBalancer`` (the client ``colocate_async`` gives its agent
loops), registered with REAL rollout servers (the project's aiohttp app on loopback), driven through the
agent loop exactly as verl instantiates it.

What cannot run here is stood in for, and each stand-in says so: Ray actor handles (:class:`LocalActor`) and
verl's vLLM replica actor, which needs a GPU (:class:`ScriptedReplica` in the fast tier; :class:`VLLMReplica`,
the real tiny vLLM CPU server behind the same actor interface, in the real tier). A weight update is what
``PPOTrainerColocateAsync`` does to every replica: ``abort_all_requests``, ``set_global_steps(step)``,
``resume_generation``.
"""
from __future__ import annotations

import asyncio
from typing import Any, Optional

import aiohttp
import numpy as np
import pytest

pytest.importorskip("verl")
from hydra.utils import instantiate  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl.experimental.agent_loop import agent_loop as verl_agent_loop  # noqa: E402
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap  # noqa: E402
from verl.utils.dataset.rl_dataset import RLHFDataset  # noqa: E402
from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient  # noqa: E402
from verl.workers.rollout.replica import TokenOutput  # noqa: E402
from verl.workers.rollout.router import GlobalRequestLoadBalancer  # noqa: E402

from prorl_server.plugin.handler import AgentHandler  # noqa: E402
from prorl_server.types import Trajectory  # noqa: E402
from trainer_plugins.client import BackendUnreachableError, register_backends  # noqa: E402
from trainer_plugins.verl import CONFIG_DIR  # noqa: E402
from trainer_plugins.verl.relay import RelayError, close_relays  # noqa: E402

PROMPT_LEN, RESPONSE_LEN = 64, 16


# ------------------------------------------------------------------------------------------ stand-ins
class LocalActor:
    """Stands in for a Ray actor handle (``handle.method.remote(...)`` -> awaitable) around a local object, so
    verl's real client and balancer run without a Ray cluster. A synchronous method runs at once (verl's
    fire-and-forget ``release_server.remote`` is never awaited)."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def __getattr__(self, name: str):
        method = getattr(self._obj, name)

        class _Remote:
            @staticmethod
            def remote(*args, **kwargs):
                if asyncio.iscoroutinefunction(method):
                    return asyncio.ensure_future(method(*args, **kwargs))
                fut = asyncio.get_running_loop().create_future()
                fut.set_result(method(*args, **kwargs))
                return fut

        return _Remote


class ScriptedReplica:
    """Stands in for verl's ``vLLMHttpServer`` replica actor (a GPU vLLM engine): the same ``generate``
    signature and ``TokenOutput`` (``extra_fields["global_steps"]``: the version ``set_global_steps`` set),
    and the same submission gate: ``abort_all_requests`` ends in-flight turns as ``"aborted"`` with the
    tokens generated so far and parks new ones until ``resume_generation``. Tokens are a deterministic
    function of the context; ``hold_after=k`` parks every turn after its k-th token until ``release``."""

    def __init__(self, global_steps: Optional[int] = 1) -> None:
        self.global_steps = global_steps
        self.paused = False
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.abort_epoch = 0
        self.hold_after: Optional[int] = None
        self.held = asyncio.Event()
        self.release = asyncio.Event()
        self.calls: list[dict] = []
        self.inflight = 0

    @staticmethod
    def token(context: list[int]) -> int:
        return (sum(context) * 31 + len(context)) % 3000 + 500

    async def generate(self, prompt_ids, sampling_params, request_id, **kwargs) -> TokenOutput:
        while self.paused:  # vLLMHttpServer._park_until_admitted
            await self.resumed.wait()
        self.calls.append({"request_id": request_id, "prompt_len": len(prompt_ids), **sampling_params})
        epoch, ids = self.abort_epoch, []
        self.inflight += 1
        try:
            for _ in range(int(sampling_params["max_tokens"])):
                if self.hold_after is not None and len(ids) == self.hold_after:
                    self.held.set()
                    await self.release.wait()
                if self.abort_epoch != epoch:
                    return self._out(ids, "aborted", sampling_params)
                ids.append(self.token(list(prompt_ids) + ids))
                await asyncio.sleep(0)
            return self._out(ids, "completed", sampling_params)
        finally:
            self.inflight -= 1

    def _out(self, ids, stop_reason, sp) -> TokenOutput:
        lps = [-0.25 - 0.001 * t for t in ids] if sp.get("logprobs") else None
        return TokenOutput(token_ids=ids, log_probs=lps, stop_reason=stop_reason,
                           extra_fields={"global_steps": self.global_steps})

    # the trainer's weight update, as PPOTrainerColocateAsync drives it through the checkpoint manager
    async def abort_all_requests(self, **kwargs) -> dict:
        self.paused = True
        self.resumed.clear()
        self.abort_epoch += 1
        self.release.set()
        while self.inflight:  # like vLLM's pause_generation: returns once in-flight turns have ended
            await asyncio.sleep(0)
        return {"aborted_count": 0}

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def resume_generation(self) -> None:
        self.hold_after = None
        self.release.clear()
        self.held.clear()
        self.paused = False
        self.resumed.set()

    async def update_weights(self, step: int) -> None:
        await self.abort_all_requests()
        await self.set_global_steps(step)
        await self.resume_generation()


class VLLMReplica(ScriptedReplica):
    """Stands in for verl's ``vLLMHttpServer`` with the REAL tiny vLLM CPU server behind it: a turn is one
    token-in ``/v1/completions`` call (as ``vLLMHttpServer.generate`` runs ``engine.generate``); the version is
    still the one ``set_global_steps`` set (the CPU engine's weights are not updated here)."""

    def __init__(self, address: str, model: str, global_steps: int = 1) -> None:
        super().__init__(global_steps)
        self.address, self.model = address, model

    async def generate(self, prompt_ids, sampling_params, request_id, **kwargs) -> TokenOutput:
        while self.paused:
            await self.resumed.wait()
        sp = dict(sampling_params)
        body = {"model": self.model, "prompt": list(prompt_ids), "max_tokens": sp.pop("max_tokens"),
                "logprobs": 0 if sp.pop("logprobs", False) else None, "return_token_ids": True, **sp}
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{self.address}/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                choice = (await r.json())["choices"][0]
        lps = choice["logprobs"]["token_logprobs"] if choice.get("logprobs") else None
        return TokenOutput(token_ids=choice["token_ids"], log_probs=lps, stop_reason="completed",
                           extra_fields={"global_steps": self.global_steps})


class TurnsHandler(AgentHandler):
    """Stands in for a multi-turn LLM handler without sandbox tools: ``turns`` generation turns on the job's
    backend through the server's real LLM client (token ids in and out, 4 tokens a turn), one trajectory
    segment per turn carrying the versions the client recorded for it. ``gates[k]`` (an event the test sets)
    is awaited before turn k, so a test can update the weights between turns."""

    name = "turns"
    needs_llm = True

    def __init__(self) -> None:
        self.gates: dict[int, asyncio.Event] = {}
        self.reached: dict[int, asyncio.Event] = {}

    async def run(self, job):
        context = list(job.instance["prompt_ids"])
        for k in range(int(job.instance.get("turns", 1))):
            self.reached.setdefault(k, asyncio.Event()).set()
            if k in self.gates:
                await self.gates[k].wait()
            comp = await job.llm.client.complete(context, backend=job, max_tokens=4,
                                                 sampling_params={"temperature": 1.0})
            job.trajectories.append(Trajectory(
                prompt_ids=list(context), response_ids=comp.token_ids, response_logprobs=comp.logprobs,
                loss_mask=[1] * len(comp.token_ids), num_turns=1, weight_versions=comp.weight_versions))
            context += comp.token_ids

    async def eval(self, job):
        job.reward, job.resolved = 1.0, True


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture
def cfg(compose_verl):
    return compose_verl(prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN)


@pytest.fixture
def turns():
    return TurnsHandler()


@pytest.fixture
async def rollout_server(serve_handlers, turns):
    """``await rollout_server(backends=(), **settings)`` -> base URL of a real rollout server (``turns``)."""

    async def start(backends=(), **settings):
        return await serve_handlers(turns, backends=backends, **settings)

    yield start
    await close_relays()


class RecordingBalancer(GlobalRequestLoadBalancer):
    """verl's real global balancer, recording the ``request_id`` of every acquire (its sticky key)."""

    def __init__(self, servers) -> None:
        super().__init__(servers)
        self.request_ids: list[str] = []

    def acquire_server(self, request_id: str):
        self.request_ids.append(request_id)
        return super().acquire_server(request_id)


def verl_client(cfg, *replicas) -> FullyAsyncLLMServerClient:
    """verl's real client over its real global balancer, as ``PPOTrainerColocateAsync.get_llm_client``."""
    lb = RecordingBalancer({f"replica-{i}": LocalActor(r) for i, r in enumerate(replicas)})
    client = FullyAsyncLLMServerClient(cfg, load_balancer_handle=LocalActor(lb))
    client.balancer = lb
    return client


def make_loop(cfg, tokenizer, server_manager, **settings):
    """The YAML entry instantiated exactly as ``AgentLoopWorker._run_agent_loop`` does (relay on loopback)."""
    entry = OmegaConf.load(CONFIG_DIR / "agent_loop.yaml")[0]
    verl_agent_loop._agent_loop_registry["prorl"] = entry
    settings.setdefault("relay_host", "127.0.0.1")
    return instantiate(config=entry, trainer_config=DictConfigWrap(config=cfg), server_manager=server_manager,
                       tokenizer=tokenizer, processor=None, hf_model_type="qwen2", dataset_cls=RLHFDataset,
                       data_config=DictConfigWrap(cfg.data), tools=ToolListWrap([]), **settings)


def row(turns=1, prompt_ids=(11, 12, 13, 14), index=3):
    return {"raw_prompt": np.array([{"role": "user", "content": "hi"}], dtype=object), "data_source": "turns",
            "extra_info": {"index": index, "instance": {"data_source": "turns", "turns": turns,
                                                        "prompt_ids": list(prompt_ids)}},
            "index": index, "global_steps": 99, "session_id": 0}  # session_id: V1's worker (a list back)


SP = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}


async def backends_of(url: str) -> dict[str, Optional[int]]:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/status") as r:
            return {b["address"]: b["weight_version"] for b in (await r.json())["backends"]}


async def reached(turns: TurnsHandler, k: int, task: asyncio.Task, timeout_s: float = 120.0) -> None:
    """Wait until the job reaches turn ``k``; a job that failed first raises its error here."""
    ev = asyncio.ensure_future(turns.reached.setdefault(k, asyncio.Event()).wait())
    done, _ = await asyncio.wait({ev, task}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        ev.cancel()
        task.result()
        raise AssertionError(f"the job ended before turn {k}")
    assert ev in done, f"turn {k} not reached in {timeout_s} s"


async def until(predicate, timeout_s=20.0):
    """Wait (not a timed assertion: the bound only stops a hang) until ``await predicate()`` is truthy."""
    async def poll():
        while not await predicate():
            await asyncio.sleep(0.02)
    await asyncio.wait_for(poll(), timeout_s)


# ------------------------------------------------------------------------------------------ tests
async def test_relay_registers_with_every_rollout_server_at_the_replicas_version(cfg, tokenizer, rollout_server,
                                                                                monkeypatch):
    urls = [await rollout_server(), await rollout_server()]
    monkeypatch.setenv("PRORL_SERVERS", ",".join(urls))
    replica = ScriptedReplica(global_steps=5)
    client = verl_client(cfg, replica)
    loop = make_loop(cfg, tokenizer, client)
    assert loop.managed
    outs = [(await loop.run(SP, **row(index=i)))[-1] for i in range(2)]
    relay = loop.relay
    for url in urls:
        assert await backends_of(url) == {relay.address: 5}  # registered, with the replicas' version
    for out in outs:
        assert out.response_ids and out.response_mask == [1] * len(out.response_ids)
        assert (out.extra_fields["min_global_steps"], out.extra_fields["max_global_steps"]) == (5, 5)
        # the tokens and logprobs are the replica's: the relay passed verl's TokenOutput through unchanged
        ctx = [11, 12, 13, 14]
        expected = []
        for _ in range(4):
            expected.append(ScriptedReplica.token(ctx + expected))
        assert out.response_ids == expected
        assert out.response_logprobs == pytest.approx([-0.25 - 0.001 * t for t in expected])
    # every turn went through verl's generate with logprobs, the job's max_tokens, and a sticky request id
    assert all(c["logprobs"] and c["max_tokens"] == 4 for c in replica.calls[1:])
    # both jobs have one prompt: one sticky key at verl's balancer, so one replica and its prefix cache
    assert len(set(client.balancer.request_ids[1:])) == 1 and len(client.balancer.request_ids) == 3


async def test_weight_update_between_turns_bumps_the_version_of_the_next_turns(cfg, tokenizer, rollout_server,
                                                                              turns, monkeypatch):
    url = await rollout_server()
    monkeypatch.setenv("PRORL_SERVERS", url)
    replica = ScriptedReplica(global_steps=1)
    loop = make_loop(cfg, tokenizer, verl_client(cfg, replica))
    turns.gates[1] = asyncio.Event()
    task = asyncio.ensure_future(loop.run(SP, **row(turns=3)))
    await reached(turns, 1, task)
    await replica.update_weights(2)  # the trainer's step: abort, set_global_steps(2), resume
    turns.gates[1].set()
    outs = await asyncio.wait_for(task, 30)  # one output per turn (TurnsHandler's segments), as V1 takes them
    assert [(o.extra_fields["min_global_steps"], o.extra_fields["max_global_steps"]) for o in outs] == [
        (1, 1), (2, 2), (2, 2)]
    # the job's next turns report the new version; the relay re-registered itself with it
    await until(lambda: _eq(backends_of(url), {loop.relay.address: 2}))
    assert loop.relay.version == 2 and loop.relay.stats["version_changes"] == 1


async def _eq(coro, value) -> bool:
    return await coro == value


async def test_turn_interrupted_by_an_update_is_resumed_and_reports_both_versions(cfg, tokenizer, rollout_server,
                                                                                  monkeypatch):
    url = await rollout_server()
    monkeypatch.setenv("PRORL_SERVERS", url)
    replica = ScriptedReplica(global_steps=1)
    loop = make_loop(cfg, tokenizer, verl_client(cfg, replica))
    await loop.run(SP, **row())  # starts the relay
    replica.hold_after = 2
    prompt = [7, 8, 9]
    async with aiohttp.ClientSession() as s:
        req = asyncio.ensure_future(s.post(f"{loop.relay.address}/v1/completions",
                                           json={"prompt": prompt, "max_tokens": 6, "temperature": 1.0}))
        await asyncio.wait_for(replica.held.wait(), 30)
        await replica.update_weights(2)  # aborts the turn after 2 tokens; FullyAsync resumes it at v2
        r = await asyncio.wait_for(req, 30)
        data = await r.json()
    assert r.status == 200, data
    choice = data["choices"][0]
    expected = []
    for _ in range(6):
        expected.append(ScriptedReplica.token(prompt + expected))
    assert choice["token_ids"] == expected and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["token_logprobs"]) == 6
    # tokens from two versions: the oldest is the turn's version, both are listed
    assert data["weight_version"] == 1 and data["weight_versions"] == [1, 2]


async def test_relay_answers_the_completions_subset_and_refuses_what_it_cannot_serve(cfg, tokenizer,
                                                                                    rollout_server, monkeypatch):
    url = await rollout_server()
    monkeypatch.setenv("PRORL_SERVERS", url)
    loop = make_loop(cfg, tokenizer, verl_client(cfg, ScriptedReplica()))
    await loop.run(SP, **row())
    base = loop.relay.address
    max_len = PROMPT_LEN + RESPONSE_LEN
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{base}/v1/models") as r:
            card = (await r.json())["data"][0]
        assert card["max_model_len"] == max_len and card["id"] == str(cfg.actor_rollout_ref.model.path)
        for body, needle in [({"prompt": "text", "max_tokens": 2}, "token ids"),
                             ({"prompt": [], "max_tokens": 2}, "token ids"),
                             ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
                             ({"prompt": [1, 2], "max_tokens": 2, "n": 2}, "n=1"),
                             ({"prompt": [1, 2], "max_tokens": 2, "stream": True}, "stream"),
                             ({"prompt": [1] * max_len, "max_tokens": 2}, "maximum context length")]:
            async with s.post(f"{base}/v1/completions", json=body) as r:
                err = await r.json()
            assert r.status == 400 and needle in err["error"]["message"], (body, err)
        # max_tokens is capped by the room left in the context
        async with s.post(f"{base}/v1/completions", json={"prompt": [1] * (max_len - 3), "max_tokens": 10}) as r:
            data = await r.json()
        assert len(data["choices"][0]["token_ids"]) == 3 and data["choices"][0]["finish_reason"] == "length"


async def test_a_missing_weight_version_is_an_error_not_a_fallback(cfg, tokenizer, rollout_server, monkeypatch):
    url = await rollout_server()
    monkeypatch.setenv("PRORL_SERVERS", url)
    replica = ScriptedReplica(global_steps=None)  # a trainer that never called update_weights(global_steps)
    loop = make_loop(cfg, tokenizer, verl_client(cfg, replica))
    with pytest.raises(RelayError, match="no weight version"):
        await loop.run_row(SP, **row())  # the error itself (V1's run returns it as a fatal row)
    assert await backends_of(url) == {}  # nothing was registered
    # a relay that has a version refuses a turn verl returns without one (HTTP 500), never guesses
    replica.global_steps = 3
    await loop.run(SP, **row())
    replica.global_steps = None
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{loop.relay.address}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}) as r:
            assert r.status == 500 and "no weight version" in (await r.json())["error"]["message"]
    # and the row of a job whose tokens carry no version is refused rather than tagged with global_steps
    result = {"job_id": "j", "trajectory_id": "j", "handler": "fixed", "reward": 1.0, "trajectories": [
        {"prompt_ids": [1, 2], "response_ids": [3, 4], "loss_mask": [1, 1], "response_logprobs": [-1.0, -1.0]}]}
    with pytest.raises(ValueError, match="no weight version"):
        await loop.to_outputs(result, row())
    # a failed job generated nothing: its zero-loss row carries the weights current when it ended
    (out,) = await loop.to_outputs({"job_id": "f", "trajectory_id": "f", "handler": "fixed", "reward": 0.0,
                                    "critical_error": "run", "trajectories": []}, row())
    assert not any(out.response_mask) and out.extra_fields["min_global_steps"] == 3


async def test_registering_an_unreachable_server_is_a_clear_error(cfg, tokenizer, rollout_server, unused_tcp_port,
                                                                 monkeypatch):
    dead = f"http://127.0.0.1:{unused_tcp_port}"
    # a rollout server that does not answer
    monkeypatch.setenv("PRORL_SERVERS", dead)
    loop = make_loop(cfg, tokenizer, verl_client(cfg, ScriptedReplica()))
    with pytest.raises(RelayError, match=f"rollout server {dead} is unreachable"):
        await loop.run_row(SP, **row())  # the error itself (V1's run returns it as a fatal row)
    # an LLM backend that does not answer is not registered
    url = await rollout_server()
    async with aiohttp.ClientSession() as s:
        with pytest.raises(BackendUnreachableError, match=f"LLM backend {dead} is unreachable"):
            await register_backends(s, url, [dead], 4, clear=False, probe_timeout_s=5)
    assert await backends_of(url) == {}
    # a relay whose advertised address the rollout servers cannot reach is refused the same way
    monkeypatch.setenv("PRORL_SERVERS", url)
    from trainer_plugins.verl import relay as relay_mod

    monkeypatch.setattr(relay_mod.Relay, "address", property(lambda self: dead))
    loop = make_loop(cfg, tokenizer, verl_client(cfg, ScriptedReplica()))
    with pytest.raises(RelayError, match=f"LLM backend {dead} is unreachable"):
        await loop.run_row(SP, **row())  # the error itself (V1's run returns it as a fatal row)
    assert await backends_of(url) == {}


async def test_a_rollout_server_with_an_unversioned_backend_is_refused(cfg, tokenizer, rollout_server,
                                                                      unused_tcp_port, monkeypatch):
    # a server started with a vLLM of its own registered without a version (what the launcher used to do)
    url = await rollout_server(backends=[f"http://127.0.0.1:{unused_tcp_port}"])
    monkeypatch.setenv("PRORL_SERVERS", url)
    loop = make_loop(cfg, tokenizer, verl_client(cfg, ScriptedReplica()))
    with pytest.raises(RelayError, match="no weight version.*--no-vllm"):
        await loop.run_row(SP, **row())  # the error itself (V1's run returns it as a fatal row)


async def test_external_backends_keep_the_rollout_servers_own(cfg, tokenizer, rollout_server, monkeypatch):
    monkeypatch.setenv("PRORL_SERVERS", await rollout_server())
    loop = make_loop(cfg, tokenizer, verl_client(cfg, ScriptedReplica()), backends="external")
    assert not loop.managed and loop.relay is None
    with pytest.raises(Exception, match="backends must be"):
        make_loop(cfg, tokenizer, None, backends="vllm")


@pytest.mark.real
async def test_real_vllm_turns_through_verls_client_and_the_relay_carry_exact_versions(
        cfg, tokenizer, rollout_server, turns, vllm_server, tiny_model_dir, monkeypatch):
    url = await rollout_server()
    monkeypatch.setenv("PRORL_SERVERS", url)
    replica = VLLMReplica(vllm_server.address, str(tiny_model_dir), global_steps=1)
    loop = make_loop(cfg, tokenizer, verl_client(cfg, replica))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Count to ten."}],
                                           add_generation_prompt=True, return_dict=False)
    turns.gates[1] = asyncio.Event()
    task = asyncio.ensure_future(loop.run(SP, **row(turns=2, prompt_ids=prompt)))
    await reached(turns, 1, task)
    await replica.update_weights(2)
    turns.gates[1].set()
    outs = await asyncio.wait_for(task, 120)
    assert [(o.extra_fields["min_global_steps"], o.extra_fields["max_global_steps"]) for o in outs] == [
        (1, 1), (2, 2)]
    assert all(o.response_logprobs and all(lp <= 0 for lp in o.response_logprobs) for o in outs)
    await until(lambda: _eq(backends_of(url), {loop.relay.address: 2}))
    # the relay's logprobs are the real model's: a greedy turn through it equals one straight to vLLM
    async with aiohttp.ClientSession() as s:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0.0}
        async with s.post(f"{loop.relay.address}/v1/completions", json=body) as r:
            relayed = (await r.json())["choices"][0]
        async with s.post(f"{vllm_server.address}/v1/completions",
                          json={**body, "model": str(tiny_model_dir), "logprobs": 0, "return_token_ids": True}) as r:
            direct = (await r.json())["choices"][0]
    assert relayed["token_ids"] == direct["token_ids"]
    assert relayed["logprobs"]["token_logprobs"] == pytest.approx(direct["logprobs"]["token_logprobs"], abs=1e-5)


async def test_the_relay_registers_with_a_fleet_member_that_joins_later(cfg, tokenizer, rollout_server, monkeypatch,
                                                                        tmp_path):
    from prorl_server.membership import Membership
    from trainer_plugins.fleet import open_fleet

    a, b = await rollout_server(), await rollout_server()
    ma = Membership(tmp_path, url=a, host="127.0.0.1", port=int(a.rsplit(":", 1)[1]), ttl_s=2)
    mb = Membership(tmp_path, url=b, host="127.0.0.1", port=int(b.rsplit(":", 1)[1]), ttl_s=2)
    await ma.start()
    monkeypatch.setenv("PRORL_SERVERS", str(tmp_path))  # prorl.servers names the fleet directory
    loop = make_loop(cfg, tokenizer, verl_client(cfg, ScriptedReplica(global_steps=5)))
    try:
        await loop.run(SP, **row())
        relay = loop.relay
        assert await backends_of(a) == {relay.address: 5}
        assert await backends_of(b) == {}
        await mb.start()  # joins after the relay registered: its heartbeat (30 s) knew only the first member
        await until(lambda: _has(b, relay.address, 5), timeout_s=10)
        outs = [(await loop.run(SP, **row(index=i)))[-1] for i in range(4)]  # jobs now run on both
        assert all((o.extra_fields["min_global_steps"], o.extra_fields["max_global_steps"]) == (5, 5) for o in outs)
    finally:
        await ma.close()
        await mb.close()
        open_fleet(tmp_path).close()


async def _has(url: str, address: str, version: int) -> bool:
    return (await backends_of(url)).get(address) == version
