#!/usr/bin/env bash
# Streaming DiLoCo with groups that survive each other, on this machine: torchft's Lighthouse
# and G groups, each its own torchrun job (train.py --lighthouse; docs/fault_tolerant_groups.md).
#
#   scripts/launch_groups.sh start G NPROC [train.py flags]   the Lighthouse and groups 0..G-1
#   scripts/launch_groups.sh lighthouse                       the Lighthouse alone
#   scripts/launch_groups.sh group g G NPROC [train.py flags] group g of G (a late start, a restart)
#   scripts/launch_groups.sh stop g                           group g saves and leaves (SIGTERM)
#
# G is the most groups the run has: each reads 1/G of every global batch, whether or not the
# others are present (every group of a run passes the same G).
# --save DIR / --load DIR / --tensorboard-dir DIR become DIR/group<g> (checkpoints are per group);
# a restarted group loads its own and heals from the others. Logs and pids: $GROUPS_DIR (./groups_run).
# Elsewhere (SLURM, several machines): examples/slurm/diloco_groups.sbatch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DIR=${GROUPS_DIR:-groups_run}
PORT=${LIGHTHOUSE_PORT:-29510}
LIGHTHOUSE=${LIGHTHOUSE:-http://127.0.0.1:$PORT}
mkdir -p "$DIR"

usage() { sed -n 5,8p "$0" | sed 's/^# *//' >&2; exit 2; }
number() { [[ "$2" =~ ^[0-9]+$ ]] || { echo "error: $1 must be a number, got '$2'; see: $0 (no arguments)" >&2; exit 2; }; }

group() {   # group g G NPROC flags...: one torchrun job in the background
  local g=$1 n=$2 nproc=$3; shift 3
  local args=() a
  while (($#)); do
    a=$1; shift
    case $a in
      --save|--load|--tensorboard-dir) args+=("$a" "$1/group$g"); shift ;;
      *) args+=("$a") ;;
    esac
  done
  "$PY" -m parallel.launch --standalone --nproc-per-node "$nproc" train.py "${args[@]}" \
    --lighthouse "$LIGHTHOUSE" --group-id "$g" --num-groups "$n" > "$DIR/group$g.log" 2>&1 &
  echo $! > "$DIR/group$g.pid"
  echo "group $g: pid $!, log $DIR/group$g.log"
}

lighthouse() {   # in the background: a quorum forms with the groups present after 10 s of waiting for the rest
  "$(dirname "$PY")/torchft_lighthouse" --min_replicas 1 --join_timeout_ms "${JOIN_TIMEOUT_MS:-10000}" \
    --bind "[::]:$PORT" > "$DIR/lighthouse.log" 2>&1 &
  echo $! > "$DIR/lighthouse.pid"
  echo "Lighthouse: $LIGHTHOUSE, pid $!, log $DIR/lighthouse.log"
}

case ${1:-} in
  lighthouse)
    lighthouse
    wait "$(cat "$DIR/lighthouse.pid")" ;;
  start)
    (($# >= 3)) || usage
    number G "$2"; number NPROC "$3"
    n=$2 nproc=$3; shift 3
    lighthouse
    for ((g = 0; g < n; g++)); do group "$g" "$n" "$nproc" "$@"; done
    echo "waiting for the groups (scripts/launch_groups.sh stop g stops one)"
    for ((g = 0; g < n; g++)); do wait "$(cat "$DIR/group$g.pid")" || true; done
    kill "$(cat "$DIR/lighthouse.pid")" 2>/dev/null || true ;;
  group)
    (($# >= 4)) || usage
    number g "$2"; number G "$3"; number NPROC "$4"
    g=$2; shift
    group "$@"
    wait "$(cat "$DIR/group$g.pid")" ;;
  stop)
    (($# == 2)) || usage
    number g "$2"
    [ -f "$DIR/group$2.pid" ] || { echo "error: no group $2 in $DIR; start it first" >&2; exit 2; }
    kill -TERM "$(cat "$DIR/group$2.pid")" && echo "group $2: stopping (it saves, then exits)" ;;
  *) usage ;;
esac
