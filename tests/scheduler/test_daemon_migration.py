"""Placement by requested share and migration in the daemon, with real (fake) job processes.

Two emulated GPUs. A restartable opportunistic job cut to the coordinator's floor by a guarantee
arrival is moved to the other GPU once that one idles: stopped with SIGTERM, started again there
when its process has ended, never two processes at once; also across a daemon restart in the
middle. A job that did not declare itself restartable stays where it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler_lite.daemon import Daemon
from scheduler_lite.launcher import wrappers_under
from scheduler_lite.model import Place, Role
from scheduler_lite.storage import JobStatus, SqliteStorage
from scheduler_lite.submission import SubmitError
from scheduler_lite.testing import stop_all_jobs
from tests.scheduler.test_daemon_fakes import JOB_ENV, MIB, fake_command, make_config, wait_for


@pytest.fixture
def daemons() -> Iterator[list[Daemon]]:
    made: list[Daemon] = []
    yield made
    for d in reversed(made):
        stop_all_jobs(d, grace_s=1)


def new_daemon(made: list[Daemon], state: Path) -> Daemon:
    # Rounds every 30 s: a guarantee job stays settling (its neighbour at the floor) for that long;
    # with the fakes' constant step times a growing share would leave the floor within a second.
    config = make_config(state, gpus=2, coordinator={"round_interval_s": 30})
    d = Daemon(config, SqliteStorage(config.db_path))
    made.append(d)
    return d


def wrappers(d: Daemon, job_id: str) -> int:
    """Live wrapper processes of this daemon's job, whatever their launch token (job ids repeat
    across stores: the jobs directory tells this test's apart)."""
    return sum(1 for _, name in wrappers_under(d.config.jobs_dir) if name.split(":")[1] == job_id)


def kinds(d: Daemon, job_id: str) -> list[str]:
    return [e.kind for e in d.storage.events(job_id)]


def ticking(d: Daemon, until, job_id: str, timeout: float = 30.0) -> bool:
    """tick() until `until(d)`; at every tick the job has at most one process."""
    def step() -> bool:
        d.tick()
        assert wrappers(d, job_id) <= 1, f"{job_id}: two processes at once"
        return until(d)
    return wait_for(step, timeout=timeout, interval=0.02)


def stranded_setup(d: Daemon, tmp_path: Path, restartable: bool, ignore_sigterm: bool = False) -> tuple[str, str]:
    """m on GPU 0 (share 0.9), f on GPU 1 for ~3 s, then a guarantee job on GPU 0: m at the floor."""
    runs = tmp_path / "runs.log"
    env = {**JOB_ENV, "FAKE_RUNS_LOG": str(runs), **({"FAKE_IGNORE_SIGTERM": "1"} if ignore_sigterm else {})}
    m = d.submit(fake_command(demand=200 * MIB), tenant="B", kind="opportunistic", env=env,
                 requested_share=0.9, restartable=restartable)
    f = d.submit(fake_command(steps=150, demand=200 * MIB), tenant="B", kind="opportunistic", env=JOB_ENV,
                 requested_share=0.9)
    first = d.tick()
    assert Place(m, (0,), Role.OPPORTUNISTIC) in first.decisions
    assert Place(f, (1,), Role.OPPORTUNISTIC) in first.decisions  # no share room left on GPU 0
    g = d.submit(fake_command(demand=200 * MIB), tenant="A", kind="guarantee", memory_bytes=300 * MIB, env=JOB_ENV)
    arrival = d.tick()
    assert Place(g, (0,), Role.GUARANTEE) in arrival.decisions
    assert d.jobs.driver.settings[m].shares[0] == d.config.coordinator.floor_share
    return m, f


def test_a_stranded_restartable_job_moves_to_the_gpu_that_idles(tmp_path: Path, daemons: list[Daemon]) -> None:
    d = new_daemon(daemons, tmp_path)
    m, f = stranded_setup(d, tmp_path, restartable=True)
    assert ticking(d, lambda d: "migrating" in kinds(d, m), m)
    assert d.storage.get_job(f).state is JobStatus.FINISHED  # the move waited for GPU 1 to idle
    assert ticking(d, lambda d: m in d.jobs.live and d.storage.get_job(m).pid is not None, m)
    record = d.storage.get_job(m)
    assert record.state is JobStatus.RUNNING and record.placement == (1,) and not record.migrating
    assert d.jobs.book.jobs_on(1) == (m,) and m not in d.jobs.book.jobs_on(0)
    assert kinds(d, m).count("launched") == 2 and "migrated" in kinds(d, m)
    # Started twice, the second time on GPU 1 (the fake job prints its SCHEDULER_LITE_GPUS first
    # thing; its ANTMAN_DEVICE_ID is 0 both times: devices are numbered within the job).
    assert wait_for(lambda: (tmp_path / "runs.log").read_text().split() == [m, m])
    stdout = (Path(record.job_dir) / "stdout.log")
    assert wait_for(lambda: [ln.split()[3] for ln in stdout.read_text().splitlines() if ln.startswith("env")]
                    == ["0", "1"])
    # On GPU 1 alone, the coordinator gives it the whole GPU again.
    assert ticking(d, lambda d: d.jobs.driver.settings[m].shares[1] == 1.0, m)


