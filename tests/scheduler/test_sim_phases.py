"""CPU-bound phases of the simulator's jobs (perf model v4, AntMan §2.2 Fig. 3-4)."""

from __future__ import annotations

import dataclasses
import json
from importlib import resources

import pytest

from scheduler_lite.model import GIB, Gpu, JobKind, Tenant
from scheduler_lite.policy.registry import POLICIES
from scheduler_lite.policy.validation import ConfigError
from scheduler_lite.sim.engine import simulate
from scheduler_lite.sim.perf import load_perf_model
from scheduler_lite.sim.workload import TraceJob, Workload, paper_recipe

PERF = load_perf_model()


def test_shipped_phases_are_the_papers_figures():
    assert PERF.input_phase_s == 275  # Fig. 3: DeepFM preprocesses on the CPU for 275 s
    assert PERF.evaluation_s == 100  # Fig. 4: ESPnet's synthesis on the CPU
    assert PERF.evaluation_every_s > PERF.evaluation_s


def test_phase_edges():
    p = dataclasses.replace(PERF, input_phase_s=275.0, input_phase_max_fraction=0.25,
                            evaluation_every_s=1800.0, evaluation_s=100.0)
    assert p.cpu_phases(600) == (0.0, 150.0)  # capped at a quarter of the run time
    assert p.cpu_phases(4000) == (0.0, 275.0, 2075.0, 2175.0, 3875.0, 3975.0)
    assert p.cpu_phases(3900) == (0.0, 275.0, 2075.0, 2175.0, 3875.0, 3900.0)  # ends evaluating
    assert dataclasses.replace(p, input_phase_s=0.0).cpu_phases(4000) == (1800.0, 1900.0, 3600.0, 3700.0)
    assert dataclasses.replace(p, input_phase_s=0.0, evaluation_every_s=0.0).cpu_phases(4000) == ()


def _raw() -> dict:
    return json.loads(resources.files("scheduler_lite.data").joinpath("perf_model.json").read_text())


def _load(tmp_path, raw):
    path = tmp_path / "perf.json"
    path.write_text(json.dumps(raw))
    return load_perf_model(path)


def test_a_version_3_model_has_no_phases(tmp_path):
    raw = _raw()
    raw["version"] = 3
    del raw["cpu_phases"]
    assert _load(tmp_path, raw).cpu_phases(10_000) == ()


@pytest.mark.parametrize(("change", "field"), [
    (lambda p: p.pop("evaluation_s"), "cpu_phases.evaluation_s"),
    (lambda p: p.update(input_max_fraction=1.5), "cpu_phases.input_max_fraction"),
    (lambda p: p.update(input_s=-1), "cpu_phases.input_s"),
    (lambda p: p.update(evaluation_s=2000), "cpu_phases.evaluation_s"),  # longer than the period
    (lambda p: p.update(decoding_s=200), "cpu_phases.decoding_s"),  # unknown key
])
def test_bad_phase_fields_are_named(tmp_path, change, field):
    raw = _raw()
    change(raw["cpu_phases"])
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        _load(tmp_path, raw)


@pytest.mark.parametrize("value", [None, [275, 0.25, 1800, 100], 275])
def test_a_version_4_model_without_a_phases_object_is_rejected(tmp_path, value):
    raw = _raw()
    if value is None:
        del raw["cpu_phases"]
    else:
        raw["cpu_phases"] = value
    with pytest.raises(ConfigError, match="cpu_phases=.*an object with input_s"):
        _load(tmp_path, raw)


def test_the_recipe_gives_each_job_its_phases():
    wl = paper_recipe(PERF, num_jobs=50, seed=1)
    for j in wl.jobs:
        assert j.cpu_phases == PERF.cpu_phases(j.runtime_s)
        assert j.cpu_phases[0] == 0.0  # every job starts preprocessing


def _workload(jobs: list[TraceJob]) -> Workload:
    return Workload("t", (Gpu(0, "n0", 32 * GIB, "n0"),), (Tenant("A", 1), Tenant("B", 0)), tuple(jobs))


def _job(jid: str, runtime: float, u: float, kind: JobKind = JobKind.OPPORTUNISTIC,
         phases: tuple[float, ...] = (), t: float = 0.0, share: float | None = None) -> TraceJob:
    return TraceJob(jid, "B" if kind is JobKind.OPPORTUNISTIC else "A", kind, t, 1, runtime, "generic",
                    2 * GIB, u, 0.5, requested_share=u if share is None else share, cpu_phases=phases)


def test_a_job_alone_takes_its_run_time_and_leaves_the_gpu_idle_in_its_phases():
    phases = (0.0, 200.0, 600.0, 700.0)
    r = simulate(_workload([_job("a", 1000, 0.8, phases=phases)]), POLICIES["yarn-cs"], PERF)
    (rec,) = r.records
    assert rec["end_s"] == pytest.approx(1000)
    assert rec["work_done_s"] == pytest.approx(1000)
    # Busy on the GPU for 700 of the 1000 s (utilisation 0.8 then), idle for 300.
    assert r.summary["gpu_compute_util"] == pytest.approx(0.8 * 700 / 1000)
    assert r.summary["gpu_busy_fraction"] == pytest.approx(1.0)  # it holds the GPU throughout


def test_a_packed_neighbour_runs_alone_while_the_other_job_is_on_the_cpu():
    """Without isolation two u = 0.9 jobs time-slice the GPU; a CPU phase gives it back."""
    plain = [_job("a", 1000, 0.9), _job("b", 1000, 0.9)]
    phased = [_job("a", 1000, 0.9, phases=(0.0, 400.0)), _job("b", 1000, 0.9)]
    before = {r["id"]: r for r in simulate(_workload(plain), POLICIES["gandiva"], PERF).records}
    after = {r["id"]: r for r in simulate(_workload(phased), POLICIES["gandiva"], PERF).records}
    assert after["b"]["end_s"] < before["b"]["end_s"] - 300
    assert after["a"]["work_done_s"] == pytest.approx(1000)
    # 'a' preprocesses at full speed whatever 'b' does (b starts at the next utilisation sample,
    # 10 s, and has 610 s left at 400 s); then both time-slice with bandwidth interference.
    assert after["b"]["start_s"] == pytest.approx(10)
    both = 1.8 * (1 + PERF.colocation_interference * 0.9)
    assert after["a"]["end_s"] == pytest.approx(400 + 600 * both)


def test_the_coordinator_gives_a_guarantee_jobs_cpu_phase_to_the_opportunistic_job():
    """A guarantee job evaluating on the CPU leaves its GPU's cycles to its neighbour: the
    opportunistic job (it asked for 0.3 of the GPU and could use 0.6), held near 1 - u of the
    GPU otherwise, gets its share raised while the guarantee job's steps do not suffer, finishes
    sooner, and the guarantee job is not stretched by more than the coordinator's tolerance."""
    g_plain = _job("g", 3000, 0.7, JobKind.GUARANTEE)
    g_phased = _job("g", 3000, 0.7, JobKind.GUARANTEE, phases=(1000.0, 2000.0))
    o = _job("o", 3000, 0.6, t=1.0, share=0.3)
    before = {r["id"]: r for r in simulate(_workload([g_plain, o]), POLICIES["tf-antman"], PERF,
                                           check_invariants=True).records}
    after = {r["id"]: r for r in simulate(_workload([g_phased, o]), POLICIES["tf-antman"], PERF,
                                          check_invariants=True).records}
    assert after["o"]["end_s"] < before["o"]["end_s"] - 300
    assert after["g"]["end_s"] <= before["g"]["end_s"] * 1.02
