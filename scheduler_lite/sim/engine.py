"""Discrete-event simulator: the driver's loop (scheduler_lite.driver) on a performance model.

Everything between a policy decision and the world (applying decisions to the book, launch
settings, busy marks, coordinator memos and settings) is the shared `Driver`, as in the daemon;
this module supplies time (events), readings (sim/perf.py) and the jobs' progress (their life on
the GPUs: sim/lifecycle.py).

Events: job arrival, job progress (finish, memory surge, or the start or end of a CPU-bound
phase), coordinator round on one GPU.
After each batch of same-time events the global policy runs once on the book's snapshot (when
jobs are pending and something it reads changed), the local coordinator runs on the GPUs whose
jobs changed or whose round is due (see "coordinator rounds" below), and the speed of every job
on a GPU that changed is recomputed from the performance model (sim/speeds.py). Job progress is
integrated between speed changes, so the cost of a run grows with events, not with simulated
time.
"""

from __future__ import annotations

import heapq
import math
import random
import sys
import time
from collections.abc import Callable

from scheduler_lite.driver import Driver
from scheduler_lite.model import (
    Job,
    JobKind,
    Place,
    Preempt,
    Reject,
    Role,
    Upgrade,
)
from scheduler_lite.policy import global_scheduler
from scheduler_lite.policy.baselines import yarn_cs_schedule
from scheduler_lite.policy.coordinator import CoordinatorConfig
from scheduler_lite.policy.registry import PolicySpec
from scheduler_lite.policy.validation import ConfigError, check_choice
from scheduler_lite.sim.interference import cached_reservation
from scheduler_lite.sim.lifecycle import EARLY, FINISHED, PHASE, JobLifecycle, never_reads
from scheduler_lite.sim.nogc import collector_paused
from scheduler_lite.sim.perf import PerfModel
from scheduler_lite.sim.result import ENGINE_WORK, SimResult, job_record, summarise
from scheduler_lite.sim.rounds import NOISE_CYCLE, NOISE_JOB_STRIDE, CoordinatorRounds, InvariantError
from scheduler_lite.sim.simjob import SimJob
from scheduler_lite.sim.speeds import JobSpeeds, work_tolerance
from scheduler_lite.sim.workload import MAX_SUBMIT_TIME_S, TraceJob, Workload

ARRIVE, PROGRESS, ROUND, REFRESH = 0, 1, 2, 3
UTILISATION_REFRESH_S = 10.0  # the global policy's utilisation is a 10 s average (paper §3.3)
ROUND_MODES = ("event", "periodic")


def _always(sim: Simulator) -> bool:
    return True


