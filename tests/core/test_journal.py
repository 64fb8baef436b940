"""The journal (``prorl_server.journal.store``): what it stores comes back exactly, and a server with one answers a
finished job's result again for its id (idempotent resubmission), after its memory forgot it, and records
every completion of the job with its exact tokens.

The store tests use the real SQLite file and writer thread; the server tests the real app with the
``scripted`` handler (tests/core/conftest.py) and ``shout`` over :class:`prorl_server.dev.fake_vllm.FakeVLLM`
(standing for vLLM's completions endpoint).
"""
from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import time

import pytest

from handlers.shout.handler import ShoutHandler
from prorl_server.app import PIPELINE, create_app
from prorl_server.config import ServerSettings, journal_path
from prorl_server.dev.fake_vllm import start_fake_vllm
from prorl_server.journal.store import Journal, JournalError
from prorl_server.plugin.registry import HandlerRegistry


def journal(tmp_path, **kw) -> Journal:
    j = Journal(str(tmp_path / "j" / "journal.sqlite"), **kw)
    j.start()
    return j


def test_jobs_and_results_round_trip(tmp_path):
    j = journal(tmp_path)
    j.job_submitted("a", "math", b'{"instance": {"data_source": "math"}}')
    j.job_state("a", "run")
    j.job_submitted("b", "math", b"{}")
    j.job_result("a", b'{"job_id": "a", "reward": 1.0}', filtered=False)
    assert j.flush()
    assert j.job("a") == ("done", b'{"instance": {"data_source": "math"}}', b'{"job_id": "a", "reward": 1.0}', False)
    assert j.result("a") == b'{"job_id": "a", "reward": 1.0}'
    assert j.result("b") is None and j.unfinished() == ["b"]
    assert [r[0] for r in j.iter_jobs()] == ["a"]
    j.close()
    # a new Journal on the same file (a restarted server) sees the same
    j2 = journal(tmp_path)
    assert j2.result("a") == b'{"job_id": "a", "reward": 1.0}' and j2.unfinished() == ["b"]
    j2.close()


def test_completions_come_back_exactly_and_shared_prefixes_are_stored_once(tmp_path):
    j = journal(tmp_path)
    ctx = list(range(500))  # a live, append-only context list, as a conversation's token_ids
    turns = []
    for k in range(5):
        prompt = list(ctx)
        out = [7000 + k * 10 + i for i in range(10)]
        j.completion("job", "http://b", ctx, out, [-0.25 * i for i in range(10)], [[k, 10]], "stop")
        turns.append((prompt, out))
        ctx.extend(out)
        ctx.extend([1, 2, 3])  # the observation appended after the turn
    rewritten = [9] + list(range(400))  # a context the chat template rewrote: not a continuation
    j.completion("job", "http://b", rewritten, [5], [-1.0], [[None, 1]], "length")
    turns.append((rewritten, [5]))
    j.flush()
    recs = j.completions("job")
    assert [(r.prompt_ids, r.token_ids) for r in recs] == turns
    assert recs[0].logprobs == [-0.25 * i for i in range(10)] and recs[-1].version_runs == [[None, 1]]
    db = sqlite3.connect(j.path)
    prefix = [row[0] for row in db.execute("SELECT prefix_len FROM completions ORDER BY seq")]
    assert prefix == [0, 510, 523, 536, 549, 0]  # each turn stores only what it added; the rewrite whole
    j.close()


def test_a_token_id_outside_int32_is_a_write_error_not_a_crash(tmp_path):
    j = journal(tmp_path)
    j.completion("x", None, [1], [2 ** 40], [0.0], [[0, 1]], "stop")
    j.job_submitted("after", "h", b"{}")
    j.flush()
    assert j.job("after") is not None  # the writer thread lives on
    j.close()


