"""Discrete-event simulator: the driver's loop (scheduler_lite.driver) on a performance model.

Everything between a policy decision and the world (applying decisions to the book, launch
settings, busy marks, coordinator memos and settings) is the shared `Driver`, as in the daemon;
this module supplies time (events), readings (sim/perf.py) and the jobs' progress (their life on
the GPUs: sim/lifecycle.py).

After each batch of same-time events (sim/clock.py lists them) the global policy runs once on
the book's snapshot (when jobs are pending and something it reads changed), the local
coordinator runs on the GPUs whose jobs changed or whose round is due (sim/rounds.py), and the
speed of every job on a GPU that changed is recomputed from the performance model
(sim/speeds.py). Job progress is integrated between speed changes, so the cost of a run grows
with events, not with simulated time.
"""

from __future__ import annotations

import gc
import heapq
import sys
import time

from scheduler_lite.driver import Driver
from scheduler_lite.model import JobKind, Role
from scheduler_lite.policy import global_scheduler
from scheduler_lite.policy.baselines import yarn_cs_schedule
from scheduler_lite.policy.coordinator import CoordinatorConfig
from scheduler_lite.policy.registry import PolicySpec
from scheduler_lite.policy.validation import ConfigError, check_choice
from scheduler_lite.sim.clock import ARRIVE, PROGRESS, REFRESH, Clock
from scheduler_lite.sim.lifecycle import EARLY, FINISHED, PHASE, JobLifecycle
from scheduler_lite.sim.perf import PerfModel
from scheduler_lite.sim.result import ENGINE_WORK, SimResult, job_record, summarise
from scheduler_lite.sim.rounds import NOISE_CYCLE, NOISE_JOB_STRIDE, CoordinatorRounds, InvariantError
from scheduler_lite.sim.simjob import SimJob
from scheduler_lite.sim.speeds import JobSpeeds
from scheduler_lite.sim.workload import MAX_SUBMIT_TIME_S, TraceJob, Workload

ROUND_MODES = ("event", "periodic")


