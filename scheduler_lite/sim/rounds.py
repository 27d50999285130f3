"""When the simulator runs a GPU's coordinator round, and what the round sees: each GPU's own
grid, the grid points event mode skips (they would decide nothing), a lone job's deferred
rounds (`alone`, `catch_up`), as docs/simulator.md ("When the policies run") describes them;
tests/scheduler/test_sim_rounds.py checks that event and periodic rounds agree without noise.

`CoordinatorRounds` is a part of `engine.Simulator`, handed the clock, the driver and the jobs
on each GPU at construction; it plans rounds on the clock (`Clock.set_round`). It also keeps the
migration policy's input (`low_shares`: running opportunistic jobs the coordinator's shares
strand), since its rounds move the shares.
"""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING

from scheduler_lite.model import GpuView, LocalJob, Role, SetComputeShare, StepSample
from scheduler_lite.policy.coordinator import demands_fit
from scheduler_lite.sim.simjob import SimJob

if TYPE_CHECKING:
    from scheduler_lite.driver import Driver
    from scheduler_lite.policy.migration import MigrationConfig
    from scheduler_lite.sim.clock import Clock

# Step-time noise: one cycle of draws; a job's samples start at its own offset, and each speed
# epoch at another, so neighbouring jobs and epochs do not see the same sequence.
NOISE_CYCLE = 4093
NOISE_JOB_STRIDE = 611
NOISE_EPOCH_STRIDE = 97


class InvariantError(AssertionError):
    pass


