"""Weight swaps on a rollout server: the trainer clears and re-registers its
inference servers with a new ``weight_version`` after every update. A re-added address is the same backend:
jobs holding it see the new version on their next turn, in-flight counts survive, jobs submitted during the
swap wait for it, and every generated turn carries the version that produced it.

The fast tests run the server's real agent loop, LLM client and conversation with the tiny model's tokenizer
against a small aiohttp app standing for vLLM's ``/v1/completions`` (or for a trainer's per-worker relay that
reports ``weight_version`` in its answers); the real-tier test uses the real vLLM CPU server.
"""
from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from prorl_server.plugin.handler import AgentHandler
from prorl_server.llm.agent_loop import AgentConfig, AgentLoop
from prorl_server.balancer import Backend, BackendPool, NoBackendError
from prorl_server.llm.client import LLMClient
from prorl_server.llm.tool_parser import ParsedTurn, ToolCall

START = [{"role": "system", "content": "You are a test agent."}, {"role": "user", "content": "Echo things."}]


class EveryTurnCallsEcho:
    """Tool parser standing for a model that calls ``echo`` every turn (the random tiny model, and the
    scripted stand-in for vLLM, write no tool-call syntax of their own)."""

    name = "every-turn-echo"

    def parse(self, text: str) -> ParsedTurn:
        call = ToolCall(name="echo", arguments={"text": text[:24]})
        return ParsedTurn(content=text, calls=[call], items=[call], raw=text)


class SwapAgentHandler(AgentHandler):
    """Stands for an LLM task handler (math, code): the server's real agent loop on the job's sticky backend,
    with one tool, ``echo``, whose first call waits until the test has swapped the weights (``resume``), so
    the swap lands exactly between turn 1 and turn 2. ``instance["turns"]`` turns (default 3)."""

    name = "swap_agent"
    needs_llm = True

    def __init__(self) -> None:
        self.in_tool = asyncio.Event()
        self.resume = asyncio.Event()

    async def run(self, job):
        async def echo(args):
            if not self.in_tool.is_set():
                self.in_tool.set()
                await self.resume.wait()
            return "echo: " + args.get("text", "")

        tools = {"echo": ({"type": "object", "properties": {"text": {"type": "string"}}}, echo)}
        tokenizer = await job.llm.tokenizer(await job.backend())
        loop = AgentLoop(tokenizer, job.llm.client, tools,
                         AgentConfig(max_turns=job.instance.get("turns", 3), parser=EveryTurnCallsEcho(),
                                     max_context_tokens=1024))
        result = await loop.run(START, backend=job, sampling_params=job.sampling_params)
        result.apply_to(job)


def fake_vllm(model_id: str, turn_ids: list[int], reported_versions=None):
    """An app standing for vLLM's OpenAI server (``/v1/models``, ``/v1/completions``): every turn generates
    ``turn_ids``. With ``reported_versions`` (a list consumed one per request) it stands for a trainer's relay
    that puts the generating weights' ``weight_version`` in each answer. Returns ``(app, requests_seen)``."""
    seen: list[dict] = []

    async def models(request):
        return web.json_response({"data": [{"id": model_id, "max_model_len": 1024}]})

    async def completions(request):
        seen.append(await request.json())
        answer = {"choices": [{"index": 0, "text": "", "finish_reason": "stop", "stop_reason": None,
                               "token_ids": turn_ids, "logprobs": {"token_logprobs": [-0.25] * len(turn_ids)}}]}
        if reported_versions is not None:
            reported = reported_versions.pop(0)
            if isinstance(reported, dict):  # the relay's full form: {"weight_version", "weight_versions"}
                answer.update(reported)
            else:
                answer["weight_version"] = reported
        return web.json_response(answer)

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    return app, seen


@pytest.fixture
def turn_ids(tokenizer):
    """What the tiny model would generate for one turn: "ok" and ChatML's end of turn."""
    return tokenizer.encode("ok", add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]



