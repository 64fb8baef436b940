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
    """One trajectory as the tree sees it: ``ids`` = ``prompt_ids + response_ids`` (length T = ``prompt_len`` +
    R) and what made each token, run-length encoded.

    ``runs``: the maximal runs ``(start, end, prov)`` (row positions, covering ``[0, T)``) of equal
    provenance: ``prov`` None for a token the model did not generate; for a generated one ``(version,)`` or,
    with routed experts recorded, ``(version, route as compact JSON)`` (one run per token then).
    ``run_starts``: the runs' starts (for bisection). ``response_logprobs``: the trajectory's list (not copied;
    entries past its end read 0.0); a non-generated token's behaviour logprob is 0.0 whatever it holds.
    ``routes``: the trajectory's routed-expert records, one per generated token, or None."""

    job_id: str
    index: int
    reward: float
    prompt_len: int
    ids: list[int]
    runs: list[tuple[int, int, Optional[tuple]]]
    run_starts: list[int]
    response_logprobs: list[float]
    routes: Optional[list[Any]]

    def logprobs(self, a: int, b: int) -> list[float]:
        """The behaviour logprobs of generated row positions ``[a, b)`` (all generated, ``a >= prompt_len``)."""
        P = self.prompt_len
        got = self.response_logprobs[a - P:b - P]
        return got if len(got) == b - a else got + [0.0] * (b - a - len(got))


def _merge_runs(runs: list[tuple[int, int, Optional[tuple]]]) -> list[tuple[int, int, Optional[tuple]]]:
    """``runs`` with adjacent runs of equal provenance joined and empty ones left out."""
    out: list[tuple[int, int, Optional[tuple]]] = []
    for a, b, p in runs:
        if a >= b:
            continue
        if out and out[-1][2] == p and out[-1][1] == a:
            out[-1] = (out[-1][0], b, p)
        else:
            out.append((a, b, p))
    return out


def rows_of(job_id: str, result: JobResult) -> list[Row]:
    """The rows of ``result``'s trajectories: a list concatenation per row and one run per segment and version
    run (one per token only for routed experts), never a Python step per token."""
    out = []
    for k, t in enumerate(result.trajectories):
        P, R = len(t.prompt_ids), len(t.response_ids)
        segments = mask_runs(t.loss_mask, R)
        n_sampled = sum(j - i for i, j, generated in segments if generated)
        versions = (t.version_runs if sum(n for _, n in t.version_runs) == n_sampled
                    else [[None, n_sampled]])  # unknown: prorl_server.types.sampled_runs_versions
        recorded = t.sampled_routes()  # per generated token, from the positional record
        recorded = recorded if isinstance(recorded, list) and len(recorded) == n_sampled else None
        if recorded is not None:
            tags = [(v, json.dumps(r, separators=(",", ":")))
                    for v, r in zip(sampled_runs_versions(t.version_runs, n_sampled), recorded)]
        runs: list[tuple[int, int, Optional[tuple]]] = [(0, P, None)]
        s = 0  # generated tokens before the segment
        for i, j, sampled in segments:
            if not sampled:
                runs.append((P + i, P + j, None))
                continue
            if recorded is not None:
                runs += [(P + i + q, P + i + q + 1, tag) for q, tag in enumerate(tags[s:s + j - i])]
            else:
                at = P + i
                for v, c in runs_slice(versions, s, j - i):
                    runs.append((at, at + c, (v,)))
                    at += c
            s += j - i
        runs = _merge_runs(runs)
        out.append(Row(job_id, k, float(result.reward), P, list(t.prompt_ids) + list(t.response_ids), runs,
                       [a for a, _, _ in runs], t.response_logprobs, recorded))
    return out


class _Node:
    """A node while the tree grows: positions [start, end) of row ``row``'s lists (nothing is copied)."""

    __slots__ = ("row", "start", "end", "parent", "children")

    def __init__(self, row: int, start: int, end: int, parent: Optional["_Node"]) -> None:
        self.row, self.start, self.end, self.parent = row, start, end, parent
        self.children: dict[tuple, _Node] = {}


