"""The daemon's tick loop end to end, with fake jobs (real processes speaking the file protocol)."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler_lite import launcher
from scheduler_lite.config import Config, parse_config
from scheduler_lite.daemon import Daemon, StateDirLostError
from scheduler_lite.jobenv import job_environment
from scheduler_lite.launcher import EXIT_STATUS_FILE, ExitInfo, Launcher, LaunchSpec, ProcessHandle
from scheduler_lite.model import Place, Reject, Role, SetComputeShare, SetMemoryLimit
from scheduler_lite.state_dir import LOCK_FILE, lock_state_dir
from scheduler_lite.storage import JobStatus, SqliteStorage
from scheduler_lite.submission import make_job_spec, submit_once
from scheduler_lite.testing import run_until, stop_all_jobs
from tests.protocol.test_protocol_schema import stats_doc
from tests.scheduler.configs import scheduler_config
from tests.scheduler.test_daemon_fakes import (
    JOB_ENV,
    MIB,
    REPO,
    fake_command,
    make_config,
    wait_for,
)
from tf_antman.protocol import Control, MemoryLimit, control_path, parse_control, read_stats, write_control


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[list[Daemon]]:
    """Daemons made by a test; their jobs are stopped at the end whatever happened."""
    made: list[Daemon] = []
    yield made
    for d in made:
        stop_all_jobs(d, grace_s=1)


def new_daemon(made: list[Daemon], state: Path, clock=None, **sections: dict) -> Daemon:
    config = make_config(state, **sections)
    d = Daemon(config, SqliteStorage(config.db_path), **({"clock": clock} if clock else {}))
    made.append(d)
    return d


def steps_of(d: Daemon, job_id: str) -> int:
    job = d.status().gpu(0).job(job_id)
    return 0 if job is None or job.step is None else job.step


def test_guarantee_arrival_shrinks_the_opportunistic_job(tmp_path: Path, daemons: list[Daemon]) -> None:
    d = new_daemon(daemons, tmp_path)
    opp = d.submit(fake_command(demand=600 * MIB), tenant="B", kind="opportunistic", env=JOB_ENV)
    first = d.tick()
    assert first.picked_up == (opp,) and first.launched == (opp,)
    assert Place(opp, (0,), Role.OPPORTUNISTIC) in first.decisions
    assert run_until(d, lambda d: steps_of(d, opp) >= 3, timeout=20, interval=0.02)
    alone = d.status().gpu(0).job(opp)
    assert alone is not None and alone.memory_limit_bytes == 1 << 30 and alone.host_in_use_bytes == 0

    g = d.submit(fake_command(demand=512 * MIB), tenant="A", kind="guarantee", memory_bytes=512 * MIB, env=JOB_ENV)
    arrival = d.tick()
    assert Place(g, (0,), Role.GUARANTEE) in arrival.decisions
    min_memory = d.config.coordinator.min_memory_bytes
    assert SetMemoryLimit(opp, 0, min_memory, 1 << 30) in arrival.decisions
    assert SetComputeShare(opp, 0, d.config.coordinator.floor_share, 1.0) in arrival.decisions
    # The coordinator's decision is in the opportunistic job's control file...
    control = parse_control(control_path(d.job_dir(opp)).read_text())
    assert [(m.device, m.limit_bytes) for m in control.memory_limits] == [(0, min_memory)]
    assert control.compute_share == d.config.coordinator.floor_share
    # ...the job applied it (its stats report the new limit and the spill to host memory)...
    def shrunk(d: Daemon) -> bool:
        job = d.status().gpu(0).job(opp)
        return job is not None and job.in_use_bytes == min_memory
    assert run_until(d, shrunk, timeout=20, interval=0.02)
    # Status shows what the job reports in force: nothing for the guarantee job until its stats.
    assert run_until(d, lambda d: steps_of(d, g) >= 1, timeout=20, interval=0.02)
    view = d.status().gpu(0)
    o, gj = view.job(opp), view.job(g)
    assert o is not None and o.host_in_use_bytes == 600 * MIB - min_memory
    assert gj is not None and gj.role is Role.GUARANTEE and gj.memory_limit_bytes == 512 * MIB
    # ...and the store remembers the settings and the events.
    placements = {(p.job_id, p.gpu): p for p in d.storage.placements()}
    assert placements[(opp, 0)].memory_limit_bytes == min_memory
    kinds = [e.kind for e in d.storage.events(opp)]
    assert kinds[:2] == ["submitted", "launched"] and "memory_limit" in kinds and "compute_share" in kinds


def test_a_job_on_two_gpus_applies_the_coordinators_shrink(tmp_path: Path, daemons: list[Daemon]) -> None:
    """One process stands for both GPUs (ANTMAN_DEVICE_ID=0): it gets one limit, the tightest.
    A control naming device 1 as well was refused whole, so the guarantee job was not protected."""
    d = new_daemon(daemons, tmp_path, gpus=2)
    opp = d.submit(fake_command(demand=600 * MIB), tenant="B", kind="opportunistic", gpus=2, env=JOB_ENV)
    assert Place(opp, (0, 1), Role.OPPORTUNISTIC) in d.tick().decisions
    assert run_until(d, lambda d: steps_of(d, opp) >= 3, timeout=20, interval=0.02)
    g = d.submit(fake_command(demand=512 * MIB), tenant="A", kind="guarantee", memory_bytes=512 * MIB, env=JOB_ENV)
    arrival = d.tick()
    (placed,) = [x for x in arrival.decisions if isinstance(x, Place) and x.job_id == g]
    min_memory = d.config.coordinator.min_memory_bytes
    assert SetMemoryLimit(opp, placed.gpus[0], min_memory, 1 << 30) in arrival.decisions
    control = parse_control(control_path(d.job_dir(opp)).read_text())
    assert [(m.device, m.limit_bytes) for m in control.memory_limits] == [(0, min_memory)]

    def applied(d: Daemon) -> bool:
        stats = read_stats(d.job_dir(opp))
        return stats is not None and stats.control_seq_applied == control.seq
    assert run_until(d, applied, timeout=20, interval=0.02)
    stats = read_stats(d.job_dir(opp))
    assert stats is not None and stats.controls_rejected == 0
    assert stats.devices[0].limit_bytes == min_memory
    # The store keeps each GPU's own setting: the untouched GPU is not cut with the other.
    placements = {(p.job_id, p.gpu): p.memory_limit_bytes for p in d.storage.placements()}
    assert placements[(opp, placed.gpus[0])] == min_memory and placements[(opp, 1 - placed.gpus[0])] == 1 << 30


def test_restart_keeps_queued_readopts_running_and_keeps_finished(tmp_path: Path, daemons: list[Daemon]) -> None:
    d1 = new_daemon(daemons, tmp_path)
    ok = d1.submit(fake_command(steps=2), tenant="A", kind="guarantee", env=JOB_ENV)
    bad = d1.submit(fake_command(steps=2, exit_code=3), tenant="A", kind="guarantee", env=JOB_ENV)
    assert run_until(d1, lambda d: d.job(bad).state.done, timeout=30, interval=0.02)  # type: ignore[union-attr]
    running = d1.submit(fake_command(), tenant="A", kind="guarantee", env=JOB_ENV)
    queued = d1.submit(fake_command(), tenant="A", kind="guarantee", env=JOB_ENV)  # quota 1: waits
    assert run_until(d1, lambda d: steps_of(d, running) >= 2, timeout=20, interval=0.02)
    pid = d1.job(running).pid  # type: ignore[union-attr]
    d1.tick()
    daemons.remove(d1)  # the daemon "crashes": nothing is stopped, nothing more is written
    del d1

    d2 = new_daemon(daemons, tmp_path)
    assert [(j.id, j.exit_code) for j in d2.storage.list_jobs([JobStatus.FINISHED])] == [(ok, 0)]
    failed = d2.job(bad)
    assert failed is not None and failed.state is JobStatus.FAILED and failed.exit_code == 3
    assert d2.job(queued).state is JobStatus.QUEUED  # type: ignore[union-attr]
    assert d2.jobs.book.jobs[running].placement == (0,) and d2.jobs.book.jobs[running].role is Role.GUARANTEE
    report = d2.tick()
    assert report.launched == () and report.ended == ()  # the queued job still waits for quota
    assert d2.job(running).pid == pid  # type: ignore[union-attr]
    before = steps_of(d2, running)
    assert run_until(d2, lambda d: steps_of(d, running) > before, timeout=20, interval=0.02)  # still watched
    assert "adopted" in [e.kind for e in d2.storage.events(running)]

    d2.cancel(running)  # the re-adopted job can be stopped; its exit frees the quota for the queued one
    assert run_until(d2, lambda d: d.job(queued).state is JobStatus.RUNNING, timeout=20, interval=0.02)  # type: ignore[union-attr]
    cancelled = d2.job(running)
    assert cancelled is not None and cancelled.state is JobStatus.CANCELLED
    assert cancelled.exit_code == -signal.SIGTERM


# A job that checkpoints on SIGTERM: it notes the signal and exits 0 (`ignore`: it does not stop).
TRAPS_TERM = "trap '{action}' TERM; echo up > up; while :; do sleep 0.05; done"


def test_a_cancel_the_daemon_died_before_acting_on_still_sends_sigterm(tmp_path: Path, daemons: list[Daemon]) -> None:
    work = tmp_path / "work"
    work.mkdir()
    d1 = new_daemon(daemons, tmp_path / "state")
    job = d1.submit(["/bin/sh", "-c", TRAPS_TERM.format(action="echo TERM >> got; exit 0")], tenant="A",
                    kind="guarantee", workdir=work)
    d1.tick()
    assert wait_for(lambda: (work / "up").exists())
    d1.cancel(job)  # in the store; the daemon dies before a tick acts on it
    daemons.remove(d1)
    del d1

    d2 = new_daemon(daemons, tmp_path / "state")
    assert run_until(d2, lambda d: d.job(job).state.done, timeout=20, interval=0.02)  # type: ignore[union-attr]
    assert (work / "got").read_text() == "TERM\n"  # it could checkpoint: a SIGTERM, not a bare SIGKILL
    record = d2.job(job)
    assert record is not None and record.state is JobStatus.CANCELLED and record.exit_code == 0
    assert [e.detail["signal"] for e in d2.storage.events(job) if e.kind == "stopping"] == ["SIGTERM"]


def test_a_cancel_signalled_before_a_restart_keeps_its_grace_period(tmp_path: Path, daemons: list[Daemon]) -> None:
    work = tmp_path / "work"
    work.mkdir()
    d1 = new_daemon(daemons, tmp_path / "state")
    job = d1.submit(["/bin/sh", "-c", TRAPS_TERM.format(action="echo TERM >> got")], tenant="A", kind="guarantee",
                    workdir=work)
    d1.tick()
    assert wait_for(lambda: (work / "up").exists())
    d1.cancel(job)
    d1.tick()  # SIGTERM sent (the job ignores it); then the daemon dies
    assert wait_for(lambda: (work / "got").exists())
    daemons.remove(d1)
    del d1

    d2 = new_daemon(daemons, tmp_path / "state")
    assert run_until(d2, lambda d: d.job(job).state.done, timeout=20, interval=0.02)  # type: ignore[union-attr]
    assert (work / "got").read_text() == "TERM\n"  # not signalled twice
    record = d2.job(job)
    assert record is not None and record.state is JobStatus.CANCELLED and record.exit_code == -signal.SIGKILL
    assert [e.detail["signal"] for e in d2.storage.events(job) if e.kind == "stopping"] == ["SIGTERM", "SIGKILL"]


def test_a_job_on_a_gpu_no_longer_configured_is_stopped_for_good(tmp_path: Path, daemons: list[Daemon]) -> None:
    """It ignores SIGTERM: a restart with one GPU less must still end it (SIGKILL after the grace)
    and record how it ended, not leave it running unmanaged."""
    work = tmp_path / "work"
    work.mkdir()
    d1 = new_daemon(daemons, tmp_path / "state", gpus=2)
    job = d1.submit(["/bin/sh", "-c", TRAPS_TERM.format(action="")], tenant="A", kind="guarantee", gpus=2,
                    workdir=work)
    d1.tick()
    assert wait_for(lambda: (work / "up").exists())
    pid = d1.job(job).pid  # type: ignore[union-attr]
    daemons.remove(d1)
    del d1

    d2 = new_daemon(daemons, tmp_path / "state", gpus=1)
    record = d2.job(job)
    assert record is not None and record.state is JobStatus.FAILED and record.exit_code == -signal.SIGKILL
    assert "no longer configured" in (record.reason or "")
    assert pid is not None and not Path(f"/proc/{pid}").exists()  # ended, and reaped
    assert [e.detail["signal"] for e in d2.storage.events(job) if e.kind == "stopping"] == ["SIGTERM"]


def test_a_job_that_ends_while_the_daemon_is_down_keeps_its_status(tmp_path: Path, daemons: list[Daemon]) -> None:
    d1 = new_daemon(daemons, tmp_path)
    job = d1.submit(fake_command(steps=3, exit_code=4), tenant="A", kind="guarantee", env=JOB_ENV)
    d1.tick()
    job_dir = d1.job_dir(job)
    pid = d1.job(job).pid  # type: ignore[union-attr]
    assert pid is not None
    daemons.remove(d1)
    del d1
    assert wait_for(lambda: (job_dir / EXIT_STATUS_FILE).exists() and _ended(pid), timeout=20)
    d2 = new_daemon(daemons, tmp_path)
    record = d2.job(job)
    assert record is not None and record.state is JobStatus.FAILED and record.exit_code == 4
    assert "while the daemon was down" in (record.reason or "")
    assert job not in d2.jobs.book.jobs_on(0)


def test_a_bad_stats_file_is_logged_and_skipped(tmp_path: Path, daemons: list[Daemon]) -> None:
    d = new_daemon(daemons, tmp_path)
    writer = ("import os, time; p = os.path.join(os.environ['ANTMAN_JOB_DIR'], 'stats.json'); "
              "open(p, 'w').write('{\"schema\": \"tf-antman/stats\", \"version\": 99}'); time.sleep(60)")
    job = d.submit([sys.executable, "-c", writer], tenant="A", kind="guarantee")
    d.tick()
    assert wait_for(lambda: (d.job_dir(job) / "stats.json").exists())
    for _ in range(5):
        d.tick()  # must not raise
    errors = [e for e in d.storage.events(job) if e.kind == "stats_error"]
    assert len(errors) == 1 and "version" in errors[0].detail["error"]  # once, naming the field
    view = d.status().gpu(0).job(job)
    assert view is not None and view.stats_error is not None and view.step is None
    assert d.job(job).state is JobStatus.RUNNING  # type: ignore[union-attr]


def test_cancel_escalates_to_sigkill_after_the_grace_period_of_the_injected_clock(
        tmp_path: Path, daemons: list[Daemon]) -> None:
    now = [1000.0]
    d = new_daemon(daemons, tmp_path, clock=lambda: now[0])
    job = d.submit(fake_command(), tenant="A", kind="guarantee", env={**JOB_ENV, "FAKE_IGNORE_SIGTERM": "1"})
    d.tick()
    assert wait_for(lambda: (d.job_dir(job) / "stats.json").exists())
    d.cancel(job)
    d.tick()  # SIGTERM, which the job ignores
    assert [e.detail["signal"] for e in d.storage.events(job) if e.kind == "stopping"] == ["SIGTERM"]
    now[0] += d.config.jobs.cancel_grace_s - 0.5
    d.tick()
    assert d.job(job).state is JobStatus.RUNNING  # type: ignore[union-attr]
    now[0] += 1.0
    d.tick()  # past the grace period on the daemon's clock
    assert wait_for(lambda: d.tick().ended != () or d.job(job).state.done)  # type: ignore[union-attr]
    record = d.job(job)
    assert record is not None and record.state is JobStatus.CANCELLED and record.exit_code == -signal.SIGKILL
    assert record.ended_at == now[0]


def test_queued_cancel_and_launch_failure(tmp_path: Path, daemons: list[Daemon]) -> None:
    d = new_daemon(daemons, tmp_path)
    gone = tmp_path / "gone"
    gone.mkdir()
    doomed = d.submit(["true"], tenant="A", kind="guarantee", workdir=gone)
    gone.rmdir()
    waiting = d.submit(["true"], tenant="A", kind="guarantee")
    d.cancel(waiting)
    report = d.tick()
    assert (waiting, JobStatus.CANCELLED, None) in report.ended
    failed = d.job(doomed)
    assert failed is not None and failed.state is JobStatus.FAILED and "cannot start" in (failed.reason or "")
    assert d.jobs.book.jobs_on(0) == ()


def test_jobs_that_can_never_run_here_fail_once_with_the_reason(tmp_path: Path, daemons: list[Daemon]) -> None:
    """Jobs queued under an older, roomier config (three 1 GiB GPUs, tenant Z, A's quota 3) that the
    daemon restarted with one GPU less, half the memory and A's quota 1: each fails once, with its
    reason and a `rejected` event, whether found by recovery, at pick-up or by the global scheduler."""
    roomy = parse_config(scheduler_config(["1GiB"] * 3, {"A": 3, "B": 0, "Z": 1}, state_dir=str(tmp_path)),
                         base_dir=tmp_path)

    def queue(storage: SqliteStorage, **how: object) -> str:
        return submit_once(storage, make_job_spec(roomy, ["true"], **how))[0].id  # type: ignore[arg-type]

    old = SqliteStorage(roomy.db_path)
    gang = queue(old, tenant="B", kind="opportunistic", gpus=3)
    stranger = queue(old, tenant="Z", kind="opportunistic")
    old.close()
    d = new_daemon(daemons, tmp_path, gpus=2, memory="512MiB", quotas={"A": 1, "B": 0})
    big = queue(d.storage, tenant="B", kind="opportunistic", memory_bytes=1 << 30)
    wide = queue(d.storage, tenant="A", kind="guarantee", gpus=2)
    report = d.tick()
    reasons = {gang: "needs 3 GPUs; this machine has 2", stranger: "tenant 'Z' is not configured",
               big: "memory 1073741824 bytes is outside [1, 536870912] (the largest GPU)",
               wide: "needs 2 GPUs, quota is 1"}
    assert Reject(wide, reasons[wide]) in report.decisions and report.picked_up == (wide,)
    assert sorted(report.ended) == sorted((j, JobStatus.FAILED, None) for j in (big, wide))  # found this tick
    for job, reason in reasons.items():
        record = d.job(job)
        assert record is not None and record.state is JobStatus.FAILED and record.reason == reason
        assert record.pid is None and record.ended_at is not None
        assert [(e.kind, e.detail.get("reason")) for e in d.storage.events(job)][1:] == [("rejected", reason)]
    assert d.tick().ended == () and d.jobs.book.jobs_on(0) == () and d.jobs.book.jobs_on(1) == ()


def test_queued_jobs_of_a_tenant_removed_from_the_config_fail_while_its_running_job_runs_on(
        tmp_path: Path, daemons: list[Daemon]) -> None:
    """Tenant B is dropped from the config while one job of its runs and others wait. The running
    one is re-adopted (it keeps its GPU until it ends); the waiting ones must not run: each fails
    once with the reason any job of an unknown tenant gets."""
    d1 = new_daemon(daemons, tmp_path)
    running = d1.submit(fake_command(), tenant="B", kind="opportunistic", env=JOB_ENV)
    d1.tick()
    assert d1.job(running).state is JobStatus.RUNNING  # type: ignore[union-attr]
    waiting = [d1.submit(fake_command(), tenant="B", kind=kind, env=JOB_ENV) for kind in ("opportunistic", "auto")]
    daemons.remove(d1)  # the daemon stops before it picks them up
    del d1

    d2 = new_daemon(daemons, tmp_path, quotas={"A": 1})
    later = submit_once(d2.storage, make_job_spec(make_config(tmp_path), ["true"], tenant="B",  # an old CLI's
                                                  kind="opportunistic"))[0].id
    report = d2.tick()
    for job in [*waiting, later]:
        record = d2.job(job)
        assert record is not None and record.state is JobStatus.FAILED, job
        assert record.reason == "tenant 'B' is not configured" and record.started_at is None
    assert report.launched == () and d2.jobs.book.jobs_on(0) == (running,)
    assert d2.job(running).state is JobStatus.RUNNING and "adopted" in [e.kind for e in d2.storage.events(running)]  # type: ignore[union-attr]


def empty_cmdline_for(monkeypatch: pytest.MonkeyPatch, pid: int, reads: int | None) -> list[int]:
    """/proc/<pid>/cmdline reads empty, as the kernel shows it while the process is inside execve
    (after Popen has returned, before the new program's arguments are in place), for the first
    `reads` reads (None: for good). Returns the list the reads are counted in."""
    path, real, seen = Path(f"/proc/{pid}/cmdline"), Path.read_bytes, []

    def read_bytes(self: Path) -> bytes:
        if self == path:
            seen.append(1)
            if reads is None or len(seen) <= reads:
                return b""
        return real(self)
    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    return seen


def test_a_restart_while_the_jobs_wrapper_is_still_inside_execve_adopts_it(
        tmp_path: Path, daemons: list[Daemon], monkeypatch: pytest.MonkeyPatch) -> None:
    """A restart right after a launch may find the wrapper's command line still empty (a CI run
    on a loaded machine did: the test above). The job is the recorded pid and start time: the new
    daemon waits for its command line, then adopts it. Without the wait it took it for a reused
    pid: recorded it as failed ('exit status unknown') and SIGKILLed the live wrapper as the
    job's leftover."""
    d1 = new_daemon(daemons, tmp_path)
    job = d1.submit(fake_command(), tenant="A", kind="guarantee", env=JOB_ENV)
    d1.tick()
    pid = d1.job(job).pid  # type: ignore[union-attr]
    assert pid is not None
    daemons.remove(d1)
    del d1

    reads = empty_cmdline_for(monkeypatch, pid, reads=3)
    d2 = new_daemon(daemons, tmp_path)
    monkeypatch.undo()
    record = d2.job(job)
    assert record is not None and record.state is JobStatus.RUNNING and record.pid == pid, record
    assert len(reads) > 3  # it looked again until the command line was there
    assert d2.jobs.book.jobs_on(0) == (job,) and "adopted" in [e.kind for e in d2.storage.events(job)]
    assert d2.host.poll(d2.jobs.live[job].handle) is None  # alive: not killed as a leftover
    assert run_until(d2, lambda d: steps_of(d, job) >= 1, timeout=20, interval=0.02)  # and watched


def test_adopt_waits_for_a_command_line_only_so_long(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that never shows the launch's name (within launcher.EXEC_GRACE_S) is not the job."""
    job_dir = tmp_path / "job"
    handle = Launcher().start(LaunchSpec("job-1", ["sleep", "30"], tmp_path, dict(os.environ), job_dir, "t1"))
    try:
        monkeypatch.setattr(launcher, "EXEC_GRACE_S", 0.3)
        reads = empty_cmdline_for(monkeypatch, handle.pid, reads=None)
        assert Launcher().adopt(handle.pid, handle.start_ticks, job_dir, "t1", "job-1") == ExitInfo(None)
        assert len(reads) > 2  # it waited, then gave up
        monkeypatch.undo()
        assert isinstance(Launcher().adopt(handle.pid, handle.start_ticks, job_dir, "t1", "job-1"), ProcessHandle)
    finally:
        Launcher().stop(handle, grace_s=1)


def test_an_exit_status_above_128_is_recorded_as_an_exit_status(tmp_path: Path, daemons: list[Daemon]) -> None:
    """`exit 137` is not a SIGKILL: the record (and so `list`, `show`) says which one it was."""
    d = new_daemon(daemons, tmp_path)
    exited = d.submit(["/bin/sh", "-c", "exit 137"], tenant="A", kind="guarantee")
    killed = d.submit(["/bin/sh", "-c", "kill -KILL $$"], tenant="B", kind="opportunistic")
    assert run_until(d, lambda d: all(d.job(j).state.done for j in (exited, killed)),  # type: ignore[union-attr]
                       timeout=20, interval=0.02)
    records = [d.job(exited), d.job(killed)]
    assert [(r.state, r.exit_code, r.reason) for r in records if r is not None] == [
        (JobStatus.FAILED, 137, "exit status 137"), (JobStatus.FAILED, -signal.SIGKILL, "killed by SIGKILL")]


def test_serve_stops_when_its_lock_file_is_replaced(tmp_path: Path, daemons: list[Daemon],
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Another `serve` on a re-created state directory locks a new daemon.lock: this daemon no
    longer keeps others out. It stops as on SIGTERM (its job runs on) and says which file."""
    d = new_daemon(daemons, tmp_path)
    lock = tmp_path / LOCK_FILE
    held = lock_state_dir(tmp_path)
    job = d.submit(fake_command(), tenant="A", kind="guarantee", env=JOB_ENV)

    def replace_the_lock() -> None:
        if wait_for(lambda: (tmp_path / "jobs" / job / "stats.json").exists()):
            lock.unlink()
            lock.write_text("")  # a new inode: the old one is still open (held)
        time.sleep(10)
        d.stop()  # a daemon that did not notice: the test fails instead of hanging

    thread = threading.Thread(target=replace_the_lock, daemon=True)
    thread.start()
    try:
        with pytest.raises(StateDirLostError) as lost:
            d.serve()
    finally:
        os.close(held)
    assert lost.value.filename == str(lock)
    assert any(r.levelname == "ERROR" and str(lock) in r.getMessage() for r in caplog.records)
    assert d.job(job).state is JobStatus.RUNNING and job in d.jobs.live  # type: ignore[union-attr]
    assert d.host.poll(d.jobs.live[job].handle) is None  # not stopped


def test_run_until_gives_up_after_the_timeout(tmp_path: Path, daemons: list[Daemon]) -> None:
    d = new_daemon(daemons, tmp_path)
    assert run_until(d, lambda d: False, timeout=0.0) is False


def test_job_environment(tmp_path: Path) -> None:
    config = make_config(tmp_path, gpus=2)
    d = Daemon(config, SqliteStorage(config.db_path))
    job = d.storage.get_job(d.submit(["x"], tenant="B", kind="opportunistic", gpus=2, env={"ANTMAN_HOST_MEMORY": "1GiB", "K": "v"}))
    assert job is not None
    base = {"PATH": "/bin", "ANTMAN_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": "7", "SCHEDULER_LITE_GPUS": "9"}
    gpus = [d.jobs.gpus[1], d.jobs.gpus[0]]
    env = job_environment(config, job, gpus, 300 * MIB, 0.5, tmp_path / "jd", base)
    assert env == {
        "PATH": "/bin", "K": "v", "ANTMAN_HOST_MEMORY": "1GiB", "ANTMAN_JOB_DIR": str(tmp_path / "jd"),
        "ANTMAN_COMPUTE_SHARE": "0.5", "ANTMAN_DEVICE_MEMORY": str(1 << 30),
        "ANTMAN_MEMORY_LIMIT": str(300 * MIB), "SCHEDULER_LITE_JOB_ID": job.id, "SCHEDULER_LITE_GPUS": "1,0",
        "ANTMAN_DEVICE": "emulated", "ANTMAN_DEVICE_ID": "0",  # within the job, as the protocol numbers it
        "ANTMAN_DEVICE_PRIORITY": "low",  # an opportunistic job on an emulated device
    }
    nvml = config.__class__(**{**{f: getattr(config, f) for f in config.__dataclass_fields__},
                               "devices": config.devices.__class__("nvml")})
    env = job_environment(nvml, job, gpus, 0, 1.0, tmp_path, {})
    assert env["CUDA_VISIBLE_DEVICES"] == "1,0" and env["ANTMAN_DEVICE"] == "cuda"
    assert env["ANTMAN_MEMORY_LIMIT"] == str(MIB)  # never below tf-antman's accepted minimum
    assert "ANTMAN_DEVICE_PRIORITY" not in env  # not applied on cuda: the job is not told to


def test_nvml_indices_are_given_to_cuda_in_pci_bus_order(tmp_path: Path) -> None:
    """CUDA_VISIBLE_DEVICES holds NVML indices (PCI bus order); CUDA's own default is fastest
    first, which on a host with mixed GPU models names other GPUs than the ones placed."""
    config = make_config(tmp_path, gpus=2)
    nvml = dataclasses.replace(config, devices=dataclasses.replace(config.devices, kind="nvml"))
    d = Daemon(config, SqliteStorage(config.db_path))
    plain = d.storage.get_job(d.submit(["x"], tenant="A"))
    theirs = d.storage.get_job(d.submit(["x"], tenant="A", env={"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}))
    assert plain is not None and theirs is not None
    daemon_env = {"PATH": "/bin", "CUDA_DEVICE_ORDER": "FASTEST_FIRST"}
    for job, base in ((plain, {}), (plain, daemon_env), (theirs, {})):  # ours wins: the indices are ours
        env = job_environment(nvml, job, [d.jobs.gpus[1]], 300 * MIB, 1.0, tmp_path, base)
        assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    # Emulated devices set no CUDA_VISIBLE_DEVICES, so no order either; a job's own is left alone.
    assert "CUDA_DEVICE_ORDER" not in job_environment(config, plain, [d.jobs.gpus[1]], 300 * MIB, 1.0, tmp_path, {})
    env = job_environment(config, theirs, [d.jobs.gpus[1]], 300 * MIB, 1.0, tmp_path, {})
    assert "CUDA_VISIBLE_DEVICES" not in env and env["CUDA_DEVICE_ORDER"] == "FASTEST_FIRST"


def test_only_opportunistic_jobs_get_the_low_device_priority(tmp_path: Path) -> None:
    """`auto` jobs may be upgraded and an unprivileged process cannot leave SCHED_IDLE, so only
    `opportunistic` submissions run at low priority; `jobs.opportunistic_priority` turns it off."""
    config = make_config(tmp_path, gpus=1)
    d = Daemon(config, SqliteStorage(config.db_path))

    def priority(cfg: Config, kind: str) -> str | None:
        job = d.storage.get_job(d.submit(["x"], tenant="A", kind=kind))
        assert job is not None
        return job_environment(cfg, job, [d.jobs.gpus[0]], 300 * MIB, 0.5, tmp_path, {}).get("ANTMAN_DEVICE_PRIORITY")

    assert [priority(config, k) for k in ("opportunistic", "auto", "guarantee")] == ["low", None, None]
    normal = dataclasses.replace(config, jobs=dataclasses.replace(config.jobs, opportunistic_priority="normal"))
    assert priority(normal, "opportunistic") is None


def _ended(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return text[text.rindex(")") + 2] == "Z"  # a zombie: exited, not yet reaped


def test_a_real_job_on_the_second_gpu_takes_the_daemons_controls(tmp_path: Path) -> None:
    """The daemon addresses a job's devices from 0 (the protocol); a real tf-antman job started
    with the environment of emulated GPU 1 must accept that control (it refused it when the
    environment told it that it was device 1)."""
    config = make_config(tmp_path, gpus=2)
    d = Daemon(config, SqliteStorage(config.db_path))
    job = d.storage.get_job(d.submit(["x"], tenant="B", kind="opportunistic"))
    assert job is not None
    job_dir = tmp_path / "jd"
    job_dir.mkdir()
    env = job_environment(config, job, [d.jobs.gpus[1]], 300 * MIB, 1.0, job_dir)
    env.update(PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2", ANTMAN_STATS_INTERVAL_MS="20")
    code = ("import time, tensorflow as tf\n"
            "v = tf.Variable(tf.ones((64, 64)))\n"
            "for _ in range(4000):\n"
            "    v.assign(tf.matmul(v, v) * 1e-3); time.sleep(0.002)\n")
    p = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while (s := read_stats(job_dir)) is None or not s.devices:
            assert time.monotonic() < deadline and p.poll() is None, "the job never reported"
            time.sleep(0.05)
        assert s.devices[0].device == 0
        write_control(job_dir, Control(seq=1, memory_limits=(MemoryLimit(device=0, limit_bytes=64 * MIB),),
                                       compute_share=0.5))
        while (s := read_stats(job_dir)) is None or s.control_seq_applied != 1:
            assert s is None or s.last_rejected is None, s.last_rejected
            assert time.monotonic() < deadline, "the control was never applied"
            time.sleep(0.05)
        assert s.devices[0].limit_bytes == 64 * MIB and s.compute_share == 0.5
    finally:
        p.kill()
        p.wait()


def test_a_job_that_floods_bad_stats_gets_one_event_a_minute_clipped_and_escaped(
        tmp_path: Path, daemons: list[Daemon], caplog: pytest.LogCaptureFixture) -> None:
    # A security review: a new 250,000-character unknown key every 0.1 s grew root's store and
    # log by a megabyte a second, and a newline in the key forged lines in the daemon's log.
    now = [1000.0]
    d = new_daemon(daemons, tmp_path, clock=lambda: now[0])
    valid = stats_doc()  # a valid document, plus a new unknown key each time
    writer = ("import itertools, json, os, time\n"
              "p = os.path.join(os.environ['ANTMAN_JOB_DIR'], 'stats.json')\n"
              f"doc = json.loads({valid!r})\n"
              "for i in itertools.count():\n"
              "    bad = dict(doc, **{'%d x\\n2026-01-01 00:00:00,000 ERROR forged' % i + 'y' * 5000: 1})\n"
              "    open(p + '.tmp', 'w').write(json.dumps(bad))\n"
              "    os.replace(p + '.tmp', p)\n"
              "    time.sleep(0.02)\n")
    job = d.submit([sys.executable, "-c", writer], tenant="A", kind="guarantee")
    d.tick()
    stats = d.job_dir(job) / "stats.json"
    assert wait_for(stats.exists, timeout=60)

    def tick_on_a_new_key() -> None:
        # A new key each tick: wait for the writer's next document, whatever the machine's load
        # (a fixed pause let a descheduled writer leave the last tick the same key, so no event).
        seen = stats.read_bytes()  # the document the previous tick read, or a later one
        assert wait_for(lambda: stats.read_bytes() != seen, timeout=60)
        d.tick()

    with caplog.at_level("WARNING", logger="scheduler_lite"):
        for _ in range(10):
            now[0] += 1.0
            tick_on_a_new_key()
        first = [e for e in d.storage.events(job) if e.kind == "stats_error"]
        now[0] += 61.0
        tick_on_a_new_key()
    errors = [e for e in d.storage.events(job) if e.kind == "stats_error"]
    assert len(first) == 1 and len(errors) == 2
    assert all(len(e.detail["error"]) <= 300 for e in errors)
    refused = [r.getMessage() for r in caplog.records if "stats.json refused" in r.getMessage()]
    assert len(refused) == 2 and not any("\n" in m for m in refused)


def test_the_lock_file_is_never_opened_through_a_link(tmp_path: Path) -> None:
    # root truncates and writes daemon.lock: a link planted in its place would aim that anywhere.
    target = tmp_path / "precious"
    target.write_text("keep me")
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / LOCK_FILE).symlink_to(target)
    with pytest.raises(OSError):
        lock_state_dir(tmp_path / "state")
    assert target.read_text() == "keep me"