class Simulator:
    """The event loop and the global passes over four parts, each made here and handed what it
    uses: the clock (sim/clock.py), the coordinator rounds (sim/rounds.py), the job speeds
    (sim/speeds.py) and the jobs' lives on the GPUs (sim/lifecycle.py). Each part refers only to
    those made before it, never back to the simulator: no reference cycle (`simulate` says why)."""

    def __init__(
        self,
        workload: Workload,
        policy: PolicySpec,
        perf: PerfModel,
        *,
        seed: int = 0,
        progress: bool = False,
        check_invariants: bool = False,
        rounds: str = "event",
    ) -> None:
        check_choice("rounds", rounds, ROUND_MODES)
        for j in workload.jobs:  # workload.py says why arrivals have a bound
            if not 0.0 <= j.submit_time <= MAX_SUBMIT_TIME_S:
                raise ConfigError(f"job {j.id} submit_time", j.submit_time, f"a time in [0, {MAX_SUBMIT_TIME_S:g}] s")
        self.w = workload
        self.policy = policy
        self.perf = perf
        self.seed = seed
        self.progress = progress
        self.check = check_invariants
        reads_nothing = self.reads_nothing = policy.schedule is yarn_cs_schedule
        ccfg = CoordinatorConfig()  # the daemon's default
        self.driver = Driver(workload.gpus, workload.tenants, policy=policy.schedule,  # type: ignore[arg-type]
                             scheduler_config=policy.config.validate(), coordinator_config=ccfg,
                             universal_memory=policy.universal_memory, marks_busy=not reads_nothing)
        self.book = self.driver.book
        self.mem = {g.id: g.memory_bytes for g in workload.gpus}
        self.jobs: dict[str, SimJob] = {}  # by book id (changes on retry)
        self.all_jobs: list[SimJob] = []
        self.on_gpu: dict[int, dict[str, SimJob]] = {g: {} for g in self.mem}  # book order
        has_auto = self.has_auto = any(j.kind is JobKind.AUTO for j in workload.jobs)
        # Which utilisation refreshes (sim/clock.py) call for a pass (`_reads_util`; docs/simulator.md,
        # "Global passes"): tf-antman reads utilisation only to place opportunistic jobs (and time
        # only for auto jobs).
        self.reads_only_opportunistic = policy.schedule is global_scheduler.schedule and not has_auto
        self.counters = {"events": 0, "schedule_calls": 0, "rounds": 0, "decisions": 0, "migrations": 0,
                         "upgrades": 0}
        self.clock = Clock()
        self.rounds = CoordinatorRounds(self.clock, self.driver, on_gpu=self.on_gpu, jobs=self.jobs, mem=self.mem,
                                        periodic=rounds == "periodic", seed=seed,
                                        noise_cv=perf.step_noise_cv, counters=self.counters,
                                        migration=None if policy.migration is None else policy.migration.validate())
        self.speeds = JobSpeeds(self.clock, self.rounds, perf=perf, policy=policy, on_gpu=self.on_gpu)
        self.life = JobLifecycle(self.clock, self.driver, self.speeds, self.rounds, perf=perf, policy=policy,
                                 mem=self.mem, group={g.id: g.nvlink_group for g in workload.gpus}, jobs=self.jobs,
                                 on_gpu=self.on_gpu, counters=self.counters, stale_on_start=not reads_nothing)

    # -- driver ---------------------------------------------------------------------------------

    def run(self) -> SimResult:
        wall = time.perf_counter()
        total = len(self.w.jobs)
        clock = self.clock
        # Every arrival up front, numbered in trace order (the order of arrivals at one time).
        clock.heap = [(j.submit_time, i + 1, ARRIVE, i, 0) for i, j in enumerate(self.w.jobs)]
        heapq.heapify(clock.heap)
        clock.seq = total
        last_submit = max((j.submit_time for j in self.w.jobs), default=0.0)
        # The time series is sampled on a fixed grid, each point with the totals that held just
        # before it (the value between the last event before it and the first at or after it):
        # the same series whatever events in between changed nothing. About 400 points: the
        # grid spans the arrivals plus the time the cluster needs for all their work.
        work_s = sum(j.runtime_s * j.num_gpus for j in self.w.jobs) / max(1, len(self.mem))
        sample_every = max(1.0, (last_submit + work_s) / 400)
        timeseries: list[tuple[float, float, float, int]] = []
        samples = 0
        next_sample = 0.0
        mem_total = sum(self.mem.values())
        n_gpus = len(self.mem)
        done = 0
        report_every = max(1, total // 50)
        heap = clock.heap
        speeds, life, rounds_of = self.speeds, self.life, self.rounds
        round_version = clock.round_version
        heappop = heapq.heappop  # hoisted: ~60k events per 20k jobs
        sim_jobs, trace_jobs = self.jobs, self.w.jobs
        coordinated = self.policy.coordinated
        events = 0
        while heap:
            t = heap[0][0]
            clock.now = t
            while next_sample <= t:
                timeseries.append((next_sample, speeds.util_sum / n_gpus, speeds.mem_sum / mem_total,
                                        speeds.busy_gpus))
                samples += 1
                next_sample = samples * sample_every
            dirty: set[int] = set()
            life.dirty = dirty
            rounds: set[int] = set()
            need_schedule = False
            refreshed = False
            while heap and heap[0][0] <= t:
                _, _, kind, key, ver = heappop(heap)
                events += 1
                if kind == ARRIVE:
                    self._arrive(trace_jobs[key])  # type: ignore[index]
                    need_schedule = True
                elif kind == PROGRESS:
                    sj = sim_jobs.get(key)  # type: ignore[arg-type]
                    if sj is None or sj.version != ver or sj.state != "running":
                        continue
                    sj.due = None
                    outcome = life.progress(sj)
                    if outcome == EARLY or outcome == PHASE:
                        continue
                    need_schedule = True
                    if outcome == FINISHED:
                        done += 1
                        if self.progress and done % report_every == 0:
                            _bar(done, total)
                elif kind == REFRESH:
                    refreshed = self._refresh_utilisation()
                elif round_version.get(key) == ver:  # type: ignore[arg-type]
                    rounds.add(key)  # type: ignore[arg-type]
            if (need_schedule or (refreshed and self._reads_util())) and self._worth_a_pass():
                self._schedule()
            if rounds_of.low_shares and (need_schedule or refreshed):
                self._migrate()
            changed = dirty
            if life.phased:
                changed = dirty | life.phased
                life.phased = set()
            if coordinated and (dirty or rounds):
                if changed is dirty:
                    changed = set(dirty)  # a copy: `gpu in dirty` below must not see the additions
                for gpu in sorted(dirty | rounds if rounds else dirty):
                    if rounds_of.round(gpu, gpu in dirty):
                        changed.add(gpu)
            if changed:
                speeds.recompute(changed)
                if self.check:
                    self._check(changed)
        self.counters["events"] = events
        if self.progress:
            _bar(total, total)
            print(file=sys.stderr)
        return self._result(time.perf_counter() - wall, timeseries, sample_every)

    def _refresh_utilisation(self) -> bool:
        """Hand the book the utilisation of the GPUs that changed; True if any did."""
        clock = self.clock
        clock.refresh_at = None
        changed = False
        observe, util, now = self.driver.observe_utilisation, self.speeds.gpu_util, clock.now
        for g in sorted(clock.util_stale):
            # The model's utilisation is instantaneous: a reading at `now` covers now.
            if observe(g, util[g], now):
                changed = True
        clock.util_stale.clear()
        return changed

    def _worth_a_pass(self) -> bool:
        """Jobs pending, or running auto jobs an upgrade pass could promote (found by the
        daemon-equivalence test: without these, a finish freeing quota upgraded nothing unless
        some job was pending)."""
        return bool(self.book.pending_count()) or (
            self.has_auto and any(self.book.upgradable_jobs(t) for t in self.book.tenants))

    def _reads_util(self) -> bool:
        """Whether a pass after a utilisation refresh could decide something new."""
        if self.reads_nothing:
            return False
        return not self.reads_only_opportunistic or bool(self.book.pending_opportunistic_queue())

    # -- events ---------------------------------------------------------------------------------

    def _arrive(self, tj: TraceJob) -> None:
        base = (len(self.all_jobs) * NOISE_JOB_STRIDE) % NOISE_CYCLE
        sj = SimJob(tj, self.perf.models[tj.model], base)
        self.jobs[sj.book_id] = sj
        self.all_jobs.append(sj)
        self.book.submit(self.life.book_job(sj))

    # -- policies -------------------------------------------------------------------------------

    def _schedule(self) -> None:
        """Global passes until one starts no job that then fails (`JobLifecycle.fail` asks for
        another).

        Ends: each failure uses up one of a job's MAX_RETRIES + 1 attempts."""
        while True:
            self.life.repass = False
            self.counters["schedule_calls"] += 1
            self.counters["decisions"] += len(self.driver.run_pass(self.clock.now, self.life))
            if not (self.life.repass and self._worth_a_pass()):
                return

    def _migrate(self) -> None:
        """Re-place stranded opportunistic jobs (policy/migration.py); each pays a checkpoint-restart."""
        migration = self.rounds.migration
        assert migration is not None
        life = self.life
        life.repass = False
        now = self.clock.now
        moves = self.driver.plan_migrations(now, self.rounds.low_shares, migration)
        for m in moves:
            sj = self.jobs[m.job_id]
            self.speeds.settle(sj)
            launch = self.driver.migrate(m, now)
            life.leave(sj)
            # The restart redoes the work since the checkpoint (before start: it sets the phase).
            sj.remaining += self.perf.checkpoint_restart_s
            life.start(sj, launch)
            sj.migrations += 1
            self.counters["migrations"] += 1
        if life.repass and self._worth_a_pass():
            self._schedule()  # a restart failed (JobLifecycle.fail): its GPUs are free, the job may wait

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

    def _result(self, wall_s: float, timeseries: list[tuple[float, float, float, int]],
                sample_every: float) -> SimResult:
        records = [job_record(sj) for sj in self.all_jobs]
        first = min((j.submit_time for j in self.w.jobs), default=0.0)
        speeds = self.speeds
        summary, last = summarise(records, first, self.mem, (speeds.util_integral, speeds.mem_integral,
                                  speeds.busy_integral), self.counters, wall_s)
        # Stale heap entries (rounds of GPUs that emptied) run the clock past the last job:
        # the series ends at the first point after it.
        series = [p for p in timeseries if p[0] < last + sample_every]
        return SimResult(self.policy.name, self.w.name, self.seed, records, summary, series)


def _bar(done: int, total: int) -> None:
    width = 40
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} jobs")
    sys.stderr.flush()


def simulate(workload: Workload, policy: PolicySpec, perf: PerfModel, **kwargs: object) -> SimResult:
    """Run one policy over a workload; keyword arguments as `Simulator`.

    The cyclic garbage collector is paused for the run and restored after, even on error. A
    20k-job run allocates millions of short-lived objects (step samples, views, memos, book
    records) and creates no reference cycles (none left after the 20k run; test_sim_nogc.py
    checks a small one), but every 700 container allocations CPython's collector walks the young
    objects and, now and then, every object of the heap (568, 50 and 5 collections of generations
    0-2 per 20k run): all of that work found nothing. Reference counting still frees every object
    at once, so memory stays as it was (peak RSS 84 MiB either way on the 20k run); a cycle made
    by a caller meanwhile is collected once the collector runs again. Results do not depend on
    it: nothing in the simulator has a finaliser or a weak reference.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        return Simulator(workload, policy, perf, **kwargs).run()  # type: ignore[arg-type]
    finally:
        if enabled:
            gc.enable()


__all__ = ["ENGINE_WORK", "InvariantError", "SimResult", "Simulator", "simulate"]
