"""A weight swap the rollout server orchestrates, on the real vLLM CPU server: long generations are in flight
when ``POST /weights/pause`` freezes them (vLLM's keep mode), new weights are loaded through the worker
extension, and ``/weights/resume`` lets them go on. Nothing is aborted, and each sequence's tokens split
cleanly into an old-version prefix and a new-version suffix at the point the worker reported.

The new weights make one token (``MARK``) overwhelmingly likely, so the tokens themselves show which weights
generated them: the random tiny model almost never samples ``MARK`` (1 in ~4,096), the new one always does.
"""
from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import save_file

from handlers.shout.handler import ShoutHandler
from prorl_server.app import COMPONENTS, create_app
from prorl_server.config import ServerSettings
from prorl_server.plugin.registry import HandlerRegistry

pytestmark = pytest.mark.real

MARK = 1234


def marked_weights(model_dir, path) -> None:
    """The tiny model's weights changed so that its last hidden state is the same at every position (constant
    embeddings, attention and MLP outputs zeroed: the residual stream is the embedding) and its LM head turns
    that state into a logit of ~hidden_size / 2 for ``MARK`` and 0 for every other token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    for name, t in sd.items():
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            sd[name] = torch.zeros_like(t)
    sd["model.embed_tokens.weight"] = torch.ones_like(sd["model.embed_tokens.weight"])
    sd["model.norm.weight"] = torch.ones_like(sd["model.norm.weight"])
    head = torch.zeros_like(sd["lm_head.weight"])
    head[MARK] = 0.5
    sd["lm_head.weight"] = head
    save_file(sd, str(path))


async def wait_done(client, job_id: str, patience_s: float = 300.0) -> dict:
    loop = asyncio.get_running_loop()
    end = loop.time() + patience_s
    while loop.time() < end:
        s = await (await client.get(f"/jobs/{job_id}")).json()
        if s["state"] == "done":
            return s["result"]
        await asyncio.sleep(0.1)
    raise AssertionError(f"job {job_id} did not end in {patience_s} s")


async def test_a_keep_swap_mid_generation_aborts_nothing_and_splits_each_sequence(
        aiohttp_client, vllm_ext_server, tiny_model_dir, tmp_path):
    path = tmp_path / "marked.safetensors"
    marked_weights(tiny_model_dir, path)
    reg = HandlerRegistry()
    reg.register(ShoutHandler)
    app = create_app(ServerSettings(tokenizer=str(tiny_model_dir), health_interval_s=3600, backends=[]),
                     registry=reg)
    client = await aiohttp_client(app)
    address = vllm_ext_server.address
    await client.post("/add_llm_server", json={"address": address, "weight_version": 0})
    ids = []
    for i in range(3):
        body = {"job_id": f"long-{i}", "instance": {"data_source": "shout", "prompt": f"Tell a story {i}."},
                "sampling_params": {"max_tokens": 300, "ignore_eos": True, "temperature": 1.0}}
        assert (await client.post("/jobs", json=body)).status == 202
        ids.append(body["job_id"])
    await asyncio.sleep(1.5)  # the first turns are well into their 300 tokens
    r = await client.post("/weights/pause", json={"weight_version": 1})
    assert r.status == 200, await r.text()
    paused = await r.json()
    assert paused["backends"] == {address: "paused"} and paused["held_calls"] >= 1
    session = app[COMPONENTS].llm.client.session
    async with session.post(f"{address}/collective_rpc",
                            json={"method": "prorl_load_weights", "args": [str(path)]}) as lr:
        assert lr.status == 200, await lr.text()
        loaded = (await lr.json())["results"][0]
        assert loaded.get("ok", True) is not False, loaded
    r = await client.post("/weights/resume", json={"swap_id": paused["swap_id"]})
    assert r.status == 200, await r.text()
    resumed = await r.json()
    assert resumed["backends"] == {address: "resumed"} and resumed["tokens_discarded"] == 0
    cut = 0
    for jid in ids:
        res = await wait_done(client, jid)
        assert res["failure_kind"] is None, res["error"]
        for t in res["trajectories"]:
            gen = [x for x, m in zip(t["response_ids"], t["loss_mask"]) if m == 1]
            versions = [v for v, n in t["version_runs"] for _ in range(n)]
            assert len(versions) == len(gen) and None not in versions
            # a clean split: every token the old weights generated precedes every token of the new ones
            assert versions == sorted(versions)
            new = [x for x, v in zip(gen, versions) if v == 1]
            old = [x for x, v in zip(gen, versions) if v == 0]
            assert all(x == MARK for x in new), "a token labelled v1 was not generated by the new weights"
            assert sum(x == MARK for x in old) <= 2, "tokens labelled v0 look like the new weights' work"
            cut += t["mixed_version_turns"]
    assert cut >= 1  # at least one turn was frozen mid-generation and resumed with the new weights
    metrics = await (await client.get("/metrics")).text()
    assert "prorl_llm_pause_retries_total 0.0" in metrics  # nothing was aborted and re-sent
    # back to the base weights for the session's other tests
    async with session.post(f"{address}/collective_rpc",
                            json={"method": "prorl_load_weights", "args": [str(tiny_model_dir)]}) as lr:
        assert lr.status == 200
    async with session.post(f"{address}/reset_prefix_cache") as rr:  # no KV of the marked weights is reused
        assert rr.status == 200
