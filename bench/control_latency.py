"""How long after the coordinator renames control.json is the setting in force in a training job?

A real Keras model trains in a child process (CPU) with a JobAgent driven by a Keras callback at
every train batch end; its actuator records the monotonic time at which each memory limit takes
effect. This process plays the coordinator: it writes control changes with an atomic rename, notes
the rename time and waits for the acknowledgement in stats.json before the next one.

Latency beyond the step boundary (docs/protocol.md, "Measured") for one control:
    in_force_time - first_step_end_after_rename
where first_step_end_after_rename is the first train-batch end whose callback starts after the
rename. A control can only take effect at a step boundary, so waiting for that first boundary is
unavoidable; whatever comes on top is the cost of noticing the file. If the watcher is too late
for the first boundary, the control waits for a later one and the step time(s) in between count.

Baseline, same run: the same agent polling control.json once per second without inotify, which is
what Alibaba's public AntMan does (FileListener::kSleepIntervalInUs = 1 s in
tensorflow/contrib/resource_management/file_listener.h of alibaba/GPU-scheduler-for-deep-learning).

The two modes above drive a simulated job (tests/protocol/simulated_job.py's SimulatedJob: the
agent is tf-antman's, the "allocator" only logs the limit). A third measurement, `real`, runs an
unchanged Keras script (examples/colocate_job.py) under tf-antman itself, as scheduler_lite starts
a job on an emulated device (ANTMAN_* set, the checkout's activation hook): its own agent takes the
control at a step boundary and its own allocator applies the limit (every other control drops it
to ~1 MiB, below what the job holds, so cached blocks over it are to be released; the reserved
bytes before and in the acknowledging stats are printed). Step ends are not visible from outside
that job, so its figure is rename -> in force: the `wall_time` of the first stats.json whose
`control_seq_applied` and device limit show the control, minus the wall time before the rename
(both time.time() on this machine; stats are written when a control is applied and every
ANTMAN_STATS_INTERVAL_MS otherwise).

Usage: python bench/control_latency.py [--quick] [--controls N] [--no-real]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from bisect import bisect_left
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tf_antman.protocol import Control, MemoryLimit, Stats, control_path, read_stats, temp_dir  # noqa: E402

MODES = {
    # name: JobAgent options
    "inotify": {"use_inotify": True, "reread_interval_s": 1.0},
    "poll-1s": {"use_inotify": False, "reread_interval_s": 1.0},
}
BASE_LIMIT = 1 << 30  # control i sets device 0 to BASE_LIMIT + i: the value tells which control it was
WARMUP_STEPS = 30
STOP_FILE = "stop"
RECORDS_FILE = "records.json"


# ------------------------------------------------------------------------------------------------
# The training job (child process)


def run_job(job_dir: Path, mode: str) -> None:
    import keras
    import numpy as np

    from tests.protocol.simulated_job import SimulatedJob
    from tf_antman.agent import JobAgent

    job = SimulatedJob(devices=1, in_use_bytes=512 << 20)
    agent = JobAgent(job_dir, job, job, **MODES[mode])
    step_ends: list[float] = []

    class AgentCallback(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: object = None) -> None:
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            step_ends.append(time.monotonic())
            agent.step_end(time.perf_counter() - self._t0)
            if len(step_ends) % 10 == 0 and (job_dir / STOP_FILE).exists():
                self.model.stop_training = True

    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4096, 128)).astype("float32")
    y = rng.integers(0, 10, 4096)
    # One endless epoch: epoch ends would add pauses between steps that have nothing to do with
    # control latency.
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(128).prefetch(4)
    model = keras.Sequential(
        [
            keras.Input((128,)),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    agent.start()
    model.fit(data, steps_per_epoch=10**9, epochs=1, shuffle=False, verbose=0, callbacks=[AgentCallback()])
    watch_mode = agent.watch_mode
    agent.close()
    applied = [(a.value, a.at) for a in job.log if a.what == "memory_limit"]
    step_ms = statistics.median(1000 * (b - a) for a, b in itertools.pairwise(step_ends))
    (job_dir / RECORDS_FILE).write_text(
        json.dumps({"step_ends": step_ends, "applied": applied, "median_step_ms": step_ms, "mode": watch_mode})
    )


# ------------------------------------------------------------------------------------------------
# The coordinator (this process)


def wait_stats(job_dir: Path, done, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = read_stats(job_dir)
        if stats is not None and done(stats):
            return stats
        time.sleep(0.002)
    raise SystemExit(f"timed out waiting for {what}")


def write_control_timed(job_dir: Path, control: Control) -> float:
    """files.write_control, step by step, returning the monotonic time just before the rename.

    The time before (not after) the rename: the writer can be descheduled right after it, and the
    job may apply the control before this process runs again. Latencies are upper bounds.
    """
    fd, tmp = tempfile.mkstemp(prefix=".control.json.", suffix=".tmp", dir=temp_dir(job_dir))
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        os.fchmod(handle.fileno(), 0o644)
        handle.write(control.to_json())
        handle.flush()
        os.fsync(handle.fileno())
    before = time.monotonic()
    os.replace(tmp, control_path(job_dir))
    return before


def measure(mode: str, controls: int, rng: random.Random, verbose: bool) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix=f"antman-bench-{mode}-") as tmp:
        job_dir = Path(tmp)
        child = subprocess.Popen(
            [sys.executable, __file__, "--job", str(job_dir), "--mode", mode],
            env={"TF_CPP_MIN_LOG_LEVEL": "3", **os.environ, "PYTHONPATH": str(ROOT)},
        )
        try:
            wait_stats(job_dir, lambda s: s.step >= WARMUP_STEPS, "the job to warm up")
            renames: list[float] = []
            for i in range(1, controls + 1):
                # A random phase against the step boundaries and against the 1 s poll of the baseline
                # (writing right after the previous acknowledgement would lock onto the poll).
                time.sleep(rng.uniform(0.02, 1.02))
                control = Control(seq=i, memory_limits=(MemoryLimit(0, BASE_LIMIT + i),))
                renames.append(write_control_timed(job_dir, control))
                wait_stats(job_dir, lambda s, i=i: s.control_seq_applied >= i, f"control {i}", timeout=30.0)
            (job_dir / STOP_FILE).touch()
            if child.wait(timeout=120) != 0:
                raise SystemExit(f"the {mode} job failed")
        finally:
            if child.poll() is None:
                child.kill()
        records = json.loads((job_dir / RECORDS_FILE).read_text())
    in_force = {int(value) - BASE_LIMIT: at for value, at in records["applied"]}
    step_ends: list[float] = records["step_ends"]
    beyond, total, first_boundary = [], [], 0
    for i, renamed in enumerate(renames, start=1):
        boundary = step_ends[bisect_left(step_ends, renamed)]
        beyond.append(1000 * (in_force[i] - boundary))
        total.append(1000 * (in_force[i] - renamed))
        first_boundary += in_force[i] - boundary < 0.001 * records["median_step_ms"] / 2
    if verbose:
        for i, renamed in enumerate(renames, start=1):
            b = step_ends[bisect_left(step_ends, renamed)]
            print(mode, i, f"boundary +{1000*(b-renamed):.1f}ms in_force +{1000*(in_force[i]-renamed):.1f}ms")
    return {
        "mode": mode,
        "watch": records["mode"],
        "controls": controls,
        "median_step_ms": records["median_step_ms"],
        "beyond_ms": beyond,
        "total_ms": total,
        "at_first_boundary": first_boundary / controls,
    }


REAL_JOB = ROOT / "examples" / "colocate_job.py"
REAL_DEVICE_MEMORY = 4 << 30
SMALL_LIMIT = 1 << 20


def measure_real(controls: int, rng: random.Random, verbose: bool) -> dict[str, object]:
    """The real job: tf-antman's agent and allocator in an unchanged Keras script."""
    with tempfile.TemporaryDirectory(prefix="antman-bench-real-") as tmp:
        job_dir = Path(tmp)
        temp_dir(job_dir).mkdir(exist_ok=True)
        env = {"TF_CPP_MIN_LOG_LEVEL": "3", **os.environ, "PYTHONPATH": str(ROOT), "ANTMAN_ENABLE": "1",
               "ANTMAN_JOB_DIR": str(job_dir), "ANTMAN_DEVICE": "emulated", "ANTMAN_DEVICE_ID": "0",
               "ANTMAN_DEVICE_MEMORY": str(REAL_DEVICE_MEMORY), "ANTMAN_MEMORY_LIMIT": str(2 << 30),
               "ANTMAN_COMPUTE_SHARE": "1.0"}
        child = subprocess.Popen([sys.executable, str(REAL_JOB), "--steps", "10000000", "--print-every", "100000"],
                                 env=env, stdout=subprocess.DEVNULL)
        try:
            warm = wait_stats(job_dir, lambda s: s.step >= WARMUP_STEPS, "the real job to warm up")
            total: list[float] = []
            step_ms: list[float] = []
            reserved = max((d.reserved_bytes for d in warm.devices), default=0)
            first_drop: tuple[int, int] | None = None  # reserved bytes before -> at the first lowered limit
            for i in range(1, controls + 1):
                time.sleep(rng.uniform(0.02, 1.02))
                # Every other control goes down to ~1 MiB, below what the job holds: the allocator
                # must release its cached blocks over the limit (the rest spills to host memory).
                limit = BASE_LIMIT + i if i % 2 else SMALL_LIMIT + i
                control = Control(seq=i, memory_limits=(MemoryLimit(0, limit),))
                before = time.time()
                write_control_timed(job_dir, control)

                def shows(s: Stats, i: int = i, limit: int = limit) -> bool:
                    return s.control_seq_applied >= i and any(d.limit_bytes == limit for d in s.devices)

                stats = wait_stats(job_dir, shows, f"real control {i}", timeout=30.0)
                total.append(1000 * (stats.wall_time - before))
                now_reserved = max((d.reserved_bytes for d in stats.devices), default=0)
                if limit < BASE_LIMIT and first_drop is None:
                    first_drop = (reserved, now_reserved)
                reserved = now_reserved
                if stats.step_ms_median is not None:
                    step_ms.append(stats.step_ms_median)
                if verbose:
                    shown = [(d.limit_bytes, d.in_use_bytes, d.reserved_bytes) for d in stats.devices]
                    print("real", i, f"in_force +{total[-1]:.1f}ms (step {stats.step}; limit, in use, reserved: {shown})")
        finally:
            child.terminate()
            try:
                child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                child.kill()
    return {"mode": "real", "controls": controls, "total_ms": total, "first_drop": first_drop,
            "median_step_ms": statistics.median(step_ms) if step_ms else float("nan")}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="30 controls per mode instead of 100")
    parser.add_argument("--controls", type=int, default=None)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--verbose", action="store_true", help="print every control's timings")
    parser.add_argument("--no-real", action="store_true", help="skip the real tf-antman job (simulated job only)")
    parser.add_argument("--job", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=sorted(MODES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job is not None:
        run_job(args.job, args.mode)
        return
    controls = args.controls or (30 if args.quick else 100)
    if not 1 <= controls <= 10_000:
        raise SystemExit("--controls must be in [1, 10000]")
    rng = random.Random(args.seed)
    results = [measure(mode, controls, rng, args.verbose) for mode in MODES]

    print(f"control latency, {controls} controls per mode, real Keras training on CPU")
    header = (
        f"{'mode':<9} {'watch':<8} {'step ms':>8} {'p50 beyond':>11} {'p99 beyond':>11} "
        f"{'p50 total':>10} {'p99 total':>10} {'at 1st boundary':>16}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r['mode']:<9} {r['watch']:<8} {r['median_step_ms']:>8.2f} "
            f"{percentile(r['beyond_ms'], 50):>9.2f}ms {percentile(r['beyond_ms'], 99):>9.2f}ms "
            f"{percentile(r['total_ms'], 50):>8.2f}ms {percentile(r['total_ms'], 99):>8.2f}ms "
            f"{100 * r['at_first_boundary']:>15.0f}%"
        )
    ours, base = results
    figures = {
        "p50_ms_beyond_step": round(percentile(ours["beyond_ms"], 50), 3),
        "p99_ms_beyond_step": round(percentile(ours["beyond_ms"], 99), 3),
        "baseline_poll_1s_p50_ms_beyond_step": round(percentile(base["beyond_ms"], 50), 3),
        "baseline_poll_1s_p99_ms_beyond_step": round(percentile(base["beyond_ms"], 99), 3),
        "p50_ms_rename_to_in_force": round(percentile(ours["total_ms"], 50), 3),
        "baseline_poll_1s_p50_ms_rename_to_in_force": round(percentile(base["total_ms"], 50), 3),
        "median_step_ms": round(ours["median_step_ms"], 3),
        "controls_per_mode": controls,
        "at_first_boundary": round(ours["at_first_boundary"], 3),
        "baseline_at_first_boundary": round(base["at_first_boundary"], 3),
    }
    for q in (50, 99):
        ours_q = max(figures[f"p{q}_ms_beyond_step"], 1e-3)
        figures[f"p{q}_ratio_baseline_over_ours"] = round(figures[f"baseline_poll_1s_p{q}_ms_beyond_step"] / ours_q, 1)
    if not args.no_real:
        real = measure_real(controls, rng, args.verbose)
        print(f"real tf-antman job (examples/colocate_job.py, its own agent and allocator): step "
              f"{real['median_step_ms']:.2f} ms, rename -> in force p50 {percentile(real['total_ms'], 50):.2f} ms, "
              f"p99 {percentile(real['total_ms'], 99):.2f} ms; its allocator's reserved bytes before -> when the "
              f"first ~1 MiB limit was acknowledged: {real['first_drop']}")
        figures["real_p50_ms_rename_to_in_force"] = round(percentile(real["total_ms"], 50), 3)
        figures["real_p99_ms_rename_to_in_force"] = round(percentile(real["total_ms"], 99), 3)
        figures["real_median_step_ms"] = round(float(real["median_step_ms"]), 3)
        figures["real_reserved_bytes_before_after_first_low_limit"] = real["first_drop"]
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