def _prov_at(row: Row, pos: int) -> Optional[tuple]:
    return row.runs[bisect.bisect_right(row.run_starts, pos) - 1][2]


def _same_prov(a: Row, b: Row, pos: int, n: int) -> int:
    """How many positions from ``pos`` (at most ``n``) ``a`` and ``b`` have equal provenance: a walk over
    their runs, not their tokens."""
    end = pos + n
    ra = bisect.bisect_right(a.run_starts, pos) - 1
    rb = bisect.bisect_right(b.run_starts, pos) - 1
    at = pos
    while at < end:
        _, ea, pa = a.runs[ra]
        _, eb, pb = b.runs[rb]
        if pa != pb:
            return at - pos
        at = min(ea, eb)
        ra += ea == at
        rb += eb == at
    return n


def _same_ids(a: list[int], b: list[int], pos: int, n: int) -> int:
    """The length of the longest common prefix of ``a[pos:]`` and ``b[pos:]``, at most ``n``: the whole
    slices compared first (C speed), then chunks, then one chunk token by token."""
    if a[pos:pos + n] == b[pos:pos + n]:
        return n
    lo = 0
    while lo < n:
        hi = min(n, lo + _CHUNK)
        if a[pos + lo:pos + hi] != b[pos + lo:pos + hi]:
            return next(k for k in range(lo, hi) if a[pos + k] != b[pos + k])
        lo = hi
    return n


def _lcp(a: Row, b: Row, pos: int, n: int) -> int:
    """The longest common prefix (token and provenance) of rows ``a`` and ``b`` from row position ``pos``, at
    most ``n``: provenance a run at a time, then tokens up to where it differs."""
    return _same_ids(a.ids, b.ids, pos, _same_prov(a, b, pos, n))


