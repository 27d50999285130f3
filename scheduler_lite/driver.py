"""Everything between a policy decision and the world, shared by the daemon and the simulator.

The policies (scheduler_lite.policy) are pure: they read a snapshot and return decisions. What
happens next used to be written twice, once in the daemon and once in the simulator, and the two
copies drifted apart (the daemon stacked jobs on a GPU the simulator knew to be busy). This module
is the one copy. A `Driver` owns:

  * the `ClusterBook` and the global policy: `schedule(now)` runs a pass and applies it;
  * the settings in force per placed job (memory limit and compute share per GPU): the initial
    ones at launch (`Launch`) and every coordinator decision after (`round`);
  * the per-GPU `CoordinatorMemo`s and the coordinator's inputs (`local_job`): step samples,
    measured peak memory, and the solo step time measured while the job ran alone (the
    daemon's; the simulator builds its views from its model, sim/rounds.py);
  * busy marks: a GPU that received a job reads as fully used (utilisation 1.0) until a
    utilisation reading covers the job's running time (`observe_utilisation`). The policy
    places at most one opportunistic job per GPU per pass for the same reason; without the mark,
    the next pass saw the stale, idle reading and stacked another job there.

The world supplies time and readings and carries decisions out:

  =================  ====================================  ===================================
  step               daemon (scheduler_lite.daemon)        simulator (scheduler_lite.sim)
  =================  ====================================  ===================================
  jobs arrive        submissions from the store            trace arrivals
  readings           stats.json of each job, the devices   the performance model
  first step         first stats.json with a step          the start (the model steps at once)
  utilisation        average over utilisation_window_s     the model's, at each 10 s refresh
  carry out Launch   start the process with the settings   start integrating the job's progress
  carry out round    write control.json                    recompute the speeds
  plan migrations    restartable jobs (submit --restartable)  every job (the policy's choice)
  carry out migrate  SIGTERM, grace, start on the new GPUs  restart it there (+ checkpoint cost)
  memory held        universal memory: the limit in force  caching allocator model (`hold`)
  =================  ====================================  ===================================

A pass, in order: `run_pass(now, world)` (the policy's decisions applied to the book and the
settings, then handed to the world's `PassWorld` methods one by one in the policy's order: the one
decision loop of both worlds) -> for each `Launch` the world starts the job (or calls
`finish(job, failed=True)` if it cannot: the booking is released) -> `round(now, gpu, view)` for
the GPUs whose jobs changed or whose round is due -> the world applies the decisions.

What each world does with a decision of a pass (`PassWorld`):

  =========  ============================================  ====================================
  decision   daemon                                        simulator
  =========  ============================================  ====================================
  Place      book the launch (after the pass's records)    start the job (its progress)
  Preempt    nothing (no policy it runs preempts)          kill it: its work starts over
  Reserve    record a `reserved` event                     nothing
  Unreserve  record an `unreserved` event                  nothing
  Upgrade    record the role, write its control (share 1)  a guarantee job from now on
  Reject     the job fails (`rejected`)                    the job fails
  =========  ============================================  ====================================
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from scheduler_lite.frozen import quick_init
from scheduler_lite.model import (
    ClusterState,
    GlobalDecision,
    Gpu,
    GpuView,
    Job,
    LocalDecision,
    LocalJob,
    Place,
    Preempt,
    Reject,
    Reserve,
    Role,
    SetComputeShare,
    SetMemoryLimit,
    StepSample,
    Tenant,
    Unreserve,
    Upgrade,
)
from scheduler_lite.policy import coordinator
from scheduler_lite.policy.book import ClusterBook
from scheduler_lite.policy.coordinator import CoordinatorConfig, CoordinatorMemo
from scheduler_lite.policy.migration import Migrate, MigrationConfig, plan_migrations

SchedulePolicy = Callable[[ClusterState, object], list[GlobalDecision]]
BUSY: Final = 1.0  # what a GPU with a job not yet covered by a reading reads as
_EMPTY_MEMO: Final = CoordinatorMemo()


@dataclass(slots=True)
class Settings:
    """What a placed job runs with, per GPU: set at launch, then by the coordinator.

    The dicts are handed to the world by reference (`Launch.settings`): the simulator keeps them
    on its job and reads them without a lookup; the driver is the only writer.
    """

    limits: dict[int, int] = field(default_factory=dict)
    shares: dict[int, float] = field(default_factory=dict)


@quick_init  # one per placement: 21k in a 20k-job simulation
@dataclass(frozen=True, slots=True)
class Launch:
    """A Place the world must carry out, with the settings it starts with."""

    job_id: str
    gpus: tuple[int, ...]
    role: Role
    settings: Settings

    def memory_limit_bytes(self) -> int:
        return min(self.settings.limits.values())

    def compute_share(self) -> float:
        return min(self.settings.shares.values())


@dataclass(frozen=True, slots=True)
class Reading:
    """What the daemon read of one job on one GPU, for the coordinator (its measured peak memory
    and solo step time are the driver's: `observe_memory`, `observe_steps`)."""

    steps: tuple[StepSample, ...] = ()
    spill_bytes: int = 0


NO_READING: Final = Reading()


class PassWorld:
    """What a world does with each decision of a global pass (`Driver.run_pass`), after the
    driver applied it to the book and the settings: the table in this module's docstring. Each
    method does nothing here; a world overrides those it acts on."""

    def place(self, launch: Launch) -> None:
        """A Place, with the settings it starts with: the world starts the job."""

    def preempt(self, decision: Preempt) -> None:
        pass

    def reserve(self, decision: Reserve) -> None:
        pass

    def unreserve(self, decision: Unreserve) -> None:
        pass

    def upgrade(self, decision: Upgrade) -> None:
        """Its compute share is 1 now (the driver set it)."""

    def reject(self, decision: Reject) -> None:
        pass


class Driver:
    def __init__(
        self,
        gpus: Iterable[Gpu],
        tenants: Iterable[Tenant],
        *,
        policy: SchedulePolicy,
        scheduler_config: object,
        coordinator_config: CoordinatorConfig,
        universal_memory: bool = True,
        marks_busy: bool = True,
    ) -> None:
        self.book = ClusterBook(gpus, tenants)
        self.policy = policy
        self.scheduler_config = scheduler_config
        self.ccfg = coordinator_config
        # Without universal memory (YARN-CS, Gandiva) a job's limit is its demand: nothing spills.
        self.universal_memory = universal_memory
        # A policy that never reads utilisation (YARN-CS) needs no marks.
        self.marks_busy = marks_busy
        self.settings: dict[str, Settings] = {}
        self.memos: dict[int, CoordinatorMemo] = {}
        self._held: dict[int, dict[str, None]] = {}  # GPU -> jobs no reading covers yet
        self._first_step: dict[str, float] = {}
        self._changed_at: dict[int, float] = {}  # last time a job arrived on or left the GPU
        self._solo: dict[str, float] = {}  # measured step time alone, per job
        self._peak: dict[str, dict[int, int]] = {}  # measured peak memory per job and GPU

    # -- global passes -----------------------------------------------------------------------------

    def schedule(self, now: float) -> tuple[list[GlobalDecision], list[Launch]]:
        """One global pass, applied to the book; the launches the world must carry out."""
        decisions = self.policy(self.book.snapshot(now), self.scheduler_config)
        launches = []
        for d in decisions:
            self.book.apply(d)
            match d:
                case Place():
                    launches.append(self._place(d, now))
                case Upgrade():
                    # Its compute share is no longer the opportunistic level: the whole GPU.
                    for g in self.book.jobs[d.job_id].placement:
                        self.settings[d.job_id].shares[g] = 1.0
                case Preempt() | Reject():
                    self._release(d.job_id, now)
        return decisions, launches

    def run_pass(self, now: float, world: PassWorld) -> list[GlobalDecision]:
        """One global pass (`schedule`), its decisions handed to the world in the policy's order
        (a Place with its Launch); returns the decisions."""
        decisions, launches = self.schedule(now)
        starts = iter(launches)
        for d in decisions:
            # isinstance in the order of frequency: Places are most of a busy pass.
            if isinstance(d, Place):
                world.place(next(starts))
            elif isinstance(d, Preempt):
                world.preempt(d)
            elif isinstance(d, Reserve):
                world.reserve(d)
            elif isinstance(d, Unreserve):
                world.unreserve(d)
            elif isinstance(d, Upgrade):
                world.upgrade(d)
            elif isinstance(d, Reject):
                world.reject(d)
        return decisions

    def _place(self, d: Place, now: float) -> Launch:
        """Initial settings: the same rule the coordinator applies at its next round.

        A guarantee job keeps all but `min_memory_bytes` per job already on the GPU (the
        coordinator's arrival step shrinks those to that); an opportunistic job alone on a GPU
        gets all of it (what the coordinator gives it: nobody to protect); one next to others
        gets what they leave, but never less than `min_memory_bytes` nor more than its demand.
        The round that follows in the same pass settles the rest before the world starts the job.
        """
        demand = self.book.jobs[d.job_id].memory_demand_bytes
        floor = self.ccfg.min_memory_bytes
        settings = Settings()
        for g in d.gpus:
            mem = self.book.gpus[g].memory_bytes
            others = [j for j in self.book.jobs_on(g) if j != d.job_id]
            if not self.universal_memory:
                limit = demand
            elif d.role is Role.GUARANTEE:
                limit = min(demand, mem - len(others) * min(floor, mem // (len(others) + 1)))
            elif not others:
                limit = mem
            else:
                used = sum(self.settings[j].limits.get(g, 0) for j in others if j in self.settings)
                limit = min(demand, max(mem - used, min(floor, mem // (len(others) + 1))))
            settings.limits[g] = max(0, limit)
            settings.shares[g] = 1.0
            self._changed_at[g] = now
            if self.marks_busy:
                self._held.setdefault(g, {})[d.job_id] = None
                self.book.set_utilisation(g, BUSY)
        self.settings[d.job_id] = settings
        return Launch(d.job_id, d.gpus, d.role, settings)

    def set_demand(self, job_id: str, demand_bytes: int, held: Mapping[int, int] | None = None) -> None:
        """The job's memory demand changed (a surge). Without universal memory its limits become
        what its framework holds: `held` per GPU when the world knows it (the simulator's caching
        model, sim/interference.py), else the demand."""
        self.book.set_memory_demand(job_id, demand_bytes)
        if not self.universal_memory:
            if held is not None:
                self.hold(job_id, held)
            else:
                limits = self.settings[job_id].limits
                for g in limits:
                    limits[g] = demand_bytes

    def hold(self, job_id: str, held: Mapping[int, int]) -> None:
        """Without universal memory: the bytes the job's framework holds on each of its GPUs (its
        limit in effect; nothing caps it but the GPU). With universal memory the coordinator sets
        limits, and this is refused."""
        if self.universal_memory:
            raise ValueError(f"hold {job_id!r}: limits under universal memory are the coordinator's")
        limits = self.settings[job_id].limits
        for g, b in held.items():
            if g not in limits:
                raise ValueError(f"hold {job_id!r}: GPU {g} is not one of its GPUs {sorted(limits)}")
            limits[g] = b

    def stranded(self, job_ids: Iterable[str], below: float) -> dict[str, float]:
        """Of these jobs, the running opportunistic ones whose compute share (the smallest over
        their GPUs, as the coordinator set it) is below `below`: the migration policy's input."""
        out = {}
        for job_id in job_ids:
            job = self.book.jobs.get(job_id)
            settings = self.settings.get(job_id)
            if job is None or settings is None or job.role is not Role.OPPORTUNISTIC or not settings.shares:
                continue
            share = min(settings.shares.values())
            if share < below:
                out[job_id] = share
        return out

    def plan_migrations(self, now: float, low_shares: Mapping[str, float], config: MigrationConfig) -> list[Migrate]:
        """The migration policy on the book (policy/migration.py); carry each move out with `migrate`."""
        return plan_migrations(self.book.snapshot(now), low_shares, config)

    def migrate(self, move: Migrate, now: float) -> Launch:
        """Re-place a running job (policy/migration.py) on `move.gpus`: its settings on the old
        GPUs are released (their jobs changed) and it starts on the new ones as a new placement
        would. The world checkpoints it, stops it and starts it there."""
        job = self.book.jobs[move.job_id]
        role = job.role
        if role is None:
            raise ValueError(f"migrate {move.job_id!r}: not running")
        self.book.apply(move)
        self._release(move.job_id, now)
        return self._place(Place(move.job_id, move.gpus, role), now)

    def requeue(self, job_id: str, now: float) -> None:
        """The running job's process ended and it goes back to its queue (the daemon's
        `jobs.misbehaviour = "requeue"`): its GPUs and settings released, pending again in the
        book, as a Preempt leaves it."""
        self.book.apply(Preempt(job_id))
        self._release(job_id, now)

    def finish(self, job_id: str, now: float, failed: bool = False) -> None:
        """The job left (ended, failed, could not start): release its GPUs and settings."""
        self.book.finish(job_id, failed=failed)
        self._release(job_id, now)

    def _release(self, job_id: str, now: float) -> None:
        settings = self.settings.pop(job_id, None)
        for g in settings.limits if settings is not None else ():
            self._changed_at[g] = now
            held = self._held.get(g)
            if held is not None:
                held.pop(job_id, None)
        self._first_step.pop(job_id, None)
        self._solo.pop(job_id, None)
        self._peak.pop(job_id, None)

    # -- readings ----------------------------------------------------------------------------------

    def first_step(self, job_id: str, now: float) -> None:
        """The job made its first step at `now` (a utilisation reading can cover it from then)."""
        self._first_step.setdefault(job_id, now)

    def observe_utilisation(self, gpu: int, value: float, covers_since: float) -> bool:
        """A utilisation reading of the GPU over (covers_since, now]; True if the book changed.

        Jobs placed on the GPU whose first step was not strictly before `covers_since` keep it
        marked busy: the reading may hold samples from before they stepped.
        """
        held = self._held.get(gpu)
        if held:
            for job_id in [j for j in held if self._first_step.get(j, math.inf) < covers_since]:
                del held[job_id]
            if held:
                return False
        return self.book.set_utilisation(gpu, value)

    def held(self, gpu: int) -> tuple[str, ...]:
        return tuple(self._held.get(gpu, ()))

    def observe_memory(self, job_id: str, gpu: int, peak_bytes: int) -> None:
        """A measured peak (device + host) of the job on one GPU; the largest one counts."""
        peaks = self._peak.setdefault(job_id, {})
        if peak_bytes > peaks.get(gpu, -1):
            peaks[gpu] = peak_bytes

    def observe_steps(self, job_id: str, steps: Sequence[StepSample]) -> None:
        """Measure the solo step time from steps made while the job ran alone at full speed.

        Alone: the only job on each of its GPUs since its last change, share 1, and no memory in
        host (its limit covers its measured peak). The median of the last `detector_window`
        such steps is kept; a later alone period replaces it.
        """
        job = self.book.jobs.get(job_id)
        settings = self.settings.get(job_id)
        if job is None or settings is None or not job.placement:
            return
        since = -math.inf
        for g in job.placement:
            if self.book.jobs_on(g) != (job_id,) or settings.shares.get(g, 1.0) < 1.0:
                return
            if self._peak.get(job_id, {}).get(g, 0) > settings.limits.get(g, 0):
                return
            since = max(since, self._changed_at.get(g, -math.inf))
        recent = [s.seconds for s in steps if s.ended_at > since][-self.ccfg.detector_window :]
        if len(recent) >= self.ccfg.detector_window:
            self._solo[job_id] = statistics.median(recent)

    # -- coordinator -------------------------------------------------------------------------------

    def local_job(self, job_id: str, gpu: int, reading: Reading = NO_READING) -> LocalJob:
        job = self.book.jobs[job_id]
        settings = self.settings.get(job_id)
        limit = 0 if settings is None else settings.limits.get(gpu, 0)
        share = 1.0 if settings is None else settings.shares.get(gpu, 1.0)
        # The measured peak when there is one, else the demand the book holds (declared).
        demand = self._peak.get(job_id, {}).get(gpu, job.memory_demand_bytes)
        return LocalJob(job_id, job.role or Role.OPPORTUNISTIC, demand, limit, reading.spill_bytes, share,
                        reading.steps, self._solo.get(job_id))

    def view(self, gpu: int, readings: Mapping[str, Reading], unmanaged_bytes: int = 0) -> GpuView:
        """The coordinator's input for one GPU; `unmanaged_bytes`: device memory seen there that
        no job's limit controls (the daemon's NVML check), counted as taken."""
        return GpuView(self.book.gpus[gpu],
                       tuple(self.local_job(j, gpu, readings.get(j, NO_READING)) for j in self.book.jobs_on(gpu)),
                       unmanaged_bytes)

    def round(self, now: float, gpu: int, view: GpuView) -> list[LocalDecision]:
        """One coordinator round on the GPU; its decisions are applied to the settings."""
        if not view.jobs:
            # The coordinator's documented answer for a GPU without jobs: nothing, a fresh memo.
            self.memos.pop(gpu, None)
            return []
        decisions, self.memos[gpu] = coordinator.round(now, view, self.ccfg, self.memos.get(gpu, _EMPTY_MEMO))
        for d in decisions:
            settings = self.settings[d.job_id]
            if isinstance(d, SetMemoryLimit):
                settings.limits[d.gpu] = d.limit_bytes
            elif isinstance(d, SetComputeShare):
                settings.shares[d.gpu] = d.share
        return decisions

    def memo(self, gpu: int) -> CoordinatorMemo:
        return self.memos.get(gpu, _EMPTY_MEMO)

    def restore(self, job: Job, place: Place, settings: Settings, now: float) -> None:
        """A running job found again after a daemon restart, with the settings last recorded."""
        self.book.submit(job)
        self.book.apply(place)
        self.settings[job.id] = settings
        for g in place.gpus:
            self._changed_at[g] = now
            # Busy, as at a fresh placement, until a reading covers the job's steps: nothing is
            # known of it since the restart, and a job that never steps (`sleep`) left its GPU
            # reading idle, so every restart admitted one more opportunistic job next to it.
            if self.marks_busy:
                self._held.setdefault(g, {})[job.id] = None
                self.book.set_utilisation(g, BUSY)
