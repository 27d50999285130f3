"""The daemon through its job host seam (scheduler_lite.jobhost), with no process and no file.

`MemoryHost` is a whole job host in memory: what the daemon asks of it is recorded, what it
answers is what the test says. It shows what the seam promises: every touch of a job goes through
the host's verbs, and the host's word on its machines (what can never run, whether their size is
known, whether jobs may move) decides what the daemon does.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from scheduler_lite.daemon import Daemon
from scheduler_lite.devices import EmulatedDevices
from scheduler_lite.driver import Launch, SchedulePolicy
from scheduler_lite.jobhost import HostedJobs
from scheduler_lite.launcher import ExitInfo, ProcessHandle
from scheduler_lite.model import Gpu
from scheduler_lite.storage import JobRecord, JobStatus, MemoryStorage
from scheduler_lite.tick import JobTableView, LiveJob
from tests.scheduler.test_daemon_fakes import make_config
from tf_antman.protocol import Control, DeviceStats, Stats


class MemoryHost:
    migrates = True

    def __init__(self, devices: EmulatedDevices) -> None:
        self.devices = devices
        self.calls: list[tuple[str, str]] = []  # (verb, job id), in order
        self.exits: dict[str, ExitInfo] = {}  # job id -> its end, once the test ends it
        self.stats_by_job: dict[str, Stats] = {}
        self.controls: dict[str, Control] = {}
        self.refused: dict[str, str] = {}  # job id -> why it can never run here
        self.known = True
        self.jobs: HostedJobs | None = None
        self.table: JobTableView | None = None
        self.pids = iter(range(50_000, 60_000))

    # the jobs
    def prepare(self, launch: Launch, uid: int | None) -> Path:
        self.calls.append(("prepare", launch.job_id))
        return Path("/nowhere") / launch.job_id

    def start(self, launch: Launch, record: JobRecord, job_dir: Path, gpus: Sequence[Gpu]) -> ProcessHandle:
        self.calls.append(("start", record.id))
        assert [g.id for g in gpus] == list(launch.gpus)
        return ProcessHandle(next(self.pids), None, job_dir)

    def find(self, record: JobRecord, job_dir: Path) -> int | None:
        return None

    def adopt(self, record: JobRecord, pid: int, start_ticks: int | None, job_dir: Path) -> ProcessHandle | ExitInfo:
        return ProcessHandle(pid, start_ticks, job_dir)

    def poll(self, handle: ProcessHandle) -> ExitInfo | None:
        return self.exits.get(handle.job_dir.name)

    def signal(self, handle: ProcessHandle, sig: int) -> bool:
        self.calls.append((signal.Signals(sig).name, handle.job_dir.name))
        return True

    def stop(self, handle: ProcessHandle, grace_s: float) -> ExitInfo:
        return ExitInfo(-15)

    def cleanup(self, handle: ProcessHandle) -> None:
        self.calls.append(("cleanup", handle.job_dir.name))

    def kill_leftovers(self, record: JobRecord, job_dir: Path, pid: int | None, start: int | None) -> list[int]:
        return []

    def stats(self, job_id: str, live: LiveJob) -> Stats | None:
        return self.stats_by_job.get(job_id)

    def write_control(self, job_id: str, live: LiveJob, control: Control) -> None:
        self.controls[job_id] = control

    def recorded_exit(self, record: JobRecord, job_dir: Path) -> ExitInfo | None:
        return None

    def control_seq(self, record: JobRecord, job_dir: Path) -> int:
        return 0

    def read_log(self, record: JobRecord, stderr: bool, offset: int, limit: int) -> tuple[bytes, int]:
        return b"from the host", offset + 13

    # the machines
    def attach(self, jobs: HostedJobs, table: JobTableView) -> None:
        self.jobs, self.table = jobs, table

    def recover(self, running: Sequence[JobRecord], now: float) -> set[str]:
        return set()

    def refresh(self, now: float) -> None:
        pass

    def policy(self, base: SchedulePolicy) -> SchedulePolicy:
        return base

    def cannot_run(self, record: JobRecord) -> str | None:
        return self.refused.get(record.name)

    def size_known(self) -> bool:
        return self.known

    def absent(self) -> tuple[str, ...]:
        return () if self.known else ("n9",)

    def taken_bytes(self, gpu: int) -> int:
        return 0

    containment = None

    def findings(self) -> None:
        return None


def daemon(tmp_path: Path, here: int = 1) -> tuple[Daemon, MemoryHost]:
    """A daemon on a host whose machines have `here` of the config's 2 GPUs."""
    config = make_config(tmp_path, gpus=2)
    clock = [100.0]
    host = MemoryHost(EmulatedDevices(replace(config.devices, emulated=config.devices.emulated[:here])))
    return Daemon(config, MemoryStorage(), clock=lambda: clock[0], host=host), host


