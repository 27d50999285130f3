"""A real Keras job under tf-antman talks to its coordinator through the job directory:
controls act on the native allocator and operator manager, stats report what they measure."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from tests.conftest import REPO, clean_env, run_py
from tf_antman.jobside import NativeStatsSource
from tf_antman.protocol import Control, MemoryLimit, read_stats, write_control

JOB = """
import sys, numpy as np, tensorflow as tf
x = np.random.default_rng(0).normal(size=(4096, 64)).astype("float32"); y = (x.sum(1) > 0).astype("float32")
m = tf.keras.Sequential([tf.keras.Input((64,)), tf.keras.layers.Dense(512, activation="relu"), tf.keras.layers.Dense(1)])
m.compile(optimizer="adam", loss="mse")
import json, time
mine = []
class Own(tf.keras.callbacks.Callback):  # the job's own, independent timing of each train batch
    def on_train_batch_begin(self, b, logs=None): self.t = time.perf_counter()
    def on_train_batch_end(self, b, logs=None): mine.append(1000 * (time.perf_counter() - self.t))
m.fit(x, y, batch_size=32, epochs=int(sys.argv[1]), verbose=0, validation_split=0.1, callbacks=[Own()])
print(json.dumps({"own_ms": mine[-32:]}), flush=True)
if len(sys.argv) > 2 and sys.argv[2] == "sys.exit": sys.exit(3)
if len(sys.argv) > 2 and sys.argv[2] == "exit": exit(4)  # site's exit(), as quick scripts call it
if len(sys.argv) > 2: raise RuntimeError("boom")
"""


def _start(job_dir: Path, epochs: int, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", JOB, str(epochs), *extra], cwd=REPO, text=True,
                            env=clean_env(ANTMAN_JOB_DIR=str(job_dir), ANTMAN_DEVICE_ID="3",
                                          ANTMAN_DEVICE_MEMORY="1GiB", ANTMAN_STATS_INTERVAL_MS="20"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait(job_dir: Path, pred, timeout: float = 120.0):  # noqa: ANN001, ANN202
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = read_stats(job_dir)
        if s is not None and pred(s):
            return s
        time.sleep(0.02)
    raise AssertionError(f"timed out; last stats: {read_stats(job_dir)}")


def test_controls_act_on_the_native_runtime_and_stats_acknowledge(tmp_path: Path) -> None:
    p = _start(tmp_path, 40)
    try:
        _wait(tmp_path, lambda s: s.state == "running" and s.step >= 5)
        write_control(tmp_path, Control(seq=1, memory_limits=(MemoryLimit(device=3, limit_bytes=128 << 10),),
                                        compute_share=0.5))
        s = _wait(tmp_path, lambda s: s.control_seq_applied == 1)
        assert s.devices[0].device == 3
        assert s.devices[0].limit_bytes == 128 << 10
        assert s.compute_share == 0.5
        # The native allocator really runs under the new limit: next steps spill to host.
        s = _wait(tmp_path, lambda s: s.devices[0].host_fallbacks > 0)
        # A control for a device the job does not have is rejected with a reason; the last
        # good one stays in force.
        write_control(tmp_path, Control(seq=2, memory_limits=(MemoryLimit(device=0, limit_bytes=1 << 30),)))
        s = _wait(tmp_path, lambda s: s.last_rejected is not None and s.last_rejected.seq == 2)
        assert s.last_rejected.field == "memory_limits[0]" and "device 0" in s.last_rejected.reason
        assert s.devices[0].limit_bytes == 128 << 10 and s.compute_share == 0.5
        write_control(tmp_path, Control(seq=3, memory_limits=(MemoryLimit(device=3, limit_bytes=512 << 20),),
                                        compute_share=1.0))
        _wait(tmp_path, lambda s: s.control_seq_applied == 3 and s.devices[0].limit_bytes == 512 << 20)
    finally:
        out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    final = read_stats(tmp_path)
    assert final is not None and final.state == "finished"
    # 40 epochs x 116 training batches; validation batches are not steps
    assert final.step == 40 * 116
    # The statistics' step times are the training batches' own durations: the same last 32
    # batches timed independently inside the job agree within 10% (evaluation batches, which
    # would be faster, are not in the window).
    own = json.loads(out.strip().splitlines()[-1])["own_ms"]
    window = list(final.step_ms_window)
    assert len(window) == len(own) == 32
    med = sorted(window)[16]
    own_med = sorted(own)[16]
    assert abs(med - own_med) <= 0.1 * own_med


def test_a_crashing_script_is_reported_failed(tmp_path: Path) -> None:
    p = _start(tmp_path, 1, "raise")
    p.communicate(timeout=300)
    assert p.returncode != 0
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["state"] == "failed"


def test_a_non_zero_exit_is_reported_failed(tmp_path: Path) -> None:
    # SystemExit does not reach sys.excepthook: sys.exit(3) used to end with state "finished".
    for mode, status in (("sys.exit", 3), ("exit", 4)):
        job_dir = tmp_path / mode
        job_dir.mkdir()
        p = _start(job_dir, 1, mode)
        p.communicate(timeout=300)
        assert p.returncode == status
        assert json.loads((job_dir / "stats.json").read_text())["state"] == "failed", mode


# An unmarked loop of eager ops (no step boundary: a control reaches it through the fallback).
LOOP = """
import os, signal, sys, time
import tensorflow as tf
if sys.argv[1] == "own-handler":  # the script's own SIGTERM handler, installed after tf-antman's start
    def own(signum, frame):
        print("own handler", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, own)
