"""``slurm/launch_rollout.sh --dry-run`` shows the plan and starts nothing (no Slurm needed)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "slurm" / "launch_rollout.sh"


def run(*args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PRORL_"))}
    return subprocess.run(["bash", str(LAUNCHER), *args], capture_output=True, text=True, timeout=30,
                          env={**base, **env})


def test_dry_run_prints_overlapping_server_steps_on_free_ports_and_creates_nothing(tmp_path):
    r = run("--dry-run", PRORL_SERVERS_DIR=str(tmp_path), SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="n[1-2]")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    srun_line = next(line for line in out.splitlines() if line.strip().startswith("srun "))
    assert "--overlap" in srun_line, "a background server step without --overlap starves every later step"
    assert "prorl-server --host 0.0.0.0 --port 0 --ready-file" in out
    assert f"{tmp_path}/prorl-4242/<node>.ready.json" in out
    assert f"servers.json:      {tmp_path}/servers.json" in out
    assert "n[1-2]" in out and "#SBATCH --signal=B:USR1@120" in out
    assert list(tmp_path.iterdir()) == [], "the dry run created files"


def test_env_dry_run_switch_and_options_show_up_in_the_plan(tmp_path):
    r = run(PRORL_DRY_RUN="1", PRORL_SERVERS_DIR=str(tmp_path), PRORL_SANDBOX_RUNTIME="singularity",
            PRORL_SERVER_ARGS="--run-workers 64", PRORL_VLLM_MODEL="/models/qwen", PRORL_VLLM_GPUS_PER_SERVER="2")
    assert r.returncode == 0, r.stderr
    assert "--sandbox-runtime singularity --run-workers 64" in r.stdout
    assert "--model /models/qwen on each group of 2 GPU(s)" in r.stdout


def test_running_outside_a_job_refuses_and_points_to_sbatch_or_dry_run(tmp_path):
    r = run(PRORL_SERVERS_DIR=str(tmp_path))
    assert r.returncode == 2
    assert "not inside a Slurm job" in r.stderr and "--dry-run" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_unknown_argument_is_refused_instead_of_ignored():
    r = run("--nodes=4")
    assert r.returncode == 2 and "unknown argument --nodes=4" in r.stderr


def test_help_prints_the_documented_options():
    r = run("--help")
    assert r.returncode == 0
    for opt in ("PRORL_SERVERS_DIR", "PRORL_VLLM_MODEL", "PRORL_STOP_GRACE", "--dry-run", "--no-vllm",
                "--weight-version", "PRORL_BACKENDS", "PRORL_WEIGHT_VERSION"):
        assert opt in r.stdout


def test_training_setup_starts_no_vllm_the_trainer_registers_its_own_servers(tmp_path):
    for args, env in [(("--dry-run", "--no-vllm"), {}), (("--dry-run",), {"PRORL_BACKENDS": "trainer"}),
                      (("--dry-run",), {})]:  # with no model to serve, training is the default
        r = run(*args, PRORL_SERVERS_DIR=str(tmp_path), **env)
        assert r.returncode == 0, r.stderr
        assert "backends:          trainer (training): no vLLM here" in r.stdout, args
        assert "--model" not in r.stdout and "registered via POST /add_llm_server" not in r.stdout
    assert list(tmp_path.iterdir()) == []


def test_evaluation_setup_registers_its_vllm_with_a_weight_version_never_none(tmp_path):
    plans = {
        "default": run("--dry-run", PRORL_VLLM_MODEL="/models/qwen"),
        "flag": run("--dry-run", "--weight-version", "7", PRORL_VLLM_MODEL="/models/qwen"),
        "flag=": run("--dry-run", "--weight-version=8", PRORL_VLLM_MODEL="/models/qwen"),
        "env": run("--dry-run", PRORL_VLLM_MODEL="/models/qwen", PRORL_WEIGHT_VERSION="9", PRORL_BACKENDS="vllm"),
    }
    for (name, r), version in zip(plans.items(), (0, 7, 8, 9)):
        assert r.returncode == 0, (name, r.stderr)
        assert "backends:          vllm (evaluation)" in r.stdout
        assert f"registered via POST /add_llm_server with weight_version {version}" in r.stdout, name


def test_contradictory_or_malformed_backend_settings_are_refused_before_anything_starts(tmp_path):
    cases = [
        (("--dry-run", "--no-vllm"), {"PRORL_VLLM_MODEL": "/models/qwen"}, "starts no vLLM, but PRORL_VLLM_MODEL"),
        (("--dry-run",), {"PRORL_BACKENDS": "vllm"}, "needs PRORL_VLLM_MODEL"),
        (("--dry-run",), {"PRORL_BACKENDS": "sglang"}, "must be trainer or vllm"),
        (("--dry-run", "--weight-version", "-1"), {"PRORL_VLLM_MODEL": "/m"}, "integer >= 0, got '-1'"),
        (("--dry-run", "--weight-version=v2"), {"PRORL_VLLM_MODEL": "/m"}, "integer >= 0, got 'v2'"),
        (("--dry-run", "--weight-version"), {"PRORL_VLLM_MODEL": "/m"}, "--weight-version needs a value"),
    ]
    for args, env, needle in cases:
        r = run(*args, PRORL_SERVERS_DIR=str(tmp_path), **env)
        assert r.returncode == 2 and needle in r.stderr, (args, env, r.stderr)
    assert list(tmp_path.iterdir()) == []
