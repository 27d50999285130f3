"""libantman_core.so bound with ctypes: the memory core, the op manager and the CUDA event gate,
with no TensorFlow anywhere (a PyTorch front-end, tests and benchmarks load it directly).

    from tf_antman import core
    lib = core.load()                              # checks the three ABI versions
    with core.OpManager(lib, share=0.5) as opm:
        with opm.host_op():                        # admitted when the share allows, timed on the host
            run_op()
        with core.CudaGate(lib, opm, device_ordinal=0) as gate:
            with gate.gated(stream_handle):        # stream_handle: torch.cuda.current_stream().cuda_stream
                launch_kernels()                   # charged with the kernels' device time
    with core.Memory(lib, backend="emulated", device_capacity=64 << 20) as mem:
        ptr = mem.alloc(1 << 20)

C API and semantics: cc/core/antman_memory.h, cc/core/antman_ops.h, cc/core/cuda_gate.h.
Every refused argument raises CoreError with the library's message, which names the field and its
accepted range. This module imports nothing beyond the standard library: importing it never
imports TensorFlow (tf_antman/native.py binds the TensorFlow glue library, libtf_antman.so).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

CORE_LIB = "libantman_core.so"
LIB_DIR = Path(__file__).resolve().parent / "_native"
# ANTMAN_MEM_ABI_VERSION, ANTMAN_OPS_ABI_VERSION, ANTMAN_GATE_ABI_VERSION (cc/core/*.h).
ABI_VERSIONS = {"mem": 1, "ops": 2, "gate": 1}
BACKENDS = {"emulated": 0, "cuda": 1}
TIMINGS = {"host": 0, "device": 1}
NESTED = -1  # ANTMAN_OPM_NESTED: admitted inside another host op of the same manager

_ERR_LEN = 512
_i32, _i64, _u64, _dbl = ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64, ctypes.c_double
_vp, _sz, _cp = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p


class CoreError(RuntimeError):
    """A call into libantman_core.so was refused or failed; `code` is the ANTMAN_ERR_* value."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


class _Struct(ctypes.Structure):
    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name, _ in self._fields_ if name != "reserved0"}


class MemStats(_Struct):
    """Mirror of antman_mem_stats (cc/core/antman_memory.h); field order matters."""

    _fields_ = [(name, _u64) for name in (
        "limit", "pending_limit", "device_capacity", "in_use", "reserved", "peak_in_use",
        "step_peak_in_use", "step_min_in_use", "host_in_use", "host_peak", "step_host_peak",
        "host_capacity", "host_fallbacks", "host_bytes_served", "device_allocs",
        "device_bytes_served", "failed_allocs", "regions", "shrink_regions_freed",
        "shrink_bytes_freed", "last_shrink_ns", "last_shrink_unfreed", "steps", "largest_region",
    )]


class MemExtStats(_Struct):
    """Mirror of antman_mem_ext_stats (cc/core/antman_memory.h): fields only ever appended; the
    call passes this struct's size, so an older library fills only the fields it knows."""

    _fields_ = [(name, _u64) for name in (
        "device_pinned", "fit_release_regions", "fit_release_bytes", "fit_retry_allocs",
        "growth_returns", "host_reserved", "host_regions", "host_idle_release_regions",
        "host_idle_release_bytes", "host_idle_release_ns",
        "largest_alloc", "peak_total_in_use", "total_in_use", "driver_refusals", "driver_cap",
        "deferred_release_bytes", "deferred_release_regions", "deferred_released_bytes",
        "release_syncs", "last_release_sync_ns", "device_only_failures",
    )]


class MemConfig(_Struct):
    """Mirror of antman_mem_config."""

    _fields_ = [("backend", ctypes.c_int), ("device_ordinal", ctypes.c_int),
                ("device_capacity", _u64), ("limit", _u64), ("host_capacity", _u64),
                ("min_region", _u64)]


class OpmConfig(_Struct):
    """Mirror of antman_opm_config (cc/core/antman_ops.h)."""

    _fields_ = [("initial_share", _dbl), ("window_ns", _i64), ("max_credit_ns", _i64),
                ("max_pending_device_ops", _i64), ("device_burst_ns", _i64)]


class OpmStats(_Struct):
    """Mirror of antman_opm_stats."""

    _fields_ = [("busy_ns", _i64), ("idle_inserted_ns", _i64), ("ops_total", _i64),
                ("ops_delayed", _i64), ("ops_waiting_now", _i64), ("ops_in_flight", _i64),
                ("share", _dbl), ("achieved_share_window", _dbl), ("window_ns", _i64),
                ("paused", _i32), ("reserved0", _i32), ("op_ns_ewma", _i64), ("credit_ns", _i64)]


