"""A group's trajectory tree (#34 part 2): ``GET /groups/{group_id}/tree`` answers the verified prefix tree of
the rows of the group's ended jobs, never merging tokens of different provenance, naming the jobs that have no
rows yet, and never serving a tree that fails its invariants."""
from __future__ import annotations

import asyncio
import json
import os
import stat

import pytest

from prorl_server import tree as tree_module
from prorl_server.plugin.handler import AgentHandler
from prorl_server.tree import build_tree, group_tree, rows_of, verify_tree, TreeInvariantError
from prorl_server.types import GroupTree, JobResult, Trajectory
from trainer_plugins.tree import TreeCheckError, check_tree


class RowsHandler(AgentHandler):
    """Stands for an agent handler: the job's trajectories are the instance's ``rows`` (what a conversation
    recorded), its reward the instance's; ``sleep`` holds the run stage, ``fail`` fails it (a filtered
    failure)."""

    name = "rows"
    needs_llm = False

    async def init(self, job):
        pass

    async def run(self, job):
        await asyncio.sleep(job.instance.get("sleep", 0))
        if job.instance.get("fail"):
            raise RuntimeError("injected harness failure")
        job.trajectories = [Trajectory(**r) for r in job.instance["rows"]]

    async def eval(self, job):
        job.reward = float(job.instance.get("reward", 0.0))


@pytest.fixture
def client(make_client, registry):
    registry.register(RowsHandler())
    return make_client


PROMPT = list(range(100, 140))


def grpo_row(i: int, turns: int = 4, version: int = 1) -> dict:
    """A 4-turn row of a GRPO group: the shared prompt, then turns that branch at turn ``i % 3``."""
    ids, mask, lps = [], [], []
    for t in range(turns):
        out = [1000 + 10 * t + (i if t >= i % 3 else 0) + k for k in range(6)]
        obs = [2000 + t, 2001 + t] if t < turns - 1 else []
        ids += out + obs
        mask += [1] * len(out) + [0] * len(obs)
        lps += [-0.25] * len(out) + [0.0] * len(obs)
    return dict(prompt_ids=PROMPT, response_ids=ids, response_logprobs=lps, loss_mask=mask,
                version_runs=[[version, sum(mask)]])


def turn_rows(turns: int = 4) -> list[dict]:
    """One row per turn of an agent whose every request re-sends its history as prompt (a rewritten
    context: what the model sampled in turn k is prompt in turn k + 1)."""
    rows, prompt = [], list(PROMPT)
    for t in range(turns):
        out = [3000 + 10 * t + k for k in range(5)]
        rows.append(dict(prompt_ids=list(prompt), response_ids=out, response_logprobs=[-0.5] * 5,
                         loss_mask=[1] * 5, version_runs=[[t, 5]]))
        prompt = prompt + out + [4000 + t]
    return rows


async def submit(c, rows, group="g", **instance) -> str:
    r = await c.post("/jobs", json={"instance": {"data_source": "rows", "rows": rows, **instance},
                                    "group_id": group})
    assert r.status == 202, await r.text()
    return (await r.json())["job_id"]


def rebuild(tree: dict, leaf: dict) -> tuple[list[int], list[int]]:
    """A leaf's row and loss mask as a client reads them: its path's tokens and its own sampled runs."""
    nodes = tree["nodes"]
    ids = [t for nid in leaf["path"] for t in nodes[nid]["token_ids"]]
    mask = [0] * len(ids)
    for s, e in leaf["sampled"]:
        mask[s:e] = [1] * (e - s)
    return ids, mask


async def test_a_grpo_group_tree_gives_back_every_row_and_shares_the_prompt(client, wait_done):
    c = await client()
    jobs = [await submit(c, [grpo_row(i)], reward=i / 8) for i in range(8)]
    results = {j: await wait_done(c, j) for j in jobs}
    r = await c.get("/groups/g/tree")
    assert r.status == 200, await r.text()
    tree = await r.json()
    assert tree["complete"] and tree["missing"] == [] and len(tree["leaves"]) == 8
    for leaf in tree["leaves"]:
        t = results[leaf["job_id"]]["trajectories"][leaf["trajectory_index"]]
        ids, mask = rebuild(tree, leaf)
        assert ids == t["prompt_ids"] + t["response_ids"]
        assert mask[leaf["prompt_len"]:] == t["loss_mask"] and not any(mask[:leaf["prompt_len"]])
        assert leaf["reward"] == results[leaf["job_id"]]["reward"]
    roots = [n for n in tree["nodes"] if n["parent"] is None]
    assert len(roots) == 1 and roots[0]["token_ids"][:len(PROMPT)] == PROMPT
    assert tree["flat_tokens"] == 8 * (40 + 4 * 6 + 3 * 2)
    assert tree["tree_token_ratio"] == tree["tree_tokens"] / tree["flat_tokens"] < 0.55
    # the trainer's own check passes on what it received
    check_tree(GroupTree.model_validate(tree), {j: JobResult.model_validate(x) for j, x in results.items()})


