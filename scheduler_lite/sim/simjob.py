"""The simulator's record of one job: its trace entry, where it runs and how fast, its progress.

Mutable and slotted (one per job, touched on every event); the engine (sim/engine.py) and the
coordinator rounds (sim/rounds.py) read and write it. Policies never see it: they see the
book's frozen `Job` records and the `LocalJob` views built from it. Compared by identity (eq=False).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from scheduler_lite.model import LocalJob, Role, StepSample
from scheduler_lite.sim.perf import ModelPerf
from scheduler_lite.sim.workload import TraceJob


@dataclass(slots=True, eq=False)
class SimJob:
    trace: TraceJob
    perf: ModelPerf
    noise_base: int
    # From the trace (__post_init__); demand and remaining change as it runs.
    u: float = field(init=False)
    step: float = field(init=False)
    book_id: str = field(init=False)
    remaining: float = field(init=False)
    demand: int = field(init=False)
    attempt: int = 0
    speed: float = 0.0
    last_t: float = 0.0
    version: int = 0
    due: float | None = None  # time of its pending progress event
    cache: tuple[StepSample, ...] = ()
    cache_key: tuple[float, int] = (-1.0, -1)  # (now, epoch) the cached steps were drawn for
    epoch: int = 0  # speed changes so far: the step samples of each epoch are distinct
    surged: bool = False
    cpu: bool = False  # in a CPU-bound phase (trace.cpu_phases): u is 0, its speed its own
    edge_at: float = math.inf  # work done at its next phase edge (JobSpeeds.set_phase)
    first_start: float | None = None
    end: float | None = None
    failures: int = 0
    preemptions: int = 0
    state: str = "pending"
    changed_at: float = 0.0
    limits: dict[int, int] = field(default_factory=dict)
    shares: dict[int, float] = field(default_factory=dict)
    gpu_speed: dict[int, float] = field(default_factory=dict)
    seen: dict[int, LocalJob] = field(default_factory=dict)  # last step-less view of it per GPU, reused
    gpus: tuple[int, ...] = ()
    locality: float = 1.0  # speed factor of its placement (a gang over NVLink groups pays)
    migrations: int = 0
    role: Role | None = None
    busy_gpu_s: float = 0.0
    work_done: float = 0.0

    def __post_init__(self) -> None:
        trace = self.trace
        self.u = trace.utilisation
        self.step = trace.step_time_s
        self.book_id = trace.id
        self.remaining = trace.runtime_s
        self.demand = trace.memory_demand_bytes
