"""A real Keras job under tf-antman talks to its coordinator through the job directory:
controls act on the native allocator and operator manager, stats report what they measure."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO, clean_env
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
if len(sys.argv) > 2: raise SystemExit("boom") if sys.argv[2] == "exit" else RuntimeError("boom")
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
