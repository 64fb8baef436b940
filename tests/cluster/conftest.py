"""Fixtures of the cluster tier: a REAL single-node Slurm (slurmctld + slurmd + munged on this machine).

A multi-node variant (two slurmd daemons on this one machine) tests launches across nodes.
The cluster is started once per session by ``.ci/slurm/cluster.sh start`` (idempotent: daemons left running
by an earlier session are reused) and stopped at the end only if this session started it. When the Slurm
commands are missing, the fixture runs ``.ci/install-slurm.sh``; it skips, printing why, only when the
packages cannot be installed (not root, no apt). Once installed, a cluster that does not come up is a
failure, not a skip.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SH = REPO / ".ci" / "slurm" / "cluster.sh"
INSTALL_SH = REPO / ".ci" / "install-slurm.sh"
SLURM_COMMANDS = ("sbatch", "srun", "scancel", "squeue", "sinfo", "scontrol", "slurmctld", "slurmd", "munged")


# Slurm's final job states (squeue(1), "JOB STATE CODES"); every other state is on the way to one of them.
FINAL_JOB_STATES = frozenset({"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
                              "OUT_OF_MEMORY", "PREEMPTED", "REVOKED", "TIMEOUT"})


@dataclass(frozen=True)
class SlurmCluster:
    """A running single-node cluster. ``env`` is ``os.environ`` plus ``SLURM_CONF`` for client commands."""

    state_dir: Path
    conf: Path
    node: str               # the first node
    env: dict
    nodes: tuple[str, ...] = ()

    def run(self, *argv: str, timeout: float = 30, check: bool = True, env: dict | None = None):
        return subprocess.run(list(argv), env=env or self.env, capture_output=True, text=True,
                              timeout=timeout, check=check)

    def job_state(self, job_id: str) -> str:
        """``RUNNING``, ``PENDING``, ``COMPLETED``, ``CANCELLED``, ... or ``""`` once the controller forgot it."""
        r = self.run("scontrol", "show", "job", job_id, "-o", check=False)
        for field in r.stdout.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return ""

    def wait_job_done(self, job_id: str, timeout: float) -> str:
        """Wait until the job reached a final state (or the controller forgot it: ``""``); return it.
        Transient states (RUNNING, COMPLETING, SIGNALING while a --signal is delivered, STAGE_OUT, ...) are
        waited through: only Slurm's final states end the wait."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in FINAL_JOB_STATES or state == "":
                return state
            time.sleep(0.3)
        raise AssertionError(f"job {job_id} still {self.job_state(job_id)} after {timeout:g} s")

    def log_tail(self, name: str = "", lines: int = 30) -> str:
        """Last lines of a daemon log (default: the first node's slurmd)."""
        name = name or f"slurmd-{self.node}.log"
        p = self.state_dir / "log" / name
        return "\n".join(p.read_text(errors="replace").splitlines()[-lines:]) if p.exists() else f"(no {p})"


def _ensure_slurm_installed() -> None:
    missing = [c for c in SLURM_COMMANDS if shutil.which(c) is None]
    if not missing:
        return
    if os.geteuid() != 0:
        pytest.skip(f"Slurm tier: {', '.join(missing)} not installed and not root to run {INSTALL_SH}")
    if shutil.which("apt-get") is None:
        pytest.skip(f"Slurm tier: {', '.join(missing)} not installed and no apt-get on this machine")
    r = subprocess.run(["bash", str(INSTALL_SH)], capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        pytest.skip(f"Slurm tier: the Slurm packages cannot be installed here:\n{r.stdout[-1500:]}"
                    f"\n{r.stderr[-1500:]}")
    print(r.stdout, file=sys.stderr)


def _start_cluster(state_dir: Path, **settings: str):
    """Start (or reuse) the cluster of ``state_dir``; yields it; stops it after if this call started it."""
    _ensure_slurm_installed()
    if os.geteuid() != 0:
        pytest.skip("Slurm tier: the test cluster runs its daemons as root (SlurmUser=root)")
    env = dict(os.environ, PRORL_SLURM_DIR=str(state_dir), SLURM_CONF=str(state_dir / "slurm.conf"), **settings)
    was_up = subprocess.run(["bash", str(CLUSTER_SH), "status"], env=env, capture_output=True).returncode == 0
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(CLUSTER_SH), "start"], env=env, capture_output=True, text=True, timeout=180)
    host = socket.gethostname().split(".")[0]
    n = int(settings.get("PRORL_SLURM_NODES", "1"))
    nodes = (host,) if n == 1 else tuple(f"{host}-{i}" for i in range(1, n + 1))
    cluster = SlurmCluster(state_dir, state_dir / "slurm.conf", nodes[0], env, nodes)
    if r.returncode != 0:
        pytest.fail(f"the Slurm packages are installed but the test cluster did not start:\n{r.stderr}\n"
                    f"--- slurmctld.log\n{cluster.log_tail('slurmctld.log')}\n"
                    f"--- slurmd.log\n{cluster.log_tail(f'slurmd-{nodes[0]}.log')}")
    print(f"slurm test cluster {'reused' if was_up else 'started'} in {time.monotonic() - t0:.1f} s: "
          f"{r.stderr.strip().splitlines()[-1]}", file=sys.stderr)
    yield cluster
    if not was_up:
        subprocess.run(["bash", str(CLUSTER_SH), "stop"], env=env, capture_output=True, timeout=120)


@pytest.fixture(scope="session")
def slurm_cluster() -> SlurmCluster:
    """One node named ``hostname -s`` (the cluster the issue describes)."""
    yield from _start_cluster(Path(os.environ.get("PRORL_SLURM_DIR", "/var/tmp/prorl-slurm")))


@pytest.fixture(scope="session")
def slurm_cluster_2nodes() -> SlurmCluster:
    """Two nodes ``<host>-1``, ``<host>-2``: two slurmd daemons on this machine, on other ports than the
    single-node cluster, so that both can run side by side."""
    yield from _start_cluster(Path("/var/tmp/prorl-slurm-2n"), PRORL_SLURM_NODES="2",
                              PRORL_SLURM_CTLD_PORT="6827", PRORL_SLURM_SLURMD_PORT="6828")