async def test_a_rewritten_context_shares_each_reply_but_only_the_row_that_sampled_it_trains_on_it(client,
                                                                                                      wait_done):
    c = await client()
    job = await submit(c, turn_rows(8))
    result = await wait_done(c, job)
    tree = await (await c.get("/groups/g/tree")).json()
    assert tree["format_version"] == 2 and len(tree["leaves"]) == 8
    # one chain: the last row's history (40 prompt + 8 replies of 5 + 7 observations); each reply is one node
    # position, sampled in row t and context in rows t + 1.. (before: held twice, 87 + 7 * 5 tokens)
    assert tree["tree_tokens"] == 40 + 8 * 5 + 7 and tree["flat_tokens"] == 8 * 45 + 6 * 28
    for leaf, t in zip(tree["leaves"], result["trajectories"]):
        ids, mask = rebuild(tree, leaf)
        assert ids == t["prompt_ids"] + t["response_ids"]
        assert mask == [0] * leaf["prompt_len"] + t["loss_mask"]  # a row trains on its own reply only
    check_tree(GroupTree.model_validate(tree), {job: JobResult.model_validate(result)})


async def test_a_weight_swap_inside_the_group_splits_equal_tokens(client, wait_done):
    c = await client()
    a = await submit(c, [grpo_row(0, version=1)])
    b = await submit(c, [grpo_row(0, version=2)])  # the very same tokens, sampled under the next weights
    await wait_done(c, a), await wait_done(c, b)
    tree = await (await c.get("/groups/g/tree")).json()
    (pa, pb) = [leaf["path"] for leaf in tree["leaves"]]
    shared = [n for n in pa if n in pb]
    assert shared and all(not tree["nodes"][n]["sampled"] for n in shared)  # only the prompt is shared
    assert {tuple(map(tuple, tree["nodes"][pa[-1]]["version_runs"])),
            tuple(map(tuple, tree["nodes"][pb[-1]]["version_runs"]))} == {((1, 24),), ((2, 24),)}


async def test_running_and_filtered_jobs_are_named_missing(client, wait_done):
    c = await client()
    done = await submit(c, [grpo_row(1)])
    running = await submit(c, [grpo_row(2)], sleep=30)
    failed = await submit(c, [grpo_row(3)], fail=True)
    await wait_done(c, done), await wait_done(c, failed)
    tree = await (await c.get("/groups/g/tree")).json()
    assert not tree["complete"] and [leaf["job_id"] for leaf in tree["leaves"]] == [done]
    reasons = {m["job_id"]: m["reason"] for m in tree["missing"]}
    assert reasons[running] in ("run", "queued_run") and reasons[failed].startswith("filtered")
    assert (await c.get("/groups/nope/tree")).status == 404
    await c.post("/cancel", json={"job_id": running})


async def test_a_process_client_still_gets_its_group_tree(client):
    c = await client()
    r = await c.post("/process", json={"instance": {"data_source": "rows", "rows": [grpo_row(0)]},
                                       "group_id": "p"})
    assert r.status == 200
    tree = await (await c.get("/groups/p/tree")).json()
    assert tree["complete"] and len(tree["leaves"]) == 1


async def test_a_tree_that_fails_its_invariants_is_never_served(client, wait_done, monkeypatch):
    c = await client()
    jobs = [await submit(c, [grpo_row(i)]) for i in range(2)]
    for j in jobs:
        await wait_done(c, j)
    real = tree_module.build_tree

    def corrupt(*a, **kw):
        tree = real(*a, **kw)
        tree.nodes[-1].token_ids[2] += 1
        return tree

    monkeypatch.setattr(tree_module, "build_tree", corrupt)
    r = await c.get("/groups/g/tree")
    assert r.status == 500
    err = (await r.json())["error"]
    assert err["type"] == "tree_invariant" and jobs[1] in err["message"] and "row position" in err["message"]


def result(job: str, rows: list[dict], reward: float = 0.0) -> JobResult:
    return JobResult(job_id=job, trajectory_id=job, handler="rows", reward=reward,
                     trajectories=[Trajectory(**r) for r in rows])


def test_merging_equal_tokens_of_other_versions_is_caught_by_both_checks():
    """Negative control: a tree whose node claims one version for two rows that differ."""
    results = [("a", result("a", [grpo_row(0, version=1)])), ("b", result("b", [grpo_row(0, version=2)]))]
    rows = [r for j, x in results for r in rows_of(j, x)]
    good = build_tree("g", rows)
    verify_tree(good, rows)
    # the tree one gets from tokens alone: b follows a's path
    bad = good.model_copy(deep=True)
    bad.leaves[1].path = list(bad.leaves[0].path)
    bad.tree_tokens = sum(len(n.token_ids) for n in bad.nodes)
    with pytest.raises(TreeInvariantError, match="weight version differs at row position 40"):
        verify_tree(bad, rows)
    with pytest.raises(TreeCheckError, match="weight version"):
        check_tree(bad, dict(results))


def test_the_trainer_check_catches_a_changed_branch_token_and_a_dropped_loss_mask():
    results = {"a": result("a", [grpo_row(0)]), "b": result("b", [grpo_row(1)])}
    tree = group_tree("g", list(results.items()))
    check_tree(tree, results)
    bad = tree.model_copy(deep=True)
    last = bad.nodes[bad.leaves[1].path[-1]]
    last.token_ids[0] += 1
    with pytest.raises(TreeCheckError, match=f"job 'b' trajectory 0: tokens differ at row position {last.depth}"):
        check_tree(bad, results)
    bad = tree.model_copy(deep=True)
    last = bad.nodes[bad.leaves[0].path[-1]]
    (s, e), = last.sampled[:1]
    last.sampled[0] = (s + 1, e)  # its first generated token made prompt, the version runs one shorter
    last.version_runs[0] = (last.version_runs[0][0], last.version_runs[0][1] - 1)
    with pytest.raises(TreeCheckError, match=f"job 'a' trajectory 0: loss mask differs at row position {last.depth + s}"):
        check_tree(bad, results)


