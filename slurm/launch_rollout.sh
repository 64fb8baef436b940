#!/usr/bin/env bash
#SBATCH --job-name=prorl-rollout
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=04:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --output=prorl-rollout-%j.out
#
# One ProRL rollout server per allocated node, for as long as the job runs.
#
#   sbatch [sbatch options] slurm/launch_rollout.sh          # submit
#   bash slurm/launch_rollout.sh --dry-run                   # print the plan, run nothing (also PRORL_DRY_RUN=1)
#   sbatch slurm/launch_rollout.sh --no-vllm                 # training: the trainer's servers are the backends
#   PRORL_VLLM_MODEL=/m sbatch --gres=gpu:8 slurm/launch_rollout.sh --weight-version 0   # evaluation
#
# Two set-ups (PRORL_BACKENDS, or the flags):
#   trainer (--no-vllm; the default when PRORL_VLLM_MODEL is unset): no vLLM here. The trainer's own
#       weight-synced inference servers are the backends: the verl plugin registers them with every server
#       (through its per-worker relay) with the trainer step as weight_version. Use this to train.
#   vllm (the default when PRORL_VLLM_MODEL is set): one vLLM per GPU group from a fixed model, registered
#       with weight_version PRORL_WEIGHT_VERSION (--weight-version N, default 0), never without one. For
#       evaluation; a verl trainer refuses rollout servers that serve backends without a version.
#
# What it does, in order:
#   1. generates a bearer token (or takes $PRORL_TOKEN) that every server of the job requires;
#   2. starts `prorl-server --port 0 --ready-file ...` on every node as a background `srun --overlap` step
#      (without --overlap the first background step holds the allocation and every later step waits);
#   3. in the vllm set-up, starts vLLM servers on each node's GPUs and registers them with that node's
#      server (POST /add_llm_server {address, weight_version});
#   4. waits until every server answers GET /health, then writes servers.json (URLs, token, node, job id)
#      atomically into $PRORL_SERVERS_DIR; trainers read it (python -m trainer_plugins.servers show DIR);
#   5. stays up until the job ends. On scancel, on the time limit, or on SIGUSR1 (sent by the
#      `--signal=B:USR1@120` default above, 2 to 2.5 minutes before the time limit: slurmctld checks every
#      30 s) it removes servers.json, stops the servers (they cancel their jobs and close their sandboxes)
#      and waits for them to exit. With a --time under ~3 minutes, lower the --signal lead time too.
#
# #SBATCH defaults above can be overridden on the sbatch command line (e.g. `sbatch -N 4 -t 12:00:00
# --cpus-per-task=64 --gres=gpu:8 slurm/launch_rollout.sh`). The servers use every CPU of their node.
#
# Options (environment variables; sbatch exports the submitting shell's environment):
#   PRORL_SERVERS_DIR      where servers.json and the per-job run directory go; must be visible from every
#                          node and from the trainer (a shared filesystem).      default: $SLURM_SUBMIT_DIR
#   PRORL_SERVER_CMD       the server command (word-split)                        default: prorl-server
#   PRORL_SERVER_ARGS      extra server flags (word-split), e.g. "--run-workers 64"      default: none
#   PRORL_CONFIG           server settings file (--config)                        default: none
#   PRORL_SANDBOX_RUNTIME  auto | bubblewrap | singularity | local | none (--sandbox-runtime)  default: auto
#   PRORL_HOST             bind address of each server                            default: 0.0.0.0
#   PRORL_ADVERTISE_HOST   address written to servers.json when PRORL_HOST is a wildcard
#                          default: the node's first address from `hostname -I`, else its host name
#   PRORL_PORT             server port                                            default: 0 (a free port)
#   PRORL_PROCESSES        server processes per node (--processes): each its own member on its own port
#                          (one event loop uses one core); 0 = one per CPU core           default: 1
#   PRORL_TOKEN            bearer token (passed to every server in the environment, never in argv)
#                                                                                 default: 32 random bytes, hex
#   PRORL_STARTUP_TIMEOUT  seconds to wait for every server (and vLLM) to be ready     default: 600
#   PRORL_STOP_GRACE       seconds servers get to exit after SIGTERM before SIGKILL    default: 25
#                          (keep it below the cluster's KillWait, 30 s by default)
#   PRORL_LOG_LEVEL        server log level                                       default: INFO
#   PRORL_PYTHON           python with this project installed (servers.json helper)    default: python3
#   PRORL_BACKENDS         trainer | vllm (see above)        default: vllm if PRORL_VLLM_MODEL is set, else trainer
#   PRORL_WEIGHT_VERSION   weight_version of the vLLM servers started here (an integer >= 0)      default: 0
#   PRORL_VLLM_MODEL       model path: start vLLM servers on the node's GPUs and register them    default: off
#   PRORL_VLLM_GPUS_PER_SERVER  GPUs per vLLM server (tensor parallel size)       default: 1
#   PRORL_VLLM_CMD         vLLM command (word-split)   default: $PRORL_PYTHON -m vllm.entrypoints.openai.api_server
#   PRORL_VLLM_ARGS        extra vLLM flags (word-split)                          default: none
#   PRORL_VLLM_CPU         1 = start one vLLM server on a node that has no GPU (CPU build of vLLM)  default: 0
#   PRORL_FLEET_DIR        a fleet directory (shared filesystem; see docs/cluster.md "A fleet that grows and shrinks"):
#                          each server process keeps a leased record there (trainers following the directory
#                          route to it within a poll), SIGTERM drains instead of cancelling (jobs held finish,
#                          up to PRORL_STOP_GRACE - 5 s), the fleet's token is $PRORL_FLEET_DIR/token (made by
#                          the first job, reused by later ones), and the job ends within seconds when the
#                          trainer writes $PRORL_FLEET_DIR/END.                         default: off
#   PRORL_FLEET_TTL_S      lease of each record, seconds (renewed every TTL/3)           default: 5
#   PRORL_DRY_RUN          1 = print the plan and exit (same as --dry-run)
#
# Files: $PRORL_SERVERS_DIR/servers.json (mode 0600: it holds the token) and
# $PRORL_SERVERS_DIR/prorl-<jobid>/ with each node's server log (<node>.log) and vLLM logs.
set -uo pipefail

