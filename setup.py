"""Builds the tf-antman wheel: Python packages plus the native libraries built by Bazel.

    python setup.py build_native      # bazel build, copy the .so files into tf_antman/_native/
    pip wheel --no-build-isolation --no-deps -w dist .

The Bazel build compiles against the TensorFlow installed for the Python running this script
(TF_ANTMAN_PYTHON defaults to it), so the wheel matches the pinned tensorflow==2.21.0.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Command, find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent
NATIVE_DIR = ROOT / "tf_antman" / "_native"
TARGETS = {"//:libtf_antman.so": "libtf_antman.so", "//:_antman_ops.so": "_antman_ops.so",
           "//:libantman_core.so": "libantman_core.so",
           "//cc/torch:libantman_torch.so": "libantman_torch.so"}
PTH_NAME = "tf_antman-autoload.pth"
sys.path.insert(0, str(ROOT))
from tf_antman.importhook import PTH_LINE as PTH_TEXT  # noqa: E402 - one definition of the line


def build_native() -> None:
    env = dict(os.environ)
    env.setdefault("TF_ANTMAN_PYTHON", sys.executable)
    cmd = ["bazel", "build", *TARGETS]
    print("running:", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    NATIVE_DIR.mkdir(exist_ok=True)
    for label, name in TARGETS.items():
        src = ROOT / "bazel-bin" / label.lstrip("/").replace(":", "/").lstrip("/")  # //pkg:name -> pkg/name
        dst = NATIVE_DIR / name
        if dst.exists():
            dst.chmod(0o755)
        shutil.copyfile(src, dst)
        print(f"copied {src} -> {dst}", flush=True)


class BuildNative(Command):
    description = "build the native libraries with Bazel and copy them into tf_antman/_native"
    user_options: list = []

    def initialize_options(self) -> None:
        pass

    def finalize_options(self) -> None:
        pass

    def run(self) -> None:
        build_native()


class BuildPyWithNative(build_py):
    """Builds the libraries unless present (TF_ANTMAN_SKIP_NATIVE_BUILD=1 requires them present)
    and puts the autoload .pth at the root of site-packages."""

    def run(self) -> None:
        missing = [n for n in TARGETS.values() if not (NATIVE_DIR / n).exists()]
        if missing and os.environ.get("TF_ANTMAN_SKIP_NATIVE_BUILD") != "1":
            build_native()
        super().run()
        Path(self.build_lib, PTH_NAME).write_text(PTH_TEXT)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib, PTH_NAME))]


class BinaryDistribution(Distribution):
    def has_ext_modules(self) -> bool:  # a platform wheel: it carries .so files
        return True


setup(
    name="tf-antman",
    version="0.1.0",
    description="AntMan-style dynamic GPU sharing for TensorFlow, and scheduler_lite",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["tf_antman", "tf_antman.*", "scheduler_lite", "scheduler_lite.*"]),
    package_data={"tf_antman": ["_native/*.so", "torch/op_hook.cpp"], "scheduler_lite": ["data/*"]},
    install_requires=["tensorflow==2.21.0", "numpy", "pynvml", "watchdog", "absl-py"],
    # `scheduler-lite serve --metrics-port`: Prometheus metrics (scheduler_lite/metrics.py);
    # `ray`: cluster mode and ray_options (scheduler_lite/cluster, docs/cluster.md)
    extras_require={"metrics": ["prometheus_client"], "ray": ["ray==2.60.0"]},
    entry_points={"console_scripts": ["scheduler-lite=scheduler_lite.cli:main"]},
    cmdclass={"build_native": BuildNative, "build_py": BuildPyWithNative},
    distclass=BinaryDistribution,
    zip_safe=False,
)