class GateConfig(_Struct):
    """Mirror of antman_gate_config (cc/core/cuda_gate.h)."""

    _fields_ = [("device_ordinal", _i32), ("reserved0", _i32), ("poll_interval_ns", _i64),
                ("anchor_interval_ns", _i64)]


class GateStats(_Struct):
    """Mirror of antman_gate_stats."""

    _fields_ = [(name, _i64) for name in (
        "ops_begun", "ops_completed", "ops_pending", "errors", "device_busy_ns", "anchors",
        "anchor_uncertainty_ns", "events_created",
    )]


class GateExtStats(_Struct):
    """Mirror of antman_gate_ext_stats (fields only ever appended)."""

    _fields_ = [(name, _i64) for name in ("ops_captured", "host_gap_ns", "launch_lag_ns", "launch_lag_untrusted")]


class _Abi(ctypes.Structure):
    _fields_ = [("mem", _i32), ("ops", _i32), ("gate", _i32)]


_SIGNATURES: dict[str, tuple[list[Any], Any]] = {
    "antman_core_get_abi": ([ctypes.POINTER(_Abi)], None),
    "antman_core_last_error": ([], _cp),
    "antman_mem_create": ([ctypes.POINTER(MemConfig), ctypes.POINTER(_vp), _cp, _sz], ctypes.c_int),
    "antman_mem_destroy": ([_vp], None),
    "antman_mem_alloc": ([_vp, _sz, _sz], _vp),
    "antman_mem_free": ([_vp, _vp], None),
    "antman_mem_is_host": ([_vp, _vp], ctypes.c_int),
    "antman_mem_allocated_size": ([_vp, _vp], _sz),
    "antman_mem_set_limit": ([_vp, _u64, ctypes.POINTER(_u64)], _u64),
    "antman_mem_request_limit": ([_vp, _u64], None),
    "antman_mem_release_cached": ([_vp], _u64),
    "antman_mem_step_boundary": ([_vp], None),
    "antman_mem_get_stats": ([_vp, ctypes.POINTER(MemStats)], None),
    "antman_mem_check_invariants": ([_vp, _cp, _sz], ctypes.c_int),
    "antman_opm_default_config": ([ctypes.POINTER(OpmConfig)], None),
    "antman_opm_create": ([ctypes.POINTER(OpmConfig), ctypes.POINTER(_vp), _cp, _sz], ctypes.c_int),
    "antman_opm_destroy": ([_vp], None),
    "antman_opm_set_share": ([_vp, _dbl], ctypes.c_int),
    "antman_opm_unthrottled": ([_vp], ctypes.c_int),
    "antman_opm_admit": ([_vp, ctypes.c_int, ctypes.POINTER(_i64)], ctypes.c_int),
    "antman_opm_finish": ([_vp, _i64], ctypes.c_int),
    "antman_opm_launched": ([_vp, ctypes.POINTER(_i64)], ctypes.c_int),
    "antman_opm_device_done": ([_vp, _i64, _i64, _i64], ctypes.c_int),
    "antman_opm_now_ns": ([_vp], _i64),
    "antman_opm_get_stats": ([_vp, ctypes.POINTER(OpmStats)], ctypes.c_int),
    "antman_gate_default_config": ([ctypes.POINTER(GateConfig)], None),
    "antman_gate_create": ([_vp, ctypes.POINTER(GateConfig), ctypes.POINTER(_vp), _cp, _sz],
                           ctypes.c_int),
    "antman_gate_destroy": ([_vp], None),
    "antman_gate_begin": ([_vp, _vp, ctypes.POINTER(_vp)], ctypes.c_int),
    "antman_gate_end": ([_vp, _vp], ctypes.c_int),
    "antman_gate_drain": ([_vp], ctypes.c_int),
    "antman_gate_get_stats": ([_vp, ctypes.POINTER(GateStats)], ctypes.c_int),
}

# Appended to the C API after ABI version 1: typed when the loaded library has them, so that an
# older build still loads (its callers get one CoreError naming the missing function).
_OPTIONAL_SIGNATURES: dict[str, tuple[list[Any], Any]] = {
    "antman_mem_alloc_device_only": ([_vp, _sz, _sz], _vp),
    "antman_mem_reset_peaks": ([_vp], None),
    "antman_mem_get_ext_stats": ([_vp, ctypes.POINTER(MemExtStats), _sz], _sz),
    "antman_gate_get_ext_stats": ([_vp, ctypes.POINTER(GateExtStats), _sz], _sz),
}


