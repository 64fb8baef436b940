"""``sbatch slurm/launch_rollout.sh`` on a REAL single-node Slurm (see conftest.py): the server comes up, is
listed in servers.json, serves a job, and after ``scancel`` (or the time limit) nothing of it is left."""
from __future__ import annotations

import json
import shutil
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from trainer_plugins.servers import wait_for_servers

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "slurm" / "launch_rollout.sh"
FAKE_VLLM = Path(__file__).resolve().parent / "fake_vllm.py"

pytestmark = pytest.mark.real

ARITHMETIC = {"instance": {"data_source": "arithmetic", "expression": "2+3", "answer": 5}, "sampling_params": {}}


def server_cmd() -> str:
    """The installed ``prorl-server`` console script next to this interpreter (else the module)."""
    exe = Path(sys.executable).parent / "prorl-server"
    return str(exe) if exe.exists() else f"{sys.executable} -m prorl_server"


def launch_env(cluster, servers_dir: Path, **extra: str) -> dict:
    env = dict(cluster.env)
    env.update(
        PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}",
        PYTHONPATH=f"{REPO}:{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(REPO),
        PRORL_SERVERS_DIR=str(servers_dir),
        PRORL_HOST="127.0.0.1",  # tests send traffic to loopback only
        PRORL_PYTHON=sys.executable,
        PRORL_SERVER_CMD=server_cmd(),
        PRORL_STARTUP_TIMEOUT="120",
    )
    env.pop("PRORL_TOKEN", None)
    env.update(extra)
    return env


def submit(cluster, servers_dir: Path, *sbatch_args: str, **env_extra: str) -> str:
    r = cluster.run("sbatch", "--parsable", f"--output={servers_dir}/job-%j.out", *sbatch_args, str(LAUNCHER),
                    env=launch_env(cluster, servers_dir, **env_extra))
    return r.stdout.strip().split(";")[0]


def post(url: str, body: dict, token: str | None, timeout: float = 30) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def get(url: str, token: str | None, timeout: float = 10) -> dict:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def job_processes(job_id: str) -> dict[int, float]:
    """Every process on this machine that belongs to the Slurm job, as ``{pid: create_time}``.

    Found by the ``SLURM_JOB_ID`` that Slurm puts in each job process's environment (inherited by the server,
    its sandboxes and anything they daemonize), so an escaped process is found whatever proctrack plugin is in
    use. Read-only: nothing is ever signalled by this lookup.
    """
    found = {}
    for p in psutil.process_iter(["pid", "create_time"]):
        try:
            if p.environ().get("SLURM_JOB_ID") == job_id:
                found[p.pid] = p.info["create_time"]
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def still_alive(procs: dict[int, float]) -> list[str]:
    alive = []
    for pid, created in procs.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{pid} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            continue
    return alive


