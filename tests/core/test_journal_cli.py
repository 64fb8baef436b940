"""``prorl-journal`` (prorl_server/journal/cli.py): re-grading journalled jobs with the current handler code and
no LLM backend, exporting them as verl / TRL / JSONL rows, and the journal's counts.

The journals are written with :class:`prorl_server.journal.store.Journal` itself, from results the real handlers made:
shout jobs run through a real rollout server (create_app) whose backend is the scripted policy of
tests/conftest.py (a labelled test double for a capable model, in vLLM's token-in/token-out dialect with the
tiny model's real tokenizer); math results are built by hand around real reasoning-gym problems (a real math
rollout needs a sandbox: tests/handlers/test_journal_regrade_real.py runs one, and a code one).
"""
from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

import pytest

from handlers.shout import ShoutHandler
from prorl_server.app import create_app
from prorl_server.config import ServerSettings
from prorl_server.journal.store import Journal
from prorl_server.journal.cli import main
from prorl_server.plugin.registry import HandlerRegistry
from prorl_server.types import JobResult, ProcessRequest, Trajectory


# ------------------------------------------------------------------------------------------ helpers
def write_journal(path: Path, jobs: list[tuple[ProcessRequest, dict | None]], handler: str | None = None) -> None:
    """Journal each ``(request, result)`` as the server does: submitted, its stages, its result (None: a job a
    crash interrupted), and one completion per generated span of its trajectories (the context before it)."""
    j = Journal(str(path))
    j.start()
    for req, result in jobs:
        name = handler or req.instance["data_source"]
        j.job_submitted(req.job_id, name, req.model_dump_json().encode())
        for state in ("init", "run", "eval"):
            j.job_state(req.job_id, state)
        if result is None:
            continue
        for t in result.get("trajectories") or []:
            traj = Trajectory.model_validate(t)
            lps = iter(lp for lp, m in zip(traj.response_logprobs, traj.loss_mask) if m)
            for offset, ids in traj.spans():
                j.completion(req.job_id, result.get("backend"), traj.prompt_ids + traj.response_ids[:offset], ids,
                             [next(lps) for _ in ids], [[result.get("weight_version"), len(ids)]], "stop")
        j.forget_owner(req.job_id)
        j.job_result(req.job_id, json.dumps(result).encode())
    assert j.flush()
    j.close()


async def cli(*argv: str) -> int:
    """``prorl-journal ARGV`` in-process, off the test's event loop (regrade runs its own)."""
    return await asyncio.to_thread(main, [*argv, "--quiet"] if argv[0] != "stats" else list(argv))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def shout_server(aiohttp_client):
    async def make(backend: str):
        registry = HandlerRegistry()
        registry.register(ShoutHandler)
        app = create_app(ServerSettings(backends=[backend], health_interval_s=3600), registry=registry)
        return await aiohttp_client(app)

    return make


LAST_TURNS = {"sea": "SHIP AHOY", "city": "Hello", "night": "1234 !!"}  # rewards 1.0, 0.2, 0.0


@pytest.fixture
async def shout_journal(tmp_path, shout_server, scripted_policy, tokenizer):
    """A journal of three real shout jobs (rewards 1.0, 0.2, 0.0) and the results the server returned."""

    def script(prompt: str, turn: int) -> str:
        topic = next(k for k in LAST_TURNS if k in prompt)
        return "calm words first" if turn == 0 else LAST_TURNS[topic]

    client = await shout_server(await scripted_policy(script))
    jobs = []
    for i, topic in enumerate(LAST_TURNS):
        req = ProcessRequest(instance={"data_source": "shout", "instance_id": f"shout-{i}",
                                       "prompt": f"Say something about the {topic}."},
                             sampling_params={"max_tokens": 32}, job_id=f"shout-job-{i}")
        r = await client.post("/process", json=req.model_dump(exclude_none=True))
        assert r.status == 200, await r.text()
        jobs.append((req, await r.json()))
    assert [res["reward"] for _, res in jobs] == pytest.approx([1.0, 0.2, 0.0])
    path = tmp_path / "journal.sqlite"
    write_journal(path, jobs)
    return path, [res for _, res in jobs], scripted_policy.returned


