"""A group's trajectory tree (issue #34): the prefix tree of the rows of a group's jobs, built and verified from
their token streams and provenance, for ``GET /groups/{group_id}/tree``.

A *row* is one trajectory's ``prompt_ids + response_ids``. Two rows share a tree node only where they have the
same token with the same provenance at every position of it: sampled or not, and for a sampled token the same
weight version and the same routed-expert record (so a node never merges tokens sampled under other weights,
or the same tokens once sampled and once given as prompt). The tree is a radix tree (a compressed trie, Knuth,
TAOCP vol. 3, 6.3 "Patricia") over those (token, provenance) pairs; its longest common prefixes are found by
comparing list slices (C speed), so building costs O(flat tokens) comparisons at a few ns each and Python work
per node, not per token.

Pure functions: no I/O, no event loop; the route runs them in a worker thread.
"""
from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from prorl_server.types import (GroupTree, JobResult, MissingJob, TreeLeaf, TreeNode, mask_runs, runs_slice,
                                sampled_runs_versions)

#: Tokens compared per slice when a longest common prefix is searched within a node that differs.
_CHUNK = 256


class TreeInvariantError(ValueError):
    """A tree that does not give back one of its rows exactly: names the leaf (job id, trajectory index) and
    the first row position that differs."""

    def __init__(self, job_id: str, index: int, position: int, what: str) -> None:
        super().__init__(f"leaf {job_id!r} trajectory {index}: {what} at row position {position}")
        self.job_id, self.index, self.position, self.what = job_id, index, position, what


@dataclass
class Row:
    """One trajectory as the tree sees it. All lists have the row's length T = ``prompt_len`` + R.

    ``prov[i]``: None for a token the model did not generate; for a generated one ``(version,)`` or, with
    routed experts recorded, ``(version, route as compact JSON)``. ``runs``: the maximal runs ``(start, end,
    prov)`` of equal ``prov``. ``logprobs[i]``: the behaviour logprob (0.0 where not generated). ``routes[i]``:
    the routed-expert record of a generated token (None elsewhere), or ``routes`` None when the trajectory has
    none."""

    job_id: str
    index: int
    reward: float
    prompt_len: int
    ids: list[int]
    prov: list[Optional[tuple]]
    runs: list[tuple[int, int, Optional[tuple]]]
    logprobs: list[float]
    routes: Optional[list[Any]]


def rows_of(job_id: str, result: JobResult) -> list[Row]:
    """The rows of ``result``'s trajectories. Without routed experts the lists are built a run at a time (one
    list operation per segment and version run), not a token at a time."""
    out = []
    for k, t in enumerate(result.trajectories):
        P, R = len(t.prompt_ids), len(t.response_ids)
        segments = mask_runs(t.loss_mask, R)
        n_sampled = sum(j - i for i, j, generated in segments if generated)
        versions = (t.version_runs if sum(n for _, n in t.version_runs) == n_sampled
                    else [[None, n_sampled]])  # unknown: prorl_server.types.sampled_runs_versions
        recorded = getattr(t, "routed_experts", None)
        recorded = recorded if isinstance(recorded, list) and len(recorded) == n_sampled else None
        if recorded is not None:
            tags = [(v, json.dumps(r, separators=(",", ":")))
                    for v, r in zip(sampled_runs_versions(t.version_runs, n_sampled), recorded)]
        prov: list[Optional[tuple]] = [None] * P
        runs: list[tuple[int, int, Optional[tuple]]] = [(0, P, None)] if P else []
        routes: Optional[list[Any]] = [None] * P if recorded is not None else None
        lps = [0.0] * P + t.response_logprobs[:R]  # floats already (pydantic)
        lps += [0.0] * (P + R - len(lps))
        s = 0  # generated tokens before the segment
        for i, j, sampled in segments:
            n = j - i
            if not sampled:
                prov += [None] * n
                runs.append((P + i, P + j, None))
                lps[P + i:P + j] = [0.0] * n
                if routes is not None:
                    routes += [None] * n
            elif recorded is not None:
                prov += tags[s:s + n]
                runs += [(P + i + q, P + i + q + 1, tag) for q, tag in enumerate(tags[s:s + n])]
                routes += recorded[s:s + n]
            else:
                at = P + i
                for v, c in runs_slice(versions, s, n):
                    prov += [(v,)] * c
                    runs.append((at, at + c, (v,)))
                    at += c
            s += n if sampled else 0
        out.append(Row(job_id, k, float(result.reward), P, list(t.prompt_ids) + list(t.response_ids), prov,
                       runs, lps, routes))
    return out


