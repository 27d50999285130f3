"""The Alibaba-2023-format loader on small generated files (the real trace is optional)."""

from __future__ import annotations

import pytest

from scheduler_lite.model import JobKind
from scheduler_lite.policy.registry import POLICIES
from scheduler_lite.policy.validation import ConfigError
from scheduler_lite.sim.alibaba import load_alibaba, peak_demand
from scheduler_lite.sim.engine import simulate
from scheduler_lite.sim.perf import load_perf_model

PERF = load_perf_model()
HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"


def _files(tmp_path, pods: list[str], nodes: int = 4):
    pod_path = tmp_path / "pods.csv"
    pod_path.write_text(HEADER + "".join(p + "\n" for p in pods))
    node_path = tmp_path / "nodes.csv"
    node_path.write_text("sn,cpu_milli,memory_mib,gpu,model\n" + "".join(
        f"node-{i},64000,262144,2,{'V100M32' if i % 2 else 'T4'}\n" for i in range(nodes)))
    return pod_path, node_path


PODS = [
    "p0,1000,1024,1,500,,LS,Running,0,1000,0",
    "p1,1000,1024,1,250,,BE,Succeeded,10,510,20",  # ran 490 s after waiting 10 s
    "p2,1000,1024,0,0,,LS,Running,0,100,0",  # CPU-only: skipped
    "p3,1000,1024,1,1000,,BE,Pending,30,9000,",  # never ran: dropped
    "p4,1000,1024,2,0,,Burstable,Failed,40,440,40",
]


def test_rows_are_mapped_and_pending_pods_dropped(tmp_path):
    wl = load_alibaba(PERF, *_files(tmp_path, PODS))
    assert [j.id for j in wl.jobs] == ["p0", "p1", "p4"] and wl.skipped == 2
    p0, p1, p4 = wl.jobs
    assert p1.kind is JobKind.OPPORTUNISTIC and p0.kind is p4.kind is JobKind.GUARANTEE
    assert p1.runtime_s == 490 and p1.submit_time == 10
    assert p1.requested_share == 0.25 and p4.requested_share == 1.0 and p4.num_gpus == 2
    assert len(wl.gpus) == 8  # the whole node list
    assert {g.memory_bytes >> 30 for g in wl.gpus} == {16, 32}


def test_cluster_scaling_and_time_compression(tmp_path):
    files = _files(tmp_path, PODS, nodes=10)
    wl = load_alibaba(PERF, *files)
    assert peak_demand(list(wl.jobs)) == 4  # p0 + p1 + p4 (2 GPUs) at t = 40
    assert len(load_alibaba(PERF, *files, peak_ratio=2.0).gpus) == 2  # ceil(4 / 2)
    assert len(load_alibaba(PERF, *files, gpus=6).gpus) == 6
    fast = load_alibaba(PERF, *files, time_compression=10)
    assert [j.submit_time for j in fast.jobs] == [0, 1, 4]
    assert [j.runtime_s for j in fast.jobs] == [j.runtime_s for j in wl.jobs]


def test_replay_runs_every_policy_and_is_deterministic(tmp_path):
    wl = load_alibaba(PERF, *_files(tmp_path, PODS), peak_ratio=1.5)
    for name in ("yarn-cs", "gandiva", "tf-antman"):
        a = simulate(wl, POLICIES[name], PERF, seed=1, check_invariants=True)
        assert {r["state"] for r in a.records} == {"finished"}
        assert a.records == simulate(wl, POLICIES[name], PERF, seed=1).records


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ("p,1,1,x,0,,LS,Running,0,10,0", "num_gpu"),
        ("p,1,1,1,2000,,LS,Running,0,10,0", "gpu_milli"),
        ("p,1,1,1,100,,XX,Running,0,10,0", "qos"),
        ("p,1,1,1,100,,LS,Running,50,10,50", "deletion_time"),
    ],
)
def test_bad_rows_name_file_line_and_field(tmp_path, row, field):
    with pytest.raises(ConfigError, match=rf"pods.csv:2 {field}"):
        load_alibaba(PERF, *_files(tmp_path, [row]))


def test_the_spread_pick_takes_the_fewest_gpus_that_reach_the_target(tmp_path):
    # Spread picks of 6 nodes with 1, 1, 1, 8, 1, 1 GPUs: m = 2 takes nodes 0 and 3 (9 GPUs),
    # m = 3 nodes 0, 2 and 4 (3 GPUs). The first m to reach 3 GPUs overshot to 9.
    pods, _ = _files(tmp_path, PODS)
    nodes = tmp_path / "uneven.csv"
    nodes.write_text("sn,gpu,model\n" + "".join(f"n{i},{g},T4\n" for i, g in enumerate((1, 1, 1, 8, 1, 1))))
    wl = load_alibaba(PERF, pods, nodes, gpus=3)
    assert len(wl.gpus) == 3 and {g.node for g in wl.gpus} == {"n0", "n2", "n4"}
    assert len(load_alibaba(PERF, pods, nodes, peak_ratio=4 / 3).gpus) == 3  # peak 4 -> 3 GPUs


@pytest.mark.parametrize(
    ("row", "words"),
    [
        ("p,1,1,1,500", "pods.csv:2='5 fields'"),  # truncated: was skipped as a pod that never ran
        ("p,1,1,1,500,,LS,Running,0,10,0,extra", "pods.csv:2='12 fields'"),
        ("p,1,1,1,500,,BE,Succeeded,0,100,", "pods.csv:2 scheduled_time"),  # was skipped
        ("p,1,1,2,banana,,LS,Running,0,10,0", "pods.csv:2 gpu_milli='banana'"),  # was ignored (2 GPUs)
        ("p,1,1,0,banana,,LS,Running,0,10,0", "pods.csv:2 gpu_milli='banana'"),  # CPU-only: still a typo
        ("p,1,1,1,500,,LS,Runnnning,0,10,0", "pods.csv:2 pod_phase='Runnnning'"),  # was accepted
        ("p,1,1,1,500,,LS,Unknown,0,10,0", "pods.csv:2 pod_phase='Unknown'"),
    ],
)
def test_malformed_rows_are_errors_not_skips(tmp_path, row, words):
    with pytest.raises(ConfigError) as e:
        load_alibaba(PERF, *_files(tmp_path, [row]))
    assert words in str(e.value)


def test_sjf_predictions_carry_the_documented_error(tmp_path):
    import math
    import random
    import statistics

    from scheduler_lite.sim.workload import PREDICTION_ERROR_SIGMA

    rows = [f"p{i},1,1,1,500,,LS,Running,{i},{i + 100 + i % 50},{i}" for i in range(400)]
    files = _files(tmp_path, rows)
    wl = load_alibaba(PERF, *files, seed=3)
    errors = [math.log(j.predicted_runtime_s / j.runtime_s) for j in wl.jobs]  # type: ignore[operator]
    assert all(e != 0.0 for e in errors)  # the exact run time before
    assert statistics.pstdev(errors) == pytest.approx(PREDICTION_ERROR_SIGMA, abs=0.03)
    assert load_alibaba(PERF, *files, seed=3) == wl  # drawn from the seed
    # From a stream of their own: the memory surges are drawn as before, one draw of the seed's
    # stream per GPU pod that ran, in file order (here also arrival order).
    rng = random.Random(3)
    surges = [PERF.surge_at_fraction if rng.random() < PERF.surge_probability else None for _ in rows]
    assert [j.surge_at_fraction for j in wl.jobs] == surges
