"""Tree-packed training (#34 part 3, trainer_plugins/trl/tree_pack.py): one forward of a group's prefix tree
with an ancestor mask and depth position ids gives every row's logprobs and gradients as the per-row forward
does, on the project's tiny Qwen2 on CPU (SDPA); four negative controls fail by far more than the bound, and
the TRL mixin's first-batch self-check falls back to rows when packing is wrong."""
from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from trainer_plugins.trl.tree_pack import (TREE_ATTENTION, TreePackedLogps, ancestor_mask,  # noqa: E402
                                           attention_layout, build_prefix_tree, max_difference, pack,
                                           packed_row_logprobs, per_row_logprobs)

#: the issue's bounds: max |delta logprob| in fp32 and fp64, relative gradient difference in fp32 and fp64
FP32, FP64, FP32_GRAD, GRAD64 = 2e-6, 1e-12, 1e-5, 1e-9


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    m = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa",
                                                          dtype=torch.float32)
    return m.eval()


def group_rows(seed: int = 0) -> list[list[int]]:
    """A GRPO-like group: a shared 48-token prompt, rows that branch at different depths (inside a turn, at
    turn boundaries), a row that is a strict prefix of another, and a row of its own."""
    rnd = random.Random(seed)
    tok = lambda n: [rnd.randrange(10, 4000) for _ in range(n)]  # noqa: E731
    prompt = tok(48)
    a = prompt + tok(30)
    b = a[:60] + tok(25)          # branches inside a's response
    c = b + tok(12)               # continues b (b is its prefix)
    d = prompt + tok(20)          # branches right after the prompt
    e = a[:70] + tok(9)
    return [a, b, c, d, e, tok(17)]


def test_the_tree_shares_prefixes_and_gives_back_every_row():
    rows = group_rows()
    nodes, paths = build_prefix_tree(rows)
    for row, path in zip(rows, paths):
        assert [t for n in path for t in nodes[n][1]] == row
    assert sum(len(ids) for _, ids in nodes) < 0.6 * sum(map(len, rows))


@pytest.fixture
def fp64_norm(monkeypatch):
    """Qwen2's RMSNorm computes in float32 whatever the model's dtype (transformers 5.10): in an fp64 model
    that rounds every layer to fp32, and the backward's sums then differ at ~1e-7 between any two orders of
    summation. For the fp64 comparison the norm keeps its input dtype (the same formula), so the comparison
    measures the packing, not fp32 rounding."""
    from transformers.models.qwen2 import modeling_qwen2

    def forward(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(modeling_qwen2.Qwen2RMSNorm, "forward", forward)


@pytest.mark.parametrize("dtype,bound", [(torch.float32, FP32), (torch.float64, FP64)])
def test_packed_logprobs_equal_the_per_row_forward(model, dtype, bound, fp64_norm):
    m = model.to(dtype)
    rows = group_rows()
    tree = pack(*build_prefix_tree(rows))
    with torch.no_grad():
        packed, _ = packed_row_logprobs(m, tree)
        ref = per_row_logprobs(m, rows)
    model.to(torch.float32)
    assert max_difference(packed, ref) <= bound


@pytest.mark.parametrize("dtype,bound", [(torch.float32, FP32_GRAD), (torch.float64, GRAD64)])
def test_gradients_equal_the_per_row_forward(model, dtype, bound, fp64_norm):
    m = model.to(dtype)
    rows = group_rows(1)
    weights = [0.5, -1.0, 2.0, 0.25, -0.75, 1.5]  # per-row advantages, applied when the loss is gathered

    def grads(logps):
        m.zero_grad()
        sum(w * lp.sum() for w, lp in zip(weights, logps)).backward()
        return torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])

    packed = grads(packed_row_logprobs(m, pack(*build_prefix_tree(rows)))[0])
    ref = grads(per_row_logprobs(m, rows))
    m.zero_grad()
    model.to(torch.float32)
    assert float((packed - ref).norm() / ref.norm()) <= bound


@pytest.mark.parametrize("control", ["causal mask", "causal layout", "packed position ids",
                                     "missing branch transition"])
