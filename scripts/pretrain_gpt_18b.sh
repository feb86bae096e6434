#!/usr/bin/env bash
# The ZeRO++ paper's 18B GPT-2: 40 layers, hidden 6144, 32 heads, seq 512, micro-batch 1 per
# GPU, fp16, activation checkpointing, TP = PP = 1, ZeRO-3 + qwZ + hpZ + qgZ
# (configs/ds_zeropp_config.json, the tutorial's zero_optimization section; hpZ's group is
# a node's GPUs), GPT-2's BPE vocabulary, on 4 nodes x 16 V100-32GB by default.
#
#   DRY_RUN=1 bash scripts/pretrain_gpt_18b.sh                       # the plan, in seconds, no GPU
#   GPUS_PER_NODE=8 DRY_RUN=1 bash scripts/pretrain_gpt_18b.sh       # the plan on 4 nodes x 8
#   SMOKE=1 bash scripts/pretrain_gpt_18b.sh                         # shrunk, 4 CPU ranks as 2 nodes x 2
#   DATA_PATH=/data/corpus_text_document VOCAB_FILE=/data/gpt2-vocab.json MERGE_FILE=/data/gpt2-merges.txt \
#     SAVE=/ckpt/gpt18b NODE_RANK=0 MASTER_ADDR=node0 bash scripts/pretrain_gpt_18b.sh   # on each node (0..3)
#   sbatch scripts/slurm/pretrain_gpt_18b.sbatch                     # SLURM
#
# Settings come from the environment (scripts/lib/launch.sh lists them; `--help` prints
# them); extra arguments go to train.py.
source "$(dirname "$0")/lib/launch.sh"

NUM_LAYERS=${NUM_LAYERS:-40}
HIDDEN_SIZE=${HIDDEN_SIZE:-6144}
NUM_HEADS=${NUM_HEADS:-32}
SEQ_LENGTH=${SEQ_LENGTH:-512}
MICRO_BATCH=${MICRO_BATCH:-1}
NNODES=${NNODES:-4}
GPUS_PER_NODE=${GPUS_PER_NODE:-16}
ZERO_STAGE=3
DS_CONFIG=${DS_CONFIG:-configs/ds_zeropp_config.json}
CLUSTER=${CLUSTER:-configs/clusters/v100_4x16_100gbps.yaml}
PRECISION=${PRECISION---fp16}
TOKENIZER_TYPE=${TOKENIZER_TYPE:-GPT2BPETokenizer}
EXTRA_ARGS=(--checkpoint-activations --deepspeed-activation-checkpointing)

launch_pretraining "$@"
