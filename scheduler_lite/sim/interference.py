"""Co-location costs the simulator charges beyond compute time-slicing (docs/simulator.md).

Three pieces, each with its source or named assumption:

* **Bandwidth interference below full utilisation.** Jobs on one GPU share its memory bandwidth,
  L2 cache and PCIe link even while their summed SM utilisation is below 1, so each one runs
  slower by a factor 1 + c x (effective utilisation of its co-runners), c =
  `colocation_interference`. Under AntMan an opportunistic job's effective utilisation is capped
  by its compute share (GpuOpManager delays its kernels, and so its memory traffic too).
  c = 0.068 is read off AntMan §5.1 / Fig. 12: the guarantee job ESPnet went from 20.1 to 20.8
  min (+3.5%) next to ResNet-50 (solo utilisation 0.9) throttled to 57% of its speed, i.e. an
  effective co-runner utilisation of 0.51: 0.035 / 0.51 = 0.068. Cross-check, not a fit: Table 2
  (ResNet-50 91.1 -> 91.8 min, +0.8%, next to a throttled GCN) implies a GCN share of 0.11.
* **Framework memory caching** for policies without universal memory (Gandiva's packing, YARN):
  TensorFlow's BFC allocator with `allow_growth` extends its pool in regions that start at 2 MiB
  and double (tensorflow/core/common_runtime/bfc_allocator.cc, `curr_region_allocation_bytes_`),
  and never returns them. A job therefore holds the smallest 2 MiB x (2^k - 1) at or above its
  peak in-use bytes, capped by what the GPU had free when it grew (the allocator then takes what
  is left). It runs out of memory when its in-use bytes exceed what it holds plus what its
  co-runners left free.
* **Locality.** A gang whose GPUs span more than one NVLink group (server) runs slower by a
  factor 1 + `cross_group_slowdown`. Named assumption (0.3), with a sensitivity run in
  bench/sim.py: MLaaS (NSDI'22 §2, §6.1) reports that GPU locality "yields over 10x speedup for
  some training tasks", an upper bound, not a typical value.
"""

from __future__ import annotations

MIB = 1 << 20
BFC_FIRST_REGION_BYTES = 2 * MIB  # bfc_allocator.cc: min(total_memory, 2 MiB) with allow_growth


def bandwidth_slowdown(coefficient: float, corunner_utilisation: float) -> float:
    """Slowdown factor (>= 1) of a job whose co-runners use this much of the GPU in total."""
    return 1.0 + coefficient * corunner_utilisation


def cached_reservation(peak_bytes: int) -> int:
    """Bytes a BFC allocator with allow_growth holds after its in-use peak reached `peak_bytes`."""
    if peak_bytes <= 0:
        return 0
    held = 0
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


__all__ = ["bandwidth_slowdown", "cached_reservation", "grow_cache", "locality_factor"]
