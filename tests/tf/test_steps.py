"""Step boundaries: only training steps count, in Keras fit, Session.run and custom loops."""

from __future__ import annotations

from tests.conftest import run_py


def test_keras_fit_counts_train_batches_not_validation_or_evaluate() -> None:
    job = run_py("""
        import numpy as np, tensorflow as tf, tf_antman, time
        from tf_antman import activation
        x = np.random.default_rng(0).normal(size=(320, 8)).astype("float32")
        y = (x.sum(axis=1) > 0).astype("float32")
        m = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(16, activation="relu"),
                                 tf.keras.layers.Dense(1)])
        m.compile(optimizer="sgd", loss="mse")
        t0 = time.perf_counter()
        m.fit(x, y, batch_size=32, epochs=3, verbose=0, validation_split=0.25)  # 8 train batches/epoch
        m.evaluate(x, y, batch_size=32, verbose=0)
        m.predict(x, batch_size=32, verbose=0)
        st = activation.active().steps
        emit({"steps": st.steps, "native_steps": tf_antman.memory_stats()["steps"],
              "window": list(st.window)})
    """, ANTMAN_ENABLE="1")
    r = job.result
    assert r["steps"] == 24
    assert r["native_steps"] == 24  # the allocator saw exactly those boundaries
    assert all(t > 0 for t in r["window"])


def test_session_run_counts_only_runs_with_a_training_op() -> None:
    job = run_py("""
        import tensorflow as tf, tf_antman
        from tf_antman import activation
        tf.compat.v1.disable_eager_execution()
        x = tf.compat.v1.placeholder(tf.float32, [None, 4])
        w = tf.compat.v1.get_variable("w", [4, 1])
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - 1.0))
        train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        with tf.compat.v1.Session() as s:
            s.run(tf.compat.v1.global_variables_initializer())   # init: not a step
            for _ in range(7):
                s.run([train, loss], {x: [[1, 2, 3, 4]]})        # training steps
            for _ in range(5):
                s.run(loss, {x: [[1, 2, 3, 4]]})                 # evaluation: not steps
        emit({"steps": activation.active().steps.steps, "info_steps": tf_antman.memory_stats()["steps"]})
    """, ANTMAN_ENABLE="1")
    assert job.result == {"steps": 7, "info_steps": 7}


def test_custom_loop_marks_steps_explicitly() -> None:
    job = run_py("""
        import tensorflow as tf, tf_antman
        from tf_antman import activation
        v = tf.Variable(tf.ones((4, 4)))
        opt = tf.keras.optimizers.SGD(0.01)
        @tf.function
        def train_step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.matmul(v, v))
            opt.apply_gradients([(tape.gradient(loss, v), v)])
            return loss
        for _ in range(6):
            with tf_antman.step():
                train_step()
        with tf_antman.step(training=False):   # an evaluation pass
            tf.reduce_sum(v).numpy()
        emit({"steps": activation.active().steps.steps})
    """, ANTMAN_ENABLE="1")
    assert job.result["steps"] == 6
