"""ANTMAN_DEVICE resolution and refusals (tf_antman/device_select.py), without a driver: the probe
is given fake drivers, resolve() fake probes."""

from __future__ import annotations

import ctypes
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import run_py
from tf_antman import config, device_select
from tf_antman.device_select import CudaProbe, DeviceUnavailable
from tf_antman.units import GiB


class FakeDriver:
    def __init__(self, init_rc: int = 0, count: int = 2, count_rc: int = 0) -> None:
        self.init_rc, self.count, self.count_rc = init_rc, count, count_rc

    def cuInit(self, flags: int) -> int:  # noqa: N802 - the driver's name
        assert flags == 0
        return self.init_rc

    def cuDeviceGetCount(self, out: object) -> int:  # noqa: N802
        ctypes.cast(out, ctypes.POINTER(ctypes.c_int))[0] = self.count
        return self.count_rc


def loader(driver: FakeDriver | None):
    def load(name: str) -> FakeDriver:
        assert name == "libcuda.so.1"
        if driver is None:
            raise OSError("libcuda.so.1: cannot open shared object file")
        return driver
    return load


def test_probe_counts_gpus_and_names_each_failure() -> None:
    probe = device_select.probe_in_process
    assert probe(loader(FakeDriver(count=3))) == CudaProbe(3, "")
    missing = probe(loader(None))
    assert missing.gpus == 0 and "libcuda.so.1 cannot be loaded" in missing.problem
    assert "cuInit returned 999" in probe(loader(FakeDriver(init_rc=999))).problem
    # CUDA_ERROR_NO_DEVICE is an answer, not a failure: no GPU (cuda then says "reports no GPU").
    assert probe(loader(FakeDriver(init_rc=100))) == CudaProbe(0, "")
    bad_count = probe(loader(FakeDriver(count_rc=3)))
    assert "cuDeviceGetCount returned 3" in bad_count.problem


FAKE_LIBCUDA = r"""
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
/* Records which process initialised it, in $FAKE_CUDA_LOG. */
int cuInit(unsigned flags) {
  FILE* f = fopen(getenv("FAKE_CUDA_LOG"), "a");
  if (f) { fprintf(f, "%d\n", (int)getpid()); fclose(f); }
  return flags == 0 ? 0 : 1;
}
int cuDeviceGetCount(int* n) { *n = 2; return 0; }
"""


