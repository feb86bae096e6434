# Shared launcher for scripts/pretrain_gpt_*.sh (sourced, not run).
#
# A script sets its run's defaults (NUM_LAYERS, HIDDEN_SIZE, NUM_HEADS, SEQ_LENGTH,
# MICRO_BATCH, NNODES, GPUS_PER_NODE, DS_CONFIG, CLUSTER, EXTRA_ARGS array) and calls
# `launch_pretraining "$@"`.
#
# Settings, from the environment (each overrides the script's default):
#   cluster   NNODES GPUS_PER_NODE NODE_RANK MASTER_ADDR MASTER_PORT RDZV_ID (SLURM: set by
#             scripts/slurm/*.sbatch; torchrun's c10d rendezvous then numbers the nodes)
#   data      DATA_PATH (required: a data.preprocess prefix, or Megatron's "weight prefix ..." blend)
#             TOKENIZER_TYPE (default GPT2BPETokenizer) VOCAB_FILE MERGE_FILE, or
#             TOKENIZER_TYPE=SentencePieceTokenizer TOKENIZER (its .model file)
#   schedule  TRAIN_ITERS GLOBAL_BATCH MICRO_BATCH LR MIN_LR WARMUP_ITERS
#   output    SAVE LOAD SAVE_INTERVAL TENSORBOARD_DIR (default SAVE/tensorboard, else
#             runs/<script>/tensorboard) LOG_INTERVAL EVAL_INTERVAL EVAL_ITERS
#   faults    MAX_RESTARTS (torchrun restarts after a crash; LOAD defaults to SAVE so they resume)
#             SHUTDOWN_TIMEOUT (seconds between SIGTERM and SIGKILL: time to save, default 240)
#   model     NUM_LAYERS HIDDEN_SIZE NUM_HEADS SEQ_LENGTH DS_CONFIG PRECISION (--fp16/--bf16/empty)
#             HPZ_SIZE (hpZ's group when DS_CONFIG turns hpZ on; default: the GPUs of a node)
#   modes     DRY_RUN=1 (the planner's plan for CLUSTER, with NNODES, GPUS_PER_NODE and
#             GPU_MEMORY_GB in place of the file's values when set; the input paths checked;
#             the command each node runs; no torchrun, no GPU)
#             SMOKE=1 (the same run shrunk: 4 CPU ranks as 2 nodes x 2, a few iterations on the
#             bundled corpus)
#   tools     PYTHON (default .venv/bin/python, else python3)
#
# Extra arguments go to train.py as they are ("$@"), after the script's own flags, so
# they win. `--help` prints this.

set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO_ROOT"
# What the user set, before the script's defaults: the dry run plans these in place of CLUSTER's.
PLAN_NNODES=${NNODES:-}
PLAN_GPUS_PER_NODE=${GPUS_PER_NODE:-}

die() {  # one line naming the problem and the fix, exit 2 (a user error)
  echo "error: $*" >&2
  exit 2
}

usage() {  # the calling script's header, then the settings above
  sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"
  echo
  sed -n '/^# Settings, from the environment/,/^[^#]/{/^#/s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}"
  echo "train.py's own flags: python train.py --help"
}

python_bin() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"
  elif [ -x .venv/bin/python ]; then echo .venv/bin/python
  else echo python3
  fi
}

# SLURM: one task per node (srun); the first node of the allocation hosts the rendezvous.
slurm_env() {
  if [ -n "${RDZV_ID:-}" ] && [ -z "${MASTER_ADDR:-}" ] && command -v scontrol >/dev/null 2>&1; then
    MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
  fi
}

