"""A training job for the benchmarks: a Keras MLP or a custom tf.function loop, timed per step.

Prints one JSON line at the end: step times (s) of the timed steps, final loss, compute and
memory statistics when tf-antman is active. Options: --mode keras|loop, --steps, --warmup,
--width, --batch, --share-schedule "step:share,step:share" (changes the share mid-run),
--duration (run until this many seconds instead of a step count), --inner N (loop mode: N
training steps per Python step, in a tf.range loop inside the tf.function, so the job keeps its
device busy without Python gaps), --input const|tfdata|pyfunc (loop mode: the batch comes from
a constant, a tf.data pipeline with map + prefetch, or the same with a py_function map that
sleeps --input-sleep-ms), --flip-shares N (a thread changes the share N times, 5 ms apart),
--phases "1,0.25,1,..." --phase-s P --settle-s S [--watch-pids PID,...] (loop mode: a thread sets each share in turn for
P seconds and, from S seconds after the change to the end of the phase, measures the job's device
work with the kernel's per-thread accounting, bench/_threadcpu.py; the job runs until the last
phase ends). Loop mode also reports each step's (start, end) on the system-wide monotonic clock,
so that another process's phases can be matched against them.
"""

import argparse
import json
import threading
import time

import numpy as np
import tensorflow as tf
from _threadcpu import device_thread_times, machine_busy_s, process_cpu_s


def input_pipeline(a: argparse.Namespace, x: tf.Tensor, y: tf.Tensor) -> tf.data.Dataset:
    """Endless batches of the job's shape through map (+ a py_function map) and prefetch."""
    rows = tf.data.Dataset.from_tensor_slices((tf.tile(x, [4, 1]), tf.tile(y, [4]))).repeat()
    rows = rows.map(lambda u, v: (u * 1.0, v), num_parallel_calls=2)
    ds = rows.batch(a.batch, drop_remainder=True)
    if a.input == "pyfunc":
        sleep_s = a.input_sleep_ms / 1000.0

        def py_map(u: np.ndarray) -> np.ndarray:
            if sleep_s:
                time.sleep(sleep_s)
            return u

        ds = ds.map(lambda u, v: (tf.ensure_shape(tf.numpy_function(py_map, [u], tf.float32), u.shape), v))
    return ds.prefetch(2)


def flip_shares(antman, n: int) -> None:  # noqa: ANN001 - the tf_antman module
    """n share changes, 5 ms apart, through every kind of value (pause included); ends at 1."""
    shares = [0.3, 0.0, 0.7, 1.0, 0.05, 0.5]
    for i in range(n):
        antman.set_compute_share(shares[i % len(shares)])
        time.sleep(0.005)
    antman.set_compute_share(1.0)