async def backends(client) -> list[dict]:
    return (await (await client.get("/status")).json())["backends"]


# ---------------------------------------------------------------------------------------------- the pool


async def test_readded_address_is_the_same_backend_and_its_count_survives_the_swap():
    pool = BackendPool()
    b = pool.add("http://a:1", weight_version=1)
    assert pool.assign("held") is b and b.in_flight == 1
    assert pool.clear() == 1
    assert len(pool) == 0 and pool.backends == [] and b.in_flight == 1
    assert pool.assign("held") is b  # sticky through the clear
    with pytest.raises(NoBackendError):
        pool.assign("new")  # but a cleared backend gets no new job
    assert pool.add("http://a:1/", weight_version=2) is b  # the same object, revived with the new version
    assert (b.weight_version, b.in_flight, pool.backends) == (2, 1, [b])
    assert pool.assign("new") is b and b.in_flight == 2
    assert pool.add("http://a:1", weight_version=3) is b and b.in_flight == 2  # re-add without a clear
    for job in ("held", "new", "held", "new"):
        pool.release(job)  # twice each: idempotent
    assert b.in_flight == 0


async def test_a_job_holding_a_cleared_backend_keeps_it_and_is_counted_once():
    changes: list[tuple[str, int, bool]] = []
    pool = BackendPool(on_change=lambda b: changes.append((b.address, b.in_flight, b.in_rotation)))
    old = pool.add("http://a:1", weight_version=1)
    pool.assign("j")
    pool.clear()
    assert changes[-1] == ("http://a:1", 1, False)  # metrics see it leave the rotation, still loaded
    new = pool.add("http://b:1", weight_version=2)  # the trainer's servers moved to another address
    assert pool.assign("j") is old  # the job keeps its backend until it ends (docs/http-api.md, Pipeline semantics)
    assert pool.assign("k") is new
    assert (old.in_flight, new.in_flight) == (1, 1)
    pool.release("j")
    pool.release("j")
    assert (old.in_flight, new.in_flight) == (0, 1)
    assert pool.add("http://a:1", weight_version=3) is old  # revived later: its true (zero) load
    assert pool.assign("m") is old and old.in_flight == 1


# ---------------------------------------------------------------------------------------------- submission


async def test_job_submitted_between_clear_and_add_waits_and_runs_with_the_new_version(make_client, wait_done):
    client = await make_client(backend_wait_s=30)
    await client.post("/add_llm_server", json={"address": "http://127.0.0.1:9", "weight_version": 1})
    await client.post("/clear_llm_server")
    r = await client.post("/jobs", json={"instance": {"data_source": "llm_holder"}})
    assert r.status == 202, await r.text()  # not 503: this server is in the middle of a swap
    job = (await r.json())["job_id"]
    await asyncio.sleep(0.2)
    assert (await (await client.get(f"/jobs/{job}")).json())["state"] == "run"  # waiting for a backend
    await client.post("/add_llm_server", json={"address": "http://127.0.0.1:9", "weight_version": 2})
    result = await wait_done(client, job)
    assert result["critical_error"] is None, result["error"]
    assert (result["backend"], result["weight_version"]) == ("http://127.0.0.1:9", 2)
    assert [b["in_flight"] for b in await backends(client)] == [0]


async def test_a_swap_that_never_completes_fails_the_job_after_backend_wait_s(make_client):
    client = await make_client(backend_wait_s=0.3)
    await client.post("/add_llm_server", json={"address": "http://127.0.0.1:9"})
    await client.post("/clear_llm_server")
    r = await client.post("/process", json={"instance": {"data_source": "llm_holder"}})
    result = await r.json()
    assert r.status == 200 and result["critical_error"] == "run"
    assert "no healthy LLM backend" in result["error"]