class CoreLib:
    """The loaded library with typed entry points (`lib.c.antman_*`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.c = ctypes.CDLL(str(path), mode=os.RTLD_LOCAL | os.RTLD_NOW)
        for name, (argtypes, restype) in _SIGNATURES.items():
            fn = getattr(self.c, name)
            fn.argtypes = argtypes
            fn.restype = restype
        for name, (argtypes, restype) in _OPTIONAL_SIGNATURES.items():
            fn = getattr(self.c, name, None)
            if fn is not None:
                fn.argtypes = argtypes
                fn.restype = restype
        abi = _Abi()
        self.c.antman_core_get_abi(ctypes.byref(abi))
        found = {"mem": abi.mem, "ops": abi.ops, "gate": abi.gate}
        if found != ABI_VERSIONS:
            raise CoreError(f"{path} has ABI versions {found}, this package expects {ABI_VERSIONS}")

    def function_addresses(self) -> dict[str, int]:
        """What a C++ caller (the PyTorch op hook) calls on every gated op, by address, so that it
        uses this very library instance and needs no link to it."""
        names = ("antman_opm_admit", "antman_opm_finish", "antman_gate_begin", "antman_gate_end")
        return {n: int(ctypes.cast(getattr(self.c, n), ctypes.c_void_p).value or 0) for n in names}

    def optional(self, name: str) -> Any:
        """An entry point of _OPTIONAL_SIGNATURES, or CoreError when this build predates it."""
        fn = getattr(self.c, name, None)
        if fn is None:
            raise CoreError(f"{self.path} has no {name}: rebuild it with `python setup.py build_native`")
        return fn

    def check(self, rc: int) -> None:
        """Raises CoreError with the library's message when rc is not ANTMAN_OK."""
        if rc != 0:
            msg = self.c.antman_core_last_error()
            raise CoreError(msg.decode(errors="replace") if msg else f"error code {rc}", rc)


_loaded: dict[Path, CoreLib] = {}
_load_lock = threading.Lock()


def lib_path() -> Path:
    override = os.environ.get("TF_ANTMAN_LIB_DIR")  # a Bazel or bench build tree; not ANTMAN_*
    return (Path(override) if override else LIB_DIR) / CORE_LIB


def load(path: Path | str | None = None) -> CoreLib:
    """Loads (once per path) and checks libantman_core.so; default: tf_antman/_native/."""
    resolved = Path(path) if path is not None else lib_path()
    with _load_lock:
        if resolved not in _loaded:
            if not resolved.exists():
                raise CoreError(f"{resolved} is missing: build it with `python setup.py build_native` "
                                "(or bench/gpu/build.sh, or install the tf-antman wheel)")
            _loaded[resolved] = CoreLib(resolved)
        return _loaded[resolved]


class _Handle:
    """Owns one native object; close() (or leaving a `with`) frees it, once."""

    _destroy = ""

    def __init__(self, lib: CoreLib, handle: int) -> None:
        self.lib = lib
        self._h: int | None = handle

    @property
    def handle(self) -> int:
        if self._h is None:
            raise CoreError(f"{type(self).__name__} is closed")
        return self._h

    def close(self) -> None:
        """The object's last call: stop the threads that use it first (a thread that destroy
        released from a wait must not call it again; it sees the object closed, at best)."""
        h, self._h = self._h, None  # closed before destroy runs: ctypes lets other threads in
        if h is not None:
            getattr(self.lib.c, self._destroy)(h)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _create(lib: CoreLib, fn: Any, *args: Any) -> int:
    out = _vp()
    err = ctypes.create_string_buffer(_ERR_LEN)
    rc = fn(*args, ctypes.byref(out), err, len(err))
    if rc != 0:
        raise CoreError(err.value.decode(errors="replace"), rc)
    assert out.value is not None
    return out.value


