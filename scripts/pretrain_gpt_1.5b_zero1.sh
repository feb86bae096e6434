#!/usr/bin/env bash
# The ZeRO tutorial's 1.5B GPT-2: 48 layers, hidden 1600, 16 heads, seq 1024, micro-batch 1,
# fp16, ZeRO stage 1 (configs/ds_zero1_config.json: reduce_bucket_size 5e8) on one node of 8 GPUs.
#
#   bash scripts/pretrain_gpt_1.5b_zero1.sh                                   # one node of 8 GPUs
#   NNODES=1 NODE_RANK=0 MASTER_ADDR=node0 bash scripts/pretrain_gpt_1.5b_zero1.sh   # on each node
#   DRY_RUN=1 bash scripts/pretrain_gpt_1.5b_zero1.sh                         # the plan for $CLUSTER
#   SMOKE=1 bash scripts/pretrain_gpt_1.5b_zero1.sh                           # shrunk, 4 CPU ranks as 2 nodes x 2
#
# Settings come from the environment (scripts/lib/launch.sh lists them; `--help` prints
# them; DATA_PATH is required, SMOKE=1 runs on the bundled corpus); extra
# arguments go to train.py.
source "$(dirname "$0")/lib/launch.sh"

NUM_LAYERS=${NUM_LAYERS:-48}
HIDDEN_SIZE=${HIDDEN_SIZE:-1600}
NUM_HEADS=${NUM_HEADS:-16}
SEQ_LENGTH=${SEQ_LENGTH:-1024}
MICRO_BATCH=${MICRO_BATCH:-1}
NNODES=${NNODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
ZERO_STAGE=1
DS_CONFIG=${DS_CONFIG:-configs/ds_zero1_config.json}
CLUSTER=${CLUSTER:-configs/clusters/v100_1x8.yaml}
PRECISION=${PRECISION---fp16}
TOKENIZER_TYPE=${TOKENIZER_TYPE:-GPT2BPETokenizer}
EXTRA_ARGS=()

launch_pretraining "$@"