class _Node:
    """A node while the tree grows: positions [start, end) of row ``row``'s lists (nothing is copied)."""

    __slots__ = ("row", "start", "end", "parent", "children")

    def __init__(self, row: int, start: int, end: int, parent: Optional["_Node"]) -> None:
        self.row, self.start, self.end, self.parent = row, start, end, parent
        self.children: dict[tuple, _Node] = {}


def _lcp(a: Row, i: int, b: Row, j: int, n: int) -> int:
    """The length of the longest common prefix (token and provenance) of ``a`` from ``i`` and ``b`` from
    ``j``, at most ``n``: whole slices first, then chunks, then one chunk token by token."""
    if a.ids[i:i + n] == b.ids[j:j + n] and a.prov[i:i + n] == b.prov[j:j + n]:
        return n
    lo = 0
    while lo < n:
        hi = min(n, lo + _CHUNK)
        if a.ids[i + lo:i + hi] != b.ids[j + lo:j + hi] or a.prov[i + lo:i + hi] != b.prov[j + lo:j + hi]:
            for k in range(lo, hi):
                if a.ids[i + k] != b.ids[j + k] or a.prov[i + k] != b.prov[j + k]:
                    return k
        lo = hi
    return n


def _key(row: Row, pos: int) -> tuple:
    return row.ids[pos], row.prov[pos]


def build_tree(group_id: str, rows: Sequence[Row], missing: Sequence[MissingJob] = ()) -> GroupTree:
    """The prefix tree of ``rows`` (radix-tree insertion, one row after another). Nodes are numbered in
    depth-first order, children in the order rows first reached them, so a subtree is contiguous.
    Not verified: see :func:`verify_tree`."""
    root = _Node(-1, 0, 0, None)
    ends: list[_Node] = []
    for r, row in enumerate(rows):
        node, pos, n = root, 0, len(row.ids)
        while pos < n:
            child = node.children.get(_key(row, pos))
            if child is None:
                child = _Node(r, pos, n, node)
                node.children[_key(row, pos)] = child
                node, pos = child, n
                break
            owner = rows[child.row]
            length = child.end - child.start
            m = _lcp(row, pos, owner, child.start, min(length, n - pos))
            if m < length:  # split: a new head node takes [start, start + m); the child keeps its tail,
                # its children and every row that ends in it
                head = _Node(child.row, child.start, child.start + m, node)
                node.children[_key(owner, child.start)] = head
                child.parent, child.start = head, child.start + m
                head.children[_key(owner, child.start)] = child
                child = head
            node, pos = child, pos + m
        ends.append(node)

    nodes: list[TreeNode] = []
    number: dict[int, int] = {}
    starts = [[a for a, _, _ in row.runs] for row in rows]
    stack = list(reversed(list(root.children.values())))
    while stack:
        x = stack.pop()
        number[id(x)] = len(nodes)
        owner = rows[x.row]
        sampled: list[tuple[int, int]] = []
        versions: list[list] = []
        routes: Optional[list[Any]] = [] if owner.routes is not None else None
        r = bisect.bisect_right(starts[x.row], x.start) - 1
        while r < len(owner.runs) and owner.runs[r][0] < x.end:
            a, b, p = owner.runs[r]
            a, b = max(a, x.start) - x.start, min(b, x.end) - x.start
            r += 1
            if p is None or a >= b:
                continue
            if sampled and sampled[-1][1] == a:
                sampled[-1] = (sampled[-1][0], b)
            else:
                sampled.append((a, b))
            if versions and versions[-1][0] == p[0]:
                versions[-1][1] += b - a
            else:
                versions.append([p[0], b - a])
            if routes is not None:
                routes += owner.routes[x.start + a:x.start + b]
        nodes.append(TreeNode.model_construct(id=len(nodes), parent=number[id(x.parent)] if x.parent is not root else None,
                              depth=x.start, token_ids=owner.ids[x.start:x.end], sampled=sampled,
                              logprobs=owner.logprobs[x.start:x.end], version_runs=[tuple(v) for v in versions],
                              routed_experts=routes))
        stack.extend(reversed(list(x.children.values())))

    leaves = []
    for row, end in zip(rows, ends):
        path = []
        x = end
        while x is not root:
            path.append(number[id(x)])
            x = x.parent
        leaves.append(TreeLeaf.model_construct(job_id=row.job_id, trajectory_index=row.index, path=path[::-1],
                               prompt_len=row.prompt_len, length=len(row.ids), reward=row.reward))
    flat = sum(len(r.ids) for r in rows)
    tree_tokens = sum(len(x.token_ids) for x in nodes)
    return GroupTree(group_id=group_id, nodes=nodes, leaves=leaves, missing=list(missing),
                     complete=not missing, flat_tokens=flat, tree_tokens=tree_tokens,
                     tree_token_ratio=tree_tokens / flat if flat else 1.0)