# ------------------------------------------------------------------------------------------ regrade
async def test_regrade_reproduces_recorded_shout_rewards_and_reports_a_changed_grader(shout_journal, tmp_path,
                                                                                      monkeypatch, capsys):
    path, results, _ = shout_journal
    out = tmp_path / "regrade.jsonl"
    out.write_text("")
    out.chmod(0o644)  # an earlier run's file, readable by every local user
    assert await cli("regrade", str(path), "--out", str(out)) == 0
    # the rows hold the journal's rewards and job ids: 0600 as the journal's own files (it kept 0644 before)
    assert out.stat().st_mode & 0o777 == 0o600
    rows = {r["job_id"]: r for r in read_jsonl(out)}
    assert set(rows) == {r["job_id"] for r in results}
    for r in results:
        row = rows[r["job_id"]]
        assert row["status"] == "regraded", row
        assert row["new_reward"] == r["reward"] == row["old_reward"] and row["changed"] is False
        assert row["new_resolved"] is r["resolved"] and row["failure_kind"] is None
        assert "eval" not in row  # shout writes no extra.eval
    assert "3 re-graded, 0 changed, mean reward 0.4000 -> 0.4000" in capsys.readouterr().err

    # The grader changes (a bug fix, or a new reward): the same trajectories, re-graded, say so.
    import handlers.shout.handler as shout

    monkeypatch.setattr(shout, "capital_share", lambda text: (0.5, len(text)))
    assert await cli("regrade", str(path), "--out", str(out), "--workers", "2") == 0
    rows = {r["job_id"]: r for r in read_jsonl(out)}
    for r in results:
        row = rows[r["job_id"]]
        assert row["status"] == "regraded" and row["new_reward"] == 0.5 and row["old_reward"] == r["reward"]
        assert row["changed"] is True
    assert "3 re-graded, 3 changed, mean reward 0.4000 -> 0.5000" in capsys.readouterr().err


def _math_job(job_id: str, instance: dict, answer: dict | None, last_message: str, reward: float,
              **result: object) -> tuple[ProcessRequest, dict]:
    """A math job as the handler records it: the finish tool's arguments in extra.agent.answer."""
    req = ProcessRequest(instance=instance, sampling_params={"max_tokens": 64}, job_id=job_id)
    res = JobResult(job_id=job_id, trajectory_id=f"t-{job_id}", handler="math", reward=reward, resolved=reward == 1.0,
                    messages=[{"role": "system", "content": "Solve."},
                              {"role": "user", "content": instance["question"]},
                              {"role": "assistant", "content": last_message}],
                    trajectories=[Trajectory(prompt_ids=[1, 2, 3], response_ids=[7, 8, 9], response_logprobs=[-0.1,
                                             -0.2, -0.3], loss_mask=[1, 1, 1], num_turns=1)],
                    extra={"agent": {"finish_reason": "stop" if answer else "max_turns", "num_turns": 1,
                                     "answer": answer}, "eval": {"scorer": "stale"}}, **result)
    return req, json.loads(res.model_dump_json())


async def test_regrade_math_scores_the_recorded_answer_again_and_catches_a_wrong_recorded_reward(tmp_path):
    from handlers.math.data import load_reasoning_gym

    a, b, c = load_reasoning_gym("basic_arithmetic", limit=3, seed=5)
    jobs = [
        _math_job("right", a, {"answer": f"\\boxed{{{a['answer']}}}"}, "calling finish", 1.0),
        # a grader bug gave this wrong answer 1.0: the current grader says 0.0
        _math_job("bug", b, {"answer": "\\boxed{-987654321.5}"}, "calling finish", 1.0),
        # no finish call: the last assistant message is the answer (as the handler's run decides)
        _math_job("no-finish", c, None, f"so \\boxed{{{c['answer']}}}", 1.0),
        # the run failed: eval never ran, nothing to re-grade
        _math_job("run-failed", a, None, "", 0.0, critical_error="run", failure_kind="sandbox", filter=True),
    ]
    path = tmp_path / "math.sqlite"
    write_journal(path, jobs)
    out = tmp_path / "regrade.jsonl"
    assert await cli("regrade", str(path), "--out", str(out), "--sandbox-runtime", "none") == 0
    rows = {r["job_id"]: r for r in read_jsonl(out)}
    assert rows["right"]["status"] == "regraded" and rows["right"]["new_reward"] == 1.0
    assert rows["right"]["changed"] is False and rows["right"]["eval"]["scorer"] == "reasoning_gym"
    assert rows["bug"]["status"] == "regraded" and rows["bug"]["new_reward"] == 0.0
    assert rows["bug"]["changed"] is True and rows["bug"]["new_resolved"] is False
    assert rows["no-finish"]["new_reward"] == 1.0 and rows["no-finish"]["changed"] is False
    assert rows["run-failed"]["status"] == "skipped" and rows["run-failed"]["new_reward"] is None
    assert "critical_error=run" in rows["run-failed"]["reason"]


