"""Memory dynamic scaling with real TensorFlow training on the emulated device."""

from __future__ import annotations

import pytest

from tests.conftest import run_py

# A Keras MLP whose working set (weights, Adam slots, activations of a 256-row batch at width
# 1024) is ~20 MiB: a 4 MiB limit forces most tensors into the host arena.
KERAS_RUN = """
import numpy as np, tensorflow as tf, tf_antman
tf.keras.utils.set_random_seed(7)
rng = np.random.default_rng(7)
x = rng.normal(size=(2048, 128)).astype("float32"); y = rng.integers(0, 10, 2048)
m = tf.keras.Sequential([tf.keras.Input((128,)), tf.keras.layers.Dense(1024, activation="relu"),
                         tf.keras.layers.Dense(1024, activation="relu"), tf.keras.layers.Dense(10)])
m.compile(optimizer="adam", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
h = m.fit(x, y, batch_size=256, epochs=2, verbose=0, shuffle=False)
s = tf_antman.memory_stats()
emit({"loss": h.history["loss"], "host_served": s["host_bytes_served"], "fallbacks": s["host_fallbacks"],
      "failed": s["failed_allocs"], "peak": s["peak_in_use"], "limit": s["limit"]})
"""


def test_keras_over_its_limit_trains_to_the_same_loss() -> None:
    free = run_py(KERAS_RUN, ANTMAN_DEVICE_MEMORY="1GiB").result
    tight = run_py(KERAS_RUN, ANTMAN_DEVICE_MEMORY="1GiB", ANTMAN_MEMORY_LIMIT="4MiB").result
    assert free["host_served"] == 0 and free["peak"] > 4 << 20  # the model needs more than 4 MiB
    assert tight["host_served"] > 0 and tight["fallbacks"] > 0
    assert tight["failed"] == 0
    assert tight["peak"] <= tight["limit"]
    # Same kernels on the same values: where a tensor lives changes no arithmetic here, so the
    # losses agree to float32 round-off (kernels may pick other blockings for other alignments).
    assert tight["loss"] == pytest.approx(free["loss"], rel=1e-5)


def test_lowering_releases_cache_and_raising_moves_back_to_device() -> None:
    job = run_py("""
        import tensorflow as tf, tf_antman
        v = tf.Variable(tf.random.normal((512, 512)))
        opt = tf.keras.optimizers.SGD(0.001)
        @tf.function
        def train_step():
            with tf.GradientTape() as tape:
                h = tf.nn.relu(tf.matmul(v, v))
                loss = tf.reduce_mean(tf.matmul(h, h))
            opt.apply_gradients([(tape.gradient(loss, v), v)])
        # Grow a large cache first: a big temporary burst, then free it.
        big = [tf.ones((1024, 1024)) for _ in range(16)]   # 64 MiB
        del big
        for _ in range(3):
            with tf_antman.step(): train_step()
        before = tf_antman.memory_stats()
        target = 2 << 20
        tf_antman.set_memory_limit(target)
        mid_pending = tf_antman.memory_stats()     # requested, not yet applied (mid-step)
        with tf_antman.step(): train_step()        # applied at this boundary
        after = tf_antman.memory_stats()
        def host_bytes_of_one_step():
            before = tf_antman.memory_stats()["host_bytes_served"]
            with tf_antman.step(): train_step()
            return tf_antman.memory_stats()["host_bytes_served"] - before
        host_during = [host_bytes_of_one_step() for _ in range(3)]
        tf_antman.set_memory_limit(512 << 20)
        host_after = [host_bytes_of_one_step() for _ in range(4)]
        host_live_after = tf_antman.memory_stats()["host_in_use"]
        invariants = tf_antman.activation.active().native.check_invariants()
        emit({"before": before, "mid": mid_pending, "after": after, "host_during": host_during,
              "host_after": host_after, "host_live_after": host_live_after, "invariants": invariants})
    """, ANTMAN_DEVICE_MEMORY="1GiB")
    r = job.result
    b, mid, a = r["before"], r["mid"], r["after"]
    assert b["reserved"] >= 64 << 20, "the burst should have left a large cache"
    assert mid["limit"] == b["limit"] and mid["pending_limit"] == 2 << 20  # not applied mid-step
    assert a["limit"] == 2 << 20
    assert a["shrink_bytes_freed"] > 0
    # Reserved drops to within one region of max(in use, new limit): only regions that still
    # hold a live block stay.
    assert a["reserved"] <= max(a["in_use"], a["limit"]) + a["largest_region"]
    assert a["largest_region"] < 64 << 20
    assert b["reserved"] - a["reserved"] >= 60 << 20
    assert max(r["host_during"]) > 0, "a 2 MiB limit must push this step's tensors to host"
    # Each mini-batch creates its tensors anew: after raising the limit they land on the device.
    assert r["host_after"][-1] == 0 and r["host_live_after"] == 0
    assert r["invariants"] == ""


def test_host_capacity_exhausted_gives_resource_exhausted_with_stats() -> None:
    job = run_py("""
        import tensorflow as tf, tf_antman
        ok = tf.ones((256, 256)).numpy().sum()
        try:
            big = tf.ones((4096, 4096)) + 1.0     # 64 MiB, over device limit + host cap
            big.numpy()
            emit({"error": None})
        except tf.errors.ResourceExhaustedError as e:
            after = tf.reduce_sum(tf.ones((64, 64))).numpy()   # the process still works
            emit({"error": str(e), "after": float(after), "failed": tf_antman.memory_stats()["failed_allocs"]})
    """, ANTMAN_DEVICE_MEMORY="64MiB", ANTMAN_MEMORY_LIMIT="16MiB", ANTMAN_HOST_MEMORY="16MiB")
    r = job.result
    assert r["error"] is not None
    assert "tf-antman: device in use" in r["error"] and "host fallback in use" in r["error"]
    assert r["after"] == 4096.0 and r["failed"] >= 1


def test_session_run_loop_under_a_tight_limit_matches_unlimited() -> None:
    code = """
        import numpy as np, tensorflow as tf, tf_antman
        tf.compat.v1.disable_eager_execution()
        tf.compat.v1.set_random_seed(3)
        x = tf.constant(np.random.default_rng(3).normal(size=(256, 256)).astype("float32"))
        w = tf.compat.v1.get_variable("w", [256, 256], initializer=tf.compat.v1.glorot_uniform_initializer(seed=3))
        loss = tf.reduce_mean(tf.square(tf.matmul(tf.nn.relu(tf.matmul(x, w)), w)))
        train = tf.compat.v1.train.AdamOptimizer(1e-3).minimize(loss)
        out = []
        with tf.compat.v1.Session() as s:
            s.run(tf.compat.v1.global_variables_initializer())
            for _ in range(10):
                out.append(float(s.run([train, loss])[1]))
        st = tf_antman.memory_stats()
        emit({"loss": out, "host": st["host_bytes_served"]})
    """
    free = run_py(code, ANTMAN_DEVICE_MEMORY="1GiB").result
    tight = run_py(code, ANTMAN_DEVICE_MEMORY="1GiB", ANTMAN_MEMORY_LIMIT="1MiB").result
    assert tight["host"] > 0 and free["host"] == 0
    assert tight["loss"] == pytest.approx(free["loss"], rel=1e-5)
