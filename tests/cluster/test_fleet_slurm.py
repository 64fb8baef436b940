"""Issue #24 on a REAL Slurm cluster (conftest.py): ``sbatch slurm/launch_rollout.sh`` with ``PRORL_FLEET_DIR``
joins a fleet that a trainer-side client is already following: a second job submitted mid-run gets its first
job within 5 s of its server listening, with the fleet's one token; when the trainer writes the end sentinel
both allocations are released (the jobs leave Slurm) within 30 s, each server step exiting cleanly."""
from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from prorl_server.membership import MemberRecord, members_dir
from trainer_plugins.admission import LeastInFlight
from trainer_plugins.fleet import Fleet
from trainer_plugins.jobs import JobSubmitter, process_request

pytestmark = pytest.mark.real

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "slurm" / "launch_rollout.sh"
ARITHMETIC = {"data_source": "arithmetic", "expression": "2+3", "answer": 5}


def submit(cluster, out_dir: Path, fleet_dir: Path) -> str:
    exe = Path(sys.executable).parent / "prorl-server"
    env = dict(cluster.env)
    env.update(PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}",
               PYTHONPATH=f"{REPO}:{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(REPO),
               PRORL_SERVERS_DIR=str(out_dir), PRORL_HOST="127.0.0.1", PRORL_PYTHON=sys.executable,
               PRORL_SERVER_CMD=str(exe) if exe.exists() else f"{sys.executable} -m prorl_server",
               PRORL_STARTUP_TIMEOUT="120", PRORL_FLEET_DIR=str(fleet_dir),
               PRORL_SERVER_ARGS="--sandbox-runtime none --journal off")
    env.pop("PRORL_TOKEN", None)
    out_dir.mkdir(parents=True, exist_ok=True)
    r = cluster.run("sbatch", "--parsable", f"--output={out_dir}/job-%j.out", str(LAUNCHER), env=env)
    return r.stdout.strip().split(";")[0]


class Recording(LeastInFlight):
    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[float, str]] = []  # (wall time, server)

    def started(self, server, group_id=None):
        self.sent.append((time.time(), server))
        super().started(server, group_id)


def records_of(fleet_dir: Path, job_id: str) -> list[MemberRecord]:
    out = []
    for p in members_dir(fleet_dir).glob("*.json"):
        try:
            r = MemberRecord.model_validate_json(p.read_bytes())
        except (OSError, ValueError):
            continue
        if r.job_id == job_id:
            out.append(r)
    return out


async def _wait(pred, timeout_s: float, what: str, cluster=None, jobs=()) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            states = {j: cluster.job_state(j) for j in jobs} if cluster else {}
            pytest.fail(f"{what}: not within {timeout_s} s (jobs: {states})")
        await asyncio.sleep(0.1)


