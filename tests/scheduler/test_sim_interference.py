"""Co-location costs of the simulator (sim/interference.py) and their use by the engine."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler_lite.model import GIB, Gpu, JobKind, Role, Tenant
from scheduler_lite.policy.registry import POLICIES
from scheduler_lite.sim.engine import Simulator, simulate
from scheduler_lite.sim.interference import (
    MIB,
    cached_reservation,
    grow_cache,
    locality_factor,
)
from scheduler_lite.sim.perf import load_perf_model
from scheduler_lite.sim.simjob import SimJob
from scheduler_lite.sim.workload import TraceJob, Workload

PERF = load_perf_model()


def test_bandwidth_coefficient_reproduces_antman_fig12():
    # ESPnet 20.1 -> 20.8 min next to ResNet-50 (u 0.9) held to 57% of its speed. Under tf-antman
    # the throttled job's share is its effective utilisation, and ESPnet is slowed by 1 + c x
    # that (docs/simulator.md, "Performance model").
    espnet = _sim_job(_job("espnet", 0, 1000, PERF.models["espnet"].utilisation, 6, kind=JobKind.GUARANTEE))
    resnet = _sim_job(_job("resnet", 0, 1000, PERF.models["resnet50"].utilisation, 17.6))
    resnet.shares = {0: 0.9 * 0.57}
    sim = Simulator(_workload([]), POLICIES["tf-antman"], PERF)
    sim.on_gpu[0].update({"espnet": espnet, "resnet": resnet})
    sim.speeds.recompute({0})
    assert 1 / espnet.gpu_speed[0] == pytest.approx(20.8 / 20.1, abs=0.002)


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


def _sim_job(trace: TraceJob) -> SimJob:
    """The job placed on GPU 0 with its whole demand as its limit, in its trace's role."""
    sj = SimJob(trace, PERF.models[trace.model], 0)
    sj.gpus, sj.limits = (0,), {0: sj.demand}
    sj.role = Role.GUARANTEE if trace.kind is JobKind.GUARANTEE else Role.OPPORTUNISTIC
    return sj


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


def test_a_slowed_gangs_gpus_read_its_gang_speed_not_what_each_gpu_allows():
    # Review defect 3: over two NVLink groups the gang runs at 1 / 1.3; each GPU read (and
    # contended as if) it ran at full speed. The utilisation integral must be the compute done.
    wl = _workload([_job("g", 0, 1000, 0.9, 4, gpus=2)], nodes=2, per_node=1)
    r = simulate(wl, POLICIES["yarn-cs"], PERF)
    speed = 1 / (1 + PERF.cross_group_slowdown)
    assert r.summary["gpu_compute_util"] == pytest.approx(0.9 * speed)
    util_gpu_s = r.summary["gpu_compute_util"] * 2 * r.summary["makespan_s"]
    assert util_gpu_s == pytest.approx(0.9 * 1000 * 2)  # u x work done x GPUs


def test_a_co_runner_of_a_slowed_gang_sees_the_gang_held_back():
    # Gandiva packs 'solo' onto GPU 0 of gang 'g', which spans two NVLink groups. Below full
    # utilisation 'solo' is slowed only by bandwidth interference, from the gang's effective
    # utilisation there: u x its gang speed / its speed on GPU 0 = u / (1 + cross_group_slowdown).
    wl = _workload([_job("g", 0, 10_000, 0.3, 4, gpus=2), _job("solo", 0, 1000, 0.3, 1)], nodes=2, per_node=1)
    recs = {rec["id"]: rec for rec in simulate(wl, POLICIES["gandiva"], PERF, check_invariants=True).records}
    solo = recs["solo"]
    assert recs["g"]["end_s"] > solo["end_s"]  # the gang runs throughout
    held = 0.3 / (1 + PERF.cross_group_slowdown)
    assert solo["end_s"] - solo["start_s"] == pytest.approx(1000 * (1 + PERF.colocation_interference * held))


@pytest.mark.parametrize("name", ["gandiva", "tf-antman", "yarn-cs"])
def test_every_gpu_reads_what_its_jobs_run_at_after_every_recomputation(name, monkeypatch):
    # A gang's speed can change through one of its GPUs; the readings of its other GPUs (and
    # their co-runners) must follow, though nothing changed there.
    from scheduler_lite.sim.speeds import JobSpeeds
    from scheduler_lite.sim.workload import paper_recipe

    original = JobSpeeds.recompute
    checked = [0]

    def checking(self, gpus):  # type: ignore[no-untyped-def]
        original(self, gpus)
        for g, jobs in self.on_gpu.items():
            reading = min(1.0, sum(sj.u * sj.speed for sj in jobs.values()))
            assert self.gpu_util[g] == pytest.approx(reading, abs=1e-9), (g, self.clock.now)
        checked[0] += 1

    monkeypatch.setattr(JobSpeeds, "recompute", checking)
    wl = paper_recipe(PERF, num_jobs=60, seed=1, nodes=2, gpus_per_node=4, quota_a=8, load=2.0)
    assert any(j.num_gpus > 1 for j in wl.jobs)
    simulate(wl, POLICIES[name], PERF, seed=1)
    assert checked[0] > 100
