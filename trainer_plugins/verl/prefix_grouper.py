"""verl's ``actor.use_prefix_grouper`` and this plugin's rows (issue #34 part 4).

verl's PrefixGrouper forwards a group's shared prompt once: ``prefix_grouper_utils.build_pg_from_micro_batch``
takes the prompt of the *first* row of each run of equal ``uid`` as the whole run's prefix. That is exact only
when every row of the run has byte-identical ``prompt_ids``; this plugin's rows break it whenever a trajectory
was split (a chat template that drops past reasoning, an agent that rewrites its history: one job, one uid,
several rows with other prompts), and a group's rows must also be contiguous.

What verl 0.9.1 does with the flag (read from its source): the config field exists
(``verl/workers/config/actor.py``) and the legacy ``RayPPOTrainer._balance_batch`` keeps each uid group on one
rank, but no worker forwards with it: the FSDP engine calls ``apply_monkey_patch`` without
``use_prefix_grouper`` and no actor calls ``prefix_grouper_utils``. Turning it on forwards nothing once, so
there is nothing to measure yet; the plugin refuses it with that reason (:func:`prefix_grouper_refusal`) and
checks each group (:func:`prefix_group_refusals`) for the day it is wired.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence


def prefix_group_refusals(uids: Sequence[str], prompt_ids: Sequence[Sequence[int]]) -> dict[str, str]:
    """The groups of a batch verl's PrefixGrouper would forward wrongly, ``uid -> reason``: rows of one uid
    that are not contiguous (verl groups runs of equal uids), or whose ``prompt_ids`` differ from the group's
    first row (the reason names the row and the first differing position). Empty: every group is exact.

    ``uids``: one per row; ``prompt_ids``: each row's prompt token ids (unpadded), in the batch's order."""
    out: dict[str, str] = {}
    first: dict[str, int] = {}
    for i, (uid, ids) in enumerate(zip(uids, prompt_ids)):
        if uid not in first:
            first[uid] = i
            continue
        if uid in out:
            continue
        if uids[i - 1] != uid:
            out[uid] = f"rows {first[uid]} and {i} of group {uid!r} are not contiguous"
            continue
        ref = list(prompt_ids[first[uid]])
        ids = list(ids)
        if ids != ref:
            k = next((k for k, (a, b) in enumerate(zip(ids, ref)) if a != b), min(len(ids), len(ref)))
            out[uid] = (f"row {i} of group {uid!r} has other prompt_ids than its first row {first[uid]} from "
                        f"position {k} (a split trajectory, or another prompt under one uid)")
    return out


def prefix_grouper_refusal(config: Any) -> Optional[str]:
    """Why this plugin refuses verl's ``actor_rollout_ref.actor.use_prefix_grouper`` (None when it is off)."""
    try:
        on = bool(config.actor_rollout_ref.actor.get("use_prefix_grouper", False))
    except AttributeError:
        return None
    if not on:
        return None
    return ("actor_rollout_ref.actor.use_prefix_grouper=True is refused: verl 0.9.1 only balances batches by "
            "uid with it (no worker forwards a shared prompt once), and its grouping takes each uid's first row "
            "as the prefix of all its rows, which is wrong for this plugin's split trajectories; set it to False "
            "(docs/training-verl.md, 'Shared prefixes')")
