"""A simulated job's life on its GPUs: started by a placement, its progress events (finish,
memory surge, CPU-phase edge), a failure out of GPU memory (resubmitted once), its departure.

`JobLifecycle` is a part of `engine.Simulator`, as `JobSpeeds` (speeds.py) and
`CoordinatorRounds` (rounds.py) are (rounds.py says why a mixin: no reference cycle); it works on
the simulator's state declared below. The engine decides when these run (its event loop and
global passes); this module what they do to the job, the driver and the GPUs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from scheduler_lite.model import Job, Role
from scheduler_lite.sim.interference import grow_cache, locality_factor
from scheduler_lite.sim.simjob import SimJob
from scheduler_lite.sim.speeds import work_tolerance

if TYPE_CHECKING:
    from scheduler_lite.driver import Driver, Launch
    from scheduler_lite.policy.book import ClusterBook
    from scheduler_lite.policy.migration import MigrationConfig
    from scheduler_lite.policy.registry import PolicySpec
    from scheduler_lite.sim.perf import PerfModel

EARLY, CHANGED, FINISHED, PHASE = 0, 1, 2, 3  # outcome of a progress event
MAX_RETRIES = 1  # a job that ran out of memory is resubmitted once, with its peak as profile


def never_reads(sim: object) -> bool:
    """The simulator's `reads_util` for a policy that never reads utilisation."""
    return False


class JobLifecycle:
    # The simulator's state these methods read and change (set in Simulator.__init__).
    now: float
    perf: PerfModel
    policy: PolicySpec
    driver: Driver
    book: ClusterBook
    mem: dict[int, int]
    group: dict[int, str]
    jobs: dict[str, SimJob]
    on_gpu: dict[int, dict[str, SimJob]]
    deferred: dict[int, float]
    phased: set[int]
    low_shares: dict[str, float]
    migration: MigrationConfig | None
    repass: bool
    reads_util: Callable[..., bool]

    if TYPE_CHECKING:  # the simulator's and the other mixins' (not stubs: they would shadow them)
        def _settle(self, sj: SimJob) -> None: ...
        def _set_phase(self, sj: SimJob) -> None: ...
        def _reschedule(self, sj: SimJob) -> None: ...
        def _catch_up(self, gpu: int, inclusive: bool, still_alone: bool = False) -> None: ...
        def _stale(self, gpu: int) -> None: ...
        def _book_job(self, sj: SimJob) -> Job: ...

    def _progress(self, sj: SimJob, dirty: set[int]) -> int:
        self._settle(sj)
        tj = sj.trace
        surge_pending = not sj.surged and tj.surge_at_fraction is not None
        target = tj.runtime_s * (1 - tj.surge_at_fraction) if surge_pending else 0.0  # type: ignore[operator]
        tolerance = work_tolerance(self.now, sj.speed)
        if sj.remaining > target + tolerance:
            if tj.runtime_s - sj.remaining + tolerance >= sj.edge_at:
                was = sj.cpu
                self._set_phase(sj)
                if sj.cpu != was:
                    self.phased.update(sj.gpus)
                self._reschedule(sj)
                return PHASE
            # The event was planned at a higher speed (see _reschedule): not there yet.
            self._reschedule(sj)
            return EARLY
        if surge_pending:
            for g in sj.gpus:
                if g in self.deferred:
                    self._catch_up(g, inclusive=False)
            sj.surged = True
            cap = min(self.mem[g] for g in sj.gpus)
            sj.demand = min(cap, int(sj.demand * (1 + tj.surge_growth)))
            dirty.update(sj.gpus)
            if self.policy.universal_memory:
                self.driver.set_demand(sj.book_id, sj.demand)
            else:
                held = self._grow_caches(sj)
                if held is None:
                    self._fail(sj, dirty)
                    return CHANGED
                # The book's demand is what a profile sees: the cache held (see _profile).
                self.driver.set_demand(sj.book_id, max(held.values()), held=held)
            self._reschedule(sj)
            return CHANGED
        sj.remaining = 0.0
        self.driver.finish(sj.book_id, self.now)
        self._leave(sj, dirty)
        sj.state = "finished"
        sj.end = self.now
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

    def _leave(self, sj: SimJob, dirty: set[int]) -> None:
        dirty.update(sj.gpus)
        for g in sj.gpus:
            # Its deferred rounds would only have moved a memo that its departure resets.
            self.deferred.pop(g, None)
            del self.on_gpu[g][sj.book_id]
        sj.gpus = ()
        self.low_shares.pop(sj.book_id, None)
        sj.limits = {}  # the driver's settings were released with the job
        sj.shares = {}
        sj.gpu_speed.clear()
        sj.seen.clear()
        sj.speed = 0.0
        sj.version += 1
        sj.due = None

    def _fail(self, sj: SimJob, dirty: set[int]) -> None:
        """Out of GPU memory without universal memory: the job dies; resubmitted once."""
        self.driver.finish(sj.book_id, self.now, failed=True)
        self._leave(sj, dirty)
        # Its GPUs are free and it may be pending again: another pass, as the daemon marks
        # itself dirty after a failed launch (Daemon._launch_failed). A failure at a progress
        # event is followed by the batch's pass anyway; one at a start inside a pass is not.
        self.repass = True
        sj.failures += 1
        if sj.failures > MAX_RETRIES:
            sj.state = "failed"
            sj.end = self.now
            return
        sj.attempt += 1
        del self.jobs[sj.book_id]
        sj.book_id = f"{sj.trace.id}~{sj.attempt}"
        sj.remaining = sj.trace.runtime_s
        sj.state = "pending"
        self.jobs[sj.book_id] = sj
        self.book.submit(self._book_job(sj))  # profile now includes the surge: no second one

    def _track_share(self, sj: SimJob) -> None:
        """Keep `low_shares` current for the migration policy."""
        if self.migration is None:
            return
        share = min((sj.shares.get(g, 1.0) for g in sj.gpus), default=1.0)
        if sj.state == "running" and sj.role is Role.OPPORTUNISTIC and share < self.migration.stranded_share:
            self.low_shares[sj.book_id] = share
        else:
            self.low_shares.pop(sj.book_id, None)

    def _start(self, sj: SimJob, d: Launch, dirty: set[int]) -> None:
        sj.state = "running"
        sj.role = d.role
        sj.gpus = d.gpus
        self._set_phase(sj)
        sj.last_t = self.now
        sj.changed_at = self.now
        if sj.first_start is None:
            sj.first_start = self.now
        # The driver's settings, by reference: its rounds change them, _recompute reads them.
        sj.limits = d.settings.limits
        sj.shares = d.settings.shares
        # The model steps from the start: a utilisation refresh after now covers the job, and
        # the driver's busy mark on its GPUs lasts until then.
        self.driver.first_step(sj.book_id, self.now)
        for g in d.gpus:
            if g in self.deferred:
                self._catch_up(g, inclusive=False)
            self.on_gpu[g][sj.book_id] = sj
            if self.reads_util is not never_reads:
                self._stale(g)
        dirty.update(d.gpus)
        groups = len({self.group[g] for g in d.gpus})
        sj.locality = locality_factor(self.perf.cross_group_slowdown, groups)
        if not self.policy.universal_memory:
            held = self._grow_caches(sj, fresh=True)  # on_gpu already lists it: not its own co-runner
            if held is None:
                self._fail(sj, dirty)  # out of memory while initialising
                return
            self.driver.hold(sj.book_id, held)