async def test_handlers_that_cannot_rebuild_what_eval_reads_are_refused_not_guessed(tmp_path, capsys):
    swe = ProcessRequest(instance={"data_source": "swe", "problem_statement": "fix it", "repo_path": "/repo"},
                         job_id="swe-1")
    swe_result = JobResult(job_id="swe-1", trajectory_id="t", handler="swe", reward=1.0, resolved=True)
    # a code result recorded before the handler kept its solution file: the file only existed in the run sandbox
    code = ProcessRequest(instance={"data_source": "code", "instance_id": "HumanEval/0"}, job_id="code-1")
    code_result = JobResult(job_id="code-1", trajectory_id="t", handler="code", reward=1.0, resolved=True)
    path = tmp_path / "j.sqlite"
    write_journal(path, [(swe, json.loads(swe_result.model_dump_json())),
                         (code, json.loads(code_result.model_dump_json()))])
    out = tmp_path / "out.jsonl"
    assert await cli("regrade", str(path), "--out", str(out), "--sandbox-runtime", "none") == 1  # nothing re-graded
    rows = {r["job_id"]: r for r in read_jsonl(out)}
    assert rows["swe-1"]["status"] == "not_regradable" and rows["swe-1"]["new_reward"] is None
    assert "does not record the patch" in rows["swe-1"]["reason"]
    assert rows["code-1"]["status"] == "not_regradable" and "extra.solution" in rows["code-1"]["reason"]
    err = capsys.readouterr().err
    assert "0 re-graded" in err and "2 not_regradable" in err and "does not record the patch" in err

    # --handler picks one handler's jobs (by name or alias)
    assert await cli("regrade", str(path), "--out", str(out), "--handler", "humaneval") == 1
    assert [r["job_id"] for r in read_jsonl(out)] == ["code-1"]


# ------------------------------------------------------------------------------------------ export
async def test_export_round_trips_the_exact_tokens_as_verl_trl_and_jsonl_rows(shout_journal, tmp_path):
    path, results, returned = shout_journal
    by_id = {r["job_id"]: r for r in results}

    # JSONL: the recorded results, unchanged
    assert await cli("export", str(path), "--format", "jsonl", "--out", str(tmp_path / "r.jsonl")) == 0
    assert read_jsonl(tmp_path / "r.jsonl") == results

    # verl: Parquet (pyarrow is installed with verl), one row per segment, the exact ids, mask and logprobs
    pq = pytest.importorskip("pyarrow.parquet")
    assert await cli("export", str(path), "--format", "verl", "--out", str(tmp_path / "v.parquet")) == 0
    verl = pq.read_table(tmp_path / "v.parquet").to_pylist()
    assert [r["job_id"] for r in verl] == [r["job_id"] for r in results]
    generated = []
    for row in verl:
        (traj,) = by_id[row["job_id"]]["trajectories"]
        assert row["prompt_ids"] == traj["prompt_ids"] and row["response_ids"] == traj["response_ids"]
        assert row["response_mask"] == traj["loss_mask"] and row["response_logprobs"] == traj["response_logprobs"]
        assert row["reward_score"] == by_id[row["job_id"]]["reward"] and row["segment"] == 0 and row["segments"] == 1
        assert row["acc"] == (1.0 if by_id[row["job_id"]]["resolved"] else 0.0) and row["num_turns"] == 2
        generated += [[t for t, m in zip(row["response_ids"], row["response_mask"]) if m]]
    # the masked-in tokens are exactly what the policy generated, two turns per job
    assert sorted(generated) == sorted(a + b for (a, _), (b, _) in zip(returned[::2], returned[1::2]))

    # verl as JSON lines: the same columns and values
    assert await cli("export", str(path), "--format", "verl", "--out", str(tmp_path / "v.jsonl")) == 0
    assert read_jsonl(tmp_path / "v.jsonl") == verl

    # TRL: one row per job, the keys its rollout function returns
    assert await cli("export", str(path), "--format", "trl", "--out", str(tmp_path / "t.jsonl")) == 0
    trl = read_jsonl(tmp_path / "t.jsonl")
    for row in trl:
        r = by_id[row["prorl_job_id"]]
        (traj,) = r["trajectories"]
        assert row["prompt_ids"] == traj["prompt_ids"] and row["completion_ids"] == traj["response_ids"]
        assert row["env_mask"] == traj["loss_mask"] and row["logprobs"] == traj["response_logprobs"]
        assert row["prorl_reward"] == r["reward"] and row["prorl_filtered"] is False
        assert len(row["prorl_token_versions"]) == len(row["completion_ids"])
    assert len(trl) == 3

    # --handler with no matching job: empty outputs, still well-formed
    assert await cli("export", str(path), "--format", "verl", "--handler", "math", "--out",
                     str(tmp_path / "none.parquet")) == 0
    assert pq.read_table(tmp_path / "none.parquet").num_rows == 0