def test_a_leaf_that_trains_on_a_reply_it_held_as_context_is_refused_by_both_checks():
    """Negative control for shared replies: row 1 holds row 0's reply as prompt; a tree that gives row 1 row 0's
    sampled run (it would train row 1 on a token it never generated, with row 0's logprobs) is refused."""
    results = [("a", result("a", turn_rows(3)))]
    rows = [r for j, x in results for r in rows_of(j, x)]
    good = build_tree("g", rows)
    verify_tree(good, rows)
    check_tree(good, dict(results))
    reply = (len(PROMPT), len(PROMPT) + 5)  # row 0's reply: row 1's prompt positions 40..45
    assert reply in good.leaves[0].sampled and good.leaves[1].sampled == [(46, 51)]
    bad = good.model_copy(deep=True)
    bad.leaves[1].sampled = [reply, (46, 51)]
    with pytest.raises(TreeInvariantError, match="trajectory 1: node .*'s loss mask differs at row position 40"):
        verify_tree(bad, rows)
    with pytest.raises(TreeCheckError, match="'a' trajectory 1: loss mask differs at row position 40"):
        check_tree(bad, dict(results))
    # the same tree read as format 1 (an old server's meaning: a node's sampled runs are every row's mask)
    old = good.model_copy(deep=True)
    old.format_version = 1
    with pytest.raises(TreeCheckError, match="trajectory 1: loss mask differs at row position 40"):
        check_tree(old, dict(results))
    # a format this plugin does not know is refused with its reason, and counted as a fallback to rows
    from trainer_plugins.tree import TreeStats, verified_tree

    newer = good.model_copy(deep=True)
    newer.format_version = 3
    stats = TreeStats()
    assert verified_tree(newer, dict(results), stats) is None
    assert stats.fallbacks == 1 and "tree format 3" in stats.last_reason


def test_a_reply_sampled_with_routes_is_never_shared_as_context():
    """Under routing replay a context token has its own prefill route: the rows of a rewritten context with
    routes recorded keep each reply twice, and a tree that shares it anyway is refused by both checks. (The
    trajectories carry a positional ``routed_experts`` record, one route per row position.)"""
    rows_in = turn_rows(3)
    for r in rows_in:
        r["routed_experts"] = [[[t % 4, 1]] for t in range(len(r["prompt_ids"]) + len(r["response_ids"]))]
    results = [("a", result("a", rows_in))]
    rows = [r for j, x in results for r in rows_of(j, x)]
    routed = build_tree("g", rows)
    verify_tree(routed, rows)
    check_tree(routed, dict(results))
    assert routed.tree_tokens == 40 + 3 * 5 + 2 + 2 * 5  # rows 1 and 2 hold the replies they did not sample
    # the unrouted rows' shape (replies shared) forced onto the routed rows
    plain = [("a", result("a", turn_rows(3)))]
    shared = build_tree("g", [r for j, x in plain for r in rows_of(j, x)])
    n_sampled = {n.id: sum(e - s for s, e in n.sampled) for n in shared.nodes}
    for n in shared.nodes:  # the routes of its sampled tokens, from the rows that sampled them
        n.routed_experts = [[[(n.depth + s + q) % 4, 1]] for s, e in n.sampled for q in range(e - s)]
        assert len(n.routed_experts) == n_sampled[n.id]
    with pytest.raises(TreeInvariantError, match="trajectory 1: node .* shares a token it sampled with routes"):
        verify_tree(shared, rows)
    with pytest.raises(TreeCheckError, match="trajectory 1: routed experts differ at row position 40"):
        check_tree(shared, dict(results))


async def test_the_journal_exports_each_groups_verified_tree(tmp_path):
    import json

    from prorl_server.journal.cli import main
    from prorl_server.journal.store import Journal
    from prorl_server.types import ProcessRequest

    path = tmp_path / "journal.db"
    j = Journal(str(path))
    j.start()
    for i, (group, rows, filtered) in enumerate([("g", [grpo_row(0)], False), ("g", [grpo_row(1)], False),
                                                 ("g", [grpo_row(2)], True), ("h", turn_rows(3), False)]):
        req = ProcessRequest(instance={"data_source": "rows"}, job_id=f"j{i}", group_id=group)
        j.job_submitted(req.job_id, "rows", req.model_dump_json().encode())
        res = result(req.job_id, rows, reward=float(i))
        res.filter, res.failure_kind = filtered, "sandbox" if filtered else None
        j.job_result(req.job_id, res.model_dump_json().encode())
    assert j.flush()
    j.close()
    out = tmp_path / "trees.jsonl"
    old_umask = os.umask(0o022)  # a usual umask: without its own mode the export would be world-readable
    try:
        assert await asyncio.to_thread(main, ["export", str(path), "--format", "trees", "--out", str(out),
                                              "--quiet"]) == 0
    finally:
        os.umask(old_umask)
    # the trees hold the journal's token ids and rewards: the export keeps the journal's rule (mode 0600)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    trees = {t["group_id"]: GroupTree.model_validate(t) for t in map(json.loads, out.read_text().splitlines())}
    assert [leaf.job_id for leaf in trees["g"].leaves] == ["j0", "j1"]
    assert [(m.job_id, m.reason) for m in trees["g"].missing] == [("j2", "filtered: sandbox")]
    assert len(trees["h"].leaves) == 3 and trees["h"].complete
    check_tree(trees["g"], {"j0": result("j0", [grpo_row(0)], 0.0), "j1": result("j1", [grpo_row(1)], 1.0)})


