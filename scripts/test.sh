#!/usr/bin/env bash
# Run the tests (sets up .venv first if needed). Extra arguments go to pytest.
# `bash scripts/test.sh`: the daily command, under 10 minutes on 2 idle cores: the quick tier
# (-m "not slow") and one slow test of each slow family (tests/conftest.py DAILY).
# `--full`: every test (CI runs this).
# `--torch X.Y.Z` runs the FSDP2 plug-in's tests instead (tests/unit/fsdp, tests/integration/fsdp2,
# test_train_fsdp2.py, test_torch_private.py and the FSDP2 rows of the fault matrix) on that torch release, in its own
# venv (scripts/setup.sh --torch): what reads FSDP2's internals, on a second release of the range.
# CI (.ci/run) runs `--full`, then `--torch 2.14.1`.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --torch ]; then
  [ $# -ge 2 ] || { echo "usage: bash scripts/test.sh --torch X.Y.Z [pytest arguments]" >&2; exit 2; }
  bash scripts/setup.sh --torch "$2"
  venv=.venv-torch${2%.*}
  shift 2
  # -k: every test of these files but the fault matrix's, of which the FSDP2 rows
  exec "$venv/bin/python" -m pytest -q tests/unit/fsdp tests/integration/fsdp2 \
    tests/integration/train/test_train_fsdp2.py tests/unit/common/test_torch_private.py \
    tests/integration/faults/test_fault_matrix.py \
    -k "not test_fault_matrix or fsdp2" "$@"
fi
bash scripts/setup.sh
if [ "${1:-}" = --full ]; then
  shift
  exec .venv/bin/python -m pytest -q "$@"
fi
exec .venv/bin/python -m pytest -q -m "not slow or daily" "$@"
