"""MoE routing replay (R3, issue #32 part 7): verl's ``TokenOutput.routed_experts`` travels relay -> the rollout
server's LLM client -> the conversation's trajectory segments -> ``Trajectory.routed_experts`` -> the agent loop's
``AgentLoopOutput.routed_experts``, aligned with each row's own tokens when a turn rewrites the context.

Real: the rollout server (the project's app on loopback), its LLM client and :class:`Conversation`, the plugin's
relay and agent loop (instantiated from the shipped YAML as verl does), verl's ``AgentLoopOutput.as_dict``.
Stood in for (no GPU, no MoE vLLM here): :class:`MoEReplica` stands for verl's ``server_manager`` in front of an
MoE vLLM replica with ``enable_return_routed_experts``: its ``TokenOutput.routed_experts`` holds one route per
position of the turn's prompt + generated tokens from position 0, the last generated token excepted (vLLM never
feeds it through the model), each route a function of the token and its position in the request.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest

pytest.importorskip("verl")
from hydra.utils import instantiate  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl.experimental.agent_loop import agent_loop as verl_agent_loop  # noqa: E402
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap  # noqa: E402
from verl.utils.dataset.rl_dataset import RLHFDataset  # noqa: E402
from verl.workers.rollout.replica import TokenOutput  # noqa: E402

from prorl_server.llm.conversation import Conversation  # noqa: E402
from prorl_server.llm.turn import TurnEngine  # noqa: E402
from prorl_server.plugin.handler import AgentHandler  # noqa: E402
from prorl_server.types import MAX_EXPERT_INDEX, MAX_ROUTE_TOP_K  # noqa: E402
from trainer_plugins.verl import CONFIG_DIR  # noqa: E402
from trainer_plugins.verl.relay import close_relays  # noqa: E402

LAYERS, TOP_K = 3, 2
SP = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}
# rewrites history every turn (the system line counts the messages): each new turn starts a new row
REWRITING = ("<|im_start|>system\n{{ messages|length }} messages<|im_end|>\n"
             "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def route(context: list[int], t: int) -> list[list[int]]:
    """The experts token ``context[t]`` at request position ``t`` is routed to, per layer (top-2)."""
    return [[(context[t] * (layer + 3)) % 997, (t * 7 + layer) % 991] for layer in range(LAYERS)]


class MoEReplica:
    """Stands in for verl's ``server_manager`` over an MoE vLLM replica with routing replay on (module docstring):
    answers ``turn {n}.<|im_end|>`` (at most ``max_tokens``), version 4. ``top_k`` / ``expert`` override the
    shape or an index of the routes it reports (a broken or hostile backend)."""

    def __init__(self, tokenizer, top_k: int = TOP_K, expert: int | None = None) -> None:
        self.tok, self.top_k, self.expert, self.turns = tokenizer, top_k, expert, 0

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs) -> TokenOutput:
        self.turns += 1
        ids = self.tok.encode(f"turn {self.turns}.", add_special_tokens=False)
        ids = (ids + [self.tok.convert_tokens_to_ids("<|im_end|>")])[:int(sampling_params["max_tokens"])]
        context = list(prompt_ids) + ids
        routes = np.array([route(context, t) for t in range(len(context) - 1)], dtype=np.int32)
        if self.top_k != TOP_K:
            routes = np.zeros((len(context) - 1, LAYERS, self.top_k), dtype=np.int32)
        if self.expert is not None:
            routes[-1, 0, 0] = self.expert
        return TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids), stop_reason="completed",
                           routed_experts=routes, extra_fields={"global_steps": 4})


class RewritingHandler(AgentHandler):
    """Stands in for a multi-turn chat handler whose model's template rewrites history (``REWRITING``; with
    ``rewrite=False`` the model's own append-only ChatML): three turns through the server's real turn engine, LLM
    client and :class:`Conversation`, a user message between them; with ``REWRITING`` every later turn starts a
    new trajectory row (a split)."""

    name = "rewriting"
    needs_llm = True

    def __init__(self, tokenizer, rewrite: bool = True) -> None:
        self.tok = copy.deepcopy(tokenizer)
        if rewrite:
            self.tok.chat_template = REWRITING

    async def run(self, job):
        engine = TurnEngine(job.llm.client)
        conv = Conversation(self.tok, [{"role": "user", "content": "Say something."}], max_context_tokens=2048)
        for k in range(3):
            if k:
                assert await conv.add_messages([{"role": "user", "content": f"And again, {k}."}])
            await engine.turn(conv, job, max_tokens=8, sampling_params={"temperature": 1.0}, parse=False)
        conv.finish("stop")
        job.trajectories.extend(conv.trajectories())

    async def eval(self, job):
        job.reward, job.resolved = 1.0, True


@pytest.fixture
async def loop_for(compose_verl, serve_handlers, tokenizer, monkeypatch):
    """``await loop_for(replica)`` -> the plugin's agent loop (shipped YAML, relay on loopback) over ``replica``,
    registered with a real rollout server serving :class:`RewritingHandler`."""
    cfg = compose_verl(prompt_length=256, response_length=128)

    async def make(replica, rewrite=True):
        url = await serve_handlers(RewritingHandler(tokenizer, rewrite))
        monkeypatch.setenv("PRORL_SERVERS", url)
        entry = OmegaConf.load(CONFIG_DIR / "agent_loop.yaml")[0]
        verl_agent_loop._agent_loop_registry["prorl"] = entry
        return instantiate(config=entry, trainer_config=DictConfigWrap(config=cfg), server_manager=replica,
                           tokenizer=tokenizer, processor=None, hf_model_type="qwen2", dataset_cls=RLHFDataset,
                           data_config=DictConfigWrap(cfg.data), tools=ToolListWrap([]), relay_host="127.0.0.1")

    yield make
    await close_relays()


def verl_row():
    return {"raw_prompt": np.array([{"role": "user", "content": "hi"}], dtype=object), "data_source": "rewriting",
            "extra_info": {"index": 0, "instance": {"data_source": "rewriting"}}, "index": 0, "global_steps": 4,
            "session_id": 0}


async def test_routes_reach_agent_loop_output_aligned_with_each_rewritten_row(loop_for, tokenizer):
    loop = await loop_for(MoEReplica(tokenizer))
    outs = await loop.run(SP, **verl_row())
    assert len(outs) == 3  # one row per turn: the template rewrote the context before turns 2 and 3
    for out in outs:
        assert out.extra_fields["prorl"]["filter"] is False
        row = list(out.prompt_ids) + list(out.response_ids)
        got = out.routed_experts
        # verl's layout: [positions, layers, top_k] int16 from the row's first token; every position but the
        # last (never fed through the model) carries the route computed for that token at that position
        assert got.shape == (len(row) - 1, LAYERS, TOP_K) and got.dtype == np.int16
        assert got.tolist() == [route(row, t) for t in range(len(row) - 1)]
        # what verl's trainer stores: one route row per token of prompts + responses, the last one zero
        stored = out.as_dict()["routed_experts"]
        assert tuple(stored.shape) == (len(row), LAYERS, TOP_K)
        assert stored[:-1].tolist() == got.tolist() and not stored[-1].any()
    # the later rows start again at position 0 of their own (rewritten) context, not after the earlier row
    assert len(outs[1].prompt_ids) > len(outs[0].prompt_ids) + len(outs[0].response_ids)


async def test_a_row_that_grows_turn_by_turn_is_sent_only_the_routes_it_lacks(loop_for, tokenizer):
    loop = await loop_for(MoEReplica(tokenizer), rewrite=False)
    (out,) = await loop.run(SP, **verl_row())  # append-only: one row of three turns
    row = list(out.prompt_ids) + list(out.response_ids)
    assert out.routed_experts.tolist() == [route(row, t) for t in range(len(row) - 1)]
    # each answer carried only the positions after those the row held (routed_experts_prompt_start), not the
    # whole context again: every position of the row once
    assert loop.relay.stats["route_positions"] == len(row) - 1


@pytest.mark.parametrize("fault", ["top_k", "expert"])
async def test_oversized_or_out_of_range_routes_are_a_filtered_backend_fault(loop_for, tokenizer, fault):
    replica = (MoEReplica(tokenizer, top_k=MAX_ROUTE_TOP_K + 1) if fault == "top_k"
               else MoEReplica(tokenizer, expert=MAX_EXPERT_INDEX + 1))
    loop = await loop_for(replica)
    outs = await loop.run(SP, **verl_row())
    prorl = outs[-1].extra_fields["prorl"]
    # the backend's doing: filtered (never a scored 0 for the model), named, and the row trains nothing
    assert prorl["filter"] is True and prorl["failure_kind"] == "llm_backend"
    assert "routed experts" in prorl["error"]
    assert all(not any(o.response_mask) and o.routed_experts is None for o in outs)


async def test_an_answer_over_the_byte_bound_is_refused_before_it_is_decoded(aiohttp_server, monkeypatch):
    """A backend (stood in for by an aiohttp app) whose answer carries more routes than the client reads."""
    from aiohttp import web

    from prorl_server.llm import client as llm_client

    async def completions(request):
        routes = [[[1, 2]] * 4] * 2000  # ~50 kB of JSON
        return web.json_response({"choices": [{"token_ids": [5], "finish_reason": "stop",
                                               "logprobs": {"token_logprobs": [-0.1]}}],
                                  "routed_experts": routes, "routed_experts_start": 0})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    server = await aiohttp_server(app)
    monkeypatch.setattr(llm_client, "MAX_ANSWER_BYTES", 10_000)
    async with llm_client.LLMClient(model="m") as client:
        with pytest.raises(llm_client.LLMError, match="more than 10000 bytes"):
            await client.complete([1, 2, 3], backend=str(server.make_url("")).rstrip("/"), max_tokens=1)


async def test_a_prompt_cut_from_the_left_cuts_its_routes_with_it(loop_for, tokenizer):
    from prorl_server.types import JobResult, Trajectory

    loop = await loop_for(MoEReplica(tokenizer))
    P, R = 300, 10  # the prompt is longer than the rollout's prompt_length (256)
    row = list(range(1000, 1000 + P + R))
    routes = [route(row, t) for t in range(P + R - 1)]
    t = Trajectory(prompt_ids=row[:P], response_ids=row[P:], response_logprobs=[-0.5] * R, loss_mask=[1] * R,
                   version_runs=[[4, R]], routed_experts=routes)
    (out,) = await loop.to_outputs(JobResult(job_id="j", trajectory_id="j", handler="h", reward=1.0,
                                             weight_version=4, trajectories=[t]),
                                   verl_row())
    assert list(out.prompt_ids) == row[P - 256:P]
    assert out.routed_experts.tolist() == routes[P - 256:]  # position 0 of the output row is row position 44