class Memory(_Handle):
    """One device's universal memory (antman_mem): limited BFC over device memory, host fallback."""

    _destroy = "antman_mem_destroy"

    def __init__(self, lib: CoreLib, *, backend: str = "emulated", device_ordinal: int = 0,
                 device_capacity: int = 0, limit: int = 0, host_capacity: int = 0,
                 min_region: int = 0) -> None:
        if backend not in BACKENDS:
            raise CoreError(f"backend: {backend!r} is not one of {sorted(BACKENDS)}")
        for field, value in (("device_capacity", device_capacity), ("limit", limit),
                             ("host_capacity", host_capacity), ("min_region", min_region)):
            if not 0 <= value < 2**64:
                raise CoreError(f"{field}: {value} is outside the accepted range [0, 2^64)")
        config = MemConfig(BACKENDS[backend], device_ordinal, device_capacity, limit,
                           host_capacity, min_region)
        super().__init__(lib, _create(lib, lib.c.antman_mem_create, ctypes.byref(config)))

    def alloc(self, nbytes: int, alignment: int = 256) -> int | None:
        """Device address, or None when neither device nor host memory can serve it."""
        return self.lib.c.antman_mem_alloc(self.handle, alignment, nbytes)

    def alloc_device_only(self, nbytes: int, alignment: int = 256) -> int | None:
        """Device address or None; never host memory (fail-fast requests)."""
        return self.lib.optional("antman_mem_alloc_device_only")(self.handle, alignment, nbytes)

    def free(self, ptr: int) -> None:
        self.lib.c.antman_mem_free(self.handle, ptr)

    def reset_peaks(self) -> None:
        """Device, host and total peaks restart from the current values; largest_alloc from 0."""
        self.lib.optional("antman_mem_reset_peaks")(self.handle)

    def is_host(self, ptr: int) -> bool | None:
        r = self.lib.c.antman_mem_is_host(self.handle, ptr)
        return None if r < 0 else bool(r)

    def allocated_size(self, ptr: int) -> int:
        return int(self.lib.c.antman_mem_allocated_size(self.handle, ptr))

    def set_limit(self, limit: int) -> tuple[int, int]:
        """Applies a limit now; returns (bytes freed, bytes reserved above the limit still)."""
        unfreed = _u64(0)
        freed = self.lib.c.antman_mem_set_limit(self.handle, limit, ctypes.byref(unfreed))
        return int(freed), int(unfreed.value)

    def request_limit(self, limit: int) -> None:
        self.lib.c.antman_mem_request_limit(self.handle, limit)

    def release_cached(self) -> int:
        return int(self.lib.c.antman_mem_release_cached(self.handle))

    def step_boundary(self) -> None:
        self.lib.c.antman_mem_step_boundary(self.handle)

    def stats(self) -> dict[str, Any]:
        s = MemStats()
        self.lib.c.antman_mem_get_stats(self.handle, ctypes.byref(s))
        return s.as_dict()

    def ext_stats(self) -> dict[str, Any]:
        """antman_mem_ext_stats; fields this library build does not fill read 0."""
        s = MemExtStats()
        self.lib.optional("antman_mem_get_ext_stats")(self.handle, ctypes.byref(s),
                                                      ctypes.sizeof(s))
        return s.as_dict()

    def check_invariants(self) -> str:
        """Empty when the allocator's invariants hold, else what broke."""
        buf = ctypes.create_string_buffer(_ERR_LEN)
        rc = self.lib.c.antman_mem_check_invariants(self.handle, buf, len(buf))
        return "" if rc == 0 else buf.value.decode(errors="replace") or f"code {rc}"