a = tf.random.normal((64, 64))
print("ready", flush=True)
while True:
    tf.matmul(a, a).numpy()
"""


def _spawn(script: str, job_dir: Path, mode: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", script, mode], cwd=REPO, text=True,
                            env=clean_env(ANTMAN_JOB_DIR=str(job_dir), ANTMAN_DEVICE="emulated", **env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _sigterm_when_ready(p: subprocess.Popen[str]) -> tuple[str, str]:
    """SIGTERM once the script says "ready"; its (stdout, stderr) after it ended."""
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        p.send_signal(signal.SIGTERM)
        return p.communicate(timeout=60)
    finally:
        p.kill()


def _start_loop(job_dir: Path, mode: str) -> subprocess.Popen[str]:
    return _spawn(LOOP, job_dir, mode, ANTMAN_CONTROL_FALLBACK_MS="50")


def test_sigterm_writes_the_final_state_and_still_kills(tmp_path: Path) -> None:
    # scheduler_lite cancels and migrates with SIGTERM: stats stayed "running", no exit report.
    # Here the job is held at compute share 0 by the fallback (its main thread stuck in an op,
    # where a Python signal handler cannot run), the hardest moment to end it.
    p = _start_loop(tmp_path, "plain")
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        write_control(tmp_path, Control(seq=1, paused=True))
        _wait(tmp_path, lambda s: s.state == "paused")
        time.sleep(0.5)
        sent = time.monotonic()
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == -signal.SIGTERM, err[-3000:]
    assert time.monotonic() - sent < 10
    final = read_stats(tmp_path)
    assert final is not None and final.state == "terminated" and final.control_seq_applied == 1
    # The exit report, with the time held at share 0 as paused (a warning: it slowed the job).
    [report] = [line for line in err.splitlines() if "tf-antman: at exit:" in line]
    paused = float(report.split("paused ")[1].split(" s")[0])
    assert report.startswith("W") or "WARNING" in report
    assert paused >= 0.5


def test_a_sigterm_handler_of_the_script_is_left_alone(tmp_path: Path) -> None:
    p = _start_loop(tmp_path, "own-handler")
    out, err = _sigterm_when_ready(p)
    assert p.returncode == 0 and "own handler" in out, err[-3000:]
    final = read_stats(tmp_path)
    assert final is not None and final.state == "finished"


CHILD_JOB = """
import json, multiprocessing as mp, os, pathlib, sys
def work(path):  # a spawn child: inherits ANTMAN_JOB_DIR and imports TensorFlow
    import tensorflow as tf, tf_antman
    tf.reduce_sum(tf.ones((10,))).numpy()
    with open(path, "w") as f:
        json.dump({"pid": os.getpid(), "active": tf_antman.is_active(), "device": tf_antman.settings().device,
                   "agent": tf_antman._state().steps.agent is not None}, f)
