"""The daemon's driver findings of issue 13: piling, launch limits, status from the job's own stats."""

from __future__ import annotations

import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler_lite.config import parse_config
from scheduler_lite.daemon import Daemon
from scheduler_lite.storage import SqliteStorage
from scheduler_lite.testing import run_until, stop_all_jobs
from tests.scheduler.test_daemon_fakes import JOB_ENV, MIB, REPO, fake_command, make_config, wait_for

SLOW_START = {**JOB_ENV, "FAKE_START_DELAY_S": "30"}  # no stats during the test, as a TF job starting


@pytest.fixture
def daemons() -> Iterator[list[Daemon]]:
    made: list[Daemon] = []
    yield made
    for d in made:
        stop_all_jobs(d, grace_s=1)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def launched_limit(d: Daemon, job_id: str) -> int:
    event = next(e for e in d.storage.events(job_id) if e.kind == "launched")
    return int(event.detail["memory_limit_bytes"])


def test_opportunistic_jobs_half_a_second_apart_spread_over_idle_gpus(tmp_path: Path, daemons: list[Daemon]) -> None:
    clock = Clock()
    config = make_config(tmp_path, gpus=4, daemon={"utilisation_window_s": 10.0})
    d = Daemon(config, SqliteStorage(config.db_path), clock=clock)
    daemons.append(d)
    jobs = []
    for _ in range(4):
        jobs.append(d.submit(fake_command(), tenant="B", kind="opportunistic", env=SLOW_START))
        d.tick()
        clock.now += 0.5
    placements = [d.job(j).placement for j in jobs]  # type: ignore[union-attr]
    assert sorted(placements) == [(0,), (1,), (2,), (3,)]
    # The marks hold until a reading covers the job's first step: none has stepped yet.
    assert all(d.jobs.driver.held(g) for g in range(4))


def test_a_mark_is_released_once_a_reading_covers_the_first_step(tmp_path: Path, daemons: list[Daemon]) -> None:
    clock = Clock()
    config = make_config(tmp_path, gpus=2, daemon={"utilisation_window_s": 2.0})
    d = Daemon(config, SqliteStorage(config.db_path), clock=clock)
    daemons.append(d)
    job = d.submit(fake_command(achieved=0.3), tenant="B", kind="opportunistic", env=JOB_ENV)
    d.tick()
    assert d.jobs.driver.held(0) == (job,) and d.jobs.book.gpus[0].utilisation == 1.0
    assert wait_for(lambda: (d.tick(), d.status().gpu(0).job(job).step)[1] is not None)  # type: ignore[union-attr]
    first_seen = clock.now
    clock.now = first_seen + 1.0  # the window still reaches back before the first step
    d.tick()
    assert d.jobs.driver.held(0) == (job,)
    clock.now = first_seen + 2.5
    d.tick()
    assert d.jobs.driver.held(0) == () and 0.0 < d.jobs.book.gpus[0].utilisation <= 0.3


def example_config(state: Path, gpus: int = 2):
    data = tomllib.loads((REPO / "examples" / "scheduler.toml").read_text())
    data["paths"]["state_dir"] = str(state)
    data["devices"]["emulated"] = data["devices"]["emulated"][:gpus]
    return parse_config(data, base_dir=state)


def test_example_config_guarantee_then_opportunistic_use_both_gpus(tmp_path: Path, daemons: list[Daemon]) -> None:
    clock = Clock()
    config = example_config(tmp_path)
    d = Daemon(config, SqliteStorage(config.db_path), clock=clock)
    daemons.append(d)
    g = d.submit(fake_command(), tenant="research", kind="guarantee", env=SLOW_START)
    d.tick()
    clock.now += 0.5
    o = d.submit(fake_command(), tenant="batch", kind="opportunistic", env=SLOW_START)
    d.tick()
    assert d.job(g).placement == (0,) and d.job(o).placement == (1,)  # type: ignore[union-attr]
    # Each alone on its GPU: the whole GPU (the guarantee job has declared no --memory).
    assert launched_limit(d, g) == launched_limit(d, o) == 2 << 30
    # Submitted before the same tick: one pass, the same split.
    g2 = d.submit(fake_command(), tenant="research", kind="guarantee", env=SLOW_START)
    o2 = d.submit(fake_command(), tenant="batch", kind="opportunistic", env=SLOW_START)
    stop_all_jobs(d, grace_s=1)
    d.tick()
    assert d.job(g2).placement == (0,) and d.job(o2).placement == (1,)  # type: ignore[union-attr]