def test_a_migrated_job_s_new_process_counts_its_running_time_from_its_own_launch(
        tmp_path: Path, daemons: list[Daemon]) -> None:
    """`status` warns about a job that has run SILENT_JOB_S without stats.json: the process just
    started on the new GPU has run for well under a second, whatever the job's first start (kept:
    the job's runtime)."""
    d = new_daemon(daemons, tmp_path)
    m, _ = stranded_setup(d, tmp_path, restartable=True)
    first = d.storage.get_job(m)
    assert ticking(d, lambda d: m in d.jobs.live and d.storage.get_job(m).placement == (1,), m)
    record = d.storage.get_job(m)
    assert record.started_at == first.started_at and record.launched_at is not None
    assert record.launched_at - record.started_at >= 2.0  # the move waited for GPU 1 (about 3 s)
    view = d.status().gpu(1).job(m)
    assert view is not None and view.running_s is not None
    assert view.running_s <= d.clock() - record.launched_at < d.clock() - record.started_at - 2.0


def test_a_job_not_declared_restartable_is_never_moved(tmp_path: Path, daemons: list[Daemon]) -> None:
    d = new_daemon(daemons, tmp_path)
    m, f = stranded_setup(d, tmp_path, restartable=False)
    assert ticking(d, lambda d: d.storage.get_job(f).state is JobStatus.FINISHED, m)
    for _ in range(20):
        d.tick()
    assert "migrating" not in kinds(d, m)
    assert d.storage.get_job(m).placement == (0,) and d.jobs.book.jobs_on(1) == ()


@pytest.mark.parametrize("ignore_sigterm", [True, False], ids=["still-running", "already-ended"])
def test_a_migration_survives_a_daemon_restart(tmp_path: Path, daemons: list[Daemon], ignore_sigterm: bool) -> None:
    first = new_daemon(daemons, tmp_path)
    m, _ = stranded_setup(first, tmp_path, restartable=True, ignore_sigterm=ignore_sigterm)
    assert ticking(first, lambda d: "migrating" in kinds(d, m), m)
    # The daemon dies here (no further tick): the store says migrating, on GPU 1.
    record = first.storage.get_job(m)
    assert record.migrating and record.placement == (1,) and record.pid is not None
    if not ignore_sigterm:
        assert wait_for(lambda: wrappers(first, m) == 0)
    second = new_daemon(daemons, tmp_path)
    assert "migration_resumed" in kinds(second, m)
    # Still running: stopped again (it ignores SIGTERM: SIGKILL after jobs.cancel_grace_s).
    assert ticking(second, lambda d: m in d.jobs.live and d.storage.get_job(m).pid is not None, m)
    record = second.storage.get_job(m)
    assert record.state is JobStatus.RUNNING and record.placement == (1,) and not record.migrating
    assert wait_for(lambda: (tmp_path / "runs.log").read_text().split() == [m, m])
    assert wrappers(second, m) == 1


def test_an_opportunistic_job_waits_for_share_room_not_for_utilisation(tmp_path: Path,
                                                                       daemons: list[Daemon]) -> None:
    config = make_config(tmp_path, gpus=1)
    d = Daemon(config, SqliteStorage(config.db_path))
    daemons.append(d)
    big = d.submit(fake_command(steps=400, demand=100 * MIB), tenant="B", kind="opportunistic", env=JOB_ENV,
                   requested_share=0.7)
    d.tick()
    half = d.submit(fake_command(demand=100 * MIB), tenant="B", kind="opportunistic", env=JOB_ENV,
                    requested_share=0.5)
    # The GPU reads 0.3 (the fake job's achieved share) once the busy mark lifts, below M = 0.8:
    # placed by utilisation, `half` would start; 0.7 + 0.5 does not fit one GPU.
    assert wait_for(lambda: (d.tick(), 0 < d.jobs.book.gpus[0].utilisation < 0.8)[1], timeout=30)
    for _ in range(10):
        d.tick()
    assert d.storage.get_job(half).state is JobStatus.QUEUED
    small = d.submit(fake_command(demand=100 * MIB), tenant="B", kind="opportunistic", env=JOB_ENV,
                     requested_share=0.3)
    assert wait_for(lambda: (d.tick(), d.storage.get_job(small).state is JobStatus.RUNNING)[1], timeout=30)
    assert d.storage.get_job(half).state is JobStatus.QUEUED  # still no room for 0.5 next to 0.7 + 0.3
    assert wait_for(lambda: (d.tick(), d.storage.get_job(big).state.done)[1], timeout=30)
    assert wait_for(lambda: (d.tick(), d.storage.get_job(half).state is JobStatus.RUNNING)[1], timeout=30)


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5, float("nan"), True])
def test_a_bad_share_is_refused_naming_the_option(tmp_path: Path, share: object) -> None:
    d = Daemon(make_config(tmp_path, gpus=1), SqliteStorage(tmp_path / "db"))
    with pytest.raises(SubmitError, match=r"--share .* accepted a fraction of one GPU in \(0, 1\]"):
        d.submit(["true"], tenant="B", kind="opportunistic", requested_share=share)  # type: ignore[arg-type]


def test_a_job_stopped_to_be_requeued_is_not_moved(tmp_path: Path, daemons: list[Daemon]) -> None:
    """A restartable job marked to go back to its queue (jobs.misbehaviour = "requeue": its end is
    a requeue, Daemon.finish) is not picked for a migration, whose end would start it elsewhere."""
    d = new_daemon(daemons, tmp_path)
    m, f = stranded_setup(d, tmp_path, restartable=True)
    d.jobs.live[m].requeue = "misbehaving: impossible"  # as the job host marks it
    assert ticking(d, lambda d: d.storage.get_job(f).state is JobStatus.FINISHED, m)
    for _ in range(20):
        d.tick()
    assert "migrating" not in kinds(d, m)
    assert d.storage.get_job(m).placement == (0,)