def run_phases(antman, shares: list[float], phase_s: float, settle_s: float,  # noqa: ANN001
               watch: list[int], out: list[dict], done: threading.Event) -> None:
    """Each share for phase_s seconds; the device work of the phase after settle_s is measured
    by the kernel (not by the op manager, whose share it judges). "foreign_cpu" is what the rest
    of the machine (not this job, not the processes in `watch`) used meanwhile, in CPU-seconds:
    a phase with foreign load did not measure this job alone. Ends at share 1."""

    def sample() -> tuple:
        return (device_thread_times(), time.monotonic(), time.process_time(), machine_busy_s(),
                sum(process_cpu_s(pid) for pid in watch))

    for share in shares:
        antman.set_compute_share(share)  # from any thread, effective from the next admission
        time.sleep(settle_s)
        d0, t0, p0, m0, w0 = sample()
        time.sleep(phase_s - settle_s)
        d1, t1, p1, m1, w1 = sample()
        out.append({"share": share, "t0": t0, "t1": t1, "wall": t1 - t0,
                    "device_cpu": d1.on_cpu_s - d0.on_cpu_s,
                    "device_runnable": d1.runnable_s - d0.runnable_s, "process_cpu": p1 - p0,
                    "watched_cpu": w1 - w0, "foreign_cpu": (m1 - m0) - (p1 - p0) - (w1 - w0)})
    antman.set_compute_share(1.0)
    done.set()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["keras", "loop"], default="loop")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--duration", type=float, default=0.0)
    p.add_argument("--share-schedule", default="")
    p.add_argument("--inner", type=int, default=1)
    p.add_argument("--input", choices=["const", "tfdata", "pyfunc"], default="const")
    p.add_argument("--input-sleep-ms", type=float, default=0.0)
    p.add_argument("--flip-shares", type=int, default=0)
    p.add_argument("--phases", default="")
    p.add_argument("--phase-s", type=float, default=3.0)
    p.add_argument("--settle-s", type=float, default=0.5)
    p.add_argument("--watch-pids", default="", help="comma-separated pids whose CPU is not foreign load")
    a = p.parse_args()
    phase_shares = [float(v) for v in a.phases.split(",") if v]

    antman = None
    try:
        import tf_antman

        antman = tf_antman if tf_antman.is_active() else None
    except ImportError:
        pass
    schedule = {int(k): float(v) for k, v in (kv.split(":") for kv in a.share_schedule.split(",") if kv)}

    tf.keras.utils.set_random_seed(a.seed)
    rng = np.random.default_rng(a.seed)
    x = tf.constant(rng.normal(size=(a.batch, 256)).astype("float32"))
    y = tf.constant(rng.integers(0, 10, a.batch))
    model = tf.keras.Sequential([tf.keras.Input((256,)), tf.keras.layers.Dense(a.width, activation="relu"),
                                 tf.keras.layers.Dense(a.width, activation="relu"), tf.keras.layers.Dense(10)])
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = tf.keras.optimizers.Adam(1e-3)

    times: list[float] = []
    losses: list[float] = []
    cpu: list[float] = []
    spans: list[tuple[float, float]] = []
    phases: list[dict] = []

    if a.mode == "keras":
        model.compile(optimizer=opt, loss=loss_fn)

        class Timer(tf.keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                self.t0 = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                times.append(time.perf_counter() - self.t0)

        ds = tf.data.Dataset.from_tensors((x, y)).repeat(a.steps + a.warmup)
        h = model.fit(ds, epochs=1, verbose=0, callbacks=[Timer()])
        times = times[a.warmup:]
        losses = h.history["loss"]
    else:
        def one_step(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables, strict=True))
            return loss

        @tf.function
        def train_step(xb, yb):
            loss = tf.constant(0.0)
            for _ in tf.range(a.inner):  # a While op: its inner kernels pass the manager one by one
                loss = one_step(xb, yb)
            return loss

        batches = iter(input_pipeline(a, x, y)) if a.input != "const" else None
        flipper = None
        if a.flip_shares and antman:
            flipper = threading.Thread(target=flip_shares, args=(antman, a.flip_shares), daemon=True)
            flipper.start()
        phases_done = threading.Event()
        deadline = None
        i = 0
        while True:
            if i in schedule and antman:
                antman.set_compute_share(schedule[i])
            if i == a.warmup:
                start_wall = time.perf_counter()
                start_cpu = time.process_time()
                start_compute = antman.compute_stats() if antman else None
                if a.duration:
                    deadline = start_wall + a.duration
                if phase_shares and antman:
                    threading.Thread(target=run_phases, daemon=True,
                                     args=(antman, phase_shares, a.phase_s, a.settle_s,
                                           [int(v) for v in a.watch_pids.split(",") if v], phases, phases_done)).start()
            t0, c0, m0 = time.perf_counter(), time.process_time(), time.monotonic()
            xb, yb = next(batches) if batches is not None else (x, y)
            loss = train_step(xb, yb)
            lv = float(loss)
            if antman:
                antman.step_end(time.perf_counter() - t0)
            if i >= a.warmup:
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
                spans.append((m0, time.monotonic()))
                losses.append(lv)
            i += 1
            if phase_shares and phases_done.is_set():
                break
            if deadline is not None and time.perf_counter() >= deadline:
                break
            if deadline is None and not phase_shares and i >= a.steps + a.warmup and not a.duration:
                break
        if flipper is not None:
            flipper.join()
    out = {"step_times": times, "cpu_times": cpu, "losses": losses}
    if a.mode == "loop":
        out["wall"] = time.perf_counter() - start_wall
        out["cpu_total"] = time.process_time() - start_cpu  # every thread of the process
        out["step_spans"] = spans
        out["phases"] = phases
    if antman:
        out["compute"] = antman.compute_stats()
        if a.mode == "loop":
            out["compute_start"] = start_compute
        out["memory"] = antman.memory_stats()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