async def test_the_servers_group_index_is_bounded(client):
    from prorl_server.app import PIPELINE
    from prorl_server.pipeline import MAX_GROUP_JOBS

    c = await client(keep_finished=100)
    pipeline = c.server.app[PIPELINE]
    for i in range(MAX_GROUP_JOBS + 10):  # a client that puts everything in one group
        pipeline._join_group("big", f"j{i}")
    assert len(pipeline.groups["big"]) == MAX_GROUP_JOBS
    for i in range(6000):  # many small groups: the oldest are forgotten, never the newest
        pipeline._join_group(f"g{i}", f"k{i}")
    assert sum(map(len, pipeline.groups.values())) <= 4096
    assert "big" not in pipeline.groups and "g5999" in pipeline.groups


def test_a_node_that_gives_a_token_it_did_not_generate_a_logprob_is_never_served():
    """The behaviour logprob of a prompt or observation token is 0.0: a node that says otherwise would put a
    logprob where the row has none."""
    results = [("a", result("a", [grpo_row(0)])), ("b", result("b", [grpo_row(1)]))]
    rows = [r for j, x in results for r in rows_of(j, x)]
    tree = build_tree("g", rows)
    verify_tree(tree, rows)
    tree.nodes[0].logprobs[3] = -0.5  # node 0 is the shared prompt
    with pytest.raises(ValueError, match="did not generate a behaviour logprob"):
        verify_tree(tree, rows)


def test_routed_experts_split_equal_tokens_and_give_back_each_rows_routes():
    """Rows with equal tokens and versions but other expert routes for one generated token share the tree up
    to that token only, and each leaf's path gives back its own routes. (The trajectories stand for ones with
    ``routed_experts`` recorded: the tree reads the record of each generated token.)"""
    from types import SimpleNamespace

    def traj(route_of_third):
        row = grpo_row(0)
        n = sum(row["loss_mask"])
        routes = [[k % 4, 1] for k in range(n)]
        routes[2] = route_of_third
        # the record of each generated token, as Trajectory.sampled_routes() gives it from routed_experts
        return SimpleNamespace(**row, routed_experts=routes, sampled_routes=lambda: routes)

    results = [(j, SimpleNamespace(reward=0.0, trajectories=[traj(r)])) for j, r in (("a", [0, 1]), ("b", [3, 2]))]
    rows = [r for j, x in results for r in rows_of(j, x)]
    tree = build_tree("g", rows)
    verify_tree(tree, rows)
    first_sampled = len(PROMPT)
    a, b = (leaf.path for leaf in tree.leaves)
    assert a[:-1] == b[:-1] and a[-1] != b[-1] and tree.nodes[a[-1]].depth == first_sampled + 2
    for leaf, (_, res) in zip(tree.leaves, results):
        got = [r for nid in leaf.path for r in (tree.nodes[nid].routed_experts or [])]
        assert got == res.trajectories[0].routed_experts


def long_row(i: int, n: int = 2000) -> dict:
    """A row of ``n`` response tokens (a full result of ~150 KB held as Python objects)."""
    ids = [1000 + (i * 7 + k) % 3000 for k in range(n)]
    return dict(prompt_ids=PROMPT, response_ids=ids, response_logprobs=[-0.5] * n, loss_mask=[1] * n,
                version_runs=[[0, n]])


async def test_a_served_groups_delivered_results_are_not_kept_whole(client, wait_done, monkeypatch):
    """Memory stays bounded over a run of groups: once a complete tree of a group was served, the results
    ``POST /process`` delivered are reduced to summaries; the tree itself is kept for a repeated GET (a
    client's retry) for the newest groups (``SERVED_TREES``, 4 here), and an older group's repeated GET names
    its reduced results missing. Only a result no client has taken yet stays whole."""
    from prorl_server import pipeline as pipeline_module
    from prorl_server.app import PIPELINE
    from prorl_server.pipeline import result_bytes

    monkeypatch.setattr(pipeline_module, "SERVED_TREES", 4)
    c = await client(keep_finished=10_000, keep_finished_mb=4096)
    pipeline = c.server.app[PIPELINE]
    one = result_bytes(result("x", [long_row(0)]))
    bodies = {}
    for g in range(12):
        for k in range(2):
            r = await c.post("/process", json={"instance": {"data_source": "rows", "rows": [long_row(2 * g + k)]},
                                               "group_id": f"g{g}"})
            assert r.status == 200
        bodies[g] = await (await c.get(f"/groups/g{g}/tree")).read()
        tree = json.loads(bodies[g])
        assert tree["complete"] and len(tree["leaves"]) == 2
    assert pipeline.retained_bytes < 2 * one  # 24 summaries, not 24 results of ~one each
    for g in (8, 11):  # asked again: the same tree, byte for byte
        assert await (await c.get(f"/groups/g{g}/tree")).read() == bodies[g]
    again = await (await c.get("/groups/g0/tree")).json()  # past the 4 kept
    assert {m["reason"] for m in again["missing"]} == {"delivered without retention"}
    # a job submitted without waiting keeps its whole result until its client takes it
    job = await submit(c, [long_row(99)], group="h")
    await wait_done(c, job)
    assert (await (await c.get("/groups/h/tree")).json())["complete"]
    assert (await wait_done(c, job))["trajectories"][0]["response_ids"] == long_row(99)["response_ids"]