def test_negative_controls_fail_by_1000x_the_bound(model, control):
    """Each control on the path it breaks: a plain causal mask over the packed tree as the dense 4-D mask
    and as the node-by-node attention's layout (every node over all packed tokens before it)."""
    rows = group_rows()
    tree = pack(*build_prefix_tree(rows), position_ids="packed" if control == "packed position ids" else "depth")
    mask = ancestor_mask(tree, torch.float32, "causal") if control == "causal mask" else None
    layout = attention_layout(tree, "causal") if control == "causal layout" else None
    transitions = "packed" if control == "missing branch transition" else "parent"
    with torch.no_grad():
        packed, _ = packed_row_logprobs(model, tree, mask=mask, transitions=transitions, layout=layout)
        ref = per_row_logprobs(model, rows)
    assert max_difference(packed, ref) >= 1000 * FP32


def agent_rows(seed: int = 2, agents: int = 2, turns: int = 4) -> list[list[int]]:
    """Agents that re-send their whole history every turn (one row per turn), as the benchmark's rewrite case."""
    rnd = random.Random(seed)
    tok = lambda n: [rnd.randrange(10, 4000) for _ in range(n)]  # noqa: E731
    prompt, rows = tok(40), []
    for _ in range(agents):
        history = list(prompt)
        for _ in range(turns):
            history += tok(9)
            rows.append(list(history))
            history += tok(6)
    return rows


def test_an_sdpa_model_attends_node_by_node_without_an_s_by_s_mask(model, monkeypatch):
    """The packed forward of an SDPA model computes attention per node over its ancestors (far fewer
    query-key pairs than S x S) and builds no dense mask, with the per-row forward's logprobs and gradient."""
    from trainer_plugins.trl import tree_pack

    def dense(*a, **kw):
        raise AssertionError("a dense S x S mask was built")

    monkeypatch.setattr(tree_pack, "ancestor_mask", dense)
    rows = agent_rows()
    tree = pack(*build_prefix_tree(rows))
    layout = attention_layout(tree)
    assert layout.pairs < 0.5 * tree.size ** 2

    def grads(logps):
        model.zero_grad()
        sum(w * lp.sum() for w, lp in zip([1.0, -0.5, 2.0, 0.5] * 2, logps)).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    packed = packed_row_logprobs(model, tree)[0]
    assert model.config._attn_implementation == TREE_ATTENTION
    ref = per_row_logprobs(model, rows)
    g_packed, g_ref = grads(packed), grads(ref)
    model.zero_grad()
    assert max_difference(packed, ref) <= FP32
    assert float((g_packed - g_ref).norm() / g_ref.norm()) <= FP32_GRAD


def test_tree_attention_is_sdpa_for_every_other_forward(tiny_model_dir):
    """A model switched to the tree attention answers a padded batch (TRL's layout) bit for bit as SDPA does."""
    from trainer_plugins.trl.tree_pack import enable_tree_attention

    m = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa",
                                                          dtype=torch.float32).eval()
    ids, mask, _ = padded_batch(group_rows()[:4], 48)
    with torch.no_grad():
        before = m(input_ids=ids, attention_mask=mask).logits
        assert enable_tree_attention(m)
        after = m(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(before, after)


def test_the_dense_mask_path_stays_exact_for_eager_models(tiny_model_dir):
    """Eager attention is not switched: the packed forward uses the dense ancestor mask, still exact."""
    m = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager",
                                                          dtype=torch.float32).eval()
    rows = group_rows()
    with torch.no_grad():
        packed, _ = packed_row_logprobs(m, pack(*build_prefix_tree(rows)))
        ref = per_row_logprobs(m, rows)
    assert m.config._attn_implementation == "eager"
    assert max_difference(packed, ref) <= FP32


