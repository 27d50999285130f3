"""TF's allocator contract kept by tf-antman's tsl::Allocator (cc/tf/allocator.h), on the emulated
device, where the same UniversalTfAllocator class serves TF as on a GPU (issue 30): statistics
through TF's own API (tf.config.experimental.get_memory_info / reset_memory_stats), and
AllocationAttributes.retry_on_failure=false (cuDNN/cuFFT scratch, XLA autotuning on a GPU) served
from the device or refused, never from the host arena. TF's allocator is driven through its base
class as a kernel does (native.tf_allocate_probe) for the attribute TF's CPU kernels never set."""

from __future__ import annotations

from tests.conftest import run_py

MIB = 1 << 20
ENV = {"ANTMAN_ENABLE": "1", "ANTMAN_DEVICE": "emulated", "ANTMAN_DEVICE_MEMORY": "64MiB",
       "ANTMAN_MEMORY_LIMIT": "32MiB"}
PRELUDE = """
        import tensorflow as tf, tf_antman
        from tf_antman import activation
        lib = activation.active().native
        MIB = 1 << 20
        def block(mib):  # a tensor of `mib` MiB on the job's device
            return tf.ones((mib * MIB // 4,), tf.float32)
"""


def test_memory_statistics_follow_tensorflows_contract() -> None:
    job = run_py(PRELUDE + """
        out = {}
        big = [block(4) for _ in range(12)]  # 48 MiB against a 32 MiB limit: some on the host
        out["filled"] = tf.config.experimental.get_memory_info("CPU:0")
        out["filled_tf"] = lib.tf_allocator_stats()
        out["host_in_use"] = tf_antman.memory_stats()["host_in_use"]
        del big
        try:
            tf.config.experimental.reset_memory_stats("CPU:0")
            out["reset"] = "ok"
        except Exception as e:
            out["reset"] = f"{type(e).__name__}: {e}"
        out["after_reset"] = tf.config.experimental.get_memory_info("CPU:0")
        out["after_reset_tf"] = lib.tf_allocator_stats()
        small = block(2)
        out["small"] = tf.config.experimental.get_memory_info("CPU:0")
        out["small_tf"] = lib.tf_allocator_stats()
        emit(out)
    """, **ENV)
    r = job.result
    filled = r["filled"]
    assert r["host_in_use"] > 0  # the case that split the figures: blocks in the host arena
    assert filled["current"] >= 48 * MIB and filled["peak"] >= filled["current"], filled  # one view, peak >= current
    assert r["filled_tf"]["largest_alloc_size"] >= 4 * MIB
    assert r["filled_tf"]["memory_type"] == 2  # tsl::AllocatorMemoryType::kHostPageable: host RAM
    assert r["reset"] == "ok", r["reset"]  # ClearStats: reset_memory_stats raised before
    after = r["after_reset"]
    assert after["peak"] == after["current"] < 8 * MIB, after  # peak restarts from the current use
    assert r["after_reset_tf"]["largest_alloc_size"] == 0 and r["after_reset_tf"]["num_allocs"] == 0
    small = r["small"]
    assert after["current"] + 2 * MIB <= small["current"] <= small["peak"] < 16 * MIB, small
    assert 2 * MIB <= r["small_tf"]["largest_alloc_size"] < 4 * MIB
    assert r["small_tf"]["num_allocs"] >= 1


def test_fail_fast_requests_never_land_in_host_memory() -> None:
    job = run_py(PRELUDE + """
        held = [block(4) for _ in range(7)]  # 28 MiB of the 32 MiB limit, all on the device
        out = {"host_before": tf_antman.memory_stats()["host_in_use"]}
        out["retry_big"] = lib.tf_allocate_probe(8 * MIB, True)       # TF's default: may spill
        out["fail_fast_big"] = lib.tf_allocate_probe(8 * MIB, False)  # must not
        out["fail_fast_small"] = lib.tf_allocate_probe(1 * MIB, False)
        out["failed_allocs"] = tf_antman.memory_stats()["failed_allocs"]
        emit(out)
    """, **ENV)
    r = job.result
    assert r["host_before"] == 0
    assert r["retry_big"] == "host"
    assert r["fail_fast_big"] == "refused", r  # before: served from pinned host memory
    assert r["fail_fast_small"] == "device"
