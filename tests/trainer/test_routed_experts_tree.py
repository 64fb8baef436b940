"""Routed experts (R3) in group trees (issue #32 part 7 with #34): rows whose tokens and weight versions match but
whose recorded routes differ at a generated token never share that token's node, and both the server's check and
the trainer's give back each row's own routes. Plain data, no stand-ins."""
from __future__ import annotations

from prorl_server.tree import build_tree, rows_of, verify_tree
from prorl_server.types import JobResult, Trajectory
from trainer_plugins.tree import check_tree

PROMPT = [5, 6, 7, 8]
RESPONSE = [20, 21, 22, 30, 31, 23, 24]  # sampled 20 21 22 | observation 30 31 | sampled 23 24
MASK = [1, 1, 1, 0, 0, 1, 1]


def result(job_id: str, route_at_9: list[list[int]]) -> JobResult:
    # one route per row position but the last (10 of 11 tokens): [layers=2][top_k=2]
    routes = [[[t % 8, 1], [2, 3]] for t in range(len(PROMPT) + len(RESPONSE) - 1)]
    routes[9] = route_at_9  # the last turn's first generated token (response position 5)
    t = Trajectory(prompt_ids=PROMPT, response_ids=RESPONSE, response_logprobs=[-.5 if m else 0.0 for m in MASK],
                   loss_mask=MASK, version_runs=[[3, 5]], routed_experts=routes)
    return JobResult(job_id=job_id, trajectory_id=job_id, handler="h", reward=1.0, trajectories=[t])


def test_equal_tokens_routed_through_other_experts_never_share_a_node():
    results = {"a": result("a", [[0, 1], [2, 3]]), "b": result("b", [[4, 5], [2, 3]])}
    rows = [r for j, res in results.items() for r in rows_of(j, res)]
    tree = build_tree("g", rows)
    verify_tree(tree, rows)
    check_tree(tree, results)
    a, b = (leaf.path for leaf in tree.leaves)
    # shared up to the token whose routes differ (row position 9), split there
    assert a[:-1] == b[:-1] and a[-1] != b[-1] and tree.nodes[a[-1]].depth == 9
    for leaf in tree.leaves:
        got = [r for nid in leaf.path for r in (tree.nodes[nid].routed_experts or [])]
        assert got == results[leaf.job_id].trajectories[0].sampled_routes()
    same = {"a": result("a", [[0, 1], [2, 3]]), "b": result("b", [[0, 1], [2, 3]])}
    assert len(build_tree("g", [r for j, res in same.items() for r in rows_of(j, res)]).leaves[0].path) == 1
