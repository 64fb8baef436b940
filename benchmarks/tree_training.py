"""Tree-packed training vs one forward per row (issue #34), side by side in one run, on the project's tiny Qwen2
on CPU (fp32, SDPA).

Two groups of rows:

- ``grpo``: a GRPO group of 8 samples x 4 turns (prompt, then generated turns and tool observations), sample i
  following the group's first sample for its first ``i % 4`` turns and branching after;
- ``rewrite``: 4 agents x 8 turns that send their whole history as the prompt of every turn (one row per turn:
  what the model generated in turn k is prompt in turn k + 1).

The rows are token ids shaped like those (random ids of the tiny vocabulary, not a vLLM rollout: the tree and
the packing depend only on the tokens and their provenance). For each group: the tree the server builds and
verifies (:func:`prorl_server.tree.group_tree`, its build time per 100k flat tokens), then one
forward+backward of a per-row GRPO-style loss (``advantage * sum of the row's generated tokens' logprobs``)
per row and packed from that tree (:mod:`trainer_plugins.trl.tree_pack`), the best of ``--repeats``; prints
flat and tree tokens, the ratio, both times and the speed-up, the max logprob difference and the relative
gradient difference, and ends with one JSON line (with the 1-minute load average before and after: the
timings are only meaningful on quiet cores).

The packed side attends node by node (``--attention tree``, the default:
:func:`trainer_plugins.trl.tree_pack.tree_attention_forward`) or through the dense S x S ancestor mask
(``--attention dense``: the path eager models take, built inside the timed step as the trainer builds it).

    .venv/bin/python benchmarks/tree_training.py [--repeats 3] [--seed 0] [--attention tree|dense]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from prorl_server.tree import group_tree  # noqa: E402
from prorl_server.types import JobResult, Trajectory  # noqa: E402
from prorl_server.types import GroupTree  # noqa: E402
from trainer_plugins.trl.tree_pack import (ancestor_mask, build_prefix_tree, enable_tree_attention,  # noqa: E402
                                           pack, packed_row_logprobs, per_row_logprobs)


def _ids(rnd: random.Random, n: int) -> list[int]:
    return [rnd.randrange(10, 4000) for _ in range(n)]


def grpo_group(rnd: random.Random, samples: int = 8, turns: int = 4, prompt: int = 300, turn: int = 64,
               obs: int = 48) -> list[tuple[str, JobResult]]:
    p = _ids(rnd, prompt)
    main = [(_ids(rnd, turn), _ids(rnd, obs)) for _ in range(turns)]
    out = []
    for i in range(samples):
        ids, mask = [], []
        for t in range(turns):
            gen, ob = main[t] if t < i % turns else (_ids(rnd, turn), _ids(rnd, obs))
            ids += gen
            mask += [1] * len(gen)
            if t < turns - 1:
                ids += ob
                mask += [0] * len(ob)
        traj = Trajectory(prompt_ids=p, response_ids=ids, response_logprobs=[-1.0 * m for m in mask],
                          loss_mask=mask, version_runs=[[1, sum(mask)]])
        out.append((f"grpo-{i}", JobResult(job_id=f"grpo-{i}", trajectory_id=str(i), handler="bench",
                                           reward=float(i % 2), trajectories=[traj])))
    return out


def rewrite_group(rnd: random.Random, agents: int = 4, turns: int = 8, prompt: int = 600, turn: int = 40,
                  obs: int = 120) -> list[tuple[str, JobResult]]:
    p = _ids(rnd, prompt)
    out = []
    for a in range(agents):
        history, rows = list(p), []
        for t in range(turns):
            gen = _ids(rnd, turn)
            rows.append(Trajectory(prompt_ids=list(history), response_ids=gen, response_logprobs=[-1.0] * turn,
                                   loss_mask=[1] * turn, version_runs=[[1, turn]]))
            history += gen + _ids(rnd, obs)
        out.append((f"agent-{a}", JobResult(job_id=f"agent-{a}", trajectory_id=str(a), handler="bench",
                                            reward=float(a % 2), trajectories=rows)))
    return out


def step(model, logps: list[torch.Tensor], masks: list[torch.Tensor], adv: list[float]) -> torch.Tensor:
    """One backward of the per-row loss; returns the flattened gradient."""
    model.zero_grad()
    loss = sum(-a * (lp * m).sum() for lp, m, a in zip(logps, masks, adv))
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def build_cost(name: str, results: list[tuple[str, JobResult]], repeats: int) -> tuple[GroupTree, dict]:
    """The server's build+verify of the group's tree (:func:`group_tree`: rows, provenance runs, radix tree,
    verification) beside the baseline, a trainer's build from the rows' tokens alone with a Python step per
    token (:func:`trainer_plugins.trl.tree_pack.build_prefix_tree`, no provenance, no verification), and the
    same build+verify as the route runs it, off the event loop (``asyncio.to_thread`` from a running loop: the
    executor hop included): the best of ``max(repeats, 15)``, in ms per 100k flat tokens, and the hop in us.
    Also build+verify on the results as the route holds them, parsed from their JSON (``parsed``): every row's
    token ids are then int objects of their own, and comparing two rows' tokens costs ~8 ns a token instead
    of ~0.6 ns for rows that share the objects (as the in-memory rows here do)."""
    ours, base, hopped, parsed_s = [], [], [], []
    rows = [t.prompt_ids + t.response_ids for _, r in results for t in r.trajectories]
    parsed = [(j, JobResult.model_validate_json(r.model_dump_json())) for j, r in results]
    for _ in range(max(repeats, 15)):  # cheap, and noisy on shared cores: the best of 15 at least
        t0 = time.perf_counter()
        tree = group_tree(name, results)
        ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        group_tree(name, parsed)
        parsed_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        build_prefix_tree(rows)
        base.append(time.perf_counter() - t0)

    async def off_loop() -> None:
        for _ in range(max(repeats, 15)):
            t0 = time.perf_counter()
            await asyncio.to_thread(group_tree, name, results)
            hopped.append(time.perf_counter() - t0)

    asyncio.run(off_loop())
    per = 1e5 * 1e3 / tree.flat_tokens
    return tree, {"build_verify_ms_per_100k": round(min(ours) * per, 2),
                  "build_verify_ms": round(min(ours) * 1e3, 3),
                  "parsed_build_verify_ms_per_100k": round(min(parsed_s) * per, 2),
                  "off_loop_ms_per_100k": round(min(hopped) * per, 2),
                  "executor_hop_us": round(max(0.0, min(hopped) - min(ours)) * 1e6, 1),
                  "baseline_token_build_ms_per_100k": round(min(base) * per, 2)}


def run(name: str, model, results: list[tuple[str, JobResult]], repeats: int, attention: str = "tree") -> dict:
    tree, cost = build_cost(name, results, repeats)
    print(f"{name:8} build: server build+verify {cost['build_verify_ms_per_100k']} ms/100k flat tokens "
          f"({cost['build_verify_ms']} ms for {tree.flat_tokens}; parsed rows "
          f"{cost['parsed_build_verify_ms_per_100k']}), off the loop {cost['off_loop_ms_per_100k']} "
          f"ms/100k (executor hop {cost['executor_hop_us']} us) vs baseline token-only build "
          f"{cost['baseline_token_build_ms_per_100k']} ms/100k", flush=True)
    if model is None:
        return {"group": name, "flat_tokens": tree.flat_tokens, "tree_tokens": tree.tree_tokens,
                "tree_token_ratio": round(tree.tree_token_ratio, 3), **cost}
    rows = [t.prompt_ids + t.response_ids for _, r in results for t in r.trajectories]
    # the loss mask of row position t >= 1 (what logprob index t - 1 predicts): per row from the trajectory,
    # packed from the tree's leaf (its own sampled runs; the tree shares replies re-sent as context)
    masks = [torch.tensor(([0] * len(t.prompt_ids) + t.loss_mask)[1:], dtype=torch.float32)
             for _, r in results for t in r.trajectories]
    from trainer_plugins.trl.tree_pack import tree_loss_masks  # here: --build-only runs on older trees too

    leaf_masks = tree_loss_masks(tree)
    adv = [r.reward - 0.5 for _, r in results for _ in r.trajectories]
    packed = pack([(n.parent, n.token_ids) for n in tree.nodes], [leaf.path for leaf in tree.leaves])
    times = {"rows": [], "packed": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        ref = per_row_logprobs(model, rows)
        g_ref = step(model, ref, masks, adv)
        times["rows"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        mask = ancestor_mask(packed, torch.float32) if attention == "dense" else None
        got, _ = packed_row_logprobs(model, packed, mask=mask)
        g_got = step(model, got, leaf_masks, adv)
        times["packed"].append(time.perf_counter() - t0)
    delta = max(float((a.detach() - b.detach()).abs().max()) for a, b in zip(got, ref))
    rel = float((g_got - g_ref).norm() / g_ref.norm())
    rows_s, packed_s = min(times["rows"]), min(times["packed"])
    out = {"group": name, "attention": attention, "rows": len(rows), "flat_tokens": tree.flat_tokens, "tree_tokens": tree.tree_tokens,
           "tree_token_ratio": round(tree.tree_token_ratio, 3),
           **cost,
           "rows_fwd_bwd_s": round(rows_s, 3), "packed_fwd_bwd_s": round(packed_s, 3),
           "speedup": round(rows_s / packed_s, 2), "ideal": round(1 / tree.tree_token_ratio, 2),
           "max_logprob_delta": delta, "grad_rel_delta": rel}
    print(f"{name:8} rows {len(rows):3}  flat {tree.flat_tokens:6} -> tree {tree.tree_tokens:6} "
          f"(ratio {tree.tree_token_ratio:.3f}, built+verified {out['build_verify_ms_per_100k']} ms/100k)  "
          f"fwd+bwd rows {rows_s:.2f} s vs packed ({attention} attention) {packed_s:.2f} s: {out['speedup']}x (ideal {out['ideal']}x)  "
          f"max |dlogp| {delta:.2g}  grad rel {rel:.2g}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--build-only", action="store_true", help="only the tree's build+verify cost (no model)")
    ap.add_argument("--attention", choices=("tree", "dense"), default="tree",
                    help="packed attention: node by node (SDPA models) or the dense S x S ancestor mask")
    ap.add_argument("--grpo-samples", type=int, default=8, help="samples of the GRPO group (8: 5.6k flat tokens)")
    args = ap.parse_args(argv)
    model = None
    if not args.build_only:
        from transformers import AutoModelForCausalLM

        from prorl_server.dev.tiny_model import build

        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_pretrained(build(ROOT / ".cache" / "tiny-model"),
                                                     attn_implementation="sdpa", dtype=torch.float32)
        # switched before the first timing, so both sides run the same model (the per-row forward through it
        # is SDPA's, bit for bit: tests/trainer/test_tree_pack.py)
        enable_tree_attention(model)
    load_before = os.getloadavg()[0]
    rnd = random.Random(args.seed)
    results = [run("grpo", model, grpo_group(rnd, samples=args.grpo_samples), args.repeats, args.attention),
               run("rewrite", model, rewrite_group(rnd), args.repeats, args.attention)]
    print(json.dumps({"benchmark": "tree_training", "torch_threads": torch.get_num_threads(),
                      "load_1min": [load_before, os.getloadavg()[0]], "groups": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