async def test_a_groups_delivered_results_are_reduced_after_the_retention_time(client):
    """A group whose tree nobody asks for: its delivered results are reduced ``group_retention_s`` after its
    newest job ended (checked as later jobs end)."""
    from prorl_server.app import PIPELINE
    from prorl_server.pipeline import result_bytes

    c = await client(keep_finished=10_000, keep_finished_mb=4096, group_retention_s=0.2)
    pipeline = c.server.app[PIPELINE]
    one = result_bytes(result("x", [long_row(0)]))
    for g in range(6):
        r = await c.post("/process", json={"instance": {"data_source": "rows", "rows": [long_row(g)]},
                                           "group_id": f"old{g}"})
        assert r.status == 200
    assert pipeline.retained_bytes > 5 * one  # kept whole for their trees within the retention time
    await asyncio.sleep(0.3)
    r = await c.post("/process", json={"instance": {"data_source": "rows", "rows": [long_row(9)]},
                                       "group_id": "new"})
    assert r.status == 200
    assert pipeline.retained_bytes < 2 * one  # the old groups reduced; the new one whole


async def test_a_job_id_reused_outside_its_group_is_refused(client, wait_done):
    # red team (session 11): without a journal, a finished job's id resubmitted in group G2 made G1's tree serve
    # G2's rows and reward under G1's leaf, with complete: true
    c = await client()
    r = await c.post("/jobs", json={"instance": {"data_source": "rows", "rows": [grpo_row(0)], "reward": 0.0},
                                    "group_id": "G1", "job_id": "dupid"})
    assert r.status == 202, await r.text()
    await wait_done(c, "dupid")
    for other in ({"group_id": "G2"}, {}):
        r = await c.post("/jobs", json={"instance": {"data_source": "rows", "rows": [grpo_row(5)], "reward": 1.0},
                                        "job_id": "dupid", **other})
        assert r.status == 409 and "G1" in (await r.json())["error"]["message"], await r.text()
    tree = await (await c.get("/groups/G1/tree")).json()
    (leaf,) = tree["leaves"]
    assert leaf["job_id"] == "dupid" and leaf["reward"] == 0.0
    # the same group may run its job id again (a re-run of its own sample)
    r = await c.post("/jobs", json={"instance": {"data_source": "rows", "rows": [grpo_row(0)], "reward": 0.0},
                                    "group_id": "G1", "job_id": "dupid"})
    assert r.status == 202, await r.text()


async def test_a_group_past_the_index_cap_never_says_complete(client, wait_done, monkeypatch):
    # red team (session 11): the jobs past the per-group cap were in neither leaves nor missing, complete: true
    import prorl_server.app as app_module
    import prorl_server.pipeline as pipeline_module

    monkeypatch.setattr(pipeline_module, "MAX_GROUP_JOBS", 3)  # stands for 1,024, with 5 real jobs
    monkeypatch.setattr(app_module, "MAX_GROUP_JOBS", 3)
    c = await client()
    jobs = [await submit(c, [grpo_row(i)], group="huge") for i in range(5)]
    for job in jobs:
        await wait_done(c, job)
    tree = await (await c.get("/groups/huge/tree")).json()
    assert len(tree["leaves"]) == 3 and not tree["complete"]
    assert [list(m.values()) if isinstance(m, dict) else list(m) for m in tree["missing"]] == [
        ["2 more jobs", "not indexed: a group's tree holds its first 3"]]


@pytest.mark.parametrize("bad", ["x\ny", "\x00z", "tab\there"])
async def test_ids_with_control_characters_are_refused(client, bad):
    c = await client()
    for field in ("group_id", "job_id"):
        r = await c.post("/jobs", json={"instance": {"data_source": "rows", "rows": [grpo_row(0)]}, field: bad})
        assert r.status == 422, (field, await r.text())


def test_random_groups_of_branches_rewrites_and_weight_swaps_build_trees_both_checks_accept():
    """Many seeded groups mixing what the builder must tell apart: rows that branch, rows that re-send an
    earlier row's reply as context, equal tokens sampled under two versions, a turn split by a swap; every
    tree passes both checks, and its nodes built with the fast constructor dump as pydantic's own would."""
    import random

    from prorl_server.types import TreeNode

    for seed in range(40):
        rnd = random.Random(seed)
        base = [rnd.randrange(5, 9) for _ in range(6)]  # a small vocabulary: equal tokens are common
        rows, hist = [], list(PROMPT[:5])
        for t in range(rnd.randrange(2, 6)):
            out = [rnd.randrange(5, 9) for _ in range(rnd.randrange(1, 5))] if rnd.random() < .5 else base[:3]
            v = rnd.choice([1, 2])
            split = rnd.random() < .2 and len(out) > 1
            runs = [[1, 1], [2, len(out) - 1]] if split else [[v, len(out)]]
            prompt = list(hist) if rnd.random() < .7 else hist[:rnd.randrange(1, len(hist) + 1)]
            rows.append(dict(prompt_ids=prompt, response_ids=out, response_logprobs=[-.5] * len(out),
                             loss_mask=[1] * len(out), version_runs=runs))
            hist = prompt + out + [rnd.randrange(5, 9)]
        results = [(f"j{k}", result(f"j{k}", rows[k:k + 2], reward=k)) for k in range(0, len(rows), 2)]
        tree = group_tree("g", results)  # builds and verifies
        check_tree(tree, dict(results))
        assert [leaf.sampled for leaf in tree.leaves] == [  # each leaf's own loss mask, whatever its nodes share
            [(len(r["prompt_ids"]), len(r["prompt_ids"]) + len(r["response_ids"]))] for r in rows]
        for n in tree.nodes[:3]:
            assert n.model_dump_json() == TreeNode.model_construct(**n.__dict__).model_dump_json()