def test_retention_deletes_old_finished_jobs_and_their_completions(tmp_path):
    j = journal(tmp_path, max_age_s=0.05, retention_every_s=0.0)
    j.job_submitted("old", "h", b"{}")
    j.completion("old", None, [1, 2], [3], [0.0], [[0, 1]], "stop")
    j.job_result("old", b"{}")
    j.job_submitted("live", "h", b"{}")
    j.flush()
    time.sleep(0.1)
    j.job_submitted("new", "h", b"{}")  # a write, so the writer runs its retention
    j.flush()
    j.job_state("new", "run")
    j.flush()
    assert j.job("old") is None and j.completions("old") == []
    assert j.job("live") is not None  # an unfinished job is never deleted
    j.close()


def test_a_journal_that_is_not_sqlite_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(b"this is not a database" * 100)
    with pytest.raises(JournalError, match="bad.sqlite"):
        Journal(str(bad))


def test_journal_path_setting():
    assert journal_path(ServerSettings()) is None
    assert journal_path(ServerSettings(journal="off")) is None
    assert journal_path(ServerSettings(journal="auto", port=0)) is None
    assert journal_path(ServerSettings(journal="auto", port=8123)).endswith("journal/127.0.0.1_8123.sqlite")
    assert journal_path(ServerSettings(journal="/x/j.sqlite")) == "/x/j.sqlite"


# ------------------------------------------------------------------------------------------ a server with one
async def test_a_finished_job_id_is_idempotent_and_found_after_memory_forgot_it(make_client, scripted, tmp_path,
                                                                               wait_done):
    path = tmp_path / "server.sqlite"
    client = await make_client(journal=str(path), keep_finished=0)
    body = {"job_id": "once", "instance": {"data_source": "scripted", "reward": 0.75}}
    first = await (await client.post("/process", json=body)).json()
    assert first["reward"] == 0.75
    again = await (await client.post("/process", json=body)).json()
    assert again == first  # the same result (same trajectory_id), not a second sample
    assert scripted.events.count(("once", "run")) == 1  # and the handler did not run again
    r = await client.get("/jobs/once")  # keep_finished=0: not in memory; answered from the journal
    assert r.status == 200 and (await r.json())["result"]["trajectory_id"] == first["trajectory_id"]
    r = await client.post("/jobs", json=body)
    assert r.status == 202
    assert (await (await client.post("/cancel", json={"job_id": "once"})).json())["cancelled"] is False


async def test_a_delivered_result_retention_deleted_is_answered_410_expired_and_never_run_again(
        make_client, scripted, tmp_path):
    # red team (#33): past journal_max_bytes retention deleted delivered results, and after a restart the same
    # job id resubmitted ran again: one id, two samples
    path = tmp_path / "server.sqlite"
    client = await make_client(journal=str(path))
    body = {"job_id": "once", "instance": {"data_source": "scripted", "reward": 0.75}}
    assert (await (await client.post("/process", json=body)).json())["reward"] == 0.75
    filtered = {"job_id": "f", "instance": {"data_source": "scripted", "fail_in": "init"}}
    assert (await (await client.post("/process", json=filtered)).json())["filter"] is True
    await client.close()

    time.sleep(0.05)
    j = Journal(str(path), max_age_s=0.01, retention_every_s=0.0)  # every finished result is too old now
    j.start()
    j.job_submitted("other", "h", b"{}")  # a commit, after which the writer applies retention
    assert j.flush()
    j.close()
    j = Journal(str(path), readonly=True)
    assert j.job("once") is None and j.expired("once") and not j.expired("f")
    j.close()

    client = await make_client(journal=str(path))  # a restarted server on the same journal
    for r in (await client.post("/process", json=body), await client.post("/jobs", json=body),
              await client.get("/jobs/once")):
        assert r.status == 410
        assert (await r.json())["error"]["type"] == "result_expired"
    assert scripted.events.count(("once", "run")) == 1  # the handler did not run it again
    # a filtered result leaves no tombstone: its id runs again, as before
    assert (await (await client.post("/process", json=filtered)).json())["filter"] is True