class OpManager(_Handle):
    """Limits a job's busy share of its device by delaying op starts (antman_opm)."""

    _destroy = "antman_opm_destroy"

    def __init__(self, lib: CoreLib, *, share: float = 1.0, window_ns: int | None = None,
                 max_credit_ns: int | None = None, max_pending_device_ops: int | None = None,
                 device_burst_ns: int | None = None) -> None:
        config = OpmConfig()
        lib.c.antman_opm_default_config(ctypes.byref(config))
        config.initial_share = share
        for field, value in (("window_ns", window_ns), ("max_credit_ns", max_credit_ns),
                             ("max_pending_device_ops", max_pending_device_ops),
                             ("device_burst_ns", device_burst_ns)):
            if value is not None:
                if not -(2**63) <= value < 2**63:
                    raise CoreError(f"{field}: {value} is outside the accepted range of int64")
                setattr(config, field, value)
        super().__init__(lib, _create(lib, lib.c.antman_opm_create, ctypes.byref(config)))
        self._gates: set[int] = set()  # ids of open CudaGates that use this manager

    def close(self) -> None:
        if self._gates:
            raise CoreError(f"opm: {len(self._gates)} CudaGate(s) still use this manager: "
                            "close them first")
        super().close()

    def set_share(self, share: float) -> None:
        self.lib.check(self.lib.c.antman_opm_set_share(self.handle, share))

    @property
    def unthrottled(self) -> bool:
        return bool(self.lib.c.antman_opm_unthrottled(self.handle))

    def admit(self, timing: str = "host") -> int:
        """Blocks until the op may start; returns the admission time (or NESTED)."""
        if timing not in TIMINGS:
            raise CoreError(f"timing: {timing!r} is not one of {sorted(TIMINGS)}")
        t = _i64()
        self.lib.check(self.lib.c.antman_opm_admit(self.handle, TIMINGS[timing], ctypes.byref(t)))
        return int(t.value)

    def finish(self, admitted_ns: int) -> None:
        self.lib.check(self.lib.c.antman_opm_finish(self.handle, admitted_ns))

    def launched(self) -> int:
        p = _i64()
        self.lib.check(self.lib.c.antman_opm_launched(self.handle, ctypes.byref(p)))
        return int(p.value)

    def device_done(self, provisional_ns: int, start_ns: int, end_ns: int) -> None:
        self.lib.check(self.lib.c.antman_opm_device_done(self.handle, provisional_ns, start_ns,
                                                         end_ns))

    def now_ns(self) -> int:
        return int(self.lib.c.antman_opm_now_ns(self.handle))

    @contextlib.contextmanager
    def host_op(self) -> Iterator[None]:
        """A host-timed op around the `with` body (skips the manager while unthrottled)."""
        if self.unthrottled:
            yield
            return
        t = self.admit("host")
        try:
            yield
        finally:
            self.finish(t)

    def raw_stats(self) -> OpmStats:
        """The C struct itself (attribute access, as the PyTorch runtime reports it)."""
        s = OpmStats()
        self.lib.check(self.lib.c.antman_opm_get_stats(self.handle, ctypes.byref(s)))
        return s

    def stats(self) -> dict[str, Any]:
        d = self.raw_stats().as_dict()
        d["paused"] = bool(d["paused"])
        return d


class CudaGate(_Handle):
    """Gates launches on CUDA streams through an OpManager and charges device time (antman_gate).

    The OpManager must stay open while the gate is (closing it first raises CoreError); close()
    waits for the device to finish every gated op. `stream` arguments are raw CUstream /
    cudaStream_t values (0 = legacy default). ctypes releases the GIL during each call, so a
    begin() held by the manager blocks only its own thread."""

    _destroy = "antman_gate_destroy"

    def __init__(self, lib: CoreLib, opm: OpManager, *, device_ordinal: int = 0,
                 poll_interval_ns: int | None = None, anchor_interval_ns: int | None = None) -> None:
        config = GateConfig()
        lib.c.antman_gate_default_config(ctypes.byref(config))
        if not -(2**31) <= device_ordinal < 2**31:
            raise CoreError(f"device_ordinal: {device_ordinal} is outside the accepted range of int32")
        config.device_ordinal = device_ordinal
        if poll_interval_ns is not None:
            config.poll_interval_ns = poll_interval_ns
        if anchor_interval_ns is not None:
            config.anchor_interval_ns = anchor_interval_ns
        self.opm = opm  # kept alive for as long as the gate
        super().__init__(lib, _create(lib, lib.c.antman_gate_create, opm.handle,
                                      ctypes.byref(config)))
        opm._gates.add(id(self))

    def close(self) -> None:
        if self._h is not None:
            super().close()  # waits for the device to finish every gated op
            self.opm._gates.discard(id(self))

    def begin(self, stream: int) -> int:
        """Admits and records the start event; returns the op handle for end() (0: not gated)."""
        op = _vp()
        self.lib.check(self.lib.c.antman_gate_begin(self.handle, stream, ctypes.byref(op)))
        return op.value or 0

    def end(self, op: int) -> None:
        self.lib.check(self.lib.c.antman_gate_end(self.handle, op or None))

    @contextlib.contextmanager
    def gated(self, stream: int) -> Iterator[None]:
        op = self.begin(stream)
        try:
            yield
        finally:
            self.end(op)

    def drain(self) -> None:
        self.lib.check(self.lib.c.antman_gate_drain(self.handle))

    def stats(self) -> dict[str, int]:
        s = GateStats()
        self.lib.check(self.lib.c.antman_gate_get_stats(self.handle, ctypes.byref(s)))
        return s.as_dict()

    def ext_stats(self) -> dict[str, int]:
        """antman_gate_ext_stats: ops let through during CUDA graph capture, host time not charged."""
        s = GateExtStats()
        self.lib.optional("antman_gate_get_ext_stats")(self.handle, ctypes.byref(s),
                                                       ctypes.sizeof(s))
        return s.as_dict()
