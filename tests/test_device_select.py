"""ANTMAN_DEVICE resolution and refusals (tf_antman/device_select.py), without a driver: the probe
is given fake drivers, resolve() fake probes."""

from __future__ import annotations

import ctypes

import pytest

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
    assert device_select.probe_cuda(loader(FakeDriver(count=3))) == CudaProbe(3, "")
    missing = device_select.probe_cuda(loader(None))
    assert missing.gpus == 0 and "libcuda.so.1 cannot be loaded" in missing.problem
    assert "cuInit returned 999" in device_select.probe_cuda(loader(FakeDriver(init_rc=999))).problem
    # CUDA_ERROR_NO_DEVICE is an answer, not a failure: no GPU (cuda then says "reports no GPU").
    assert device_select.probe_cuda(loader(FakeDriver(init_rc=100))) == CudaProbe(0, "")
    bad_count = device_select.probe_cuda(loader(FakeDriver(count_rc=3)))
    assert "cuDeviceGetCount returned 3" in bad_count.problem


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