def test_the_job_process_never_initialises_cuda(tmp_path: Path) -> None:
    """The probe's cuInit runs in a child: after it, the job's process has not loaded libcuda at
    all, so a later fork (multiprocessing) inherits no CUDA state (issue 30). A fake libcuda.so.1
    logs the pid of every cuInit."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the fake libcuda.so.1")
    (tmp_path / "fake.c").write_text(FAKE_LIBCUDA)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(tmp_path / "libcuda.so.1"), str(tmp_path / "fake.c")],
                   check=True)
    log = tmp_path / "cuinit.log"
    job = run_py("""
        import os
        from tf_antman import device_select
        probe = device_select.probe_cuda()
        emit({"pid": os.getpid(), "gpus": probe.gpus, "problem": probe.problem,
              "libcuda_mapped": "libcuda.so.1" in open("/proc/self/maps").read()})
    """, LD_LIBRARY_PATH=str(tmp_path), FAKE_CUDA_LOG=str(log))
    r = job.result
    assert r["gpus"] == 2 and r["problem"] == "", r  # the fake driver answered, through the child
    callers = [int(x) for x in log.read_text().split()]
    assert len(callers) == 1 and callers[0] != r["pid"], (callers, r["pid"])
    assert r["libcuda_mapped"] is False


def fake_run(stdout: str = "", stderr: str = "", rc: int = 0, raises: Exception | None = None):
    def run(args: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        assert args[1:3] == ["-S", "-c"]  # no site: the .pth hook cannot activate tf-antman there
        if raises is not None:
            raise raises
        return subprocess.CompletedProcess(args, rc, stdout, stderr)
    return run


def test_a_probe_child_that_fails_is_one_line() -> None:
    ok = device_select.probe_cuda(fake_run(json.dumps({"init_rc": 0, "count_rc": 0, "count": 4})))
    assert ok == CudaProbe(4, "")
    died = device_select.probe_cuda(fake_run(stderr="Traceback ...\nSegfault-ish: boom\n", rc=-11))
    assert died.gpus == 0 and died.problem == "the CUDA probe process failed (Segfault-ish: boom)"
    silent = device_select.probe_cuda(fake_run(rc=-9))
    assert silent.problem == "the CUDA probe process failed (exit status -9)"
    hung = device_select.probe_cuda(fake_run(raises=subprocess.TimeoutExpired("python", 120)))
    assert hung.problem.startswith("the CUDA probe process could not run (TimeoutExpired")
    for p in (died, silent, hung):
        assert "\n" not in p.problem


def settings(device: str) -> config.Settings:
    return config.load({"ANTMAN_DEVICE": device})


def no_probe() -> CudaProbe:
    raise AssertionError("emulated must not touch the CUDA driver")


@pytest.mark.parametrize(("found", "expected"), [
    (CudaProbe(1, ""), "cuda"),
    (CudaProbe(0, ""), "emulated"),
    (CudaProbe(0, "no CUDA driver"), "emulated"),
])
def test_auto_picks_cuda_only_with_a_driver_and_a_gpu(found: CudaProbe, expected: str) -> None:
    assert device_select.resolve(settings("auto"), {}, lambda: found).device == expected


def test_emulated_never_probes() -> None:
    assert device_select.resolve(settings("emulated"), {}, no_probe).device == "emulated"


@pytest.mark.parametrize(("found", "env", "says"), [
    (CudaProbe(0, "no CUDA driver (x)"), {}, "no CUDA driver (x)"),
    (CudaProbe(0, ""), {"CUDA_VISIBLE_DEVICES": ""}, "reports no GPU with CUDA_VISIBLE_DEVICES=''"),
    (CudaProbe(2, ""), {"TF_GPU_ALLOCATOR": "cuda_malloc_async"}, "TF_GPU_ALLOCATOR=cuda_malloc_async"),
])
def test_cuda_refusals_are_one_line(found: CudaProbe, env: dict[str, str], says: str) -> None:
    with pytest.raises(DeviceUnavailable) as err:
        device_select.resolve(settings("cuda"), env, lambda: found)
    message = str(err.value)
    assert message.startswith("ANTMAN_DEVICE=cuda refused: ") and says in message
    assert "\n" not in message


def test_cuda_with_a_gpu_is_served() -> None:
    assert device_select.resolve(settings("cuda"), {}, lambda: CudaProbe(1, "")).device == "cuda"


def test_cuda_memory_defaults_to_the_gpu_not_the_emulated_budget() -> None:
    cuda = device_select.resolve(settings("cuda"), {}, lambda: CudaProbe(1, ""))
    assert device_select.native_memory(cuda, {"ANTMAN_DEVICE": "cuda"}) == (0, 0)
    env = {"ANTMAN_DEVICE": "cuda", "ANTMAN_DEVICE_MEMORY": "8GiB", "ANTMAN_MEMORY_LIMIT": "2GiB"}
    capped = device_select.resolve(config.load(env), env, lambda: CudaProbe(1, ""))
    assert device_select.native_memory(capped, env) == (8 * GiB, 2 * GiB)
    emulated = settings("emulated")
    assert device_select.native_memory(emulated, {}) == (4 * GiB, 4 * GiB)


def test_a_limit_above_the_emulated_default_is_for_the_gpu_to_judge() -> None:
    """On cuda an unset ANTMAN_DEVICE_MEMORY is the GPU's free memory: an 8GiB limit must not be
    refused against the emulated device's 4GiB default; auto that ends up emulated still is."""
    for device in ("cuda", "auto"):
        env = {"ANTMAN_DEVICE": device, "ANTMAN_MEMORY_LIMIT": "8GiB"}
        on_gpu = device_select.resolve(config.load(env), env, lambda: CudaProbe(1, ""))
        assert device_select.native_memory(on_gpu, env) == (0, 8 * GiB)
    env = {"ANTMAN_DEVICE": "auto", "ANTMAN_MEMORY_LIMIT": "8GiB"}
    refused = r"ANTMAN_MEMORY_LIMIT='8GiB' is invalid: accepted 1MiB\.\.ANTMAN_DEVICE_MEMORY \(4\.0 GiB\)"
    with pytest.raises(config.ConfigError, match=refused):
        device_select.resolve(config.load(env), env, lambda: CudaProbe(0, ""))
    env = {"ANTMAN_DEVICE": "emulated", "ANTMAN_MEMORY_LIMIT": "8GiB"}
    with pytest.raises(config.ConfigError, match="ANTMAN_MEMORY_LIMIT"):
        config.load(env)
    # The PyTorch front-end follows the same rule (config.load is the one place that holds it).
    from tf_antman.torch import settings as torch_settings

    on_gpu = torch_settings.load({"ANTMAN_DEVICE": "cuda", "ANTMAN_MEMORY_LIMIT": "8GiB"}, lambda: CudaProbe(1, ""))
    assert (on_gpu.device_capacity, on_gpu.memory_limit) == (0, 8 * GiB)
    with pytest.raises(config.ConfigError, match=refused):
        torch_settings.load({"ANTMAN_DEVICE": "auto", "ANTMAN_MEMORY_LIMIT": "8GiB"}, lambda: CudaProbe(0, ""))
