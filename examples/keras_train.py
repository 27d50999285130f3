"""A plain Keras training script: nothing in it knows about tf-antman.

    .venv/bin/python examples/keras_train.py                   # stock TensorFlow
    ANTMAN_ENABLE=1 .venv/bin/python examples/keras_train.py   # the same script under tf-antman
    ANTMAN_ENABLE=1 .venv/bin/python examples/keras_train.py --verbose   # which it says: "tf-antman: active ..."
    ANTMAN_MEMORY_LIMIT=64MiB .venv/bin/python examples/keras_train.py --width 2048   # over its limit

Synthetic data (no downloads): a classification task a small MLP learns in a few epochs.
tf-antman logs through absl: its warnings (such as the exit report of a job it slowed) show by
default, its INFO lines (the activation line, the exit report of a job it did not slow) only at
absl's INFO verbosity, which --verbose sets before TensorFlow is imported (docs/steps.md, "Logging").
"""

import argparse
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps", type=int, default=50, help="training batches per epoch")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--width", type=int, default=256, help="hidden layer width (memory grows with it)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--verbose", action="store_true",
                   help="absl INFO logging, set before TensorFlow is imported (tf-antman's activation line)")
    args = p.parse_args()
    if args.verbose:
        from absl import logging

        logging.set_verbosity(logging.INFO)
    import tensorflow as tf  # after the arguments: --help is quick, --verbose is in force at import

    tf.keras.utils.set_random_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    n = args.steps * args.batch
    x = rng.normal(size=(n, 64)).astype("float32")
    w = rng.normal(size=(64, 10)).astype("float32")
    y = np.argmax(x @ w, axis=1)

    model = tf.keras.Sequential([
        tf.keras.Input(shape=(64,)),
        tf.keras.layers.Dense(args.width, activation="relu"),
        tf.keras.layers.Dense(args.width, activation="relu"),
        tf.keras.layers.Dense(10),
    ])
    model.compile(optimizer="adam",
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    t0 = time.perf_counter()
    hist = model.fit(x, y, batch_size=args.batch, epochs=args.epochs, verbose=2,
                     validation_split=0.1)
    print(f"final loss {hist.history['loss'][-1]:.4f} accuracy {hist.history['accuracy'][-1]:.3f} "
          f"in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
