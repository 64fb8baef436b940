"""Bounded memory: finished results are retained up to ``keep_finished_mb`` (estimated from token
counts), results a ``/process`` call delivered keep only a summary, and /metrics forgets cleared backends."""
from __future__ import annotations

import asyncio
import random
import tracemalloc

import pytest

from prorl_server.plugin.handler import AgentHandler
from prorl_server.plugin.registry import HandlerRegistry
from prorl_server.app import PIPELINE, create_app
from prorl_server.balancer import BackendPool
from prorl_server.config import ServerSettings
from prorl_server.metrics import Metrics
from prorl_server.pipeline import Pipeline, result_bytes
from prorl_server.types import JobResult, ProcessRequest, Trajectory


def trajectory(prompt: int, response: int, seed: int = 0) -> Trajectory:
    """A rollout segment shaped like a real one: token ids from a 150k vocabulary, one float logprob per
    response token, a 0/1 loss mask."""
    rng = random.Random(seed)
    return Trajectory(prompt_ids=[rng.randrange(1000, 150_000) for _ in range(prompt)],
                      response_ids=[rng.randrange(1000, 150_000) for _ in range(response)],
                      response_logprobs=[-rng.random() for _ in range(response)],
                      loss_mask=[rng.randrange(2) for _ in range(response)])


class TokensHandler(AgentHandler):
    """Stands in for an LLM handler: eval writes a trajectory of ``instance["tokens"]`` response tokens (and
    a message), as a multi-turn rollout would."""

    name = "tokens"
    needs_llm = False

    async def eval(self, job):
        job.trajectories = [trajectory(100, job.instance["tokens"])]
        job.messages = [{"role": "assistant", "content": "x" * 100}]
        job.extra["note"] = "kept"
        job.reward = 1.0


def test_result_size_estimate_matches_the_memory_an_18k_token_result_holds():
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        result = JobResult(job_id="j", trajectory_id="t", handler="h", trajectories=[trajectory(2000, 16_000, seed=1)])
        measured = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    estimate = result_bytes(result)
    print(f"18k-token result: measured {measured / 1e6:.2f} MB, estimated {estimate / 1e6:.2f} MB")
    assert 0.7 < estimate / measured < 1.4


async def test_retention_is_bounded_in_bytes_oldest_forgotten_first():
    registry = HandlerRegistry()
    registry.register(TokensHandler)
    per_job = result_bytes(JobResult(job_id="j", trajectory_id="t", handler="h", trajectories=[trajectory(100, 5000)],
                                     messages=[{"role": "assistant", "content": "x" * 100}]))
    pipeline = Pipeline(registry, BackendPool(), Metrics(), {"init": 2, "run": 2, "eval": 2},
                        keep_finished=10_000, keep_finished_mb=3.5 * per_job / 2**20)
    pipeline.start_workers()
    try:
        for i in range(10):
            job = pipeline.submit(ProcessRequest(job_id=f"b{i}", instance={"data_source": "tokens", "tokens": 5000}))
            await asyncio.wait_for(asyncio.shield(job.done), 30)
        kept = [i for i in range(10) if pipeline.get(f"b{i}") is not None]
        assert kept == [7, 8, 9]  # the newest that fit in 3.5 results' worth
        assert pipeline.retained_bytes == 3 * per_job <= pipeline.keep_finished_bytes
        assert len(pipeline.get("b9").result.trajectories[0].response_ids) == 5000

        # one result larger than the whole budget: still queryable (the newest is always kept), alone
        job = pipeline.submit(ProcessRequest(job_id="huge", instance={"data_source": "tokens", "tokens": 30_000}))
        await asyncio.wait_for(asyncio.shield(job.done), 30)
        assert [j.job_id for j in pipeline._finished] == ["huge"]
        assert pipeline.get("b9") is None and pipeline.get("huge").result.reward == 1.0
    finally:
        await pipeline.shutdown()


@pytest.fixture
def tokens_client(aiohttp_client):
    async def make(**settings):
        registry = HandlerRegistry()
        registry.register(TokensHandler)
        app = create_app(ServerSettings(health_interval_s=3600, **settings), registry=registry)
        return await aiohttp_client(app)
    return make


async def test_results_delivered_by_process_are_not_retained_twice(tokens_client):
    client = await tokens_client(keep_finished_mb=64)
    pipeline = client.app[PIPELINE]
    assert pipeline.keep_finished_bytes == 64 * 2**20  # the setting reaches the pipeline
    r = await client.post("/process", json={"job_id": "p", "instance": {"data_source": "tokens", "tokens": 3000}})
    full = await r.json()
    assert len(full["trajectories"][0]["response_ids"]) == 3000 and full["extra"] == {"note": "kept"}
    s = await (await client.get("/jobs/p")).json()
    summary = s["result"]
    assert s["state"] == "done" and summary["reward"] == 1.0 and summary["critical_error"] is None
    assert summary["trajectories"] == [] and summary["messages"] == []
    assert summary["extra"] == {"delivered": "POST /process"}
    assert pipeline.retained_bytes == result_bytes(pipeline.get("p").result) < 4096

    # a job submitted with POST /jobs is fetched with GET /jobs/{id}: its result stays whole
    r = await client.post("/jobs", json={"job_id": "q", "instance": {"data_source": "tokens", "tokens": 3000}})
    for _ in range(3000):  # hang guard
        s = await (await client.get("/jobs/q")).json()
        if s["state"] == "done":
            break
        await asyncio.sleep(0.01)
    assert len(s["result"]["trajectories"][0]["response_ids"]) == 3000