def test_gradient_checkpointing_recomputes_with_the_tree_attention(tiny_model_dir):
    """Gradient checkpointing re-runs each layer's forward in the backward: it must find the tree attention
    and its layout again (the switch is kept), giving the per-row gradient."""
    m = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa",
                                                          dtype=torch.float32)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.train()  # checkpointing is active in training mode only (attention dropout is 0)
    rows = group_rows(1)

    def grads(logps):
        m.zero_grad()
        sum(w * lp.sum() for w, lp in zip([0.5, -1.0, 2.0, 0.25, -0.75, 1.5], logps)).backward()
        return torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])

    g_packed = grads(packed_row_logprobs(m, pack(*build_prefix_tree(rows)))[0])
    g_ref = grads(per_row_logprobs(m, rows))
    assert float((g_packed - g_ref).norm() / g_ref.norm()) <= FP32_GRAD


class PerRowTrainer:
    """Stands for TRL's ``GRPOTrainer._get_per_token_logps_and_entropies`` (TRL 1.x): the padded batch
    forwarded as it is, the last ``logits_to_keep`` columns' logprobs returned."""

    temperature = 1.0

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                           batch_size=None, compute_entropy=False, compute_aux_loss=False, **kw):
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        logp = torch.log_softmax(logits[:, :-1] / self.temperature, -1).gather(-1, input_ids[:, 1:, None])[..., 0]
        return logp[:, -logits_to_keep:], None, None


class PackedTrainer(TreePackedLogps, PerRowTrainer):
    pass


def padded_batch(rows: list[list[int]], prompt_len: int):
    """TRL's layout: prompts left-padded, completions right-padded (pad id 0)."""
    P = prompt_len
    C = max(len(r) for r in rows) - P
    ids = torch.zeros(len(rows), P + C, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, :P], mask[b, :P] = torch.tensor(r[:P]), 1
        ids[b, P:P + len(r) - P], mask[b, P:P + len(r) - P] = torch.tensor(r[P:]), 1
    return ids, mask, C


def assert_packed_matches_rows(trainer, model, ids, mask, C) -> None:
    """The packed trainer's completion logprobs equal TRL's per-row forward's within 1e-4."""
    with torch.no_grad():
        got, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, C)
        ref, _, _ = PerRowTrainer()._get_per_token_logps_and_entropies(model, ids, mask, C)
    keep = mask[:, -C:].bool()
    assert float((got - ref)[keep].abs().max()) <= 1e-4


def test_the_trl_mixin_packs_a_batch_and_returns_trls_layout(model):
    rows = [r for r in group_rows()[:5]]
    ids, mask, C = padded_batch(rows, 48)
    trainer = PackedTrainer()
    assert_packed_matches_rows(trainer, model, ids, mask, C)
    s = trainer.tree_pack_stats
    assert s.packed_batches == 1 and s.fallback_reason is None and s.tree_token_ratio < 0.7


@pytest.mark.parametrize("path", ["tree attention", "dense mask"])
def test_a_mask_leak_across_branches_is_caught_by_the_self_check_and_rows_are_forwarded(model, tiny_model_dir,
                                                                                        monkeypatch, path):
    from trainer_plugins.trl import tree_pack

    if path == "tree attention":
        real = tree_pack.attention_layout
        monkeypatch.setattr(tree_pack, "attention_layout", lambda tree, kind="ancestor": real(tree, "causal"))
    else:  # an eager model keeps the dense 4-D mask
        model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager",
                                                                  dtype=torch.float32).eval()
        real = tree_pack.ancestor_mask
        monkeypatch.setattr(tree_pack, "ancestor_mask",
                            lambda tree, dtype, kind="ancestor": real(tree, dtype, "causal"))
    rows = group_rows()[:5]
    ids, mask, C = padded_batch(rows, 48)
    trainer = PackedTrainer()
    with torch.no_grad():
        got, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, C)
        ref, _, _ = PerRowTrainer()._get_per_token_logps_and_entropies(model, ids, mask, C)
    s = trainer.tree_pack_stats
    assert s.fallback_reason and "self-check" in s.fallback_reason and s.packed_batches == 0
    assert torch.equal(got, ref)  # what the loss gets is the per-row forward's
    trainer._get_per_token_logps_and_entropies(model, ids, mask, C)
    assert s.row_batches == 2  # off for the rest of the run