def build_tree(group_id: str, rows: Sequence[Row], missing: Sequence[MissingJob] = ()) -> GroupTree:
    """The prefix tree of ``rows`` (radix-tree insertion, one row after another). Nodes are numbered in
    depth-first order, children in the order rows first reached them, so a subtree is contiguous.
    Not verified: see :func:`verify_tree`."""
    root = _Node(-1, 0, 0, None)
    ends: list[_Node] = []
    for r, row in enumerate(rows):
        node, pos, n = root, 0, len(row.ids)
        while pos < n:
            key = (row.ids[pos], _prov_at(row, pos))
            child = node.children.get(key)
            if child is None:
                child = _Node(r, pos, n, node)
                node.children[key] = child
                node, pos = child, n
                break
            length = child.end - child.start  # child.start == pos: a node starts at its depth in every row
            m = _lcp(row, rows[child.row], pos, min(length, n - pos))
            if m < length:  # split: a new head node takes [start, start + m); the child keeps its tail,
                # its children and every row that ends in it
                owner = rows[child.row]
                head = _Node(child.row, child.start, child.start + m, node)
                node.children[key] = head
                child.parent, child.start = head, child.start + m
                head.children[(owner.ids[child.start], _prov_at(owner, child.start))] = child
                child = head
            node, pos = child, pos + m
        ends.append(node)

    nodes: list[TreeNode] = []
    number: dict[int, int] = {}
    stack = list(reversed(list(root.children.values())))
    while stack:
        x = stack.pop()
        number[id(x)] = len(nodes)
        owner = rows[x.row]
        sampled: list[tuple[int, int]] = []
        versions: list[tuple] = []
        logprobs: list[float] = []
        routes: Optional[list[Any]] = [] if owner.routes is not None else None
        r = bisect.bisect_right(owner.run_starts, x.start) - 1
        while r < len(owner.runs) and owner.runs[r][0] < x.end:
            a, b, p = owner.runs[r]
            a, b = max(a, x.start), min(b, x.end)
            r += 1
            if p is None:
                logprobs += [0.0] * (b - a)
                continue
            logprobs += owner.logprobs(a, b)
            a, b = a - x.start, b - x.start
            if sampled and sampled[-1][1] == a:
                sampled[-1] = (sampled[-1][0], b)
            else:
                sampled.append((a, b))
            if versions and versions[-1][0] == p[0]:
                versions[-1] = (p[0], versions[-1][1] + b - a)
            else:
                versions.append((p[0], b - a))
        if routes is not None:
            # the generated tokens of the owner before the node, then the node's
            k = sum(min(b, x.start) - a for a, b, p in owner.runs if p is not None and a < x.start)
            routes = owner.routes[k:k + sum(e - s for s, e in sampled)]
        nodes.append(TreeNode.model_construct(
            id=len(nodes), parent=number[id(x.parent)] if x.parent is not root else None, depth=x.start,
            token_ids=owner.ids[x.start:x.end], sampled=sampled, logprobs=logprobs, version_runs=versions,
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


def _node_runs(node: TreeNode) -> list[tuple[int, int, Optional[tuple]]]:
    """What a node says of its tokens as provenance runs in a :class:`Row`'s ``runs`` form (row positions,
    from its ``depth``; maybe empty or unmerged), built a run at a time (a token at a time only for routed
    experts). Raises ValueError when its sampled runs, version runs, routes and logprobs do not fit together,
    its sampled runs leave it, a token it did not generate has a logprob other than 0.0, or a logprob is not
    finite."""
    L, d = len(node.token_ids), node.depth
    n_sampled = sum(e - s for s, e in node.sampled)
    if (sum(n for _, n in node.version_runs) != n_sampled or len(node.logprobs) != L
            or (node.routed_experts is not None and len(node.routed_experts) != n_sampled)):
        raise ValueError(f"node {node.id}'s version runs, routes or logprobs do not fit its tokens")
    lps = node.logprobs
    out: list[tuple[int, int, Optional[tuple]]] = []
    at = k = 0  # node offset after the last sampled run; generated tokens before it
    for s, e in list(node.sampled) + [(L, L)]:
        if not at <= s <= e <= L or (s == e and s != L):
            raise ValueError(f"node {node.id}'s sampled run [{s}, {e}) is out of order or leaves it")
        out.append((d + at, d + s, None))
        if any(lps[at:s]):
            raise ValueError(f"node {node.id} gives a token it did not generate a behaviour logprob")
        if node.routed_experts is None:
            q = s
            for v, c in runs_slice(node.version_runs, k, e - s):
                out.append((d + q, d + q + c, (v,)))
                q += c
        else:
            versions = [v for v, c in runs_slice(node.version_runs, k, e - s) for _ in range(c)]
            out += [(d + s + q, d + s + q + 1, (v, json.dumps(r, separators=(",", ":"))))
                    for q, (v, r) in enumerate(zip(versions, node.routed_experts[k:k + e - s]))]
        k += e - s
        at = e
    if not math.isfinite(math.fsum(lps)):
        raise ValueError(f"node {node.id} has a behaviour logprob that is not finite")
    return out


def _first_difference(a: Sequence, b: Sequence) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _prov_difference(mine: list[tuple[int, int, Optional[tuple]]], theirs: list[tuple[int, int, Optional[tuple]]]
                     ) -> tuple[int, str]:
    """The first row position where two run lists (merged, from 0) differ, and what differs there: a
    difference starts at a run boundary of one of them."""
    def at(runs: list, pos: int) -> Any:
        r = bisect.bisect_right([a for a, _, _ in runs], pos) - 1
        return runs[r][2] if 0 <= r and pos < runs[r][1] else "end"

    for pos in sorted({a for a, _, _ in mine} | {a for a, _, _ in theirs}):
        p, q = at(mine, pos), at(theirs, pos)
        if p != q:
            what = ("loss mask" if "end" in (p, q) or (p is None) != (q is None) else
                    "weight version" if p[0] != q[0] else "routed experts")
            return pos, what
    return 0, "loss mask"


def verify_tree(tree: GroupTree, rows: Sequence[Row]) -> float:
    """Check ``tree`` against the rows it was built from (``rows[i]`` is ``tree.leaves[i]``'s): each leaf's
    path runs from a root down parent links with depths that add up; the nodes' tokens concatenated give the
    row's tokens; their sampled runs give its ``loss_mask``; their version runs and routed experts give the
    version and route of each of its generated tokens (so no node merges rows of different provenance); and
    the token counts are right. One pass: each node is expanded once (its provenance as runs), and a leaf is
    compared by one list comparison of its path's concatenated tokens with the row's, one of its path's
    provenance runs with the row's, and one of each sampled run's behaviour logprobs.

    Returns the largest difference between a row's behaviour logprob and its shared node's (the tree's
    ``max_logprob_spread``).

    Raises:
        TreeInvariantError: the first leaf that fails, with its first differing row position.
        ValueError: a node or the token counts do not fit together.
    """
    if len(tree.leaves) != len(rows):
        raise ValueError(f"{len(tree.leaves)} leaves for {len(rows)} rows")
    nodes = tree.nodes
    node_runs = [_node_runs(x) for x in nodes]
    spread = 0.0
    for leaf, row in zip(tree.leaves, rows):
        def fail(pos: int, what: str) -> TreeInvariantError:
            return TreeInvariantError(row.job_id, row.index, pos, what)

        if (leaf.job_id, leaf.trajectory_index, leaf.prompt_len, leaf.length) != (
                row.job_id, row.index, row.prompt_len, len(row.ids)):
            raise fail(0, "the leaf names another row")
        pos, parent = 0, None
        ids: list[int] = []
        runs: list[tuple[int, int, Optional[tuple]]] = []
        for nid in leaf.path:
            if not 0 <= nid < len(nodes):
                raise fail(pos, f"unknown node {nid}")
            node = nodes[nid]
            if node.parent != parent or node.depth != pos:
                raise fail(pos, f"node {nid} is not the child of node {parent} at depth {pos}")
            ids += node.token_ids
            runs += node_runs[nid]
            pos, parent = pos + len(node.token_ids), nid
        if ids != row.ids:
            k = _first_difference(ids, row.ids)
            if k == len(row.ids):
                raise fail(k, "the path runs past the row's end")
            if k == len(ids):
                raise fail(k, "the path ends before the row")
            raise fail(k, f"node {_node_at(nodes, leaf.path, k)}'s token differs")
        runs = _merge_runs(runs)
        if runs != row.runs:
            k, what = _prov_difference(runs, row.runs)
            raise fail(k, f"node {_node_at(nodes, leaf.path, k)}'s {what} differs")
        for nid in leaf.path:  # behaviour logprobs: one comparison per sampled run
            node = nodes[nid]
            for s, e in node.sampled:
                mine, theirs = node.logprobs[s:e], row.logprobs(node.depth + s, node.depth + e)
                if mine != theirs:
                    for k, (a, b) in enumerate(zip(mine, theirs)):
                        d = abs(a - b)
                        if not math.isfinite(d):
                            raise fail(node.depth + s + k, f"row's behaviour logprob is not finite (node {nid})")
                        spread = max(spread, d)
    if tree.flat_tokens != sum(len(r.ids) for r in rows) or tree.tree_tokens != sum(len(x.token_ids)
                                                                                     for x in nodes):
        raise ValueError("the tree's token counts are wrong")
    return spread


def _node_at(nodes: Sequence[TreeNode], path: Sequence[int], pos: int) -> int:
    """The node of ``path`` that holds row position ``pos`` (the last one past the path's end)."""
    for nid in path:
        if pos < nodes[nid].depth + len(nodes[nid].token_ids):
            return nid
    return path[-1] if path else -1


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
