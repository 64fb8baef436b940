"""Tree-packed training for the TRL plugin (issue #34 part 3, an option): forward each shared prefix of a batch
once.

The rows of a batch are merged into a prefix tree (rows with equal leading tokens share nodes), the tree is
laid out as one packed sequence in depth-first order, and one forward computes every row's logprobs:

- **ancestor attention**: a token attends to the tokens of its node before it and to every token of its
  ancestor nodes, never to a sibling branch. For SDPA models it is computed node by node
  (:func:`tree_attention_forward`, registered through transformers' ``AttentionInterface``), costing the sum
  over nodes of node length x path length; other models get it as a dense 4-D additive mask
  (:func:`ancestor_mask`: 0 where a token may attend, the dtype's minimum elsewhere; S x S);
- **depth position ids**: a token's position is its position in its row (the node's depth plus its offset),
  not its index in the packed sequence, so RoPE sees each row as the per-row forward does;
- **gather with branch transitions**: row position ``t``'s logprob comes from the packed index of row position
  ``t - 1``; for the first token of a child node that is the last token of its parent, wherever the parent
  lies in the packed sequence. Targets are never deduplicated: each row gathers its own.

With the same kernels this is the per-row forward up to floating-point reassociation (measured on the tiny
Qwen2, CPU, SDPA: fp64 ~1e-16, fp32 ~1e-6). A plain causal mask over the packed tree or packed-index positions
is off by ~0.1 and more. It is what MiniMax's Forge ("prefix tree merging") and AReaL's tree training do; the
check here is per row and strict (see :class:`TreePackedLogps`).

The tree is built from the batch's tokens: for a dense text model the forward of equal tokens at equal
positions is the same whatever their provenance, and the behaviour logprobs, masks and advantages stay
per row in TRL's loss. A server tree (format 2) shares a reply one row sampled with the rows that re-send it
as context; each leaf's loss mask is its own ``sampled`` runs (:func:`tree_loss_masks`), never its nodes'. Models whose forward depends on more than the tokens (MoE routing replay, images) are
not packed.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch

log = logging.getLogger(__name__)


@dataclass
class PackedTree:
    """A prefix tree of rows laid out as one packed sequence of S tokens.

    ``input_ids``, ``position_ids``: LongTensor [S]. ``node_of``: LongTensor [S], the node of each packed token.
    ``ancestors``: per node, the ids of its ancestors and itself (root first). ``node_start``/``node_len``:
    each node's packed range. ``row_index``: per row, LongTensor [T_row] of the packed index of each of its
    positions (the node path concatenated)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    node_of: torch.Tensor
    ancestors: list[list[int]]
    node_start: list[int]
    node_len: list[int]
    row_index: list[torch.Tensor]

    @property
    def size(self) -> int:
        return int(self.input_ids.numel())


def build_prefix_tree(rows: Sequence[Sequence[int]]) -> tuple[list[tuple[Optional[int], list[int]]], list[list[int]]]:
    """The prefix tree of token rows: ``(nodes, paths)`` with ``nodes[i] = (parent or None, token ids)`` (a
    parent before its children, depth-first) and ``paths[r]`` the node ids of row ``r`` root first. A radix
    tree (compressed trie) with node splitting, the rows inserted one after another."""
    # node: [parent, start in owner row, end, owner row, children {first token: node}]
    root: list = [None, 0, 0, -1, {}]
    ends = []
    for r, row in enumerate(rows):
        row = list(row)
        node, pos = root, 0
        while pos < len(row):
            child = node[4].get(row[pos])
            if child is None:
                child = [node, pos, len(row), r, {}]
                node[4][row[pos]] = child
                node, pos = child, len(row)
                break
            owner = rows[child[3]]
            n = min(child[2] - child[1], len(row) - pos)
            m = next((k for k in range(n) if owner[child[1] + k] != row[pos + k]), n)
            if m < child[2] - child[1]:  # split: a new head takes [start, start + m), the child keeps the rest
                head = [node, child[1], child[1] + m, child[3], {}]
                node[4][row[pos]] = head
                child[0], child[1] = head, child[1] + m
                head[4][owner[child[1]]] = child
                child = head
            node, pos = child, pos + m
        ends.append(node)
    nodes: list[tuple[Optional[int], list[int]]] = []
    number: dict[int, int] = {}
    stack = list(reversed(list(root[4].values())))
    while stack:
        x = stack.pop()
        number[id(x)] = len(nodes)
        nodes.append((number[id(x[0])] if x[0] is not root else None, list(rows[x[3]][x[1]:x[2]])))
        stack.extend(reversed(list(x[4].values())))
    paths = []
    for end in ends:
        path = []
        while end is not root:
            path.append(number[id(end)])
            end = end[0]
        paths.append(path[::-1])
    return nodes, paths


