"""The wheel builds, installs into a new virtualenv, and activates from an unchanged script there.

Slow (a new venv gets TensorFlow from pip's cache or index), but it is the only test of what a
user actually installs: the .pth autoload line, the packaged .so files, the dependencies."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

from tests.conftest import REPO


def test_wheel_builds_installs_and_activates(tmp_path: Path) -> None:
    env = dict(os.environ, TF_ANTMAN_SKIP_NATIVE_BUILD="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
                    "-w", str(tmp_path / "dist"), str(REPO)], check=True, env=env, timeout=600)
    wheels = list((tmp_path / "dist").glob("tf_antman-*.whl"))
    assert len(wheels) == 1
    names = zipfile.ZipFile(wheels[0]).namelist()
    assert "tf_antman/_native/libtf_antman.so" in names
    assert "tf_antman/_native/_antman_ops.so" in names
    assert "tf_antman/_native/libantman_core.so" in names
    assert "tf_antman/_native/libantman_torch.so" in names  # PyTorch's allocator functions
    assert "tf_antman/torch/op_hook.cpp" in names  # built on the job's machine (docs/pytorch.md)
    assert "tf_antman-autoload.pth" in names
    assert "scheduler_lite/data/perf_model.json" in names
    assert "-linux_x86_64" in wheels[0].name or "-manylinux" in wheels[0].name  # a platform wheel

    target = tmp_path / "venv"
    venv.create(target, with_pip=True)
    py = target / "bin" / "python"
    # Without PYTHONPATH: with this checkout on it, the new venv's pip finds tf_antman.egg-info there,
    # calls tf-antman "already satisfied" and installs nothing of the wheel (it happened after a test
    # module had put the checkout on PYTHONPATH).
    no_path = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheels[0])], check=True, env=no_path,
                   timeout=1200)
    script = tmp_path / "user_script.py"  # an unchanged user script: no tf_antman import
    script.write_text("from absl import logging\n"  # INFO lines on, as under absl.app
                      "logging.set_verbosity(logging.INFO)\n"
                      "import tensorflow as tf\n"
                      "print('sum', float(tf.reduce_sum(tf.ones((64, 64)))))\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("ANTMAN_", "PYTHONPATH"))}
    clean["TF_CPP_MIN_LOG_LEVEL"] = "2"
    on = subprocess.run([str(py), str(script)], cwd=tmp_path, capture_output=True, text=True,
                        env=dict(clean, ANTMAN_DEVICE_MEMORY="256MiB"), timeout=300)
    assert on.returncode == 0, on.stderr[-3000:]
    assert "sum 4096.0" in on.stdout
    assert "tf-antman: active" in on.stderr, on.stderr[-6000:]  # whole, to tell why if it is missing
    assert str(target) in subprocess.run(
        [str(py), "-c", "import tf_antman, sys; print(tf_antman.__file__)"], capture_output=True,
        text=True, env=clean, cwd=tmp_path).stdout
    # The wheel's library carries the GPU device factories: with the default ANTMAN_DEVICE=auto on
    # this GPU-less machine the job is emulated and TF's "GPU" factory is ours, hiding GPUs.
    gpu = subprocess.run([str(py), "-c", "import tensorflow as tf\n"
                          "from tf_antman import activation\n"
                          "f = activation.active().native.gpu_factory()\n"
                          "print('gpu', f['kind'], f['registered'], "
                          "len(tf.config.list_physical_devices('GPU')))\n"],
                         cwd=tmp_path, capture_output=True, text=True,
                         env=dict(clean, ANTMAN_DEVICE_MEMORY="256MiB"), timeout=300)
    assert "gpu hidden 1 0" in gpu.stdout, gpu.stderr[-3000:]
    off = subprocess.run([str(py), str(script)], cwd=tmp_path, capture_output=True, text=True,
                         env=clean, timeout=300)
    assert off.returncode == 0 and "tf-antman" not in off.stderr
