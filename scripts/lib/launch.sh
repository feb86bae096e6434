# Shared launcher for scripts/pretrain_gpt_*.sh (sourced, not run).
#
# A script sets its run's defaults (NUM_LAYERS, HIDDEN_SIZE, NUM_HEADS, SEQ_LENGTH,
# MICRO_BATCH, NNODES, GPUS_PER_NODE, DS_CONFIG, CLUSTER, EXTRA_ARGS array) and calls
# `launch_pretraining "$@"`. Every setting can be overridden from the environment:
#
#   cluster   NNODES GPUS_PER_NODE NODE_RANK MASTER_ADDR MASTER_PORT RDZV_ID (SLURM: set by
#             scripts/slurm/*.sbatch; torchrun's c10d rendezvous then numbers the nodes)
#   data      DATA_PATH TOKENIZER_TYPE TOKENIZER (sentencepiece model) VOCAB_FILE MERGE_FILE
#   schedule  TRAIN_ITERS GLOBAL_BATCH MICRO_BATCH LR MIN_LR WARMUP_ITERS
#   output    SAVE LOAD SAVE_INTERVAL TENSORBOARD_DIR LOG_INTERVAL EVAL_INTERVAL EVAL_ITERS
#   faults    MAX_RESTARTS (torchrun restarts after a crash; LOAD defaults to SAVE so they resume)
#             SHUTDOWN_TIMEOUT (seconds between SIGTERM and SIGKILL: time to save, default 240)
#   model     NUM_LAYERS HIDDEN_SIZE NUM_HEADS SEQ_LENGTH DS_CONFIG PRECISION (--fp16/--bf16/empty)
#   modes     DRY_RUN=1 (print the planner's plan for CLUSTER; no torchrun, no GPU)
#             SMOKE=1 (the same run shrunk: 4 CPU ranks as 2 nodes x 2, a few iterations)
#   tools     PYTHON (default .venv/bin/python, else python3)
#
# Extra arguments go to train.py as they are ("$@"), after the script's own flags, so
# they win.

set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO_ROOT"