log() { echo "[launch_rollout $(date +%H:%M:%S)] $*"; }

DRY_RUN=${PRORL_DRY_RUN:-0}
while [ "$#" -gt 0 ]; do
    arg=$1; shift
    case "$arg" in
        --dry-run) DRY_RUN=1 ;;
        --no-vllm) PRORL_BACKENDS=trainer ;;
        --weight-version=*) PRORL_WEIGHT_VERSION=${arg#*=} ;;
        --weight-version)
            [ "$#" -gt 0 ] || { echo "launch_rollout.sh: --weight-version needs a value" >&2; exit 2; }
            PRORL_WEIGHT_VERSION=$1; shift ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
        *) echo "launch_rollout.sh: unknown argument $arg (options are environment variables; see --help)" >&2
           exit 2 ;;
    esac
done

JOB_ID=${SLURM_JOB_ID:-}
SERVERS_DIR=${PRORL_SERVERS_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
SERVERS_FILE=$SERVERS_DIR/servers.json
RUN_DIR=$SERVERS_DIR/prorl-${JOB_ID:-<jobid>}
PY=${PRORL_PYTHON:-python3}
SERVER_CMD=${PRORL_SERVER_CMD:-prorl-server}
HOST=${PRORL_HOST:-0.0.0.0}
PORT=${PRORL_PORT:-0}
STARTUP_TIMEOUT=${PRORL_STARTUP_TIMEOUT:-600}
STOP_GRACE=${PRORL_STOP_GRACE:-25}
FLEET_DIR=${PRORL_FLEET_DIR:-}
DRAIN_S=$((STOP_GRACE > 6 ? STOP_GRACE - 5 : 1))
VLLM_MODEL=${PRORL_VLLM_MODEL:-}
BACKENDS=${PRORL_BACKENDS:-}
[ -z "$BACKENDS" ] && { [ -n "$VLLM_MODEL" ] && BACKENDS=vllm || BACKENDS=trainer; }
WEIGHT_VERSION=${PRORL_WEIGHT_VERSION:-0}
PROCESSES=${PRORL_PROCESSES:-1}
if ! [[ "$PROCESSES" =~ ^[0-9]+$ ]]; then
    echo "launch_rollout.sh: PRORL_PROCESSES must be an integer >= 0 (0: one per CPU core), got '$PROCESSES'" >&2
    exit 2
fi
case "$BACKENDS" in
    trainer) if [ -n "$VLLM_MODEL" ]; then
                 echo "launch_rollout.sh: --no-vllm / PRORL_BACKENDS=trainer starts no vLLM, but PRORL_VLLM_MODEL is" \
                      "set ($VLLM_MODEL); unset one of them" >&2
                 exit 2
             fi ;;
    vllm) if [ -z "$VLLM_MODEL" ]; then
              echo "launch_rollout.sh: PRORL_BACKENDS=vllm needs PRORL_VLLM_MODEL (the model to serve)" >&2
              exit 2
          fi ;;
    *) echo "launch_rollout.sh: PRORL_BACKENDS must be trainer or vllm, got '$BACKENDS'" >&2; exit 2 ;;
