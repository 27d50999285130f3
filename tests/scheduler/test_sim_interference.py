"""Co-location costs of the simulator (sim/interference.py) and their use by the engine."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler_lite.model import GIB, Gpu, JobKind, Tenant
from scheduler_lite.policy.registry import POLICIES
from scheduler_lite.sim.engine import simulate
from scheduler_lite.sim.interference import (
    MIB,
    bandwidth_slowdown,
    cached_reservation,
    grow_cache,
    locality_factor,
)
from scheduler_lite.sim.perf import load_perf_model
from scheduler_lite.sim.workload import TraceJob, Workload

PERF = load_perf_model()


def test_bandwidth_coefficient_reproduces_antman_fig12():
    # ESPnet 20.1 -> 20.8 min next to ResNet-50 (u 0.9) held to 57% of its speed.
    assert bandwidth_slowdown(PERF.colocation_interference, 0.9 * 0.57) == pytest.approx(20.8 / 20.1, abs=0.002)
    assert bandwidth_slowdown(PERF.colocation_interference, 0.0) == 1.0


def test_bfc_reservation_doubles_from_2_mib():
    assert cached_reservation(1) == 2 * MIB
    assert cached_reservation(2 * MIB) == 2 * MIB
    assert cached_reservation(2 * MIB + 1) == 6 * MIB  # 2 + 4
    assert cached_reservation(7 * MIB) == 14 * MIB  # 2 + 4 + 8
    assert cached_reservation(17 * GIB) == (2 * 16384 - 2) * MIB  # regions up to 16 GiB


def test_cache_grows_into_free_memory_or_runs_out():
    assert grow_cache(0, 3 * MIB, 100 * MIB) == 6 * MIB
    assert grow_cache(0, 3 * MIB, 4 * MIB) == 4 * MIB  # takes what is left
    assert grow_cache(0, 5 * MIB, 4 * MIB) is None  # out of memory
    assert grow_cache(14 * MIB, 10 * MIB, 0) == 14 * MIB  # a cache is never returned


def test_locality():
    assert locality_factor(0.3, 1) == 1.0
    assert locality_factor(0.3, 2) == pytest.approx(1 / 1.3)


def _workload(jobs: list[TraceJob], nodes: int = 1, per_node: int = 1) -> Workload:
    gpus = tuple(Gpu(n * per_node + i, f"n{n}", 32 * GIB, f"n{n}") for n in range(nodes) for i in range(per_node))
    return Workload("t", gpus, (Tenant("A", len(gpus)), Tenant("B", 0)), tuple(jobs))


def _job(jid: str, t: float, runtime: float, u: float, gib: float, gpus: int = 1,
         kind: JobKind = JobKind.OPPORTUNISTIC) -> TraceJob:
    return TraceJob(jid, "B" if kind is JobKind.OPPORTUNISTIC else "A", kind, t, gpus, runtime, "generic",
                    int(gib * GIB), u, 0.5, requested_share=u)


def test_packing_below_full_utilisation_is_not_free():
    wl = _workload([_job("a", 0, 1000, 0.4, 1), _job("b", 0, 1000, 0.4, 1)])
    r = simulate(wl, POLICIES["gandiva"], PERF)
    # Summed utilisation 0.8 <= 1: only bandwidth interference, from the other job's 0.4.
    first, second = sorted(r.records, key=lambda rec: rec["start_s"])
    together_from = second["start_s"]  # Gandiva waits for a utilisation sample between the two
    slow = 1 + PERF.colocation_interference * 0.4
    assert first["end_s"] == pytest.approx(together_from + (1000 - together_from) * slow)
    free = dataclasses.replace(PERF, colocation_interference=0.0)
    for rec in simulate(wl, POLICIES["gandiva"], free).records:
        assert rec["end_s"] - rec["start_s"] == pytest.approx(1000)


def test_a_cache_holding_the_gpu_makes_a_packed_job_run_out_of_memory():
    # 'a' needs 17 GiB; its allocator holds 32 GiB minus what was free. Gandiva's profile of
    # 'a' is its reservation (32 GiB), so 'b' is not packed next to it: it waits instead.
    wl = _workload([_job("a", 0, 1000, 0.3, 17), _job("b", 1, 100, 0.3, 1)])
    recs = {rec["id"]: rec for rec in simulate(wl, POLICIES["gandiva"], PERF, check_invariants=True).records}
    assert recs["b"]["start_s"] == pytest.approx(1000)
    assert recs["a"]["failures"] == 0


def test_a_gang_over_two_nvlink_groups_runs_slower():
    wl = _workload([_job("g", 0, 1000, 1.0, 4, gpus=2)], nodes=2, per_node=1)
    r = simulate(wl, POLICIES["yarn-cs"], PERF)
    assert r.records[0]["end_s"] == pytest.approx(1000 * (1 + PERF.cross_group_slowdown))
    inside = _workload([_job("g", 0, 1000, 1.0, 4, gpus=2)], nodes=1, per_node=2)
    assert simulate(inside, POLICIES["yarn-cs"], PERF).records[0]["end_s"] == pytest.approx(1000)
