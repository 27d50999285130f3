"""Step boundaries (docs/steps.md): every import order installs the hooks; Keras 3 and tf_keras
fit/train_on_batch, Session.run with each kind of optimizer update, make_callable and marked
custom loops count exactly their training steps; a control from the job directory is in force
after exactly one step; the newest of a user request and a coordinator limit wins.

Each test is one TensorFlow process that combines several checks (a process costs seconds)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.conftest import run_py

# In the job: send a control through the job directory and wait until the job's watcher has read
# it (so the next step boundary is the first that can apply it); read what is in force.
CONTROL_HELPERS = """
import json, os, pathlib, time, tf_antman
from tf_antman import activation
from tf_antman.protocol import Control, MemoryLimit, write_control
_seq = [0]
def send(**fields):
    agent = activation.active().steps.agent
    version = agent._watcher.version
    _seq[0] += 1
    write_control(pathlib.Path(os.environ["ANTMAN_JOB_DIR"]), Control(seq=_seq[0], **fields))
    while agent._watcher.version == version:
        time.sleep(0.001)
def limit():
    return tf_antman.memory_stats()["limit"]
def steps():
    return activation.active().steps.steps
MiB = 1 << 20
"""

MiB = 1 << 20

# Trains with fit (2 epochs x 3 batches, validation batches too), 3 train_on_batch, then
# evaluate/predict/test_on_batch/predict_on_batch, which are not steps: 9 steps. During fit a
# limit is sent before batch 1 and read at batch 2 (one step later); during train_on_batch
# another is sent between two calls.
KERAS_JOB = CONTROL_HELPERS + """
import numpy as np
x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32"); y = x.sum(1)
m = K.Sequential([K.Input((8,)), K.layers.Dense(4), K.layers.Dense(1)])
m.compile(optimizer="adam", loss="mse")
seen = {}
class Probe(K.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if batch == 1 and "sent" not in seen:
            send(memory_limits=(MemoryLimit(0, 300 * MiB),))
            seen["sent"] = limit()
        elif batch == 2 and "next" not in seen:
            seen["next"] = limit()
m.fit(x, y, batch_size=16, epochs=2, verbose=0, validation_split=0.25, callbacks=[Probe()])
m.train_on_batch(x[:16], y[:16])
send(memory_limits=(MemoryLimit(0, 200 * MiB),))
seen["tob_sent"] = limit()
m.train_on_batch(x[:16], y[:16])
seen["tob_next"] = limit()
m.train_on_batch(x[:16], y[:16])
m.evaluate(x, y, verbose=0); m.predict(x, verbose=0); m.test_on_batch(x, y); m.predict_on_batch(x)
emit({"steps": steps(), "native_steps": tf_antman.memory_stats()["steps"], "seen": seen,
      "model": type(m).__module__, "window": list(activation.active().steps.window)})
"""


@pytest.mark.parametrize(("first", "keras", "env"), [
    ("import keras", "keras", {}),
    ("import tensorflow", "tf.keras", {}),
    ("from tensorflow import keras", "keras", {}),
    ("import tf_keras", "tf_keras", {}),
    ("import tensorflow", "tf.keras", {"TF_USE_LEGACY_KERAS": "1"}),
])
def test_each_import_order_hooks_fit_and_train_on_batch(tmp_path: Path, first: str, keras: str,
                                                        env: dict[str, str]) -> None:
    job = run_py(f"{first}\nimport tensorflow as tf\nK = {keras}\n" + KERAS_JOB, ANTMAN_JOB_DIR=str(tmp_path),
                 ANTMAN_CONTROL_FALLBACK_MS="600000", KERAS_BACKEND="tensorflow", **env)
    r = job.result
    legacy = keras == "tf_keras" or "TF_USE_LEGACY_KERAS" in env
    assert r["model"].startswith("tf_keras." if legacy else "keras."), r["model"]
    assert r["steps"] == r["native_steps"] == 9
    assert all(t > 0 for t in r["window"])
    # In force after exactly one step: not before (read right after the watcher had it), and
    # at the next batch's start.
    assert r["seen"] == {"sent": 4 << 30, "next": 300 * MiB, "tob_sent": 300 * MiB, "tob_next": 200 * MiB}


def test_session_run_counts_every_kind_of_optimizer_update(tmp_path: Path) -> None:  # and tf_keras v1
    job = run_py(CONTROL_HELPERS + textwrap.dedent("""
        import tensorflow as tf, keras
        tf.compat.v1.disable_eager_execution()
        v1 = tf.compat.v1
        x = v1.placeholder(tf.float32, [None, 4])
        counts = {}
        def runs(name, sess, fetches, n, feed=None):
            before = steps()
            for _ in range(n):
                sess.run(fetches, feed)
            counts[name] = steps() - before
        feed = {x: [[1, 2, 3, 4]]}
        # 1. A reference variable and GradientDescentOptimizer: ApplyGradientDescent.
        w_ref = v1.get_variable("w_ref", [4, 1], use_resource=False)
        loss_ref = tf.reduce_mean(tf.square(tf.matmul(x, w_ref) - 1.0))
        sgd = v1.train.GradientDescentOptimizer(0.1).minimize(loss_ref)
        # 2. A resource variable and AdamOptimizer: ResourceApplyAdam.
        w_res = v1.get_variable("w_res", [4, 1], use_resource=True)
        loss_res = tf.reduce_mean(tf.square(tf.matmul(x, w_res) - 1.0))
        adam = v1.train.AdamOptimizer(0.1).minimize(loss_res)
        # 2b. No placeholder (make_callable without feeds): ResourceApplyMomentum.
        w_c = v1.get_variable("w_c", [4, 1], use_resource=True)
        momentum = v1.train.MomentumOptimizer(0.1, 0.9).minimize(
            tf.reduce_mean(tf.square(tf.matmul(tf.ones((1, 4)), w_c) - 1.0)))
        # 3. A Keras 3 optimizer in a TF1 graph: AssignSubVariableOp / AssignAddVariableOp.
        w_k = tf.Variable(tf.ones((4, 1)), name="w_k")
        loss_k = tf.reduce_mean(tf.square(tf.matmul(x, w_k) - 1.0))
        graph = v1.get_default_graph()
        ops_before = set(graph.get_operations())
        keras.optimizers.Adam(0.1).apply_gradients(zip(tf.gradients(loss_k, [w_k]), [w_k]))
        keras_update = tf.group(*[op for op in graph.get_operations() if op not in ops_before
                                  and op.type.endswith("VariableOp") and op.type.startswith("Assign")])
        kinds = sorted({op.type for op in graph.get_operations() if op not in ops_before
                        and op.type.startswith("Assign")})
        # 4. A hand-written update: an overwrite computed from the variable itself.
        manual = w_k.assign(w_k - 0.01 * tf.gradients(loss_k, [w_k])[0])
        # Writes that are not training: set_weights-style assignment from a placeholder, and a
        # copy of one trainable variable into another (a target network's sync).
        value = v1.placeholder(tf.float32, [4, 1])
        set_w = w_res.assign(value)
        copy = w_c.assign(w_res)
        saver = v1.train.Saver()
        with v1.Session() as s:
            runs("init", s, v1.global_variables_initializer(), 1)
            runs("sgd", s, [sgd, loss_ref], 3, feed)
            runs("adam", s, adam, 4, feed)
            runs("keras3", s, keras_update, 5, feed)
            runs("eval", s, [loss_ref, loss_res, loss_k], 6, feed)
            runs("set_weights", s, set_w, 2, {value: [[0.0]] * 4})
            runs("manual", s, manual, 2, feed)
            runs("copy", s, copy, 2)
            path = saver.save(s, os.path.join(os.environ["ANTMAN_JOB_DIR"], "ckpt"))
            before = steps(); saver.restore(s, path); counts["save_restore"] = steps() - before
            # make_callable: without feeds it bypasses run(); with feeds it goes through run().
            call_train = s.make_callable(momentum)
            call_train_fed = s.make_callable([sgd, loss_ref], feed_list=[x])
            call_eval = s.make_callable(loss_k, feed_list=[x])
            before = steps()
            for _ in range(3):
                call_train_fed([[1, 2, 3, 4]])
            counts["callable_fed"] = steps() - before
            before = steps(); call_eval([[1, 2, 3, 4]]); counts["callable_eval"] = steps() - before
            # A limit sent now is in force after exactly one training step of each kind.
            before = steps()
            for _ in range(2):
                call_train()
            counts["callable"] = steps() - before
            in_force = []
            for i, step in enumerate([lambda: call_train(), lambda: s.run(sgd, feed),
                                      lambda: s.run(keras_update, feed)]):
                send(memory_limits=(MemoryLimit(0, (100 + i) * MiB),))
                in_force.append(limit())
                step()
                in_force.append(limit())
        # tf_keras in graph mode (training_v1.Model): 2 epochs x 2 batches + 1 train_on_batch; its
        # batches run through Session callables inside the marked step, not counted twice.
        import numpy as np, tf_keras
        xs = np.ones((32, 4), "float32")
        m = tf_keras.Sequential([tf_keras.layers.Dense(1, input_shape=(4,))])
        m.compile(optimizer="adam", loss="mse")
        before = steps()
        m.fit(xs, xs[:, 0], batch_size=16, epochs=2, verbose=0)
        m.train_on_batch(xs[:8], xs[:8, 0])
        m.evaluate(xs, xs[:, 0], verbose=0)
        counts["tf_keras_v1"] = steps() - before
        # Every op of this TF whose name speaks of Apply/Assign/Scatter is classified.
        import re
        from tf_antman import hooks
        unclassified = [n for n in dir(tf.raw_ops) if re.search("Apply|Assign|Scatter", n) and not (
            hooks.OPTIMIZER_KERNEL_RE.match(n) or n in hooks.READ_MODIFY_WRITE_OPS
            or n in hooks.OVERWRITE_OPS or n in hooks.NOT_VARIABLE_WRITES)]
        emit({"counts": counts, "kinds": kinds, "in_force": in_force, "total": steps(),
              "native_steps": tf_antman.memory_stats()["steps"], "unclassified": unclassified})
    """), ANTMAN_JOB_DIR=str(tmp_path), ANTMAN_CONTROL_FALLBACK_MS="600000")
    r = job.result
    assert r["unclassified"] == []
    assert r["kinds"] == ["AssignAddVariableOp", "AssignSubVariableOp", "AssignVariableOp"]
    assert r["counts"] == {"init": 0, "sgd": 3, "adam": 4, "keras3": 5, "eval": 0, "set_weights": 0, "manual": 2, "copy": 0,
                           "save_restore": 0, "callable": 2, "callable_fed": 3,
                           "callable_eval": 0, "tf_keras_v1": 5}
    assert r["in_force"] == [4 << 30, 100 << 20, 100 << 20, 101 << 20, 101 << 20, 102 << 20]
    assert r["total"] == r["native_steps"] == 3 + 4 + 5 + 2 + 2 + 3 + 3 + 5


def test_custom_loop_marks_steps_and_the_newest_limit_wins(tmp_path: Path) -> None:
    job = run_py(CONTROL_HELPERS + textwrap.dedent("""
        import tensorflow as tf
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
        with tf_antman.step(training=False):   # an evaluation pass: not a step
            tf.reduce_sum(v).numpy()
        counted = steps()
        send(memory_limits=(MemoryLimit(0, 300 << 20),))
        before_step = limit()
        with tf_antman.step():
            train_step()
        after_step = limit()
        # The user asks first, the coordinator's limit is received after: the coordinator's wins.
        tf_antman.set_memory_limit(64 << 20)
        send(memory_limits=(MemoryLimit(0, 128 << 20),))
        with tf_antman.step():
            train_step()
        coordinator_newer = limit()
        with tf_antman.step():
            train_step()
        still = limit()
        # The coordinator's limit is received first, the user asks after: the user's wins.
        send(memory_limits=(MemoryLimit(0, 256 << 20),))
        tf_antman.set_memory_limit(96 << 20)
        with tf_antman.step():
            train_step()
        user_newer = limit()
        def stats_limit():
            assert activation.active().steps.agent.flush_stats()  # the writer is asynchronous
            doc = json.loads((pathlib.Path(os.environ["ANTMAN_JOB_DIR"]) / "stats.json").read_text())
            return doc["devices"][0]["limit_bytes"]
        in_stats = stats_limit()  # written at that boundary (a control was applied there)
        # A user request alone: the stats written at its boundary report it (interval 1 ms).
        time.sleep(0.01)
        tf_antman.set_memory_limit(80 << 20)
        with tf_antman.step():
            train_step()
        emit({"counted": counted, "before_step": before_step, "after_step": after_step,
              "coordinator_newer": coordinator_newer, "still": still, "user_newer": user_newer,
              "in_stats": in_stats, "alone_in_stats": stats_limit(), "alone": limit()})
    """), ANTMAN_JOB_DIR=str(tmp_path), ANTMAN_CONTROL_FALLBACK_MS="600000", ANTMAN_STATS_INTERVAL_MS="1")
    r = job.result
    assert r["counted"] == 6
    assert (r["before_step"], r["after_step"]) == (4 << 30, 300 << 20)
    assert r["coordinator_newer"] == r["still"] == 128 << 20
    assert r["user_newer"] == 96 << 20
    # stats.json written at a boundary reports the limit that boundary put into force (it showed
    # the one before for a step: the request was applied after the agent wrote).
    assert r["in_stats"] == 96 << 20
    assert r["alone_in_stats"] == r["alone"] == 80 << 20


def test_a_marked_step_around_a_hooked_call_counts_once() -> None:
    # docs/steps.md: "Work inside a marked step is not counted twice". tf_antman.step() around
    # train_on_batch or a training Session.run counted each iteration twice (the hook inside too).
    job = run_py(CONTROL_HELPERS + textwrap.dedent("""
        import numpy as np
        import tensorflow as tf
        x = np.ones((8, 4), "float32"); y = np.ones((8, 1), "float32")
        m = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
        m.compile(optimizer="sgd", loss="mse")
        for _ in range(5):
            with tf_antman.step():
                m.train_on_batch(x, y)
        keras = steps()
        with tf.Graph().as_default():
            v = tf.compat.v1.get_variable("v", initializer=tf.ones((4,)))
            train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_sum(v * v))
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                for _ in range(3):
                    with tf_antman.step():
                        sess.run(train)
        session = steps() - keras
        for _ in range(2):
            with tf_antman.step():
                with tf_antman.step():  # nested: the outer step counts
                    m.train_on_batch(x, y)
        emit({"keras": keras, "session": session, "nested": steps() - keras - session,
              "native": tf_antman.memory_stats()["steps"]})
    """), ANTMAN_ENABLE="1", ANTMAN_DEVICE="emulated")
    assert job.result == {"keras": 5, "session": 3, "nested": 2, "native": 10}, job.stderr[-3000:]


def test_a_job_without_step_boundaries_gets_its_controls_from_the_fallback(tmp_path: Path) -> None:
    # Eager ops in a loop that never marks a step (as an unmarked custom loop, or a job stuck
    # before its first step): limits, a pause and its resume still take effect, by the fallback.
    job = run_py(CONTROL_HELPERS + textwrap.dedent("""
        import threading
        import tensorflow as tf
        from tf_antman.protocol import read_stats
        a = tf.random.normal((64, 64))
        done, count = threading.Event(), [0]
        def loop():
            while not done.is_set():
                tf.matmul(a, a).numpy()
                count[0] += 1
        def share():
            return tf_antman.compute_stats()["share"]
        def wait(pred):  # bounded: a broken fallback fails the test instead of hanging it
            deadline = time.monotonic() + 30
            while not pred():
                if time.monotonic() > deadline:
                    done.set()
                    raise SystemExit("never happened")
                time.sleep(0.005)
        worker = threading.Thread(target=loop); worker.start()
        wait(lambda: count[0] > 10)
        agent = activation.active().steps.agent
        t0 = time.monotonic()
        send(memory_limits=(MemoryLimit(0, 200 * MiB),))
        wait(lambda: limit() == 200 * MiB)
        limit_after_s = time.monotonic() - t0
        job_dir = pathlib.Path(os.environ["ANTMAN_JOB_DIR"])
        send(paused=True)
        # The fallback thread sets the share, then the state, then submits the stats: a share of 0
        # says nothing about the stats yet (CI once read "starting" here).
        wait(lambda: share() == 0.0 and agent.flush_stats() and read_stats(job_dir).control_seq_applied == 2)
        paused_stats = read_stats(job_dir)
        frozen = count[0]
        time.sleep(0.5)
        moved_while_paused = count[0] - frozen
        send(paused=False)
        # The share is back before the fallback thread has finished writing its stats: wait for both.
        wait(lambda: share() == 1.0 and count[0] > frozen + 10 and agent.flush_stats()
             and read_stats(job_dir).control_seq_applied == 3)
        done.set(); worker.join()
        agent.flush_stats()
        final = read_stats(job_dir)
        emit({"limit_after_s": limit_after_s, "moved_while_paused": moved_while_paused,
              "paused": [paused_stats.state, paused_stats.compute_share, paused_stats.last_applied_by],
              "final": [final.state, final.step, final.controls_applied, final.controls_applied_fallback,
                        final.last_applied_by, final.control_seq_applied]})
    """), ANTMAN_JOB_DIR=str(tmp_path), ANTMAN_CONTROL_FALLBACK_MS="300")
    r = job.result
    assert r["limit_after_s"] >= 0.3  # it waited the fallback time for a step boundary first
    assert r["paused"] == ["paused", 1.0, "fallback"]  # held by share 0; the share in force is reported
    assert r["moved_while_paused"] <= 1  # at most the op that was running when the share went to 0
    assert r["final"] == ["starting", 0, 3, 3, "fallback", 3]


def test_the_first_step_end_is_not_timed_and_stays_out_of_the_agents_window() -> None:
    # StepTracker passed 0.0 for the untimed first tf_antman.step_end(): a 0.0 ms step in
    # stats.json's step_ms_window and in the mean the coordinator reads.
    from types import SimpleNamespace

    from tf_antman.steps import StepTracker

    native = SimpleNamespace(step_boundary=lambda: None, request_limit=lambda n: None,
                             set_limit_now=lambda n: (0, 0))
    seen: list[float | None] = []
    tracker = StepTracker(native, SimpleNamespace(job_dir=None))  # type: ignore[arg-type]
    tracker.agent = SimpleNamespace(step_end=lambda seconds, training: seen.append(seconds))
    tracker.step_end()
    tracker.step_end()
    tracker.step_end(0.25)
    assert tracker.steps == 3 and seen[0] is None and seen[1] is not None and seen[2] == 0.25
    assert len(tracker.window) == 2


def test_a_pause_at_the_step_boundary_is_not_the_next_steps_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # The agent holds the thread in step_end while the job is paused; the next untimed step was
    # measured from before that hold, so a pause read as a step that long in stats.json.
    from types import SimpleNamespace

    from tf_antman import steps as steps_module
    from tf_antman.steps import StepTracker

    now = [100.0]  # a clock of our own: only the pause and the steps move it
    monkeypatch.setattr(steps_module, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    native = SimpleNamespace(step_boundary=lambda: None, request_limit=lambda n: None,
                             set_limit_now=lambda n: (0, 0))
    seen: list[float | None] = []

    def agent_step_end(seconds: float | None, training: bool) -> None:
        seen.append(seconds)
        if len(seen) == 2:
            now[0] += 30.0  # paused for 30 s here, at the boundary after the second step

    tracker = StepTracker(native, SimpleNamespace(job_dir=None))  # type: ignore[arg-type]
    tracker.agent = SimpleNamespace(step_end=agent_step_end)
    for _ in range(3):
        tracker.step_end()
        now[0] += 0.5  # each step trains for 0.5 s
    assert seen == [None, 0.5, 0.5]


API = """
import math, numpy as np, tensorflow as tf, keras, tf_keras, tf_antman
def error(f):
    try:
        f()
    except Exception as e:
        return [type(e).__name__, str(e)]
    return None