def tree_url(server: str, group_id: str) -> Any:
    """``GET /groups/{group_id}/tree`` of ``server`` with the group id as one path segment, percent-encoded (a
    ``/``, ``?``, ``#`` or space in it would change the URL, and a segment ``.`` or ``..`` would be folded away
    by the client's path normalisation, so its dots are encoded too); a ``yarl.URL`` already encoded, which
    aiohttp sends as it is."""
    from urllib.parse import quote

    from yarl import URL

    segment = quote(group_id, safe="")
    if segment.strip(".") == "":
        segment = segment.replace(".", "%2E")
    return URL(f"{server.rstrip('/')}/groups/{segment}/tree", encoded=True)


class ServerTrees:
    """The rollout servers' verified group trees (``GET /groups/{id}/tree``, issue #34) of the last
    ``keep_calls`` rollout calls, indexed by the rows TRL trains on, so a packed batch forwards the server's
    provenance-checked tree instead of one built here from tokens alone.

    :meth:`collect` fetches a call's trees, checks each with :func:`trainer_plugins.tree.verified_tree`
    against the results the rollout holds (a tree that fails, or a fetch that fails, is refused and counted
    in :attr:`stats` with its reason), and indexes the leaves of the rows TRL receives. :meth:`forest` gives
    the trees of a batch's rows, pruned to their paths, or why it cannot (the batch then builds its tree from
    its rows). Memory: the trees of ``keep_calls`` calls at most."""

    def __init__(self, keep_calls: int = 2, max_bytes: int = 256 * 1024 * 1024) -> None:
        from trainer_plugins.tree import TreeStats

        self.keep_calls = max(1, int(keep_calls))
        self.max_bytes = max_bytes
        self.stats = TreeStats()
        self._calls: "list[dict[tuple, tuple[Any, int]]]" = []  # per call: row tokens -> (tree, leaf index)

    async def collect(self, session: Any, headers: Mapping[str, str],
                      groups: Sequence[tuple[str, str, Sequence[Any], Sequence[int]]]) -> None:
        """Fetch and check the trees of ``groups``: ``(group_id, server URL, the group's job results there,
        the index of the trajectory TRL trains on of each)``, and index those rows. Never raises for a
        server's answer: a tree that cannot be had or verified is counted in :attr:`stats` and its rows
        are left out (trained from a tree built from their tokens)."""
        import aiohttp

        from prorl_server.types import GroupTree
        from trainer_plugins.tree import verified_tree

        index: dict[tuple, tuple[Any, int]] = {}
        for gid, server, results, trained in groups:
            held = {r.job_id: r for r in results}
            tree = None
            try:
                async with session.get(tree_url(server, gid), headers=dict(headers),
                                       timeout=aiohttp.ClientTimeout(total=60)) as resp:
                    body = await resp.content.read(self.max_bytes + 1)
                    if resp.status != 200:
                        raise ValueError(f"HTTP {resp.status}: {body[:200]!r}")
                    if len(body) > self.max_bytes:
                        raise ValueError(f"the tree is over {self.max_bytes} bytes")
                tree = GroupTree.model_validate_json(body)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                self._refuse(f"fetch: group {gid} from {server}: {e}")
                continue
            tree = verified_tree(tree, held, self.stats)
            if tree is None:
                log.warning("tree of group %s refused, its rows train on a tree built from their tokens: %s", gid,
                            self.stats.last_reason)
                continue
            leaves = {(leaf.job_id, leaf.trajectory_index): k for k, leaf in enumerate(tree.leaves)}
            for r, t in zip(results, trained):
                k = leaves.get((r.job_id, t))
                if k is None:
                    self._refuse(f"missing: job {r.job_id} has no leaf in its group's tree")
                    continue
                traj = r.trajectories[t]
                index[tuple(traj.prompt_ids) + tuple(traj.response_ids)] = (tree, k)
        self._calls.append(index)
        del self._calls[:-self.keep_calls]

    def _refuse(self, reason: str) -> None:
        self.stats.fallbacks += 1
        self.stats.last_reason = reason
        key = reason.split(":")[0][:80]
        self.stats.reasons[key] = self.stats.reasons.get(key, 0) + 1
        log.warning("server tree not used: %s", reason)

    def forest(self, rows: Sequence[Sequence[int]]) -> "tuple[list[tuple[Optional[int], list[int]]], list[list[int]]] | str":
        """``(nodes, paths)`` as :func:`build_prefix_tree` gives them, from the server trees of ``rows``
        (each tree pruned to the paths of the rows present, the trees side by side as one forest), or a
        string saying why not (a row that is in no verified tree: TRL changed it, or its tree was refused)."""
        found = []
        for b, row in enumerate(rows):
            key = tuple(row)
            hit = next((c[key] for c in reversed(self._calls) if key in c), None)
            if hit is None:
                return f"row {b} of the batch is in no verified server tree"
            found.append(hit)
        nodes: list[tuple[Optional[int], list[int]]] = []
        number: dict[tuple[int, int], int] = {}
        trees: dict[int, Any] = {}
        for tree, k in found:
            trees.setdefault(id(tree), tree)
        for tid, tree in trees.items():  # a tree's node ids put a parent before its children
            used = sorted({n for t, k in found if id(t) == tid for n in t.leaves[k].path})
            for n in used:
                parent = tree.nodes[n].parent
                number[(tid, n)] = len(nodes)
                nodes.append((None if parent is None else number[(tid, parent)], list(tree.nodes[n].token_ids)))
        paths = [[number[(id(tree), n)] for n in tree.leaves[k].path] for tree, k in found]
        return nodes, paths