esac
if ! [[ "$WEIGHT_VERSION" =~ ^[0-9]+$ ]]; then
    echo "launch_rollout.sh: the weight version must be an integer >= 0, got '$WEIGHT_VERSION'" >&2
    exit 2
fi

server_args() {  # node -> the server's argv after $SERVER_CMD, one per line
    printf '%s\n' --host "$HOST" --port "$PORT" --ready-file "$RUN_DIR/$1.ready.json" \
        --log-level "${PRORL_LOG_LEVEL:-INFO}"
    [ -n "${PRORL_CONFIG:-}" ] && printf '%s\n' --config "$PRORL_CONFIG"
    [ -n "${PRORL_SANDBOX_RUNTIME:-}" ] && printf '%s\n' --sandbox-runtime "$PRORL_SANDBOX_RUNTIME"
    [ "$PROCESSES" != 1 ] && printf '%s\n' --processes "$PROCESSES"
    if [ -n "$FLEET_DIR" ]; then
        printf '%s\n' --fleet-dir "$FLEET_DIR" --drain-timeout-s "$DRAIN_S"
        [ -n "${PRORL_FLEET_TTL_S:-}" ] && printf '%s\n' --fleet-ttl-s "$PRORL_FLEET_TTL_S"
    fi
    # shellcheck disable=SC2086  # word-splitting of PRORL_SERVER_ARGS is the documented behaviour
    [ -n "${PRORL_SERVER_ARGS:-}" ] && printf '%s\n' ${PRORL_SERVER_ARGS}
    return 0
}

srun_args() {  # node -> srun flags of that node's server step
    # --overlap: share the allocation with later steps (vLLM, the trainer's own steps); no --exact, so the
    # step may use every CPU (and GPU) the job has on the node.
    printf '%s\n' --overlap --nodes=1 --ntasks=1 --nodelist="$1" --kill-on-bad-exit=0 --input=none \
        --output="$RUN_DIR/$1.log" --job-name=prorl-server
}

