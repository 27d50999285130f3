"""Event-driven coordinator rounds against periodic ones (docs/simulator.md, "Rounds")."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler_lite.model import GIB, Gpu, GpuView, JobKind, Tenant
from scheduler_lite.policy.coordinator import (
    CoordinatorConfig,
    CoordinatorMemo,
    Phase,
    round,
)
from scheduler_lite.policy.registry import POLICIES
from scheduler_lite.policy.validation import ConfigError
from scheduler_lite.sim.engine import simulate
from scheduler_lite.sim.perf import load_perf_model
from scheduler_lite.sim.workload import TraceJob, Workload, paper_recipe, uniform_cluster

PERF = load_perf_model()
QUIET = dataclasses.replace(PERF, step_noise_cv=0.0)  # no step noise: skipped rounds are no-ops
# Small and loaded: guarantee jobs land on GPUs with opportunistic jobs, gangs span GPUs.
WL = paper_recipe(QUIET, num_jobs=60, seed=7, nodes=2, gpus_per_node=4, quota_a=8, load=2.0)


@pytest.mark.parametrize("name", ["tf-antman", "tf-antman-sjf"])
def test_event_rounds_match_periodic_rounds_without_noise(name):
    event = simulate(WL, POLICIES[name], QUIET, seed=1, rounds="event", check_invariants=True)
    periodic = simulate(WL, POLICIES[name], QUIET, seed=1, rounds="periodic", check_invariants=True)
    # The comparison means something only if the coordinator did work and periodic mode asked
    # it many more times.
    assert event.summary["rounds"] > 100
    assert periodic.summary["rounds"] > 2 * event.summary["rounds"]
    assert event.records == periodic.records


def test_opportunistic_jobs_are_throttled_next_to_guarantee_jobs():
    event = simulate(WL, POLICIES["tf-antman"], QUIET, seed=1)
    shared = [r for r in event.records if r["kind"] == "opportunistic" and r["state"] == "finished"]
    # Opportunistic jobs were slowed (shares below a whole GPU) yet all finished.
    assert any(float(r["jct_s"]) - float(r["queue_delay_s"]) > float(r["runtime_s"]) * 1.05 for r in shared)


def test_round_on_an_empty_gpu_resets_the_memo():
    # The simulator skips rounds on GPUs without jobs and resets their memo on this promise.
    memo = CoordinatorMemo(guarantee_job="g", phase=Phase.STEADY, baseline_s=0.1, level=0.4,
                           opportunistic=frozenset({"o"}), next_round_at=5.0)
    decisions, after = round(10.0, GpuView(Gpu(0, "n", 32 * GIB, "n"), ()), CoordinatorConfig(), memo)
    assert decisions == []
    assert after == CoordinatorMemo()


def test_unknown_round_mode_is_rejected():
    with pytest.raises(ConfigError, match="rounds"):
        simulate(WL, POLICIES["tf-antman"], QUIET, rounds="sometimes")


def test_a_gpu_that_just_got_a_job_takes_no_other_until_the_next_utilisation_sample():
    m = PERF.models["wide_deep"]  # light: one such job leaves its GPU far below M = 0.8

    def job(i: int, at: float) -> TraceJob:
        return TraceJob(f"o{i}", "B", JobKind.OPPORTUNISTIC, at, 1, 3600.0, "wide_deep",
                        m.memory_bytes, m.utilisation, m.step_time_s)

    wl = Workload("burst", uniform_cluster(1, 2, 32.0), (Tenant("A", 2), Tenant("B", 0)),
                  tuple(job(i, 1.0 + i) for i in range(4)))
    r = simulate(wl, POLICIES["tf-antman"], PERF, check_invariants=True)
    starts = [float(rec["start_s"]) for rec in r.records]
    assert starts[:2] == [1.0, 2.0]  # one per GPU straight away
    # The next two wait for the 10 s sample that shows the GPUs' load, then share them.
    assert starts[2:] == [10.0, 10.0]
