"""The driver's migration and held-memory entry points (issue 15's model on issue 13's driver)."""

from __future__ import annotations

import pytest

from scheduler_lite.driver import BUSY, Driver
from scheduler_lite.model import GIB, GlobalDecision, Gpu, Job, JobKind, Place, Role, Tenant
from scheduler_lite.policy.coordinator import CoordinatorConfig
from scheduler_lite.policy.migration import Migrate

GPUS = (Gpu(0, "n0", 32 * GIB, "n0"), Gpu(1, "n0", 32 * GIB, "n0"), Gpu(2, "n1", 32 * GIB, "n1"))


def scripted(batches: list[list[GlobalDecision]]):  # type: ignore[no-untyped-def]
    """A policy that returns the next scripted batch on each pass."""

    def policy(state: object, config: object) -> list[GlobalDecision]:
        return batches.pop(0) if batches else []

    return policy


def job(jid: str, tenant: str, kind: JobKind, demand: int = 8 * GIB) -> Job:
    return Job(id=jid, tenant=tenant, num_gpus=1, kind=kind, submit_time=0.0, memory_demand_bytes=demand)


def driver(universal_memory: bool = True) -> Driver:
    batches: list[list[GlobalDecision]] = [[Place("g", (0,), Role.GUARANTEE), Place("o", (0,), Role.OPPORTUNISTIC)]]
    d = Driver(GPUS, (Tenant("A", 2), Tenant("B", 0)), policy=scripted(batches), scheduler_config=None,
               coordinator_config=CoordinatorConfig(), universal_memory=universal_memory)
    d.book.submit(job("g", "A", JobKind.GUARANTEE))
    d.book.submit(job("o", "B", JobKind.OPPORTUNISTIC))
    _, launches = d.schedule(0.0)
    assert [la.gpus for la in launches] == [(0,), (0,)]
    return d


def test_migrate_moves_book_settings_and_busy_mark() -> None:
    d = driver()
    d.settings["o"].shares[0] = 0.05  # the coordinator cut it: stranded
    launch = d.migrate(Migrate("o", (2,)), 10.0)
    assert (launch.job_id, launch.gpus, launch.role) == ("o", (2,), Role.OPPORTUNISTIC)
    # Alone on GPU 2: the whole GPU (the coordinator's answer for a lone opportunistic job), full
    # share; nothing of GPU 0 is left in its settings.
    assert launch.settings.limits == {2: 32 * GIB} and launch.settings.shares == {2: 1.0}
    assert d.settings["o"] is launch.settings
    assert d.book.jobs_on(0) == ("g",) and d.book.jobs_on(2) == ("o",)
    assert d.book.jobs["o"].placement == (2,) and d.book.jobs["o"].role is Role.OPPORTUNISTIC
    # GPU 2 got a job: busy until a reading covers it; GPU 0 no longer waits for it.
    assert d.held(2) == ("o",) and d.book.gpus[2].utilisation == BUSY
    assert "o" not in d.held(0)


def test_migrate_refuses_a_job_that_is_not_running() -> None:
    d = driver()
    d.book.submit(job("p", "B", JobKind.OPPORTUNISTIC))
    with pytest.raises(ValueError, match="'p': not running"):
        d.migrate(Migrate("p", (1,)), 1.0)


def test_hold_sets_what_the_framework_holds_without_universal_memory() -> None:
    d = driver(universal_memory=False)
    assert d.settings["o"].limits == {0: 8 * GIB}  # launch: the demand, until the world says more
    d.hold("o", {0: 14 * GIB})
    assert d.settings["o"].limits == {0: 14 * GIB}
    d.set_demand("o", 20 * GIB, held={0: 30 * GIB})
    assert d.settings["o"].limits == {0: 30 * GIB} and d.book.jobs["o"].memory_demand_bytes == 20 * GIB
    d.set_demand("o", 24 * GIB)  # the world did not say: the limit follows the demand
    assert d.settings["o"].limits == {0: 24 * GIB}
    with pytest.raises(ValueError, match="GPU 1 is not one of its GPUs"):
        d.hold("o", {1: GIB})


def test_hold_is_refused_under_universal_memory() -> None:
    d = driver()
    with pytest.raises(ValueError, match="coordinator"):
        d.hold("o", {0: GIB})


def test_a_placement_starts_with_what_the_coordinator_would_give() -> None:
    """The driver's launch settings follow the coordinator's rule, so its first round changes
    nothing: alone, an opportunistic job gets the whole GPU; next to a guarantee job, what it
    leaves (here the guarantee job's demand leaves 24 GiB, more than the 8 GiB demand)."""
    d = driver()  # g (guarantee) and o (opportunistic) on GPU 0
    assert d.settings["o"].limits == {0: 8 * GIB}
    d.book.submit(job("p", "B", JobKind.OPPORTUNISTIC))
    d.policy = scripted([[Place("p", (1,), Role.OPPORTUNISTIC)]])
    _, (launch,) = d.schedule(1.0)
    assert launch.settings.limits == {1: 32 * GIB}
    view = d.view(1, {})
    assert d.round(2.0, 1, view) == []  # the coordinator agrees: nothing to change
