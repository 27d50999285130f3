"""ctypes binding of the op manager and the CUDA event gate in libantman_core.so.

The C API is the one declared in cc/core/antman_ops.h and cc/core/cuda_gate.h (the core-only
library, no TensorFlow symbols). The PyTorch front-end uses it for compute scaling: one op
manager per job, and on a GPU one gate that admits ops and charges their kernel time from CUDA
events. When the library is absent the front-end runs without compute scaling and refuses a
share below 1 (the coordinator sees the rejection in stats.json), it never fails the job.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
from pathlib import Path

from tf_antman.native import NativeError, lib_path

LIB_NAME = "libantman_core.so"
ABI = {"mem": 1, "ops": 1, "gate": 1}  # ANTMAN_{MEM,OPS,GATE}_ABI_VERSION this binding mirrors
TIMING_HOST, TIMING_DEVICE = 0, 1


class CoreAbi(ctypes.Structure):
    _fields_ = [("mem", ctypes.c_int32), ("ops", ctypes.c_int32), ("gate", ctypes.c_int32)]


class OpmConfig(ctypes.Structure):
    _fields_ = [("initial_share", ctypes.c_double), ("window_ns", ctypes.c_int64),
                ("max_credit_ns", ctypes.c_int64), ("max_pending_device_ops", ctypes.c_int64)]


class OpmStats(ctypes.Structure):
    """Mirror of antman_opm_stats; the names match tf_antman.native.OpStats where they overlap."""

    _fields_ = [
        ("busy_ns", ctypes.c_int64), ("idle_inserted_ns", ctypes.c_int64),
        ("ops_total", ctypes.c_int64), ("ops_delayed", ctypes.c_int64),
        ("ops_waiting_now", ctypes.c_int64), ("ops_in_flight", ctypes.c_int64),
        ("share", ctypes.c_double), ("achieved_share_window", ctypes.c_double),
        ("window_ns", ctypes.c_int64), ("paused", ctypes.c_int32), ("reserved0", ctypes.c_int32),
        ("op_ns_ewma", ctypes.c_int64), ("credit_ns", ctypes.c_int64),
    ]

    def as_dict(self) -> dict[str, float | int | bool]:
        d: dict[str, float | int | bool] = {n: getattr(self, n) for n, _ in self._fields_ if n != "reserved0"}
        d["paused"] = bool(self.paused)
        return d


class GateConfig(ctypes.Structure):
    _fields_ = [("device_ordinal", ctypes.c_int32), ("reserved0", ctypes.c_int32),
                ("poll_interval_ns", ctypes.c_int64), ("anchor_interval_ns", ctypes.c_int64)]


class GateStats(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in (
        "ops_begun", "ops_completed", "ops_pending", "errors", "device_busy_ns", "anchors",
        "anchor_uncertainty_ns", "events_created")]

    def as_dict(self) -> dict[str, int]:
        return {n: int(getattr(self, n)) for n, _ in self._fields_}


def _address(fn: object) -> int:
    return int(ctypes.cast(fn, ctypes.c_void_p).value or 0)


@dataclasses.dataclass
class Core:
    lib: ctypes.CDLL
    path: Path

    def last_error(self) -> str:
        msg = self.lib.antman_core_last_error()
        return msg.decode(errors="replace") if msg else ""

    def function_addresses(self) -> dict[str, int]:
        """What the op hook (a C++ extension) calls on every gated op, by address, so that it
        uses this very library instance and needs no link to it."""
        names = ("antman_opm_admit", "antman_opm_finish", "antman_gate_begin", "antman_gate_end")
        return {n: _address(getattr(self.lib, n)) for n in names}


class OpManager:
    """One antman_opm: the job's compute share."""

    def __init__(self, core: Core, initial_share: float) -> None:
        self.core = core
        cfg = OpmConfig()
        core.lib.antman_opm_default_config(ctypes.byref(cfg))
        cfg.initial_share = initial_share
        handle = ctypes.c_void_p()
        err = ctypes.create_string_buffer(512)
        if core.lib.antman_opm_create(ctypes.byref(cfg), ctypes.byref(handle), err, len(err)) != 0:
            raise NativeError(err.value.decode(errors="replace"))
        self.handle = int(handle.value or 0)

    def set_share(self, share: float) -> None:
        if self.core.lib.antman_opm_set_share(self.handle, share) != 0:
            raise NativeError(self.core.last_error() or f"compute share {share!r} refused: accepted 0.0..1.0")

    def unthrottled(self) -> bool:
        return bool(self.core.lib.antman_opm_unthrottled(self.handle))

    def stats(self) -> OpmStats:
        s = OpmStats()
        if self.core.lib.antman_opm_get_stats(self.handle, ctypes.byref(s)) != 0:
            raise NativeError(self.core.last_error())
        return s

    # Host-timed ops driven from Python (tests of the wiring; the op hook calls these from C++).
    def admit(self, timing: int = TIMING_HOST) -> int:
        t = ctypes.c_int64(0)
        if self.core.lib.antman_opm_admit(self.handle, timing, ctypes.byref(t)) != 0:
            raise NativeError(self.core.last_error())
        return int(t.value)

    def finish(self, admitted_ns: int) -> None:
        if self.core.lib.antman_opm_finish(self.handle, admitted_ns) != 0:
            raise NativeError(self.core.last_error())