# ---------------------------------------------------------------------------------------------------------
# node_main runs on every node inside the server's srun step (written to $RUN_DIR/node.sh, which is why the
# run dir must be on a filesystem every node sees): it starts vLLM (optional) and the server, registers the
# vLLM servers, and on SIGTERM passes the signal on and waits for them to exit, SIGKILL after the grace.
node_main() {
    set -uo pipefail
    local node=${SLURMD_NODENAME:-$(hostname -s)} children=() vllm_urls=() pid
    nlog() { echo "[node $node $(date +%H:%M:%S)] $*"; }
    stop_children() {
        trap '' TERM INT USR1
        nlog "stopping: $1"
        local deadline=$((SECONDS + ${PRORL_STOP_GRACE:-25})) alive
        # Slurm may have signalled them already (same process group); a second SIGTERM is harmless.
        for pid in "${children[@]}"; do kill -TERM "$pid" 2>/dev/null; done
        while :; do
            alive=0; for pid in "${children[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
            [ "$alive" = 0 ] && break
            if [ "$SECONDS" -ge "$deadline" ]; then
                nlog "still running after ${PRORL_STOP_GRACE:-25} s: SIGKILL"
                for pid in "${children[@]}"; do kill -KILL "$pid" 2>/dev/null; done
                break
            fi
            sleep 0.2
        done
        wait "${children[0]}"; local rc=$?
        nlog "prorl-server exited rc=$rc"
        exit "$rc"
    }
    trap 'stop_children SIGTERM' TERM
    trap 'stop_children SIGINT' INT

    local adv=${PRORL_ADVERTISE_HOST:-}
    if [ -z "$adv" ]; then
        case "$PRORL_L_HOST" in
            0.0.0.0|::|"") adv=$(hostname -I 2>/dev/null | awk '{print $1}'); adv=${adv:-$(hostname -f)} ;;
            *) adv=$PRORL_L_HOST ;;
        esac
    fi
    echo "$adv" >"$PRORL_L_RUN_DIR/$node.advertise"
    export PRORL_ADVERTISE_HOST=$adv  # the address a fleet record gives (prorl-server --fleet-dir)

    local args=() line
    while IFS= read -r line; do args+=("${line//@NODE@/$node}"); done <<<"$PRORL_L_SERVER_ARGS"
    # shellcheck disable=SC2086
    $PRORL_L_SERVER_CMD "${args[@]}" &
    children+=("$!")
    nlog "prorl-server pid $! on $adv: $PRORL_L_SERVER_CMD ${args[*]}"

    if [ "${PRORL_L_BACKENDS:-}" = vllm ]; then
        local gpus=() per=${PRORL_VLLM_GPUS_PER_SERVER:-1} i vport group
        if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
            IFS=, read -r -a gpus <<<"$CUDA_VISIBLE_DEVICES"
        elif command -v nvidia-smi >/dev/null 2>&1; then
            mapfile -t gpus < <(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null)
        fi
        local groups=()
        for ((i = 0; i + per <= ${#gpus[@]}; i += per)); do
            groups+=("$(IFS=,; echo "${gpus[*]:i:per}")")
        done
        if [ "${#groups[@]}" = 0 ] && [ "${PRORL_VLLM_CPU:-0}" = 1 ]; then groups=("cpu"); fi
        [ "${#groups[@]}" = 0 ] && nlog "PRORL_VLLM_MODEL is set but this node has no GPU: no vLLM here"
        local vcmd=${PRORL_VLLM_CMD:-${PRORL_PYTHON:-python3} -m vllm.entrypoints.openai.api_server}
        # per-request metrics: each answer says how long the engine queued it, which the rollout server charges to
        # the system, not the model (docs/http-api.md, t_llm_s); vLLM refuses it beside --disable-log-stats
        local metrics=(--enable-per-request-metrics)
        case " ${PRORL_VLLM_ARGS:-} " in *" --disable-log-stats "*) metrics=() ;; esac
        for group in "${groups[@]}"; do
            vport=$("${PRORL_PYTHON:-python3}" -c 'import socket; s=socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
            local tp=(); [ "$group" != cpu ] && [ "$per" -gt 1 ] && tp=(--tensor-parallel-size "$per")
            # shellcheck disable=SC2086
            if [ "$group" = cpu ]; then
                $vcmd --model "$PRORL_VLLM_MODEL" --host "$adv" --port "$vport" "${tp[@]}" "${metrics[@]}" ${PRORL_VLLM_ARGS:-} \
                    >"$PRORL_L_RUN_DIR/$node.vllm-$vport.log" 2>&1 &
            else
                CUDA_VISIBLE_DEVICES=$group $vcmd --model "$PRORL_VLLM_MODEL" --host "$adv" --port "$vport" \
                    "${tp[@]}" "${metrics[@]}" ${PRORL_VLLM_ARGS:-} >"$PRORL_L_RUN_DIR/$node.vllm-$vport.log" 2>&1 &
            fi
            children+=("$!")
            vllm_urls+=("http://$adv:$vport")
            nlog "vLLM pid $! on devices $group: http://$adv:$vport"
        done
    fi

    # Wait for the server's ready file, then for each vLLM /health, then register them.
    local deadline=$((SECONDS + ${PRORL_STARTUP_TIMEOUT:-600})) url
    until [ -s "$PRORL_L_RUN_DIR/$node.ready.json" ]; do
        kill -0 "${children[0]}" 2>/dev/null || { wait "${children[0]}"; nlog "prorl-server exited rc=$? before it was ready"; stop_children "server died"; }
        [ "$SECONDS" -lt "$deadline" ] || stop_children "server not ready after ${PRORL_STARTUP_TIMEOUT:-600} s"
        sleep 0.2
    done
    local server_url member_urls=()
    server_url=$("${PRORL_PYTHON:-python3}" -c 'import json,sys; print(json.load(open(sys.argv[1]))["url"])' \
        "$PRORL_L_RUN_DIR/$node.ready.json")
    # with --processes, every member is a server of its own: each gets every vLLM server
    mapfile -t member_urls < <("${PRORL_PYTHON:-python3}" -c 'import json,sys; r=json.load(open(sys.argv[1]))
print("\n".join(m["url"] for m in r.get("members") or [r]))' "$PRORL_L_RUN_DIR/$node.ready.json")
    : >"$PRORL_L_RUN_DIR/$node.llm.tmp"
    for url in "${vllm_urls[@]}"; do
        until "${PRORL_PYTHON:-python3}" - "$url" <<'PY'
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1] + "/health", timeout=2).close()
except Exception:
    sys.exit(1)
PY
        do
            [ "$SECONDS" -lt "$deadline" ] || stop_children "vLLM at $url not healthy in time"
            sleep 2
        done
        for server_url in "${member_urls[@]}"; do
            "${PRORL_PYTHON:-python3}" - "$server_url" "$url" <<'PY' || stop_children "could not register $url"
import json, os, sys, urllib.request
server, backend = sys.argv[1], sys.argv[2]
body = {"address": backend, "weight_version": int(os.environ["PRORL_L_WEIGHT_VERSION"])}
req = urllib.request.Request(server + "/add_llm_server", data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json",
                                      "Authorization": "Bearer " + os.environ["PRORL_TOKEN"]})
urllib.request.urlopen(req, timeout=30).close()
PY
            nlog "registered vLLM $url with $server_url (weight_version $PRORL_L_WEIGHT_VERSION)"
        done
        echo "$url" >>"$PRORL_L_RUN_DIR/$node.llm.tmp"
    done
    mv "$PRORL_L_RUN_DIR/$node.llm.tmp" "$PRORL_L_RUN_DIR/$node.llm"

    # Stay until the server exits or we are signalled (a signal interrupts `wait` and runs the trap).
    wait "${children[0]}"; local rc=$?
    nlog "prorl-server exited on its own, rc=$rc"
    stop_children "server exited"
}

