"""The simulator's record of one job: its trace entry, where it runs and how fast, its progress.

Mutable and slotted (one per job, touched on every event); the engine (sim/engine.py) and the
coordinator rounds (sim/rounds.py) read and write it. Policies never see it: they see the
book's frozen `Job` records and the `LocalJob` views built from it.
"""

from __future__ import annotations

import math

from scheduler_lite.model import LocalJob, Role, StepSample
from scheduler_lite.sim.perf import ModelPerf
from scheduler_lite.sim.workload import TraceJob


class SimJob:
    __slots__ = (
        "attempt",
        "book_id",
        "busy_gpu_s",
        "cache",
        "cache_key",
        "changed_at",
        "cpu",
        "demand",
        "due",
        "edge_at",
        "end",
        "epoch",
        "failures",
        "first_start",
        "gpu_speed",
        "gpus",
        "last_t",
        "limits",
        "locality",
        "migrations",
        "noise_base",
        "perf",
        "preemptions",
        "remaining",
        "role",
        "seen",
        "shares",
        "speed",
        "state",
        "step",
        "surged",
        "trace",
        "u",
        "version",
        "work_done",
    )

    def __init__(self, trace: TraceJob, perf: ModelPerf, noise_base: int) -> None:
        self.trace = trace
        self.perf = perf
        self.u = trace.utilisation
        self.step = trace.step_time_s
        self.noise_base = noise_base
        self.book_id = trace.id
        self.attempt = 0
        self.remaining = trace.runtime_s
        self.speed = 0.0
        self.last_t = 0.0
        self.version = 0
        self.due: float | None = None  # time of its pending progress event
        self.cache: tuple[StepSample, ...] = ()
        self.cache_key = (-1.0, -1)  # (now, epoch) the cached steps were drawn for
        self.epoch = 0  # speed changes so far: the step samples of each epoch are distinct
        self.demand = trace.memory_demand_bytes
        self.surged = False
        self.cpu = False  # in a CPU-bound phase (trace.cpu_phases): u is 0, its speed its own
        self.edge_at = math.inf  # work done at its next phase edge (Simulator._set_phase)
        self.first_start: float | None = None
        self.end: float | None = None
        self.failures = 0
        self.preemptions = 0
        self.state = "pending"
        self.changed_at = 0.0
        self.limits: dict[int, int] = {}
        self.shares: dict[int, float] = {}
        self.gpu_speed: dict[int, float] = {}
        self.seen: dict[int, LocalJob] = {}  # last step-less view of it per GPU, reused
        self.gpus: tuple[int, ...] = ()
        self.locality = 1.0  # speed factor of its placement (a gang over NVLink groups pays)
        self.migrations = 0
        self.role: Role | None = None
        self.busy_gpu_s = 0.0
        self.work_done = 0.0
