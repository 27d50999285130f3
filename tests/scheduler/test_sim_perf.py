"""The simulator's performance model and workload recipe against their sources."""

from __future__ import annotations

import dataclasses
import json
from importlib import resources

import pytest

from scheduler_lite.model import GIB, Gpu, JobKind, Role, Tenant
from scheduler_lite.policy.registry import POLICIES
from scheduler_lite.policy.validation import ConfigError
from scheduler_lite.sim.engine import Simulator
from scheduler_lite.sim.perf import load_perf_model
from scheduler_lite.sim.simjob import SimJob
from scheduler_lite.sim.workload import TraceJob, Workload, paper_recipe

PERF = load_perf_model()


def test_packing_without_isolation_reproduces_antman_fig12():
    espnet, resnet = PERF.models["espnet"], PERF.models["resnet50"]
    light, heavy = PERF.unisolated_speeds([espnet.utilisation, resnet.utilisation])
    # AntMan §5.1: ESPnet 20.1 min alone, 105.2 min packed with ResNet-50.
    assert 1 / light == pytest.approx(105.2 / 20.1, rel=0.02)
    assert heavy == 1.0


def test_packing_equal_jobs_is_proportional_time_slicing():
    assert PERF.unisolated_speeds([0.9, 0.9]) == pytest.approx([1 / 1.8, 1 / 1.8])
    assert PERF.unisolated_speeds([0.3, 0.5]) == [1.0, 1.0]  # the GPU is not saturated


def _on_one_gpu(policy: str, jobs: dict[str, SimJob]) -> Simulator:
    """A simulator of one GPU (its real parts) with `jobs` placed on it."""
    gpu = Gpu(0, "n0", 32 * GIB, "n0")
    sim = Simulator(Workload("t", (gpu,), (Tenant("A", 1), Tenant("B", 0)), ()), POLICIES[policy], PERF)
    sim.on_gpu[0].update(jobs)
    return sim


def test_isolated_jobs_over_a_full_gpu_are_slowed_by_contention():
    # Two guarantee jobs of u 0.7 on one GPU with compute isolation: D = 1.4, each slowed by
    # 1 + k (D - 1), and by bandwidth interference from the other (docs/simulator.md,
    # "Performance model").
    trace = TraceJob("a", "A", JobKind.GUARANTEE, 0.0, 1, 100.0, "generic", GIB, 0.7, 0.5)
    jobs = {}
    for jid in ("a", "b"):
        sj = SimJob(dataclasses.replace(trace, id=jid), PERF.models["generic"], 0)
        sj.gpus, sj.limits, sj.role = (0,), {0: GIB}, Role.GUARANTEE
        jobs[jid] = sj
    sim = _on_one_gpu("tf-antman", jobs)
    sim.speeds.recompute({0})
    slow = (1 + PERF.contention_slowdown * 0.4) * (1 + PERF.colocation_interference * 0.7)
    assert [sj.gpu_speed[0] for sj in jobs.values()] == pytest.approx([1 / slow, 1 / slow])
    del sim.on_gpu[0]["b"]  # no co-runner: no contention, no bandwidth interference
    sim.speeds.recompute({0})
    assert jobs["a"].gpu_speed[0] == 1.0


def _raw() -> dict:
    return json.loads(resources.files("scheduler_lite.data").joinpath("perf_model.json").read_text())


def test_bad_exponent_is_rejected_with_its_name(tmp_path):
    raw = _raw()
    raw["unisolated_share_exponent"] = -1
    path = tmp_path / "perf.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="unisolated_share_exponent"):
        load_perf_model(path)


def test_version_1_file_is_rejected(tmp_path):
    raw = _raw()
    raw["version"] = 1
    path = tmp_path / "perf.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="format/version"):
        load_perf_model(path)


def test_recipe_gang_sizes_follow_philly_single_gpu_share():
    wl = paper_recipe(PERF, num_jobs=4000, seed=11)
    single = sum(1 for j in wl.jobs if j.num_gpus == 1) / len(wl.jobs)
    assert single == pytest.approx(0.82, abs=0.02)
    assert {j.num_gpus for j in wl.jobs} == {1, 2, 4, 8}


@pytest.mark.parametrize(("families", "field"), [({}, "families"), ({"cv": [], "nlp": ["bert"]}, "families.cv")])
def test_an_empty_family_choice_is_rejected_with_its_name(tmp_path, families, field):
    # The recipe draws a family, then a model of it: an empty choice was an IndexError there.
    raw = _raw()
    raw["families"] = families
    path = tmp_path / "perf.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=rf"^{field}=.*at least one"):
        load_perf_model(path)
