#!/usr/bin/env bash
# Create .venv and install the project's dependencies (idempotent).
# No GPU: the CPU build torch==2.13.0 (never the CUDA wheels). GPU: the default CUDA build + Triton.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "Python 3.10+ is required")'
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=".venv/bin/python -m pip install -q --disable-pip-version-check"
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    $PIP torch triton
  else
    $PIP torch==2.13.0
  fi
fi
# torch is already there, so these never pull another torch build.
$PIP -e '.[test]'
