#!/usr/bin/env bash
# The ZeRO tutorial's 10B GPT-2: 50 layers, hidden 4096, 32 heads, seq 1024, micro-batch 1,
# fp16, activation checkpointing, ZeRO stage 2 (configs/ds_zero2_config.json: contiguous
# gradients, overlap_comm, reduce_scatter, both bucket sizes 5e8) on 32 GPUs (2 nodes x 16).
#
#   NNODES=1 bash scripts/pretrain_gpt_10b_zero2.sh                          # one node of 16 GPUs
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash scripts/pretrain_gpt_10b_zero2.sh   # on each node
#   DRY_RUN=1 bash scripts/pretrain_gpt_10b_zero2.sh                         # the plan for $CLUSTER
#   SMOKE=1 bash scripts/pretrain_gpt_10b_zero2.sh                           # shrunk, 4 CPU ranks as 2 nodes x 2
#
# Settings come from the environment (scripts/lib/launch.sh lists them; `--help` prints
# them; DATA_PATH is required, SMOKE=1 runs on the bundled corpus); extra
# arguments go to train.py.
source "$(dirname "$0")/lib/launch.sh"

NUM_LAYERS=${NUM_LAYERS:-50}
HIDDEN_SIZE=${HIDDEN_SIZE:-4096}
NUM_HEADS=${NUM_HEADS:-32}
SEQ_LENGTH=${SEQ_LENGTH:-1024}
MICRO_BATCH=${MICRO_BATCH:-1}
NNODES=${NNODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-16}
ZERO_STAGE=2
DS_CONFIG=${DS_CONFIG:-configs/ds_zero2_config.json}
CLUSTER=${CLUSTER:-configs/clusters/v100_2x16_100gbps.yaml}
PRECISION=${PRECISION---fp16}
TOKENIZER_TYPE=${TOKENIZER_TYPE:-GPT2BPETokenizer}
EXTRA_ARGS=(--checkpoint-activations)

launch_pretraining "$@"