async def test_export_takes_the_rewards_of_a_regrade(shout_journal, tmp_path, capsys):
    path, results, _ = shout_journal
    first, second, _ = (r["job_id"] for r in results)
    rewards = tmp_path / "regrade.jsonl"
    rewards.write_text(json.dumps({"job_id": first, "status": "regraded", "new_reward": 0.25, "new_resolved": False,
                                   "failure_kind": None}) + "\n"
                       + json.dumps({"job_id": second, "status": "eval_failed", "new_reward": None,
                                     "new_resolved": None}) + "\n")
    assert await cli("export", str(path), "--format", "trl", "--rewards", str(rewards), "--out",
                     str(tmp_path / "t.jsonl")) == 0
    trl = {r["prorl_job_id"]: r for r in read_jsonl(tmp_path / "t.jsonl")}
    assert trl[first]["prorl_reward"] == 0.25  # the re-graded reward
    assert [trl[r["job_id"]]["prorl_reward"] for r in results[1:]] == [r["reward"] for r in results[1:]]  # as recorded
    assert await cli("export", str(path), "--format", "jsonl", "--rewards", str(rewards), "--out",
                     str(tmp_path / "r.jsonl")) == 0
    row = read_jsonl(tmp_path / "r.jsonl")[0]
    assert (row["reward"], row["resolved"]) == (0.25, False)
    assert row["extra"]["regrade"] == {"old_reward": 1.0, "old_resolved": True, "old_failure_kind": None,
                                       "old_critical_error": None, "old_filter": False}
    assert "rewards from --rewards 1" in capsys.readouterr().err

    rewards.write_text("not json\n")
    assert await cli("export", str(path), "--format", "trl", "--rewards", str(rewards), "--out",
                     str(tmp_path / "t2.jsonl")) == 2
    assert "line 1 is not a prorl-journal regrade line" in capsys.readouterr().err
    assert not (tmp_path / "t2.jsonl").exists()


def test_a_job_whose_grader_failed_is_graded_now_and_exported_with_its_new_outcome(tmp_path):
    # the eval stage raised then (a grader bug: filtered, never trained on); the current grader grades it
    t = Trajectory(prompt_ids=[1, 2], response_ids=[3, 4], response_logprobs=[-0.5, -0.25], loss_mask=[1, 1],
                   num_turns=1)
    req = ProcessRequest(instance={"data_source": "arithmetic", "expression": "2*3", "answer": 6}, job_id="bug")
    res = JobResult(job_id="bug", trajectory_id="t", handler="arithmetic", critical_error="eval", filter=True,
                    failure_kind="handler", error="eval failed: KeyError: 'value'", trajectories=[t],
                    extra={"value": 6})
    path = tmp_path / "j.sqlite"
    write_journal(path, [(req, json.loads(res.model_dump_json()))])
    out = tmp_path / "regrade.jsonl"
    assert main(["regrade", str(path), "--out", str(out), "-q"]) == 0
    (row,) = read_jsonl(out)
    assert row["status"] == "regraded" and (row["old_reward"], row["new_reward"]) == (0.0, 1.0) and row["changed"]
    assert (row["critical_error"], row["filter"], row["failure_kind"]) == (None, False, None)
    assert main(["export", str(path), "--format", "trl", "--out", str(tmp_path / "before.jsonl"), "-q"]) == 0
    assert read_jsonl(tmp_path / "before.jsonl") == []  # filtered as recorded
    assert main(["export", str(path), "--format", "trl", "--rewards", str(out), "--out",
                 str(tmp_path / "after.jsonl"), "-q"]) == 0
    (trl,) = read_jsonl(tmp_path / "after.jsonl")
    assert trl["prorl_reward"] == 1.0 and trl["completion_ids"] == [3, 4]