def wait_ready(cluster, servers_dir: Path, job_id: str, timeout: float = 120):
    """servers.json of the job, once it appears; fails at once (with the logs) when the job ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return wait_for_servers(servers_dir / "servers.json", timeout_s=1.0, poll_s=0.1, job_id=job_id)
        except TimeoutError:
            if cluster.job_state(job_id) not in ("PENDING", "CONFIGURING", "RUNNING"):
                break
    out = servers_dir / f"job-{job_id}.out"
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                     for p in sorted(servers_dir.glob(f"prorl-{job_id}/*.log")))
    pytest.fail(f"job {job_id} ({cluster.job_state(job_id)}) wrote no servers.json\n"
                f"--- job output\n{out.read_text() if out.exists() else '(none)'}\n{logs}\n"
                f"--- slurmd log\n{cluster.log_tail()}")


def job_output(servers_dir: Path, job_id: str) -> str:
    return (servers_dir / f"job-{job_id}.out").read_text(errors="replace")


def assert_stopped_cleanly(cluster, servers_dir: Path, job_id: str, procs: dict[int, float]) -> None:
    out = job_output(servers_dir, job_id)
    node_log = (servers_dir / f"prorl-{job_id}" / f"{cluster.node}.log").read_text(errors="replace")
    # The server handled SIGTERM itself (exit 0) instead of being SIGKILLed after the grace period.
    assert f"server step on {cluster.node} exited rc=0" in out, out
    assert "prorl-server exited rc=0" in node_log, node_log
    assert "SIGKILL" not in node_log, node_log
    assert not (servers_dir / "servers.json").exists(), "servers.json of a stopped job was left for trainers"
    deadline = time.monotonic() + 10  # slurmstepd reaps the last processes just after the state flips
    while (alive := still_alive(procs)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, f"processes of job {job_id} outlived it: {alive}"
    assert not job_processes(job_id), f"processes with SLURM_JOB_ID={job_id} remain: {job_processes(job_id)}"


def test_sbatch_serves_a_job_then_scancel_leaves_no_process(slurm_cluster, tmp_path):
    job_id = submit(slurm_cluster, tmp_path)
    try:
        sf = wait_ready(slurm_cluster, tmp_path, job_id)
        assert sf.job_id == job_id and len(sf.servers) == 1
        assert (tmp_path / "servers.json").stat().st_mode & 0o077 == 0, "servers.json holding the token is readable by others"
        server = sf.ordered(slurm_cluster.node)[0]
        assert server.node == slurm_cluster.node
        assert sf.token and len(sf.token) >= 32

        status, _ = post(f"{server.url}/process", ARITHMETIC, token=None)
        assert status == 401, "the launched server accepted a job without the job's bearer token"
        status, result = post(f"{server.url}/process", ARITHMETIC, token=sf.token)
        assert status == 200, result
        assert result["reward"] == 1.0 and result["critical_error"] is None, result

        procs = job_processes(job_id)
        assert server.pid in procs, f"server pid {server.pid} not among the job's processes {sorted(procs)}"
    finally:
        slurm_cluster.run("scancel", job_id, check=False)
    state = slurm_cluster.wait_job_done(job_id, timeout=60)
    assert state == "CANCELLED", state
    assert_stopped_cleanly(slurm_cluster, tmp_path, job_id, procs)
    assert "stopping (SIGTERM)" in job_output(tmp_path, job_id)


def test_server_that_cannot_start_fails_the_job_fast_and_writes_no_servers_json(slurm_cluster, tmp_path):
    job_id = submit(slurm_cluster, tmp_path, PRORL_SERVER_ARGS="--no-such-flag")
    state = slurm_cluster.wait_job_done(job_id, timeout=60)
    assert state == "FAILED", state
    out = job_output(tmp_path, job_id)
    assert "ended before it was ready" in out, out
    assert "--no-such-flag" in out, "the job output does not show the server's own error"
    assert not (tmp_path / "servers.json").exists()
    assert not job_processes(job_id)


def test_vllm_servers_are_started_and_registered_before_servers_json_appears(slurm_cluster, tmp_path):
    job_id = submit(slurm_cluster, tmp_path, PRORL_VLLM_MODEL="tiny-model", PRORL_VLLM_CPU="1",
                    PRORL_VLLM_CMD=f"{sys.executable} {FAKE_VLLM}")
    try:
        sf = wait_ready(slurm_cluster, tmp_path, job_id)
        server = sf.servers[0]
        assert len(server.llm_backends) == 1, sf
        backend = server.llm_backends[0]
        assert backend.startswith("http://127.0.0.1:")
        status = get(f"{server.url}/status", sf.token)
        # registered with a version (the launcher's default 0), never without one
        assert [b["weight_version"] for b in status["backends"] if b["address"] == backend] == [0], status
        procs = job_processes(job_id)
    finally:
        slurm_cluster.run("scancel", job_id, check=False)
    slurm_cluster.wait_job_done(job_id, timeout=60)
    assert_stopped_cleanly(slurm_cluster, tmp_path, job_id, procs)


def test_training_setup_starts_no_vllm_and_leaves_the_backends_to_the_trainer(slurm_cluster, tmp_path):
    # the trainer's own servers are the backends: the launcher starts and registers nothing, even with a vLLM
    # command at hand
    job_id = submit(slurm_cluster, tmp_path, PRORL_BACKENDS="trainer", PRORL_VLLM_CPU="1",
                    PRORL_VLLM_CMD=f"{sys.executable} {FAKE_VLLM}")
    try:
        sf = wait_ready(slurm_cluster, tmp_path, job_id)
        server = sf.servers[0]
        assert server.llm_backends == (), sf
        assert get(f"{server.url}/status", sf.token)["backends"] == []
        assert "backends: trainer (training)" in job_output(tmp_path, job_id)
        assert not list((tmp_path / f"prorl-{job_id}").glob("*.vllm-*.log"))
        procs = job_processes(job_id)
    finally:
        slurm_cluster.run("scancel", job_id, check=False)
    slurm_cluster.wait_job_done(job_id, timeout=60)
    assert_stopped_cleanly(slurm_cluster, tmp_path, job_id, procs)


@pytest.mark.skipif(os.environ.get("PRORL_SLOW_TESTS") == "0", reason="PRORL_SLOW_TESTS=0: time-limit test off")
def test_time_limit_stops_servers_before_slurm_kills_them(slurm_cluster, tmp_path):
    # slurmctld checks time limits every 30 s (PERIODIC_TIMEOUT) and sends the warning signal at the first
    # check with now + warn + 30 >= end: with --time=1 --signal=B:USR1@5 that is 25-55 s after the start,
    # safely after the servers are up and before the hard limit (60-90 s). The launcher then stops the servers
    # itself and the job ends. (The script's default, USR1@120, gives real jobs 2-2.5 minutes of notice.)
    job_id = submit(slurm_cluster, tmp_path, "--time=1", "--signal=B:USR1@5")
    try:
        wait_ready(slurm_cluster, tmp_path, job_id)
        procs = job_processes(job_id)
        state = slurm_cluster.wait_job_done(job_id, timeout=150)
    finally:
        slurm_cluster.run("scancel", job_id, check=False)
    assert "stopping (SIGUSR1: time limit near)" in job_output(tmp_path, job_id), job_output(tmp_path, job_id)
    assert state in ("COMPLETED", "TIMEOUT"), state
    assert_stopped_cleanly(slurm_cluster, tmp_path, job_id, procs)


def test_server_that_dies_mid_job_ends_the_job_and_withdraws_servers_json(slurm_cluster, tmp_path):
    job_id = submit(slurm_cluster, tmp_path)
    try:
        sf = wait_ready(slurm_cluster, tmp_path, job_id)
        procs = job_processes(job_id)
        os.kill(sf.servers[0].pid, 9)  # the server this job started, by its recorded pid
        state = slurm_cluster.wait_job_done(job_id, timeout=60)
    finally:
        slurm_cluster.run("scancel", job_id, check=False)
    assert state == "FAILED", state
    out = job_output(tmp_path, job_id)
    assert f"server step on {slurm_cluster.node} ended while the job runs" in out, out
    assert not (tmp_path / "servers.json").exists(), "trainers were left pointing at a dead server"
    deadline = time.monotonic() + 10
    while (alive := still_alive(procs)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive


def test_two_node_job_runs_one_server_per_node_and_scancel_stops_both(slurm_cluster_2nodes, tmp_path):
    cluster = slurm_cluster_2nodes
    job_id = submit(cluster, tmp_path, "--nodes=2")
    try:
        sf = wait_ready(cluster, tmp_path, job_id)
        assert sorted(s.node for s in sf.servers) == sorted(cluster.nodes), sf
        assert len({s.pid for s in sf.servers}) == 2 and len({s.port for s in sf.servers}) == 2
        second = cluster.nodes[1]
        assert sf.ordered(second)[0].node == second, "a trainer on node 2 is not sent to its own node first"
        for server in sf.servers:
            status, result = post(f"{server.url}/process", ARITHMETIC, token=sf.token)
            assert status == 200 and result["reward"] == 1.0, (server, result)
        procs = job_processes(job_id)
    finally:
        cluster.run("scancel", job_id, check=False)
    cluster.wait_job_done(job_id, timeout=60)
    out = job_output(tmp_path, job_id)
    for node in cluster.nodes:
        assert f"server step on {node} exited rc=0" in out, out
    assert not (tmp_path / "servers.json").exists()
    deadline = time.monotonic() + 10
    while (alive := still_alive(procs)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, alive


CODE_INSTANCE = {"data_source": "code", "prompt": "def add(a, b):\n", "entry_point": "add",
                 "tests": "def check(candidate):\n    assert candidate(2, 3) == 5\n"}


def server_tree(pid: int) -> dict[int, float]:
    """The server and every descendant (its sandboxes' launchers and what runs inside), ``{pid: create_time}``."""
    root = psutil.Process(pid)
    return {p.pid: p.create_time() for p in [root, *root.children(recursive=True)]}


def test_scancel_mid_job_closes_the_open_sandbox_and_leaves_no_process(slurm_cluster, tmp_path, tiny_model_dir):
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is part of the project's set-up (.ci/install) but `bwrap` is not on PATH")
    # The model never answers, so the code job sits in its run stage with its sandbox open when scancel comes.
    job_id = submit(slurm_cluster, tmp_path, PRORL_SANDBOX_RUNTIME="bubblewrap", PRORL_VLLM_MODEL=str(tiny_model_dir),
                    PRORL_VLLM_CPU="1", PRORL_VLLM_CMD=f"{sys.executable} {FAKE_VLLM}",
                    PRORL_VLLM_ARGS="--hang-completions")
    try:
        sf = wait_ready(slurm_cluster, tmp_path, job_id)
        server = sf.servers[0]
        status, submitted = post(f"{server.url}/jobs", {"instance": CODE_INSTANCE, "sampling_params": {}}, sf.token)
        assert status == 202, submitted
        job_url = f"{server.url}/jobs/{submitted['job_id']}"
        deadline = time.monotonic() + 60
        while (status_doc := get(job_url, sf.token))["state"] != "run":
            assert status_doc["state"] != "done" and time.monotonic() < deadline, f"job never reached run: {status_doc}"
            time.sleep(0.2)
        time.sleep(1.0)  # the agent loop is now waiting on the model, inside an open sandbox
        procs = {**job_processes(job_id), **server_tree(server.pid)}
        sandbox = [pid for pid in procs if "bwrap" in " ".join(psutil.Process(pid).cmdline())]
        assert sandbox, "no bubblewrap sandbox was running: this test would prove nothing"
    finally:
        slurm_cluster.run("scancel", job_id, check=False)
    slurm_cluster.wait_job_done(job_id, timeout=60)
    assert_stopped_cleanly(slurm_cluster, tmp_path, job_id, procs)


def test_vllm_servers_split_the_node_gpus_into_tensor_parallel_groups(slurm_cluster, tmp_path):
    # A node with 4 GPUs as Slurm exposes them (CUDA_VISIBLE_DEVICES); 2 GPUs per vLLM server -> 2 servers.
    job_id = submit(slurm_cluster, tmp_path, CUDA_VISIBLE_DEVICES="0,1,2,3", PRORL_VLLM_MODEL="tiny-model",
                    PRORL_VLLM_GPUS_PER_SERVER="2", PRORL_VLLM_CMD=f"{sys.executable} {FAKE_VLLM}")
    try:
        sf = wait_ready(slurm_cluster, tmp_path, job_id)
        assert len(sf.servers[0].llm_backends) == 2, sf
        logs = sorted(p.read_text() for p in (tmp_path / f"prorl-{job_id}").glob("*.vllm-*.log"))
        assert len(logs) == 2
        assert sorted(line.split(" devices=")[1].strip() for line in logs) == ["0,1 tp=2", "2,3 tp=2"], logs
        procs = job_processes(job_id)
    finally:
        slurm_cluster.run("scancel", job_id, check=False)
    slurm_cluster.wait_job_done(job_id, timeout=60)
    assert_stopped_cleanly(slurm_cluster, tmp_path, job_id, procs)