def pack(nodes: Sequence[tuple[Optional[int], Sequence[int]]], paths: Sequence[Sequence[int]],
         position_ids: str = "depth") -> PackedTree:
    """Lay ``nodes`` (parent before child) out in order as one sequence. ``position_ids``: ``"depth"`` (the
    position in the row: exact) or ``"packed"`` (the packed index: wrong for every branch after the first, a
    negative control)."""
    starts, lens, depth, ancestors = [], [], [], []
    at = 0
    for i, (parent, ids) in enumerate(nodes):
        starts.append(at)
        lens.append(len(ids))
        depth.append(0 if parent is None else depth[parent] + lens[parent])
        ancestors.append(([] if parent is None else ancestors[parent]) + [i])
        at += len(ids)
    input_ids = torch.tensor([t for _, ids in nodes for t in ids], dtype=torch.long)
    node_of = torch.repeat_interleave(torch.arange(len(nodes)), torch.tensor(lens, dtype=torch.long))
    offsets = torch.arange(at) - torch.tensor(starts, dtype=torch.long)[node_of]
    if position_ids == "depth":
        pos = torch.tensor(depth, dtype=torch.long)[node_of] + offsets
    elif position_ids == "packed":
        pos = torch.arange(at)
    else:
        raise ValueError(f"position_ids must be 'depth' or 'packed', not {position_ids!r}")
    row_index = [torch.cat([torch.arange(starts[n], starts[n] + lens[n]) for n in path]) if path
                 else torch.zeros(0, dtype=torch.long) for path in paths]
    return PackedTree(input_ids, pos, node_of, ancestors, starts, lens, row_index)


def tree_loss_masks(tree: Any) -> list[torch.Tensor]:
    """Per leaf of a server tree (:class:`prorl_server.types.GroupTree`, issue #34), its loss mask aligned with
    :func:`packed_row_logprobs`'s rows: float Tensor [T_row - 1], index ``t - 1`` for row position ``t``; 1 where
    the leaf's own row generated the token (its ``sampled`` runs, :func:`trainer_plugins.tree.leaf_loss_mask`).
    A shared node's tokens that another row sampled (a reply re-sent as context) are 0 here: the packed
    forward computes them once, and only the row that sampled them trains on them."""
    from trainer_plugins.tree import leaf_loss_mask

    return [torch.tensor(leaf_loss_mask(tree, k)[1:], dtype=torch.float32) for k in range(len(tree.leaves))]