def test_a_packed_forward_that_raises_on_the_first_batch_turns_packing_off_saying_why(model, monkeypatch):
    # A model the packed path cannot run (a shape it does not expect, memory): the mixin's docstring promised
    # rows for the rest of the run; before, the exception stopped the training step.
    from trainer_plugins.trl import tree_pack

    def broken(*a, **k):
        raise RuntimeError("stands for a packed forward this model cannot run")

    monkeypatch.setattr(tree_pack, "packed_row_logprobs", broken)
    ids, mask, C = padded_batch(group_rows()[:5], 48)
    trainer = PackedTrainer()
    got, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, C)
    with torch.no_grad():
        ref, _, _ = PerRowTrainer()._get_per_token_logps_and_entropies(model, ids, mask, C)
    s = trainer.tree_pack_stats
    assert s.fallback_reason and "RuntimeError" in s.fallback_reason and s.packed_batches == 0
    assert got.requires_grad and torch.equal(got.detach(), ref)  # the per-row forward, trainable
    trainer._get_per_token_logps_and_entropies(model, ids, mask, C)
    assert s.row_batches == 2


def test_packed_entropies_equal_the_per_row_ones(model):
    rows = group_rows()[:4]
    tree = pack(*build_prefix_tree(rows))
    with torch.no_grad():
        _, ents = packed_row_logprobs(model, tree, compute_entropy=True)
        for row, ent in zip(rows, ents):
            logits = model(input_ids=torch.tensor([row])).logits[0, :-1]
            logp = torch.log_softmax(logits, -1)
            assert float((ent - (-(logp.exp() * logp).sum(-1))).abs().max()) <= 1e-4


