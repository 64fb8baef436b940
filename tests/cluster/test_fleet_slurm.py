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


def submit(cluster, out_dir: Path, fleet_dir: Path, node: str | None = None, server_args: str = "",
           **more_env: str) -> str:
    """``sbatch slurm/launch_rollout.sh`` joining ``fleet_dir`` (on ``node`` when given); returns the job id."""
    exe = Path(sys.executable).parent / "prorl-server"
    env = dict(cluster.env)
    env.update(PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}",
               PYTHONPATH=f"{REPO}:{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(REPO),
               PRORL_SERVERS_DIR=str(out_dir), PRORL_HOST="127.0.0.1", PRORL_PYTHON=sys.executable,
               PRORL_SERVER_CMD=str(exe) if exe.exists() else f"{sys.executable} -m prorl_server",
               PRORL_STARTUP_TIMEOUT="120", PRORL_FLEET_DIR=str(fleet_dir),
               PRORL_SERVER_ARGS=f"--sandbox-runtime none --journal off {server_args}".strip(), **more_env)
    env.pop("PRORL_TOKEN", None)
    out_dir.mkdir(parents=True, exist_ok=True)
    where = [f"--nodelist={node}"] if node else []
    r = cluster.run("sbatch", "--parsable", *where, f"--output={out_dir}/job-%j.out", str(LAUNCHER), env=env)
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


# ------------------------------------------------------------------------------------------ two nodes
# Two slurmd daemons on this machine (conftest.slurm_cluster_2nodes): each job of the fleet runs on its own node,
# and the trainer-side readers run on neither (their node is this host's name, the members' are <host>-1 and
# <host>-2), so a pid means nothing to them: only requests, leases and Slurm can tell a member died.

TURN_S = 1.0


def shout(i: int) -> dict:
    return {"data_source": "shout", "instance_id": f"shout-{i}", "prompt": "Say something about the sea.",
            "turns": 2}


class Load:
    """``workers`` loops running 2-turn shout jobs (2 x TURN_S s) through ``JobSubmitter.run(fleet)``."""

    def __init__(self, jobs: JobSubmitter, fleet: Fleet, workers: int) -> None:
        self.chooser = Recording()
        self.outcomes: list = []
        self.delivered_at: list[float] = []  # wall time each outcome was delivered
        self._stop = False
        self._tasks = [asyncio.create_task(self._loop(jobs, fleet, w)) for w in range(workers)]

    async def _loop(self, jobs, fleet, w):
        i = 0
        while not self._stop:
            self.outcomes.append(await jobs.run(fleet, process_request(shout(i), {"max_tokens": 8}),
                                                chooser=self.chooser, job_prefix=f"w{w}-{i}"))
            self.delivered_at.append(time.time())
            i += 1

    async def stop(self):
        self._stop = True
        await asyncio.gather(*self._tasks)