def _node_prov(node: TreeNode) -> list[Optional[tuple]]:
    """What a node says of each of its tokens, in a :class:`Row`'s ``prov`` form, built a run at a time.
    Raises ValueError when its sampled runs, version runs, routes and logprobs do not fit together, its
    sampled runs leave it, or a logprob is not finite."""
    L = len(node.token_ids)
    out: list[Optional[tuple]] = []
    n_sampled = sum(e - s for s, e in node.sampled)
    if (sum(n for _, n in node.version_runs) != n_sampled or len(node.logprobs) != L
            or (node.routed_experts is not None and len(node.routed_experts) != n_sampled)):
        raise ValueError(f"node {node.id}'s version runs, routes or logprobs do not fit its tokens")
    at = k = 0
    for s, e in node.sampled:
        if not at <= s < e <= L:
            raise ValueError(f"node {node.id}'s sampled run [{s}, {e}) is out of order or leaves it")
        out += [None] * (s - at)
        if node.routed_experts is None:
            for v, c in runs_slice(node.version_runs, k, e - s):
                out += [(v,)] * c
        else:
            versions = [v for v, c in runs_slice(node.version_runs, k, e - s) for _ in range(c)]
            out += [(v, json.dumps(r, separators=(",", ":")))
                    for v, r in zip(versions, node.routed_experts[k:k + e - s])]
        k += e - s
        at = e
    out += [None] * (L - at)
    if not math.isfinite(math.fsum(node.logprobs)):
        raise ValueError(f"node {node.id} has a behaviour logprob that is not finite")
    return out