km = keras.Sequential([keras.Input(shape=(8,)), keras.layers.Dense(4)]); km.compile("sgd", "mse")
tm = tf_keras.Sequential([tf_keras.Input(shape=(8,)), tf_keras.layers.Dense(4)]); tm.compile("sgd", "mse")
x = np.ones((32, 8), "float32"); y = np.ones((32, 4), "float32")
steps = lambda: tf_antman._state().steps.steps
out = {"fit": {}}
for name, model in (("keras3", km), ("tf_keras", tm)):
    for how, cb in (("auto", lambda m: tf_antman.keras_callback()), ("model", tf_antman.keras_callback)):
        before = steps()
        err = error(lambda: model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[cb(model)]))
        out["fit"][name + "/" + how] = [err, steps() - before]
out["bases"] = [type(tf_antman.keras_callback(m)).__mro__[1].__module__.split(".")[0] for m in (km, tm)]
bad = {
    "limit_above_device": lambda: tf_antman.set_memory_limit("1GiB"),
    "limit_below_1MiB": lambda: tf_antman.set_memory_limit(1000),
    "limit_none": lambda: tf_antman.set_memory_limit(None),
    "limit_float": lambda: tf_antman.set_memory_limit(1.5e6),
    "limit_bool": lambda: tf_antman.set_memory_limit(True),
    "limit_text": lambda: tf_antman.set_memory_limit("lots"),
    "share_str": lambda: tf_antman.set_compute_share("0.5"),
    "share_none": lambda: tf_antman.set_compute_share(None),
    "share_nan": lambda: tf_antman.set_compute_share(float("nan")),
    "share_2": lambda: tf_antman.set_compute_share(2),
    "step_nan": lambda: tf_antman.step_end(float("nan")),
    "step_negative": lambda: tf_antman.step_end(-1),
    "step_str": lambda: tf_antman.step_end("a"),
    "step_training": lambda: tf_antman.step_end(0.1, training="yes"),
}
out["bad"] = {k: error(f) for k, f in bad.items()}
before = steps()
out["good"] = [error(lambda: tf_antman.set_memory_limit("32MiB")), error(lambda: tf_antman.set_memory_limit(64 << 20)),
               error(lambda: tf_antman.set_memory_limit(np.int64(48 << 20))),
               error(lambda: tf_antman.set_compute_share(1)), error(lambda: tf_antman.step_end(0)),
               error(lambda: tf_antman.step_end(np.float64(0.5))), steps() - before]
