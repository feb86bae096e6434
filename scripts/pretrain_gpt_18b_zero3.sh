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
# Everything else is scripts/pretrain_gpt_18b.sh's (settings from the environment, extra
# arguments to train.py).
DS_CONFIG=${DS_CONFIG:-configs/ds_zero3_config.json} exec bash "$(dirname "$0")/pretrain_gpt_18b.sh" "$@"