@pytest.mark.parametrize("bf16,control", [(False, None), (True, None), (True, "packed position ids")])
def test_trls_grpo_trainer_trains_tree_packed(tiny_model_dir, tmp_path, monkeypatch, bf16, control):
    """TRL 1.16's own GRPOTrainer (generation with transformers on CPU, no vLLM) with the mixin: every loss
    forward is packed with the node-by-node tree attention and the first-batch self-check against TRL's own
    per-row forward passes, in fp32 and under the bf16 autocast that GRPOConfig turns on by default. The
    check runs the fp32 model with autocast off (TRL's and accelerate's included), so an honest packing is
    within 1e-5 under bf16 too, and packed-index position ids (off by 1.2e-2 under bf16 autocast, inside the
    old bf16 bound of 5e-2) fall back to rows."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from trainer_plugins.trl import tree_pack

    if control:
        real = tree_pack.pack
        monkeypatch.setattr(tree_pack, "pack", lambda nodes, paths, position_ids="depth": real(nodes, paths, "packed"))

    class Trainer(TreePackedLogps, trl.GRPOTrainer):
        pass

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                              attn_implementation="sdpa")
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=8, learning_rate=1e-3, max_steps=2, beta=0.0, report_to=[],
                          save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, bf16=bf16)
    trainer = Trainer(model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                      args=args, train_dataset=Dataset.from_list([{"prompt": "Say something about the sea."}] * 4),
                      processing_class=transformers.AutoTokenizer.from_pretrained(tiny_model_dir))
    trainer.train()
    s = trainer.tree_pack_stats
    if control:
        assert s.fallback_reason and "self-check" in s.fallback_reason and "float32" in s.fallback_reason
        assert s.packed_batches == 0 and s.row_batches >= 2 and s.self_check_delta > 1e-3
        return
    assert s.fallback_reason is None and s.packed_batches >= 2 and s.row_batches == 0
    assert s.self_check_delta <= 1e-5
    assert s.tree_token_ratio < 0.8  # the group's shared prompt is forwarded once
    assert trainer.model.config._attn_implementation == TREE_ATTENTION  # attention node by node, no S x S mask


def trl_batch(prompts: list[list[int]], completions: list[list[int]]):
    """TRL's padded batch of rollout rows: prompts left-padded, completions right-padded (pad id 0)."""
    P, C = max(map(len, prompts)), max(map(len, completions))
    ids = torch.zeros(len(prompts), P + C, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, (p, c) in enumerate(zip(prompts, completions)):
        ids[b, P - len(p):P], mask[b, P - len(p):P] = torch.tensor(p), 1
        ids[b, P:P + len(c)], mask[b, P:P + len(c)] = torch.tensor(c), 1
    return ids, mask, C


def split_instance(name: str, first: int) -> dict:
    """A ``fixed`` instance (tests/trainer/conftest.py) whose rollout was split by a context rewrite: TRL trains
    on its second segment only, whose prompt re-sends the first's history."""
    prompt = list(range(100, 140))
    turn1, obs, turn2 = [first + k for k in range(6)], [300, 301], [first + 50 + k for k in range(5)]
    seg1 = dict(prompt_ids=prompt, response_ids=turn1, response_logprobs=[-0.5] * 6, loss_mask=[1] * 6,
                version_runs=[[0, 6]])
    seg2 = dict(prompt_ids=prompt + turn1 + obs, response_ids=turn2, response_logprobs=[-0.25] * 5,
                loss_mask=[1] * 5, version_runs=[[0, 5]])
    return {"data_source": "fixed", "id": name, "prompt": f"say {name}", "rewards": [0.0, 1.0],
            "trajectories": [seg1, seg2]}


async def test_the_mixin_packs_the_servers_verified_trees_and_says_why_when_it_cannot(start_llm_server, model,
                                                                                      monkeypatch):
    """``ProRLRollout(server_trees=True)`` fetches each group's tree from its server and checks it; the mixin
    packs those trees (one per group, pruned to the rows TRL trains: the prompt is not shared across groups,
    unlike a tree built here from tokens) with the per-row forward's logprobs; a row TRL changed, and a tree
    that fails the trainer's check, fall back to a tree built from the rows, each counted with its reason."""
    import asyncio
    from types import SimpleNamespace as NS

    from prorl_server import tree as server_tree
    from trainer_plugins.trl import ProRLRollout

    url = await start_llm_server()
    # stands for trl.GRPOTrainer: the attributes the rollout function reads (tests/trainer/test_trl_rollout.py)
    trainer_stub = NS(num_generations=2, temperature=1.0, state=NS(global_step=0),
                      args=NS(temperature=1.0, top_p=1.0, top_k=None, max_completion_length=12),
                      processing_class=NS(eos_token_id=7, pad_token_id=0))
    rollout = ProRLRollout([url], [split_instance("a", 1000), split_instance("b", 2000)], max_sample_retries=0,
                           server_trees=True)
    try:
        out = await asyncio.to_thread(rollout, ["say a", "say a", "say b", "say b"], trainer_stub)
        trees = rollout.server_trees
        assert trees.stats.verified == 2 and trees.stats.fallbacks == 0
        ids, mask, C = trl_batch(out["prompt_ids"], out["completion_ids"])
        trainer = PackedTrainer()
        trainer.rollout_func = rollout
        assert_packed_matches_rows(trainer, model, ids, mask, C)
        s = trainer.tree_pack_stats
        row_len = len(out["prompt_ids"][0]) + len(out["completion_ids"][0])
        assert s.server_tree_chunks == 1 and s.row_tree_chunks == 0
        assert s.tree_tokens == 2 * row_len  # one tree per group; built from tokens it would be row_len + 5

        # a row TRL changed (truncated) is in no server tree: that chunk builds its own, saying why
        ids2, mask2 = ids.clone(), mask.clone()
        mask2[0, -1] = 0
        with torch.no_grad():
            trainer._get_per_token_logps_and_entropies(model, ids2, mask2, C)
        assert s.row_tree_chunks == 1 and any("no verified server tree" in r for r in s.tree_reasons)

        # a server that serves a tree its own check would refuse: the trainer's check refuses it too
        real = server_tree.build_tree

        def corrupt(*a, **kw):
            t = real(*a, **kw)
            t.nodes[-1].token_ids[0] += 1
            return t

        monkeypatch.setattr(server_tree, "build_tree", corrupt)
        monkeypatch.setattr(server_tree, "verify_tree", lambda tree, rows: 0.0)
        await asyncio.to_thread(rollout, ["say a", "say a"], trainer_stub)
        assert trees.stats.fallbacks == 1 and any("tokens differ" in r for r in trees.stats.reasons)
    finally:
        rollout.close()


def shared_reply_results(seed: int = 3, agents: int = 2, turns: int = 4):
    """Agents that re-send their history every turn (one row per turn): the reply sampled in row t is prompt
    in row t + 1, so the server's tree shares it (issue #34 format 2)."""
    from prorl_server.types import JobResult, Trajectory

    rnd = random.Random(seed)
    tok = lambda n: [rnd.randrange(10, 4000) for _ in range(n)]  # noqa: E731
    prompt, out = tok(24), []
    for a in range(agents):
        history, rows = list(prompt), []
        for t in range(turns):
            gen = tok(7)
            rows.append(Trajectory(prompt_ids=list(history), response_ids=gen, response_logprobs=[-1.0] * 7,
                                   loss_mask=[1] * 7, version_runs=[[1, 7]]))
            history += gen + tok(5)
        out.append((f"a{a}", JobResult(job_id=f"a{a}", trajectory_id=str(a), handler="h", reward=float(a),
                                       trajectories=rows)))
    return out


@pytest.mark.parametrize("dtype,bound,grad_bound", [(torch.float32, FP32, FP32_GRAD), (torch.float64, FP64, GRAD64)])
def test_a_server_tree_sharing_replies_as_context_trains_each_row_exactly(model, dtype, bound, grad_bound,
                                                                         fp64_norm):
    """The packed forward of a tree whose nodes hold replies sampled in one row and context in the next, with
    each leaf's own loss mask, gives the per-row logprobs and gradient; training a leaf on its nodes' sampled
    runs instead (what a format-1 reader would do) is off by far more than the bound."""
    from prorl_server.tree import group_tree
    from trainer_plugins.trl.tree_pack import tree_loss_masks

    results = shared_reply_results()
    tree = group_tree("g", results)
    trajs = [t for _, r in results for t in r.trajectories]
    rows = [t.prompt_ids + t.response_ids for t in trajs]
    # the shared prompt, then each agent's rows as one chain: every reply held once (format 1: 3 more per agent)
    assert tree.tree_tokens == 24 + 2 * (4 * 7 + 3 * 5)
    masks = tree_loss_masks(tree)
    assert [m.tolist() for m in masks] == [([0] * len(t.prompt_ids) + t.loss_mask)[1:] for t in trajs]
    m = model.to(dtype)
    adv = [0.5, -1.0, 2.0, 0.25, -0.75, 1.5, 1.0, -0.5]

    def grads(logps, masks):
        m.zero_grad()
        sum(a * (lp * mk.to(lp.dtype)).sum() for a, lp, mk in zip(adv, logps, masks)).backward()
        return torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])

    packed_tree = pack([(n.parent, n.token_ids) for n in tree.nodes], [leaf.path for leaf in tree.leaves])
    packed = packed_row_logprobs(m, packed_tree)[0]
    ref = per_row_logprobs(m, rows)
    delta = max_difference(packed, ref)
    g_packed, g_ref = grads(packed, masks), grads(ref, masks)
    union = [torch.zeros(len(r) - 1) for r in rows]  # every node-sampled token of the path: format 1's mask
    for u, leaf in zip(union, tree.leaves):
        for n in leaf.path:
            for s, e in tree.nodes[n].sampled:
                u[tree.nodes[n].depth + s - 1:tree.nodes[n].depth + e - 1] = 1
    g_union = grads(packed_row_logprobs(m, packed_tree)[0], union)
    m.zero_grad()
    model.to(torch.float32)
    assert delta <= bound
    assert float((g_packed - g_ref).norm() / g_ref.norm()) <= grad_bound
    assert float((g_union - g_ref).norm() / g_ref.norm()) >= 1000 * FP32_GRAD