class Simulator(JobLifecycle, JobSpeeds, CoordinatorRounds):
    def __init__(
        self,
        workload: Workload,
        policy: PolicySpec,
        perf: PerfModel,
        *,
        seed: int = 0,
        coordinator_config: CoordinatorConfig | None = None,
        progress: bool = False,
        check_invariants: bool = False,
        rounds: str = "event",
    ) -> None:
        check_choice("rounds", rounds, ROUND_MODES)
        _check_submit_times(workload)
        self.w = workload
        self.policy = policy
        self.perf = perf
        self.seed = seed
        self.ccfg = (coordinator_config or CoordinatorConfig()).validate()
        self.sched_cfg = policy.config.validate()
        self.progress = progress
        self.check = check_invariants
        self.periodic = rounds == "periodic"
        self.interval = self.ccfg.round_interval_s
        self.rng = random.Random(seed)
        # Step-time noise is drawn once from the seed and indexed by (job, speed epoch, step
        # number): a sample does not depend on when or how often a coordinator reads it, so
        # event-driven and periodic rounds see the same steps.
        cv = perf.step_noise_cv
        self.noise = [max(0.1, 1 + self.rng.gauss(0.0, cv)) for _ in range(NOISE_CYCLE)]
        reads_nothing = policy.schedule is yarn_cs_schedule
        self.driver = Driver(workload.gpus, workload.tenants, policy=policy.schedule,  # type: ignore[arg-type]
                             scheduler_config=self.sched_cfg, coordinator_config=self.ccfg,
                             universal_memory=policy.universal_memory, marks_busy=not reads_nothing)
        self.book = self.driver.book
        self.mem = {g.id: g.memory_bytes for g in workload.gpus}
        self.group = {g.id: g.nvlink_group for g in workload.gpus}
        self.max_mem = max(self.mem.values(), default=0)
        self.jobs: dict[str, SimJob] = {}  # by book id (changes on retry)
        self.all_jobs: list[SimJob] = []
        self.on_gpu: dict[int, dict[str, SimJob]] = {g: {} for g in self.mem}  # book order
        self.heap: list[tuple[float, int, int, object, int]] = []
        self.seq = 0
        self.round_version: dict[int, int] = {}
        self.round_at: dict[int, float | None] = {}
        self.anchor: dict[int, float] = {}  # time of the GPU's last change-driven round
        # Next round of a GPU whose only job's rounds decide nothing (`_alone`), run only if
        # something happens there before the job leaves (_catch_up).
        self.deferred: dict[int, float] = {}
        self.gpu_util = dict.fromkeys(self.mem, 0.0)
        self.gpu_mem = dict.fromkeys(self.mem, 0)
        self.util_sum = 0.0
        self.mem_sum = 0
        self.busy_gpus = 0
        self.gpu_busy = dict.fromkeys(self.mem, False)
        # Integrals of the three totals over time, advanced only when a total changes (to
        # `integrated_to`): events that change nothing (a round that decides nothing) do not
        # split the sums, so the figures do not depend on how many such events the engine runs.
        self.util_integral = 0.0
        self.mem_integral = 0.0
        self.busy_integral = 0.0
        self.integrated_to = 0.0
        self.now = 0.0
        # The global policy sees utilisation as the daemon does: refreshed every
        # UTILISATION_REFRESH_S (the paper's 10 s average), not the instant a share moves.
        # A pass runs on arrivals, finishes and surges, and after a refresh that changed a GPU
        # if the policy reads utilisation; other passes would decide the same as the last one.
        self.util_stale: set[int] = set()
        # GPUs whose job entered or left a CPU phase in this batch of events: their speeds are
        # recomputed; the coordinator hears of it through the speeds (_watch), as a daemon would.
        self.phased: set[int] = set()
        self.repass = False  # a job failed inside a pass: run another (_fail, _schedule)
        self.refresh_at: float | None = None
        has_auto = self.has_auto = any(j.kind is JobKind.AUTO for j in workload.jobs)
        # A function of the simulator, not a bound method: a simulator that refers to itself is a
        # reference cycle, and its whole state (millions of objects) would wait for the cyclic
        # collector after the run instead of being freed when the last reference goes.
        self.reads_util: Callable[[Simulator], bool]
        if reads_nothing:
            self.reads_util = never_reads
        elif policy.schedule is global_scheduler.schedule and not has_auto:
            # Utilisation is read only to place opportunistic jobs; time only for auto jobs.
            self.reads_util = Simulator._opportunistic_pending
        else:
            self.reads_util = _always
        self.counters = {"events": 0, "schedule_calls": 0, "rounds": 0, "decisions": 0, "migrations": 0,
                         "upgrades": 0}
        self.migration = policy.migration.validate() if policy.migration is not None else None
        # Running opportunistic jobs below the migration policy's stranded share (its input).
        self.low_shares: dict[str, float] = {}
        self.timeseries: list[tuple[float, float, float, int]] = []
        self.sample_every = 1.0

    # -- driver ---------------------------------------------------------------------------------

    def run(self) -> SimResult:
        wall = time.perf_counter()
        total = len(self.w.jobs)
        # Arrivals enter the heap one at a time, in (time, trace order), each with the sequence
        # number it would have had if all were pushed up front: the same order of events from
        # a heap that does not carry every future arrival (20k entries in the 20k-job run).
        arrivals = iter(sorted(range(total), key=lambda i: (self.w.jobs[i].submit_time, i)))
        self.seq = total
        first = next(arrivals, None)
        if first is not None:
            heapq.heappush(self.heap, (self.w.jobs[first].submit_time, first + 1, ARRIVE, first, 0))
        last_submit = max((j.submit_time for j in self.w.jobs), default=0.0)
        # The time series is sampled on a fixed grid, each point with the totals that held just
        # before it (the value between the last event before it and the first at or after it):
        # the same series whatever events in between changed nothing. About 400 points: the
        # grid spans the arrivals plus the time the cluster needs for all their work.
        work_s = sum(j.runtime_s * j.num_gpus for j in self.w.jobs) / max(1, len(self.mem))
        sample_every = self.sample_every = max(1.0, (last_submit + work_s) / 400)
        samples = 0
        next_sample = 0.0
        mem_total = sum(self.mem.values())
        n_gpus = len(self.mem)
        done = 0
        report_every = max(1, total // 50)
        heap = self.heap
        heappop, heappush = heapq.heappop, heapq.heappush  # hoisted: ~60k events per 20k jobs
        sim_jobs, trace_jobs = self.jobs, self.w.jobs
        coordinated = self.policy.coordinated
        events = 0
        while heap:
            t = heap[0][0]
            self.now = t
            while next_sample <= t:
                self.timeseries.append((next_sample, self.util_sum / n_gpus, self.mem_sum / mem_total,
                                        self.busy_gpus))
                samples += 1
                next_sample = samples * sample_every
            dirty: set[int] = set()
            rounds: set[int] = set()
            need_schedule = False
            refreshed = False
            while heap and heap[0][0] <= t:
                _, _, kind, key, ver = heappop(heap)
                events += 1
                if kind == ARRIVE:
                    self._arrive(trace_jobs[key])  # type: ignore[index]
                    need_schedule = True
                    after = next(arrivals, None)
                    if after is not None:
                        heappush(heap, (trace_jobs[after].submit_time, after + 1, ARRIVE, after, 0))
                elif kind == PROGRESS:
                    sj = sim_jobs.get(key)  # type: ignore[arg-type]
                    if sj is None or sj.version != ver or sj.state != "running":
                        continue
                    sj.due = None
                    outcome = self._progress(sj, dirty)
                    if outcome == EARLY or outcome == PHASE:
                        continue
                    need_schedule = True
                    if outcome == FINISHED:
                        done += 1
                        if self.progress and done % report_every == 0:
                            _bar(done, total)
                elif kind == REFRESH:
                    refreshed = self._refresh_utilisation()
                elif self.round_version.get(key) == ver:  # type: ignore[arg-type]
                    rounds.add(key)  # type: ignore[arg-type]
            if (need_schedule or (refreshed and self.reads_util(self))) and (
                self.book.pending_count() or self._upgradable()
            ):
                self._schedule(dirty)
            if self.low_shares and (need_schedule or refreshed):
                self._migrate(dirty)
            changed = dirty
            if self.phased:
                changed = dirty | self.phased
                self.phased = set()
            if coordinated and (dirty or rounds):
                if changed is dirty:
                    changed = set(dirty)  # a copy: `gpu in dirty` below must not see the additions
                for gpu in sorted(dirty | rounds if rounds else dirty):
                    if self._round(gpu, gpu in dirty):
                        changed.add(gpu)
            if changed:
                self._recompute(changed)
                if self.check:
                    self._check(changed)
        self.counters["events"] = events
        if self.progress:
            _bar(total, total)
            print(file=sys.stderr)
        return self._result(time.perf_counter() - wall)

    def _push(self, t: float, kind: int, key: object, ver: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, key, ver))

    def _stale(self, gpu: int) -> None:
        self.util_stale.add(gpu)
        if self.refresh_at is None:
            self.refresh_at = (math.floor(self.now / UTILISATION_REFRESH_S) + 1) * UTILISATION_REFRESH_S
            self._push(self.refresh_at, REFRESH, None, 0)

    def _refresh_utilisation(self) -> bool:
        """Hand the book the utilisation of the GPUs that changed; True if any did."""
        self.refresh_at = None
        changed = False
        observe, util, now = self.driver.observe_utilisation, self.gpu_util, self.now
        for g in sorted(self.util_stale):
            # The model's utilisation is instantaneous: a reading at `now` covers now.
            if observe(g, util[g], now):
                changed = True
        self.util_stale.clear()
        return changed

    def _upgradable(self) -> bool:
        """Running auto jobs an upgrade pass could promote (found by the daemon-equivalence test:
        without this, a finish freeing quota upgraded nothing unless some job was pending)."""
        return self.has_auto and any(self.book.upgradable_jobs(t) for t in self.book.tenants)

    def _opportunistic_pending(self) -> bool:
        return next(self.book.iter_pending_opportunistic(), None) is not None

    # -- events ---------------------------------------------------------------------------------

    def _arrive(self, tj: TraceJob) -> None:
        base = (len(self.all_jobs) * NOISE_JOB_STRIDE) % NOISE_CYCLE
        sj = SimJob(tj, self.perf.models[tj.model], base)
        self.jobs[sj.book_id] = sj
        self.all_jobs.append(sj)
        self.book.submit(self._book_job(sj))

    def _book_job(self, sj: SimJob) -> Job:
        tj = sj.trace
        return Job(id=sj.book_id, tenant=tj.tenant, num_gpus=tj.num_gpus, kind=tj.kind,
                   submit_time=tj.submit_time, memory_demand_bytes=self._profile(sj),
                   predicted_runtime_s=tj.predicted_runtime_s, requested_share=tj.requested_share)

    def _profile(self, sj: SimJob) -> int:
        """Memory the book commits for the job: without universal memory, what its framework's
        caching allocator holds (a profiling run sees that, not the tensors; interference.py)."""
        if self.policy.universal_memory:
            return sj.demand
        if sj.limits:
            return max(sj.limits.values())
        return min(cached_reservation(sj.demand), self.max_mem)



    # -- policies -------------------------------------------------------------------------------

    def _schedule(self, dirty: set[int]) -> None:
        """Global passes until one starts no job that then fails (`_fail` asks for another).

        Ends: each failure uses up one of a job's MAX_RETRIES + 1 attempts."""
        while True:
            self.repass = False
            self._pass(dirty)
            if not (self.repass and (self.book.pending_count() or self._upgradable())):
                return

    def _pass(self, dirty: set[int]) -> None:
        self.counters["schedule_calls"] += 1
        decisions, launches = self.driver.schedule(self.now)
        self.counters["decisions"] += len(decisions)
        starts = iter(launches)
        for d in decisions:
            if isinstance(d, Preempt):
                sj = self.jobs[d.job_id]
                self._settle(sj)
                self._leave(sj, dirty)
                sj.preemptions += 1
                sj.remaining = sj.trace.runtime_s  # killed: starts over
                sj.state = "pending"
                continue
            if isinstance(d, Place):
                self._start(self.jobs[d.job_id], next(starts), dirty)
            elif isinstance(d, Upgrade):
                self.counters["upgrades"] += 1
                sj = self.jobs[d.job_id]
                sj.role = Role.GUARANTEE  # the driver set its shares to 1
                self._track_share(sj)
                dirty.update(sj.gpus)
            elif isinstance(d, Reject):
                sj = self.jobs[d.job_id]
                sj.state = "failed"
                sj.end = self.now

    def _migrate(self, dirty: set[int]) -> None:
        """Re-place stranded opportunistic jobs (policy/migration.py); each pays a checkpoint-restart."""
        assert self.migration is not None
        self.repass = False
        moves = self.driver.plan_migrations(self.now, self.low_shares, self.migration)
        for m in moves:
            sj = self.jobs[m.job_id]
            self._settle(sj)
            launch = self.driver.migrate(m, self.now)
            self._leave(sj, dirty)
            # The restart redoes the work since the checkpoint (before _start: it sets the phase).
            sj.remaining += self.perf.checkpoint_restart_s
            self._start(sj, launch, dirty)
            sj.migrations += 1
            self.counters["migrations"] += 1
        if self.repass and (self.book.pending_count() or self._upgradable()):
            self._schedule(dirty)  # a restart failed (_fail): its GPUs are free, the job may wait

    # -- coordinator rounds (the rest: sim/rounds.py) ------------------------------------------

    def _set_round(self, gpu: int, at: float | None) -> None:
        ver = self.round_version.get(gpu, 0) + 1
        self.round_version[gpu] = ver
        self.round_at[gpu] = at
        if at is not None:
            self._push(at, ROUND, gpu, ver)

    # -- progress events (speeds: sim/speeds.py) -----------------------------------------------

    def _reschedule(self, sj: SimJob) -> None:
        """Plan the job's next progress event (finish or surge) at its current speed.

        A job that slowed down keeps its earlier event: it fires early and is planned again
        then. Speeds change at every coordinator round that moves a share, so this saves most
        of the events that would otherwise be pushed only to be discarded.
        """
        if sj.speed <= 0:
            sj.version += 1
            sj.due = None
            return
        target = sj.remaining
        tj = sj.trace
        if not sj.surged and tj.surge_at_fraction is not None:
            target = sj.remaining - tj.runtime_s * (1 - tj.surge_at_fraction)
        if sj.edge_at != math.inf:
            # Up to its next phase edge, or now if it reached one on the way to another event
            # (a surge at the same point came first).
            gap = sj.edge_at - (tj.runtime_s - sj.remaining)
            target = 0.0 if gap <= work_tolerance(self.now, sj.speed) else min(target, gap)
        at = self.now + max(0.0, target) / sj.speed
        if sj.due is not None and sj.due <= at:
            return
        sj.version += 1
        sj.due = at
        self._push(at, PROGRESS, sj.book_id, sj.version)

    # -- checks and results ---------------------------------------------------------------------

    def _check(self, gpus: set[int]) -> None:
        for g in gpus:
            sjs = [self.jobs[j] for j in self.book.jobs_on(g)]
            if [s.book_id for s in self.on_gpu[g].values()] != [s.book_id for s in sjs]:
                raise InvariantError(f"GPU {g}: simulator and book disagree on its jobs")
            holders = [s for s in sjs if s.role is Role.GUARANTEE]
            if len(holders) > 1:
                raise InvariantError(f"GPU {g}: {len(holders)} guarantee jobs")
            used = sum(s.limits.get(g, 0) for s in sjs)  # without universal memory: cache held
            if used > self.mem[g]:
                raise InvariantError(f"GPU {g}: {used} bytes committed of {self.mem[g]}")
            if self.policy.name.startswith("yarn") and len(sjs) > 1:
                raise InvariantError(f"GPU {g}: {len(sjs)} jobs under an exclusive policy")

    def _result(self, wall_s: float) -> SimResult:
        records = [job_record(sj) for sj in self.all_jobs]
        first = min((j.submit_time for j in self.w.jobs), default=0.0)
        summary, last = summarise(records, first, self.mem, (self.util_integral, self.mem_integral,
                                  self.busy_integral), self.counters, wall_s)
        # Stale heap entries (rounds of GPUs that emptied) run the clock past the last job:
        # the series ends at the first point after it.
        series = [p for p in self.timeseries if p[0] < last + self.sample_every]
        return SimResult(self.policy.name, self.w.name, self.seed, records, summary, series)


def _check_submit_times(workload: Workload) -> None:
    """Arrivals within [0, MAX_SUBMIT_TIME_S] (workload.py says why there is a bound)."""
    for j in workload.jobs:
        if not 0.0 <= j.submit_time <= MAX_SUBMIT_TIME_S:
            raise ConfigError(f"job {j.id} submit_time", j.submit_time, f"a time in [0, {MAX_SUBMIT_TIME_S:g}] s")


def _bar(done: int, total: int) -> None:
    width = 40
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} jobs")
    sys.stderr.flush()


def simulate(workload: Workload, policy: PolicySpec, perf: PerfModel, **kwargs: object) -> SimResult:
    """Run one policy over a workload; keyword arguments as `Simulator`."""
    with collector_paused():  # nogc.py: the collector's work found nothing to free
        return Simulator(workload, policy, perf, **kwargs).run()  # type: ignore[arg-type]


__all__ = ["ENGINE_WORK", "InvariantError", "SimResult", "Simulator", "simulate"]
