"""A training job for the benchmarks: a Keras MLP or a custom tf.function loop, timed per step.

Prints one JSON line at the end: step times (s) of the timed steps, final loss, compute and
memory statistics when tf-antman is active. Options: --mode keras|loop, --steps, --warmup,
--width, --batch, --share-schedule "step:share,step:share" (changes the share mid-run),
--duration (run until this many seconds instead of a step count).
"""

import argparse
import json
import time

import numpy as np
import tensorflow as tf


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
    a = p.parse_args()

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
        @tf.function
        def train_step():
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables, strict=True))
            return loss

        deadline = None
        i = 0
        while True:
            if i in schedule and antman:
                antman.set_compute_share(schedule[i])
            if i == a.warmup:
                start_wall = time.perf_counter()
                start_compute = antman.compute_stats() if antman else None
                if a.duration:
                    deadline = start_wall + a.duration
            t0, c0 = time.perf_counter(), time.process_time()
            loss = train_step()
            lv = float(loss)
            if antman:
                antman.step_end(time.perf_counter() - t0)
            if i >= a.warmup:
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
                losses.append(lv)
            i += 1
            if deadline is not None and time.perf_counter() >= deadline:
                break
            if deadline is None and i >= a.steps + a.warmup and not a.duration:
                break
    out = {"step_times": times, "cpu_times": cpu, "losses": losses}
    if a.mode == "loop":
        out["wall"] = time.perf_counter() - start_wall
    if antman:
        out["compute"] = antman.compute_stats()
        if a.mode == "loop":
            out["compute_start"] = start_compute
        out["memory"] = antman.memory_stats()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
