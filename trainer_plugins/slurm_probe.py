"""Ask Slurm which fleet members still run (issue #24: "``scontrol``/``squeue`` to confirm what is alive").

A fleet member started by ``slurm/launch_rollout.sh`` runs inside a Slurm job step, and its record says which
(``cluster``, ``job_id``, ``step_id``: :class:`prorl_server.membership.MemberRecord`). Its lease takes up to
``2 x TTL`` to say it is gone; the controller knows at once when the job or its step ended (the server was
SIGKILLed and its step ended, the job was cancelled, the node was lost and the job failed). A
:class:`SlurmProbe` asks it, so :class:`trainer_plugins.fleet.Fleet` takes such a member out without waiting
for its lease.

One probe is two commands, run by the fleet's reading thread every ``interval_s`` (2 s) while some member
runs under Slurm, never on an event loop:

- ``squeue --noheader --format='%i %T' --jobs=ID,...``: the members' jobs still known and their states; a job
  not listed (it ended: squeue lists only jobs that are pending, running or completing) or not in
  :data:`ALIVE_STATES` is dead;
- ``squeue --noheader --steps --format=%i --jobs=ID,...`` over the live jobs: their running steps
  (``JOB.STEP``); a member whose (numbered) step is not among them is dead.

Defined outcomes when Slurm cannot tell: the commands are missing (:meth:`SlurmProbe.auto` gives None), fail,
time out (``timeout_s``), or know none of the ids (``squeue`` exits 1 with "Invalid job id": every job is
forgotten, or this is another cluster's controller) -> nothing is declared dead, the lease decides. A member of
another cluster (its record's ``cluster`` is not this controller's ``ClusterName``), or with no Slurm job, is
never probed.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
from typing import Iterable, Mapping, Optional

log = logging.getLogger(__name__)

#: Job states (squeue(1), "JOB STATE CODES") in which a job's steps can still be running.
ALIVE_STATES = frozenset({"RUNNING", "SUSPENDED", "CONFIGURING", "RESIZING", "SIGNALING", "STAGE_OUT"})


class SlurmProbe:
    """Which members' Slurm jobs/steps ended (see the module docstring).

    Args:
        env: environment of the Slurm commands (``SLURM_CONF`` picks the cluster; default: this process's).
        timeout_s: seconds one command may take.
        interval_s: seconds between probes (the fleet's reading thread keeps to it).
    """

    def __init__(self, env: Optional[Mapping[str, str]] = None, *, timeout_s: float = 5.0,
                 interval_s: float = 2.0) -> None:
        self.env = dict(env) if env is not None else None
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self._cluster: Optional[str] = None
        self.probes = 0  # probes that answered (for status displays and tests)
        self.failures = 0

    @classmethod
    def auto(cls, env: Optional[Mapping[str, str]] = None, **kwargs) -> Optional["SlurmProbe"]:
        """A probe when ``squeue`` and ``scontrol`` are on ``PATH``, else None."""
        path = (env or os.environ).get("PATH")
        if shutil.which("squeue", path=path) is None or shutil.which("scontrol", path=path) is None:
            return None
        return cls(env, **kwargs)

    def _run(self, *argv: str) -> Optional[subprocess.CompletedProcess]:
        try:
            return subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=self.timeout_s)
        except (OSError, subprocess.SubprocessError) as e:
            self.failures += 1
            log.debug("slurm probe: %s failed: %r", argv[0], e)
            return None

    def cluster(self) -> Optional[str]:
        """This controller's ``ClusterName`` (``scontrol show config``; cached once known), or None."""
        if self._cluster is None:
            r = self._run("scontrol", "show", "config")
            if r is not None and r.returncode == 0:
                for line in r.stdout.splitlines():
                    key, _, value = line.partition("=")
                    if key.strip() == "ClusterName" and value.strip():
                        self._cluster = value.strip()
                        break
        return self._cluster

    def dead(self, members: Iterable[tuple[str, Optional[str], Optional[str], Optional[str]]]) -> set[str]:
        """The ids of the members whose job or step Slurm says has ended.

        Args:
            members: ``(member_id, cluster, job_id, step_id)``; those with no job, or of another cluster, are
                skipped.
        Returns:
            a subset of the member ids; empty whenever Slurm could not tell (module docstring).
        """
        cluster = self.cluster()
        if cluster is None:
            return set()
        ours = [(mid, str(job), None if step is None else str(step)) for mid, c, job, step in members
                if job and c == cluster]
        if not ours:
            return set()
        jobs = sorted({job for _, job, _ in ours})
        r = self._run("squeue", "--noheader", "--format=%i %T", f"--jobs={','.join(jobs)}")
        if r is None or r.returncode != 0:  # every id unknown, or Slurm unreachable: cannot tell
            if r is not None:
                self.failures += 1
            return set()
        alive_jobs = set()
        for line in r.stdout.splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[1] in ALIVE_STATES:
                alive_jobs.add(parts[0])
        steps: Optional[set[str]] = None
        if alive_jobs:
            r = self._run("squeue", "--noheader", "--steps", "--format=%i", f"--jobs={','.join(sorted(alive_jobs))}")
            if r is not None and r.returncode == 0:
                steps = {line.strip() for line in r.stdout.splitlines() if line.strip()}
        self.probes += 1
        return {mid for mid, job, step in ours
                if job not in alive_jobs
                or (steps is not None and step is not None and step.isdigit() and f"{job}.{step}" not in steps)}
