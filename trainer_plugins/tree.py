"""The trainer's check of a group's trajectory tree (issue #34), written apart from the server's build so that
one cannot hide the other's bug: a tree is trained on only when every leaf gives back, position by position,
the row the trainer received (token, loss mask, weight version and routed experts of each generated token),
through a well-formed path. Anything else is refused with its reason, and the trainer trains on the rows
(:func:`verified_tree` counts the fallbacks).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from prorl_server.types import GroupTree, JobResult


class TreeCheckError(ValueError):
    """A tree that does not give back a row it names exactly (the message names the leaf and the position),
    or that is not a tree."""


def _row_of(t: Any) -> tuple[list[int], list[int], list[Optional[int]], Optional[list[Any]]]:
    """(tokens, loss mask, version of each generated token or None, routes of each generated token or None)
    over the row ``prompt_ids + response_ids``."""
    P, R = len(t.prompt_ids), len(t.response_ids)
    mask = [0] * P + [1 if m == 1 else 0 for m in (list(t.loss_mask[:R]) + [0] * R)[:R]]
    n = sum(mask)
    per_token = [v for v, c in t.version_runs for _ in range(c)]
    if len(per_token) != n:
        per_token = [None] * n  # no version runs for this row: unknown
    routes = t.sampled_routes()  # per generated token, from the positional record
    if not isinstance(routes, list) or len(routes) != n:
        routes = None
    return list(t.prompt_ids) + list(t.response_ids), mask, per_token, routes


#: The ``GroupTree.format_version`` values this checker reads: 1 (a node's ``sampled`` runs are every one of its
#: rows' loss mask) and 2 (each leaf's own ``sampled`` runs; a node's are their union).
FORMATS = (1, 2)


def check_tree(tree: GroupTree, results: Mapping[str, JobResult]) -> None:
    """Check ``tree`` against the job results the trainer holds (``job_id`` -> result): its format is one this
    checker reads; every node's parent comes before it and its depth is its parent's end; every leaf names a
    trajectory of a held result, its path runs root to leaf, and its nodes' tokens give that row's
    ``prompt_ids + response_ids``; the leaf's own ``sampled`` runs (format 1: its nodes') give the row's
    ``loss_mask`` and lie inside its nodes' sampled runs, whose version runs and routed experts give the
    version and route of each generated token; a token a node sampled that the leaf holds as context is shared
    only when neither the node nor the row has routes; its reward is the result's; every behaviour logprob is
    finite; the token counts are the tree's.

    Raises:
        TreeCheckError: the first failure, naming the leaf's job and trajectory and the row position.
    """
    if tree.format_version not in FORMATS:
        raise TreeCheckError(f"tree format {tree.format_version}: this plugin reads formats "
                             f"{', '.join(map(str, FORMATS))} (update the plugin)")
    nodes = tree.nodes
    for i, n in enumerate(nodes):
        if n.id != i or (n.parent is not None and not 0 <= n.parent < i):
            raise TreeCheckError(f"node {i}: its id or parent ({n.parent}) is not a node before it")
        parent_end = 0 if n.parent is None else nodes[n.parent].depth + len(nodes[n.parent].token_ids)
        if n.depth != parent_end:
            raise TreeCheckError(f"node {i}: depth {n.depth}, its parent ends at {parent_end}")
        if len(n.logprobs) != len(n.token_ids) or not all(math.isfinite(x) for x in n.logprobs):
            raise TreeCheckError(f"node {i}: logprobs are not one finite number per token")
    flat = 0
    for leaf in tree.leaves:
        where = f"job {leaf.job_id!r} trajectory {leaf.trajectory_index}"
        res = results.get(leaf.job_id)
        if res is None or not 0 <= leaf.trajectory_index < len(res.trajectories):
            raise TreeCheckError(f"{where}: not a row the trainer holds")
        t = res.trajectories[leaf.trajectory_index]
        ids, mask, versions, routes = _row_of(t)
        flat += len(ids)
        if leaf.prompt_len != len(t.prompt_ids) or leaf.length != len(ids):
            raise TreeCheckError(f"{where}: prompt length or length differs from the row")
        if leaf.reward != res.reward:
            raise TreeCheckError(f"{where}: reward {leaf.reward} differs from the result's {res.reward}")
        got_ids: list[int] = []
        node_mask: list[int] = []  # per row position: 1 where the path's node sampled the token
        got_versions: list[Optional[int]] = []  # per row position: the node's version of a sampled token
        got_routes: list[Any] = []  # per row position: the node's route of a sampled token, or None
        parent = None
        for nid in leaf.path:
            if not 0 <= nid < len(nodes) or nodes[nid].parent != parent:
                raise TreeCheckError(f"{where}: path {leaf.path} is not a root-to-leaf path at node {nid}")
            n = nodes[nid]
            m = [0] * len(n.token_ids)
            for s, e in n.sampled:
                if not 0 <= s < e <= len(m):
                    raise TreeCheckError(f"node {nid}: sampled run [{s}, {e}) leaves the node")
                m[s:e] = [1] * (e - s)
            node_versions = [v for v, c in n.version_runs for _ in range(c)]
            if len(node_versions) != sum(m) or (n.routed_experts is not None and len(n.routed_experts) != sum(m)):
                raise TreeCheckError(f"node {nid}: version runs or routes do not count its sampled tokens")
            v_iter, r_iter = iter(node_versions), iter(n.routed_experts or ())
            got_ids += n.token_ids
            node_mask += m
            got_versions += [next(v_iter) if x else None for x in m]
            got_routes += [(next(r_iter) if n.routed_experts is not None else None) if x else None for x in m]
            parent = nid

        def first(a: list, b: list) -> int:
            return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

        if got_ids != ids:
            raise TreeCheckError(f"{where}: tokens differ at row position {first(got_ids, ids)}")
        if leaf.sampled is None or tree.format_version == 1:
            got_mask = node_mask
        else:
            got_mask = [0] * len(ids)
            last = 0
            for s, e in leaf.sampled:
                if not last <= s < e <= len(ids):
                    raise TreeCheckError(f"{where}: sampled run [{s}, {e}) is out of order or leaves the row")
                got_mask[s:e] = [1] * (e - s)
                last = e
        if got_mask != mask:
            raise TreeCheckError(f"{where}: loss mask differs at row position {first(got_mask, mask)}")
        for p, (x, y) in enumerate(zip(got_mask, node_mask)):
            if x and not y:
                raise TreeCheckError(f"{where}: loss mask differs at row position {p} (sampled in the leaf, "
                                     f"not by its node)")
            if y and not x and (got_routes[p] is not None or t.routed_experts is not None):
                raise TreeCheckError(f"{where}: routed experts differ at row position {p} (a token sampled with "
                                     f"routes shared as context)")
        sampled_at = [p for p, x in enumerate(mask) if x]
        leaf_versions = [got_versions[p] for p in sampled_at]
        if leaf_versions != versions:
            k = first(leaf_versions, versions)
            raise TreeCheckError(f"{where}: weight version differs at row position "
                                 f"{sampled_at[k] if k < len(sampled_at) else len(ids)}")
        leaf_routes = [got_routes[p] for p in sampled_at]
        if routes is not None and leaf_routes != routes:
            k = first(leaf_routes, routes)
            raise TreeCheckError(f"{where}: routed experts differ at row position "
                                 f"{sampled_at[k] if k < len(sampled_at) else len(ids)}")
    if tree.flat_tokens != flat or tree.tree_tokens != sum(len(n.token_ids) for n in nodes):
        raise TreeCheckError(f"token counts: the tree says flat {tree.flat_tokens} / tree {tree.tree_tokens}, "
                             f"its rows and nodes hold {flat} / {sum(len(n.token_ids) for n in nodes)}")


def leaf_loss_mask(tree: GroupTree, k: int) -> list[int]:
    """The loss mask of leaf ``k`` over its whole row (list[int] of length ``leaf.length``: 1 where the row
    generated the token): its own ``sampled`` runs (format 2), or its nodes' (format 1). The row trains on
    these tokens only; a shared node's other sampled tokens are context here. Meant for a tree
    :func:`check_tree` accepted; runs outside the row are clipped to it."""
    leaf = tree.leaves[k]
    mask = [0] * leaf.length
    if leaf.sampled is not None and tree.format_version >= 2:
        runs = [(s, e) for s, e in leaf.sampled]
    else:
        runs = [(tree.nodes[n].depth + s, tree.nodes[n].depth + e) for n in leaf.path for s, e in tree.nodes[n].sampled]
    for s, e in runs:  # clamped: a tree not yet checked must not make it allocate past the row
        s, e = max(0, s), min(e, leaf.length)
        if s < e:
            mask[s:e] = [1] * (e - s)
    return mask


@dataclass
class TreeStats:
    """What the trainer did with the trees it received: ``verified`` (trained as trees) and ``fallbacks``
    (refused: trained as rows), with the reasons of the refusals counted by what failed, and the last refusal's
    whole reason (leaf and row position)."""

    verified: int = 0
    fallbacks: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    last_reason: Optional[str] = None


def verified_tree(tree: Optional[GroupTree], results: Mapping[str, JobResult],
                  stats: Optional[TreeStats] = None) -> Optional[GroupTree]:
    """``tree`` when :func:`check_tree` passes, else None (train on the rows), counted in ``stats``. A tree
    with missing jobs is checked on the rows it has; the caller decides whether a partial group trains."""
    stats = stats if stats is not None else TreeStats()
    if tree is None:
        reason = "no tree"
    else:
        try:
            check_tree(tree, results)
        except TreeCheckError as e:
            reason = str(e)
        else:
            stats.verified += 1
            return tree
    stats.fallbacks += 1
    stats.last_reason = reason
    # counted by what failed ("tokens differ", "loss mask differs"), not by which leaf
    what = reason.split(": ", 1)[1] if reason.startswith("job ") and ": " in reason else reason
    key = what.split(" at ")[0][:80]
    stats.reasons[key] = stats.reasons.get(key, 0) + 1
    return None
