"""XLA-compiled work passes the operator manager (cc/tf/op_classes.cc, IsXlaLaunchedCall).

A tf.function(jit_compile=True) called from a graph (Keras 3's train step under `fit`, a jit
function inside a tf.function) is one function-call node with _XlaMustCompile=true, whose kernel
TF's custom kernel creator replaces by XLA's launch kernel with the call node's type: the whole
compiled step is that one kernel. Before, the call types were let through as waiting ops, so the
step ran at full speed whatever the share (issue 30: a Keras MLP `fit` took 0.78 s at share 0.3
against 1.02 s at share 1).

Judged by CPU time, not the manager's figures (as bench/compute.py judges a share): the process's
CPU time over wall time in a phase at share 0.3, against the phases at share 1 on both sides of
it, in the same process. The compiled step runs on TF's threads under `fit` and on the calling
Python thread for an eager jit call, so the whole process's CPU time is the judge; Python's own
work between steps is small beside the step. Throttled, that rate falls to about the share; not
throttled, it stays near 1. The margin (< 0.7) is wide: no timing threshold, a ratio of rates.
"""

from __future__ import annotations

from tests.conftest import run_py

PHASES = """
        import time, tensorflow as tf, tf_antman
        def rate(run):
            c0, t0 = time.process_time(), time.monotonic()
            run()
            return (time.process_time() - c0) / (time.monotonic() - t0)
        def judge(run):
            run(); run()  # compile and warm up
            before = rate(run)
            tf_antman.set_compute_share(0.3)
            s0 = tf_antman.compute_stats()
            throttled = rate(run)
            s1 = tf_antman.compute_stats()
            tf_antman.set_compute_share(1.0)
            after = rate(run)
            return {"ratio": throttled / ((before + after) / 2), "rates": [before, throttled, after],
                    "ops": s1["ops_total"] - s0["ops_total"], "delayed": s1["ops_delayed"] - s0["ops_delayed"]}
"""
ENV = {"ANTMAN_ENABLE": "1", "TF_NUM_INTEROP_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1"}


def test_keras_fit_with_jit_compile_takes_its_share() -> None:
    job = run_py(PHASES + """
        import numpy as np, keras
        keras.utils.set_random_seed(3)
        x = np.random.default_rng(0).random((2048, 256)).astype("float32")
        y = np.random.default_rng(1).random((2048, 1)).astype("float32")
        model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dense(512, activation="relu"), keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse", jit_compile=True)
        def run():
            model.fit(x, y, batch_size=256, epochs=2, verbose=0, shuffle=False)
        r = judge(run)
        r["jit"] = bool(model.jit_compile)
        emit(r)
    """, **ENV)
    r = job.result
    assert r["jit"] is True
    assert r["delayed"] > 0, r  # the manager held compiled steps back...
    assert r["ratio"] < 0.7, r  # ...and the job's CPU time fell with the share


def test_jit_function_in_a_loop_takes_its_share() -> None:
    job = run_py(PHASES + """
        v = tf.Variable(tf.random.normal((384, 384)))
        @tf.function(jit_compile=True)
        def step():
            y = v
            for _ in range(6):
                y = tf.tanh(tf.matmul(y, v))
            v.assign(y / (1.0 + tf.reduce_max(tf.abs(y))))
        @tf.function
        def graph_loop():  # the jit function called from a graph: a call node XLA launches
            step()
        def eager():  # called eagerly: an op of the function's own name
            for _ in range(40):
                step()
            v.numpy()
        def nested():
            for _ in range(40):
                graph_loop()
            v.numpy()
        emit({"eager": judge(eager), "nested": judge(nested)})
    """, **ENV)
    for case in ("eager", "nested"):
        r = job.result[case]
        assert r["delayed"] > 0, (case, r)
        assert r["ratio"] < 0.7, (case, r)


def test_xla_compile_of_an_autoclustered_graph_is_not_charged() -> None:
    """Auto-clustering (TF_XLA_FLAGS) splits a cluster into _XlaCompile (compiles on the host:
    seconds, at every recompile) and _XlaRun (runs it). The compile is not device work: at share
    0.5 the first call, which compiles, is charged little of its wall time. Before, the compile
    was gated and charged, and the job then sat idle for as long again (issue 30)."""
    job = run_py("""
        import time, tensorflow as tf, tf_antman
        tf.config.optimizer.set_jit("autoclustering")
        v = tf.Variable(tf.random.normal((64, 64)))
        @tf.function
        def f(x):
            y = x
            for _ in range(30):
                y = tf.tanh(tf.matmul(y, v) + 1.0)
            return tf.reduce_sum(y)
        tf_antman.set_compute_share(0.5)
        s0, t0 = tf_antman.compute_stats(), time.monotonic()
        f(tf.ones((64, 64))).numpy()
        wall, s1 = time.monotonic() - t0, tf_antman.compute_stats()
        emit({"wall": wall, "busy": (s1["busy_ns"] - s0["busy_ns"]) / 1e9, "ops": s1["ops_total"] - s0["ops_total"]})
    """, TF_XLA_FLAGS="--tf_xla_auto_jit=2 --tf_xla_cpu_global_jit", TF_CPP_MIN_LOG_LEVEL="0", **ENV)
    assert "Compiled cluster using XLA" in job.stderr  # the graph did take the _XlaCompile/_XlaRun path
    r = job.result
    assert r["ops"] > 0, r  # _XlaRun and the ops around the cluster were gated
    # Charged: about 0.05 of the first call's wall time now; 0.42 with _XlaCompile gated (at share
    # 0.5 the charge is paid with as much idle time, so it cannot read above about 0.5).
    assert r["busy"] < 0.2 * r["wall"], r