def test_an_opportunistic_job_next_to_a_guarantee_job_starts_with_the_minimum(
    tmp_path: Path, daemons: list[Daemon]
) -> None:
    clock = Clock()
    config = example_config(tmp_path, gpus=1)
    d = Daemon(config, SqliteStorage(config.db_path), clock=clock)
    daemons.append(d)
    g = d.submit(fake_command(), tenant="research", kind="guarantee", env=SLOW_START)
    d.tick()
    clock.now += 0.5
    o = d.submit(fake_command(), tenant="batch", kind="opportunistic", env=SLOW_START)
    for _ in range(30):  # the GPU is marked busy until a reading covers g's first step: never here
        d.tick()
        clock.now += 0.5
    assert d.job(o).placement == ()  # type: ignore[union-attr]
    d.jobs.driver._held.clear()  # as if g had been measured: the next reading reaches the book
    d.tick()
    assert d.job(o).placement == (0,)  # type: ignore[union-attr]
    floor = config.coordinator.min_memory_bytes
    assert launched_limit(d, o) == floor
    limits = {p.job_id: p.memory_limit_bytes for p in d.storage.placements()}
    assert limits == {g: (2 << 30) - floor, o: floor}
    share = next(e for e in d.storage.events(o) if e.kind == "launched").detail["compute_share"]
    assert share == config.coordinator.floor_share


def test_status_shows_the_settings_in_force_and_what_is_pending(tmp_path: Path, daemons: list[Daemon]) -> None:
    config = make_config(tmp_path)
    d = Daemon(config, SqliteStorage(config.db_path))
    daemons.append(d)
    # Steps of 3 s: a control written now is applied at the start of the next step.
    opp = d.submit(fake_command(step_s=3.0, demand=600 * MIB), tenant="B", kind="opportunistic", env=JOB_ENV)
    before = d.tick()
    assert before.launched == (opp,)
    row = d.status().gpu(0).job(opp)
    assert row is not None and row.memory_limit_bytes is None and row.target_memory_limit_bytes == 1 << 30
    assert run_until(d, lambda d: d.status().gpu(0).job(opp).memory_limit_bytes is not None,  # type: ignore[union-attr]
                       timeout=20, interval=0.05)
    # A slow guarantee job: the coordinator waits for its steps and decides nothing more.
    d.submit(fake_command(step_s=5.0), tenant="A", kind="guarantee", memory_bytes=512 * MIB, env=JOB_ENV)
    d.tick()
    row = d.status().gpu(0).job(opp)
    assert row is not None
    assert (row.memory_limit_bytes, row.compute_share) == (1 << 30, 1.0)  # what the job runs with
    assert row.target_memory_limit_bytes == config.coordinator.min_memory_bytes
    assert row.target_compute_share == config.coordinator.floor_share
    assert row.controls_pending == 1
    assert run_until(d, lambda d: d.status().gpu(0).job(opp).controls_pending == 0,  # type: ignore[union-attr]
                       timeout=20, interval=0.05)
    row = d.status().gpu(0).job(opp)
    assert row is not None and row.memory_limit_bytes == config.coordinator.min_memory_bytes
    assert row.compute_share == config.coordinator.floor_share


def test_measured_demand_solo_step_and_remaining_time(tmp_path: Path, daemons: list[Daemon]) -> None:
    config = make_config(tmp_path)
    d = Daemon(config, SqliteStorage(config.db_path))
    daemons.append(d)
    opp = d.submit(fake_command(demand=900 * MIB), tenant="B", kind="opportunistic", env=JOB_ENV)
    # Alone at full share: its solo step time is measured (the coordinator's trial-and-error reference).
    assert run_until(d, lambda d: d.jobs.driver.local_job(opp, 0).solo_step_time_s is not None, timeout=20, interval=0.02)
    solo = d.jobs.driver.local_job(opp, 0).solo_step_time_s
    assert solo is not None and 0.02 <= solo < 0.5
    # A guarantee job without --memory: the whole GPU until measured, then its peak plus headroom.
    g = d.submit(fake_command(demand=300 * MIB), tenant="A", kind="guarantee", expected_steps=100_000, env=JOB_ENV)
    d.tick()
    assert d.jobs.driver.settings[g].limits[0] == (1 << 30) - config.coordinator.min_memory_bytes
    # That tick observed before it placed g, so it may still have re-measured opp from steps made
    # alone: the reference is the value after it. From then on opp is not alone: it stands.
    solo = d.jobs.driver.local_job(opp, 0).solo_step_time_s
    for _ in range(20):  # ~1 s: enough steps for a new window (detector_window 10, ~0.02 s each)
        time.sleep(0.05)
        d.tick()
        assert d.jobs.driver.local_job(opp, 0).solo_step_time_s == solo

    def measured(d: Daemon) -> bool:
        return d.jobs.driver.memo(0).anchor_s is not None

    assert run_until(d, measured, timeout=30, interval=0.02)
    c = config.coordinator
    headroom = max(int(300 * MIB * c.demand_headroom), c.min_memory_bytes)  # at least min_memory
    g_limit = d.jobs.driver.settings[g].limits[0]
    assert g_limit in (300 * MIB + headroom, 300 * MIB + headroom + 1)
    assert d.jobs.driver.settings[opp].limits[0] == (1 << 30) - g_limit  # the rest, below its 900 MiB demand
    # Remaining time from --steps and the measured step rate.
    job = d.jobs.book.jobs[g]
    assert job.estimated_remaining_s is not None and job.mean_step_time_s is not None
    step = d.status().gpu(0).job(g).step  # type: ignore[union-attr]
    assert step is not None
    assert job.estimated_remaining_s == pytest.approx((100_000 - step) * job.mean_step_time_s, rel=0.05)