def released(cluster, job: str) -> bool:
    return cluster.job_state(job) in {"", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT"}


async def test_two_nodes_a_job_joining_on_the_other_node_gets_work_within_5_s_and_the_end_releases_both(
        slurm_cluster_2nodes, tmp_path, fake_llm):
    cluster = slurm_cluster_2nodes
    n1, n2 = cluster.nodes[:2]
    fleet_dir = tmp_path / "fleet"
    jobs_ = [submit(cluster, tmp_path / "a", fleet_dir, n1, f"--backend {fake_llm}")]
    fleet = Fleet(fleet_dir)
    try:
        await _wait(lambda: len(fleet) == 1, 120, f"the server on {n1} in the fleet", cluster, jobs_)
        async with JobSubmitter(fleet.headers, fleet=fleet) as jobs:
            load = Load(jobs, fleet, workers=4)
            # the first jobs load the tokenizer (seconds): only then do jobs start at a steady rate
            await _wait(lambda: len(load.outcomes) >= 4, 120, "the first jobs")
            jobs_.append(submit(cluster, tmp_path / "b", fleet_dir, n2, f"--backend {fake_llm}"))
            await _wait(lambda: records_of(fleet_dir, jobs_[1]), 120, f"the record of the job on {n2}", cluster,
                        jobs_)
            joined = records_of(fleet_dir, jobs_[1])[0]
            await _wait(lambda: any(s == joined.url for _, s in load.chooser.sent), 30, f"a job on {n2}")
            first_job = min(t for t, s in load.chooser.sent if s == joined.url)
            await load.stop()
        latency = first_job - joined.started_at  # one machine: one clock
        print(f"slurm 2 nodes, join: first job on {joined.node} {latency:.2f} s after its server listened")
        assert joined.node == n2 and records_of(fleet_dir, jobs_[0])[0].node == n1
        assert latency < 5.0
        assert load.outcomes and not any(o.filtered for o in load.outcomes)

        t0 = time.monotonic()
        fleet.end("test: the trainer ended")
        await _wait(lambda: all(released(cluster, j) for j in jobs_), 30, "both allocations released", cluster,
                    jobs_)
        took = time.monotonic() - t0
        print(f"slurm 2 nodes, end: both jobs left Slurm {took:.2f} s after the end sentinel")
        assert took < 30
        assert list(members_dir(fleet_dir).glob("*.json")) == []
    finally:
        fleet.close()
        for job in jobs_:
            cluster.run("scancel", job, check=False)


async def test_two_nodes_a_sigkilled_server_is_out_within_2_ttl_and_a_scancelled_one_drains_with_0_aborted(
        slurm_cluster_2nodes, tmp_path, fake_llm):
    import os
    import signal

    cluster = slurm_cluster_2nodes
    n1, n2 = cluster.nodes[:2]
    fleet_dir = tmp_path / "fleet"
    jobs_ = [submit(cluster, tmp_path / "a", fleet_dir, n1, f"--backend {fake_llm}"),
             submit(cluster, tmp_path / "b", fleet_dir, n2, f"--backend {fake_llm}"),
             submit(cluster, tmp_path / "c", fleet_dir, n2, f"--backend {fake_llm}")]
    fleet = Fleet(fleet_dir)
    lease_only = Fleet(fleet_dir, slurm=None)  # sends nothing and asks no one: only the lease can tell
    try:
        await _wait(lambda: len(fleet) == 3 and len(lease_only) == 3, 120, "the three servers in the fleet",
                    cluster, jobs_)
        drained, killed, stays = (records_of(fleet_dir, j)[0] for j in jobs_)
        async with JobSubmitter(fleet.headers, fleet=fleet) as jobs:
            load = Load(jobs, fleet, workers=6)
            await _wait(lambda: {s for _, s in load.chooser.sent} >= {killed.url, drained.url}, 30, "jobs on all")
            await asyncio.sleep(TURN_S / 2)  # mid-turn
            os.kill(killed.pid, signal.SIGKILL)
            t_kill = time.monotonic()
            await _wait(lambda: killed.url not in lease_only, 2 * 5.0 + 1, "out by the lease", cluster, jobs_)
            out_lease = time.monotonic() - t_kill
            # shrink: scancel the job on the first node while its server holds jobs: it drains and leaves
            await _wait(lambda: load.chooser.in_flight[drained.url] > 0, 30, "jobs held by the server to drain")
            cluster.run("scancel", jobs_[0])  # SIGTERM to the steps and the batch shell, as a user would
            t_term = time.time()
            await _wait(lambda: drained.url not in fleet, 10, "the drained server out of the rotation")
            await _wait(lambda: released(cluster, jobs_[0]), 60, "the drained job left Slurm", cluster, jobs_)
            await load.stop()
        print(f"slurm 2 nodes, SIGKILL on {killed.node}: out by the lease alone {out_lease:.2f} s after the kill")
        assert out_lease <= 2 * 5.0
        outcomes = load.outcomes
        assert outcomes and not any(o.filtered for o in outcomes)  # nothing lost
        moved = [o for o in outcomes if any(a.server == killed.url for a in o.attempts)]
        assert moved and all(o.server != killed.url for o in moved)  # the killed one's jobs ran elsewhere
        # 0 aborted by the drain: every job the drained server held was delivered by it, and some finished after
        # the scancel; an attempt it did not take (refused as draining, or refused once it had left) is no abort
        aborted = [a for o in outcomes for a in o.attempts if a.server == drained.url and a.failure_kind != "draining"
                   and "Connect call failed" not in (a.error or "")]
        assert aborted == []
        assert any(o.server == drained.url and t > t_term for o, t in zip(outcomes, load.delivered_at))
        delivered = [o.result.job_id for o in outcomes]
        assert len(delivered) == len(set(delivered))  # nothing delivered twice
        out = (tmp_path / "a" / f"job-{jobs_[0]}.out").read_text(errors="replace")
        assert "exited rc=0" in out, out  # the drained server left cleanly
    finally:
        fleet.close()
        lease_only.close()
        for job in jobs_:
            cluster.run("scancel", job, check=False)


async def test_slurm_confirms_a_dead_member_before_its_lease_runs_out(slurm_cluster_2nodes, tmp_path):
    """A member whose Slurm job (or step) ended is out at the next Slurm probe, while its lease (30 s here) still
    runs; a reader that does not ask Slurm keeps it until the lease runs out."""
    import os
    import signal

    from trainer_plugins.slurm_probe import SlurmProbe

    cluster = slurm_cluster_2nodes
    n2 = cluster.nodes[1]
    fleet_dir = tmp_path / "fleet"
    job = submit(cluster, tmp_path / "a", fleet_dir, n2, PRORL_FLEET_TTL_S="30")
    probe = SlurmProbe(cluster.env)
    asking = Fleet(fleet_dir, slurm=probe)
    lease_only = Fleet(fleet_dir, slurm=None)
    try:
        await _wait(lambda: len(asking) == 1 and len(lease_only) == 1, 120, "the server in the fleet", cluster, [job])
        member = records_of(fleet_dir, job)[0]
        assert (member.cluster, member.job_id, member.node) == (probe.cluster(), job, n2)
        asking.check_slurm(force=True)
        assert member.url in asking  # Slurm says it runs
        os.kill(member.pid, signal.SIGKILL)  # its step ends, and the launcher's job with it
        await _wait(lambda: member.url not in asking, 30, "out by Slurm", cluster, [job])
        last = records_of(fleet_dir, job)[0]  # SIGKILL left it behind: its last renewal
        lease_live = member.url in lease_only  # read at once: the lease reader still has it
        print(f"slurm probe: out {time.time() - last.renewed_at:.2f} s after the last renewal (lease 30 s)")
        assert asking.is_lost(member.url)  # lost: an open request to it would end as resubmittable
        assert lease_live and time.time() < last.renewed_at + last.ttl_s  # the lease alone had not told
    finally:
        asking.close()
        lease_only.close()
        cluster.run("scancel", job, check=False)


def test_a_fleet_token_planted_by_another_user_stops_the_launcher_before_any_server_starts(slurm_cluster, tmp_path):
    # issue #33: the launcher took whatever DIR/token held (`ln` fails when the file exists): a co-tenant who made
    # it first knew the key every server then signed its record and checked its requests with
    import os

    fleet_dir = tmp_path / "fleet"
    fleet_dir.mkdir()
    planted = fleet_dir / "token"
    planted.write_text("the-co-tenants-key")
    planted.chmod(0o600)
    os.chown(planted, 4321, 4321)
    job = submit(slurm_cluster, tmp_path / "a", fleet_dir)
    try:
        assert slurm_cluster.wait_job_done(job, 60) in {"FAILED", ""}
        out = (tmp_path / "a" / f"job-{job}.out").read_text()
        assert "belongs to uid 4321" in out and "cannot use" in out, out
        assert not members_dir(fleet_dir).exists()  # no server started, none signed with the planted key
    finally:  # a launcher that took the planted token runs on: release it before the cluster goes
        slurm_cluster.run("scancel", job, check=False)
        slurm_cluster.wait_job_done(job, 60)


async def test_an_end_sentinel_another_user_wrote_neither_stops_the_servers_nor_releases_the_allocation(
        slurm_cluster, tmp_path):
    # issue #33: DIR/END was believed whoever wrote it: a co-tenant who could write the directory ended the fleet
    import json
    import os

    cluster = slurm_cluster
    fleet_dir = tmp_path / "fleet"
    job = submit(cluster, tmp_path / "a", fleet_dir)
    fleet = Fleet(fleet_dir)
    try:
        await _wait(lambda: len(fleet) == 1, 120, "the job's server in the fleet", cluster, [job])
        forged = fleet_dir / ".END.forged"
        forged.write_text(json.dumps({"reason": "a co-tenant", "at": time.time()}))
        os.chown(forged, 4321, 4321)
        os.replace(forged, fleet_dir / "END")
        await asyncio.sleep(4)  # servers look every second, the launcher every second
        assert cluster.job_state(job) == "RUNNING" and len(fleet) == 1
        async with JobSubmitter(fleet.headers, fleet=fleet) as jobs:
            assert (await jobs.run(fleet, process_request(ARITHMETIC), job_prefix="after")).result.reward == 1.0
        fleet.end("test: the trainer ended")  # signed with the fleet's token: this one ends it
        await _wait(lambda: cluster.job_state(job) in {"", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT"}, 30,
                    "the allocation released after the trainer's end sentinel", cluster, [job])
        out = (tmp_path / "a" / f"job-{job}.out").read_text(errors="replace")
        assert "ignoring" in out and "the trainer ended" in out, out
    finally:
        fleet.close()
        cluster.run("scancel", job, check=False)
