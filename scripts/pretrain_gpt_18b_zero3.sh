#!/usr/bin/env bash
# The ZeRO-3 baseline of scripts/pretrain_gpt_18b.sh: the same 18B GPT-2 run on 4 nodes x 16
# V100-32GB, with configs/ds_zero3_config.json (the tutorial's zero_optimization section
# without qwZ, hpZ and qgZ).
#
#   NODE_RANK=0 MASTER_ADDR=node0 bash scripts/pretrain_gpt_18b_zero3.sh   # on each node (NODE_RANK 0..3)
#   sbatch scripts/slurm/pretrain_gpt_18b_zero3.sbatch                     # SLURM
#   DRY_RUN=1 bash scripts/pretrain_gpt_18b_zero3.sh                       # the plan, in seconds, no GPU
#   SMOKE=1 bash scripts/pretrain_gpt_18b_zero3.sh                         # shrunk, 4 CPU ranks as 2 nodes x 2
#
# Settings come from the environment (scripts/lib/launch.sh lists them); extra
# arguments go to train.py.
source "$(dirname "$0")/lib/launch.sh"

NUM_LAYERS=${NUM_LAYERS:-40}
HIDDEN_SIZE=${HIDDEN_SIZE:-6144}
NUM_HEADS=${NUM_HEADS:-32}
SEQ_LENGTH=${SEQ_LENGTH:-512}
MICRO_BATCH=${MICRO_BATCH:-1}
NNODES=${NNODES:-4}
GPUS_PER_NODE=${GPUS_PER_NODE:-16}
ZERO_STAGE=3
DS_CONFIG=${DS_CONFIG:-configs/ds_zero3_config.json}
CLUSTER=${CLUSTER:-configs/clusters/v100_4x16_100gbps.yaml}
PRECISION=${PRECISION---fp16}
DATA_PATH=${DATA_PATH:-work_dir/kjv_text_document}
TOKENIZER_TYPE=${TOKENIZER_TYPE:-SentencePieceTokenizer}
TOKENIZER=${TOKENIZER:-work_dir/kjv_sp.model}
EXTRA_ARGS=(--checkpoint-activations --deepspeed-activation-checkpointing)

launch_pretraining "$@"
