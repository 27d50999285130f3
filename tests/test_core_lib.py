"""libantman_core.so through tf_antman.core in a process that never imports TensorFlow: the memory
core and the op manager work, bad arguments raise CoreError naming the field, and the CUDA gate
refuses cleanly where there is no driver. The snippet runs in a fresh interpreter so that nothing
this test process imported (TensorFlow, via other tests) can leak into it."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO, clean_env
from tf_antman import core

SNIPPET = textwrap.dedent("""
    import ctypes, json, sys, threading, time
    from tf_antman import core

    lib = core.load()
    out = {"tf_before": "tensorflow" in sys.modules}

    # Memory core, emulated backend: 4 MiB device limit, host fallback past it.
    with core.Memory(lib, backend="emulated", device_capacity=16 << 20, limit=4 << 20,
                     host_capacity=16 << 20, min_region=1 << 20) as mem:
        ptrs = [mem.alloc(1 << 20) for _ in range(6)]
        out["all_served"] = all(p is not None for p in ptrs)
        out["host_flags"] = [mem.is_host(p) for p in ptrs]
        ctypes.memset(ptrs[0], 0x5A, 1 << 20)  # emulated device memory is host memory
        out["byte"] = ctypes.string_at(ptrs[0], 1)[0]
        s = mem.stats()
        out["in_use"], out["host_in_use"], out["reserved"] = s["in_use"], s["host_in_use"], s["reserved"]
        for p in ptrs:
            mem.free(p)
        out["freed"] = mem.release_cached()
        out["invariants"] = mem.check_invariants()
        out["in_use_after"] = mem.stats()["in_use"]

    # The front-ends' additions: device-only allocation, total peak, largest block, peak reset.
    with core.Memory(lib, backend="emulated", device_capacity=16 << 20, limit=4 << 20,
                     host_capacity=16 << 20, min_region=1 << 20) as mem:
        d = mem.alloc(3 << 20)
        h = mem.alloc(2 << 20)  # past the limit: host memory
        out["device_only_past_limit"] = mem.alloc_device_only(2 << 20)
        small = mem.alloc_device_only(1 << 19)
        out["device_only_small_is_host"] = mem.is_host(small)
        mem.free(d)
        mem.free(h)
        e = mem.ext_stats()
        out["ext_before_reset"] = {k: e[k] for k in (
            "largest_alloc", "peak_total_in_use", "total_in_use", "device_only_failures",
            "deferred_release_bytes", "driver_refusals")}
        mem.reset_peaks()
        e = mem.ext_stats()
        out["ext_after_reset"] = {k: e[k] for k in ("largest_alloc", "peak_total_in_use",
                                                     "total_in_use")}
        out["peak_after_reset"] = mem.stats()["peak_in_use"]
        mem.free(small)

    # Op manager: host op, device op with an explicit interval, pause and release.
    with core.OpManager(lib, share=0.5) as opm:
        with opm.host_op():
            pass
        opm.admit("device")
        prov = opm.launched()
        time.sleep(0.003)  # the device interval below comes after the host op
        now = opm.now_ns()
        opm.device_done(prov, now - 2_000_000, now)
        s = opm.stats()
        out["ops_total"], out["in_flight"] = s["ops_total"], s["ops_in_flight"]
        out["device_busy_at_least"] = s["busy_ns"] >= 2_000_000
        errors = {}
        for name, call in [("share", lambda: opm.set_share(1.5)),
                           ("timing", lambda: opm.admit("gpu")),
                           ("end_ns", lambda: opm.device_done(0, 10, 5)),
                           ("future", lambda: opm.device_done(0, 10, opm.now_ns() + 10**9)),
                           ("window_ns", lambda: core.OpManager(lib, window_ns=0))]:
            try:
                call()
                errors[name] = None
            except core.CoreError as e:
                errors[name] = str(e)
        out["errors"] = errors
        opm.set_share(0.0)
        released = threading.Event()
        def op():
            with opm.host_op():
                released.set()
        t = threading.Thread(target=op)
        t.start()
        deadline = time.monotonic() + 10
        while opm.stats()["ops_waiting_now"] != 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        out["held_while_paused"] = not released.is_set() and opm.stats()["paused"]
        opm.set_share(1.0)
        t.join(10)
        out["released"] = released.is_set()

    # The gate without a GPU driver: a clean error, not a crash.
    with core.OpManager(lib, share=0.5) as opm:
        try:
            core.CudaGate(lib, opm, poll_interval_ns=5)
            out["gate_bad_poll"] = None
        except core.CoreError as e:
            out["gate_bad_poll"] = str(e)
        try:
            with core.CudaGate(lib, opm) as gate:
                out["gate"] = "created"
        except core.CoreError as e:
            out["gate"] = f"code {e.code}: {e}"

    out["tf_after"] = "tensorflow" in sys.modules
    print(json.dumps(out))