async def test_a_filtered_result_is_run_again_on_resubmission(make_client, tmp_path):
    client = await make_client(journal=str(tmp_path / "s.sqlite"))
    body = {"job_id": "f", "instance": {"data_source": "scripted", "fail_in": "init"}}
    first = await (await client.post("/process", json=body)).json()
    assert first["filter"] is True
    again = await (await client.post("/process", json=body)).json()
    assert again["trajectory_id"] != first["trajectory_id"]


async def test_every_completion_of_a_job_is_journalled_with_its_exact_tokens(aiohttp_client, tiny_model_dir,
                                                                            tmp_path):
    fake, runner, address = await start_fake_vllm(step_s=0.001)
    try:
        reg = HandlerRegistry()
        reg.register(ShoutHandler)
        path = tmp_path / "s.sqlite"
        app = create_app(ServerSettings(tokenizer=str(tiny_model_dir), health_interval_s=3600, backends=[address],
                                        journal=str(path)), registry=reg)
        client = await aiohttp_client(app)
        body = {"job_id": "s1", "instance": {"data_source": "shout", "prompt": "Hi.", "turns": 3},
                "sampling_params": {"max_tokens": 7}}
        res = await (await client.post("/process", json=body)).json()
        assert res["failure_kind"] is None
        j = Journal(str(path), readonly=True)
        recs = j.completions("s1")
        traj = res["trajectories"][0]
        assert len(recs) == 3
        assert recs[0].prompt_ids == traj["prompt_ids"]
        gen = [t for t, m in zip(traj["response_ids"], traj["loss_mask"]) if m]
        assert [t for r in recs for t in r.token_ids] == gen
        full = traj["prompt_ids"] + traj["response_ids"]
        for r in recs:  # each turn's prompt is the context at that turn, exactly
            assert full[:len(r.prompt_ids)] == r.prompt_ids
        state, request, result, filtered = j.job("s1")
        assert state == "done" and json.loads(request)["job_id"] == "s1" and not filtered
        assert json.loads(result)["trajectory_id"] == res["trajectory_id"]
        j.close()
    finally:
        await runner.cleanup()


def test_a_journal_of_another_schema_version_is_refused(tmp_path):
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE jobs (job_id TEXT)")
    db.execute("PRAGMA user_version = 0")
    db.commit()
    db.close()
    with pytest.raises(JournalError, match="schema version 0"):
        Journal(str(path))


async def _shout_server(aiohttp_client, tiny_model_dir, address, path):
    reg = HandlerRegistry()
    reg.register(ShoutHandler)
    app = create_app(ServerSettings(tokenizer=str(tiny_model_dir), health_interval_s=3600, backends=[address],
                                    journal=str(path)), registry=reg)
    return await aiohttp_client(app)


SHOUT = {"job_id": "r1", "instance": {"data_source": "shout", "prompt": "Hi.", "turns": 3},
         "sampling_params": {"max_tokens": 6}}