async def test_a_server_that_never_had_a_backend_refuses_llm_jobs_at_submit(make_client):
    client = await make_client(backend_wait_s=30)
    r = await client.post("/jobs", json={"instance": {"data_source": "llm_holder"}})
    assert r.status == 503 and (await r.json())["error"]["type"] == "no_backend"
    # a handler that needs no LLM is not affected
    r = await client.post("/process", json={"instance": {"data_source": "arithmetic", "expression": "1+2",
                                                          "answer": 3}})
    assert r.status == 200 and (await r.json())["reward"] == 1.0


async def test_in_flight_count_of_a_held_backend_survives_clear_and_add(make_client, wait_done):
    client = await make_client()
    await client.post("/add_llm_server", json={"address": "http://127.0.0.1:9", "weight_version": 1})
    job = (await (await client.post("/jobs", json={"instance": {"data_source": "llm_holder",
                                                                "hold_s": 1.0}})).json())["job_id"]
    for _ in range(500):
        if (await backends(client))[0]["in_flight"] == 1:
            break
        await asyncio.sleep(0.01)
    await client.post("/clear_llm_server")
    await client.post("/add_llm_server", json={"address": "http://127.0.0.1:9", "weight_version": 2})
    assert await backends(client) == [{"address": "http://127.0.0.1:9", "in_flight": 1, "healthy": True,
                                       "weight_version": 2}]
    metrics = await (await client.get("/metrics")).text()
    assert 'prorl_backend_in_flight{backend="http://127.0.0.1:9"} 1.0' in metrics
    await wait_done(client, job)
    assert [b["in_flight"] for b in await backends(client)] == [0]  # released once, not below zero
    metrics = await (await client.get("/metrics")).text()
    assert 'prorl_backend_in_flight{backend="http://127.0.0.1:9"} 0.0' in metrics


# ---------------------------------------------------------------------------------------------- versions


async def test_swap_between_turns_the_next_turn_reports_the_new_version(aiohttp_server, make_client, registry,
                                                                         tiny_model_dir, turn_ids, wait_done):
    handler = SwapAgentHandler()
    registry.register(handler)
    app, seen = fake_vllm(str(tiny_model_dir), turn_ids)
    address = str((await aiohttp_server(app)).make_url("")).rstrip("/")
    client = await make_client()
    await client.post("/add_llm_server", json={"address": address, "weight_version": 1})
    job = (await (await client.post("/jobs", json={"instance": {"data_source": "swap_agent"},
                                                    "sampling_params": {"max_tokens": 4}})).json())["job_id"]
    await asyncio.wait_for(handler.in_tool.wait(), 120)  # turn 1 generated; its tool call is running
    assert len(seen) == 1
    assert (await client.post("/clear_llm_server")).status == 200
    assert (await client.post("/add_llm_server", json={"address": address, "weight_version": 2})).status == 200
    assert [(b["in_flight"], b["weight_version"]) for b in await backends(client)] == [(1, 2)]
    handler.resume.set()
    result = await wait_done(client, job)
    assert result["critical_error"] is None, result["error"]
    assert len(seen) == 3 and result["extra"]["agent"]["num_turns"] == 3
    (traj,) = result["trajectories"]
    assert traj["weight_versions"] == [1, 2]  # turn 1 under version 1, turns 2 and 3 under version 2
    assert result["weight_version"] == 2  # the last turn's
    assert result["backend"] == address
    assert [b["in_flight"] for b in await backends(client)] == [0]


async def test_a_relay_reported_weight_version_is_the_turns_version(aiohttp_server, make_client, registry,
                                                                    tiny_model_dir, turn_ids):
    """The backend stands for a trainer's per-worker relay: each answer names the version that generated it,
    which wins over the version the backend was registered with."""
    handler = SwapAgentHandler()
    handler.in_tool.set()  # no pause
    registry.register(handler)
    app, seen = fake_vllm(str(tiny_model_dir), turn_ids, reported_versions=[41, 42, 42])
    address = str((await aiohttp_server(app)).make_url("")).rstrip("/")
    client = await make_client()
    await client.post("/add_llm_server", json={"address": address, "weight_version": 3})
    r = await client.post("/process", json={"instance": {"data_source": "swap_agent"},
                                            "sampling_params": {"max_tokens": 4}})
    result = await r.json()
    assert result["critical_error"] is None, result["error"]
    assert result["trajectories"][0]["weight_versions"] == [41, 42]
    assert result["weight_version"] == 42


