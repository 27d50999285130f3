"""Activation (issue: drop-in wheel): the native library is loaded, TF's device is built on it,
and nothing of tf-antman exists without ANTMAN_* variables."""

from __future__ import annotations

from tests.conftest import REPO, run_py

MATMUL = """
import tensorflow as tf
import tf_antman
before = tf_antman.memory_stats()["device_bytes_served"]
a = tf.random.normal((256, 256))
b = tf.matmul(a, a).numpy()
after = tf_antman.memory_stats()["device_bytes_served"]
from tf_antman import activation
emit({"info": tf_antman.device_info(), "served": after - before,
      "devices": activation.active().native.devices_created()})
"""


def test_device_tensors_are_served_by_our_allocator() -> None:
    job = run_py(MATMUL, ANTMAN_ENABLE="1")
    r = job.result
    assert r["info"]["allocator"] == "antman_universal"
    assert r["info"]["device"].endswith("/device:CPU:0")
    # absl's default verbosity (as TensorFlow's Python side): warnings only, no INFO line
    assert "tf-antman: active" not in job.stderr
    assert r["devices"] >= 1, "the device factory never ran: activation came too late"
    # two 256x256 float32 tensors at least went through the core
    assert r["served"] >= 2 * 256 * 256 * 4


def test_no_trace_without_antman_variables() -> None:
    ops_lib = str(REPO / "tf_antman" / "_native" / "_antman_ops.so")
    job = run_py(f"""
        import tensorflow as tf
        ops = tf.load_op_library({ops_lib!r})
        alloc, _ = ops.antman_device_info()
        x = tf.matmul(tf.ones((8, 8)), tf.ones((8, 8))).numpy()
        emit({{"allocator": alloc.numpy().decode(), "imported": "tf_antman" in sys.modules}})
    """)
    r = job.result
    assert r["allocator"] != "antman_universal"
    assert r["imported"] is False
    assert "tf-antman" not in job.stderr


def test_bad_value_fails_at_start_naming_variable_and_range() -> None:
    job = run_py("import tensorflow as tf\nemit({'reached': True})", ANTMAN_COMPUTE_SHARE="1.5")
    assert job.rc != 0
    assert "ANTMAN_COMPUTE_SHARE" in job.stderr and "0.0..1.0" in job.stderr
    assert '"reached"' not in job.stdout


def test_unknown_variable_is_rejected() -> None:
    job = run_py("import tensorflow as tf", ANTMAN_MEMROY_LIMIT="1GiB")
    assert job.rc != 0 and "ANTMAN_MEMROY_LIMIT" in job.stderr


def test_enable_from_code_before_tensorflow() -> None:
    job = run_py("""
        import tf_antman
        s = tf_antman.enable(device_memory="512MiB", compute_share=1.0)
        import tensorflow as tf
        tf.ones((4, 4)).numpy()
        emit({"info": tf_antman.device_info(), "capacity": tf_antman.memory_stats()["device_capacity"]})
    """)
    r = job.result
    assert r["info"]["allocator"] == "antman_universal"
    assert r["capacity"] == 512 << 20


def test_enable_after_devices_exist_is_refused() -> None:
    job = run_py("""
        import tensorflow as tf
        tf.ones((2, 2)).numpy()
        import tf_antman
        try:
            tf_antman.enable()
        except RuntimeError as e:
            emit({"error": str(e)})
    """)
    assert "before TensorFlow creates its devices" in job.result["error"]


def test_keras_example_log_says_active_with_settings() -> None:
    import subprocess
    import sys

    from tests.conftest import clean_env

    # tf-antman logs through absl (docs/steps.md): its INFO lines show at absl's INFO verbosity,
    # which a script under absl.app has by default; here it is set before the unchanged example.
    run_example = ("import runpy, sys; from absl import logging; logging.set_verbosity(logging.INFO); "
                   "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    cmd = [sys.executable, "-c", run_example, str(REPO / "examples" / "keras_train.py"), "--epochs", "1", "--steps", "5"]
    on = subprocess.run(cmd, env=clean_env(ANTMAN_ENABLE="1", ANTMAN_DEVICE_MEMORY="1GiB"),
                        capture_output=True, text=True, timeout=300)
    off = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert on.returncode == 0, on.stderr[-3000:]
    assert off.returncode == 0, off.stderr[-3000:]
    assert "tf-antman: active" in on.stderr and "device_memory=1.0 GiB" in on.stderr
    assert "tf-antman" not in off.stderr and "tf-antman" not in off.stdout
    assert "final loss" in on.stdout and "final loss" in off.stdout


PRIORITY = """
import os, threading, time
stop = threading.Event()
early = threading.Thread(target=stop.wait)  # exists before activation: must be changed too
early.start()
import tf_antman
tf_antman.enable(device="emulated", device_priority=PRIORITY)
import tensorflow as tf
a = tf.random.normal((512, 512))
tf.matmul(a, a).numpy()  # TF's thread pools exist from here
ds = tf.data.Dataset.range(64).map(lambda x: x * 2, num_parallel_calls=2).prefetch(2)
sum(int(x) for x in ds)
policies = {int(t): os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")}
stop.set()
emit({"policies": sorted(policies.values()), "threads": len(policies), "idle": os.SCHED_IDLE,
      "early": policies.get(early.native_id)})
"""


def test_low_device_priority_puts_every_thread_of_the_job_in_the_idle_class() -> None:
    """ANTMAN_DEVICE_PRIORITY=low (tf_antman/priority.py): the threads that existed at activation
    and every thread TF starts later (its intra-/inter-op pools, tf.data's) run under SCHED_IDLE;
    `normal` leaves them all as they were."""
    low = run_py(PRIORITY.replace("PRIORITY)", '"low")')).result
    assert low["threads"] >= 4, low  # main, the early thread, TF's pools
    assert set(low["policies"]) == {low["idle"]} and low["early"] == low["idle"]
    normal = run_py(PRIORITY.replace("PRIORITY)", '"normal")')).result
    assert low["idle"] not in normal["policies"] and normal["early"] != low["idle"]