def running_stats(step: int, limit: int) -> Stats:
    return Stats(seq=step, pid=1, state="running", step=step, step_ms_window=(50.0,) * min(step, 8),
                 step_ms_median=50.0, devices=(DeviceStats(0, limit, 1 << 28, 1 << 28, 1 << 28, 1 << 28, 0, 0, 0),))


def test_a_job_runs_and_ends_through_the_host_verbs_only(tmp_path: Path) -> None:
    d, host = daemon(tmp_path)
    assert host.jobs is d and host.table is d.jobs  # attached before the daemon's recovery
    job = d.submit(["train"], tenant="A", kind="guarantee")
    report = d.tick()
    assert report.launched == (job,)
    assert host.calls == [("prepare", job), ("start", job)]  # prepared before the start, once
    host.stats_by_job[job] = running_stats(5, 1 << 30)
    d.tick()
    assert d.status().gpu(0).job(job).step == 5  # type: ignore[union-attr]  # the host's stats, as read
    assert d.host.read_log(d.job(job), False, 0, 100) == (b"from the host", 13)  # type: ignore[arg-type]
    d.cancel(job)
    d.tick()
    assert ("SIGTERM", job) in host.calls
    host.exits[job] = ExitInfo(-15)
    report = d.tick()
    assert report.ended == ((job, JobStatus.CANCELLED, -15),)
    assert host.calls[-1] == ("cleanup", job)


def test_the_host_says_what_can_never_run_and_when_a_job_must_wait_for_its_size(tmp_path: Path) -> None:
    d, host = daemon(tmp_path)
    host.refused["odd"] = "not on this host"
    odd = d.submit(["x"], tenant="A", kind="guarantee", name="odd")
    d.tick()
    assert d.job(odd).state is JobStatus.FAILED and d.job(odd).reason == "not on this host"  # type: ignore[union-attr]
    host.known = False  # a machine away: a job too big for the GPUs here waits for it
    big = d.submit(["x"], tenant="A", kind="guarantee", gpus=2)  # the config has 2: accepted
    d.tick()
    assert d.job(big).state is JobStatus.QUEUED  # type: ignore[union-attr]
    assert d.status().absent_nodes == ("n9",)
    host.known = True  # every machine here, and still one GPU: it can never run
    assert host.jobs is not None
    host.jobs.gpus_changed(list(d.jobs.gpus.values()), 200.0, size_known=True)
    assert d.job(big).state is JobStatus.FAILED  # type: ignore[union-attr]
    assert "needs 2 GPUs" in (d.job(big).reason or "")  # type: ignore[union-attr]


def test_a_job_lost_with_its_machine_is_released_and_recorded_by_the_daemon(tmp_path: Path) -> None:
    d, host = daemon(tmp_path)
    job = d.submit(["train"], tenant="A", kind="guarantee")
    d.tick()
    assert host.jobs is not None and host.table is not None and job in host.table.live
    lost = host.jobs.lose(job, 150.0)
    assert lost is not None and job not in host.table.live
    assert not d.jobs.book.jobs_on(0) and d.jobs.book.quota_used("A") == 0
    host.jobs.gpus_changed(list(d.jobs.gpus.values()), 150.0, size_known=True)  # the machine's GPUs went with it
    host.jobs.record_lost(job, 150.0, "node n9 lost", requeue=True)  # once nothing of it runs
    record = d.job(job)
    assert record is not None and record.state is JobStatus.QUEUED and record.launch_token is None
    assert [e.kind for e in d.storage.events(job)][-1] == "requeued"
    d.tick()  # picked up again and placed on the GPU it freed
    assert d.job(job).state is JobStatus.RUNNING  # type: ignore[union-attr]
    assert [c for c in host.calls if c[0] == "start"] == [("start", job), ("start", job)]