# ---------------------------------------------------------------------------------------------------------

if [ "$DRY_RUN" = 1 ]; then
    nodes=${SLURM_JOB_NODELIST:-"<the job's nodes>"}
    echo "launch_rollout.sh plan (dry run: nothing is started)"
    echo "  sbatch defaults (override on the sbatch command line):"
    grep '^#SBATCH' "$0" | sed 's/^/    /'
    echo "  job id:            ${JOB_ID:-<assigned by sbatch>}"
    echo "  nodes:             $nodes (one server each$([ "$PROCESSES" != 1 ] && echo ", $PROCESSES processes (0: one per core)"))"
    echo "  servers.json:      $SERVERS_FILE (mode 0600, written when every server answers /health)"
    echo "  run dir (logs):    $RUN_DIR"
    echo "  token:             ${PRORL_TOKEN:+from PRORL_TOKEN}${PRORL_TOKEN:-generated: 32 random bytes, hex}"
    echo "  per node:"
    echo "    srun $(srun_args '<node>' | tr '\n' ' ')\\"
    echo "      $SERVER_CMD $(server_args '<node>' | tr '\n' ' ')"
    if [ "$BACKENDS" = vllm ]; then
        echo "  backends:          vllm (evaluation): this launcher's own vLLM servers"
        echo "    vLLM: ${PRORL_VLLM_CMD:-$PY -m vllm.entrypoints.openai.api_server} --model $VLLM_MODEL" \
             "on each group of ${PRORL_VLLM_GPUS_PER_SERVER:-1} GPU(s), registered via POST /add_llm_server" \
             "with weight_version $WEIGHT_VERSION"
    else
        echo "  backends:          trainer (training): no vLLM here; the trainer registers its own inference" \
             "servers with a weight version after each update (verl plugin: its per-worker relay)"
        echo "    vLLM: off (for evaluation set PRORL_VLLM_MODEL to start one per GPU)"
    fi
    if [ -n "$FLEET_DIR" ]; then
        echo "  fleet:             $FLEET_DIR (a leased record per server process; token $FLEET_DIR/token;" \
             "SIGTERM drains up to $DRAIN_S s; the job ends when $FLEET_DIR/END appears)"
    fi
    echo "  ready: wait up to ${STARTUP_TIMEOUT} s for every ready file and /health"
    echo "  stop:  on scancel / time limit / SIGUSR1: remove servers.json, SIGTERM the servers," \
         "SIGKILL after ${STOP_GRACE} s"
    exit 0
