"""``benchmarks/tree_training.py`` (issue #34 part 5) stays importable and its pure helpers say what the benchmark
claims: the GRPO agents' scripts branch where the issue's group does (sample i on the shared path for its first
``i % 4`` turns), the rewriting agent compacts every reply (so every turn is a row), the branch check catches rows
that do not share what their scripts share, the per-row side follows the server tree's leaf order, and a server
tree that does not give back the rows is refused before anything trains on it. The benchmark itself, run end to
end against vLLM and the rollout server, is the check of the service path (its last line is in
docs/benchmarks.md); the synthetic path runs here with ``--build-only``."""
from __future__ import annotations

import importlib.util
import itertools
import json
import random
import sys
from pathlib import Path

import pytest

from prorl_server.tree import group_tree
from prorl_server.types import Trajectory
from trainer_plugins.tree import TreeCheckError

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return _load("tree_training")


@pytest.fixture(scope="module")
def agent():
    return _load("tree_agents")


def _text():
    counter = itertools.count()
    return lambda n: f"text{next(counter)}:{n}"


def test_grpo_scripts_branch_after_i_mod_4_shared_turns(bench):
    scripts = bench.grpo_scripts(_text(), "m", samples=8, turns=4, prompt=300, turn=64, obs=48)
    assert len(scripts) == 8 and {s["task"] for s in scripts} == {"text0:300"}
    shared = [(t["seed"], t["observation"]) for t in scripts[3]["turns"][:3]]
    own = set()
    for i, s in enumerate(scripts):
        steps = s["turns"]
        assert [t["tokens"] for t in steps] == [64] * 4 and steps[-1]["observation"] is None
        assert s["reward"] == i % 2 and not s["rewrite"]
        k = i % 4
        assert [(t["seed"], t["observation"]) for t in steps[:k]] == shared[:k]
        for t in steps[k:]:  # its own seed from the turn it branches at: no two samples share one there
            assert t["seed"] not in own and t["seed"] not in [sd for sd, _ in shared]
            own.add(t["seed"])
            assert t["observation"] is None or t["observation"] not in [ob for _, ob in shared]


def test_rewrite_scripts_are_agents_of_one_prompt_with_their_own_turns(bench):
    scripts = bench.rewrite_scripts(_text(), "m", agents=4, turns=8, prompt=800, turn=40, obs=120)
    assert len(scripts) == 4 and len({s["task"] for s in scripts}) == 1 and all(s["rewrite"] for s in scripts)
    seeds = [t["seed"] for s in scripts for t in s["turns"]]
    assert len(set(seeds)) == 32
    assert all(len(s["turns"]) == 8 and s["turns"][-1]["observation"] is None for s in scripts)


def test_agent_echoes_the_served_answer_or_compacts_it(agent):
    history = [{"role": "system", "content": "s"}, {"role": "user", "content": "task"}]
    served = {"role": "assistant", "content": "abc", "tool_calls": None, "refusal": None}
    kept = agent.next_messages(history, served, 0, "obs", rewrite=False)
    assert kept == history + [{"role": "assistant", "content": "abc"}, {"role": "user", "content": "obs"}]
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    assert agent.answer_message({"role": "assistant", "content": "", "tool_calls": calls}) == \
        {"role": "assistant", "content": "", "tool_calls": calls}
    compacted = agent.next_messages(history, served, 3, None, rewrite=True)
    assert compacted == history + [{"role": "assistant", "content": "(reply 3 elided)"}]


def _row(prompt: list[int], turns: list[tuple[list[int], list[int]]]) -> Trajectory:
    ids, mask = [], []
    for gen, obs in turns:
        ids += gen + obs
        mask += [1] * len(gen) + [0] * len(obs)
    return Trajectory(prompt_ids=prompt, response_ids=ids, response_logprobs=[0.0] * len(ids), loss_mask=mask)


def test_branches_as_scripted_counts_rows_that_share_their_scripted_turns(bench):
    rnd = random.Random(0)
    ids = lambda n: [rnd.randrange(10, 4000) for _ in range(n)]  # noqa: E731
    p, main = ids(5), [(ids(3), ids(2)) for _ in range(4)]
    rows = [_row(p, [main[t] if t < i % 4 else (ids(3), ids(2)) for t in range(4)]) for i in range(8)]
    assert bench.branches_as_scripted(rows, 4) == (6, 6)
    # sample 2 should follow the shared path for two turns; a different token in its second turn breaks it
    bad = [main[0], ([main[1][0][0] + 1] + main[1][0][1:], main[1][1]), (ids(3), ids(2)), (ids(3), ids(2))]
    rows[2] = _row(p, bad)
    assert bench.branches_as_scripted(rows, 4) == (5, 6)
    assert bench.sampled_runs([0, 1, 1, 0, 1], offset=10) == [(11, 13), (14, 15)]


def test_row_facts_measure_turns_and_the_context_between_them(bench):
    one = _row([1] * 7, [([2] * 4, [3] * 5), ([2] * 4, [])])
    assert bench.row_facts([one]) == {"prompt_tokens": 7, "gen_tokens_per_turn": 4.0,
                                      "context_tokens_between_turns": 5.0}
    per_turn = [Trajectory(prompt_ids=[1] * n, response_ids=[2] * 3, response_logprobs=[0.0] * 3,
                           loss_mask=[1] * 3) for n in (10, 16, 22)]
    assert bench.row_facts(per_turn)["context_tokens_between_turns"] == 6.0


def test_rows_follow_the_server_trees_leaves_and_a_wrong_tree_is_refused(bench):
    results = bench.grpo_group(random.Random(1), samples=4)
    tree = group_tree("grpo", results)
    rows = bench.leaf_rows(tree, list(reversed(results)))  # the results in another order than the leaves
    assert [t.prompt_ids + t.response_ids for t, _ in rows] == \
        [r.trajectories[0].prompt_ids + r.trajectories[0].response_ids for _, r in results]
    assert [reward for _, reward in rows] == [r.reward for _, r in results]
    bad = tree.model_copy(deep=True)
    bad.nodes[-1].token_ids[0] += 1
    with pytest.raises(TreeCheckError):
        bench.run("grpo", None, results, 1, tree=bad, route_s=0.01)
    out = bench.run("grpo", None, results, 1, tree=tree, route_s=0.01)
    assert out["route_get_ms"] == 10.0 and out["server_tree_equals_local"] is True


def test_synthetic_build_only_ends_with_one_json_line(bench, capsys):
    assert bench.main(["--source", "synthetic", "--build-only", "--grpo-samples", "2", "--repeats", "1"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["source"] == "synthetic" and [g["group"] for g in last["groups"]] == ["grpo", "rewrite"]
    assert "route_work_ms_per_100k" in last["groups"][0]