emit(out)
"""


def test_keras_callback_and_the_api_arguments() -> None:
    # keras_callback() built on Keras 3's Callback crashed tf_keras's fit (no
    # '_implements_train_batch_hooks'); a limit above the device was accepted; bad arguments were
    # accepted silently or failed with unrelated errors.
    job = run_py(API, ANTMAN_DEVICE="emulated", ANTMAN_DEVICE_MEMORY="64MiB")
    r = job.result
    assert r["fit"] == {k: [None, 4] for k in ("keras3/auto", "keras3/model", "tf_keras/auto", "tf_keras/model")}
    assert r["bases"] == ["keras", "tf_keras"]
    bad = r["bad"]
    assert bad["limit_above_device"] == ["ValueError", "set_memory_limit: limit '1GiB' (1073741824 bytes) is out of "
                                         "range: accepted 1MiB..64.0 MiB (the device's memory, 67108864 bytes)"]
    assert bad["limit_below_1MiB"][0] == "ValueError" and "accepted 1MiB..64.0 MiB" in bad["limit_below_1MiB"][1]
    for key in ("limit_none", "limit_float", "limit_bool"):
        assert bad[key][0] == "TypeError" and bad[key][1].startswith("set_memory_limit: limit must be an int"), key
    assert bad["limit_text"][0] == "ValueError" and "set_memory_limit: limit 'lots' is not a size" in bad["limit_text"][1]
    for key in ("share_str", "share_none"):
        assert bad[key][0] == "TypeError" and bad[key][1].startswith("set_compute_share: share must be a number"), key
    for key in ("share_nan", "share_2"):
        assert bad[key][0] == "ValueError" and "accepted 0.0..1.0" in bad[key][1], key
    for key in ("step_nan", "step_negative"):
        assert bad[key][0] == "ValueError" and bad[key][1].startswith("step_end: seconds") and ">= 0" in bad[key][1]
    assert bad["step_str"][0] == "TypeError" and bad["step_str"][1].startswith("step_end: seconds must be")
    assert bad["step_training"] == ["TypeError", "step_end: training must be True or False, got str 'yes'"]
    assert r["good"] == [None, None, None, None, None, None, 2]  # numpy's integers are integers too
