"""Fake training jobs for the daemon and CLI tests, and a check that the fake follows the protocol.

A fake job is a plain Python process (no TensorFlow) that speaks the job side of the file protocol
through tf_antman.protocol: each "step" it applies the newest control.json (memory limit of its
device 0, compute share) and rewrites stats.json with the settings in force.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from scheduler_lite.config import Config, parse_config
from tests.scheduler.configs import Table, merge_tables, scheduler_config
from tf_antman.protocol import (
    Control,
    MemoryLimit,
    parse_stats,
    stats_path,
    write_control,
)

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20

# argv: steps (0 = until killed), step seconds, memory demand bytes, exit status, achieved share
FAKE_JOB = r"""
import os, signal, statistics, sys, time
from pathlib import Path
from tf_antman.protocol import (DeviceStats, ProtocolError, Stats, atomic_write_text, control_path,
                                parse_control, read_text, stats_path, temp_dir)
job_dir = Path(os.environ["ANTMAN_JOB_DIR"])
steps, step_s, demand, code = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
achieved = float(sys.argv[5]) if len(sys.argv) > 5 else None
time.sleep(float(os.environ.get("FAKE_START_DELAY_S", "0")))  # a TF job takes seconds to start
if os.environ.get("FAKE_RUNS_LOG"):  # one line per start: a job started twice shows twice
    with open(os.environ["FAKE_RUNS_LOG"], "a") as log:
        log.write(os.environ["SCHEDULER_LITE_JOB_ID"] + "\n")
if os.environ.get("FAKE_IGNORE_SIGTERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
limit = int(os.environ["ANTMAN_MEMORY_LIMIT"])
share = float(os.environ["ANTMAN_COMPUTE_SHARE"])
applied = seen = rejected = n = seq = 0
window = []
print("env", os.environ["ANTMAN_DEVICE"], os.environ["ANTMAN_DEVICE_ID"], os.environ["SCHEDULER_LITE_GPUS"],
      flush=True)
print("to stderr", file=sys.stderr, flush=True)
while steps <= 0 or n < steps:
    try:
        text = read_text(control_path(job_dir))
        if text:
            c = parse_control(text)
            if c.seq > seen:
                seen = c.seq
                if any(m.device != int(os.environ["ANTMAN_DEVICE_ID"]) for m in c.memory_limits):
                    rejected += 1  # tf-antman's agent refuses the whole control (one device a process)
                else:
                    applied = c.seq
                    limit = next((m.limit_bytes for m in c.memory_limits), limit)
                    share = share if c.compute_share is None else c.compute_share
    except ProtocolError as e:
        print("control refused:", e, file=sys.stderr, flush=True)
    t = time.monotonic()
    time.sleep(step_s)
    n += 1
    window = (window + [(time.monotonic() - t) * 1000])[-32:]
    on = min(demand, limit)
    seq += 1
    s = Stats(seq=seq, pid=os.getpid(), state="running", step=n, last_step_ms=window[-1],
              step_ms_window=tuple(window), step_ms_median=statistics.median(window),
              devices=(DeviceStats(0, limit, on, on, on, on, demand - on, demand - on, 0),),
              compute_share=share, achieved_share=achieved, control_seq_applied=applied,
              controls_applied=applied, controls_rejected=rejected, wall_time=time.time())
    atomic_write_text(stats_path(job_dir), s.to_json(), fsync=False, tmp_dir=temp_dir(job_dir))
print("done", n, flush=True)
sys.exit(code)
"""

JOB_ENV = {"PYTHONPATH": str(REPO)}


def fake_command(steps: int = 0, step_s: float = 0.02, demand: int = 512 * MIB, exit_code: int = 0,
                 achieved: float | None = 0.3) -> list[str]:
    cmd = [sys.executable, "-c", FAKE_JOB, str(steps), str(step_s), str(demand), str(exit_code)]
    return cmd + ([str(achieved)] if achieved is not None else [])


def make_config(state_dir: Path, gpus: int = 1, memory: str = "1GiB", quotas: Mapping[str, int] | None = None,
                **sections: Table) -> Config:
    """`gpus` GPUs of one NVLink group; tenant A's quota is every GPU, B is opportunistic only."""
    data = scheduler_config(
        [memory] * gpus, quotas or {"A": gpus, "B": 0}, nvlink_group="g0", state_dir=str(state_dir),
        jobs={"cancel_grace_s": 2},
        daemon={"tick_interval_s": 0.05, "schedule_interval_s": 0.2, "utilisation_window_s": 1.0},
        coordinator={"min_memory_bytes": "64MiB", "round_interval_s": 0.2})
    return parse_config(merge_tables(data, **sections), base_dir=state_dir)


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def test_fake_job_writes_valid_stats_and_applies_controls(tmp_path: Path) -> None:
    env = {**os.environ, **JOB_ENV, "ANTMAN_JOB_DIR": str(tmp_path), "ANTMAN_MEMORY_LIMIT": str(256 * MIB),
           "ANTMAN_COMPUTE_SHARE": "1.0", "ANTMAN_DEVICE": "emulated", "ANTMAN_DEVICE_ID": "0",
           "SCHEDULER_LITE_GPUS": "0"}
    proc = subprocess.Popen(fake_command(demand=300 * MIB), env=env, stdout=subprocess.DEVNULL)
    try:
        path = stats_path(tmp_path)
        assert wait_for(lambda: path.exists())
        first = parse_stats(path.read_text())
        assert first.devices[0].limit_bytes == 256 * MIB
        assert first.devices[0].host_in_use_bytes == 44 * MIB  # the demand past the limit
        write_control(tmp_path, Control(seq=1, memory_limits=(MemoryLimit(0, 100 * MIB),), compute_share=0.25))

        def applied() -> bool:
            s = parse_stats(path.read_text())
            return s.control_seq_applied == 1
        assert wait_for(applied)
        after = parse_stats(path.read_text())
        assert after.devices[0].limit_bytes == 100 * MIB
        assert after.devices[0].host_in_use_bytes == 200 * MIB
        assert after.compute_share == 0.25
    finally:
        proc.kill()
        proc.wait()