# ---------------------------------------------------------------------------------------------- who may read it
# A tree holds other jobs' token ids, logprobs and rewards (a red team's finding). Its rule is the one of the
# jobs it is built from: this server has one bearer token (--token-file / PRORL_TOKEN) and no per-client job
# owner, so whoever may read GET /jobs/{id} (and submit with POST /process) may read every group's tree, and
# nobody else. The journal's `export --format trees` keeps its own rule: the journal file's mode 0600.

OWNER = {"Authorization": "Bearer owner-s3cret"}


async def test_only_a_caller_that_may_read_the_groups_jobs_gets_its_tree(client):
    c = await client(token="owner-s3cret")
    jobs = []
    for i in range(2):
        r = await c.post("/jobs", headers=OWNER, json={"instance": {"data_source": "rows", "rows": [grpo_row(i)]},
                                                       "group_id": "g"})
        assert r.status == 202, await r.text()
        jobs.append((await r.json())["job_id"])
    for j in jobs:  # polled with the owner's token (a guard against a hang: 120 s)
        for _ in range(6000):
            if (await (await c.get(f"/jobs/{j}", headers=OWNER)).json())["state"] == "done":
                break
            await asyncio.sleep(0.02)
    for other in ({}, {"Authorization": "Bearer another-tenant"}, {"Authorization": "owner-s3cret"}):
        for path in ("/groups/g/tree", "/groups/no-such-group/tree", f"/jobs/{jobs[0]}"):
            r = await c.get(path, headers=other)
            body = await r.text()
            # a JSON reason, the same whether the group exists or not, and nothing of its rows
            assert r.status == 401, (other, path, body)
            assert list(await r.json()) == ["error"] and (await r.json())["error"]["type"] == "unauthorized"
            assert str(PROMPT[0]) not in body and "token_ids" not in body
    r = await c.get("/groups/g/tree", headers=OWNER)
    assert r.status == 200, await r.text()
    tree = await r.json()
    assert tree["complete"] and sorted(leaf["job_id"] for leaf in tree["leaves"]) == sorted(jobs)
    assert tree["nodes"][0]["token_ids"][:len(PROMPT)] == PROMPT


def test_the_tree_route_is_authorized_like_the_job_routes():
    """The route table gives the tree the rule of GET /jobs/{id} and POST /process (the auth middleware and
    the OpenAPI document both read it)."""
    from prorl_server.app import ROUTES

    auth = {(r.method, r.path): r.auth for r in ROUTES}
    assert auth[("GET", "/groups/{group_id}/tree")] == auth[("GET", "/jobs/{job_id}")] \
        == auth[("POST", "/process")] == "bearer"


# ------------------------------------------------------------------ the compiled build and check (prorl_server/_tree_c.c)
# Rows without routed experts are built and checked by the compiled module, the Python code being the
# reference: the same tree byte for byte, the same logprob spread, and never a pass where the Python check
# fails (a compiled check that fails hands over to the Python one, which names the failure).

def test_the_install_builds_the_compiled_tree_module():
    """`pip install -e .` (the README's install) compiles it; without it every tree is built in Python, about
    2-10x slower (benchmarks/tree_training.py). setup.py marks it optional, so only this test says it is missing."""
    assert tree_module._tree_c is not None, "prorl_server/_tree_c.c was not compiled: run `pip install -e .` again"


def _random_group(rnd) -> list[tuple[str, JobResult]]:
    """Rows that branch, re-send earlier replies (whole or cut) as context, hold context inside a turn, sample
    under two versions (a swap inside a turn too), carry an unknown version (version runs that do not add up)
    or fewer logprobs than tokens; a small vocabulary, so equal tokens are common."""
    vocab = rnd.choice([3, 6, 50])
    base = [rnd.randrange(5, 5 + vocab) for _ in range(8)]
    rows, hist = [], [rnd.randrange(5, 5 + vocab) for _ in range(rnd.randrange(0, 6))]
    for _ in range(rnd.randrange(1, 8)):
        n = rnd.randrange(0, 6)
        out = [rnd.randrange(5, 5 + vocab) for _ in range(n)] if rnd.random() < .5 else base[:n]
        mask = [rnd.choice([0, 1, 1]) for _ in out]
        ns = sum(mask)
        if ns > 1 and rnd.random() < .3:
            runs = [[1, 1], [2, ns - 1]]
        elif ns and rnd.random() < .1:
            runs = [[1, ns + 1]]
        else:
            runs = [[rnd.choice([1, 2, None]), ns]] if ns else []
        lps = [round(-rnd.random(), 2) if m else 0.0 for m in mask]
        if rnd.random() < .2:
            lps = lps[:rnd.randrange(0, len(lps) + 1)]
        prompt = list(hist) if rnd.random() < .7 else hist[:rnd.randrange(0, len(hist) + 1)]
        rows.append(dict(prompt_ids=prompt, response_ids=out, response_logprobs=lps, loss_mask=mask,
                         version_runs=runs))
        hist = prompt + out + [rnd.randrange(5, 5 + vocab)]
    rnd.shuffle(rows)
    return [(f"j{k}", result(f"j{k}", rows[k:k + 2], reward=k)) for k in range(0, len(rows), 2)]


