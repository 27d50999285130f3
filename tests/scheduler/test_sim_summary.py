"""The run summary's figures (sim/result.py)."""

from __future__ import annotations

import math

import pytest

from scheduler_lite.policy.registry import POLICIES
from scheduler_lite.sim.engine import simulate
from scheduler_lite.sim.perf import load_perf_model
from scheduler_lite.sim.result import summarise
from scheduler_lite.sim.workload import paper_recipe

PERF = load_perf_model()


def _record(kind: str, jct: float) -> dict[str, object]:
    return {"kind": kind, "state": "finished", "jct_s": jct, "end_s": jct, "queue_delay_s": 0.0,
            "failures": 0, "preemptions": 0}


def test_auto_jobs_count_as_guarantee_jobs():
    records = [_record("guarantee", 100.0), _record("auto", 300.0), _record("opportunistic", 50.0)]
    summary, _ = summarise(records, 0.0, {0: 1}, (0.0, 0.0, 0.0), {}, 0.0)
    assert summary["guarantee_avg_jct_s"] == 200.0
    assert summary["opportunistic_avg_jct_s"] == 50.0


@pytest.mark.parametrize("name", ["yarn-cs", "gandiva"])
def test_a_baseline_reports_the_same_figures_whether_tenant_a_submits_guarantee_or_auto_jobs(name):
    # The baselines run an auto job as a guarantee job: the same run, so the same summary.
    kw = dict(num_jobs=40, seed=2, nodes=1, gpus_per_node=4, quota_a=4, load=1.5)
    plain = simulate(paper_recipe(PERF, **kw), POLICIES[name], PERF, seed=2).summary  # type: ignore[arg-type]
    auto = simulate(paper_recipe(PERF, auto_fraction=1.0, **kw), POLICIES[name], PERF, seed=2).summary  # type: ignore[arg-type]
    assert not math.isnan(auto["guarantee_avg_jct_s"])
    for key in ("guarantee_avg_jct_s", "opportunistic_avg_jct_s", "avg_jct_s"):
        assert auto[key] == plain[key]
