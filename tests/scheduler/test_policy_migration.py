"""Re-placing stranded opportunistic jobs (policy/migration.py) and its use by the simulator."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler_lite.model import GIB, Gpu, JobKind, Place, Role, Tenant
from scheduler_lite.policy.migration import Migrate, MigrationConfig, plan_migrations
from scheduler_lite.policy.registry import POLICIES
from scheduler_lite.policy.validation import ConfigError
from scheduler_lite.sim.engine import simulate
from scheduler_lite.sim.perf import load_perf_model
from scheduler_lite.sim.workload import TraceJob, Workload
from tests.scheduler.builders import book, job

CFG = MigrationConfig()


def _setup(opp_gpus: int = 1, busy: tuple[int, ...] = ()):
    b = book(nodes=2, per_node=2)
    b.submit(job("g", gpus=opp_gpus))
    b.apply(Place("g", tuple(range(opp_gpus)), Role.GUARANTEE))
    b.submit(job("o", tenant="B", gpus=opp_gpus, kind=JobKind.OPPORTUNISTIC))
    b.apply(Place("o", tuple(range(opp_gpus)), Role.OPPORTUNISTIC))
    for i, gpu in enumerate(busy):
        b.submit(job(f"x{i}"))
        b.apply(Place(f"x{i}", (gpu,), Role.GUARANTEE))
    return b


@pytest.mark.parametrize(
    ("share", "busy", "expect"),
    [
        (0.05, (), [Migrate("o", (2,))]),  # stranded, idle GPUs in the other group: moves
        (0.05, (1,), [Migrate("o", (2,))]),  # GPU 1 busy: GPUs 2 and 3 are still idle
        (0.5, (), []),  # not stranded: a fair share of its GPU
        (0.05, (1, 2, 3), []),  # no idle GPU: stays
    ],
)
def test_a_stranded_job_moves_to_an_idle_gpu(share, busy, expect):
    b = _setup(busy=busy)
    got = plan_migrations(b.snapshot(0.0), {"o": share}, CFG)
    # Best fit: the group whose idle GPUs fit the job most tightly.
    assert [(m.job_id, len(m.gpus)) for m in got] == [(m.job_id, len(m.gpus)) for m in expect]
    for m in got:
        assert not set(m.gpus) & ({0} | set(busy))


def test_a_gang_moves_only_as_a_whole_and_the_book_follows():
    b = _setup(opp_gpus=2)
    (m,) = plan_migrations(b.snapshot(0.0), {"o": 0.05}, CFG)
    assert sorted(m.gpus) == [2, 3]  # one NVLink group
    b.apply(m)
    assert b.jobs["o"].placement == (2, 3) and b.jobs["o"].role is Role.OPPORTUNISTIC
    assert b.jobs_on(0) == ("g",) and b.jobs_on(2) == ("o",)
    assert plan_migrations(_setup(opp_gpus=2, busy=(2,)).snapshot(0.0), {"o": 0.05}, CFG) == []


def test_bad_config_names_the_field():
    with pytest.raises(ConfigError, match="stranded_share"):
        MigrationConfig(stranded_share=2.0).validate()


def test_simulator_moves_the_stranded_job_and_charges_the_restart():
    perf = load_perf_model()
    gpus = (Gpu(0, "n0", 32 * GIB, "n0"), Gpu(1, "n1", 32 * GIB, "n1"))
    # The opportunistic job starts on GPU 0 (least loaded); the guarantee job lands next to it
    # only while GPU 1 is busy with a short guarantee job; GPU 1 then idles.
    jobs = (
        TraceJob("short", "A", JobKind.GUARANTEE, 0.0, 1, 300.0, "generic", 4 * GIB, 1.0, 0.5, requested_share=1.0),
        TraceJob("opp", "B", JobKind.OPPORTUNISTIC, 1.0, 1, 3000.0, "generic", 4 * GIB, 0.5, 0.5,
                 requested_share=0.5),
        # Uses the whole GPU: any share the opportunistic job gets slows it, so it stays cut.
        TraceJob("long", "A", JobKind.GUARANTEE, 100.0, 1, 5000.0, "generic", 4 * GIB, 1.0, 0.5,
                 requested_share=1.0),
    )
    wl = Workload("t", gpus, (Tenant("A", 2), Tenant("B", 0)), jobs)
    with_mig = {r["id"]: r for r in simulate(wl, POLICIES["tf-antman"], perf, check_invariants=True).records}
    without = dataclasses.replace(POLICIES["tf-antman"], migration=None)
    stuck = {r["id"]: r for r in simulate(wl, without, perf).records}
    assert with_mig["opp"]["migrations"] == 1 and stuck["opp"]["migrations"] == 0
    assert with_mig["opp"]["end_s"] < stuck["opp"]["end_s"]
    # The restart cost is work: the moved job did its run time plus one checkpoint-restart.
    assert with_mig["opp"]["work_done_s"] == pytest.approx(3000.0 + perf.checkpoint_restart_s, rel=1e-6)