if __name__ == "__main__":
    import tensorflow as tf, tf_antman
    from tf_antman.protocol import read_stats
    m = tf.keras.Sequential([tf.keras.Input(shape=(4,)), tf.keras.layers.Dense(1)]); m.compile("sgd", "mse")
    m.fit(tf.ones((64, 4)), tf.ones((64, 1)), epochs=1, batch_size=8, verbose=0)
    child = mp.get_context("spawn").Process(target=work, args=(sys.argv[1],))
    child.start(); child.join()
    agent = tf_antman._state().steps.agent
    agent.flush_stats()
    after_child = read_stats(pathlib.Path(os.environ["ANTMAN_JOB_DIR"]))
    m.fit(tf.ones((64, 4)), tf.ones((64, 1)), epochs=1, batch_size=8, verbose=0)
    print(json.dumps({"pid": os.getpid(), "child_rc": child.exitcode, "after_child": [after_child.pid, after_child.state],
                      "child": json.load(open(sys.argv[1]))}), flush=True)
"""


def test_a_child_process_runs_without_an_agent(tmp_path: Path) -> None:
    # A second agent on the job directory overwrote the job's stats.json with the child's pid and
    # state "finished" at the child's exit, and applied controls to the child.
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    script = tmp_path / "job.py"  # spawn re-imports the main module: it must be a file
    script.write_text(CHILD_JOB)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "child.json")], cwd=REPO, text=True,
                         env=clean_env(ANTMAN_JOB_DIR=str(job_dir), ANTMAN_DEVICE="emulated"),
                         capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["child_rc"] == 0 and r["child"]["pid"] != r["pid"]
    assert r["after_child"] == [r["pid"], "running"]
    # The child still runs on tf-antman's device (stock TF could take a whole GPU), unmanaged.
    assert r["child"] == {"pid": r["child"]["pid"], "active": True, "device": "emulated", "agent": False}
    assert out.stderr.count("runs without one: it writes no stats and takes no controls") == 1
    final = read_stats(job_dir)
    assert final is not None and (final.pid, final.state, final.step) == (r["pid"], "finished", 16)


def test_a_bad_job_directory_is_a_config_error_at_start(tmp_path: Path) -> None:
    # It crashed `import tensorflow` with a ProtocolError naming "job_dir" (or FileNotFoundError).
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for bad in (tmp_path / "missing", a_file):
        job = run_py("import tensorflow", timeout=120, ANTMAN_JOB_DIR=str(bad))
        assert job.rc != 0
        last = job.stderr.strip().splitlines()[-1]
        assert last == (f"tf_antman.config.ConfigError: ANTMAN_JOB_DIR={str(bad)!r} is invalid: "
                        "accepted an existing directory this process can write to")


def test_a_job_directory_the_agent_cannot_use_is_logged_once(tmp_path: Path) -> None:
    # What the start-up check cannot foresee (here: the lock file is a directory; /sys as root is
    # another) stops the agent, not the job.
    (tmp_path / "agent.lock").mkdir()
    job = run_py("""
        import tensorflow as tf, tf_antman
        tf.reduce_sum(tf.ones((4,))).numpy()
        emit({"active": tf_antman.is_active(), "agent": tf_antman._state().steps.agent is not None})
    """, timeout=120, ANTMAN_JOB_DIR=str(tmp_path), ANTMAN_DEVICE="emulated")
    assert job.rc == 0, job.stderr[-3000:]
    assert job.result == {"active": True, "agent": False}
    lines = [line for line in job.stderr.splitlines() if "tf-antman:" in line]
    assert len(lines) == 1 and "cannot start the job agent on" in lines[0]
    assert "agent.lock: is a directory" in lines[0] and "Traceback" not in job.stderr
    assert not (tmp_path / "stats.json").exists()


FORK_JOB = """
import json, multiprocessing as mp, time
import tensorflow as tf
def idle():
    time.sleep(60)
if __name__ == "__main__":
    m = tf.keras.Sequential([tf.keras.Input(shape=(4,)), tf.keras.layers.Dense(1)]); m.compile("sgd", "mse")
    m.fit(tf.ones((64, 4)), tf.ones((64, 1)), epochs=1, batch_size=8, verbose=0)
    child = mp.get_context("fork").Process(target=idle)
    child.start(); time.sleep(0.5)
    child.terminate(); child.join()  # SIGTERM to the forked child
    time.sleep(0.5)
    print(json.dumps({"child_rc": child.exitcode}), flush=True)
