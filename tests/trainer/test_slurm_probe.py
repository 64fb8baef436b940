"""What the fleet does with Slurm's answers (trainer_plugins/slurm_probe.py), fast tier: each outcome the module
docstring defines. Slurm's ``squeue``/``scontrol`` are stood in for by small scripts on ``PATH`` that print what
the real commands print (their formats were read off Slurm 22.05 on this machine's test cluster), because a
controller that forgets jobs, answers for another cluster or hangs cannot be staged on cue; the real commands
are exercised by tests/cluster/test_fleet_slurm.py."""
from __future__ import annotations

import os
import stat
from pathlib import Path

from prorl_server.membership import MemberRecord, write_record
from trainer_plugins.fleet import Fleet
from trainer_plugins.slurm_probe import SlurmProbe


def fake_slurm(tmp_path: Path, *, cluster="prorl-ci", jobs="", steps="", jobs_rc=0, hang=False) -> dict:
    """A PATH with ``scontrol show config`` (ClusterName) and ``squeue`` printing ``jobs`` (``%i %T`` lines) or,
    with ``--steps``, ``steps`` (``%i`` lines); ``jobs_rc=1`` answers as squeue does for unknown job ids."""
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    (bin_ / "scontrol").write_text(f"#!/bin/sh\necho 'ClusterName             = {cluster}'\n")
    body = "exec sleep 30\n" if hang else ""
    (bin_ / "squeue").write_text(
        "#!/bin/sh\n" + body +
        'case "$*" in *--steps*) printf "%s" "$STEPS";; *)\n'
        f'  if [ {jobs_rc} != 0 ]; then\n'
        f'    echo "slurm_load_jobs error: Invalid job id specified" >&2; exit {jobs_rc}\n'
        '  fi\n'
        '  printf "%s" "$JOBS";; esac\n')
    for f in ("scontrol", "squeue"):
        (bin_ / f).chmod((bin_ / f).stat().st_mode | stat.S_IXUSR)
    return {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "JOBS": jobs, "STEPS": steps}


def member(mid: str, job: str, step: str = "0", cluster: str = "prorl-ci") -> MemberRecord:
    import time

    now = time.time()
    return MemberRecord(member_id=mid, url=f"http://127.0.0.1:{1000 + len(mid)}{job}", host="127.0.0.1", port=1,
                        pid=1, node="elsewhere", cluster=cluster, job_id=job, step_id=step, seq=1, ttl_s=60,
                        renewed_at=now, expires_at=now + 60)


def test_a_member_whose_job_or_step_ended_is_dead_and_the_others_are_not(tmp_path):
    env = fake_slurm(tmp_path, jobs="10 RUNNING\n11 COMPLETING\n", steps="10.0\n10.batch\n")
    probe = SlurmProbe(env)
    asked = [("runs", "prorl-ci", "10", "0"), ("job-ending", "prorl-ci", "11", "0"),
             ("job-gone", "prorl-ci", "12", "0"), ("step-gone", "prorl-ci", "10", "1"),
             ("batch-step", "prorl-ci", "10", "batch"), ("no-slurm", "prorl-ci", None, None)]
    assert probe.dead(asked) == {"job-ending", "job-gone", "step-gone"}


def test_nothing_is_declared_dead_when_slurm_cannot_tell(tmp_path):
    asked = [("a", "prorl-ci", "10", "0")]
    # the controller knows none of the ids (forgotten, or another cluster's controller): exit 1
    assert SlurmProbe(fake_slurm(tmp_path, jobs_rc=1)).dead(asked) == set()
    # the member's record names another cluster
    assert SlurmProbe(fake_slurm(tmp_path, cluster="other", jobs="")).dead(asked) == set()
    # a command that hangs is given up after timeout_s
    assert SlurmProbe(fake_slurm(tmp_path, hang=True), timeout_s=0.5).dead(asked) == set()
    # no Slurm commands at all: no probe
    empty = tmp_path / "empty"
    empty.mkdir()
    assert SlurmProbe.auto({"PATH": str(empty)}) is None


def test_the_fleet_takes_out_a_member_slurm_says_ended_while_its_lease_is_live(tmp_path):
    env = fake_slurm(tmp_path, jobs="10 RUNNING\n", steps="10.0\n")
    alive, ended = member("alive", "10"), member("ended", "11")
    write_record(tmp_path / "fleet", alive)
    write_record(tmp_path / "fleet", ended)
    fleet = Fleet(tmp_path / "fleet", start=False, slurm=SlurmProbe(env))
    assert sorted(fleet) == sorted([alive.url, ended.url])  # both leases are live (60 s)
    assert fleet.check_slurm(force=True)
    assert list(fleet) == [alive.url] and fleet.is_lost(ended.url) and not fleet.is_lost(alive.url)
    lease_only = Fleet(tmp_path / "fleet", start=False, slurm=None)
    assert sorted(lease_only) == sorted([alive.url, ended.url])
