"""Device readings. The NVML path runs against a fake nvml module (no GPU on the development
machine): it answers like pynvml does, including NotSupported errors past the last NVLink."""

from __future__ import annotations

import builtins
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from scheduler_lite.config import parse_config
from scheduler_lite.devices import (
    NO_NVLINK_GROUP,
    DeviceError,
    EmulatedDevices,
    JobLoad,
    NvmlDevices,
    open_devices,
)

GIB = 1 << 30


class NVMLError(Exception):
    def __init__(self, message: str, value: int = 999) -> None:  # pynvml's NVMLError.value
        super().__init__(message)
        self.value = value


class FakeNvml:
    """Four GPUs: 0-1 joined by two NVLinks, 2 and 3 with no active link."""

    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 6

    def __init__(self, fail_init: bool = False) -> None:
        self.fail_init = fail_init
        self.util = {0: 35, 1: 100, 2: 0, 3: 50}
        self.links = {0: [1, 1], 1: [0, 0], 2: [], 3: []}

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise NVMLError("Driver Not Loaded")

    def nvmlDeviceGetCount(self) -> int:
        return 4

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(total=(16 + h) * GIB, used=h * GIB, free=16 * GIB)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        if h == 3 and self.util[3] is None:
            raise NVMLError("GPU is lost")
        if self.util[h] == "mig":
            raise NVMLError("Not Supported", value=3)  # NVML_ERROR_NOT_SUPPORTED, as on a MIG GPU
        return SimpleNamespace(gpu=self.util[h], memory=0)

    def nvmlDeviceGetPciInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(busId=f"00000000:0{h}:00.0".encode())

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        if link >= 4:
            raise NVMLError("Invalid Argument")
        if h in (2, 3):
            raise NVMLError("Not Supported")
        return 1 if link < len(self.links[h]) else 0

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: int, link: int) -> SimpleNamespace:
        return SimpleNamespace(busId=f"00000000:0{self.links[h][link]}:00.0")  # str here, bytes above


def test_nvml_inventory_with_nvlink_groups() -> None:
    devices = NvmlDevices(nvml=FakeNvml(), node="host")
    gpus = devices.inventory()
    assert [(g.id, g.memory_bytes) for g in gpus] == [(i, (16 + i) * GIB) for i in range(4)]
    groups = {g.id: g.nvlink_group for g in gpus}
    assert groups[0] == groups[1] != NO_NVLINK_GROUP
    assert groups[2] == groups[3] == NO_NVLINK_GROUP


def test_nvml_subset_readings_and_a_gpu_that_stops_answering() -> None:
    nvml = FakeNvml()
    devices = NvmlDevices([1, 3], nvml=nvml)
    assert [g.id for g in devices.inventory()] == [1, 3]
    assert devices.utilisation({}) == {1: 1.0, 3: 0.5}
    nvml.util[3] = None
    assert devices.utilisation({})[3] == 1.0  # unknown reads as busy: no opportunistic job lands there


def test_a_gpu_nvml_cannot_read_is_unknown_not_busy() -> None:
    # A MIG-enabled GPU answers NotSupported for good: read as busy, it never got an opportunistic
    # job. Estimated from its jobs' reports instead, as on an emulated device.
    from scheduler_lite.devices import JobLoad

    nvml = FakeNvml()
    nvml.util[2] = "mig"
    devices = NvmlDevices(nvml=nvml)
    assert devices.utilisation({})[2] == 0.0
    assert devices.utilisation({2: [JobLoad(0.5, None, True)]})[2] == 0.5
    assert devices.utilisation({2: [JobLoad(1.0, 0.25, True)]})[2] == 0.25
    assert devices.utilisation({})[0] == 0.35  # the others still read from NVML


def test_nvml_errors_are_one_clear_line() -> None:
    with pytest.raises(DeviceError, match="NVML could not be initialised .*Driver Not Loaded.*emulated"):
        NvmlDevices(nvml=FakeNvml(fail_init=True))
    with pytest.raises(DeviceError, match="GPU 7 does not exist; NVML reports 4"):
        NvmlDevices([7], nvml=FakeNvml())


def test_missing_pynvml_is_a_device_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_pynvml(name: str, *args: object, **kwargs: object):
        if name == "pynvml":
            raise ImportError("No module named 'pynvml'")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_pynvml)
    config = parse_config({"version": 1, "paths": {"state_dir": "s"}, "devices": {"kind": "nvml"},
                           "tenants": [{"name": "A", "gpu_quota": 1}]}, Path("/"))
    with pytest.raises(DeviceError, match="needs the pynvml package"):
        open_devices(config.devices)


def test_emulated_inventory_and_utilisation_from_job_stats() -> None:
    config = parse_config({"version": 1, "paths": {"state_dir": "s"},
                           "devices": {"kind": "emulated", "emulated": [
                               {"id": 3, "memory": "1GiB", "nvlink_group": "a"}, {"id": 5, "memory": 2 * GIB}]},
                           "tenants": [{"name": "A", "gpu_quota": 1}]}, Path("/"))
    devices = EmulatedDevices(config.devices, node="n")
    assert [(g.id, g.memory_bytes, g.nvlink_group) for g in devices.inventory()] == [(3, GIB, "a"), (5, 2 * GIB, "local")]
    loads = {
        3: [JobLoad(1.0, 0.4, True), JobLoad(0.5, None, True), JobLoad(1.0, None, False)],
        5: [JobLoad(1.0, 0.9, True), JobLoad(1.0, 0.9, True)],
    }
    # measured 0.4 + allowed 0.5 of a stepping job without a measure + 0 for an idle one; capped at 1
    assert devices.utilisation(loads) == {3: pytest.approx(0.9), 5: 1.0}
    assert devices.utilisation({}) == {3: 0.0, 5: 0.0}