die() {  # one line naming the problem and the fix, exit 2 (a user error)
  echo "error: $*" >&2
  exit 2
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

# torchrun's arguments for NNODES x GPUS_PER_NODE.
torchrun_args() {
  local args=(--nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE")
  if [ -n "${RDZV_ID:-}" ]; then  # SLURM (or any launcher that starts one torchrun per node)
    [ -n "${MASTER_ADDR:-}" ] || die "RDZV_ID is set but MASTER_ADDR is not: set it to the first node's address"
    args+=(--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" --rdzv-id "$RDZV_ID")
  elif [ "$NNODES" -gt 1 ]; then
    [ -n "${NODE_RANK:-}" ] && [ -n "${MASTER_ADDR:-}" ] || die "a $NNODES-node run needs NODE_RANK (0..$((NNODES - 1)), \
this node's index) and MASTER_ADDR (node 0's address) in the environment on every node, e.g. \
NODE_RANK=0 MASTER_ADDR=node0 bash $0; or NNODES=1 for one node; or sbatch scripts/slurm/*.sbatch"
    args+=(--node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-29500}")
  else
    args+=(--node-rank "${NODE_RANK:-0}" --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}")
  fi
  printf '%s\n' "${args[@]}"
}

# SMOKE=1: the same flags and ZeRO++ switches on a model this machine can train in seconds.
# fp16 becomes fp32 on CPU (the CPU has no fast 16-bit matmul), hpZ's group becomes the
# 2 ranks of an emulated node, small weights are partitioned too (persistence threshold 1000).
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
  local dir
  dir=$(mktemp -d "${TMPDIR:-/tmp}/smoke.XXXXXX")
  "$PY" - "$DS_CONFIG" "$dir/ds_config.json" <<'EOF'
import json, sys
cfg = json.load(open(sys.argv[1]))
zero = cfg.setdefault("zero_optimization", {})
cfg.pop("fp16", None)            # fp16 -> fp32 on CPU
cfg["steps_per_print"] = 1       # a log line per iteration
if zero.get("zero_hpz_partition_size", 1) > 1:
    zero["zero_hpz_partition_size"] = 2   # the 2 ranks of an emulated node
if zero.get("stage") == 3:
    zero["stage3_param_persistence_threshold"] = 1000
json.dump(cfg, open(sys.argv[2], "w"), indent=1)
EOF
  DS_CONFIG="$dir/ds_config.json"
  PRECISION=""
  SMOKE_ARGS=(--ranks-per-node 2 --distributed-backend gloo)
  export OMP_NUM_THREADS=1
  echo "> SMOKE=1: $NUM_LAYERS layers, hidden $HIDDEN_SIZE, seq $SEQ_LENGTH, 4 CPU ranks as 2 nodes x 2, \
gloo, fp32 instead of fp16, $TRAIN_ITERS iterations; zero_optimization from $DS_CONFIG"
}

launch_pretraining() {
  PY=$(python_bin)
  SMOKE_ARGS=()
  if [ "${SMOKE:-0}" = 1 ]; then smoke_setup; fi
  [ -f "$DS_CONFIG" ] || die "DS_CONFIG: no such file $DS_CONFIG"

  local train=(
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
    --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE" --num-attention-heads "$NUM_HEADS"
    --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH" --micro-batch-size "$MICRO_BATCH"
    --train-iters "${TRAIN_ITERS:-500000}" --lr "${LR:-1.5e-4}" --min-lr "${MIN_LR:-1.0e-5}"
    --lr-decay-style cosine --lr-warmup-iters "${WARMUP_ITERS:-$(( ${TRAIN_ITERS:-500000} / 100 ))}"
    --weight-decay 1e-2 --clip-grad 1.0
    --data-path $DATA_PATH --split 949,50,1 --tokenizer-type "$TOKENIZER_TYPE"
    --eval-interval "${EVAL_INTERVAL:-1000}" --eval-iters "${EVAL_ITERS:-10}"
    --deepspeed --deepspeed_config "$DS_CONFIG" --zero-stage "$ZERO_STAGE"
  )
  if [ "$TOKENIZER_TYPE" = GPT2BPETokenizer ]; then   # GPT-2's vocab.json + merges.txt
    [ -n "${VOCAB_FILE:-}" ] && train+=(--vocab-file "$VOCAB_FILE")
    [ -n "${MERGE_FILE:-}" ] && train+=(--merge-file "$MERGE_FILE")
  else                                                # a sentencepiece model
    [ -n "${TOKENIZER:-}" ] && train+=(--tokenizer-model "$TOKENIZER")
  fi
  [ -n "${GLOBAL_BATCH:-}" ] && train+=(--global-batch-size "$GLOBAL_BATCH")
  [ -n "${LOG_INTERVAL:-}" ] && train+=(--log-interval "$LOG_INTERVAL")   # default: the JSON's steps_per_print
  [ -n "${SAVE:-}" ] && train+=(--save "$SAVE" --save-interval "${SAVE_INTERVAL:-1000}")
  LOAD=${LOAD:-${SAVE:-}}   # resume from the newest checkpoint of SAVE, if any
  [ -n "${LOAD:-}" ] && train+=(--load "$LOAD")
  [ -n "${TENSORBOARD_DIR:-}" ] && train+=(--tensorboard-dir "$TENSORBOARD_DIR")
  [ -n "${PRECISION:-}" ] && train+=($PRECISION)
  train+=("${EXTRA_ARGS[@]}" "${SMOKE_ARGS[@]}")

  if [ "${DRY_RUN:-0}" = 1 ]; then
    exec "$PY" train.py "${train[@]}" --dry-run --cluster "$CLUSTER" "$@"
  fi
  slurm_env
  local dist
  mapfile -t dist < <(torchrun_args)
  [ "${#dist[@]}" -gt 0 ] || exit 2   # torchrun_args already said why
  # MAX_RESTARTS>0: torchrun restarts the job after a crash and train.py resumes from --load.
  # Restarted workers must not share the rendezvous store of the failed attempt, whose stale
  # addresses they would dial (pytorch/pytorch#135712).
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
  echo "> torchrun ${dist[*]} train.py ..."
  # On SIGTERM torchrun forwards it to the workers, which finish the step and save; it kills
  # them SHUTDOWN_TIMEOUT seconds later (torchrun's default, 30 s, is short for an 18B save).
  # parallel.launch is torchrun with exit status 0 once every worker saved and exited 0 (torchrun
  # itself exits 1 after a signal, whatever its workers did).
  exec "$PY" -m parallel.launch "${dist[@]}" --max-restarts "${MAX_RESTARTS:-0}" \
    --shutdown-timeout "${SHUTDOWN_TIMEOUT:-240}" train.py "${train[@]}" "$@"
}