def ancestor_mask(tree: PackedTree, dtype: torch.dtype, kind: str = "ancestor") -> torch.Tensor:
    """The additive attention mask [1, 1, S, S] (0: attend, ``finfo(dtype).min``: not). ``kind``:
    ``"ancestor"`` (exact) or ``"causal"`` (a plain causal mask over the packed sequence, which lets a branch
    attend to its earlier siblings: a negative control)."""
    S = tree.size
    allowed = torch.zeros(S, S, dtype=torch.bool)
    if kind == "causal":
        allowed = torch.ones(S, S, dtype=torch.bool).tril()
    elif kind == "ancestor":
        for n, chain in enumerate(tree.ancestors):
            a, b = tree.node_start[n], tree.node_start[n] + tree.node_len[n]
            for m in chain[:-1]:
                allowed[a:b, tree.node_start[m]:tree.node_start[m] + tree.node_len[m]] = True
            allowed[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    else:
        raise ValueError(f"kind must be 'ancestor' or 'causal', not {kind!r}")
    mask = torch.zeros(S, S, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


#: The attention implementation :func:`enable_tree_attention` registers (transformers' ``AttentionInterface`` and
#: ``AttentionMaskInterface``): SDPA, and for a packed tree's forward (the ``tree_attention`` keyword) attention
#: node by node, each node's queries over its ancestors' keys and its own (:func:`tree_attention_forward`).
TREE_ATTENTION = "prorl_tree_sdpa"


@dataclass
class TreeAttentionLayout:
    """Per node of a :class:`PackedTree` (packed order), what its queries attend to: ``spans[n] = (a, b)``, its
    packed query range; ``keys[n]``, LongTensor [K_n] of the packed key indices (its ancestors' tokens, root
    first, then its own ``b - a``); ``masks[n]``, bool Tensor [b - a, K_n] (True: attend), or None when the
    node has no ancestors (plain causal: SDPA's ``is_causal``). ``pairs``: the query-key pairs computed,
    sum over nodes of ``node_len x (ancestor tokens + node_len)``, against ``S x S`` for a dense mask."""

    spans: list[tuple[int, int]]
    keys: list[torch.Tensor]
    masks: list[Optional[torch.Tensor]]

    @property
    def pairs(self) -> int:
        return sum((b - a) * int(k.numel()) for (a, b), k in zip(self.spans, self.keys))


def attention_layout(tree: PackedTree, kind: str = "ancestor") -> TreeAttentionLayout:
    """The node-by-node attention of ``tree``: ``kind`` ``"ancestor"`` (exact: the same pairs as
    :func:`ancestor_mask`) or ``"causal"`` (each node over every packed token before it, a plain causal mask
    over the packed tree: a negative control)."""
    if kind not in ("ancestor", "causal"):
        raise ValueError(f"kind must be 'ancestor' or 'causal', not {kind!r}")
    spans, keys, masks = [], [], []
    for n, chain in enumerate(tree.ancestors):
        a, b = tree.node_start[n], tree.node_start[n] + tree.node_len[n]
        if a == b:  # no queries, and no keys for its descendants
            continue
        if kind == "causal":
            before = torch.arange(0, a)
        else:
            before = torch.cat([torch.arange(tree.node_start[m], tree.node_start[m] + tree.node_len[m])
                                for m in chain[:-1]] or [torch.zeros(0, dtype=torch.long)])
        k = torch.cat([before, torch.arange(a, b)])
        L, P = b - a, int(before.numel())
        # own tokens causally; SDPA's is_causal is top-left aligned, right only without ancestors
        mask = None if P == 0 else torch.ones(L, P + L, dtype=torch.bool).tril(P)
        spans.append((a, b))
        keys.append(k)
        masks.append(mask)
    return TreeAttentionLayout(spans, keys, masks)


def tree_attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                           scaling: Optional[float] = None, tree_attention: Optional[TreeAttentionLayout] = None,
                           **kwargs: Any) -> tuple[torch.Tensor, None]:
    """An attention function for transformers' ``AttentionInterface`` (signature of its ``sdpa_attention_forward``:
    ``query`` [1, H, S, D], ``key``/``value`` [1, H_kv, S, D]; returns [1, S, H, D] and no weights). Without
    ``tree_attention`` it is transformers' SDPA, unchanged. With it, each node's queries attend to their
    ``keys`` through :func:`torch.nn.functional.scaled_dot_product_attention` on the node's block only, so a
    packed tree costs ``layout.pairs`` query-key pairs instead of ``S x S`` and no ``S x S`` mask exists."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if tree_attention is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"tree attention takes one packed sequence, not a batch of {query.shape[0]}")
    layout = tree_attention
    groups = query.shape[1] // key.shape[1]
    # one gather and one split for all nodes: slicing or indexing per node would make the backward allocate
    # and zero-fill an [H, S, D] gradient per node and per tensor (measured: most of the packed backward
    # with 33 nodes of 5,240 tokens)
    index = torch.cat(layout.keys).to(query.device)
    key_lens = [int(k.numel()) for k in layout.keys]
    keys = repeat_kv(key[:, :, index], groups).split(key_lens, dim=2)
    values = repeat_kv(value[:, :, index], groups).split(key_lens, dim=2)
    queries = query.split([b - a for a, b in layout.spans], dim=2)
    outs = [torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=None if mask is None else mask.to(query.device), dropout_p=dropout,
                is_causal=mask is None, scale=scaling)
            for q, k, v, mask in zip(queries, keys, values, layout.masks)]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def enable_tree_attention(model: Any) -> bool:
    """Switch an SDPA model (``attn_implementation="sdpa"``) to :data:`TREE_ATTENTION`, which is SDPA for every
    forward but a packed tree's (same attention function, same mask function), so :func:`packed_row_logprobs`
    computes attention node by node. The switch is kept (gradient checkpointing re-runs the forward in the
    backward and must find the same implementation). Returns whether the model now uses it; other
    implementations (eager, flex, flash) are left alone and packed forwards use the dense 4-D mask."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(TREE_ATTENTION, tree_attention_forward)  # idempotent; global in transformers
    AttentionMaskInterface.register(TREE_ATTENTION, sdpa_mask)
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current == TREE_ATTENTION:
        return True
    if current != "sdpa" or not hasattr(model, "set_attn_implementation"):  # a wrapper: keep the dense mask
        return False
    model.set_attn_implementation(TREE_ATTENTION)
    return getattr(model.config, "_attn_implementation", None) == TREE_ATTENTION


def packed_row_logprobs(model: Any, tree: PackedTree, mask: Optional[torch.Tensor] = None,
                        transitions: str = "parent", temperature: float = 1.0,
                        compute_entropy: bool = False, layout: Optional[TreeAttentionLayout] = None
                        ) -> tuple[list[torch.Tensor], Optional[list[torch.Tensor]]]:
    """One forward of the packed tree; per row, the logprob of each of its tokens after the first (Tensor
    [T_row - 1], position ``t - 1`` holds token ``t``'s), and with ``compute_entropy`` the entropy at the
    same positions.

    Attention: with ``mask`` (a 4-D additive mask, :func:`ancestor_mask`), that dense mask; else, for an SDPA
    model (switched by :func:`enable_tree_attention`, kept), node by node (``layout``, default
    :func:`attention_layout` of ``tree``); else (eager, flex) the dense :func:`ancestor_mask`.

    ``transitions``: ``"parent"`` (exact: row position ``t``'s logits are those at the packed index of row
    position ``t - 1``) or ``"packed"`` (the packed predecessor, which for a child's first token is another
    branch's last token: a negative control)."""
    refusal = packing_refusal(model)
    if refusal is not None:
        raise ValueError(f"cannot tree-pack this model: {refusal}")
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    extra: dict[str, Any] = {}
    if mask is None and enable_tree_attention(model):
        extra["tree_attention"] = attention_layout(tree) if layout is None else layout
        # an empty 4-D mask: transformers passes a 4-D mask through as it is, and any attention that ignored
        # the layout would fail on its shape instead of silently attending everywhere
        mask = torch.zeros(1, 1, 0, 0, dtype=dtype)
    elif mask is None:
        mask = ancestor_mask(tree, dtype)
    out = model(input_ids=tree.input_ids[None].to(device), attention_mask=mask.to(device),
                position_ids=tree.position_ids[None].to(device), use_cache=False, **extra)
    logits = out.logits.squeeze(0)  # a view: indexing [0] would copy the [S, V] gradient in the backward
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits  # autocast's too
    logp = torch.log_softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)
    ent = -(logp.exp() * logp).sum(-1) if compute_entropy else None
    # every row's (source position, target token) pairs in ONE index: indexing [S, V] once per row would make
    # the backward allocate and scatter into an [S, V] zero tensor per row (measured: 60% of the packed
    # fwd+bwd with 32 rows of 5,240 packed tokens)
    srcs, lens = [], []
    for idx in tree.row_index:
        n = max(idx.numel() - 1, 0)
        lens.append(n)
        if n:
            srcs.append(idx[:-1] if transitions == "parent" else idx[1:] - 1)
    if not srcs:
        return [logp.new_zeros(0) for _ in lens], ([logp.new_zeros(0) for _ in lens] if compute_entropy else None)
    src = torch.cat(srcs).to(device)
    targets = tree.input_ids[torch.cat([idx[1:] for idx in tree.row_index if idx.numel() > 1])].to(device)
    rows = list(logp[src, targets].split(lens))
    ents = list(ent[src].split(lens)) if ent is not None else None
    return rows, ents


