#!/usr/bin/env bash
# Create .venv and install the project's dependencies (idempotent), with torch 2.13.0: the CPU
# build where there is no GPU (never the CUDA wheels), the CUDA build + Triton where there is one.
# `--torch 2.14.1` makes a second venv, .venv-torch2.14, with that release of pyproject.toml's
# torch range (its default build: a CUDA build, which also runs on CPU) and the project installed
# editable: scripts/test.sh --torch runs the FSDP2 plug-in's tests in it.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=2.13.0 VENV=.venv
if [ $# -gt 0 ]; then
  if [ "$1" != --torch ] || [ $# -ne 2 ] || [[ ! "$2" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
    echo "usage: bash scripts/setup.sh [--torch X.Y.Z] (a release in pyproject.toml's torch range, e.g. 2.14.1)" >&2
    exit 2
  fi
  TORCH=$2 VENV=.venv-torch${2%.*}
fi
PYTHON=${PYTHON:-python3}
"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "Python 3.10+ is required")'
# a release outside pyproject.toml's torch range is refused here, before anything is downloaded
"$PYTHON" -c '
import re, sys
low, high = re.search(r"\"torch>=([0-9.]+),<([0-9.]+)\"", open("pyproject.toml").read()).groups()
release = lambda v: tuple(int(x) for x in v.split(".")[:2])
if not release(low) <= release(sys.argv[1]) < release(high):
    sys.exit(f"setup.sh: torch {sys.argv[1]} is outside pyproject.toml range >={low},<{high}: pass --torch X.Y.Z inside it")
' "$TORCH" || exit 2
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip install -q --disable-pip-version-check"
if ! "$VENV/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH')" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    $PIP "torch==$TORCH" triton
  elif [ "$TORCH" = 2.13.0 ]; then
    $PIP torch==2.13.0   # the CPU build (2.13.0+cpu)
  else
    $PIP "torch==$TORCH"
  fi
fi
# torch is already there (pinned), so these never pull another torch build.
$PIP "torch==$TORCH" -e '.[test]'
