"""The daemon's exchange with its running jobs: their stats read, their controls written.

Steps 3 and 5 of a tick (scheduler_lite.daemon): `observe` reads every running job's stats.json
and hands what it says to the driver (step samples, peak memory, solo step time, remaining time)
with the GPUs' utilisation; `coordinate` runs the coordinator's rounds and writes the changed
settings into the running jobs' control.json files (`write_control`, which the schedule step
also calls when a job is upgraded).

`JobControls` works on the daemon's job table (scheduler_lite.tick) through its job host
(scheduler_lite.jobhost), which reads the stats and writes the controls on this machine or on
the job's nodes; it keeps its own state: the GPUs' utilisation window and each GPU's last round.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from typing import TYPE_CHECKING

from scheduler_lite.devices import JobLoad, job_load
from scheduler_lite.driver import Reading
from scheduler_lite.faults import Faults
from scheduler_lite.jobhost import JobHost
from scheduler_lite.model import Role, SetComputeShare, SetMemoryLimit, StepSample
from scheduler_lite.storage import Storage
from scheduler_lite.tick import ControlWrite, JobTable, LiveJob, TickLog
from tf_antman.protocol import Control, MemoryLimit, ProtocolError, clip_text

if TYPE_CHECKING:
    from scheduler_lite.config import Config

log = logging.getLogger("scheduler_lite")

STATS_ERROR_EVERY_S = 60.0  # a job's refused stats.json: one event (and log line) a minute at most
STATS_ERROR_MAX_CHARS = 300  # of the message kept (status shows the latest)


class JobControls:
    """Steps 3 and 5 of the daemon's tick, on its job table."""

    def __init__(self, config: Config, storage: Storage, host: JobHost, table: JobTable, faults: Faults) -> None:
        self.config = config
        self.storage = storage
        self.host = host
        self.table = table
        self.faults = faults
        self.util_samples: dict[int, deque[tuple[float, float]]] = {g: deque() for g in table.gpus}
        self.round_sig: dict[int, tuple[tuple[str, Role], ...]] = {}
        self.last_round: dict[int, float] = {}

    def gpus_changed(self) -> None:
        """The table's GPUs changed (a cluster's node lost or joined): windows kept for the GPUs
        still here, every GPU's next round due."""
        self.util_samples = {g: self.util_samples.get(g, deque()) for g in self.table.gpus}
        self.round_sig = {}

    # -- 3. observe -------------------------------------------------------------------------------

    def observe(self, now: float) -> None:
        window = self.config.daemon.utilisation_window_s
        loads: dict[int, list[JobLoad]] = {g: [] for g in self.table.gpus}
        for job_id, live in self.table.live.items():
            self.faults.at("observe")
            self._read_stats(job_id, live, now)
            stepping = now - live.last_progress_at <= window
            for gpu in live.record.placement:
                loads[gpu].append(job_load(live.stats, stepping))
        readings = self.host.devices.utilisation(loads)
        for gpu, samples in self.util_samples.items():
            samples.append((now, readings.get(gpu, 0.0)))
            while samples and samples[0][0] < now - window:
                samples.popleft()
            average = statistics.fmean(u for _, u in samples)
            self.table.driver.observe_utilisation(gpu, round(average, 6), now - window)

    def _read_stats(self, job_id: str, live: LiveJob, now: float) -> None:
        try:
            stats = self.host.stats(job_id, live)
        except (ProtocolError, OSError) as e:
            # The job's user writes the file: what it says is clipped, and logged escaped (a
            # newline or terminal escape in a key forged lines in the daemon's log).
            message = clip_text(str(e), STATS_ERROR_MAX_CHARS)
            # Once per distinct problem, and at most one a minute: a job writing a new bad key
            # each tick grew root's store and log by a megabyte a second.
            if message != live.stats_error and now - live.stats_error_noted_at >= STATS_ERROR_EVERY_S:
                log.warning("%s: stats.json refused, keeping the last good one: %r", job_id, message)
                self.storage.add_event(now, "stats_error", job_id, error=message)
                live.stats_error_noted_at = now
            live.stats_error = message
            return
        live.stats_error = None
        if stats is None or (live.stats is not None and stats.seq == live.stats.seq):
            return
        new = stats.step - live.last_step if live.last_step is not None else min(stats.step, len(stats.step_ms_window))
        if new > 0 and stats.step_ms_window:
            # The daemon's clock, not the job's: samples are compared with the coordinator's `now`.
            # Steps first seen now ended by now: a decision taken at this tick excludes them.
            for ms in stats.step_ms_window[-min(new, len(stats.step_ms_window)):]:
                live.samples.append(StepSample(now, ms / 1000.0))
            live.last_progress_at = now
        if stats.step > 0:
            self.table.driver.first_step(job_id, now)
        live.last_step = stats.step
        live.stats = stats
        for gpu in live.record.placement:
            device = live.device_stats(gpu)
            if device is not None:
                self.table.driver.observe_memory(job_id, gpu, device.step_peak_bytes + device.host_in_use_bytes)
        self.table.driver.observe_steps(job_id, live.samples)
        # The remaining run time, from what the job gave at submission and its measured step rate:
        # (steps left) x (median step time), else what is left of the duration asked for, else
        # None (the policy assumes its default).
        step_s = None if stats.step_ms_median is None else stats.step_ms_median / 1000.0
        record, remaining = live.record, None
        if record.expected_steps is not None and step_s is not None:
            remaining = max(0.0, (record.expected_steps - stats.step) * step_s)
        elif record.expected_duration_s is not None:
            running_s = now - (record.started_at if record.started_at is not None else now)
            remaining = max(0.0, record.expected_duration_s - running_s)
        self.table.book.update_hints(job_id, mean_step_time_s=step_s, estimated_remaining_s=remaining)

    # -- 5. coordinate ----------------------------------------------------------------------------

    def coordinate(self, now: float, out: TickLog) -> None:
        interval = self.config.coordinator.round_interval_s
        for gpu in self.table.gpus:
            ids = self.table.book.jobs_on(gpu)
            sig = tuple((j, self.table.book.jobs[j].role or Role.OPPORTUNISTIC) for j in ids)
            memo = self.table.driver.memo(gpu)
            changed = sig != self.round_sig.get(gpu)
            due = bool(ids) and (
                now - self.last_round.get(gpu, -math.inf) >= interval
                or (memo.next_round_at is not None and now >= memo.next_round_at)
            )
            if not (changed or due):
                continue
            view = self.table.driver.view(gpu, {j: self._reading(j, gpu) for j in ids}, self.host.taken_bytes(gpu))
            decisions = self.table.driver.round(now, gpu, view)
            self.round_sig[gpu] = sig
            self.last_round[gpu] = now
            touched: dict[str, None] = {}
            for d in decisions:
                out.decisions.append(d)
                if d.job_id not in self.table.live:
                    continue  # booked, not started: it starts with these settings
                match d:
                    case SetMemoryLimit():
                        self.storage.add_event(now, "memory_limit", d.job_id, gpu=d.gpu, limit_bytes=d.limit_bytes,
                                               previous_bytes=d.previous_bytes)
                    case SetComputeShare():
                        self.storage.add_event(now, "compute_share", d.job_id, gpu=d.gpu, share=d.share,
                                               previous=d.previous)
                touched[d.job_id] = None
            for job_id in touched:  # in decision order: shrinks before grows
                self.write_control(job_id, now, out)
                self.faults.at("control")

    def _reading(self, job_id: str, gpu: int) -> Reading:
        live = self.table.live.get(job_id)
        if live is None:
            return Reading()
        device = live.device_stats(gpu)
        return Reading(steps=tuple(live.samples), spill_bytes=0 if device is None else device.host_in_use_bytes)

    def write_control(self, job_id: str, now: float, out: TickLog) -> None:
        live = self.table.live[job_id]
        placement = live.record.placement
        settings = self.table.driver.settings[job_id]
        control = Control(
            seq=live.control_seq + 1,
            memory_limits=tuple(MemoryLimit(i, settings.limits[g]) for i, g in enumerate(placement)),
            compute_share=min(settings.shares[g] for g in placement),
        )
        try:
            self.host.write_control(job_id, live, control)
        except OSError as e:
            log.warning("%s: cannot write control.json: %s", job_id, e)
            self.storage.add_event(now, "control_error", job_id, error=str(e))
            return
        live.control_seq = control.seq
        with self.storage.transaction():
            self.storage.update_job(job_id, control_seq=control.seq)
            for g in placement:
                self.storage.set_placement(job_id, g, settings.limits[g], settings.shares[g])
        out.controls.append(ControlWrite(job_id, control))
