#!/usr/bin/env bash
# The scheduler's real workflow from a shell: daemon in the background, two jobs submitted, status
# while they run (limits, memory, shares, step times), their logs with tf-antman's exit report,
# daemon stopped.
#   bash examples/cli_demo.sh            (after scripts/setup.sh; any user the config admits)
set -euo pipefail
cd "$(dirname "$0")/.."
SL=${SCHEDULER_LITE:-scheduler-lite}
command -v "$SL" >/dev/null || SL=.venv/bin/scheduler-lite
CFG=examples/scheduler.toml
PY=$PWD/.venv/bin/python
mkdir -p out
sl() { "$SL" --config "$CFG" "$@"; }

echo "== scheduler-lite serve (in the background, log in out/demo-daemon.log)"
sl serve > out/demo-daemon.log 2>&1 &
DAEMON=$!
trap 'kill "$DAEMON" 2>/dev/null || true; wait "$DAEMON" 2>/dev/null || true' EXIT
for _ in $(seq 100); do sl list >/dev/null 2>&1 && break; sleep 0.2; done

echo "== two jobs: a guarantee job and an opportunistic one"
G=$(sl submit --tenant research --type guarantee -- "$PY" examples/colocate_job.py --steps 400 --width 512)
O=$(sl submit --tenant batch --type opportunistic -- "$PY" examples/colocate_job.py --steps 400 --width 512 --seed 2)
echo "submitted $G $O"

echo "== status while both run"
# Until both report statistics (TensorFlow takes a few seconds to start).
for _ in $(seq 240); do
  sl status --json | "$PY" -c 'import json, sys
jobs = [j for g in json.load(sys.stdin)["gpus"] for j in g["jobs"]]
sys.exit(0 if len(jobs) == 2 and all(j["step"] for j in jobs) else 1)' && break
  sleep 0.5
done
sl status

echo "== waiting for both to finish"
sl logs --follow "$G" | tail -n 2
sl logs --follow "$O" | tail -n 2
echo "== what tf-antman did, from the jobs' own logs"
sl logs --stderr "$G" | grep "at exit" || true
sl logs --stderr "$O" | grep "at exit" || true
sl list

echo "== stopping the daemon"
kill "$DAEMON"; wait "$DAEMON" || true
trap - EXIT