def test_export_leaves_filtered_results_out_of_trainer_rows_and_honours_since(tmp_path):
    t = Trajectory(prompt_ids=[5, 6], response_ids=[10, 11, 12, 13], response_logprobs=[-0.5, 0.0, 0.0, -0.25],
                   loss_mask=[1, 0, 0, 1], num_turns=2, weight_versions=[3, 4], version_runs=[(3, 1), (4, 1)])
    ok = JobResult(job_id="ok", trajectory_id="a", handler="arithmetic", reward=1.0, trajectories=[t],
                   weight_version=4)
    bad = JobResult(job_id="bad", trajectory_id="b", handler="arithmetic", trajectories=[t], filter=True,
                    failure_kind="sandbox", critical_error="run")
    reqs = [ProcessRequest(instance={"data_source": "arithmetic", "expression": "1"}, job_id=i) for i in ("ok", "bad")]
    path = tmp_path / "j.sqlite"
    write_journal(path, [(reqs[0], json.loads(ok.model_dump_json())), (reqs[1], json.loads(bad.model_dump_json()))])
    assert main(["export", str(path), "--format", "trl", "--out", str(tmp_path / "t.jsonl"), "-q"]) == 0
    (row,) = read_jsonl(tmp_path / "t.jsonl")
    assert row["prorl_job_id"] == "ok" and row["prorl_token_versions"] == [3, None, None, 4]
    assert row["prorl_weight_versions"] == [3, 4]
    assert main(["export", str(path), "--format", "verl", "--out", str(tmp_path / "v.jsonl"), "-q"]) == 0
    (row,) = read_jsonl(tmp_path / "v.jsonl")
    assert (row["min_global_steps"], row["max_global_steps"]) == (3, 4)
    # --since: jobs submitted before it are left out
    assert main(["export", str(path), "--format", "jsonl", "--since", "9999999999", "--out",
                 str(tmp_path / "late.jsonl"), "-q"]) == 0
    assert (tmp_path / "late.jsonl").read_text() == ""
    assert main(["export", str(path), "--format", "jsonl", "--since", "0", "--out", str(tmp_path / "all.jsonl"),
                 "-q"]) == 0
    assert [r["job_id"] for r in read_jsonl(tmp_path / "all.jsonl")] == ["ok", "bad"]


# ------------------------------------------------------------------------------------------ stats and errors
async def test_stats_counts_jobs_by_state_and_completions(shout_journal, tmp_path, capsys):
    path, results, returned = shout_journal
    crashed = ProcessRequest(instance={"data_source": "shout", "prompt": "x"}, job_id="interrupted")
    more = tmp_path / "more.sqlite"
    write_journal(more, [(crashed, None)])
    assert await cli("stats", str(more), "--json") == 0
    s = json.loads(capsys.readouterr().out)
    assert s["jobs"] == {"eval": 1} and s["completions"]["rows"] == 0

    assert await cli("stats", str(path), "--json") == 0
    s = json.loads(capsys.readouterr().out)
    assert s["jobs"] == {"done": 3} and s["done_by_handler"] == {"shout": 3}
    assert s["completions"] == {"rows": 6, "owners": 3, "generated_tokens": sum(len(ids) for ids, _ in returned)}
    assert s["size_bytes"] > 0
    assert await cli("stats", str(path)) == 0
    assert "jobs: 3 (done 3)" in capsys.readouterr().out


@pytest.mark.parametrize("command", [["stats"], ["regrade"], ["export", "--format", "jsonl", "--out", "x.jsonl"]])
def test_a_missing_or_corrupt_journal_is_exit_2_with_a_message_and_is_not_created(tmp_path, capsys, command):
    missing = tmp_path / "nope.sqlite"
    argv = lambda p: [command[0], str(p), *command[1:]]  # noqa: E731
    assert main(argv(missing)) == 2
    assert "no journal at" in capsys.readouterr().err and not missing.exists()

    corrupt = tmp_path / "corrupt.sqlite"
    corrupt.write_bytes(b"SQLite format 3\x00" + bytes(range(256)) * 8)
    assert main(argv(corrupt)) == 2
    err = capsys.readouterr().err
    assert "not a readable journal" in err and "Traceback" not in err

    other = tmp_path / "other.sqlite"
    db = sqlite3.connect(other)
    db.execute("CREATE TABLE t (x)")
    db.commit()
    db.close()
    assert main(argv(other)) == 2
    assert "not a journal (no table jobs, completions)" in capsys.readouterr().err
    assert {r[0] for r in sqlite3.connect(other).execute("SELECT name FROM sqlite_master")} == {"t"}  # untouched


