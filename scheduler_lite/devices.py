"""What the daemon knows of its GPUs: the inventory once, and a utilisation reading every tick.

Two backends behind one protocol:
  * `NvmlDevices`: real GPUs through pynvml (NVML): memory, utilisation, NVLink topology.
    NOT TESTED ON A GPU here (the development machine has none): its unit tests drive a fake
    nvml module that answers like NVML does.
  * `EmulatedDevices`: the memory sizes stated in the config; utilisation is derived from the
    jobs' stats files (an emulated device has no counters of its own).
"""

from __future__ import annotations

import contextlib
import socket
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

from scheduler_lite.config import DevicesConfig
from scheduler_lite.model import Gpu
from tf_antman.protocol import Stats

NO_NVLINK_GROUP = "pcie"  # GPUs with no NVLink peer: all alike, one group


class DeviceError(RuntimeError):
    """The devices cannot be used as configured (NVML missing, GPU index out of range...)."""


@dataclass(frozen=True, slots=True)
class JobLoad:
    """What one job's latest stats say about its use of one GPU."""

    compute_share: float
    achieved_share: float | None
    stepping: bool  # it finished a step recently


class DeviceBackend(Protocol):
    kind: str

    def inventory(self) -> tuple[Gpu, ...]: ...

    def utilisation(self, loads: Mapping[int, Sequence[JobLoad]]) -> dict[int, float]:
        """Instantaneous utilisation in [0, 1] of every GPU (loads: the jobs on each GPU)."""
        ...


def job_load(stats: Stats | None, stepping: bool) -> JobLoad:
    if stats is None:
        return JobLoad(0.0, None, False)
    return JobLoad(stats.compute_share, stats.achieved_share, stepping)


def jobs_utilisation(loads: Sequence[JobLoad]) -> float:
    """A GPU's utilisation from its jobs' reports: the sum over them of the share each is using,
    at most 1. A job's share is its measured achieved share when the job reports one, else the
    share it is allowed while it is making steps: a stepping job is assumed to use all it may."""
    total = 0.0
    for load in loads:
        if load.achieved_share is not None:
            total += load.achieved_share
        elif load.stepping:
            total += load.compute_share
    return min(1.0, total)


def emulated_utilisation(gpus: Iterable[Gpu], loads: Mapping[int, Sequence[JobLoad]]) -> dict[int, float]:
    """Every GPU's utilisation from its jobs' reports alone (`jobs_utilisation`): emulated GPUs,
    here or on a cluster's nodes, have no counters of their own."""
    return {gpu.id: jobs_utilisation(loads.get(gpu.id, ())) for gpu in gpus}


class EmulatedDevices:
    kind = "emulated"

    def __init__(self, config: DevicesConfig, node: str | None = None) -> None:
        node = node or socket.gethostname()
        self._gpus = tuple(Gpu(d.id, node, d.memory_bytes, d.nvlink_group) for d in config.emulated)

    def inventory(self) -> tuple[Gpu, ...]:
        return self._gpus

    def utilisation(self, loads: Mapping[int, Sequence[JobLoad]]) -> dict[int, float]:
        return emulated_utilisation(self._gpus, loads)


