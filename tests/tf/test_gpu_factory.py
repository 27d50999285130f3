"""The GPU device factory in stock TF on a machine without a GPU (issue 11, CI side): it is built
into the wheel's library, registers for "GPU" above TF's own, creates no device, and CPU training
is unchanged; ANTMAN_DEVICE=emulated hides GPUs from TF; auto falls back to emulated; cuda is
refused in one line."""

from __future__ import annotations

import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.conftest import run_py

TRAIN = """
import numpy as np
import tensorflow as tf
tf.keras.utils.set_random_seed(0)
x = np.random.rand(256, 8).astype("float32")
y = x @ np.arange(8, dtype="float32")[:, None]
model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(1)])
model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")
hist = model.fit(x, y, epochs=5, batch_size=32, verbose=0).history["loss"]
gpus = [d.name for d in tf.config.list_physical_devices("GPU")]
logical = [d.name for d in tf.config.list_logical_devices()]
"""
# The cuda runtime configured directly (activation would refuse cuda here: no driver), which is
# what a GPU machine runs, minus the GPUs.
CUDA_RUNTIME = """
from tf_antman import exit_report, native
lib = native.load()
lib.configure("cuda", 0, 0, 0, 1 << 30, 1.0)
"""
# What the job can read of its memory, and its exit report.
MEMORY_AND_REPORT = """
try:
    lib.mem_stats()
    no_memory = None
except native.NativeError as e:
    no_memory = str(e)
exit_report.report(lib)
"""


def test_cuda_factory_registers_in_stock_tf_without_gpu_and_cpu_training_runs() -> None:
    job = run_py(CUDA_RUNTIME + TRAIN + MEMORY_AND_REPORT + textwrap.dedent("""
        emit({"factory": lib.gpu_factory(), "gpus": gpus, "logical": logical, "loss": hist,
              "antman_devices": lib.device_count(), "no_memory": no_memory})
    """))
    r = job.result
    # TF made no GPU: the job runs on the CPU, unmanaged, and is told so, once, and at exit.
    unmanaged = "tf-antman: ANTMAN_DEVICE=cuda, but TensorFlow created no GPU device and sees no GPU"
    assert job.stderr.count(unmanaged) == 1, job.stderr[-3000:]
    assert r["no_memory"] is not None and "TensorFlow created none" in r["no_memory"]
    assert "at exit: no figures: no GPU device under tf-antman: TensorFlow created none" in job.stderr
    f = r["factory"]
    assert f["kind"] == "cuda"
    assert f["registered"] == 1, "TF's GPU factory is not ours: registered too late or below 210"
    assert f["list_calls"] >= 1 and f["create_calls"] >= 1, "TF never consulted our GPU factory"
    assert f["devices"] == 0 and r["antman_devices"] == 0
    assert r["gpus"] == [] and all("GPU" not in d for d in r["logical"])
    assert r["loss"][-1] < r["loss"][0] / 2


def test_cuda_before_tf_created_its_devices_says_so_and_stays_quiet_at_exit() -> None:
    # Nothing ran (TF imported, no op): no device yet is no news worth a warning at exit.
    job = run_py(CUDA_RUNTIME + "import tensorflow as tf\n" + MEMORY_AND_REPORT + textwrap.dedent("""
        emit({"no_memory": no_memory, "creates": lib.gpu_factory()["create_calls"]})
    """))
    r = job.result
    assert r["creates"] == 0 and "TensorFlow has not created its devices" in r["no_memory"]
    assert "at exit" not in job.stderr and "created no GPU device" not in job.stderr


def test_emulated_hides_gpus_from_tf() -> None:
    job = run_py("import tf_antman\n" + TRAIN + textwrap.dedent("""
        from tf_antman import activation
        lib = activation.active().native
        emit({"factory": lib.gpu_factory(), "gpus": gpus, "logical": logical, "loss": hist,
              "device": tf_antman.settings().device})
    """), ANTMAN_DEVICE="emulated")
    r = job.result
    assert r["device"] == "emulated"
    assert r["factory"]["kind"] == "hidden" and r["factory"]["registered"] == 1
    assert r["factory"]["list_calls"] >= 1, "list_physical_devices('GPU') did not reach our factory"
    assert r["gpus"] == [] and all("GPU" not in d for d in r["logical"])
    assert r["loss"][-1] < r["loss"][0] / 2


def test_auto_without_driver_is_emulated() -> None:
    job = run_py("""
        import tensorflow as tf
        import tf_antman
        emit({"device": tf_antman.settings().device, "info": tf_antman.device_info()})
    """, ANTMAN_ENABLE="1", ANTMAN_DEVICE="auto")
    r = job.result
    assert r["device"] == "emulated"
    assert r["info"]["allocator"] == "antman_universal"


def test_cuda_without_driver_is_refused_in_one_line() -> None:
    job = run_py("import tensorflow as tf\nemit({'reached': True})", ANTMAN_DEVICE="cuda")
    assert job.rc != 0 and '"reached"' not in job.stdout
    # The exception's message is the traceback's last line, whole.
    last = job.stderr.strip().splitlines()[-1]
    assert last.startswith("tf_antman.device_select.DeviceUnavailable: ANTMAN_DEVICE=cuda refused:")
    assert "libcuda.so.1" in last and last.endswith("use ANTMAN_DEVICE=emulated or auto")


FOREIGN_TF = r"""
/* Stands for libtf_antman.so built against another TensorFlow build: it needs a symbol of TF's
   GPU device that tensorflow-cpu's framework library does not export. */
extern void _ZN10tensorflow13BaseGPUDeviceD2Ev(void);
void antman_uses_gpu_device(void) { _ZN10tensorflow13BaseGPUDeviceD2Ev(); }
"""


def test_a_tensorflow_without_the_gpu_classes_is_one_line_even_emulated(tmp_path: Path) -> None:
    """tensorflow-cpu lacks TF's GPU device classes, so libtf_antman.so does not link; `import
    tensorflow` (the import hook activates tf-antman) ends in one line naming the wheel, not the
    dynamic linker's OSError, with ANTMAN_DEVICE=emulated too. The library is stood in for by one
    with exactly that undefined symbol (no tensorflow-cpu is installed here)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the stand-in library")
    (tmp_path / "foreign.c").write_text(FOREIGN_TF)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(tmp_path / "libtf_antman.so"), str(tmp_path / "foreign.c")],
                   check=True)
    job = run_py("import tensorflow as tf\nemit({'reached': True})", ANTMAN_DEVICE="emulated",
                 TF_ANTMAN_LIB_DIR=str(tmp_path))
    assert job.rc != 0 and '"reached"' not in job.stdout
    last = job.stderr.strip().splitlines()[-1]
    assert last.startswith("tf_antman.native.NativeError: libtf_antman.so cannot link against the installed "
                           "TensorFlow (undefined symbol _ZN10tensorflow13BaseGPUDeviceD2Ev)"), last
    assert "tensorflow==2.21.0" in last and "tensorflow-cpu" in last