@pytest.mark.parametrize("command", [["regrade"], ["export", "--format", "verl"], ["stats"]])
def test_a_journal_damaged_past_its_first_pages_is_exit_2_and_leaves_no_partial_output(tmp_path, capsys, command):
    t = Trajectory(prompt_ids=list(range(200)), response_ids=list(range(300)), response_logprobs=[-0.5] * 300,
                   loss_mask=[1] * 300, num_turns=1)
    jobs = [(ProcessRequest(instance={"data_source": "arithmetic", "expression": "1+1", "answer": 2}, job_id=f"j{i}"),
             json.loads(JobResult(job_id=f"j{i}", trajectory_id="t", handler="arithmetic", reward=1.0, resolved=True,
                                  trajectories=[t], extra={"value": 2}).model_dump_json())) for i in range(400)]
    path = tmp_path / "j.sqlite"
    write_journal(path, jobs)
    db = sqlite3.connect(path)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # every page in the file itself
    db.close()
    size = path.stat().st_size
    with open(path, "r+b") as f:  # a disk error half-way through the file
        f.seek(size // 2)
        f.write(b"\xff" * 20000)
    out = tmp_path / ("rows.parquet" if command[0] == "export" else "out.jsonl")
    argv = [command[0], str(path), *command[1:]] + (["--out", str(out), "-q"] if command[0] != "stats" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "malformed" in err and "Traceback" not in err
    if command[0] == "export":
        assert not out.exists() and not Path(str(out) + ".partial").exists()


@pytest.mark.parametrize("command", [["regrade"], ["export", "--format", "jsonl"]])
def test_an_output_that_is_the_journal_is_refused_and_the_journal_kept(tmp_path, capsys, command):
    req = ProcessRequest(instance={"data_source": "arithmetic", "expression": "1+1", "answer": 2}, job_id="a")
    res = JobResult(job_id="a", trajectory_id="t", handler="arithmetic", reward=1.0, extra={"value": 2})
    path = tmp_path / "j.sqlite"
    write_journal(path, [(req, json.loads(res.model_dump_json()))])
    before = path.read_bytes()
    for out in (path, Path(str(path) + "-wal")):
        assert main([command[0], str(path), *command[1:], "--out", str(out), "-q"]) == 2
        assert "is the journal itself" in capsys.readouterr().err
    assert path.read_bytes() == before


def test_the_console_script_exits_2_on_a_missing_journal(tmp_path):
    import configparser
    import shutil
    import subprocess
    import sys

    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).resolve().parents[2] / "setup.cfg")
    assert "prorl-journal = prorl_server.journal.cli:main" in cfg["options.entry_points"]["console_scripts"]
    # the module as a program, and the installed script (.ci/install's editable install makes it)
    commands = [[sys.executable, "-m", "prorl_server.journal.cli"]]
    script = shutil.which("prorl-journal", path=str(Path(sys.executable).parent))
    if script is not None:
        commands.append([script])
    for cmd in commands:
        p = subprocess.run([*cmd, "stats", str(tmp_path / "missing.sqlite")], capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 2 and "no journal at" in p.stderr and "Traceback" not in p.stderr, (cmd, p.stderr)


def test_vacuum_converts_a_large_journal_of_an_older_version_so_retention_can_shrink_it(tmp_path, monkeypatch,
                                                                                      capsys):
    # a journal created before auto_vacuum (schema 2 files, converted at open only when small): retention frees
    # its pages but the file never shrinks until it is converted once, with the server stopped
    import sqlite3

    from prorl_server.journal import store

    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.executescript(store.SCHEMA)
    db.execute(f"PRAGMA user_version = {store.SCHEMA_VERSION}")
    db.commit()
    db.close()
    monkeypatch.setattr(store, "CONVERT_MAX_BYTES", 0)  # as if it were larger than what an open converts
    j = store.Journal(str(path))
    j.close()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA auto_vacuum").fetchone()[0] == 0
    db.close()
    assert main(["vacuum", str(path)]) == 0
    assert "auto_vacuum=INCREMENTAL" in capsys.readouterr().out
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA auto_vacuum").fetchone()[0] == 2
    db.close()
    assert main(["vacuum", str(tmp_path / "missing.sqlite")]) == 2  # never creates a journal
    assert not (tmp_path / "missing.sqlite").exists()
