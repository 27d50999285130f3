#!/usr/bin/env bash
# The scheduler's real workflow from a shell, on one emulated GPU (examples/demo.toml): the daemon
# in the background; an opportunistic job takes the idle GPU; a guarantee job arrives and the local
# coordinator shrinks and throttles the opportunistic one to protect it, then gives room back;
# status while they share the GPU (limits in force, memory, host fallback, shares, step times);
# their logs with tf-antman's exit report; the daemon stopped.
#   bash examples/cli_demo.sh            (after scripts/setup.sh; about 1 minute on 2 idle cores)
# DEMO_CONFIG (default examples/demo.toml) and DEMO_OUT (default out: the daemon's log, and the
# store the config names there, emptied first) let a test run it without touching out/.
set -euo pipefail
cd "$(dirname "$0")/.."
SL=${SCHEDULER_LITE:-scheduler-lite}
command -v "$SL" >/dev/null || SL=.venv/bin/scheduler-lite
CFG=${DEMO_CONFIG:-examples/demo.toml}
PY=$PWD/.venv/bin/python
OUT=${DEMO_OUT:-out}
mkdir -p "$OUT"
rm -rf "$OUT/demo-state"   # a fresh store each run: the demo shows only its own jobs
sl() { "$SL" --config "$CFG" "$@"; }

echo "== scheduler-lite serve (in the background, log in $OUT/demo-daemon.log)"
# Not through sl(): a backgrounded function is a subshell, and $! would name that subshell, which a
# kill stops while the daemon it started keeps running.
"$SL" --config "$CFG" serve > "$OUT/demo-daemon.log" 2>&1 &
DAEMON=$!
trap 'kill "$DAEMON" 2>/dev/null || true; wait "$DAEMON" 2>/dev/null || true' EXIT
for _ in $(seq 100); do sl list >/dev/null 2>&1 && break; sleep 0.2; done

echo "== an opportunistic job on the idle GPU"
O=$(sl submit --tenant batch --type opportunistic -- "$PY" examples/colocate_job.py --steps 3000 --width 512 --seed 2)
echo "submitted $O"
for _ in $(seq 240); do
  sl status --json | "$PY" -c 'import json, sys
jobs = [j for g in json.load(sys.stdin)["gpus"] for j in g["jobs"]]
sys.exit(0 if jobs and all(j["step"] for j in jobs) else 1)' && break
  sleep 0.5
done
sl status

echo "== a guarantee job arrives on the same GPU"
G=$(sl submit --tenant research --type guarantee -- "$PY" examples/colocate_job.py --steps 2000 --width 512)
echo "submitted $G"

echo "== status while both run"
# Until both report statistics (TensorFlow takes a few seconds to start).
for _ in $(seq 240); do
  sl status --json | "$PY" -c 'import json, sys
jobs = [j for g in json.load(sys.stdin)["gpus"] for j in g["jobs"]]
sys.exit(0 if len(jobs) == 2 and all(j["step"] for j in jobs) else 1)' && break
  sleep 0.5
done
sl status
sleep 8
echo "== a few coordinator rounds later"
sl status

echo "== waiting for both to finish"
sl logs --follow "$G" | tail -n 2
sl logs --follow "$O" | tail -n 2
echo "== what tf-antman did, from the jobs' own logs"
# tf-antman's exit report is a WARNING for a job it slowed (host memory, paused, throttled), else
# an INFO line, which a job's log shows only at absl's INFO verbosity (docs/configuration.md).
exit_report() {  # $1: job id, $2: its role
  local line
  line=$(sl logs --stderr "$1" | grep -m1 "tf-antman: at exit" || true)
  echo "$1 ($2): ${line:-no warning at exit: tf-antman did not slow it (no host memory, pause or throttling)}"
}
exit_report "$G" guarantee
exit_report "$O" opportunistic
sl list

echo "== stopping the daemon"
kill "$DAEMON"; wait "$DAEMON" || true
trap - EXIT