""")


def _driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def result() -> dict:
    if not core.lib_path().exists():
        pytest.fail(f"{core.lib_path()} is missing: run `python setup.py build_native`")
    proc = subprocess.run([sys.executable, "-c", SNIPPET], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_no_tensorflow_in_the_process(result: dict) -> None:
    assert result["tf_before"] is False
    assert result["tf_after"] is False


def test_memory_core_limit_and_host_fallback(result: dict) -> None:
    assert result["all_served"]
    assert result["host_flags"] == [False] * 4 + [True] * 2
    assert result["byte"] == 0x5A
    assert result["in_use"] == 4 << 20
    assert result["host_in_use"] == 2 << 20
    assert result["reserved"] <= 4 << 20
    assert result["freed"] > 0
    assert result["invariants"] == ""
    assert result["in_use_after"] == 0


def test_memory_core_front_end_additions(result: dict) -> None:
    assert result["device_only_past_limit"] is None  # refused, not served from host memory
    assert result["device_only_small_is_host"] is False
    assert result["ext_before_reset"] == {
        "largest_alloc": 3 << 20, "peak_total_in_use": (5 << 20) + (1 << 19),
        "total_in_use": 1 << 19, "device_only_failures": 1, "deferred_release_bytes": 0,
        "driver_refusals": 0}
    assert result["ext_after_reset"] == {"largest_alloc": 0, "peak_total_in_use": 1 << 19,
                                         "total_in_use": 1 << 19}
    assert result["peak_after_reset"] == 1 << 19


def test_op_manager_ops_pause_and_release(result: dict) -> None:
    assert result["ops_total"] == 2
    assert result["in_flight"] == 0
    assert result["device_busy_at_least"]
    assert result["held_while_paused"]
    assert result["released"]


def test_bad_arguments_name_the_field(result: dict) -> None:
    errors = result["errors"]
    assert "share: 1.5 is outside the accepted range [0, 1]" in errors["share"]
    assert "timing: 'gpu'" in errors["timing"]
    assert "end_ns: 5 is outside the accepted range [start_ns = 10" in errors["end_ns"]
    assert "is later than the manager's clock now" in errors["future"]
    assert "window_ns: 0" in errors["window_ns"]
    assert "poll_interval_ns: 5 is outside the accepted range" in result["gate_bad_poll"]


def test_gate_without_a_driver_is_a_clean_error(result: dict) -> None:
    if _driver_present():
        pytest.skip("a CUDA driver is present: bench/gpu exercises the gate there")
    assert result["gate"].startswith("code 2: CUDA driver not available")


def test_abi_mismatch_is_refused() -> None:
    lib = core.load()
    saved = dict(core.ABI_VERSIONS)
    try:
        core.ABI_VERSIONS["ops"] = 999
        with pytest.raises(core.CoreError, match="ABI versions"):
            core.CoreLib(lib.path)
    finally:
        core.ABI_VERSIONS.clear()
        core.ABI_VERSIONS.update(saved)