@pytest.mark.parametrize("diverge", [False, True, "sampling"])
async def test_a_job_a_crash_interrupted_resumes_exactly_from_its_journalled_turns(
        aiohttp_client, tiny_model_dir, tmp_path, diverge):
    # 1. a first attempt's journal: the job was running and had generated 2 of its 3 turns when the server died
    fake, runner, address = await start_fake_vllm(step_s=0.001, version=0)
    try:
        client = await _shout_server(aiohttp_client, tiny_model_dir, address, tmp_path / "first.sqlite")
        assert (await (await client.post("/process", json=SHOUT)).json())["failure_kind"] is None
        await client.close()
    finally:
        await runner.cleanup()
    first = Journal(str(tmp_path / "first.sqlite"), readonly=True)
    recs = first.completions("r1")
    first.close()
    assert len(recs) == 3
    crashed = Journal(str(tmp_path / "crashed.sqlite"))
    crashed.start()
    crashed.job_submitted("r1", "shout", json.dumps(SHOUT).encode())
    crashed.job_state("r1", "run")
    for k, r in enumerate(recs[:2]):
        prompt = list(r.prompt_ids)
        if diverge is True and k == 1:
            prompt[3] += 1  # the second request is not the one the agent sends now
        crashed.completion("r1", r.backend, prompt, r.token_ids, r.logprobs, r.version_runs, r.finish_reason,
                           r.stop_reason, r.params)
    crashed.close()
    # 2. the restarted server, whose backend now has other weights (its tokens say so: 1000 + 7)
    fake, runner, address = await start_fake_vllm(step_s=0.001, version=7)
    try:
        client = await _shout_server(aiohttp_client, tiny_model_dir, address, tmp_path / "crashed.sqlite")
        assert (await client.get("/jobs/r1")).status == 404
        assert (await (await client.get("/jobs/r1")).json())["error"]["type"] == "job_interrupted"
        body = SHOUT if diverge != "sampling" else {**SHOUT, "sampling_params": {**SHOUT["sampling_params"],
                                                                                "temperature": 0.5}}
        res = await (await client.post("/process", json=body)).json()
        assert res["failure_kind"] is None
        traj = res["trajectories"][0]
        gen = [t for t, m in zip(traj["response_ids"], traj["loss_mask"]) if m]
        per_turn = [gen[i:i + 6] for i in range(0, len(gen), 6)]
        if not diverge:  # turns 1-2 answered from the journal (no extra turn), turn 3 generated now
            assert per_turn == [recs[0].token_ids, recs[1].token_ids, [1007] * 6]
            assert fake.counts["requests"] == 1
            assert res["extra"]["replay"] == {"replayed": 2, "recorded": 2, "ended": None}
        elif diverge is True:  # the replay ends where the request differs, and says where
            assert per_turn == [recs[0].token_ids, [1007] * 6, [1007] * 6]
            assert fake.counts["requests"] == 2
            assert res["extra"]["replay"]["replayed"] == 1
            assert "token 3" in res["extra"]["replay"]["ended"]
        else:  # same prompts, other sampling parameters: not the recorded requests, nothing replayed
            assert per_turn == [[1007] * 6] * 3
            assert res["extra"]["replay"]["replayed"] == 0
            assert "sampling parameters" in res["extra"]["replay"]["ended"]
        await client.close()
    finally:
        await runner.cleanup()
    # 3. the new attempt's journal holds its own turns, replayed ones included, in order
    j = Journal(str(tmp_path / "crashed.sqlite"), readonly=True)
    assert [r.token_ids for r in j.completions("r1")] == per_turn
    j.close()


def test_two_journals_on_one_file_are_refused(tmp_path):
    first = journal(tmp_path)
    with pytest.raises(JournalError, match="in use by another process"):
        Journal(first.path)
    first.close()
    Journal(first.path).close()  # free again once the first is closed


def _hold_write_lock(path: str) -> sqlite3.Connection:
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # stands for a disk that refuses writes: every commit fails meanwhile
    return other


def test_a_write_that_fails_is_retried_and_flush_waits_for_it(tmp_path, monkeypatch):
    monkeypatch.setattr(Journal, "busy_timeout_s", 0.05)  # a commit meeting the lock fails at once
    j = journal(tmp_path)
    other = _hold_write_lock(j.path)
    j.job_submitted("a", "h", b"{}")
    assert j.flush(timeout_s=0.5) is False and j.last_error is not None
    other.execute("ROLLBACK")
    other.close()
    assert j.flush(timeout_s=10) is True and j.job("a") is not None and j.last_error is None
    j.close()


async def test_a_result_the_journal_cannot_record_is_not_answered_as_one(make_client, tmp_path, monkeypatch):
    monkeypatch.setattr(Journal, "busy_timeout_s", 0.05)  # a commit meeting the lock fails at once
    path = str(tmp_path / "s.sqlite")
    client = await make_client(journal=path)
    client.server.app[PIPELINE].journal_flush_s = 0.5
    body = {"job_id": "w", "instance": {"data_source": "scripted", "reward": 0.5}}
    other = _hold_write_lock(path)
    res = await (await client.post("/process", json=body)).json()
    assert res["failure_kind"] == "internal" and res["filter"] is True and "journal" in res["error"]
    other.execute("ROLLBACK")
    other.close()
    await asyncio.sleep(0.5)  # the writer's retry goes through
    again = await (await client.post("/process", json=body)).json()
    assert again["reward"] == 0.5 and again["failure_kind"] is None  # the real result, recorded since