def per_row_logprobs(model: Any, rows: Sequence[Sequence[int]], temperature: float = 1.0) -> list[torch.Tensor]:
    """The reference: each row forwarded alone; per row Tensor [T_row - 1] as :func:`packed_row_logprobs`."""
    device = next(model.parameters()).device
    out = []
    for row in rows:
        ids = torch.tensor([list(row)], dtype=torch.long, device=device)
        logits = model(input_ids=ids, use_cache=False).logits[0]
        logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        logp = torch.log_softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)
        out.append(logp[:-1].gather(-1, ids[0, 1:, None])[:, 0])
    return out


def max_difference(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """The largest |a - b| over all rows (inf when the rows' lengths differ)."""
    worst = 0.0
    for x, y in zip(a, b):
        if x.shape != y.shape:
            return float("inf")
        if x.numel():
            worst = max(worst, float((x.detach() - y.detach()).abs().max()))
    return worst if len(a) == len(b) else float("inf")


#: Attention implementations whose packed forward is exact: SDPA (switched to :data:`TREE_ATTENTION` on the first
#: packed forward) and eager (the dense :func:`ancestor_mask`). Others are refused before any packed forward:
#: flex_attention's packed forward with a 4-D mask aborted the process on CPU (transformers 5.10, torch 2.13:
#: ``malloc(): invalid size``, rc 139), and flash attention takes no 4-D mask.
PACKABLE_ATTENTION = ("sdpa", "eager", TREE_ATTENTION)


def _model_config(model: Any) -> Any:
    """The config of ``model`` or of the model a wrapper holds (DDP's ``module``; PEFT forwards ``config``)."""
    for _ in range(4):
        config = getattr(model, "config", None)
        if config is not None:
            return config
        model = getattr(model, "module", None)
        if model is None:
            break
    return None


def packing_refusal(model: Any) -> Optional[str]:
    """Why ``model``'s forward cannot be tree-packed exactly, or None when it can (a dense text decoder with
    full causal attention through SDPA or eager attention).

    Refused: an attention implementation outside :data:`PACKABLE_ATTENTION`; and any layer that does not attend
    to every earlier token of its row, read as transformers builds the layers: a ``layer_types`` entry other
    than ``"full_attention"`` (``"sliding_attention"`` when ``sliding_window`` is set: Gemma2/3, Qwen2 with
    ``use_sliding_window`` above ``max_window_layers``; chunked, linear or recurrent layers always), a model
    without ``layer_types`` whose config sets ``sliding_window`` (Mistral, Mixtral, Phi-3, Starcoder2 apply it
    to every layer), or a submodule whose ``sliding_window`` is set. The packed forward computes full ancestor
    attention: a window is ignored on both attention paths (off by 0.13-0.82 once a row is longer than the
    window), and a recurrent layer's state would run across branches. A window that is configured but used by
    no layer (Qwen2's ``use_sliding_window=False``, which transformers turns into ``sliding_window=None``, or
    ``max_window_layers`` >= the layer count) is not refused."""
    config = _model_config(model)
    if config is None:
        return "no model config to read the attention from"
    model_type = getattr(config, "model_type", type(model).__name__)
    impl = getattr(config, "_attn_implementation", None)
    if impl not in PACKABLE_ATTENTION:
        return (f"attention implementation {impl!r} ({model_type}): the packed forward is exact only with "
                f"'sdpa' or 'eager'")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None)
    if layer_types:
        other = sorted({t for t in layer_types if t != "full_attention"
                        and not (t == "sliding_attention" and window is None)})
        if other:
            return (f"{model_type} has {', '.join(other)} layers (sliding_window={window}): the packed forward "
                    f"attends to every ancestor token")
    elif window is not None:
        return f"{model_type} has a sliding window of {window} tokens: the packed forward attends to every ancestor token"
    for name, module in getattr(model, "named_modules", lambda: iter(()))():
        if isinstance(getattr(module, "sliding_window", None), int):
            return (f"{model_type} layer {name} has a sliding window of {module.sliding_window} tokens: the packed "
                    f"forward attends to every ancestor token")
    return None


