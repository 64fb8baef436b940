"""Group trees over rows the server's own code made (#34 part 2): shout jobs through a real rollout server
(create_app, the shout handler's Conversation, the token-in/token-out client) with a weight swap inside the
group, and the rewritten context of a chat template that drops past reasoning (the real Conversation and the
qwen3 family template). The backend is the scripted policy of tests/conftest.py, a labelled test double for a
model (the random tiny model writes no stable text)."""
from __future__ import annotations

import pytest

from handlers.shout import ShoutHandler
from prorl_server.app import create_app
from prorl_server.config import ServerSettings
from prorl_server.plugin.registry import HandlerRegistry
from prorl_server.tree import group_tree
from prorl_server.types import GroupTree, JobResult
from trainer_plugins.tree import check_tree


@pytest.fixture
def shout_server(aiohttp_client):
    async def make():
        registry = HandlerRegistry()
        registry.register(ShoutHandler)
        return await aiohttp_client(create_app(ServerSettings(health_interval_s=3600), registry=registry))

    return make


async def test_a_weight_swap_inside_a_group_never_merges_equal_tokens_of_two_versions(shout_server,
                                                                                         scripted_policy):
    variant = {"v": "A"}

    def script(prompt: str, turn: int) -> str:
        # every sample starts alike, then branches at its second turn by the variant the test sets
        return "calm words first" if turn == 0 else f"LOUD {variant['v']} {turn}"

    backend = await scripted_policy(script)
    c = await shout_server()
    results = {}
    for version, v in [(1, "A"), (1, "B"), (2, "A"), (2, "B")]:
        # a re-registered address is the same backend with the new version (the trainer's weight update)
        assert (await c.post("/add_llm_server", json={"address": backend, "weight_version": version})).status == 200
        variant["v"] = v
        r = await c.post("/process", json={"instance": {"data_source": "shout", "prompt": "Say it.", "turns": 4},
                                           "sampling_params": {"max_tokens": 16}, "group_id": "g"})
        assert r.status == 200, await r.text()
        res = JobResult.model_validate(await r.json())
        results[res.job_id] = res
    r = await c.get("/groups/g/tree")
    assert r.status == 200, await r.text()
    tree = GroupTree.model_validate(await r.json())
    check_tree(tree, results)
    assert tree.complete and len(tree.leaves) == 4
    a1, b1, a2, b2 = [leaf.path for leaf in tree.leaves]
    sampled = lambda nid: bool(tree.nodes[nid].sampled)  # noqa: E731
    # same version: the prompt and the first generated turn are shared, the second turn branches
    assert any(sampled(n) for n in set(a1) & set(b1)) and a1[-1] != b1[-1]
    # the very same tokens under versions 1 and 2: only what was not generated is shared
    ids = lambda path: [t for n in path for t in tree.nodes[n].token_ids]  # noqa: E731
    assert ids(a1) == ids(a2)
    assert set(a1) & set(a2) and not any(sampled(n) for n in set(a1) & set(a2))
    assert {v for n in a2 for v, _ in tree.nodes[n].version_runs} == {2}
    assert tree.tree_token_ratio < 0.75


async def test_a_rewritten_context_row_shares_its_prefix_but_not_as_generated_tokens():
    from prorl_server.dev.tiny_model import build_tokenizer
    from prorl_server.llm.client import Completion
    from prorl_server.llm.conversation import Conversation

    tok = build_tokenizer(template="qwen3")
    start = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "List the files."}]
    results = {}
    for k in range(3):  # three samples of one prompt, each split by the template dropping past reasoning
        conv = Conversation(tok, start, max_context_tokens=8192)
        for i, text in enumerate([f"<think>\nstep {i}\n</think>\n\nLooking {k}." for i in range(2)]):
            ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
            conv.add_completion(Completion(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop",
                                           stop_reason=None, backend="scripted", weight_versions=[1]))
            assert await conv.add_messages([{"role": "user", "content": f"Go on {i}."}])
        trajs = conv.trajectories()
        assert len(trajs) >= 2 and trajs[0].split_reason.startswith("template_drops_generated_text")
        results[f"j{k}"] = JobResult(job_id=f"j{k}", trajectory_id=f"t{k}", handler="scripted", trajectories=trajs)
    tree = group_tree("g", list(results.items()))
    check_tree(tree, results)
    roots = {leaf.path[0] for leaf in tree.leaves}
    assert len(roots) == 1  # every row starts with the rendered system + user prompt
    for leaf in tree.leaves:
        assert all(s >= leaf.prompt_len for s, _ in leaf.sampled)  # a row never trains on its prompt