class NvmlDevices:
    """Real GPUs. `nvml` is the pynvml module (a fake one in tests)."""

    kind = "nvml"

    def __init__(self, ids: Sequence[int] | None = None, nvml: ModuleType | Any | None = None,
                 node: str | None = None) -> None:
        self._nvml = nvml if nvml is not None else _import_pynvml()
        try:
            self._nvml.nvmlInit()
            count = self._nvml.nvmlDeviceGetCount()
        except Exception as e:  # noqa: BLE001 - NVMLError_* and driver problems alike
            raise DeviceError(f"NVML could not be initialised ({e}); is an NVIDIA driver installed? "
                              "Use devices.kind = \"emulated\" on a machine without GPUs") from None
        wanted = list(range(count)) if ids is None else list(ids)
        for i in wanted:
            if not 0 <= i < count:
                raise DeviceError(f"devices.ids: GPU {i} does not exist; NVML reports {count} GPU(s)")
        if not wanted:
            raise DeviceError("NVML reports no GPU; use devices.kind = \"emulated\"")
        self._handles = {i: self._nvml.nvmlDeviceGetHandleByIndex(i) for i in wanted}
        node = node or socket.gethostname()
        groups = self._nvlink_groups()
        self._gpus = tuple(
            Gpu(i, node, int(self._nvml.nvmlDeviceGetMemoryInfo(h).total), groups[i])
            for i, h in self._handles.items()
        )

    def inventory(self) -> tuple[Gpu, ...]:
        return self._gpus

    def utilisation(self, loads: Mapping[int, Sequence[JobLoad]]) -> dict[int, float]:
        out = {}
        not_supported = getattr(self._nvml, "NVML_ERROR_NOT_SUPPORTED", 3)
        for i, h in self._handles.items():
            try:
                out[i] = min(1.0, max(0.0, self._nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0))
            except Exception as e:  # noqa: BLE001 - NVMLError_* and driver problems alike
                if getattr(e, "value", None) == not_supported:
                    # No reading on this GPU, ever (a MIG-enabled GPU, some boards): unknown, not
                    # busy (busy kept every opportunistic job off it for good). Estimated from its
                    # jobs' own reports, as on an emulated device.
                    out[i] = jobs_utilisation(loads.get(i, ()))
                else:  # a GPU that stops answering (lost, fallen off the bus) reads as busy, not idle
                    out[i] = 1.0
        return out

    def compute_processes(self) -> dict[int, list[tuple[int, int]]]:
        """(pid, used device bytes) of each GPU's compute processes (the misbehaviour checks;
        usedGpuMemory None, as NVML reports under some drivers and in MIG mode, counts as 0)."""
        return {i: [(int(p.pid), int(p.usedGpuMemory or 0)) for p in self._nvml.nvmlDeviceGetComputeRunningProcesses(h)]
                for i, h in self._handles.items()}

    def _nvlink_groups(self) -> dict[int, str]:
        """GPUs joined by active NVLink links, as connected components; the rest share one group."""
        nvml = self._nvml
        bus = {}
        for i, h in self._handles.items():
            with contextlib.suppress(Exception):  # no PCI info: no NVLink grouping for it
                bus[_bus_id(nvml.nvmlDeviceGetPciInfo(h))] = i
        parent = {i: i for i in self._handles}

        def find(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        linked: set[int] = set()
        max_links = getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)
        for i, h in self._handles.items():
            for link in range(max_links):
                try:
                    if nvml.nvmlDeviceGetNvLinkState(h, link) != getattr(nvml, "NVML_FEATURE_ENABLED", 1):
                        continue
                    peer = bus.get(_bus_id(nvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link)))
                except Exception:  # noqa: BLE001 - NotSupported / InvalidArgument past the last link
                    break
                if peer is not None and peer != i:
                    parent[find(i)] = find(peer)
                    linked.update((i, peer))
        return {i: f"nvlink{find(i)}" if i in linked else NO_NVLINK_GROUP for i in self._handles}


def _bus_id(pci: Any) -> str:
    bus = pci.busId
    if isinstance(bus, bytes):
        bus = bus.decode()
    return str(bus).lower()


def _import_pynvml() -> ModuleType:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # pynvml 12+ warns that it is a shim over nvidia-ml-py
            import pynvml
    except ImportError as e:
        raise DeviceError(f"devices.kind = \"nvml\" needs the pynvml package ({e}); "
                          "pip install nvidia-ml-py, or use devices.kind = \"emulated\"") from None
    return pynvml


def open_devices(config: DevicesConfig) -> DeviceBackend:
    if config.kind == "nvml":
        return NvmlDevices(config.nvml_ids)
    return EmulatedDevices(config)
