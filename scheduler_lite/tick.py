"""What one daemon tick reports, and what the daemon tracks of its jobs.

Shared by the daemon (scheduler_lite.daemon), its crash recovery (scheduler_lite.recovery), its
exchange with the running jobs (scheduler_lite.job_controls) and the job hosts
(scheduler_lite.jobhost, scheduler_lite.cluster.host).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Final, Protocol

from scheduler_lite.driver import Driver, Launch
from scheduler_lite.launcher import ProcessHandle
from scheduler_lite.model import Decision, Gpu, StepSample
from scheduler_lite.policy.book import ClusterBook
from scheduler_lite.policy.migration import Migrate
from scheduler_lite.storage import JobRecord, JobStatus
from tf_antman.protocol import Control, DeviceStats, Stats

STEP_HISTORY: Final = 256  # step samples kept per job: several detector windows


@dataclass(frozen=True, slots=True)
class ControlWrite:
    job_id: str
    control: Control


@dataclass(frozen=True, slots=True)
class TickReport:
    now: float
    picked_up: tuple[str, ...] = ()
    launched: tuple[str, ...] = ()
    ended: tuple[tuple[str, JobStatus, int | None], ...] = ()
    decisions: tuple[Decision, ...] = ()
    controls: tuple[ControlWrite, ...] = ()
    migrating: tuple[Migrate, ...] = ()  # moves decided this tick (the processes were sent SIGTERM)


@dataclass
class TickLog:
    """A tick's report while the tick runs (each step appends); `freeze` at its end."""

    now: float
    picked_up: list[str] = field(default_factory=list)
    launched: list[str] = field(default_factory=list)
    ended: list[tuple[str, JobStatus, int | None]] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    controls: list[ControlWrite] = field(default_factory=list)
    migrating: list[Migrate] = field(default_factory=list)

    def freeze(self) -> TickReport:
        # By name: TickReport's fields are TickLog's, frozen (their order may differ).
        return TickReport(now=self.now, **{f.name: tuple(getattr(self, f.name)) for f in fields(self)[1:]})


@dataclass
class LiveJob:
    """What the daemon tracks of one running job (its settings are the driver's)."""

    record: JobRecord
    handle: ProcessHandle
    job_dir: Path
    control_seq: int = 0
    stats: Stats | None = None
    stats_error: str | None = None
    stats_error_noted_at: float = -math.inf  # the last stats_error event (one a minute at most)
    last_step: int | None = None
    last_progress_at: float = -math.inf
    samples: deque[StepSample] = field(default_factory=lambda: deque(maxlen=STEP_HISTORY))
    stop_sent_at: float | None = None
    killed: bool = False
    # Set when it is stopped to be queued again (jobs.misbehaviour = "requeue"): why. Its end is
    # then a requeue, not an exit (Daemon.finish).
    requeue: str | None = None

    def device_stats(self, gpu: int) -> DeviceStats | None:
        """The job's last reported stats for one of its GPUs (by the GPU's index in its placement)."""
        if self.stats is None:
            return None
        index = self.record.placement.index(gpu)
        return next((d for d in self.stats.devices if d.device == index), None)


@dataclass
class JobTable:
    """What the daemon holds of its jobs between ticks; its recovery and its job controls work on
    the same table (each is handed it). The driver is replaced when a cluster's GPUs change."""

    driver: Driver
    gpus: dict[int, Gpu]
    live: dict[str, LiveJob] = field(default_factory=dict)
    # Migrations under way: the old process (stopping) and the launch that follows its end.
    stopping: dict[str, LiveJob] = field(default_factory=dict)
    moves: dict[str, Launch] = field(default_factory=dict)
    booked: list[Launch] = field(default_factory=list)  # booked this tick, started after the rounds

    @property
    def book(self) -> ClusterBook:
        return self.driver.book


class JobTableView(Protocol):
    """What of the daemon's job table a job host reads (`JobHost.attach`): read only; the host
    changes it through the daemon's verbs (jobhost.HostedJobs). `JobTable` is one."""

    @property
    def live(self) -> Mapping[str, LiveJob]: ...  # the running jobs

    @property
    def booked(self) -> Sequence[Launch]: ...  # the launches booked this tick, not started