async def test_a_relay_turn_that_spans_a_weight_update_records_both_versions(aiohttp_server):
    app, _ = fake_vllm("m", [5], reported_versions=[{"weight_version": 4, "weight_versions": [4, 5]}])
    address = str((await aiohttp_server(app)).make_url("")).rstrip("/")
    async with LLMClient() as llm:
        c = await llm.complete([1, 2], backend=Backend(address, weight_version=3), max_tokens=1)
    assert c.weight_versions == [4, 5]


@pytest.mark.parametrize("reported", ["7", True, 7.0, None, {"weight_versions": "45"},
                                      {"weight_versions": [True, "4"]}])
async def test_a_reported_version_that_is_not_an_integer_is_ignored(aiohttp_server, reported):
    app, _ = fake_vllm("m", [5], reported_versions=[reported])
    address = str((await aiohttp_server(app)).make_url("")).rstrip("/")
    async with LLMClient() as llm:
        c = await llm.complete([1, 2], backend=Backend(address, weight_version=3), max_tokens=1)
    assert c.weight_versions == [3]


async def test_the_turns_version_is_the_one_registered_when_its_request_was_sent(aiohttp_server):
    """The backend is re-registered while a request is being generated (no abort): the turn keeps the
    version its request was sent under, one version per turn."""
    b = Backend("", weight_version=1)

    async def models(request):
        return web.json_response({"data": [{"id": "m", "max_model_len": 64}]})

    async def completions(request):
        b.weight_version = 2  # the trainer's re-registration lands while this turn is generated
        return web.json_response({"choices": [{"text": "", "token_ids": [5], "finish_reason": "stop",
                                               "logprobs": {"token_logprobs": [-0.5]}}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    b.address = str((await aiohttp_server(app)).make_url("")).rstrip("/")
    async with LLMClient() as llm:
        first = await llm.complete([1], backend=b, max_tokens=1)
        second = await llm.complete([1], backend=b, max_tokens=1)
    assert (first.weight_versions, second.weight_versions) == ([1], [2])


# ---------------------------------------------------------------------------------------------- real tier


@pytest.mark.real
async def test_real_vllm_multi_turn_job_across_a_weight_swap_records_both_versions(make_client, registry,
                                                                                   vllm_server, wait_done):
    handler = SwapAgentHandler()
    registry.register(handler)
    client = await make_client()
    address = vllm_server.address
    await client.post("/add_llm_server", json={"address": address, "weight_version": 1})
    job = (await (await client.post("/jobs", json={
        "instance": {"data_source": "swap_agent"},
        "sampling_params": {"max_tokens": 8, "temperature": 1.0}})).json())["job_id"]
    await asyncio.wait_for(handler.in_tool.wait(), 300)
    await client.post("/clear_llm_server")
    await client.post("/add_llm_server", json={"address": address, "weight_version": 2})
    assert [(b["in_flight"], b["weight_version"]) for b in await backends(client)] == [(1, 2)]
    handler.resume.set()
    result = await wait_done(client, job, patience_s=300)
    assert result["critical_error"] is None, result["error"]
    assert result["extra"]["agent"]["num_turns"] == 3
    (traj,) = result["trajectories"]
    assert traj["weight_versions"] == [1, 2]
    assert sum(traj["loss_mask"]) > 0 and len(traj["response_logprobs"]) == len(traj["response_ids"])
    assert (result["backend"], result["weight_version"]) == (address, 2)
    assert [b["in_flight"] for b in await backends(client)] == [0]
