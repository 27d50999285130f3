"""Compute dynamic scaling: every op of the emulated device passes the GpuOpManager.

Accuracy of the achieved share is a timing figure and lives in bench/compute.py; these tests
check what the mechanism does, not how fast."""

from __future__ import annotations

from tests.conftest import run_py

LOOP = """
        import threading, time, tensorflow as tf, tf_antman
        tf.keras.utils.set_random_seed(5)
        v = tf.Variable(tf.random.normal((512, 512)))
        opt = tf.keras.optimizers.Adam(1e-3)
        @tf.function
        def train_step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(tf.matmul(tf.nn.relu(tf.matmul(v, v)), v)))
            opt.apply_gradients([(tape.gradient(loss, v), v)])
            return loss
"""


def test_share_changes_during_training_without_restart() -> None:
    job = run_py(LOOP + """
        def run(n):
            for _ in range(n):
                with tf_antman.step(): train_step()
        run(5)
        full = tf_antman.compute_stats()
        tf_antman.set_compute_share(0.3)
        run(5)
        throttled = tf_antman.compute_stats()
        tf_antman.set_compute_share(1.0)
        run(5)
        back = tf_antman.compute_stats()
        emit({"full": full, "throttled": throttled, "back": back})
    """, ANTMAN_ENABLE="1")
    r = job.result
    assert r["full"]["ops_delayed"] == 0 and r["full"]["share"] == 1.0
    assert r["throttled"]["share"] == 0.3
    # Synchronous kernels (MatMul and friends) went through the manager's queue...
    assert r["throttled"]["ops_total"] - r["full"]["ops_total"] >= 5 * 3
    assert r["throttled"]["busy_ns"] > 0
    # ...and it held some back to make room for idle time.
    assert r["throttled"]["ops_delayed"] > 0 and r["throttled"]["idle_inserted_ns"] > 0
    # At 100% again nothing more is delayed.
    assert r["back"]["ops_delayed"] == r["throttled"]["ops_delayed"]


def test_pause_at_zero_blocks_and_resume_gives_the_same_losses() -> None:
    code = LOOP + """
        losses, steps_done = [], []
        def trainer():
            for _ in range(30):
                with tf_antman.step():
                    losses.append(float(train_step()))
        PAUSE = %s
        t = threading.Thread(target=trainer)
        t.start()
        paused_progress = None
        if PAUSE:
            while len(losses) < 10:
                time.sleep(0.001)
            tf_antman.set_compute_share(0.0)
            time.sleep(0.3)                      # let the running step reach an op boundary
            n0 = len(losses)
            time.sleep(1.0)
            paused_progress = len(losses) - n0   # no step can finish while paused
            stats = tf_antman.compute_stats()
            tf_antman.set_compute_share(1.0)
        t.join()
        emit({"losses": losses, "paused_progress": paused_progress,
              "paused_flag": stats["paused"] if PAUSE else None})
    """
    plain = run_py(code % "False", ANTMAN_ENABLE="1").result
    paused = run_py(code % "True", ANTMAN_ENABLE="1").result
    assert paused["paused_progress"] == 0
    assert paused["paused_flag"] is True
    assert len(paused["losses"]) == 30
    assert paused["losses"] == plain["losses"]  # same ops, same order, same values
