"""Recipes are tests (issue #22 item 2): every ``bash`` block of the docs pages "Training with verl"
(``docs/training-verl.md``) and "Running on a cluster" (``docs/cluster.md``) runs as written, extracted from the
pages so the two cannot drift (issue #27 moved them out of the README); ``run_gpu.sh`` and
``run_cpu.sh`` compose verl's config (``DRY_RUN=1``; ``run_cpu.sh``'s real run is ``test_verl_cpu_run.py``).

What cannot run here is stood in for by a shell function of the same name, each saying what it stands for:
``sbatch`` (no Slurm in this tier: the launcher's own ``--dry-run`` plan of the job), ``python -m
verl.trainer.main_ppo`` (it needs a GPU: ``--cfg job`` composes and prints the config it would run, so every
override and config name is checked), ``prorl-build-image`` without ``--dry-run`` (no Apptainer here: its plan),
``source`` of the cluster's venv (this checkout's ``.venv`` is on PATH). ``/shared/`` paths go to a temporary
directory, ``/shared/models/my-model`` to the locally built tiny model. A block that installs packages
(``pip install``) is not run (``.ci/install`` does that).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("verl")
pytestmark = pytest.mark.real  # runs bash, the launcher and verl's main_ppo as processes (about a minute)

ROOT = Path(__file__).resolve().parents[2]
PAGES = {"Training with verl": ROOT / "docs" / "training-verl.md",
         "Running on a cluster": ROOT / "docs" / "cluster.md"}

STAND_INS = r'''
set -eo pipefail
export PATH="$ROOT/.venv/bin:$PATH"
sbatch() {  # stands in for Slurm: the launcher's own plan (--dry-run) of what the job would run
  while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do
    case "$1" in -N|-n|-t|-p|-A|-J|-o|-e|--gres|--cpus-per-task|--time|--nodes) shift 2 ;; *) shift ;; esac
  done
  bash "$@" --dry-run
}
python() {  # `python -m verl.trainer.main_ppo` needs a GPU here: compose and print the config it would run
  if [ "$1 $2" = "-m verl.trainer.main_ppo" ]; then "$ROOT/.venv/bin/python" "$@" --cfg job
  else "$ROOT/.venv/bin/python" "$@"; fi
}
prorl-build-image() {  # no Apptainer here: the plan of the build
  case " $* " in *" --dry-run "*) command prorl-build-image "$@" ;; *) command prorl-build-image "$@" --dry-run ;; esac
}
source() { :; }  # the cluster's venv: this checkout's .venv is on PATH
export DRY_RUN=1  # run_gpu.sh / run_cpu.sh: compose verl's config (run_cpu.sh runs for real in test_verl_cpu_run.py)
'''


def page(name: str) -> str:
    """The whole page titled ``name`` (its subsections included: the fleet's block is part of the cluster page)."""
    text = PAGES[name].read_text()
    assert text.startswith(f"# {name}\n"), f"{PAGES[name]} is not the page {name!r}"
    return text


def bash_blocks(name: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", page(name), re.S)


BLOCKS = [(name, i, block) for name in ("Training with verl", "Running on a cluster")
          for i, block in enumerate(bash_blocks(name))]


def test_the_sections_have_their_command_blocks():
    names = {name for name, _, _ in BLOCKS}
    assert names == {"Training with verl", "Running on a cluster"}
    assert any("verl.trainer.main_ppo" in b for _, _, b in BLOCKS)
    assert any("run_cpu.sh" in b for _, _, b in BLOCKS)


@pytest.mark.parametrize("name, index, block", BLOCKS, ids=[f"{n.split()[-1]}-{i}" for n, i, _ in BLOCKS])
def test_docs_block_runs_as_written(name, index, block, tmp_path, tiny_model_dir):
    if "pip install" in block:
        pytest.skip("installs packages (.ci/install does it)")
    script = block.replace("/shared/models/my-model", str(tiny_model_dir)).replace("/shared/", f"{tmp_path}/shared/")
    (tmp_path / "shared" / "run1").mkdir(parents=True)
    env = {**os.environ, "ROOT": str(ROOT), "OUT": str(tmp_path / "out"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(["bash", "-c", STAND_INS + "\n" + script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"docs block {name}[{index}] failed:\n{script}\n---\n{proc.stdout[-3000:]}" \
                                 f"\n{proc.stderr[-3000:]}"
    if "verl.trainer.main_ppo" in block:  # the composed config has the block's settings
        assert "servers: " + f"{tmp_path}/shared/run1/servers.json" in proc.stdout
        assert f"tokenizer_path: {tiny_model_dir}" in proc.stdout


@pytest.mark.parametrize("script", ["run_gpu.sh", "run_cpu.sh"])
def test_example_scripts_compose_verls_config(script, tmp_path):
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path)}
    proc = subprocess.run(["bash", str(ROOT / "trainer_plugins/verl/examples" / script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "trainer_mode: colocate_async" in proc.stdout and "default_agent_loop: prorl" in proc.stdout
    if script == "run_cpu.sh":
        assert "device: cpu" in proc.stdout and "param_dtype: fp32" in proc.stdout


def test_run_gpu_refuses_a_python_without_cuda_naming_the_install_page(tmp_path):
    """Issue #32 part 6: run_gpu.sh ran the project's CPU venv and failed deep inside verl; now a real run with a
    torch that has no CUDA stops at once (exit 2) and names the GPU install section (this machine has no GPU)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: run_gpu.sh runs")
    script = ROOT / "trainer_plugins" / "verl" / "examples" / "run_gpu.sh"
    out = subprocess.run(["bash", str(script)], env={**os.environ, "OUT": str(tmp_path), "DRY_RUN": "0"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "GPU install" in out.stderr and "docs/training-verl.md" in out.stderr
    assert "GPU install" in page("Training with verl")
    assert not (tmp_path / "server.log").exists()  # nothing started


TASK_RUNNER = r'''
import json, os, sys
from omegaconf import OmegaConf
import verl  # loads VERL_USE_EXTERNAL_MODULES, as verl's TaskRunner actor does on its node
from verl.utils.import_utils import resolve_config_path
config = OmegaConf.create(sys.argv[1])
OmegaConf.resolve(config)  # TaskRunner.run resolves the shipped config without Hydra
path = resolve_config_path(config.actor_rollout_ref.rollout.agent.agent_loop_config_path)
names = [entry.name for entry in OmegaConf.load(path)]  # what each AgentLoopWorker does with it
print(json.dumps({"path": path, "names": names}))
'''


@pytest.mark.parametrize("name", ["prorl_dapo", "prorl_cispo"])
def test_agent_loop_yaml_resolves_on_a_worker_whose_cwd_is_elsewhere(name, tmp_path):
    """Issue #32 part 6 (multi-node): the shipped configs named the agent loop YAML relative to the cwd, which on
    another node (or a Ray worker started elsewhere) is not the repository: verl's TaskRunner found no file. The
    config is composed by Hydra here (the driver) and resolved as verl's TaskRunner does, in a process with
    another cwd, no Hydra, and only the environment the shipped runtime_env gives every Ray worker."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from trainer_plugins.verl import CONFIG_DIR

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        config = compose(config_name=name)  # no override of agent_loop_config_path: the shipped value
    shipped = OmegaConf.to_yaml(config)  # unresolved, as main_ppo ships it to the TaskRunner
    worker_env = OmegaConf.to_container(config.ray_kwargs.ray_init.runtime_env.env_vars, resolve=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PRORL_", "VERL_"))}
    env.update({k: str(v) for k, v in worker_env.items()})
    env["PYTHONPATH"] = str(ROOT)  # the plugin is installed on every node (here: this checkout)
    proc = subprocess.run([str(ROOT / ".venv/bin/python"), "-c", TASK_RUNNER, shipped], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert os.path.isabs(found["path"]) and "prorl" in found["names"], found


# The verl command of "Training with verl" run for real on this CPU (issue #32 part 6: `--cfg job` only composes the
# config and cannot see a failure of verl's actor build). Each stand-in says what it stands for.
REAL_STAND_INS = r'''
set -eo pipefail
export PATH="$ROOT/.venv/bin:$PATH"
sbatch() {  # stands in for Slurm on one node: what launch_rollout.sh starts on each node (prorl-server on a free
            # port, the job's sandbox runtime, no vLLM) and the servers.json it writes once the server is healthy
  local run="$PRORL_SERVERS_DIR/prorl-recipe"
  mkdir -p "$run"
  prorl-server --host 127.0.0.1 --port 0 --sandbox-runtime "$PRORL_SANDBOX_RUNTIME" \
      --ready-file "$run/node0.ready.json" >"$run/node0.log" 2>&1 &
  SERVER_PID=$!
  trap 'kill -TERM "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null' EXIT
  for _ in $(seq 600); do [ -s "$run/node0.ready.json" ] && break; sleep 0.1; done
  python -m trainer_plugins.servers compose --run-dir "$run" --nodes node0 --job-id recipe --out "$PRORL_SERVERS_DIR"
}
python() {  # verl's main_ppo as written, plus the CPU platform's overrides (the CPU stands in for the GPU) and
            # the test's sizes (one step of 2 prompts x 4 samples, shout instances)
  if [ "$1 $2" = "-m verl.trainer.main_ppo" ]; then
    [ -n "$VERL_USE_EXTERNAL_MODULES" ] || { echo "the docs' command does not set VERL_USE_EXTERNAL_MODULES" >&2; return 3; }
    local documented=$VERL_USE_EXTERNAL_MODULES
    . "$ROOT/trainer_plugins/verl/examples/cpu_settings.sh"
    VERL_USE_EXTERNAL_MODULES=$documented "$ROOT/.venv/bin/python" "$@" "${CPU_ARGS[@]}" "${TEST_ARGS[@]}"
  else "$ROOT/.venv/bin/python" "$@"; fi
}
TEST_ARGS=(
  data.train_batch_size=2 data.max_prompt_length=128 data.max_response_length=96
  actor_rollout_ref.rollout.prompt_length=128 actor_rollout_ref.rollout.response_length=96
  actor_rollout_ref.rollout.n=4 actor_rollout_ref.actor.ppo_mini_batch_size=2
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4
  prorl.max_tokens=16 algorithm.filter_groups.metric=score
  trainer.total_training_steps=1 trainer.val_before_train=false trainer.test_freq=-1 trainer.save_freq=-1
  trainer.logger='[console]' trainer.default_local_dir="$OUT/checkpoints" hydra.run.dir="$OUT/hydra"
)
'''


@pytest.mark.verl_cpu
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="the documented rollout servers run bubblewrap sandboxes")
def test_docs_verl_command_builds_the_actor_and_trains_one_step(tmp_path, tiny_model_dir):
    """Issue #32 part 6: the docs' verl command as written (its environment, config and overrides; paths under
    /shared/ and the parquet files in a temporary directory) runs verl's main_ppo for real: the actor is built, the
    agent loop YAML found, the relay registered with a rollout server, and the first training step ends. Before,
    only ``--cfg job`` ran, which a missing VERL_USE_EXTERNAL_MODULES (an ImportError in the actor build with
    TRL 1.x) or an agent loop path relative to a worker's cwd passed. About 2 minutes on 2 cores."""
    pytest.importorskip("vllm")
    import pandas as pd

    from handlers.shout import load_dataset

    [block] = [b for name, _, b in BLOCKS if name == "Training with verl" and "verl.trainer.main_ppo" in b]
    for name, n, seed in (("train", 16, 0), ("val", 4, 1)):
        rows = [{"data_source": "shout", "agent_name": "prorl", "prompt": [{"role": "user", "content": i["prompt"]}],
                 "reward_model": {"style": "rule", "ground_truth": ""}, "extra_info": {"index": k, "instance": i}}
                for k, i in enumerate(load_dataset(limit=n, seed=seed))]
        pd.DataFrame(rows).to_parquet(tmp_path / f"{name}.parquet")
    script = (block.replace("/shared/models/my-model", str(tiny_model_dir)).replace("/shared/", f"{tmp_path}/shared/")
              .replace("=train.parquet", f"={tmp_path}/train.parquet").replace("=val.parquet", f"={tmp_path}/val.parquet"))
    assert f"{tmp_path}/train.parquet" in script, "the docs' command names no train.parquet"
    (tmp_path / "shared" / "run1").mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PRORL_", "VERL_"))}
    env.update({"ROOT": str(ROOT), "OUT": str(tmp_path / "out"), "PYTHONPATH": str(ROOT)})
    proc = subprocess.Popen(["bash", "-c", REAL_STAND_INS + "\n" + script], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=540)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        pytest.fail(f"the docs' verl command did not finish one step in 540 s:\n{out[-4000:]}")
    assert proc.returncode == 0, f"the docs' verl command failed:\n{script}\n---\n{out[-6000:]}"
    step = re.search(r"step:1 - (.*)", out)
    assert step and "critic/score/mean:" in step.group(1), out[-4000:]  # the actor was built and trained once
    # shout's two model turns per row: the rows came through the plugin's agent loop (the YAML was found) and a
    # rollout server, not verl's single-turn default
    assert re.search(r"num_turns/mean:(np\.float64\()?2\.0", step.group(1)), step.group(1)