fi

if [ -z "$JOB_ID" ]; then
    echo "launch_rollout.sh: not inside a Slurm job. Submit it with sbatch, or use --dry-run to see the plan." >&2
    exit 2
fi

mkdir -p "$RUN_DIR" && chmod 0700 "$RUN_DIR" || { log "cannot create $RUN_DIR"; exit 1; }
END_AT_START=
if [ -n "$FLEET_DIR" ]; then
    mkdir -p "$FLEET_DIR" || { log "cannot create the fleet directory $FLEET_DIR"; exit 1; }
    # sticky: in a group-writable directory only a file's owner may rename or delete it (END, token, members/);
    # the servers refuse another user's directory that others may write without it (docs/cluster.md)
    if [ -O "$FLEET_DIR" ]; then chmod +t "$FLEET_DIR" || { log "cannot chmod +t $FLEET_DIR"; exit 1; }; fi
    if [ -z "${PRORL_TOKEN:-}" ]; then
        # one token for the whole fleet: the first job makes it (ln fails if another job was first)
        tok_tmp=$(mktemp "$FLEET_DIR/.token.XXXXXX") && chmod 0600 "$tok_tmp" \
            && od -An -tx1 -N32 /dev/urandom | tr -d ' \n' >"$tok_tmp" \
            && { ln "$tok_tmp" "$FLEET_DIR/token" 2>/dev/null || true; }
        rm -f "$tok_tmp"
        # read back with the reader's checks (a regular file of this user, mode 600, no link, no FIFO): a co-tenant
        # who can write the directory may have put a token of their own there first, to sign records with it
        PRORL_TOKEN=$("$PY" -c 'import sys
from prorl_server.membership import read_token_file
try:
    print(read_token_file(sys.argv[1], require_owner=True))
except (OSError, ValueError) as e:
    sys.exit(f"the fleet token {sys.argv[1]} cannot be used: {e}")' "$FLEET_DIR/token") \
            || { log "cannot use $FLEET_DIR/token (remove it if it is not yours)"; exit 1; }
    fi
    END_AT_START=$(stat -c '%i %Y' "$FLEET_DIR/END" 2>/dev/null)
    LAUNCHED_AT=$(date +%s.%N)  # an END signed before this job started ended an earlier run
fi
export PRORL_TOKEN=${PRORL_TOKEN:-$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')}
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
log "job $JOB_ID: ${#NODES[@]} node(s): ${NODES[*]}; servers.json -> $SERVERS_FILE"
if [ "$BACKENDS" = vllm ]; then
    log "backends: vllm (evaluation): $VLLM_MODEL, registered with weight_version $WEIGHT_VERSION"
else
    log "backends: trainer (training): no vLLM here; the trainer registers its inference servers"
fi

# The node wrapper gets its settings through the environment (srun exports ours).
export PRORL_L_RUN_DIR=$RUN_DIR PRORL_L_HOST=$HOST PRORL_L_SERVER_CMD=$SERVER_CMD
export PRORL_L_BACKENDS=$BACKENDS PRORL_L_WEIGHT_VERSION=$WEIGHT_VERSION
PRORL_L_SERVER_ARGS=$(server_args @NODE@)
export PRORL_L_SERVER_ARGS
{ echo '# Generated by launch_rollout.sh: the per-node part, run by srun on every node.'
  declare -f node_main; echo 'node_main "$@"'; } >"$RUN_DIR/node.sh"

declare -A STEP_PID=()
STOPPING=0
stop_all() {
    [ "$STOPPING" = 1 ] && return
    STOPPING=1
    log "stopping ($1): removing servers.json, SIGTERM to the server steps"
    "$PY" -m trainer_plugins.servers remove "$SERVERS_FILE" --job-id "$JOB_ID" >/dev/null 2>&1 \
        || rm -f "$SERVERS_FILE"
    local node pid rc deadline=$((SECONDS + STOP_GRACE + 5)) alive
    # SIGTERM to the server steps through slurmstepd, not to srun: srun answers SIGTERM by SIGKILLing its step.
    # Without --full, scancel leaves this batch shell out. On scancel/time limit Slurm has already sent it.
    scancel --signal=TERM "$JOB_ID" 2>/dev/null || true  # refused when the job is already being cancelled
    while :; do  # the node wrapper SIGKILLs what is left after PRORL_STOP_GRACE
        alive=0; for pid in "${STEP_PID[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ "$alive" = 0 ] || [ "$SECONDS" -ge "$deadline" ] && break
        sleep 0.2
    done
    for node in "${!STEP_PID[@]}"; do
        wait "${STEP_PID[$node]}" 2>/dev/null; rc=$?
        log "server step on $node exited rc=$rc"
    done
    rm -f "$RUN_DIR"/*.ready.json "$RUN_DIR"/*.advertise "$RUN_DIR"/*.llm
    log "stopped; logs in $RUN_DIR"
}
trap 'stop_all SIGTERM; exit 0' TERM
trap 'stop_all "SIGUSR1: time limit near"; exit 0' USR1
trap 'stop_all SIGINT; exit 130' INT

for node in "${NODES[@]}"; do
    mapfile -t SARGS < <(srun_args "$node")
    srun "${SARGS[@]}" bash "$RUN_DIR/node.sh" &
    STEP_PID[$node]=$!
done

# Wait for every ready file (and the vLLM registrations), failing fast when a step dies.
deadline=$((SECONDS + STARTUP_TIMEOUT))
for node in "${NODES[@]}"; do
    while [ ! -s "$RUN_DIR/$node.ready.json" ] || { [ "$BACKENDS" = vllm ] && [ ! -e "$RUN_DIR/$node.llm" ]; }; do
        if ! kill -0 "${STEP_PID[$node]}" 2>/dev/null; then
            log "server step on $node ended before it was ready; its log: $RUN_DIR/$node.log"
            tail -n 20 "$RUN_DIR/$node.log" 2>/dev/null | sed 's/^/    /'
            stop_all "startup failed"; exit 1
        fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            log "server on $node not ready after $STARTUP_TIMEOUT s"; stop_all "startup timeout"; exit 1
        fi
        sleep 0.2
    done
done
remaining=$((deadline - SECONDS)); [ "$remaining" -lt 5 ] && remaining=5
NODE_CSV=$(IFS=,; echo "${NODES[*]}")
END_CHECKED= END_PROVEN=1
fleet_ended() {  # the trainer wrote the fleet's end sentinel since this job started
    [ -n "$FLEET_DIR" ] || return 1
    local now
    now=$(stat -c '%i %Y' "$FLEET_DIR/END" 2>/dev/null)
    { [ -n "$now" ] && [ "$now" != "$END_AT_START" ]; } || return 1
    [ "$now" = "$END_CHECKED" ] && return "$END_PROVEN"
    END_CHECKED=$now
    # signed with the fleet token (PRORL_TOKEN, in the environment): an END another local user wrote would
    # release the allocation under a running trainer (the servers ignore it too)
    if "$PY" -c 'import os, sys
from prorl_server.membership import end_is_proven
ok, why = end_is_proven(sys.argv[1], os.environ.get("PRORL_TOKEN"), started_at=float(sys.argv[2]))
sys.exit(0 if ok else why)' "$FLEET_DIR" "$LAUNCHED_AT"; then END_PROVEN=0; else
        END_PROVEN=1; log "ignoring $FLEET_DIR/END: not signed with the fleet token, or written before this job"
    fi
    return "$END_PROVEN"
}
"$PY" -m trainer_plugins.servers compose --run-dir "$RUN_DIR" --nodes "$NODE_CSV" --job-id "$JOB_ID" \
    --out "$SERVERS_FILE" --timeout "$remaining" >/dev/null &
COMPOSE_PID=$!
while kill -0 "$COMPOSE_PID" 2>/dev/null; do
    if fleet_ended; then  # the trainer ended while this job was starting: its servers have left already
        kill "$COMPOSE_PID" 2>/dev/null; wait "$COMPOSE_PID" 2>/dev/null
        stop_all "the trainer ended during startup: $FLEET_DIR/END"; exit 0
    fi
    for node in "${NODES[@]}"; do  # a server that dies now would leave compose waiting for its /health
        if ! kill -0 "${STEP_PID[$node]}" 2>/dev/null; then
            kill "$COMPOSE_PID" 2>/dev/null; wait "$COMPOSE_PID" 2>/dev/null
            log "server step on $node ended during startup; its log: $RUN_DIR/$node.log"
            stop_all "startup failed"; exit 1
        fi
    done
    sleep 0.2
done
if ! wait "$COMPOSE_PID"; then
    log "servers did not all answer /health"; stop_all "startup failed"; exit 1
fi
log "all ${#NODES[@]} server(s) healthy; wrote $SERVERS_FILE"
"$PY" -m trainer_plugins.servers show "$SERVERS_FILE" | sed 's/^/    /'

# Stay up. `wait -n` returns when a step ends (or a trapped signal arrives, which runs stop_all and exits). With a
# fleet the loop also looks for the trainer's end sentinel every second (one left by an earlier run is ignored).
while :; do
    if [ -n "$FLEET_DIR" ]; then
        sleep 1 & wait $!
        if fleet_ended; then
            # the servers saw it too and are leaving: a SIGTERM now would race their clean exit
            log "the trainer ended ($FLEET_DIR/END): waiting up to 10 s for the servers to leave"
            end_deadline=$((SECONDS + 10))
            while [ "$SECONDS" -lt "$end_deadline" ]; do
                end_alive=0; for pid in "${STEP_PID[@]}"; do kill -0 "$pid" 2>/dev/null && end_alive=1; done
                [ "$end_alive" = 0 ] && break
                sleep 0.2
            done
            stop_all "the trainer ended: $FLEET_DIR/END"; exit 0
        fi
    else
        wait -n  # bash 4.3+; the only children here are the server steps
    fi
    for node in "${!STEP_PID[@]}"; do
        if ! kill -0 "${STEP_PID[$node]}" 2>/dev/null; then
            log "server step on $node ended while the job runs; see $RUN_DIR/$node.log"
            stop_all "a server died"; exit 1
        fi
    done
done