async def test_while_the_journal_cannot_commit_new_jobs_are_refused_and_a_finishing_one_fails_fast(
        make_client, tmp_path, monkeypatch):
    """A full disk (here: a write lock held by another connection) must not make every job run only to be thrown
    away 30 s later: new jobs are a 503 ``journal_unavailable`` (a client sends them elsewhere), a job that
    finishes meanwhile is answered in about a second as a filtered ``internal`` failure, and everything works
    again with the first commit that goes through."""
    monkeypatch.setattr(Journal, "busy_timeout_s", 0.05)  # a commit meeting the lock fails at once
    path = str(tmp_path / "s.sqlite")
    client = await make_client(journal=path)
    pipeline = client.server.app[PIPELINE]
    assert pipeline.journal_flush_s == 30.0  # the default: a failing journal must not cost it
    running = asyncio.ensure_future(client.post("/process", json={
        "job_id": "r", "instance": {"data_source": "scripted", "sleep": {"run": 1.0}}}))
    await asyncio.sleep(0.3)  # r runs
    other = _hold_write_lock(path)
    pipeline.journal.job_submitted("probe", "h", b"{}")  # a commit that fails: the writer reports why
    assert await pipeline.journal.aflush(0.5) is False and pipeline.journal_failing() is not None
    refused = await client.post("/process", json={"job_id": "n", "instance": {"data_source": "scripted"}})
    body = await refused.json()
    assert refused.status == 503 and body["error"]["type"] == "journal_unavailable", body
    assert "submit it elsewhere or later" in body["error"]["message"]
    t0 = time.monotonic()
    res = await (await running).json()
    assert res["failure_kind"] == "internal" and res["filter"] is True and "journal" in res["error"]
    assert time.monotonic() - t0 < 5.0  # ~0.7 s of r's run left + 1 s, not 30 s
    other.execute("ROLLBACK")
    other.close()
    for _ in range(100):  # the writer's retry goes through
        if pipeline.journal_failing() is None:
            break
        await asyncio.sleep(0.05)
    ok = await (await client.post("/process", json={"job_id": "n", "instance": {"data_source": "scripted",
                                                                                "reward": 0.5}})).json()
    assert ok["reward"] == 0.5 and ok["failure_kind"] is None



_SERVER = """
import os
import sys
from prorl_server.journal.store import Journal
j = Journal(sys.argv[1])
j.start()
print(j._proc.pid if getattr(j, "_proc", None) else os.getpid(), flush=True)  # the writer process
sys.stdin.readline()
j.job_submitted("b", "h", b"{}")
j.job_result("b", b'{"job_id": "b"}')
print("handed over", flush=True)
sys.stdin.readline()  # never comes: SIGKILLed here
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def test_rows_a_sigkilled_server_handed_over_are_committed_and_its_writer_exits(tmp_path):
    # a process (standing for the server) writes a job and its result while another connection holds the
    # database's write lock (so nothing can be committed yet), and is SIGKILLed; its writer process commits
    # them once the lock is free, exits (no orphan), and frees the journal for the next server. A writer
    # thread died with the process: the rows were lost.
    import os
    import signal
    import subprocess
    import sys

    path = str(tmp_path / "k.sqlite")
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        writer = int(proc.stdout.readline())
        other = _hold_write_lock(path)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "handed over"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert _running(writer)  # waiting for the lock, with the rows it was handed
        other.execute("ROLLBACK")
        other.close()
        deadline = time.monotonic() + 20
        while _running(writer) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(writer)
    finally:
        proc.kill()
    j = Journal(path)  # the lock is free: the next server opens it
    assert j.job("b") == ("done", b"{}", b'{"job_id": "b"}', False)
    j.close()


_PREALLOC_SERVER = """
import os
import sys
from prorl_server.journal.store import Journal
j = Journal(sys.argv[1], prealloc_wal=True)
j.start()
for i in range(200):
    j.job_submitted(f"job-{i}", "h", b"{}")
    j.job_result(f"job-{i}", b'{"n": %d}' % i)
    j.completion(f"job-{i}", None, list(range(300)), [i, i + 1], [-0.5, -0.25], [[0, 2]], "stop")
