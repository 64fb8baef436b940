#!/usr/bin/env bash
# verl 0.9.1 trains through the ProRL plugin on ONE GPU, for a few steps, with nothing downloaded:
#
#   bash trainer_plugins/verl/examples/run_gpu.sh            # from the repository root, in the project's venv
#   STEPS=5 OUT=/tmp/prorl-verl bash trainer_plugins/verl/examples/run_gpu.sh
#   DRY_RUN=1 bash trainer_plugins/verl/examples/run_gpu.sh  # compose and print verl's config (--cfg job), run nothing
#
# What it does:
#   1. builds the tiny random Qwen2 model locally (prorl_server/dev/tiny_model.py; no download) unless MODEL is set;
#   2. writes a parquet dataset of `math` problems ("What is 17 + 25?", answer 42) in verl's RLHFDataset format,
#      each row carrying its rollout-server instance in extra_info.instance;
#   3. starts a rollout server on loopback with NO backend of its own (what `slurm/launch_rollout.sh --no-vllm`
#      does on a cluster), with bubblewrap sandboxes (SANDBOX_RUNTIME) and the tokenizer given explicitly;
#   4. runs `python -m verl.trainer.main_ppo` with trainer_plugins/verl/config/prorl_dapo.yaml (async DAPO, V1
#      colocate_async trainer): verl starts its vLLM replica on the GPU; each agent loop worker's relay registers
#      it with the rollout server at the trainer's step (no manual registration) and every turn comes back
#      with the version of the weights that generated it.
#   5. prints the lines to look at: the relay's version changes, and verl's per-step reward and
#      staleness metrics (log in $OUT/verl.log, rollout server log in $OUT/server.log).
#
# A random model solves nothing, so every group has equal (zero) rewards: DAPO's group filter is switched off
# here (algorithm.filter_groups.enable=false), or every batch would be filtered out. Point MODEL at a real
# instruction model (and raise the lengths) to see reward move.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${OUT:-$ROOT/out/verl-gpu}
STEPS=${STEPS:-3}
N=${N:-4}                    # samples per prompt (GRPO group)
BATCH=${BATCH:-4}            # prompts per step
PROMPT_LEN=${PROMPT_LEN:-256}
RESPONSE_LEN=${RESPONSE_LEN:-128}
DRY_RUN=${DRY_RUN:-0}
mkdir -p "$OUT"
# A real run needs verl's GPU stack; the project's venv (.ci/install) holds the CPU torch build, where verl would
# fail much later and less clearly. DRY_RUN only composes the config and runs anywhere.
if [ "$DRY_RUN" != 1 ] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "run_gpu.sh: $PY has no CUDA torch ($("$PY" -c 'import torch; print("torch", torch.__version__)' 2>&1 | tail -1))." >&2
    echo "  Install verl 0.9.1's GPU stack in its own venv (docs/training-verl.md, \"GPU install\") and run with" >&2
    echo "  PYTHON=/path/to/that/venv/bin/python; on this CPU venv use run_cpu.sh." >&2
    exit 2
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"   # Ray workers import trainer_plugins from here
export HF_HUB_OFFLINE=1
# verl loads this module in every process; its patches that are not about the CPU (verl's TRL value-head import,
# which fails with TRL 1.x) apply here too; its CPU platform is chosen only with VERL_PLATFORM=cpu (run_cpu.sh)
export VERL_USE_EXTERNAL_MODULES=trainer_plugins.verl.cpu_platform
SANDBOX_RUNTIME=${SANDBOX_RUNTIME:-bubblewrap}   # the math handler runs its tools in a sandbox

# 1. model
MODEL=${MODEL:-$("$PY" -c 'import sys; from prorl_server.dev.tiny_model import build; print(build(sys.argv[1]))' \
    "$ROOT/.cache/tiny-model")}
echo "model: $MODEL"

# 2. data: math instances the `math` handler scores with math-verify
"$PY" - "$OUT" <<'PY'
import random, sys
import pandas as pd
out = sys.argv[1]
def rows(n, seed):
    rng = random.Random(seed)
    for i in range(n):
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        q = f"What is {a} + {b}? Put the final answer in \\boxed{{}}."
        yield {"data_source": "math", "agent_name": "prorl",
               "prompt": [{"role": "user", "content": q}],
               "reward_model": {"style": "rule", "ground_truth": str(a + b)},
               "extra_info": {"index": i, "instance": {"data_source": "math", "question": q, "answer": str(a + b),
                                                       "max_turns": 1}}}