"""


def test_terminating_a_forked_child_leaves_the_job_alone(tmp_path: Path) -> None:
    # A forked child shares the SIGTERM wakeup pipe of the job's process: its SIGTERM must end the
    # child as by default, not reach the parent's reader (which would terminate the job).
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    script = tmp_path / "job.py"
    script.write_text(FORK_JOB)
    out = subprocess.run([sys.executable, str(script)], cwd=REPO, text=True, capture_output=True, timeout=300,
                         env=clean_env(ANTMAN_JOB_DIR=str(job_dir), ANTMAN_DEVICE="emulated"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"child_rc": -signal.SIGTERM}
    final = read_stats(job_dir)
    assert final is not None and final.state == "finished" and final.step == 8


VERBOSE_LOG = "from absl import logging as absl_logging\nabsl_logging.set_verbosity(absl_logging.INFO)\n"

THREAD_JOB = """
import json, sys, threading, time
import numpy as np, tensorflow as tf, keras
m = keras.Sequential([keras.Input(shape=(8,)), keras.layers.Dense(4)]); m.compile("sgd", "mse")
x = np.ones((8, 8), "float32"); y = np.ones((8, 4), "float32")
def train():  # a non-daemon thread that trains on after the main thread has returned
    time.sleep(1.0)
    n = 0
    while n < 200:
        m.train_on_batch(x, y); n += 1
    print(json.dumps({"steps": n}), flush=True)
threading.Thread(target=train).start()
"""


def test_a_job_that_trains_in_a_thread_ends_when_the_thread_does(tmp_path: Path) -> None:
    # The final state, the agent's close and the exit report ran when the main thread returned
    # (threading's exit hooks run before the interpreter joins non-daemon threads): "finished" at
    # step 0 while the thread trained on, unmanaged.
    out = subprocess.run([sys.executable, "-c", VERBOSE_LOG + THREAD_JOB], cwd=REPO, text=True,
                         capture_output=True, timeout=300,
                         env=clean_env(ANTMAN_JOB_DIR=str(tmp_path), ANTMAN_DEVICE="emulated"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"steps": 200}
    final = read_stats(tmp_path)
    assert final is not None and (final.state, final.step) == ("finished", 200)
    assert len([line for line in out.stderr.splitlines() if "tf-antman: at exit:" in line]) == 1


ENDINGS = """
import sys
if sys.argv[1] == "from-sys-exit":
    from sys import exit  # bound before tf-antman starts (at `import tensorflow`)
import tensorflow as tf
tf.reduce_sum(tf.ones((3,))).numpy()
if sys.argv[1] == "from-sys-exit":
    exit(5)
if sys.argv[1] == "own-excepthook":  # the script's own hook, installed after tf-antman's start
    sys.excepthook = lambda t, v, tb: print("own hook:", v, file=sys.stderr)
raise RuntimeError("boom")
"""


def test_a_crash_or_exit_status_is_seen_whatever_hooks_and_names_the_script_uses(tmp_path: Path) -> None:
    # An excepthook installed after start-up replaced the wrapped one: a crash ended "finished";
    # `from sys import exit` before the import escaped the sys.exit wrapper.
    for mode, status in (("from-sys-exit", 5), ("own-excepthook", 1)):
        job_dir = tmp_path / mode
        job_dir.mkdir()
        out = subprocess.run([sys.executable, "-c", ENDINGS, mode], cwd=REPO, text=True, capture_output=True,
                             timeout=300, env=clean_env(ANTMAN_JOB_DIR=str(job_dir), ANTMAN_DEVICE="emulated"))
        assert out.returncode == status, out.stderr[-3000:]
        assert json.loads((job_dir / "stats.json").read_text())["state"] == "failed", mode
        assert ("own hook: boom" in out.stderr) == (mode == "own-excepthook")


HELD = """
import sys, threading, time
import tensorflow as tf, tf_antman
print("holding", flush=True)
tf.reduce_sum(tf.ones((3,))).numpy()  # held: ANTMAN_COMPUTE_SHARE=0
print("released", flush=True)
if sys.argv[1] == "interrupt":
    time.sleep(60)  # not reached: the interrupt is raised as the op returns