assert j.flush()
print(os.path.getsize(sys.argv[1] + "-wal"), flush=True)
sys.stdin.readline()  # never comes: SIGKILLed here, writer included
"""


def test_a_preallocated_wal_keeps_every_committed_row_across_a_sigkill_and_goes_with_a_clean_close(tmp_path):
    # prealloc_wal (prorl-server's default) writes the WAL file (zeros) before the first commit so commits
    # overwrite allocated space: the server and its writer are SIGKILLed after a flush, and the next journal on
    # the file finds every row (the zeros after the last frame are not taken for frames), and removes the
    # 68 MiB WAL when it closes.
    import os
    import signal
    import subprocess
    import sys

    path = str(tmp_path / "p.sqlite")
    proc = subprocess.Popen([sys.executable, "-c", _PREALLOC_SERVER, path], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wal_bytes = int(proc.stdout.readline())
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert wal_bytes >= 64 << 20  # the space commits overwrite instead of appending
    deadline = time.monotonic() + 20
    while True:  # the killed writer's lock goes with it
        try:
            j = Journal(path)
            break
        except JournalError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert j.count_jobs() == 200
    assert j.result("job-199") == b'{"n": 199}'
    assert [(c.token_ids, c.logprobs) for c in j.completions("job-7")] == [([7, 8], [-0.5, -0.25])]
    j.start()
    j.job_submitted("after", "h", b"{}")
    assert j.flush()
    j.close()
    assert not os.path.exists(path + "-wal")  # the last connection checkpointed it into the file and removed it
    j = Journal(path)
    assert j.count_jobs(None) == 201
    j.close()


def test_prorl_server_preallocates_the_wal_and_an_app_built_in_code_does_not():
    from prorl_server.cli import settings_from_args

    assert settings_from_args([]).journal_prealloc_wal is True
    assert settings_from_args(["--no-journal-prealloc-wal"]).journal_prealloc_wal is False
    assert not ServerSettings().journal_prealloc_wal


def test_the_preallocated_wal_does_not_count_against_the_size_cap(tmp_path):
    # the WAL's 97 MiB of zeros are not the journal's data: a 4 MiB cap keeps finished jobs the small database
    # holds (counting the zeros, retention deleted them at every pass)
    j = journal(tmp_path, max_bytes=4 << 20, retention_every_s=0.0, prealloc_wal=True)
    for i in range(20):
        j.job_submitted(f"job-{i}", "h", b"{}")
        j.job_result(f"job-{i}", b"{}")
        assert j.flush()  # each commit is followed by a retention pass
    assert j.count_jobs() == 20
    j.close()


def test_a_journal_of_schema_2_is_upgraded_in_place_and_its_gateway_sessions_come_under_retention(tmp_path):
    # a journal written by the previous version: no auto_vacuum, gateway requests stored as sent, no record of
    # job-less sessions (so retention never deleted their rows)
    path = tmp_path / "v2.sqlite"
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE jobs (job_id TEXT PRIMARY KEY, handler TEXT, request BLOB, state TEXT NOT NULL,
                           submitted REAL NOT NULL, updated REAL NOT NULL, result BLOB, filtered INTEGER);
        CREATE TABLE completions (id INTEGER PRIMARY KEY, owner TEXT NOT NULL, seq INTEGER NOT NULL, backend TEXT,
                                  prefix_len INTEGER NOT NULL, prompt_tail BLOB NOT NULL, token_ids BLOB NOT NULL,
                                  logprobs BLOB NOT NULL, version_runs TEXT NOT NULL, finish_reason TEXT,
                                  stop_reason TEXT, params TEXT, t REAL NOT NULL);
        CREATE TABLE gateway (id INTEGER PRIMARY KEY, session_id TEXT NOT NULL, seq INTEGER NOT NULL,
                              request_hash TEXT NOT NULL, request BLOB NOT NULL, response BLOB NOT NULL,
                              t REAL NOT NULL);
        INSERT INTO jobs VALUES ('job', 'h', '{}', 'done', 1.0, 1.0, '{}', 0);
        INSERT INTO gateway VALUES (1, 'job', 1, 'h1', '{ "messages" : [] }', '{}', 1.0);
        INSERT INTO gateway VALUES (2, 'sess_a', 1, 'h2', '{ "messages" : [1] }', '{}', 2.0);
        PRAGMA user_version = 2;
    """)
    db.close()
    j = Journal(str(path))
    j.start()
    assert j.gateway_exchanges("sess_a") == [(1, "h2", '{ "messages" : [1] }', "{}")]  # as stored
    j.close()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == 3
    assert db.execute("PRAGMA auto_vacuum").fetchone()[0] == 2  # converted once (a small file)
    assert db.execute("SELECT session_id, owner, ended FROM sessions").fetchall() == [("sess_a", "gateway:sess_a", 1)]
    db.close()