async def test_a_job_submitted_mid_run_joins_the_fleet_and_the_end_sentinel_releases_every_allocation(
        slurm_cluster, tmp_path):
    cluster = slurm_cluster
    fleet_dir = tmp_path / "fleet"
    first = submit(cluster, tmp_path / "a", fleet_dir)
    second = None
    fleet = Fleet(fleet_dir)
    try:
        await _wait(lambda: len(fleet) == 1, 120, "the first job's server in the fleet", cluster, [first])
        chooser = Recording()
        stop = False
        outcomes = []
        async with JobSubmitter(fleet.headers, fleet=fleet) as jobs:
            async def loop(w):
                i = 0
                while not stop:
                    outcomes.append(await jobs.run(fleet, process_request(ARITHMETIC), chooser=chooser,
                                                   job_prefix=f"w{w}-{i}"))
                    i += 1
                    await asyncio.sleep(0.05)

            workers = [asyncio.create_task(loop(w)) for w in range(2)]
            second = submit(cluster, tmp_path / "b", fleet_dir)
            await _wait(lambda: records_of(fleet_dir, second), 120, "the second job's record", cluster,
                        [first, second])
            joined = records_of(fleet_dir, second)[0]
            await _wait(lambda: any(s == joined.url for _, s in chooser.sent), 30, "a job on the joined server")
            first_job = min(t for t, s in chooser.sent if s == joined.url)
            stop = True
            await asyncio.gather(*workers)
        latency = first_job - joined.started_at  # same host: one clock
        print(f"slurm join: first job on job {second}'s server {latency:.2f} s after it listened")
        assert latency < 5.0
        assert outcomes and not any(o.filtered for o in outcomes)
        assert all(o.result.reward == 1.0 for o in outcomes)  # the fleet's token was accepted by both jobs

        t0 = time.monotonic()
        fleet.end("test: the trainer ended")
        final = {"", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT"}
        await _wait(lambda: cluster.job_state(first) in final and cluster.job_state(second) in final, 30,
                    "both allocations released after the end sentinel", cluster, [first, second])
        took = time.monotonic() - t0
        print(f"slurm end: both jobs left Slurm {took:.2f} s after the end sentinel")
        assert took < 30
        for job, d in ((first, tmp_path / "a"), (second, tmp_path / "b")):
            out = (d / f"job-{job}.out").read_text(errors="replace")
            assert "the trainer ended" in out and "exited rc=0" in out, out
        assert list(members_dir(fleet_dir).glob("*.json")) == []
    finally:
        fleet.close()
        for job in (first, second):
            if job:
                cluster.run("scancel", job, check=False)


async def test_a_sigkilled_server_is_out_within_2_ttl_and_a_scancelled_job_drains_with_nothing_lost(
        slurm_cluster, tmp_path):
    import os
    import signal

    cluster = slurm_cluster
    fleet_dir = tmp_path / "fleet"
    jobs_ = [submit(cluster, tmp_path / "a", fleet_dir), submit(cluster, tmp_path / "b", fleet_dir)]
    fleet = Fleet(fleet_dir)
    remote = Fleet(fleet_dir, local_node="another-node")  # where a pid means nothing: only the lease counts
    try:
        await _wait(lambda: len(fleet) == 2, 120, "both jobs' servers in the fleet", cluster, jobs_)
        killed = records_of(fleet_dir, jobs_[1])[0]
        drained = records_of(fleet_dir, jobs_[0])[0]
        chooser = Recording()
        stop = False
        outcomes = []
        async with JobSubmitter(fleet.headers, fleet=fleet) as jobs:
            async def loop(w):
                i = 0
                while not stop:
                    outcomes.append(await jobs.run(fleet, process_request(ARITHMETIC), chooser=chooser,
                                                   job_prefix=f"w{w}-{i}"))
                    i += 1
                    await asyncio.sleep(0.02)

            workers = [asyncio.create_task(loop(w)) for w in range(2)]
            await _wait(lambda: {s for _, s in chooser.sent} >= {killed.url, drained.url}, 30, "jobs on both")
            os.kill(killed.pid, signal.SIGKILL)
            t_kill = time.monotonic()
            await _wait(lambda: killed.url not in fleet, 10, "out for the client")
            out_client, known_dead_at = time.monotonic() - t_kill, time.time()
            await _wait(lambda: killed.url not in remote, 2 * 5.0 + 1, "out by the lease")
            out_lease = time.monotonic() - t_kill
            sent_after = [s for t, s in chooser.sent if t > known_dead_at]
            stop = True
            await asyncio.gather(*workers)
            # shrink: the other job is told to stop; its server drains (takes no new job) and leaves
            cluster.run("scancel", jobs_[0])  # SIGTERM to the steps and the batch shell, as a user would
            await _wait(lambda: drained.url not in fleet, 10, "the drained server out of the rotation")
        print(f"slurm SIGKILL: out for the client {out_client:.2f} s, by the lease alone {out_lease:.2f} s after "
              "the kill")
        assert out_lease <= 2 * 5.0
        assert sent_after and killed.url not in sent_after  # never a job to a server known dead
        assert outcomes and not any(o.filtered for o in outcomes)  # nothing lost, none aborted
        final = {"", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT"}
        await _wait(lambda: all(cluster.job_state(j) in final for j in jobs_), 60, "both jobs left Slurm", cluster,
                    jobs_)
        out = (tmp_path / "a" / f"job-{jobs_[0]}.out").read_text(errors="replace")
        assert "exited rc=0" in out, out  # the drained server left cleanly
        node_log = next((tmp_path / "a").glob("prorl-*/*.log")).read_text(errors="replace")
        assert "draining" in node_log and "SIGKILL" not in node_log, node_log
    finally:
        fleet.close()
        remote.close()
        for job in jobs_:
            cluster.run("scancel", job, check=False)
