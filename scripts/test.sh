#!/usr/bin/env bash
# Run the test suite (sets up .venv first if needed). Extra arguments go to pytest,
# e.g. `bash scripts/test.sh -m "not slow"`.
# `--torch X.Y.Z` runs the FSDP2 plug-in's tests instead (tests/test_fsdp*.py, test_train_fsdp2.py,
# test_torch_private.py and the FSDP2 rows of the fault matrix) on that torch release, in its own
# venv (scripts/setup.sh --torch): what reads FSDP2's internals, on a second release of the range.
# CI (.ci/run) runs the suite, then `--torch 2.14.1`.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --torch ]; then
  [ $# -ge 2 ] || { echo "usage: bash scripts/test.sh --torch X.Y.Z [pytest arguments]" >&2; exit 2; }
  bash scripts/setup.sh --torch "$2"
  venv=.venv-torch${2%.*}
  shift 2
  # -k: every test of these files but the fault matrix's, of which the FSDP2 rows
  exec "$venv/bin/python" -m pytest -q tests/test_fsdp*.py tests/test_train_fsdp2.py tests/test_torch_private.py \
    tests/test_fault_matrix.py -k "not test_fault_matrix or fsdp2" "$@"
fi
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