def test_metrics_series_of_a_cleared_backend_go_when_no_job_holds_it_and_come_back_with_it():
    m = Metrics()
    pool = BackendPool(on_change=m.backend_changed)
    a, b = "http://10.0.0.1:8000", "http://10.0.0.2:8000"
    pool.add(a)
    pool.add(b)
    pool.assign("job", exclude=frozenset({b}))  # holds a
    pool.clear()

    def series() -> set[str]:
        text = m.render().decode()
        return {addr for addr in (a, b) if f'prorl_backend_in_flight{{backend="{addr}"}}' in text
                or f'prorl_backend_healthy{{backend="{addr}"}}' in text}

    assert series() == {a}  # b: cleared and unheld -> gone; a: still held by a job
    pool.release("job")
    assert series() == set()
    pool.add(b, weight_version=2)  # the swap brings it back
    assert series() == {b}
    assert f'prorl_backend_healthy{{backend="{b}"}} 1.0' in m.render().decode()


async def test_a_delivered_result_frees_its_token_arrays(tokens_client):
    """The summary is not only what GET answers: the retained job no longer references the token lists."""
    client = await tokens_client()
    r = await client.post("/process", json={"job_id": "w", "instance": {"data_source": "tokens", "tokens": 100}})
    assert r.status == 200 and len((await r.json())["trajectories"]) == 1
    job = client.app[PIPELINE].get("w")
    assert job.trajectories == [] and job.messages == [] and job.extra == {}
    assert job.result.trajectories == [] and job.result.reward == 1.0


# ------------------------------------------------------------------ the journal's size cap (#33 part 4)

def _fill(j, sessions: int, jobs: int, session_bytes: int, job_bytes: int) -> None:
    """``sessions`` job-less gateway sessions of one ``session_bytes`` exchange each (oldest), then ``jobs``
    finished jobs, each with a result and two gateway exchanges of ``job_bytes`` in all."""
    rng = random.Random(0)

    def text(n: int) -> str:
        return "".join(rng.choice("abcdefghij klmnop") for _ in range(n))

    for i in range(sessions):
        sid = f"sess_{i}"
        j.gateway_session(sid, f"gateway:{sid}")
        j.gateway_exchange(sid, 1, "h", {"messages": [{"role": "user", "content": text(session_bytes)}]}, b"{}")
        j.gateway_session_ended(sid)
        if i % 20 == 0:
            assert j.flush()
    for i in range(jobs):
        jid = f"job_{i}"
        j.job_submitted(jid, "h", b"{}")
        for k in range(2):
            j.gateway_exchange(jid, k + 1, "h", {"messages": [{"role": "user", "content": text(job_bytes // 2)}]},
                               b"{}")
        j.job_result(jid, b'{"reward": 1.0}')
        if i % 10 == 0:
            assert j.flush()
    assert j.flush()


def test_journal_retention_drops_the_oldest_gateway_sessions_and_keeps_the_file_near_its_cap(tmp_path,
                                                                                           monkeypatch):
    # red team (#33): gateway rows were never deleted, so past journal_max_bytes every finished job went and
    # the file stayed at 161 MB against a 50 MB cap; and each pass ran a full VACUUM while commits waited
    import os
    import sqlite3

    from prorl_server.journal import store

    statements: list[str] = []
    real_connect = store.connect

    def traced(path, busy_timeout_s=30.0):
        db = real_connect(path, busy_timeout_s)
        db.set_trace_callback(statements.append)
        return db

    monkeypatch.setattr(store, "connect", traced)
    cap = 2 << 20
    path = tmp_path / "j.sqlite"
    j = store.Journal(str(path), max_bytes=cap, retention_every_s=0.0, writer="thread")
    j.start()
    statements.clear()  # the writer's statements from now on (opening the journal ran its schema)
    _fill(j, sessions=150, jobs=100, session_bytes=16_000, job_bytes=8_000)  # 2.4 MB, then 0.8 MB
    assert j.gateway_exchanges("sess_0") == [] and j.completions("gateway:sess_0") == []
    assert len(j.gateway_exchanges("job_99")) == 2 and j.result("job_99") is not None  # the newest stay
    assert j.count_jobs() == 100  # the sessions were older: they went first, every finished job stays
    kept_sessions = [i for i in range(150) if j.gateway_exchanges(f"sess_{i}")]
    assert kept_sessions == list(range(150 - len(kept_sessions), 150))  # oldest first
    # the writer reports what retention did (as of its last report: a step may follow it)
    assert 0 < j.counters["retention_sessions"] <= 150 - len(kept_sessions) and j.counters["retention_jobs"] == 0
    j.close()
    db = sqlite3.connect(path)
    assert db.execute("SELECT COUNT(*) FROM sessions").fetchone()[0] == len(kept_sessions)
    db.close()
    size = os.path.getsize(path)
    print(f"journal {size / 2**20:.2f} MiB against a {cap / 2**20:.0f} MiB cap")
    assert size < cap * 1.2
    assert not any(s.strip().upper().startswith("VACUUM") for s in statements)
    assert any("incremental_vacuum" in s for s in statements)