def _tampered(rnd, tree: GroupTree) -> GroupTree:
    """``tree`` with one thing changed: a token, a sampled run, a logprob (NaN and inf too), a version, a
    path cut or swapped, a leaf's sampled runs, a parent or a depth."""
    bad = tree.model_copy(deep=True)
    x = rnd.choice(bad.nodes)
    leaf = rnd.choice(bad.leaves)
    kind = rnd.randrange(9)
    if kind == 0:
        x.token_ids[rnd.randrange(len(x.token_ids))] += 1
    elif kind == 1 and x.sampled and x.sampled[0][1] - x.sampled[0][0] > 1:
        x.sampled[0] = (x.sampled[0][0] + 1, x.sampled[0][1])
    elif kind == 2:
        x.logprobs[rnd.randrange(len(x.logprobs))] = rnd.choice([-0.3, 0.0, float("nan"), float("inf")])
    elif kind == 3 and x.version_runs:
        x.version_runs[0] = (rnd.choice([1, 2, 3, None]), x.version_runs[0][1])
    elif kind == 4 and leaf.path:
        leaf.path = leaf.path[:-1]
    elif kind == 5:
        leaf.path = list(rnd.choice(bad.leaves).path)
    elif kind == 6:
        leaf.sampled = leaf.sampled[1:] if leaf.sampled else [(0, 1)]
    elif kind == 7:
        x.parent = rnd.choice([None, 0, 1, 5])
    else:
        x.depth += 1
    return bad


def test_the_compiled_build_and_check_agree_with_the_python_ones_on_random_groups(monkeypatch):
    import random

    assert tree_module._tree_c is not None
    compiled = tree_module._tree_c

    def python_check(tree, rows):
        monkeypatch.setattr(tree_module, "_tree_c", None)
        try:
            return verify_tree(tree, rows)
        finally:
            monkeypatch.setattr(tree_module, "_tree_c", compiled)

    refused = 0
    for seed in range(400):
        rnd = random.Random(seed)
        rows = [r for j, x in _random_group(rnd) for r in rows_of(j, x)]
        tree = build_tree("g", rows)
        assert tree.model_dump_json() == tree_module._build_python("g", rows).model_dump_json(), seed
        assert tree_module._verify_c(tree, rows) == python_check(tree, rows), seed
        for _ in range(4 if tree.nodes else 0):
            bad = _tampered(rnd, tree)
            try:
                spread = python_check(bad, rows)
            except (TreeInvariantError, ValueError):
                refused += 1
                assert tree_module._verify_c(bad, rows) is None, seed  # never a pass where Python refuses
                with pytest.raises((TreeInvariantError, ValueError)):
                    verify_tree(bad, rows)  # and the route's check names it
            else:
                assert tree_module._verify_c(bad, rows) in (spread, None), seed
    assert refused > 1000  # the tampering did change trees


def test_a_token_id_past_64_bits_and_routed_rows_take_the_python_build(monkeypatch):
    """What the compiled module does not read goes to the Python code: token ids past 64 bits, rows with
    routed experts (their provenance per token is a route record)."""
    calls = []
    python_build = tree_module._build_python
    monkeypatch.setattr(tree_module, "_build_python", lambda *a: calls.append(a) or python_build(*a))
    big = [("a", result("a", [dict(prompt_ids=[2 ** 70, 5], response_ids=[6, 7], response_logprobs=[-.1, -.2],
                                    loss_mask=[1, 1], version_runs=[[1, 2]])]))]
    tree = group_tree("g", big)
    assert len(calls) == 1 and tree.nodes[0].token_ids == [2 ** 70, 5, 6, 7]
    group_tree("g", [("a", result("a", [grpo_row(0)]))])
    assert len(calls) == 1  # a plain row: compiled


@pytest.mark.parametrize("group", ["HumanEval/0", "..", "a b?c#d"])
async def test_the_trl_plugin_fetches_the_tree_of_a_group_id_with_url_characters(client, wait_done, group):
    """The route decodes its percent-encoded path segment; the TRL plugin's fetch encodes the group id (before,
    `HumanEval/0` reached no route, `..` was folded away by the HTTP client, `?`/`#` cut the path)."""
    import aiohttp

    from trainer_plugins.trl.tree_pack import ServerTrees

    c = await client()
    jobs = [await submit(c, [grpo_row(i)], group=group) for i in range(2)]
    results = [JobResult.model_validate(await wait_done(c, j)) for j in jobs]
    trees = ServerTrees()
    async with aiohttp.ClientSession() as http:
        await trees.collect(http, {}, [(group, str(c.make_url("")), results, [0, 0])])
    assert trees.stats.fallbacks == 0, trees.stats.last_reason
    assert len(trees._calls[-1]) == 2


async def test_a_served_tree_is_answered_again_only_while_its_group_has_the_same_jobs(client, wait_done):
    """A job that joins the group after its complete tree was served makes a new tree: the kept one does not
    hold it (the reduced results of the first jobs are then named missing)."""
    c = await client()
    for i in range(2):
        r = await c.post("/process", json={"instance": {"data_source": "rows", "rows": [grpo_row(i)]},
                                           "group_id": "late"})
        assert r.status == 200
    first = await (await c.get("/groups/late/tree")).read()
    assert await (await c.get("/groups/late/tree")).read() == first
    job = await submit(c, [grpo_row(2)], group="late")
    await wait_done(c, job)
    tree = await (await c.get("/groups/late/tree")).json()
    assert [leaf["job_id"] for leaf in tree["leaves"]] == [job] and not tree["complete"]
    assert {m["reason"] for m in tree["missing"]} == {"delivered without retention"}


