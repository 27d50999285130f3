"""Throttled jobs that read their input through tf.data (map, py_function, prefetch): they must
never freeze, must train exactly as unthrottled, and their waiting for input is not charged.

Before the op manager admitted ops instead of running them on its one thread, an eager
IteratorGetNext ran on that thread and blocked it while the pipeline's own ops queued behind it:
these jobs hung for ever at any share below 1. Timing figures live in bench/compute.py."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import run_py

PIPELINE = """
        import threading, time, numpy as np, tensorflow as tf, tf_antman
        tf.keras.utils.set_random_seed(3)
        x = np.random.default_rng(0).random((2048, 32)).astype("float32")
        y = (x.sum(1) > 16).astype("float32")

        def double(v):
            return v * 2.0

        def pipeline(slow_s=0.0):
            def py_step(a):
                if slow_s:
                    time.sleep(slow_s)
                return double(a)
            ds = tf.data.Dataset.from_tensor_slices((x, y))
            ds = ds.map(lambda a, b: (a * 2.0, b))
            ds = ds.map(lambda a, b: (tf.numpy_function(py_step, [a], tf.float32), b))
            ds = ds.map(lambda a, b: (tf.reshape(a, (32,)), b))
            return ds.batch(64).prefetch(2)

        model = tf.keras.Sequential([tf.keras.Input((32,)), tf.keras.layers.Dense(64, activation="relu"),
                                     tf.keras.layers.Dense(1)])
        model.compile(tf.keras.optimizers.SGD(0.01), "mse")
"""


def test_share_changes_during_tf_data_training_finish_with_unthrottled_losses() -> None:
    """1 -> 0.3 -> 0 -> 0.7 -> 1 while Keras fits on a tf.data pipeline and an eager loop
    iterates another one; 100 more share changes while a third pipeline is drained."""
    code = PIPELINE + """
        CHANGE = %s
        stop = threading.Event()
        seen = []
        def controller():
            # Each share is held for a while; 0 is a pause that must be resumed from here.
            for share in (1.0, 0.3, 0.0, 0.7, 1.0):
                if stop.is_set():
                    return
                tf_antman.set_compute_share(share)
                seen.append(share)
                time.sleep(0.4)
        t = threading.Thread(target=controller)
        if CHANGE:
            t.start()
        history = model.fit(pipeline(), epochs=3, verbose=0)
        eager_sum = 0.0
        for a, _ in pipeline():          # eager iteration: IteratorGetNext through TF's Compute
            eager_sum += float(tf.reduce_sum(a))
        if CHANGE:
            t.join()
            # 100 changes, 2 ms apart, while a pipeline is drained eagerly.
            flips = [0.3, 0.0, 0.7, 1.0, 0.05]
            def flipper():
                for i in range(100):
                    tf_antman.set_compute_share(flips[i %% len(flips)])
                    time.sleep(0.002)
                tf_antman.set_compute_share(1.0)
            f = threading.Thread(target=flipper)
            f.start()
            n = sum(1 for _ in pipeline())
            f.join()
        else:
            n = sum(1 for _ in pipeline())
        stop.set()
        emit({"losses": [float(v) for v in history.history["loss"]], "eager_sum": eager_sum,
              "batches": n, "seen": seen, "stats": tf_antman.compute_stats()})
    """
    plain = run_py(code % "False", timeout=240, ANTMAN_ENABLE="1").result
    changed = run_py(code % "True", timeout=240, ANTMAN_ENABLE="1").result
    assert changed["seen"] == [1.0, 0.3, 0.0, 0.7, 1.0]
    assert changed["losses"] == plain["losses"]
    assert changed["eager_sum"] == plain["eager_sum"]
    assert changed["batches"] == plain["batches"] == 32
    s = changed["stats"]
    # Throttling really happened (ops were admitted through the manager)...
    assert s["ops_total"] > 0 and s["busy_ns"] > 0
    # ...and nothing is left waiting or half-way.
    assert s["ops_waiting_now"] == 0 and s["ops_in_flight"] == 0


def test_input_bound_job_is_not_charged_for_waiting() -> None:
    """A job whose input step (a py_function) sleeps 40 ms per batch is input-bound: its busy time
    is its few compute ops, not the wait for input. Charging that wait as busy time (the old double
    charging of IteratorGetNext) makes busy about equal to wall time and puts the job in debt, so
    it runs far below what it would use unthrottled (bench/compute.py measures that rate)."""
    job = run_py(PIPELINE + """
        tf_antman.set_compute_share(0.5)
        ds = tf.data.Dataset.from_tensor_slices(x[:256]).batch(32).map(
            lambda a: tf.numpy_function(lambda v: (time.sleep(0.04), v)[1], [a], tf.float32))
        w = tf.Variable(tf.ones((32, 1)))
        before = tf_antman.compute_stats()
        t0 = time.perf_counter()
        for a in ds:
            w.assign_sub(0.001 * tf.matmul(tf.transpose(a), tf.matmul(a, w)))
        wall = time.perf_counter() - t0
        after = tf_antman.compute_stats()
        emit({"before": before, "after": after, "wall": wall})
    """, ANTMAN_ENABLE="1")
    r = job.result
    ops = r["after"]["ops_total"] - r["before"]["ops_total"]
    busy_s = (r["after"]["busy_ns"] - r["before"]["busy_ns"]) / 1e9
    assert ops > 0  # the compute ops went through the manager
    # What was charged is the compute, not the ~0.32 s spent waiting for input.
    assert busy_s < 0.25 * r["wall"]


def test_waiting_op_list_names_real_tensorflow_ops() -> None:
    """Every op type the manager lets through uncharged (cc/tf/op_classes.cc) exists in TF 2.21's
    op registry: a misspelt name would silently charge that op's waiting."""
    job = run_py("""
        import tensorflow as tf, tf_antman
        from tensorflow.python.framework import op_def_registry
        from tf_antman import activation
        names = activation.active().native.waiting_op_types()
        emit({"names": names, "missing": [n for n in names if op_def_registry.get(n) is None]})
    """, ANTMAN_ENABLE="1")
    r = job.result
    assert len(r["names"]) > 20
    assert "IteratorGetNext" in r["names"] and "EagerPyFunc" in r["names"]
    assert r["missing"] == []
    # XLA's compile kernel is host work and NCCL's wait for peers: neither is charged (issue 30).
    # XLA's run kernels are device work: gated (a call op XLA launches, tests/tf/test_xla.py).
    assert {"_XlaCompile", "NcclAllReduce", "_NcclReduceRecv"} <= set(r["names"])
    assert not {"_XlaRun", "XlaLaunch", "XlaLaunchV2"} & set(r["names"])


