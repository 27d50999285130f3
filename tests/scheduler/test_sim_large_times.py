"""Runs whose clock reaches large absolute times end, and end right (review defect 1).

Above ~8.6e9 s the spacing of the float clock is more than the engine's old work tolerance
(1e-6 s): a phase edge a few 1e-5 s of work away was neither reached nor reachable (the next
event, planned at now + gap / speed, rounded to now), and the run spun at one time for ever.
Each run below counts its progress events and stops at a bound far above what it needs, so a
regression fails instead of hanging.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from scheduler_lite.policy.registry import POLICIES
from scheduler_lite.policy.validation import ConfigError
from scheduler_lite.sim.alibaba import load_alibaba
from scheduler_lite.sim.engine import simulate
from scheduler_lite.sim.lifecycle import JobLifecycle
from scheduler_lite.sim.perf import load_perf_model
from scheduler_lite.sim.workload import MAX_SUBMIT_TIME_S, paper_recipe

PERF = load_perf_model()
PODS = ("name,num_gpu,gpu_milli,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"
        # The reviewer's pod: its input phase ends 3e-5 s of work past where the clock can land.
        "p16,1,500,LS,Running,990000041431.400,990000042379.136,990000041431.400\n")
MAX_PROGRESS_EVENTS = 10_000  # the pod needs a handful; the defect made millions at one time


class Spinning(AssertionError):
    pass


@pytest.fixture
def bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail a run that makes more progress events than MAX_PROGRESS_EVENTS (a livelock)."""
    original = JobLifecycle.progress
    count = [0]

    def counting(self: JobLifecycle, sj):  # type: ignore[no-untyped-def]
        count[0] += 1
        if count[0] > MAX_PROGRESS_EVENTS:
            raise Spinning(f"{count[0]} progress events, the clock at {self.clock.now!r}")
        return original(self, sj)

    monkeypatch.setattr(JobLifecycle, "progress", counting)


def _one_pod(tmp_path: Path):  # type: ignore[no-untyped-def]
    pods, nodes = tmp_path / "pods.csv", tmp_path / "nodes.csv"
    pods.write_text(PODS)
    nodes.write_text("sn,gpu,model\nn1,1,V100M32\n")
    return load_alibaba(PERF, pods, nodes)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_pod_created_at_9_9e11_s_finishes_in_its_run_time(tmp_path, bounded, name):
    wl = _one_pod(tmp_path)
    (rec,) = simulate(wl, POLICIES[name], PERF, check_invariants=True).records
    assert rec["state"] == "finished"
    # Alone on its GPU: its run time, to within a few steps of the clock (1.2e-4 s there).
    assert rec["jct_s"] == pytest.approx(wl.jobs[0].runtime_s, abs=1e-3)
    assert rec["work_done_s"] == pytest.approx(wl.jobs[0].runtime_s, abs=1e-3)


def test_a_tiny_load_spreads_arrivals_over_1e10_s_and_every_job_finishes(bounded):
    wl = paper_recipe(PERF, num_jobs=12, seed=0, nodes=1, gpus_per_node=8, quota_a=8, load=1e-7)
    assert wl.jobs[-1].submit_time > 1e10  # where the clock's spacing exceeds 1e-6 s
    r = simulate(wl, POLICIES["yarn-cs"], PERF, check_invariants=True)
    assert {rec["state"] for rec in r.records} == {"finished"}
    for rec in r.records:  # nothing queues at this load: each job takes its run time
        assert rec["jct_s"] == pytest.approx(rec["runtime_s"], abs=1e-2)


def test_arrivals_beyond_1e12_s_are_refused_naming_the_option(tmp_path):
    pods, nodes = tmp_path / "pods.csv", tmp_path / "nodes.csv"
    pods.write_text(PODS)
    nodes.write_text("sn,gpu,model\nn1,1,V100M32\n")
    with pytest.raises(ConfigError, match="time_compression"):
        load_alibaba(PERF, pods, nodes, time_compression=0.5)  # arrives at 1.98e12 s
    with pytest.raises(ConfigError, match="load"):
        paper_recipe(PERF, num_jobs=50, seed=0, load=1e-9)
    wl = _one_pod(tmp_path)
    late = dataclasses.replace(wl, jobs=(dataclasses.replace(wl.jobs[0], submit_time=2 * MAX_SUBMIT_TIME_S),))
    with pytest.raises(ConfigError, match="p16 submit_time"):
        simulate(late, POLICIES["yarn-cs"], PERF)