#: Largest |packed - per-row| logprob the first-batch self-check accepts, by the parameters' dtype (the check
#: runs fp32/fp64 models with autocast off, :func:`full_precision`): fp32 and fp64 agree to ~1e-6 and ~1e-15
#: (reassociation only); half precision rounds each layer's output.
SELF_CHECK_BOUND = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


@contextlib.contextmanager
def full_precision(model: Any, accelerator: Any = None):
    """Autocast off for the forwards of ``model`` inside: torch's autocast on the parameters' device; the
    autocast that accelerate's ``prepare_model`` wraps around a model's ``forward`` under mixed precision
    (it keeps the unwrapped one as ``_original_forward``; here ``model`` or a wrapper's ``module``); and
    ``accelerator.autocast()``, which TRL's own forward enters, through accelerate's ``autocast_handler``
    (``AutocastKwargs(enabled=False)``, accelerate's way back to fp32 inside autocast). Restored on exit."""
    handler = getattr(accelerator, "autocast_handler", False)
    if handler is not False:
        from accelerate.utils import AutocastKwargs

        accelerator.autocast_handler = AutocastKwargs(enabled=False)
    swapped = []
    m = model
    for _ in range(4):
        if m is None:
            break
        original = vars(m).get("_original_forward") if hasattr(m, "__dict__") else None
        if original is not None and "forward" in vars(m):
            swapped.append((m, vars(m)["forward"]))
            m.forward = original
        m = getattr(m, "module", None)
    try:
        with torch.autocast(next(model.parameters()).device.type, enabled=False):
            yield
    finally:
        for m, forward in swapped:
            m.forward = forward
        if handler is not False:
            accelerator.autocast_handler = handler