class CoordinatorRounds:
    def __init__(self, clock: Clock, driver: Driver, *, on_gpu: dict[int, dict[str, SimJob]],
                 jobs: dict[str, SimJob], mem: dict[int, int], periodic: bool,
                 seed: int, noise_cv: float, counters: dict[str, int], migration: MigrationConfig | None) -> None:
        self.clock = clock
        self.driver = driver
        self.book = driver.book
        self.on_gpu = on_gpu
        self.jobs = jobs  # by book id
        self.mem = mem
        self.interval = driver.ccfg.round_interval_s
        self.periodic = periodic
        # Step-time noise is drawn once from the seed and indexed by (job, speed epoch, step
        # number): a sample does not depend on when or how often a coordinator reads it, so
        # event-driven and periodic rounds see the same steps.
        rng = random.Random(seed)
        self.noise = [max(0.1, 1 + rng.gauss(0.0, noise_cv)) for _ in range(NOISE_CYCLE)]
        self.counters = counters
        self.migration = migration
        self.anchor: dict[int, float] = {}  # time of the GPU's last change-driven round
        # Next round of a GPU whose only job's rounds decide nothing (`alone`), run only if
        # something happens there before the job leaves (catch_up).
        self.deferred: dict[int, float] = {}
        # Running opportunistic jobs below the migration policy's stranded share (its input).
        self.low_shares: dict[str, float] = {}

    def track_share(self, sj: SimJob) -> None:
        """Keep `low_shares` current for the migration policy."""
        if self.migration is None:
            return
        share = min((sj.shares.get(g, 1.0) for g in sj.gpus), default=1.0)
        if sj.state == "running" and sj.role is Role.OPPORTUNISTIC and share < self.migration.stranded_share:
            self.low_shares[sj.book_id] = share
        else:
            self.low_shares.pop(sj.book_id, None)

    def round(self, gpu: int, changed: bool) -> bool:
        """Run the GPU's coordinator round now if it can decide something; True if it decided."""
        now = self.clock.now
        if changed:
            self.anchor[gpu] = now
        if not self.on_gpu[gpu]:
            # The coordinator's documented answer for a GPU without jobs: no decisions, a fresh
            # memo. Not asking saves a tenth of all rounds (every last departure).
            self.driver.round(now, gpu, GpuView(self.book.gpus[gpu], ()))
            self.clock.set_round(gpu, None)
            return False
        if changed and not self.periodic and self.alone(gpu):
            # A lone job's round after a change decides nothing either (its placement, its own
            # surge that still fits, a neighbour leaving it all it needs): it waits with the
            # later ones and runs, at this time, only if something happens here before the job
            # leaves (catch_up). Step samples are indexed by step number, so a round run late
            # reads what it would have read now. (Until session 14 only a job not stepping yet
            # was deferred here: 3.6k of the 20k-job run's 36k rounds ran at once for nothing.)
            self.deferred[gpu] = now
            self.clock.set_round(gpu, None)
            return False
        self.counters["rounds"] += 1
        decisions = self.driver.round(now, gpu, self._view(gpu))  # applied to sj.limits/shares
        memo = self.driver.memo(gpu)  # the round on a GPU with jobs left one
        if self.migration is not None:
            for d in decisions:
                if isinstance(d, SetComputeShare):
                    self.track_share(self.jobs[d.job_id])
        if self.periodic:
            at = self._next_tick(gpu)
        elif memo.next_round_at is None:
            at = None
        else:
            at = self._next_tick(gpu, memo.next_round_at)
            if self.alone(gpu):
                self.deferred[gpu] = at
                at = None
        self.clock.set_round(gpu, at)
        return bool(decisions)

    def alone(self, gpu: int) -> bool:
        """A lone job whose rounds decide nothing: a guarantee job with all its memory on the
        GPU, or an opportunistic job holding the whole GPU at a full share (the coordinator's
        answer for it; the driver places it so).

        A guarantee job with part of it in host memory (its neighbours left while it was
        settling, e.g. moved away by migration), or an opportunistic job whose neighbours just
        left, gets a decision from its next round, so those rounds are not deferred.
        """
        jobs = self.on_gpu[gpu]
        if len(jobs) != 1:
            return False
        sj = next(iter(jobs.values()))
        if sj.role is Role.GUARANTEE:
            return sj.limits.get(gpu, 0) >= sj.demand
        return sj.limits.get(gpu, 0) == self.mem[gpu] and sj.shares.get(gpu, 1.0) == 1.0

    def catch_up(self, gpu: int, inclusive: bool, still_alone: bool = False) -> None:
        """Run the deferred rounds of a lone job (`alone`), if any, before its GPU changes.

        Rounds due before now see the GPU as it was then (nothing changed since, or this would
        have run earlier). A round due exactly now runs here when the change is not one that
        gives the GPU a round now anyway (`inclusive`), as periodic rounds would.
        """
        at = self.deferred.pop(gpu, None)
        clock = self.clock
        now = clock.now
        while at is not None and (at < now - 1e-9 or (inclusive and at <= now + 1e-9)):
            clock.now = at
            self.counters["rounds"] += 1
            decisions = self.driver.round(at, gpu, self._view(gpu))
            if decisions:
                raise InvariantError(f"GPU {gpu}: a lone job's round decided {decisions}")
            memo = self.driver.memo(gpu)
            at = None if memo.next_round_at is None else self._next_tick(gpu, memo.next_round_at)
        clock.now = now
        if at is not None and still_alone and self.alone(gpu):
            # Only the job's speed changed (e.g. from 0 at its start): the rounds still to come
            # read the new speed whenever they run, so they can wait as before.
            self.deferred[gpu] = at
        elif at is not None and at > now + 1e-9:
            self.clock.set_round(gpu, at)

    def _next_tick(self, gpu: int, at_or_after: float | None = None) -> float:
        """First grid point of the GPU after now, or at or after `at_or_after` if that is later."""
        anchor = self.anchor[gpu]
        k = math.floor((self.clock.now - anchor) / self.interval + 1e-9) + 1
        if at_or_after is not None:
            k = max(k, math.ceil((at_or_after - anchor) / self.interval - 1e-9))
        return anchor + k * self.interval

    def watch(self, sj: SimJob) -> None:
        """The job's speed changed: the coordinators that read its steps look again."""
        for g in sj.gpus:
            jobs = self.on_gpu[g]
            if len(jobs) < 2 or g not in self.anchor:
                continue
            if self.book.guarantee_holder(g) is not None:
                if sj.role is not Role.GUARANTEE:
                    continue  # only the guarantee job's steps are read on its GPU
            elif demands_fit([o.demand for o in jobs.values()], self.mem[g]):
                continue  # opportunistic jobs whose demands fit: their steps are not read
            at = self._next_tick(g)
            pending = self.clock.round_at.get(g)
            if pending is None or pending > at:
                self.clock.set_round(g, at)

    def _view(self, gpu: int) -> GpuView:
        local = []
        jobs = self.on_gpu[gpu]
        # Only the step times the coordinator reads are drawn (they cost most of a round): the
        # guarantee job's, or with none on the GPU, those of opportunistic jobs whose demands do
        # not fit together (its memory trials compare their progress).
        trials = (len(jobs) > 1 and self.book.guarantee_holder(gpu) is None
                  and not demands_fit([sj.demand for sj in jobs.values()], self.mem[gpu]))
        guarantee = Role.GUARANTEE
        now = self.clock.now
        for jid, sj in jobs.items():
            steps: tuple[StepSample, ...] = ()
            watched = trials or sj.role is guarantee
            limit = sj.limits.get(gpu, 0)
            share = sj.shares.get(gpu, 1.0)
            assert sj.role is not None
            if sj.speed > 0 and watched:
                # The last `detector_window` steps since its speed last changed; the other GPUs
                # of a gang read the same steps at the same tick (cached per time and epoch).
                key = (now, sj.epoch)
                if sj.cache_key != key:
                    sj.cache_key = key
                    sj.cache = self._draw_steps(sj)
                steps = sj.cache
            else:
                # Without steps a job's view changes only with its limit, share or demand.
                seen = sj.seen.get(gpu)
                if seen is not None and seen.memory_limit_bytes == limit and \
                        seen.compute_share == share and seen.memory_demand_bytes == sj.demand and \
                        seen.role is sj.role:
                    local.append(seen)
                    continue
            job = LocalJob(jid, sj.role, sj.demand, limit, max(0, sj.demand - limit), share, steps,
                           sj.step)
            if not steps:
                sj.seen[gpu] = job
            local.append(job)
        return GpuView(self.book.gpus[gpu], tuple(local))

    def _draw_steps(self, sj: SimJob) -> tuple[StepSample, ...]:
        step = sj.step / sj.speed
        start = sj.changed_at
        last = int((self.clock.now - start) / step)
        first = max(1, last - self.driver.ccfg.detector_window + 1)
        count = last - first + 1
        if count <= 0:
            return ()
        at = (sj.noise_base + sj.epoch * NOISE_EPOCH_STRIDE + first) % NOISE_CYCLE
        noise = self.noise[at : at + count]
        if len(noise) < count:
            noise += self.noise[: count - len(noise)]
        ends = [start + i * step for i in range(first, last + 1)]
        return tuple(map(StepSample, ends, [step * x for x in noise]))