# Held again, by the user this time, for about 1 s.
tf_antman.set_compute_share(0.0)
threading.Timer(1.0, tf_antman.set_compute_share, args=(1.0,)).start()
tf.reduce_sum(tf.ones((3,))).numpy()
print("done", flush=True)
"""


def _start_held(job_dir: Path, mode: str) -> subprocess.Popen[str]:
    return _spawn(HELD, job_dir, mode, ANTMAN_COMPUTE_SHARE="0")


def test_ctrl_c_ends_a_job_held_at_compute_share_0(tmp_path: Path) -> None:
    # The main thread waited in the op manager with the GIL released: Python's SIGINT handler
    # never ran, and Ctrl-C was ignored until SIGTERM.
    p = _start_held(tmp_path, "interrupt")
    try:
        assert p.stdout is not None and p.stdout.readline() == "holding\n", p.communicate()[1][-3000:]
        time.sleep(1.5)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=30)
    finally:
        p.kill()
    assert p.returncode == -signal.SIGINT, err[-3000:]  # as an uncaught KeyboardInterrupt ends Python
    assert "KeyboardInterrupt" in err and "interrupted (SIGINT) while ops are held at compute share 0" in err
    final = read_stats(tmp_path)
    assert final is not None and final.state == "failed"


def test_every_hold_at_compute_share_0_counts_as_paused(tmp_path: Path) -> None:
    # The start-up share 0 and the user's set_compute_share(0) were not counted: "paused 0.0 s",
    # at INFO, hidden by default.
    p = _start_held(tmp_path, "release")
    try:
        assert p.stdout is not None and p.stdout.readline() == "holding\n", p.communicate()[1][-3000:]
        time.sleep(2.0)
        write_control(tmp_path, Control(seq=1, compute_share=1.0))
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 0 and out.endswith("done\n"), err[-3000:]
    [report] = [line for line in err.splitlines() if "tf-antman: at exit:" in line]
    assert report.startswith("WARNING:absl:"), report  # it slowed the job: shown by default
    paused = float(report.split("paused ")[1].split(" s")[0])
    assert 2.5 <= paused < 10, report


def test_sigterm_logs_the_exit_report_without_a_job_directory(tmp_path: Path) -> None:
    p = subprocess.Popen([sys.executable, "-c", VERBOSE_LOG + LOOP, "plain"], cwd=REPO, text=True,
                         env=clean_env(ANTMAN_DEVICE="emulated"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, err = _sigterm_when_ready(p)
    assert p.returncode == -signal.SIGTERM, err[-3000:]
    assert len([line for line in err.splitlines() if "tf-antman: at exit:" in line]) == 1, err[-3000:]


def test_a_control_limit_above_the_device_memory_is_clipped_to_it(tmp_path: Path) -> None:
    # A 1 TiB limit on a 1 GiB device was put into force and echoed as 1 TiB in stats.json,
    # while the exit report said "limit: the whole device".
    p = _start(tmp_path, 40)
    try:
        _wait(tmp_path, lambda s: s.state == "running" and s.step >= 5)
        write_control(tmp_path, Control(seq=1, memory_limits=(MemoryLimit(device=3, limit_bytes=1 << 40),)))
        s = _wait(tmp_path, lambda s: s.control_seq_applied == 1)
        assert s.devices[0].limit_bytes == 1 << 30 and s.last_rejected is None
    finally:
        p.kill()
        _, err = p.communicate(timeout=60)
    assert "control memory limit 1099511627776 bytes for device 3 is above the device's memory " \
           "(1073741824 bytes): clipped to it" in err


def test_stats_report_the_share_and_its_achieved_share_from_one_reading() -> None:
    # A share change between two readings used to pair share 0.5 with "not measured" (the
    # achieved share of share 1): stats.json must give both from the same moment.
    readings = iter([SimpleNamespace(share=0.5, achieved_share_window=0.45),
                     SimpleNamespace(share=1.0, achieved_share_window=0.0)])
    native = SimpleNamespace(op_stats=lambda: next(readings))
    assert NativeStatsSource(native, 0).shares() == (0.5, 0.45)  # type: ignore[arg-type]