@dataclass
class TreePackStats:
    """What tree packing did: batches packed, batches forwarded per row (and why: ``fallback_reason``), flat
    and packed tokens (``tree_token_ratio`` = packed / flat), and the self-check's measured difference."""

    packed_batches: int = 0
    row_batches: int = 0
    flat_tokens: int = 0
    tree_tokens: int = 0
    self_check_delta: Optional[float] = None
    fallback_reason: Optional[str] = None
    reasons: dict[str, int] = field(default_factory=dict)
    #: chunks packed from the servers' verified trees (:class:`ServerTrees`), and chunks whose tree was built
    #: here from their tokens although server trees were on, by why (``tree_reasons``)
    server_tree_chunks: int = 0
    row_tree_chunks: int = 0
    tree_reasons: dict[str, int] = field(default_factory=dict)

    @property
    def tree_token_ratio(self) -> float:
        return self.tree_tokens / self.flat_tokens if self.flat_tokens else 1.0


class TreePackedLogps:
    """A mixin for TRL's ``GRPOTrainer`` (TRL 1.x, ``_get_per_token_logps_and_entropies``) that computes the
    batch's per-token logprobs with one tree-packed forward instead of one row per batch element::

        class Trainer(TreePackedLogps, GRPOTrainer): ...

    The first packed batch is checked against TRL's own per-row forward; a difference above
    :data:`SELF_CHECK_BOUND` (or an exception of its packed forward) turns packing off for the run, saying why in the log and in
    :attr:`tree_pack_stats`; an fp32/fp64 model's check runs with autocast off (:func:`full_precision`). Models
    :func:`packing_refusal` refuses (sliding windows, attention other than SDPA or eager) are forwarded per row
    from the start. Batches with images, MoE auxiliary losses or token type ids are forwarded per row.
    """

    tree_pack_enabled: bool = True
    #: the servers' verified trees to pack (:class:`ServerTrees`); None: the ``rollout_func``'s
    #: ``server_trees`` (``ProRLRollout(server_trees=True)``) when it has them, else trees built from tokens
    server_trees: Optional["ServerTrees"] = None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                           batch_size=None, compute_entropy=False, compute_aux_loss=False,
                                           **kwargs):
        stats = self.__dict__.setdefault("tree_pack_stats", TreePackStats())
        plain = lambda: super(TreePackedLogps, self)._get_per_token_logps_and_entropies(  # noqa: E731
            model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
            compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **kwargs)
        reason = None
        if not self.tree_pack_enabled or stats.fallback_reason:
            reason = stats.fallback_reason or "disabled"
        elif compute_aux_loss or any(v is not None for v in kwargs.values()):
            reason = "images, token types or an MoE auxiliary loss: the forward depends on more than tokens"
        elif stats.self_check_delta is None and (refusal := packing_refusal(model)) is not None:
            # before any packed forward: a refused model's packed forward is wrong (a window) or kills the process
            stats.fallback_reason = reason = f"not packable: {refusal}; forwarding rows"
            log.warning("tree packing off: %s", reason)
        if reason is not None:
            stats.row_batches += 1
            stats.reasons[reason[:60]] = stats.reasons.get(reason[:60], 0) + 1
            return plain()
        temperature = float(getattr(self, "temperature", 1.0) or 1.0)
        # TRL's batch_size bounds the rows forwarded together; it bounds the packed sequence (and its S x S
        # mask) the same way. TRL's sampler puts a prompt's rows next to each other, so chunks keep groups.
        step = batch_size or input_ids.size(0)
        accelerator = getattr(self, "accelerator", None)
        # the same autocast as TRL's own forward (GRPOConfig's bf16 defaults to True, on CPU too)
        autocast = accelerator.autocast if accelerator is not None else contextlib.nullcontext  # one per use
        trees = self.server_trees or getattr(getattr(self, "rollout_func", None), "server_trees", None)
        if stats.self_check_delta is None:
            # fp32/fp64 parameters: both forwards of the check run in that precision with autocast off, where an
            # honest packing agrees to ~1e-6 and packed-index position ids are off by ~1e-2; under bf16 autocast
            # the honest difference (~4e-3) and that error (1.2e-2) are too close for any bound. Half-precision
            # parameters are checked as they train, against TRL's per-row forward in the same dtype.
            check_dtype = next(model.parameters()).dtype
            exact = check_dtype in (torch.float32, torch.float64)
            with torch.no_grad(), (full_precision(model, accelerator) if exact else autocast()):
                try:
                    check = torch.cat([tree_packed_batch(model, input_ids[a:a + step], attention_mask[a:a + step],
                                                         logits_to_keep, temperature, False, None, trees)[0]
                                       for a in range(0, input_ids.size(0), step)])
                except Exception as e:  # noqa: BLE001 - a packed forward this model cannot run: rows, saying why
                    check = None
                    stats.fallback_reason = (f"self-check: the packed forward raised {type(e).__name__}: "
                                             f"{str(e)[:200]}; forwarding rows from now on")
                ref = plain()[0] if check is not None else None
            if check is None:
                log.warning("tree packing off: %s", stats.fallback_reason)
                stats.row_batches += 1
                return plain()  # with gradients and the trainer's autocast, as every per-row batch
            keep = attention_mask[:, -logits_to_keep:].bool()
            delta = float((check - ref.to(check.dtype))[keep].abs().max()) if keep.any() else 0.0
            stats.self_check_delta = delta
            bound = SELF_CHECK_BOUND.get(check_dtype, 1e-2)
            if not delta <= bound:
                stats.fallback_reason = (f"self-check: the packed forward's logprobs differ from the per-row "
                                         f"forward's by {delta:.3g} > {bound:g} ({str(check_dtype)[6:]}); "
                                         f"forwarding rows from now on")
                log.warning("tree packing off: %s", stats.fallback_reason)
                stats.row_batches += 1
                return plain()
        with autocast():
            parts = [tree_packed_batch(model, input_ids[a:a + step], attention_mask[a:a + step], logits_to_keep,
                                       temperature, compute_entropy, stats, trees)
                     for a in range(0, input_ids.size(0), step)]
        logps = torch.cat([p[0] for p in parts])
        ents = torch.cat([p[1] for p in parts]) if compute_entropy else None
        stats.packed_batches += 1
        return logps, ents, None


