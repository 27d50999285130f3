"""The judge that bench/compute.py uses for the achieved share (bench/_threadcpu.py): kernel CPU
time of the job's non-Python threads. The bench's figures are only as good as this split, so it
is tested on a real TF job: Python threads never count, TF's kernel threads do, and a paused job
adds nothing."""

from __future__ import annotations

from tests.conftest import REPO, run_py

PRELUDE = f"""
        import sys, threading, time
        sys.path.insert(0, {str(REPO / 'bench')!r})
        from _threadcpu import device_thread_times
"""


def test_python_threads_are_not_device_work() -> None:
    job = run_py(PRELUDE + """
        def burn(seconds):
            end = time.thread_time() + seconds
            while time.thread_time() < end:
                pass
        d0, p0 = device_thread_times(), time.process_time()
        t = threading.Thread(target=burn, args=(0.4,)); t.start(); burn(0.2); t.join()
        d1, p1 = device_thread_times(), time.process_time()
        emit({"device": d1.on_cpu_s - d0.on_cpu_s, "process": p1 - p0})
    """)
    r = job.result
    assert r["process"] >= 0.55
    assert r["device"] < 0.05


def test_tf_kernels_count_and_a_paused_job_adds_nothing() -> None:
    job = run_py(PRELUDE + """
        import tensorflow as tf, tf_antman
        x = tf.random.normal((256, 512)); w = tf.Variable(tf.random.normal((512, 512)))
        @tf.function(autograph=False)  # the snippet has no source file for AutoGraph
        def work():
            y = x
            for _ in range(40):
                y = tf.tanh(tf.matmul(y, w))
            return tf.reduce_sum(y)
        work()
        def measure(seconds):
            d0, t0 = device_thread_times(), time.monotonic()
            done = threading.Event()
            def loop():
                while not done.is_set():
                    work().numpy()
            th = threading.Thread(target=loop, daemon=True); th.start()
            time.sleep(seconds)
            d1 = device_thread_times()
            done.set()
            return d1.on_cpu_s - d0.on_cpu_s, time.monotonic() - t0
        running, wall = measure(1.5)
        tf_antman.set_compute_share(0.0)
        time.sleep(0.3)  # the op in flight when the pause came finishes
        paused, _ = measure(1.5)
        tf_antman.set_compute_share(1.0)
        emit({"running": running, "paused": paused, "wall": wall})
    """, ANTMAN_ENABLE="1", TF_NUM_INTEROP_THREADS="1", TF_NUM_INTRAOP_THREADS="1")
    r = job.result
    assert r["running"] > 0.1, r  # the kernels ran on TF's threads, and were counted
    assert r["paused"] < r["running"] / 10, r
