"""Tree-packed training vs one forward per row (issue #34), side by side in one run, on the project's tiny Qwen2
on CPU (fp32, SDPA), with rows that come from the service.

``--source service`` (the default): the tiny model (``.cache/tiny-model``, built if missing) on a CPU vLLM
server, a rollout server in its own process (``python -m prorl_server``, bubblewrap sandboxes, a bearer token)
and two groups of ``cli_agent`` jobs submitted with ``POST /process`` (``group_id``, ``group_size``), each job
running the scripted agent program ``benchmarks/tree_agents.py`` (standard library; it speaks the OpenAI Chat
Completions API to its gateway session, so the gateway records the rows):

- ``grpo``: 8 samples x 4 turns (prompt ~300 tokens, 64 generated tokens a turn with ``min_tokens =
  max_tokens``, a ~48-token observation between turns); sample i follows the group's shared path for its
  first ``i % 4`` turns and branches after. The shared turns are the same request with the same per-turn
  ``seed``, so the rows share what the scripts share as long as vLLM's seeded sampler gives the same tokens
  whatever else is in the batch (it did on CPU in every run here); ``branches_as_scripted`` counts the samples
  whose row equals its partner's through its last shared turn (one that does not is a vLLM nondeterminism,
  and shows as a higher ratio). All twelve jobs of both groups run concurrently.
- ``rewrite``: 4 agents x 8 turns that compact their history every turn: each reply, once answered, is
  replaced by a one-line note, so the gateway splits the session at every request (``message_changed``) and
  each turn is a row of its own holding the whole compacted history as its prompt (prompt ~800 tokens, 40
  generated tokens a turn, a ~120-token observation). Unlike the synthetic group below, no row holds an
  earlier reply as context: the gateway renders a split's history afresh and the random tiny model's sampled
  tokens rarely re-tokenize to themselves, so a re-sent reply would not share its sampled tokens; the prompt
  is longer than the synthetic 600 so that the shared history is as long against each turn's new tokens
  (with 600 the ratio measured 0.155, over the issue's 0.15; with 800, 0.137).

Rewards are scripted (``eval="reward_info"``: 0/1 alternating; the benchmark measures training cost and
exactness, which do not depend on where the reward came from). After the jobs end, each group's tree comes
from the server (``GET /groups/{group_id}/tree``, its wall time printed as ``route_get_ms``), is checked on
receipt against the job results as the TRL plugin does (:func:`trainer_plugins.tree.check_tree`), and the
servers are stopped before any timing of the model. The per-row side trains on the job results' rows
(``prompt_ids + response_ids``, ``loss_mask``), the packed side on the server's tree.

``--source synthetic``: the same two shapes as random token ids of the tiny vocabulary (no vLLM, no server;
prompt 600 for ``rewrite``, whose agents re-send their whole history, replies included), the tree built here.

For each group: the server's build+verify of the tree on the same results (:func:`prorl_server.tree.group_tree`
and the route's whole work from result JSON, :func:`prorl_server.tree.tree_of_results`, per 100k flat tokens),
then one forward+backward of a per-row GRPO-style loss (``advantage * sum of the row's generated tokens'
logprobs``) per row and packed from the tree (:mod:`trainer_plugins.trl.tree_pack`), the best of
``--repeats``; prints flat and tree tokens, the ratio, both times and the speed-up in wall clock and in the
process's CPU time (``cpu_speedup``: all threads; other sessions' load stretches wall clock by waiting for the
cores, CPU time hardly), the max logprob difference and the relative gradient difference, and ends with one
JSON line (with the 1-minute load average before and after the training steps: wall-clock timings are only
meaningful on quiet cores; ``source`` and, for the
service, the model, vLLM's version and each group's measured tokens per prompt, turn and observation).

The packed side attends node by node (``--attention tree``, the default:
:func:`trainer_plugins.trl.tree_pack.tree_attention_forward`) or through the dense S x S ancestor mask
(``--attention dense``: the path eager models take, built inside the timed step as the trainer builds it).

    .venv/bin/python benchmarks/tree_training.py [--source service|synthetic] [--repeats 3] [--seed 0]
        [--attention tree|dense] [--build-only]

Takes ~1.5 minutes with the service on 2 shared cores (vLLM ready in ~25-50 s, the 12 jobs in ~15 s, then the
training steps).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from prorl_server.tree import group_tree, tree_of_results  # noqa: E402
from prorl_server.types import GroupTree, JobResult, Trajectory  # noqa: E402
from trainer_plugins.tree import check_tree  # noqa: E402
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


# ------------------------------------------------------------------------------------------ rows from the service
AGENT = ROOT / "benchmarks" / "tree_agents.py"
#: words the scripted texts are made of (Python's keywords and builtins: the tiny tokenizer was trained on
#: CPython's stdlib, so they are ordinary text to it)
WORDS = sorted({w for w in __import__("keyword").kwlist + dir(__import__("builtins")) if w.isalpha()})
SYSTEM = "You are a coding agent. Read the task, act, and read what your actions return."


def text_of(tokenizer: Any, rnd: random.Random, n: int) -> str:
    """Words drawn from :data:`WORDS` whose encoding by ``tokenizer`` is ~``n`` tokens (the fewest words that
    reach ``n``; a chat template adds its markers around it)."""
    words = [rnd.choice(WORDS) for _ in range(n)]  # every word is at least one token
    lo, hi = 1, n
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.encode(" ".join(words[:mid]), add_special_tokens=False)) >= n:
            hi = mid
        else:
            lo = mid + 1
    return " ".join(words[:lo])


def grpo_scripts(text: Callable[[int], str], model: str, samples: int = 8, turns: int = 4, prompt: int = 300,
                 turn: int = 64, obs: int = 48, seed: int = 0) -> list[dict[str, Any]]:
    """The agent scripts (``benchmarks/tree_agents.py``'s ``script.json``) of a GRPO group: ``samples`` agents of
    one prompt (``text(prompt)``: ~``prompt`` tokens), ``turns`` turns of ``turn`` generated tokens each, an
    observation of ``text(obs)`` after every turn but the last. Sample i takes the shared path's seed and
    observation for its first ``i % turns`` turns and its own after (where it branches); its reward is
    ``i % 2``."""
    task = text(prompt)
    shared = [(seed * 100_000 + t, text(obs)) for t in range(turns)]
    out = []
    for i in range(samples):
        steps = []
        for t in range(turns):
            sd, ob = shared[t] if t < i % turns else (seed * 100_000 + 1_000 * (i + 1) + t, text(obs))
            steps.append({"seed": sd, "tokens": turn, "observation": ob if t < turns - 1 else None})
        out.append({"model": model, "system": SYSTEM, "task": task, "rewrite": False, "reward": float(i % 2),
                    "turns": steps})
    return out


def rewrite_scripts(text: Callable[[int], str], model: str, agents: int = 4, turns: int = 8, prompt: int = 800,
                    turn: int = 40, obs: int = 120, seed: int = 0) -> list[dict[str, Any]]:
    """The agent scripts of a group of ``agents`` agents of one prompt that compact their history every turn
    (``rewrite``: each reply replaced by a note once answered, so every turn is a row), ``turns`` turns of
    ``turn`` generated tokens, each agent its own seeds and observations (``text(obs)``); reward ``a % 2``."""
    task = text(prompt)
    return [{"model": model, "system": SYSTEM, "task": task, "rewrite": True, "reward": float(a % 2),
             "turns": [{"seed": seed * 100_000 + 50_000 + 1_000 * a + t, "tokens": turn,
                        "observation": text(obs) if t < turns - 1 else None} for t in range(turns)]}
            for a in range(agents)]


def sampled_runs(mask: list[int], offset: int = 0) -> list[tuple[int, int]]:
    """The ``[start, end)`` runs of 1s of ``mask`` (a loss mask), shifted by ``offset`` (a row's prompt length:
    row positions)."""
    runs, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m == 1 and start is None:
            start = i
        elif m != 1 and start is not None:
            runs.append((start + offset, i + offset))
            start = None
    return runs


def branches_as_scripted(rows: list[Trajectory], turns: int) -> tuple[int, int]:
    """(samples whose row equals a partner's through the end of its last shared turn, samples that share a turn)
    for a GRPO group from :func:`grpo_scripts` (``rows[i]``: sample i's single row): sample i with
    ``k = i % turns > 0`` must agree, token for token, with another sample j with ``j % turns >= k`` up to
    where its turn k's generated tokens start."""
    ok = n = 0
    for i, row in enumerate(rows):
        k = i % turns
        partners = [j for j in range(len(rows)) if j != i and j % turns >= k]
        runs = sampled_runs(row.loss_mask, len(row.prompt_ids))
        if k == 0 or not partners or len(runs) <= k:
            continue
        n += 1
        a = row.prompt_ids + row.response_ids
        b = rows[max(partners, key=lambda j: j % turns)]
        b = b.prompt_ids + b.response_ids
        ok += a[:runs[k][0]] == b[:runs[k][0]]
    return ok, n


def row_facts(rows: list[Trajectory]) -> dict[str, float]:
    """Measured shape of a group's rows (tokens): the first row's prompt, the mean generated run, and the mean
    context between two generated runs of a row (observation plus template markers; with one row per turn, the
    mean growth of the prompt from one turn's row to the next: the note in place of the reply, the observation
    and their markers)."""
    gen = [b - a for r in rows for a, b in sampled_runs(r.loss_mask)]
    between = [b[0] - a[1] for r in rows for a, b in zip(sampled_runs(r.loss_mask), sampled_runs(r.loss_mask)[1:])]
    if not between:
        between = [len(b.prompt_ids) - len(a.prompt_ids) for a, b in zip(rows, rows[1:])
                   if len(b.prompt_ids) > len(a.prompt_ids)]  # the next row of the same agent
    mean = lambda v: round(sum(v) / len(v), 1) if v else 0.0  # noqa: E731
    return {"prompt_tokens": len(rows[0].prompt_ids), "gen_tokens_per_turn": mean(gen),
            "context_tokens_between_turns": mean(between)}


@contextlib.contextmanager
def rollout_server(vllm: str, token: str) -> Iterator[str]:
    """A rollout server in its own process (``python -m prorl_server``: bubblewrap sandboxes, no journal, the
    bearer ``token`` through ``PRORL_TOKEN``, ``vllm`` its backend); its URL. Stopped on exit (SIGTERM: it
    cancels its jobs and closes its sandboxes; SIGKILL after 60 s)."""
    tmp = Path(tempfile.mkdtemp(prefix="tree-bench-"))
    ready = tmp / "ready.json"
    proc = subprocess.Popen([sys.executable, "-m", "prorl_server", "--port", "0", "--ready-file", str(ready),
                             "--backend", vllm, "--sandbox-runtime", "bubblewrap", "--journal", "off",
                             "--log-level", "WARNING"], cwd=ROOT, env={**os.environ, "PRORL_TOKEN": token})
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the rollout server did not start (exit status {proc.poll()})")
            time.sleep(0.1)
        yield json.loads(ready.read_text())["url"]
    finally:
        from _common import stop_process  # benchmarks/: imported here so that tests import this module alone

        stop_process(proc, 60)
        shutil.rmtree(tmp, ignore_errors=True)


async def _rollouts(url: str, token: str, groups: dict[str, list[dict[str, Any]]], timeout_s: float
                    ) -> dict[str, tuple[list[tuple[str, JobResult]], GroupTree, float]]:
    """Every script of ``groups`` (group id -> agent scripts) as a ``cli_agent`` job through ``POST /process``,
    all at once; then each group's tree (``GET /groups/{id}/tree``, timed). Group id -> (``(job_id, result)`` in
    submission order, the tree, the GET's wall seconds).

    Raises:
        RuntimeError: a job failed (filtered or an error; its agent's output tail in the message), or a route
            answered other than 200.
    """
    import aiohttp

    source = AGENT.read_text()
    headers = {"Authorization": f"Bearer {token}"}

    async def job(http: aiohttp.ClientSession, group: str, i: int, script: dict[str, Any]) -> tuple[str, JobResult]:
        job_id = f"{group}-{i}"
        body = {"instance": {"data_source": "cli_agent", "instance_id": job_id, "command": "python3 agent.py",
                             "files": {"agent.py": source, "script.json": json.dumps(script)},
                             "eval": "reward_info", "agent_timeout_s": timeout_s},
                "job_id": job_id, "group_id": group, "group_size": len(groups[group]), "timeout_s": timeout_s}
        async with http.post(f"{url}/process", json=body) as r:
            data = await r.json()
        if r.status != 200:
            raise RuntimeError(f"POST /process {job_id}: {r.status} {data}")
        result = JobResult.model_validate(data)
        if result.critical_error or result.filter or not result.trajectories:
            tail = ((result.extra or {}).get("gateway") or {}).get("output_tail")
            raise RuntimeError(f"job {job_id} failed ({result.failure_kind}): {result.error}; agent: {tail}")
        return job_id, result

    out = {}
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=None)) as http:
        done = await asyncio.gather(*(job(http, g, i, s) for g, scripts in groups.items()
                                      for i, s in enumerate(scripts)))
        for g in groups:
            t0 = time.perf_counter()
            async with http.get(f"{url}/groups/{g}/tree") as r:
                body = await r.read()
            route_s = time.perf_counter() - t0
            if r.status != 200:
                raise RuntimeError(f"GET /groups/{g}/tree: {r.status} {body[:2000]!r}")
            out[g] = ([(j, res) for j, res in done if j.rsplit("-", 1)[0] == g], GroupTree.model_validate_json(body),
                      route_s)
    return out


def service_groups(model_dir: Path, samples: int, seed: int, timeout_s: float = 600.0
                   ) -> tuple[dict[str, tuple[list[tuple[str, JobResult]], GroupTree, float]], dict[str, Any]]:
    """Start vLLM (CPU, the tiny model in ``model_dir``) and a rollout server, run the ``grpo`` (``samples``
    samples) and ``rewrite`` groups through them (:func:`_rollouts`), stop both; (the groups, facts of the run:
    model, vLLM's version, rollout wall seconds)."""
    import urllib.request

    from transformers import AutoTokenizer

    from _common import vllm_address  # benchmarks/: imported here so that tests import this module alone
    from prorl_server.dev.tiny_model import build

    tokenizer = AutoTokenizer.from_pretrained(build(model_dir))
    rnd = random.Random(seed)
    text = lambda n: text_of(tokenizer, rnd, n)  # noqa: E731
    token = secrets.token_hex(16)
    with vllm_address(None, str(model_dir), max_model_len=4096, max_num_batched_tokens=4096) as vllm:
        with urllib.request.urlopen(f"{vllm}/v1/models") as r:
            model = json.loads(r.read())["data"][0]["id"]
        with urllib.request.urlopen(f"{vllm}/version") as r:
            version = json.loads(r.read()).get("version")
        groups = {"grpo": grpo_scripts(text, model, samples=samples, seed=seed),
                  "rewrite": rewrite_scripts(text, model, seed=seed)}
        with rollout_server(vllm, token) as url:
            t0 = time.monotonic()
            got = asyncio.run(_rollouts(url, token, groups, timeout_s))
            rollout_s = time.monotonic() - t0
    print(f"rollouts: {sum(len(s) for s in groups.values())} cli_agent jobs in {rollout_s:.1f} s", flush=True)
    return got, {"model": Path(model).name, "vllm": version, "rollout_s": round(rollout_s, 1)}


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
    of ~0.6 ns for rows that share the objects (as the in-memory rows here do). And the route's whole work from
    the results' JSON (``route_work``: :func:`tree_of_results`, parsing included; not the answer's
    serialization)."""
    ours, base, hopped, parsed_s, route_s = [], [], [], [], []
    rows = [t.prompt_ids + t.response_ids for _, r in results for t in r.trajectories]
    ended = [(j, r.model_dump_json().encode()) for j, r in results]
    parsed = [(j, JobResult.model_validate_json(body)) for j, body in ended]
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
        t0 = time.perf_counter()
        tree_of_results(name, ended)
        route_s.append(time.perf_counter() - t0)

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
                  "route_work_ms_per_100k": round(min(route_s) * per, 2),
                  "off_loop_ms_per_100k": round(min(hopped) * per, 2),
                  "executor_hop_us": round(max(0.0, min(hopped) - min(ours)) * 1e6, 1),
                  "baseline_token_build_ms_per_100k": round(min(base) * per, 2)}


def leaf_rows(tree: GroupTree, results: list[tuple[str, JobResult]]) -> list[tuple[Trajectory, float]]:
    """(trajectory, its result's reward) of each leaf of ``tree``, in leaf order (the packed side's row order).

    Raises:
        KeyError / IndexError: a leaf names a job or trajectory that ``results`` does not hold.
    """
    by_id = dict(results)
    return [(by_id[leaf.job_id].trajectories[leaf.trajectory_index], by_id[leaf.job_id].reward)
            for leaf in tree.leaves]


def run(name: str, model, results: list[tuple[str, JobResult]], repeats: int, attention: str = "tree",
        tree: Optional[GroupTree] = None, route_s: Optional[float] = None) -> dict:
    """One group: the tree's build cost on ``results`` (:func:`build_cost`), then (``model`` given) the timed
    forward+backward per row and packed. ``tree``: the tree the server answered for these results (checked with
    :func:`trainer_plugins.tree.check_tree`, raising its ``TreeCheckError`` if it does not give back the
    results' rows; packed as received), ``route_s`` its GET's wall seconds; None: the tree built here. The
    local build takes the jobs in the server's order (the order their ``POST /process`` arrived, which
    concurrent submissions do not fix), so that ``server_tree_equals_local`` compares like with like."""
    if tree is not None:
        first = {}
        for k, leaf in enumerate(tree.leaves):
            first.setdefault(leaf.job_id, k)
        results = sorted(results, key=lambda jr: first.get(jr[0], len(first)))
    local, cost = build_cost(name, results, repeats)
    if tree is None:
        tree = local
    else:
        check_tree(tree, dict(results))  # what the TRL plugin does on receipt (verified_tree)
        cost["route_get_ms"] = round(route_s * 1e3, 2) if route_s is not None else None
        cost["server_tree_equals_local"] = (tree.model_dump(exclude={"max_logprob_spread"})
                                            == local.model_dump(exclude={"max_logprob_spread"}))
    route = "" if route_s is None else f"; GET /groups/{name}/tree {cost['route_get_ms']} ms"
    print(f"{name:8} build: server build+verify {cost['build_verify_ms_per_100k']} ms/100k flat tokens "
          f"({cost['build_verify_ms']} ms for {tree.flat_tokens}; parsed rows "
          f"{cost['parsed_build_verify_ms_per_100k']}, from result JSON {cost['route_work_ms_per_100k']}), off the "
          f"loop {cost['off_loop_ms_per_100k']} ms/100k (executor hop {cost['executor_hop_us']} us) vs baseline "
          f"token-only build {cost['baseline_token_build_ms_per_100k']} ms/100k{route}", flush=True)
    if model is None:
        return {"group": name, "flat_tokens": tree.flat_tokens, "tree_tokens": tree.tree_tokens,
                "tree_token_ratio": round(tree.tree_token_ratio, 3), **cost}
    # the per-row side in the tree's leaf order, so that row k of each side is the same row
    by_leaf = leaf_rows(tree, results)
    rows = [t.prompt_ids + t.response_ids for t, _ in by_leaf]
    # the loss mask of row position t >= 1 (what logprob index t - 1 predicts): per row from the trajectory,
    # packed from the tree's leaf (its own sampled runs; the tree shares replies re-sent as context)
    masks = [torch.tensor(([0] * len(t.prompt_ids) + t.loss_mask)[1:], dtype=torch.float32) for t, _ in by_leaf]
    from trainer_plugins.trl.tree_pack import tree_loss_masks  # here: --build-only runs on older trees too

    leaf_masks = tree_loss_masks(tree)
    adv = [reward - 0.5 for _, reward in by_leaf]
    packed = pack([(n.parent, n.token_ids) for n in tree.nodes], [leaf.path for leaf in tree.leaves])
    # wall clock, and the process's CPU time (all its threads): the other sessions' load stretches the first
    # by waiting for the cores, the second hardly
    times: dict[str, list[float]] = {"rows": [], "packed": [], "rows_cpu": [], "packed_cpu": []}
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        ref = per_row_logprobs(model, rows)
        g_ref = step(model, ref, masks, adv)
        times["rows"].append(time.perf_counter() - t0)
        times["rows_cpu"].append(time.process_time() - c0)
        t0, c0 = time.perf_counter(), time.process_time()
        mask = ancestor_mask(packed, torch.float32) if attention == "dense" else None
        got, _ = packed_row_logprobs(model, packed, mask=mask)
        g_got = step(model, got, leaf_masks, adv)
        times["packed"].append(time.perf_counter() - t0)
        times["packed_cpu"].append(time.process_time() - c0)
    delta = max(float((a.detach() - b.detach()).abs().max()) for a, b in zip(got, ref))
    rel = float((g_got - g_ref).norm() / g_ref.norm())
    rows_s, packed_s = min(times["rows"]), min(times["packed"])
    rows_cpu, packed_cpu = min(times["rows_cpu"]), min(times["packed_cpu"])
    out = {"group": name, "attention": attention, "rows": len(rows), "flat_tokens": tree.flat_tokens, "tree_tokens": tree.tree_tokens,
           "tree_token_ratio": round(tree.tree_token_ratio, 3),
           **cost,
           "rows_fwd_bwd_s": round(rows_s, 3), "packed_fwd_bwd_s": round(packed_s, 3),
           "speedup": round(rows_s / packed_s, 2), "ideal": round(1 / tree.tree_token_ratio, 2),
           "rows_fwd_bwd_cpu_s": round(rows_cpu, 3), "packed_fwd_bwd_cpu_s": round(packed_cpu, 3),
           "cpu_speedup": round(rows_cpu / packed_cpu, 2),
           "max_logprob_delta": delta, "grad_rel_delta": rel}
    print(f"{name:8} rows {len(rows):3}  flat {tree.flat_tokens:6} -> tree {tree.tree_tokens:6} "
          f"(ratio {tree.tree_token_ratio:.3f}, built+verified {out['build_verify_ms_per_100k']} ms/100k)  "
          f"fwd+bwd rows {rows_s:.2f} s vs packed ({attention} attention) {packed_s:.2f} s: {out['speedup']}x (ideal {out['ideal']}x; "
          f"CPU time {rows_cpu:.2f} vs {packed_cpu:.2f} s: {out['cpu_speedup']}x)  "
          f"max |dlogp| {delta:.2g}  grad rel {rel:.2g}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", choices=("service", "synthetic"), default="service",
                    help="rows from cli_agent jobs on vLLM through the gateway (default), or random token ids")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--build-only", action="store_true", help="only the tree's build+verify cost (no model)")
    ap.add_argument("--attention", choices=("tree", "dense"), default="tree",
                    help="packed attention: node by node (SDPA models) or the dense S x S ancestor mask")
    ap.add_argument("--grpo-samples", type=int, default=8, help="samples of the GRPO group (8: ~6k flat tokens)")
    args = ap.parse_args(argv)
    model_dir = ROOT / ".cache" / "tiny-model"
    facts: dict[str, Any] = {}
    if args.source == "service":  # the rollouts first, and their servers stopped before anything is timed
        got, facts = service_groups(model_dir, args.grpo_samples, args.seed)
        groups = [(name, results, tree, route_s) for name, (results, tree, route_s) in got.items()]
    else:
        rnd = random.Random(args.seed)
        groups = [("grpo", grpo_group(rnd, samples=args.grpo_samples), None, None),
                  ("rewrite", rewrite_group(rnd), None, None)]
    model = None
    if not args.build_only:
        from transformers import AutoModelForCausalLM

        from prorl_server.dev.tiny_model import build

        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_pretrained(build(model_dir), attn_implementation="sdpa",
                                                     dtype=torch.float32)
        # switched before the first timing, so both sides run the same model (the per-row forward through it
        # is SDPA's, bit for bit: tests/trainer/test_tree_pack.py)
        enable_tree_attention(model)
    load_before = os.getloadavg()[0]
    out = []
    for name, results, tree, route_s in groups:
        row = run(name, model, results, args.repeats, args.attention, tree=tree, route_s=route_s)
        if args.source == "service":
            trajs = [t for _, r in results for t in r.trajectories]
            turns = {sum(len(sampled_runs(t.loss_mask)) for t in r.trajectories) for _, r in results}
            row.update(jobs=len(results), turns_per_job=sorted(turns), **row_facts(trajs))
            if name == "grpo":
                ok, n = branches_as_scripted([r.trajectories[0] for _, r in results], 4)
                row["branches_as_scripted"] = f"{ok}/{n}"
        out.append(row)
    print(json.dumps({"benchmark": "tree_training", "source": args.source, **facts,
                      "torch_threads": torch.get_num_threads(),
                      "load_1min": [load_before, os.getloadavg()[0]], "groups": out}))
    return 0


if __name__ == "__main__":
    # SIGTERM (``timeout``, a job scheduler) unwinds like an error, so the context managers stop vLLM and the
    # rollout server (each in its own process group: nothing else would reach them); SIGINT already does
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sys.exit(main())
