"""Speed work on the simulator and the shared policies must not change a single result.

The hashes below were computed from the code before the issue-15 speed work (commit e474886):
every record (JCT, start, end, work done, preemptions, ...), the summary without its wall time,
and the utilisation time series, as `repr` (exact floats). An optimisation that changes any of
them is not an optimisation. A deliberate change of the model or of a policy changes them too:
then recompute them in the same commit and say why there.

Recomputed once since: the four tf-antman hashes, when a guarantee job began to prefer a group
with idle GPUs over the best fit by guarantee-free GPUs (a policy change, branch sim; the other
policies' hashes did not move).
"""

from __future__ import annotations

import hashlib

import pytest

from scheduler_lite.policy.registry import POLICIES
from scheduler_lite.sim.engine import SimResult, simulate
from scheduler_lite.sim.perf import load_perf_model
from scheduler_lite.sim.workload import paper_recipe

PERF = load_perf_model()
# Loaded (backlog, preemptions, migrations, gangs) and with auto jobs (upgrades).
LOADED = paper_recipe(PERF, num_jobs=150, seed=0, nodes=4, gpus_per_node=8, quota_a=16, load=2.5)
AUTO = paper_recipe(PERF, num_jobs=150, seed=3, nodes=4, gpus_per_node=8, quota_a=16, load=1.5,
                    auto_fraction=0.5)

GOLDEN = {
    ("loaded", "yarn-cs"): "39d7f0d6ec580300",
    ("loaded", "yarn-cs-preempt"): "5f9432fb18580713",
    ("loaded", "gandiva"): "93894011fd61286a",
    ("loaded", "tf-antman"): "26584b42651b56d7",
    ("loaded", "tf-antman-sjf"): "2c8cb0c4f54c8350",
    ("auto", "yarn-cs"): "730f631ee1df1275",
    ("auto", "yarn-cs-preempt"): "f4724951586b891d",
    ("auto", "gandiva"): "8becfc79371d15f4",
    ("auto", "tf-antman"): "7852fe561e5b1fd6",
    ("auto", "tf-antman-sjf"): "913ee87c122de0b1",
}


def result_hash(r: SimResult) -> str:
    summary = sorted((k, v) for k, v in r.summary.items() if k != "wall_s")
    return hashlib.sha256(repr((r.records, summary, r.timeseries)).encode()).hexdigest()[:16]


@pytest.mark.parametrize(("workload", "policy"), sorted(GOLDEN))
def test_results_are_bit_for_bit_those_before_the_speed_work(workload, policy):
    wl, seed = (LOADED, 0) if workload == "loaded" else (AUTO, 3)
    r = simulate(wl, POLICIES[policy], PERF, seed=seed)
    assert r.summary["finished"] > 100  # the runs did real work
    assert result_hash(r) == GOLDEN[(workload, policy)]
