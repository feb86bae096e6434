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
# others are present (every group of a run passes the same G). train.py makes --save, --load and
# --tensorboard-dir (flags or --config) per group, DIR/group<g>: a restarted group loads its own
# and heals from the others. Logs (appended, a line at each start) and pids: $GROUPS_DIR
# (./groups_run). `start` and `group` exit with the groups' status, naming those that failed.
# Elsewhere (SLURM, several machines): examples/slurm/diloco_groups.sbatch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DIR=${GROUPS_DIR:-groups_run}
PORT=${LIGHTHOUSE_PORT:-29510}
LIGHTHOUSE=${LIGHTHOUSE:-http://127.0.0.1:$PORT}

usage() { sed -n 5,8p "$0" | sed 's/^# *//' >&2; exit 2; }
fail() { echo "error: $1" >&2; exit "${2:-2}"; }
number() {   # number NAME VALUE [LEAST]
  [[ "$2" =~ ^(0|[1-9][0-9]*)$ ]] || fail "$1 must be a number, got '$2'; see: $0 (no arguments)"
  (($2 >= ${3:-0})) || fail "$1 must be at least ${3:-0}, got $2"
}
answers() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }   # something listens on port $1 here

running() {   # running NAME PATTERN: the pid in $DIR/NAME.pid when that process is alive and is NAME
  local pid
  pid=$(cat "$DIR/$1.pid" 2>/dev/null) || return 1
  [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null || return 1
  ps -o args= -p "$pid" 2>/dev/null | grep -q -- "$2" || return 1   # not a pid reused since
  echo "$pid"
}
group_running() { running "group$1" "--group-id $1 --num-groups"; }
lighthouse_running() { running lighthouse torchft_lighthouse; }

ended() {   # ended NAME PID: forget the pid file if it still names PID (a restart may have replaced it)
  [ "$(cat "$DIR/$1.pid" 2>/dev/null)" != "$2" ] || rm -f "$DIR/$1.pid"
}

group() {   # group g G NPROC flags...: one torchrun job in the background; GROUP_PID is its pid
  local g=$1 n=$2 nproc=$3; shift 3
  mkdir -p "$DIR"
  echo "=== $(date '+%F %T') group $g of $n starts ($nproc ranks): $*" >> "$DIR/group$g.log"
  "$PY" -m parallel.launch --standalone --nproc-per-node "$nproc" train.py "$@" \
    --lighthouse "$LIGHTHOUSE" --group-id "$g" --num-groups "$n" >> "$DIR/group$g.log" 2>&1 &
  GROUP_PID=$!
  echo "$GROUP_PID" > "$DIR/group$g.pid"
  echo "group $g: pid $GROUP_PID, log $DIR/group$g.log"
}

lighthouse() {   # in the background, once it answers; a quorum forms with the groups present after 10 s
  local pid waited=0
  ! answers "$PORT" || fail "port $PORT is in use (another Lighthouse, or another program): set LIGHTHOUSE_PORT \
to a free port, or stop what listens there" 1
  mkdir -p "$DIR"
  echo "=== $(date '+%F %T') Lighthouse starts on port $PORT" >> "$DIR/lighthouse.log"
  "$(dirname "$PY")/torchft_lighthouse" --min_replicas 1 --join_timeout_ms "${JOIN_TIMEOUT_MS:-10000}" \
    --bind "[::]:$PORT" >> "$DIR/lighthouse.log" 2>&1 &
  pid=$!
  echo "$pid" > "$DIR/lighthouse.pid"
  until answers "$PORT"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      local rc=0
      wait "$pid" || rc=$?
      ended lighthouse "$pid"
      fail "the Lighthouse exited at once (status $rc: $(tail -n 1 "$DIR/lighthouse.log")); see $DIR/lighthouse.log" 1
    fi
    if ((waited++ >= 300)); then
      kill "$pid" 2>/dev/null || true
      fail "the Lighthouse did not answer on port $PORT within 30 s; see $DIR/lighthouse.log" 1
    fi
    sleep 0.1
  done
  LIGHTHOUSE_PID=$pid
  echo "Lighthouse: $LIGHTHOUSE, pid $pid, log $DIR/lighthouse.log"
}

refuse_running() {   # refuse_running g...: none of these groups may be running already
  local g pid
  for g in "$@"; do
    if pid=$(group_running "$g"); then
      fail "group $g is running (pid $pid, $DIR/group$g.pid); stop it first: $0 stop $g"
    fi
  done
}

verdict() {   # verdict "g:status[:restarted]"...: one line naming the groups that failed; exits with the first's status
  local failed="" count=0 first=0 entry g rc again
  for entry in "$@"; do
    IFS=: read -r g rc again <<< "$entry"
    if ((rc)); then
      failed+="${failed:+; }group $g (exit status $rc${again:+, restarted since}, $DIR/group$g.log)"
      count=$((count + 1))
      ((first)) || first=$rc
    fi
  done
  ((count == 0)) || fail "$count of $# group(s) failed: $failed" "$first"
}

case ${1:-} in
  lighthouse)
    (($# == 1)) || usage
    if pid=$(lighthouse_running); then fail "the Lighthouse is running (pid $pid, $DIR/lighthouse.pid)"; fi
    lighthouse
    rc=0
    wait "$LIGHTHOUSE_PID" || rc=$?
    ended lighthouse "$LIGHTHOUSE_PID"
    exit "$rc" ;;
  start)
    (($# >= 3)) || usage
    number G "$2" 1; number NPROC "$3" 1
    n=$2 nproc=$3; shift 3
    refuse_running $(seq 0 $((n - 1)))
    if pid=$(lighthouse_running); then fail "the Lighthouse is running (pid $pid, $DIR/lighthouse.pid)"; fi
    lighthouse
    pids=()
    for ((g = 0; g < n; g++)); do group "$g" "$n" "$nproc" "$@"; pids+=("$GROUP_PID"); done
    echo "waiting for the groups (scripts/launch_groups.sh stop g stops one)"
    gone= restarted=()
    while :; do   # until every group has ended (restarts too); say once if the Lighthouse ends first
      alive=0
      for ((g = 0; g < n; g++)); do
        if kill -0 "${pids[g]}" 2>/dev/null; then alive=1
        elif pid=$(group_running "$g"); then alive=1 restarted[g]=1   # started again elsewhere: `group g`
        fi
      done
      ((alive)) || break
      if [ -z "$gone" ] && ! kill -0 "$LIGHTHOUSE_PID" 2>/dev/null; then
        gone=1
        echo "warning: the Lighthouse has exited (see $DIR/lighthouse.log): the groups train on alone, with no" \
             "exchange, until one answers at $LIGHTHOUSE again ($0 lighthouse)" >&2
      fi
      sleep 1
    done
    statuses=()
    for ((g = 0; g < n; g++)); do
      rc=0
      wait "${pids[g]}" || rc=$?
      ended "group$g" "${pids[g]}"
      statuses+=("$g:$rc:${restarted[g]:-}")
    done
    kill "$LIGHTHOUSE_PID" 2>/dev/null || true
    wait "$LIGHTHOUSE_PID" 2>/dev/null || true
    ended lighthouse "$LIGHTHOUSE_PID"
    verdict "${statuses[@]}" ;;
  group)
    (($# >= 4)) || usage
    number g "$2"; number G "$3" 1; number NPROC "$4" 1
    (($2 < $3)) || fail "group $2 of $3: g must be below G (groups 0..$(($3 - 1)))"
    g=$2; shift
    refuse_running "$g"
    group "$@"
    rc=0
    wait "$GROUP_PID" || rc=$?
    ended "group$g" "$GROUP_PID"
    verdict "$g:$rc" ;;
  stop)
    (($# == 2)) || usage
    number g "$2"
    pid=$(group_running "$2") || fail "group $2 is not running (no live pid in $DIR/group$2.pid)"
    kill -TERM "$pid" && echo "group $2: stopping (it saves, then exits)" ;;
  *) usage ;;
esac
