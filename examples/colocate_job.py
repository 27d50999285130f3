"""A small Keras training job to co-locate under scheduler_lite; nothing in it knows about tf-antman.

    .venv/bin/python examples/colocate_job.py --width 512 --steps 300 --batch 64
    scheduler-lite submit --tenant research --type guarantee -- .venv/bin/python examples/colocate_job.py --steps 2000

Synthetic data (no downloads). Memory grows with --width (two hidden layers of width x width
weights) and --batch; run time with --steps. One progress line every --print-every steps
(step, mean step time of the last chunk, throughput), and a final JSON line with the figures.
Under scheduler_lite the job runs under tf-antman automatically (the scheduler sets ANTMAN_*), and
Keras fit gets tf-antman's step hooks, so memory limits and compute shares apply at step boundaries.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=256, help="hidden layer width (memory grows with it)")
    p.add_argument("--steps", type=int, default=200, help="training steps in all")
    p.add_argument("--batch", type=int, default=64, help="examples per step")
    p.add_argument("--print-every", type=int, default=20, help="steps between progress lines")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    for name in ("width", "steps", "batch", "print_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    import tensorflow as tf  # after the arguments: --help and a usage error need no TensorFlow

    tf.keras.utils.set_random_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    chunk = min(args.print_every, args.steps)
    n = chunk * args.batch  # one chunk of data, repeated: the input pipeline costs nothing
    x = rng.normal(size=(n, 64)).astype("float32")
    y = np.argmax(x @ rng.normal(size=(64, 10)).astype("float32"), axis=1)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch).repeat()

    model = tf.keras.Sequential([
        tf.keras.Input(shape=(64,)),
        tf.keras.layers.Dense(args.width, activation="relu"),
        tf.keras.layers.Dense(args.width, activation="relu"),
        tf.keras.layers.Dense(10),
    ])
    model.compile(optimizer="adam", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    started = time.monotonic()
    chunk_times: list[float] = []

    class Progress(tf.keras.callbacks.Callback):
        def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
            self.t = time.monotonic()

        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            seconds = time.monotonic() - self.t
            chunk_times.append(seconds)
            step = (epoch + 1) * chunk
            print(f"step {step}/{args.steps}  {1000 * seconds / chunk:.1f} ms/step  "
                  f"{chunk * args.batch / seconds:.0f} examples/s  loss {logs.get('loss', float('nan')):.3f}",
                  flush=True)

    model.fit(data, epochs=args.steps // chunk, steps_per_epoch=chunk, verbose=0, callbacks=[Progress()])
    wall = time.monotonic() - started
    steps = chunk * len(chunk_times)
    print(json.dumps({"steps": steps, "mean_step_ms": 1000 * sum(chunk_times) / max(steps, 1),
                      "wall_s": wall, "job_id": os.environ.get("SCHEDULER_LITE_JOB_ID")}), flush=True)


if __name__ == "__main__":
    main()