# torchrun's arguments for NNODES x GPUS_PER_NODE (into DIST); what is missing goes to PROBLEMS.
torchrun_args() {
  DIST=(--nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE")
  if [ -n "${RDZV_ID:-}" ]; then  # SLURM (or any launcher that starts one torchrun per node)
    [ -n "${MASTER_ADDR:-}" ] || PROBLEMS+=("RDZV_ID is set but MASTER_ADDR is not: set it to the first node's address")
    DIST+=(--rdzv-backend c10d --rdzv-endpoint "${MASTER_ADDR:-}:${MASTER_PORT:-29500}" --rdzv-id "$RDZV_ID")
  elif [ "$NNODES" -gt 1 ]; then
    [ -n "${NODE_RANK:-}" ] && [ -n "${MASTER_ADDR:-}" ] || PROBLEMS+=("a $NNODES-node run needs NODE_RANK \
(0..$((NNODES - 1)), this node's index) and MASTER_ADDR (node 0's address) in the environment on every node, e.g. \
NODE_RANK=0 MASTER_ADDR=node0 bash $0; or NNODES=1 for one node; or sbatch scripts/slurm/*.sbatch")
    DIST+=(--node-rank "${NODE_RANK:-}" --master-addr "${MASTER_ADDR:-}" --master-port "${MASTER_PORT:-29500}")
  else
    DIST+=(--node-rank "${NODE_RANK:-0}" --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}")
  fi
}

# hpZ's secondary partition spans a node, as the ZeRO++ paper sets it: when DS_CONFIG turns hpZ on,
# its group is the node's GPUs (HPZ_SIZE to choose), whatever size the JSON was written for.
hpz_args() {
  local node=$1 in_json
  in_json=$("$PY" -c 'import json, sys
print(json.load(open(sys.argv[1])).get("zero_optimization", {}).get("zero_hpz_partition_size", 1))' "$DS_CONFIG")
  [ "$in_json" -gt 1 ] 2>/dev/null || return 0
  local size=${HPZ_SIZE:-$node}
  [ "$size" = "$in_json" ] && return 0
  local why="the GPUs of a node, as the ZeRO++ paper sets it"
  [ -n "${HPZ_SIZE:-}" ] && why="HPZ_SIZE"
  if [ "$size" -gt 1 ]; then echo "> hpZ: groups of $size GPUs ($why; $DS_CONFIG says $in_json)"
  else echo "> hpZ: off ($why: 1 GPU; $DS_CONFIG says $in_json)"
  fi
  TRAIN+=(--zero-hpz-size "$size")
}

# SMOKE=1: the same flags and ZeRO++ switches on a model this machine can train in seconds.
# fp16 becomes fp32 on CPU (the CPU has no fast 16-bit matmul), hpZ's group becomes the
# 2 ranks of an emulated node, small weights are partitioned too (persistence threshold 1000).
# The shrunk JSON goes to work_dir/smoke/ (beside the bundled corpus; rewritten each time).
smoke_setup() {
  NUM_LAYERS=${SMOKE_LAYERS:-2}; HIDDEN_SIZE=${SMOKE_HIDDEN:-64}; NUM_HEADS=${SMOKE_HEADS:-4}
  SEQ_LENGTH=${SMOKE_SEQ:-64}; MICRO_BATCH=1; NNODES=1; GPUS_PER_NODE=4; NODE_RANK=0
  MASTER_ADDR=127.0.0.1; MASTER_PORT=${MASTER_PORT:-$((29500 + RANDOM % 1000))}; unset RDZV_ID
  TRAIN_ITERS=${SMOKE_ITERS:-4}; GLOBAL_BATCH=""; LOG_INTERVAL=""; EVAL_INTERVAL=1000; EVAL_ITERS=1
  SAVE=${SMOKE_SAVE:-}; LOAD=""; TENSORBOARD_DIR=""
  DATA_PATH=work_dir/kjv_text_document; TOKENIZER_TYPE=SentencePieceTokenizer; TOKENIZER=work_dir/kjv_sp.model
  if [ ! -f "$DATA_PATH.idx" ] || [ ! -f "$TOKENIZER" ]; then
    echo "> SMOKE=1: building the bundled corpus first (scripts/prepare_demo_data.sh)"
    PYTHON="$PY" bash scripts/prepare_demo_data.sh || die "SMOKE=1 needs the bundled corpus ($DATA_PATH, \
$TOKENIZER) and scripts/prepare_demo_data.sh could not build it; run it by hand to see why"
  fi
  local shrunk
  shrunk=work_dir/smoke/$(basename "$DS_CONFIG")
  mkdir -p work_dir/smoke
  "$PY" - "$DS_CONFIG" "$shrunk" <<'EOF'
import json, os, sys
cfg = json.load(open(sys.argv[1]))
zero = cfg.setdefault("zero_optimization", {})
cfg.pop("fp16", None)            # fp16 -> fp32 on CPU
cfg["steps_per_print"] = 1       # a log line per iteration
if zero.get("stage") == 3:
    zero["stage3_param_persistence_threshold"] = 1000
with open(f"{sys.argv[2]}.{os.getpid()}", "w") as f:   # whole or not at all: another SMOKE run may read it
    json.dump(cfg, f, indent=1)
os.replace(f"{sys.argv[2]}.{os.getpid()}", sys.argv[2])
EOF
  DS_CONFIG=$shrunk
  PRECISION=""
  SMOKE_ARGS=(--ranks-per-node 2 --distributed-backend gloo)
  NODE_GPUS=2
  export OMP_NUM_THREADS=1
  echo "> SMOKE=1: $NUM_LAYERS layers, hidden $HIDDEN_SIZE, seq $SEQ_LENGTH, 4 CPU ranks as 2 nodes x 2, \
gloo, fp32 instead of fp16, $TRAIN_ITERS iterations; zero_optimization from $DS_CONFIG"
}

quoted() {  # the arguments as a shell reads them back, quoted only where they need it
  local arg out=()
  for arg in "$@"; do
    if [[ "$arg" =~ ^[A-Za-z0-9_./:=,+-]+$ ]]; then out+=("$arg"); else out+=("'${arg//\'/\'\\\'\'}'"); fi
  done
  echo "${out[*]}"
}

# The dry run's cluster: CLUSTER, with what the user set in the environment in place of its values.
cluster_spec() {
  local spec=$CLUSTER
  [ -n "$PLAN_NNODES" ] && spec+=",nodes=$PLAN_NNODES"
  [ -n "$PLAN_GPUS_PER_NODE" ] && spec+=",gpus_per_node=$PLAN_GPUS_PER_NODE"
  [ -n "${GPU_MEMORY_GB:-}" ] && spec+=",gpu_memory_gb=$GPU_MEMORY_GB"
  echo "$spec"
}

# train.py's arguments (into TRAIN); what the run needs and was not given goes to PROBLEMS.
train_args() {
  TRAIN=(
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
    --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE" --num-attention-heads "$NUM_HEADS"
    --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH" --micro-batch-size "$MICRO_BATCH"
    --train-iters "${TRAIN_ITERS:-500000}" --lr "${LR:-1.5e-4}" --min-lr "${MIN_LR:-1.0e-5}"
    --lr-decay-style cosine --lr-warmup-iters "${WARMUP_ITERS:-$(( ${TRAIN_ITERS:-500000} / 100 ))}"
    --weight-decay 1e-2 --clip-grad 1.0
    --split 949,50,1 --tokenizer-type "$TOKENIZER_TYPE"
    --eval-interval "${EVAL_INTERVAL:-1000}" --eval-iters "${EVAL_ITERS:-10}"
    --deepspeed --deepspeed_config "$DS_CONFIG" --zero-stage "$ZERO_STAGE"
  )
  local files=()
  ABSENT=()   # inputs the run needs and the plan does without
  if [ -n "${DATA_PATH:-}" ]; then
    TRAIN+=(--data-path $DATA_PATH)   # unquoted: a blend is "weight prefix weight prefix"
  else
    ABSENT+=(DATA_PATH)
    PROBLEMS+=("DATA_PATH is not set: this run trains on your corpus (DATA_PATH=/data/corpus_text_document, \
a data.preprocess prefix: docs/data.md); SMOKE=1 runs the script on the bundled corpus")
  fi
  if [ "$TOKENIZER_TYPE" = GPT2BPETokenizer ]; then   # GPT-2's vocab.json + merges.txt
    [ -n "${VOCAB_FILE:-}" ] && TRAIN+=(--vocab-file "$VOCAB_FILE") || files+=(VOCAB_FILE)
    [ -n "${MERGE_FILE:-}" ] && TRAIN+=(--merge-file "$MERGE_FILE") || files+=(MERGE_FILE)
  else                                                # a sentencepiece model
    [ -n "${TOKENIZER:-}" ] && TRAIN+=(--tokenizer-model "$TOKENIZER") || files+=(TOKENIZER)
  fi
  if [ "${#files[@]}" -gt 0 ]; then
    ABSENT+=("${files[@]}")
    PROBLEMS+=("${files[*]} not set: $TOKENIZER_TYPE needs its files (VOCAB_FILE and MERGE_FILE: GPT-2's \
vocab.json and merges.txt; or TOKENIZER_TYPE=SentencePieceTokenizer TOKENIZER=its .model)")
  fi
  [ -n "${GLOBAL_BATCH:-}" ] && TRAIN+=(--global-batch-size "$GLOBAL_BATCH")
  [ -n "${LOG_INTERVAL:-}" ] && TRAIN+=(--log-interval "$LOG_INTERVAL")   # default: the JSON's steps_per_print
  [ -n "${SAVE:-}" ] && TRAIN+=(--save "$SAVE" --save-interval "${SAVE_INTERVAL:-1000}")
  LOAD=${LOAD:-${SAVE:-}}   # resume from the newest checkpoint of SAVE, if any
  [ -n "${LOAD:-}" ] && TRAIN+=(--load "$LOAD")
  if [ "${SMOKE:-0}" != 1 ]; then   # TensorBoard on, as Megatron's scripts have it
    local name
    name=$(basename "$0" .sh)
    TENSORBOARD_DIR=${TENSORBOARD_DIR:-${SAVE:+$SAVE/tensorboard}}
    TENSORBOARD_DIR=${TENSORBOARD_DIR:-runs/${name#pretrain_}/tensorboard}
  fi
  [ -n "${TENSORBOARD_DIR:-}" ] && TRAIN+=(--tensorboard-dir "$TENSORBOARD_DIR")
  [ -n "${PRECISION:-}" ] && TRAIN+=($PRECISION)
  hpz_args "$NODE_GPUS"
  TRAIN+=("${EXTRA_ARGS[@]}" "${SMOKE_ARGS[@]}")
}

# DRY_RUN=1: the plan of CLUSTER as the user set it, then the command each node runs.
dry_run() {
  [ "${#ABSENT[@]}" -eq 0 ] || echo "> not set: ${ABSENT[*]}: planned without them; the run itself needs them"
  "$PY" train.py "${TRAIN[@]}" --dry-run --cluster "$(cluster_spec)" "$@" || exit
  NNODES=${PLAN_NNODES:-$NNODES}
  if [ "$NNODES" -gt 1 ] && [ -z "${RDZV_ID:-}" ]; then
    NODE_RANK='$NODE_RANK' MASTER_ADDR='$MASTER_ADDR' torchrun_args
    echo "> each of the $NNODES nodes runs (NODE_RANK 0..$((NNODES - 1)), MASTER_ADDR node 0's address; this \
script with the same settings runs it):"
  else
    torchrun_args
    echo "> the node runs (this script with the same settings runs it):"
  fi
  echo "  $PY -m parallel.launch ${DIST[*]} --max-restarts ${MAX_RESTARTS:-0} \
--shutdown-timeout ${SHUTDOWN_TIMEOUT:-240} train.py $(quoted "${TRAIN[@]}" "$@")"
}

launch_pretraining() {
  local arg
  for arg in "$@"; do
    case "$arg" in -h|--help) usage; exit 0 ;; esac
  done
  PY=$(python_bin)
  SMOKE_ARGS=()
  NODE_GPUS=$GPUS_PER_NODE
  if [ "${SMOKE:-0}" = 1 ]; then smoke_setup; fi
  [ -f "$DS_CONFIG" ] || die "DS_CONFIG: no such file $DS_CONFIG"
  PROBLEMS=()
  if [ "${DRY_RUN:-0}" = 1 ]; then
    train_args
    dry_run "$@"
    exit 0
  fi
  slurm_env
  torchrun_args
  train_args
  if [ "${#PROBLEMS[@]}" -gt 0 ]; then   # every problem, in one line
    local all="" problem
    for problem in "${PROBLEMS[@]}"; do all+="${all:+; also: }$problem"; done
    die "$all"
  fi
  # MAX_RESTARTS>0: torchrun restarts the job after a crash and train.py resumes from --load.
  # Restarted workers must not share the rendezvous store of the failed attempt, whose stale
  # addresses they would dial (pytorch/pytorch#135712).
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
  echo "> torchrun ${DIST[*]} train.py ..."
  # On SIGTERM torchrun forwards it to the workers, which finish the step and save; it kills
  # them SHUTDOWN_TIMEOUT seconds later (torchrun's default, 30 s, is short for an 18B save).
  # parallel.launch is torchrun that checks train.py's command line before starting the workers
  # (a user error is one line, exit 2) and exits 0 once every worker saved and exited 0 after a
  # signal (torchrun itself exits 1 after a signal, whatever its workers did).
  exec "$PY" -m parallel.launch "${DIST[@]}" --max-restarts "${MAX_RESTARTS:-0}" \
    --shutdown-timeout "${SHUTDOWN_TIMEOUT:-240}" train.py "${TRAIN[@]}" "$@"
}