def test_a_journal_over_its_cap_with_running_jobs_only_keeps_its_tombstones(tmp_path):
    # the running job cannot be deleted; deleting the tombstones would free nothing worth it and let the
    # delivered id run again
    j = journal(tmp_path, max_bytes=1 << 20, retention_every_s=0.0)
    j.job_submitted("delivered", "h", b"{}")
    j.job_result("delivered", b'{"reward": 1.0}')
    assert j.flush()
    j.job_submitted("running", "h", b"x" * (2 << 20))
    assert j.flush()
    j.job_state("running", "run")  # a commit after which retention runs with the big job in
    assert j.flush()
    assert j.job("delivered") is None and j.expired("delivered")
    assert j.job("running") is not None
    j.close()


# ------------------------------------------------------------------------------------------ a co-tenant (#33 part 6)


def test_journal_files_are_private_whatever_the_umask(tmp_path):
    # red team J0: the journal, its -wal and -shm were 0644 under umask 022: every local user read every
    # instance and result
    old = os.umask(0o022)
    try:
        j = Journal(str(tmp_path / "j.sqlite"))
        j.start()
        j.job_submitted("a", "shout", b"{}")
        j.flush()
        modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir() if p.name.startswith("j.sqlite")}
        j.close()
    finally:
        os.umask(old)
    assert {"j.sqlite", "j.sqlite-wal", "j.sqlite-shm", "j.sqlite.lock"} <= set(modes)
    assert set(modes.values()) == {0o600}, modes
    (tmp_path / "k.sqlite").touch(mode=0o644)  # an existing file of ours made private
    os.chmod(tmp_path / "k.sqlite", 0o644)
    Journal(str(tmp_path / "k.sqlite")).close()
    assert (tmp_path / "k.sqlite").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("plant", ["link_to_missing", "link_wal", "fifo_wal", "other_users"])
def test_a_journal_path_another_user_planted_is_refused_with_its_name(tmp_path, plant):
    # red team J1/J2: a symlink planted at the journal's path made the server create its journal in the
    # planter's directory (readable and replaceable by her); one to another file stopped the start obscurely
    path = tmp_path / "node.sqlite"
    loot = tmp_path / "loot"
    loot.mkdir()
    if plant == "link_to_missing":
        path.symlink_to(loot / "d.sqlite")
        bad = path
    elif plant == "link_wal":
        bad = tmp_path / "node.sqlite-wal"
        bad.symlink_to(loot / "victim")
    elif plant == "fifo_wal":
        bad = tmp_path / "node.sqlite-wal"
        os.mkfifo(bad)
    else:
        if os.geteuid() != 0:
            pytest.skip("needs root to own a file as another user")
        path.touch()
        os.chown(path, 65534, 65534)
        bad = path
    with pytest.raises(JournalError, match=str(bad)):
        j = Journal(str(path))
        j.close()
    assert not (loot / "d.sqlite").exists() and not (loot / "victim").exists()