pd.DataFrame(list(rows(256, 0))).to_parquet(f"{out}/train.parquet")
pd.DataFrame(list(rows(16, 1))).to_parquet(f"{out}/val.parquet")
print(f"data: {out}/train.parquet (256 rows), {out}/val.parquet (16 rows)")
PY

VERL_ARGS=(
    --config-path "$ROOT/trainer_plugins/verl/config" --config-name prorl_dapo
    actor_rollout_ref.model.path="$MODEL"
    actor_rollout_ref.rollout.agent.num_workers=1
    data.train_files="$OUT/train.parquet" data.val_files="$OUT/val.parquet"
    data.train_batch_size="$BATCH" data.max_prompt_length="$PROMPT_LEN" data.max_response_length="$RESPONSE_LEN"
    actor_rollout_ref.rollout.prompt_length="$PROMPT_LEN" actor_rollout_ref.rollout.response_length="$RESPONSE_LEN"
    actor_rollout_ref.rollout.n="$N"
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.4
    actor_rollout_ref.actor.ppo_mini_batch_size="$BATCH"
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu="$N"
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu="$N"
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu="$N"
    algorithm.filter_groups.enable=false
    trainer.n_gpus_per_node=1 trainer.nnodes=1
    trainer.total_training_steps="$STEPS"
    trainer.val_before_train=false trainer.test_freq=-1 trainer.save_freq=-1
    trainer.logger='[console]'
    trainer.project_name=prorl trainer.experiment_name=run_gpu
    trainer.default_local_dir="$OUT/checkpoints"
    hydra.run.dir="$OUT/hydra"
    # the tokenizer's location the rollout servers load (reported by the relay), and the relay's version lines
    prorl.tokenizer_path="$MODEL" prorl.log_level=INFO
)

if [ "$DRY_RUN" = 1 ]; then
    PRORL_SERVERS=http://127.0.0.1:1 "$PY" -m verl.trainer.main_ppo "${VERL_ARGS[@]}" --cfg job
    exit 0
fi

# 3. rollout server: loopback, no backend of its own; turns may wait out a training step in colocate_async
cat >"$OUT/server.yaml" <<YAML
llm_timeout_s: 3600
backend_wait_s: 600
YAML
rm -f "$OUT/server.ready.json"
"$PY" -m prorl_server --config "$OUT/server.yaml" --host 127.0.0.1 --port 0 --sandbox-runtime "$SANDBOX_RUNTIME" \
    --tokenizer "$MODEL" --ready-file "$OUT/server.ready.json" >"$OUT/server.log" 2>&1 &
SERVER_PID=$!
trap 'kill -TERM "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null' EXIT
for _ in $(seq 600); do [ -s "$OUT/server.ready.json" ] && break; sleep 0.1; done
[ -s "$OUT/server.ready.json" ] || { echo "rollout server did not start; see $OUT/server.log" >&2; exit 1; }
export PRORL_SERVERS
PRORL_SERVERS=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["url"])' "$OUT/server.ready.json")
export PRORL_RELAY_HOST=127.0.0.1   # one machine: the relay and the rollout server meet on loopback
echo "rollout server: $PRORL_SERVERS (no backend until the trainer's relay registers)"

# 4. train
set +e
"$PY" -m verl.trainer.main_ppo "${VERL_ARGS[@]}" 2>&1 | tee "$OUT/verl.log"
rc=${PIPESTATUS[0]}
set -e

# 5. what to look at
echo "---- relay registrations and version changes"
grep -hoE "relay http[^ ]* (serves verl.*|weights v.*)" "$OUT/verl.log" || true
echo "---- per step: reward and weight-version staleness"
grep -hoE "step:[0-9]+|critic/score/mean:[-0-9.e]+|critic/rewards/mean:[-0-9.e]+|[a-z_/]*global_steps[a-z_/]*:[-0-9.e]+" \
    "$OUT/verl.log" | paste -sd' ' | sed 's/ step:/\nstep:/g' || true
echo "---- rollout server backends now"
curl -s "$PRORL_SERVERS/status" || true
echo
exit "$rc"
