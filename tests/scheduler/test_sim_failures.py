"""Jobs that run out of memory when they start (policies without universal memory).

A job whose framework cannot allocate its memory at the start dies and is resubmitted once
(engine._fail). The daemon runs another global pass after a failed launch (it marks itself
dirty); the simulator must too, or under yarn-cs, which has no utilisation refresh to run a
later pass, the retry and every job behind it wait for an arrival or finish that may never come
(review defect 2).
"""

from __future__ import annotations

import pytest

from scheduler_lite.model import JobKind, Tenant
from scheduler_lite.policy.registry import POLICIES
from scheduler_lite.sim.engine import simulate
from scheduler_lite.sim.perf import load_perf_model
from scheduler_lite.sim.workload import TraceJob, Workload, paper_recipe, uniform_cluster

PERF = load_perf_model()
BASELINES = ("yarn-cs", "yarn-cs-preempt", "gandiva")


def _job(name: str, model: str, submit: float = 0.0) -> TraceJob:
    m = PERF.models[model]
    return TraceJob(id=name, tenant="A", kind=JobKind.GUARANTEE, submit_time=submit, num_gpus=1,
                    runtime_s=600.0, model=model, memory_demand_bytes=m.memory_bytes,
                    utilisation=m.utilisation, step_time_s=m.step_time_s, requested_share=m.utilisation)


@pytest.mark.parametrize("name", BASELINES)
def test_a_job_too_large_for_every_gpu_fails_for_good_instead_of_waiting_for_ever(name):
    # ResNet-50 needs 17.6 GiB; each GPU has 16. The book's profile (capped at the largest GPU)
    # fits, the allocation at the start does not.
    wl = Workload("too-large", uniform_cluster(1, 2, 16.0), (Tenant("A", 2),), (_job("big", "resnet50", 100.0),))
    (rec,) = simulate(wl, POLICIES[name], PERF, check_invariants=True).records
    assert rec["state"] == "failed"
    assert rec["failures"] == 2  # the first attempt and its one retry
    assert rec["end_s"] == 100.0  # both at its arrival: nothing else was going to happen


@pytest.mark.parametrize("name", BASELINES)
def test_the_gpu_a_failed_start_frees_goes_to_the_job_waiting_behind_it(name):
    # One GPU; the large job is first in line, takes it and fails; the small one waits behind it.
    wl = Workload("behind", uniform_cluster(1, 1, 16.0), (Tenant("A", 1),),
                  (_job("big", "resnet50"), _job("small", "gcn")))
    recs = {r["id"]: r for r in simulate(wl, POLICIES[name], PERF, check_invariants=True).records}
    assert recs["big"]["state"] == "failed"
    assert recs["small"]["state"] == "finished"
    assert recs["small"]["start_s"] == 0.0
    assert recs["small"]["end_s"] == pytest.approx(600.0)


def test_the_review_recipe_on_small_gpus_leaves_no_job_behind():
    # The reviewer's run: 120 jobs on 8 x 12 GiB, some larger than a GPU. Before the fix 60 jobs
    # never finished under yarn-cs once arrivals stopped.
    wl = paper_recipe(PERF, num_jobs=120, seed=5, nodes=1, gpus_per_node=8, gpu_memory_gib=12.0, quota_a=8,
                      load=2.0)
    s = simulate(wl, POLICIES["yarn-cs"], PERF, check_invariants=True).summary
    assert s["unfinished"] == 0
    assert s["finished"] + s["failed"] == 120
