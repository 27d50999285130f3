"""A simulated job's life on its GPUs: started by a placement, its progress events (finish,
memory surge, CPU-phase edge), a failure out of GPU memory (resubmitted once), its departure.

`JobLifecycle` is a part of `engine.Simulator`, handed the clock, the driver, the job speeds
(speeds.py) and the coordinator rounds (rounds.py) at construction. The engine decides when these
run (its event loop and global passes); this module what they do to the job, the driver and the
GPUs. It is also the simulator's world of a global pass (driver.py's table: `PassWorld`): what
the simulator does with each decision. Every change it makes to a GPU adds it to `dirty`, the
GPUs of the engine's current batch of events that the engine then recomputes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler_lite.driver import PassWorld
from scheduler_lite.model import Job, Preempt, Reject, Role, Upgrade
from scheduler_lite.sim.clock import work_tolerance
from scheduler_lite.sim.interference import cached_reservation, grow_cache, locality_factor
from scheduler_lite.sim.simjob import SimJob

if TYPE_CHECKING:
    from scheduler_lite.driver import Driver, Launch
    from scheduler_lite.policy.registry import PolicySpec
    from scheduler_lite.sim.clock import Clock
    from scheduler_lite.sim.perf import PerfModel
    from scheduler_lite.sim.rounds import CoordinatorRounds
    from scheduler_lite.sim.speeds import JobSpeeds

EARLY, CHANGED, FINISHED, PHASE = 0, 1, 2, 3  # outcome of a progress event
MAX_RETRIES = 1  # a job that ran out of memory is resubmitted once, with its peak as profile


class JobLifecycle(PassWorld):
    def __init__(self, clock: Clock, driver: Driver, speeds: JobSpeeds, rounds: CoordinatorRounds, *,
                 perf: PerfModel, policy: PolicySpec, mem: dict[int, int], group: dict[int, str],
                 jobs: dict[str, SimJob], on_gpu: dict[int, dict[str, SimJob]], counters: dict[str, int],
                 stale_on_start: bool) -> None:
        self.clock = clock
        self.driver = driver
        self.book = driver.book
        self.speeds = speeds
        self.rounds = rounds
        self.perf = perf
        self.policy = policy
        self.mem = mem
        self.group = group
        self.max_mem = max(mem.values(), default=0)
        self.jobs = jobs  # by book id (changes on retry)
        self.on_gpu = on_gpu  # book order
        self.counters = counters
        self.dirty: set[int] = set()  # the batch's: the engine sets a fresh one for each
        # The policy reads utilisation: a start makes its GPUs' readings stale.
        self.stale_on_start = stale_on_start
        # GPUs whose job entered or left a CPU phase in this batch of events: their speeds are
        # recomputed; the coordinator hears of it through the speeds (rounds.watch), as a daemon
        # would.
        self.phased: set[int] = set()
        self.repass = False  # a job failed inside a pass: run another (fail, Simulator._schedule)

    def book_job(self, sj: SimJob) -> Job:
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

    def progress(self, sj: SimJob) -> int:
        self.speeds.settle(sj)
        tj = sj.trace
        surge_pending = not sj.surged and tj.surge_at_fraction is not None
        target = tj.runtime_s * (1 - tj.surge_at_fraction) if surge_pending else 0.0  # type: ignore[operator]
        tolerance = work_tolerance(self.clock.now, sj.speed)
        if sj.remaining > target + tolerance:
            if tj.runtime_s - sj.remaining + tolerance >= sj.edge_at:
                was = sj.cpu
                self.speeds.set_phase(sj)
                if sj.cpu != was:
                    self.phased.update(sj.gpus)
                self.clock.reschedule(sj)
                return PHASE
            # The event was planned at a higher speed (see Clock.reschedule): not there yet.
            self.clock.reschedule(sj)
            return EARLY
        if surge_pending:
            for g in sj.gpus:
                self.rounds.catch_up(g, inclusive=False)
            sj.surged = True
            cap = min(self.mem[g] for g in sj.gpus)
            sj.demand = min(cap, int(sj.demand * (1 + tj.surge_growth)))
            self.dirty.update(sj.gpus)
            if self.policy.universal_memory:
                self.driver.set_demand(sj.book_id, sj.demand)
            else:
                held = self._grow_caches(sj)
                if held is None:
                    self.fail(sj)
                    return CHANGED
                # The book's demand is what a profile sees: the cache held (see _profile).
                self.driver.set_demand(sj.book_id, max(held.values()), held=held)
            self.clock.reschedule(sj)
            return CHANGED
        sj.remaining = 0.0
        self.driver.finish(sj.book_id, self.clock.now)
        self.leave(sj)
        sj.state = "finished"
        sj.end = self.clock.now
        return FINISHED

    def _grow_caches(self, sj: SimJob, fresh: bool = False) -> dict[int, int] | None:
        """What its caching allocator holds on each GPU at its current demand; None: OOM.

        `fresh`: the job is just starting and holds nothing yet (the driver's launch limit is the
        book's profile, an intention, not an allocation).
        """
        held = {}
        for g in sj.gpus:
            others = sum(o.limits.get(g, 0) for o in self.on_gpu[g].values() if o is not sj)
            own = 0 if fresh else sj.limits.get(g, 0)
            h = grow_cache(own, sj.demand, self.mem[g] - others - own)
            if h is None:
                return None
            held[g] = h
        return held

    def leave(self, sj: SimJob) -> None:
        self.dirty.update(sj.gpus)
        for g in sj.gpus:
            # Its deferred rounds would only have moved a memo that its departure resets.
            self.rounds.deferred.pop(g, None)
            del self.on_gpu[g][sj.book_id]
        sj.gpus = ()
        self.rounds.low_shares.pop(sj.book_id, None)
        sj.limits = {}  # the driver's settings were released with the job
        sj.shares = {}
        sj.gpu_speed.clear()
        sj.seen.clear()
        sj.speed = 0.0
        sj.version += 1
        sj.due = None

    def fail(self, sj: SimJob) -> None:
        """Out of GPU memory without universal memory: the job dies; resubmitted once."""
        self.driver.finish(sj.book_id, self.clock.now, failed=True)
        self.leave(sj)
        # Its GPUs are free and it may be pending again: another pass, as the daemon marks
        # itself dirty after a failed launch (Daemon._launch_failed). A failure at a progress
        # event is followed by the batch's pass anyway; one at a start inside a pass is not.
        self.repass = True
        sj.failures += 1
        if sj.failures > MAX_RETRIES:
            sj.state = "failed"
            sj.end = self.clock.now
            return
        sj.attempt += 1
        del self.jobs[sj.book_id]
        sj.book_id = f"{sj.trace.id}~{sj.attempt}"
        sj.remaining = sj.trace.runtime_s
        sj.state = "pending"
        self.jobs[sj.book_id] = sj
        self.book.submit(self.book_job(sj))  # profile now includes the surge: no second one

    def place(self, launch: Launch) -> None:
        self.start(self.jobs[launch.job_id], launch)

    def preempt(self, decision: Preempt) -> None:
        """Killed by a preemption: its work starts over when it is placed again."""
        sj = self.jobs[decision.job_id]
        self.speeds.settle(sj)
        self.leave(sj)
        sj.preemptions += 1
        sj.remaining = sj.trace.runtime_s
        sj.state = "pending"

    def upgrade(self, decision: Upgrade) -> None:
        self.counters["upgrades"] += 1
        sj = self.jobs[decision.job_id]
        sj.role = Role.GUARANTEE  # the driver set its shares to 1
        self.rounds.track_share(sj)
        self.dirty.update(sj.gpus)

    def reject(self, decision: Reject) -> None:
        sj = self.jobs[decision.job_id]
        sj.state = "failed"
        sj.end = self.clock.now

    def start(self, sj: SimJob, d: Launch) -> None:
        sj.state = "running"
        sj.role = d.role
        sj.gpus = d.gpus
        self.speeds.set_phase(sj)
        sj.last_t = self.clock.now
        sj.changed_at = self.clock.now
        if sj.first_start is None:
            sj.first_start = self.clock.now
        # The driver's settings, by reference: its rounds change them, JobSpeeds.recompute reads them.
        sj.limits = d.settings.limits
        sj.shares = d.settings.shares
        # The model steps from the start: a utilisation refresh after now covers the job, and
        # the driver's busy mark on its GPUs lasts until then.
        self.driver.first_step(sj.book_id, self.clock.now)
        for g in d.gpus:
            self.rounds.catch_up(g, inclusive=False)
            self.on_gpu[g][sj.book_id] = sj
            if self.stale_on_start:
                self.clock.stale(g)
        self.dirty.update(d.gpus)
        groups = len({self.group[g] for g in d.gpus})
        sj.locality = locality_factor(self.perf.cross_group_slowdown, groups)
        if not self.policy.universal_memory:
            held = self._grow_caches(sj, fresh=True)  # on_gpu already lists it: not its own co-runner
            if held is None:
                self.fail(sj)  # out of memory while initialising
                return
            self.driver.hold(sj.book_id, held)