def tree_packed_batch(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                      temperature: float = 1.0, compute_entropy: bool = False,
                      stats: Optional[TreePackStats] = None, server_trees: Optional[ServerTrees] = None
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """TRL's padded batch (``input_ids``/``attention_mask`` [B, L], prompts left-padded, completions
    right-padded) through one tree-packed forward: logprobs [B, logits_to_keep] laid out as TRL's (column j
    holds the logprob of ``input_ids[:, L - logits_to_keep + j]``; padding 0), and entropies the same way.
    The tree is the servers' (``server_trees``, :meth:`ServerTrees.forest`) when every row is in one, else
    built from the rows' tokens (counted in ``stats.tree_reasons``)."""
    B, L = input_ids.shape
    keep = attention_mask.bool()
    rows, where = [], []
    for b in range(B):
        cols = keep[b].nonzero()[:, 0]
        rows.append(input_ids[b, cols].tolist())
        where.append(cols)
    found = server_trees.forest(rows) if server_trees is not None else None
    if isinstance(found, tuple):
        nodes, paths = found
        if stats is not None:
            stats.server_tree_chunks += 1
    else:
        nodes, paths = build_prefix_tree(rows)
        if stats is not None and found is not None:
            stats.row_tree_chunks += 1
            key = found.split(":")[0][:60]
            stats.tree_reasons[key] = stats.tree_reasons.get(key, 0) + 1
    tree = pack(nodes, paths)
    if stats is not None:
        stats.flat_tokens += sum(len(r) for r in rows)
        stats.tree_tokens += tree.size
    lps, ents = packed_row_logprobs(model, tree, temperature=temperature, compute_entropy=compute_entropy)
    out = lps[0].new_zeros(B, L) if lps else input_ids.new_zeros(B, L, dtype=torch.float32)
    ent_out = out.clone() if compute_entropy else None
    for b in range(B):
        cols = where[b][1:].to(out.device)  # row position t >= 1 sits in column cols[t - 1]
        if cols.numel():
            out = out.index_put((torch.full_like(cols, b), cols), lps[b])
            if ent_out is not None:
                ent_out = ent_out.index_put((torch.full_like(cols, b), cols), ents[b])
    return out[:, -logits_to_keep:], (ent_out[:, -logits_to_keep:] if ent_out is not None else None)