def test_coordinator_share_controls_during_tf_keras_train_on_batch_and_custom_loop(tmp_path: Path) -> None:
    """Controls written to the job directory cycle the share 1 -> 0.3 -> 0 -> 0.7 -> 1 (again and
    again) while a tf_keras fit on a tf.data pipeline, a train_on_batch loop and a custom loop
    train: they finish with the losses of an unthrottled run. Share 0 stops the job inside an op,
    so the next control can only arrive through the fallback (ANTMAN_CONTROL_FALLBACK_MS)."""
    code = """
        import os, pathlib, threading, time
        import numpy as np, tensorflow as tf, tf_keras, tf_antman
        from tf_antman import activation
        from tf_antman.protocol import Control, read_stats, write_control
        tf.keras.utils.set_random_seed(7)
        CONTROL = %s
        job_dir = pathlib.Path(os.environ["ANTMAN_JOB_DIR"])
        sent = [0]
        done = threading.Event()
        def controller():
            shares = (1.0, 0.3, 0.0, 0.7, 1.0)
            while not done.is_set():
                sent[0] += 1
                write_control(job_dir, Control(seq=sent[0], compute_share=shares[sent[0] %% 5]))
                time.sleep(0.15)
            sent[0] += 1
            write_control(job_dir, Control(seq=sent[0], compute_share=1.0))
        x = np.random.default_rng(1).random((512, 16)).astype("float32")
        y = (x.sum(1) > 8).astype("float32")
        ds = tf.data.Dataset.from_tensor_slices((x, y)).map(lambda a, b: (a * 2.0, b))
        ds = ds.map(lambda a, b: (tf.reshape(tf.numpy_function(lambda v: v + 1.0, [a], tf.float32), (16,)), b))
        ds = ds.batch(32).prefetch(2)
        m = tf_keras.Sequential([tf_keras.layers.Dense(32, activation="relu", input_shape=(16,)),
                                 tf_keras.layers.Dense(1)])
        m.compile(tf_keras.optimizers.SGD(0.05), "mse")
        t = threading.Thread(target=controller)
        if CONTROL:
            t.start()
        losses = [float(v) for v in m.fit(ds, epochs=3, verbose=0).history["loss"]]
        for i in range(20):
            losses.append(float(m.train_on_batch(x[i * 16:(i + 1) * 16], y[i * 16:(i + 1) * 16])))
        v = tf.Variable(tf.ones((16, 1)) * 0.1)
        @tf.function
        def step(a, b):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(tf.matmul(a, v)[:, 0] - b))
            v.assign_sub(0.01 * tape.gradient(loss, v))
            return loss
        for a, b in ds.repeat(2):
            with tf_antman.step():
                losses.append(float(step(a, b)))
        done.set()
        if CONTROL:
            t.join()
            # The file observer may not have seen the last control yet (CI once applied seq 19 of 20):
            # read control.json now, so the next boundary has it whatever the observer's timing.
            activation.active().steps.agent._watcher.check_now()
            with tf_antman.step():      # one more boundary: the last control is applied here
                losses.append(float(step(x[:32] * 2.0 + 1.0, y[:32])))
            activation.active().steps.agent.flush_stats()
            s = read_stats(job_dir)
            final = {"seq": s.control_seq_applied, "share": s.compute_share, "applied": s.controls_applied,
                     "fallback": s.controls_applied_fallback}
        else:
            losses.append(float(step(x[:32] * 2.0 + 1.0, y[:32])))
            final = {}
        emit({"losses": losses, "sent": sent[0], "final": final})
    """
    (tmp_path / "plain").mkdir()
    (tmp_path / "changed").mkdir()
    plain = run_py(code % "False", timeout=300, ANTMAN_JOB_DIR=str(tmp_path / "plain"),
                   ANTMAN_CONTROL_FALLBACK_MS="200").result
    changed = run_py(code % "True", timeout=300, ANTMAN_JOB_DIR=str(tmp_path / "changed"),
                     ANTMAN_CONTROL_FALLBACK_MS="200").result
    assert changed["losses"] == plain["losses"]
    assert changed["sent"] >= 6  # the cycle went through share 0 at least once
    f = changed["final"]
    assert f["seq"] == changed["sent"] and f["share"] == 1.0
    assert f["applied"] >= 3 and f["fallback"] >= 1  # a share-0 stop was lifted by the fallback