def _first_difference(a: Sequence, b: Sequence) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def verify_tree(tree: GroupTree, rows: Sequence[Row]) -> float:
    """Check ``tree`` against the rows it was built from (``rows[i]`` is ``tree.leaves[i]``'s): each leaf's
    path runs from a root down parent links with depths that add up; the nodes' tokens concatenated give the
    row's tokens; their sampled runs give its ``loss_mask``; their version runs and routed experts give the
    version and route of each of its generated tokens (so no node merges rows of different provenance); and
    the token counts are right. Each node is expanded once; a leaf is compared a node at a time by list
    slices.

    Returns the largest difference between a row's behaviour logprob and its shared node's (the tree's
    ``max_logprob_spread``).

    Raises:
        TreeInvariantError: the first leaf that fails, with its first differing row position.
        ValueError: a node or the token counts do not fit together.
    """
    if len(tree.leaves) != len(rows):
        raise ValueError(f"{len(tree.leaves)} leaves for {len(rows)} rows")
    nodes = tree.nodes
    provs = [_node_prov(x) for x in nodes]
    spread = 0.0
    for leaf, row in zip(tree.leaves, rows):
        def fail(pos: int, what: str) -> TreeInvariantError:
            return TreeInvariantError(row.job_id, row.index, pos, what)

        if (leaf.job_id, leaf.trajectory_index, leaf.prompt_len, leaf.length) != (
                row.job_id, row.index, row.prompt_len, len(row.ids)):
            raise fail(0, "the leaf names another row")
        pos, parent = 0, None
        for nid in leaf.path:
            if not 0 <= nid < len(nodes):
                raise fail(pos, f"unknown node {nid}")
            node = nodes[nid]
            if node.parent != parent or node.depth != pos:
                raise fail(pos, f"node {nid} is not the child of node {parent} at depth {pos}")
            L = len(node.token_ids)
            if pos + L > len(row.ids):
                raise fail(len(row.ids), f"node {nid} runs past the row's end")
            if node.token_ids != row.ids[pos:pos + L]:
                raise fail(pos + _first_difference(node.token_ids, row.ids[pos:pos + L]), f"node {nid}'s token differs")
            if provs[nid] != row.prov[pos:pos + L]:
                k = _first_difference(provs[nid], row.prov[pos:pos + L])
                mine, theirs = provs[nid][k], row.prov[pos + k]
                what = ("loss mask" if (mine is None) != (theirs is None) else
                        "weight version" if mine[0] != theirs[0] else "routed experts")
                raise fail(pos + k, f"node {nid}'s {what} differs")
            if node.logprobs != row.logprobs[pos:pos + L]:
                for k, (a, b) in enumerate(zip(node.logprobs, row.logprobs[pos:pos + L])):
                    d = abs(a - b)
                    if not math.isfinite(d):
                        raise fail(pos + k, f"row's behaviour logprob is not finite (node {nid})")
                    spread = max(spread, d)
            pos, parent = pos + L, nid
        if pos != len(row.ids):
            raise fail(pos, "the path ends before the row")
    if tree.flat_tokens != sum(len(r.ids) for r in rows) or tree.tree_tokens != sum(len(x.token_ids)
                                                                                     for x in nodes):
        raise ValueError("the tree's token counts are wrong")
    return spread


def group_tree(group_id: str, results: Sequence[tuple[str, JobResult]],
               missing: Sequence[MissingJob] = ()) -> GroupTree:
    """Build and verify the tree of ``results`` (``(job_id, result)`` of the group's ended jobs with rows):
    what the route answers. Raises :class:`TreeInvariantError` for a tree that fails its invariants (a bug
    here, never served)."""
    rows = [row for job_id, result in results for row in rows_of(job_id, result)]
    tree = build_tree(group_id, rows, missing)
    tree.max_logprob_spread = verify_tree(tree, rows)
    return tree


def tree_of_results(group_id: str, ended: Sequence[tuple[str, bytes]],
                    missing: Sequence[tuple[str, str]] = ()) -> GroupTree:
    """The route's work, off the event loop: parse the ended jobs' results (``(job_id, result JSON)``), leave
    out the filtered ones and those without trajectories (named in ``missing`` with why), then
    :func:`group_tree`. Raises :class:`TreeInvariantError` as :func:`group_tree` does."""
    gone = [MissingJob(job_id=j, reason=r) for j, r in missing]
    results = []
    for job_id, body in ended:
        result = JobResult.model_validate_json(body)
        if result.filter:
            gone.append(MissingJob(job_id=job_id, reason=f"filtered: {result.failure_kind or 'by its handler'}"))
        elif not result.trajectories:
            gone.append(MissingJob(job_id=job_id, reason="no trajectories"))
        else:
            results.append((job_id, result))
    return group_tree(group_id, results, gone)
