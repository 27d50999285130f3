"""Co-location costs the simulator charges beyond compute time-slicing: bandwidth interference
below full utilisation, framework memory caching for policies without universal memory, locality
of gangs. docs/simulator.md ("Performance model") gives each one's rule and its source or named
assumption; the caching rule is TensorFlow's BFC allocator with `allow_growth`
(tensorflow/core/common_runtime/bfc_allocator.cc, `curr_region_allocation_bytes_`): regions
start at 2 MiB and double, and are never returned.
"""

from __future__ import annotations

MIB = 1 << 20
BFC_FIRST_REGION_BYTES = 2 * MIB  # bfc_allocator.cc: min(total_memory, 2 MiB) with allow_growth


def cached_reservation(peak_bytes: int) -> int:
    """Bytes a BFC allocator with allow_growth holds after its in-use peak reached `peak_bytes`."""
    held = 0  # and 0 for a peak of 0
    region = BFC_FIRST_REGION_BYTES
    while held < peak_bytes:
        held += region
        region *= 2
    return held


def grow_cache(held: int, need: int, free: int) -> int | None:
    """New holding of a job whose in-use bytes reach `need`; None when it runs out of memory.

    `held`: what it holds now; `free`: bytes of the GPU nobody holds. The allocator asks for its
    next regions but takes only what is free (it backs off to smaller regions on failure).
    """
    if need <= held:
        return held
    if need > held + free:
        return None
    return max(need, min(cached_reservation(need), held + free))


def locality_factor(slowdown: float, groups: int) -> float:
    """Speed factor of a gang over `groups` NVLink groups (1.0 inside one)."""
    return 1.0 if groups <= 1 else 1.0 / (1.0 + slowdown)


__all__ = ["cached_reservation", "grow_cache", "locality_factor"]
