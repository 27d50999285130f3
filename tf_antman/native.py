"""The native library, bound with ctypes.

libtf_antman.so is loaded RTLD_LOCAL *before* TensorFlow is imported: its C functions configure
the runtime, which installs tf-antman's device factory before TF creates devices. It links to
libtensorflow_framework.so.2 of the same wheel, so the later `import tensorflow` shares one copy.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import os
import threading
from pathlib import Path

# One mirror of antman_mem_stats and of antman_opm_stats, shared with the core binding.
from tf_antman.core import MemStats, OpmStats
from tf_antman.holds import SHARE_ZERO, HoldClock

LIB_DIR = Path(__file__).resolve().parent / "_native"
MAIN_LIB = "libtf_antman.so"
OPS_LIB = "_antman_ops.so"
ABI_VERSION = 1  # ANTMAN_MEM_ABI_VERSION in cc/core/antman_memory.h

BACKENDS = {"emulated": 0, "cuda": 1}
GPU_FACTORY_KINDS = {0: "none", 1: "cuda", 2: "hidden"}


class NativeError(RuntimeError):
    pass


class UnmanagedError(NativeError):
    """ANTMAN_DEVICE=cuda, and TensorFlow created its devices without a GPU: the job runs on the
    CPU, unmanaged (cc/tf/gpu_device.cc says why in TF's log)."""


class OpStats(OpmStats):
    """antman_opm_stats (cc/core/antman_ops.h) as antman_rt_get_op_stats (cc/tf/c_api.cc) fills
    it: the core binding's one mirror of the struct; `paused` is a bool in as_dict()."""

    def as_dict(self) -> dict[str, float | int | bool]:
        d: dict[str, float | int | bool] = super().as_dict()
        d["paused"] = bool(self.paused)
        return d


@dataclasses.dataclass
class Native:
    lib: ctypes.CDLL
    path: Path
    # Time at compute share 0, whoever set it (exit report); the agent adds its step pauses.
    holds: HoldClock = dataclasses.field(default_factory=HoldClock)
    # The share and the hold clock change together: without it a user's set_share(0) and the
    # agent's set_share(1) at the same moment could leave the clock held at share 1.
    _share_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def configure(self, backend: str, device_id: int, device_capacity: int, limit: int,
                  host_capacity: int, compute_share: float) -> None:
        err = ctypes.create_string_buffer(512)
        rc = self.lib.antman_rt_configure(BACKENDS[backend], device_id, device_capacity, limit,
                                          host_capacity, compute_share, err, len(err))
        if rc != 0:
            raise NativeError(err.value.decode(errors="replace"))

    def start_hold_clock(self) -> None:
        """Once TensorFlow is imported (no op is held before): a start-up share of 0 holds from now."""
        with self._share_lock:
            self.holds.set(SHARE_ZERO, float(self.op_stats().share) == 0.0)

    def devices_created(self) -> int:
        return int(self.lib.antman_rt_devices_created())

    def device_count(self) -> int:
        """Devices with universal memory so far: 1 emulated, or each GPU TF created."""
        return int(self.lib.antman_rt_device_count())

    def gpu_factory(self) -> dict[str, int | str]:
        """What tf-antman's "GPU" device factory did (cc/tf/gpu_device.h)."""
        kind, registered, lists, creates, devices = (ctypes.c_int() for _ in range(5))
        self.lib.antman_rt_gpu_factory_stats(*(ctypes.byref(v) for v in (
            kind, registered, lists, creates, devices)))
        return {"kind": GPU_FACTORY_KINDS.get(kind.value, str(kind.value)),
                "registered": registered.value, "list_calls": lists.value,
                "create_calls": creates.value, "devices": devices.value}

    def mem_stats(self) -> MemStats:
        s = MemStats()
        if self.lib.antman_rt_get_mem_stats(ctypes.byref(s)) != 0:
            raise self._no_device()
        return s

    def _no_device(self) -> NativeError:
        """Why there is no memory to report: under cuda the devices are TF's to create."""
        factory = self.gpu_factory()
        if factory["kind"] != "cuda":
            return NativeError("tf-antman runtime is not configured")
        if factory["create_calls"] == 0:
            return NativeError("no GPU device under tf-antman yet: TensorFlow has not created its devices")
        return UnmanagedError("no GPU device under tf-antman: TensorFlow created none (the job runs "
                              "on the CPU, unmanaged; docs/gpu-path.md)")

    def op_stats(self) -> OpStats:
        s = OpStats()
        if self.lib.antman_rt_get_op_stats(ctypes.byref(s)) != 0:
            raise NativeError("tf-antman runtime is not configured")
        return s

    def request_limit(self, limit: int) -> None:
        self.lib.antman_rt_request_limit(limit)

    def set_limit_now(self, limit: int) -> tuple[int, int]:
        unfreed = ctypes.c_uint64(0)
        freed = self.lib.antman_rt_set_limit_now(limit, ctypes.byref(unfreed))
        return int(freed), int(unfreed.value)

    def release_cached(self) -> int:
        return int(self.lib.antman_rt_release_cached())

    def step_boundary(self) -> None:
        self.lib.antman_rt_step_boundary()

    def set_share(self, share: float) -> None:
        with self._share_lock:
            if self.lib.antman_rt_set_share(share) != 0:
                raise NativeError(f"compute share {share!r} refused: accepted 0.0..1.0")
            self.holds.set(SHARE_ZERO, share == 0.0)

    def waiting_op_types(self) -> list[str]:
        """Op types the manager lets through uncharged (cc/tf/op_classes.cc)."""
        names = []
        while (name := self.lib.antman_rt_waiting_op(len(names))) is not None:
            names.append(name.decode())
        return names

    def check_gpu_options(self, config_proto: bytes) -> str:
        """Empty when the GPU device factory accepts a serialized tensorflow.ConfigProto's GPU
        options, else its one-line refusal (cc/tf/gpu_options.h)."""
        buf = ctypes.create_string_buffer(1024)
        rc = self.lib.antman_rt_check_gpu_options(config_proto, len(config_proto), buf, len(buf))
        if rc == 2:
            raise NativeError("config_proto: not a serialized tensorflow.ConfigProto")
        return buf.value.decode(errors="replace") if rc else ""

    def plan_gpu_memory(self, antman_capacity: int, antman_limit: int, tf_limit: int) -> tuple[int, int, str]:
        """(capacity, limit, note) of a GPU's memory from ANTMAN_DEVICE_MEMORY, ANTMAN_MEMORY_LIMIT
        (0 = unset) and TF's own limit for the device (cc/tf/gpu_options.h)."""
        capacity, limit = ctypes.c_uint64(0), ctypes.c_uint64(0)
        note = ctypes.create_string_buffer(1024)
        self.lib.antman_rt_plan_gpu_memory(antman_capacity, antman_limit, tf_limit, ctypes.byref(capacity),
                                           ctypes.byref(limit), note, len(note))
        return int(capacity.value), int(limit.value), note.value.decode(errors="replace")

    def tf_allocator_stats(self) -> dict[str, int]:
        """TF's view of the first device's memory (its tsl::Allocator's GetStats and memory type)."""
        out = (ctypes.c_int64 * 7)()
        if self.lib.antman_rt_tf_allocator_stats(out) != 0:
            raise self._no_device()
        keys = ("num_allocs", "bytes_in_use", "peak_bytes_in_use", "largest_alloc_size", "bytes_reserved",
                "bytes_limit", "memory_type")
        return dict(zip(keys, (int(v) for v in out), strict=True))

    def tf_allocate_probe(self, nbytes: int, retry_on_failure: bool) -> str:
        """Test hook: allocates and frees `nbytes` through TF's allocator of the first device with
        AllocationAttributes(retry_on_failure); "device", "host" or "refused"."""
        rc = self.lib.antman_rt_tf_allocate_probe(nbytes, int(retry_on_failure))
        if rc < 0:
            raise self._no_device()
        return ("device", "host", "refused")[rc]

    def check_invariants(self) -> str:
        """Empty when the allocator's invariants hold, else what broke."""
        buf = ctypes.create_string_buffer(512)
        rc = self.lib.antman_rt_check_invariants(buf, len(buf))
        return "" if rc == 0 else buf.value.decode(errors="replace") or f"code {rc}"


def lib_path(name: str = MAIN_LIB) -> Path:
    override = os.environ.get("TF_ANTMAN_LIB_DIR")  # for running from a Bazel tree; not ANTMAN_*
    return (Path(override) if override else LIB_DIR) / name


def _preload_tf_framework() -> None:
    """Loads TF's libtensorflow_framework.so.2 by path, RTLD_LOCAL, without importing TF.

    Our library needs it (DT_NEEDED) before `import tensorflow` has loaded it; once loaded, the
    dynamic linker matches TF's own later load by soname, so the process has one copy. RTLD_LOCAL
    matters: loading it RTLD_GLOBAL before Python's hashlib clashes with its bundled symbols.
    """
    spec = importlib.util.find_spec("tensorflow")
    if spec is None or not spec.submodule_search_locations:
        raise NativeError("tensorflow is not installed: tf-antman needs tensorflow==2.21.0")
    fw = Path(list(spec.submodule_search_locations)[0]) / "libtensorflow_framework.so.2"
    if not fw.exists():
        raise NativeError(f"{fw} is missing: is the installed tensorflow a complete 2.21.0 wheel?")
    ctypes.CDLL(str(fw), mode=os.RTLD_LOCAL | os.RTLD_NOW)


def load_failure(path: Path, error: OSError) -> str:
    """One line for a library the dynamic linker refused. An undefined symbol is the installed
    TensorFlow's: the library is built against the standard tensorflow==2.21.0 wheel, a CUDA build
    whose framework library exports TF's GPU device classes (docs/gpu-path.md); tensorflow-cpu,
    another version or another build lacks some, whichever ANTMAN_DEVICE is asked for."""
    text = str(error).strip()
    if "undefined symbol" in text:
        symbol = text.rsplit("undefined symbol:", 1)[-1].strip()
        return (f"{path.name} cannot link against the installed TensorFlow (undefined symbol {symbol}): "
                "tf-antman needs the standard tensorflow==2.21.0 wheel (a CUDA build; tensorflow-cpu "
                "lacks TF's GPU device classes, whichever ANTMAN_DEVICE is set); install it, or unset "
                "the ANTMAN_* variables to run without tf-antman")
    return f"{path} cannot be loaded: {text}"


def load() -> Native:
    path = lib_path()
    if not path.exists():
        raise NativeError(f"{path} is missing: build it with `python setup.py build_native` "
                          "(or install the tf-antman wheel)")
    _preload_tf_framework()
    try:
        lib = ctypes.CDLL(str(path), mode=os.RTLD_LOCAL | os.RTLD_NOW)
    except OSError as e:
        raise NativeError(load_failure(path, e)) from None
    u64, dbl, i32 = ctypes.c_uint64, ctypes.c_double, ctypes.c_int
    lib.antman_rt_abi_version.restype = i32
    lib.antman_rt_configure.argtypes = [i32, i32, u64, u64, u64, dbl, ctypes.c_char_p, ctypes.c_size_t]
    lib.antman_rt_configure.restype = i32
    lib.antman_rt_request_limit.argtypes = [u64]
    lib.antman_rt_set_limit_now.argtypes = [u64, ctypes.POINTER(u64)]
    lib.antman_rt_set_limit_now.restype = u64
    lib.antman_rt_release_cached.restype = u64
    lib.antman_rt_set_share.argtypes = [dbl]
    lib.antman_rt_waiting_op.argtypes = [i32]
    lib.antman_rt_waiting_op.restype = ctypes.c_char_p
    lib.antman_rt_check_invariants.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.antman_rt_tf_allocator_stats.argtypes = [ctypes.POINTER(ctypes.c_int64)]
    lib.antman_rt_tf_allocator_stats.restype = i32
    lib.antman_rt_tf_allocate_probe.argtypes = [u64, i32]
    lib.antman_rt_tf_allocate_probe.restype = i32
    lib.antman_rt_check_gpu_options.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]
    lib.antman_rt_check_gpu_options.restype = i32
    lib.antman_rt_plan_gpu_memory.argtypes = [u64, u64, ctypes.c_int64, ctypes.POINTER(u64), ctypes.POINTER(u64),
                                              ctypes.c_char_p, ctypes.c_size_t]
    lib.antman_rt_plan_gpu_memory.restype = None
    version = lib.antman_rt_abi_version()
    if version != ABI_VERSION:
        raise NativeError(f"{path} has ABI version {version}, this package expects {ABI_VERSION}")
    return Native(lib=lib, path=path)