class CudaGate:
    """One antman_gate on the device's primary context (needs a GPU and its driver)."""

    def __init__(self, core: Core, opm: OpManager, device: int) -> None:
        self.core = core
        cfg = GateConfig()
        core.lib.antman_gate_default_config(ctypes.byref(cfg))
        cfg.device_ordinal = device
        handle = ctypes.c_void_p()
        err = ctypes.create_string_buffer(512)
        if core.lib.antman_gate_create(opm.handle, ctypes.byref(cfg), ctypes.byref(handle), err, len(err)) != 0:
            raise NativeError(err.value.decode(errors="replace"))
        self.handle = int(handle.value or 0)

    def stats(self) -> GateStats:
        s = GateStats()
        if self.core.lib.antman_gate_get_stats(self.handle, ctypes.byref(s)) != 0:
            raise NativeError(self.core.last_error())
        return s


def core_path() -> Path:
    return lib_path(LIB_NAME)


def load(path: Path | None = None) -> Core:
    path = core_path() if path is None else path
    if not path.exists():
        raise NativeError(f"{path} is missing: compute scaling needs the core library "
                          "(`python setup.py build_native`)")
    lib = ctypes.CDLL(str(path), mode=os.RTLD_LOCAL | os.RTLD_NOW)
    vp, i32, i64, dbl, pvp = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_double, ctypes.POINTER(ctypes.c_void_p)
    abi = CoreAbi()
    lib.antman_core_get_abi.argtypes = [ctypes.POINTER(CoreAbi)]
    lib.antman_core_get_abi.restype = None
    lib.antman_core_get_abi(ctypes.byref(abi))
    got = {"mem": abi.mem, "ops": abi.ops, "gate": abi.gate}
    if got != ABI:
        raise NativeError(f"{path} serves ABI versions {got}, this package expects {ABI}")
    lib.antman_core_last_error.restype = ctypes.c_char_p
    lib.antman_opm_default_config.argtypes = [ctypes.POINTER(OpmConfig)]
    lib.antman_opm_default_config.restype = None
    lib.antman_opm_create.argtypes = [ctypes.POINTER(OpmConfig), pvp, ctypes.c_char_p, ctypes.c_size_t]
    lib.antman_opm_create.restype = i32
    lib.antman_opm_destroy.argtypes = [vp]
    lib.antman_opm_destroy.restype = None
    lib.antman_opm_set_share.argtypes = [vp, dbl]
    lib.antman_opm_set_share.restype = i32
    lib.antman_opm_unthrottled.argtypes = [vp]
    lib.antman_opm_unthrottled.restype = i32
    lib.antman_opm_admit.argtypes = [vp, i32, ctypes.POINTER(i64)]
    lib.antman_opm_admit.restype = i32
    lib.antman_opm_finish.argtypes = [vp, i64]
    lib.antman_opm_finish.restype = i32
    lib.antman_opm_get_stats.argtypes = [vp, ctypes.POINTER(OpmStats)]
    lib.antman_opm_get_stats.restype = i32
    lib.antman_gate_default_config.argtypes = [ctypes.POINTER(GateConfig)]
    lib.antman_gate_default_config.restype = None
    lib.antman_gate_create.argtypes = [vp, ctypes.POINTER(GateConfig), pvp, ctypes.c_char_p, ctypes.c_size_t]
    lib.antman_gate_create.restype = i32
    lib.antman_gate_get_stats.argtypes = [vp, ctypes.POINTER(GateStats)]
    lib.antman_gate_get_stats.restype = i32
    return Core(lib=lib, path=path)