async def test_a_job_id_run_again_in_its_group_gets_a_new_tree_not_the_kept_one(client):
    """Red team (session 14, row 2): a job id of the group resubmitted after the group's complete tree was served
    runs again with other rows; the next GET must build the tree of the new run, not answer the kept one."""
    c = await client()
    for job_id, i in (("re-a", 0), ("re-b", 1)):
        r = await c.post("/process", json={"instance": {"data_source": "rows", "rows": [grpo_row(i)]},
                                           "group_id": "re", "job_id": job_id})
        assert r.status == 200, await r.text()
    first = await (await c.get("/groups/re/tree")).json()
    assert first["complete"]
    r = await c.post("/process", json={"instance": {"data_source": "rows", "rows": [grpo_row(5)], "reward": 1.0},
                                       "group_id": "re", "job_id": "re-a"})
    assert r.status == 200, await r.text()
    rerun = (await r.json())["trajectories"][0]
    assert rerun["response_ids"] == grpo_row(5)["response_ids"] != grpo_row(0)["response_ids"]  # it ran again
    tree = await (await c.get("/groups/re/tree")).json()
    leaf = next(leaf for leaf in tree["leaves"] if leaf["job_id"] == "re-a")
    assert rebuild(tree, leaf)[0] == rerun["prompt_ids"] + rerun["response_ids"] and leaf["reward"] == 1.0


def test_a_result_with_a_non_finite_logprob_is_named_missing_and_the_rest_of_the_tree_served():
    """Red team (session 14, row 1): a handler recorded a NaN behaviour logprob; the server stores it as JSON
    null, which does not parse back. The whole group's tree answered 500 internal_error every time; now that
    job is named in `missing` with why and the others' tree is served."""
    from prorl_server.tree import tree_of_results

    good = result("a", [grpo_row(0)])
    row = grpo_row(1)
    row["response_logprobs"] = [float("nan")] + row["response_logprobs"][1:]
    bad = result("b", [row])
    assert b"null" in bad.model_dump_json().encode()
    tree = tree_of_results("g", [("a", good.model_dump_json().encode()), ("b", bad.model_dump_json().encode())])
    assert [leaf.job_id for leaf in tree.leaves] == ["a"] and not tree.complete
    (gone,) = tree.missing
    assert gone.job_id == "b" and gone.reason.startswith("its result does not parse: trajectories.0.response_logprobs")


def test_a_server_without_the_compiled_tree_module_says_so_at_start(monkeypatch, caplog):
    """Red team (session 14, row 7): an install without a C compiler went on silently (pip shows its warning
    only with -v); the server now says at start that its trees are built in Python."""
    import logging

    from prorl_server.app import create_app
    from prorl_server.config import ServerSettings

    monkeypatch.setattr(tree_module, "_tree_c", None)
    with caplog.at_level(logging.WARNING, logger="prorl_server.app"):
        create_app(ServerSettings(health_interval_s=3600))
    assert any("prorl_server._tree_c is not compiled" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("compiled", [True, False])
def test_a_wrong_leaf_reward_a_node_id_off_its_index_and_an_orphan_node_are_refused(monkeypatch, compiled):
    """Red team (session 14, row 14): neither check looked at these (both walk the leaves' paths only)."""
    if not compiled:
        monkeypatch.setattr(tree_module, "_tree_c", None)
    results = [("a", result("a", [grpo_row(0)], reward=0.0)), ("b", result("b", [grpo_row(1)], reward=1.0))]
    rows = [r for j, x in results for r in rows_of(j, x)]
    good = build_tree("g", rows)
    verify_tree(good, rows)
    bad = good.model_copy(deep=True)
    bad.leaves[1].reward = 0.0
    with pytest.raises(TreeInvariantError, match="trajectory 0: the leaf's reward 0.0 is not its row's 1.0"):
        verify_tree(bad, rows)
    bad = good.model_copy(deep=True)
    bad.nodes[1].id = 7
    with pytest.raises(ValueError, match="node 1 has id 7"):
        verify_tree(bad, rows)
    bad = good.model_copy(deep=True)
    orphan = bad.nodes[-1].model_copy(update={"id": len(bad.nodes), "parent": None, "depth": 0})
    bad.nodes.append(orphan)
    bad.tree_tokens += len(orphan.token_ids)
    with pytest.raises(ValueError, match=f"node {orphan.id} is on no leaf's path"):
        verify_tree(bad, rows)


def test_the_routes_json_of_a_tree_is_pydantics_byte_for_byte():
    """tree_json writes a node and a leaf at a time (a 34 MB tree in one pydantic call held the event loop
    192 ms, red team row 6); its bytes are model_dump_json's, whatever the ids hold."""
    from prorl_server.tree import tree_json
    from prorl_server.types import MissingJob

    rows = [grpo_row(i) for i in range(4)]
    for gid in ("g", 'x","nodes":[],"leaves":[]', "ü\\\"", "a/b"):
        tree = group_tree(gid, [(f"j{i}", result(f"j{i}", [r], reward=i)) for i, r in enumerate(rows)])
        tree.missing = [MissingJob(job_id='j"nodes":[],"leaves":[]', reason="running")]
        assert tree_json(tree) == tree.model_dump_json().encode()
    empty = group_tree("e", [])
    assert tree_json(empty) == empty.model_dump_json().encode()
