"""How fast each simulated job runs, and what its GPUs add to the cluster's totals.

After each batch of events the engine hands `recompute` the GPUs whose jobs changed (arrived,
left, entered or left a CPU phase, had a share or limit moved by a round): the performance model
(docs/simulator.md, "Performance model"; its parameters in sim/perf.py) gives every job on them
its speed on each GPU, a gang runs at its slowest GPU's speed times its locality factor (and its
GPUs and co-runners see it at that speed, `_held_back`), and a job whose speed moved has its
work so far settled (`settle`: progress is integrated between speed changes, not stepped) and
its next progress event planned again (`Clock.reschedule`). The GPUs' utilisation, memory in use
and busy flags feed the run's integrals, advanced only when a total changes (`_integrate`).

`JobSpeeds` is a part of `engine.Simulator`, handed the clock, the coordinator rounds (a speed
change may run a lone job's deferred rounds first, and makes the coordinators that read the job's
steps look again) and the jobs on each GPU at construction.
"""

from __future__ import annotations

import bisect
import math
from typing import TYPE_CHECKING

from scheduler_lite.model import Role
from scheduler_lite.sim.clock import work_tolerance
from scheduler_lite.sim.simjob import SimJob

if TYPE_CHECKING:
    from scheduler_lite.policy.registry import PolicySpec
    from scheduler_lite.sim.clock import Clock
    from scheduler_lite.sim.perf import PerfModel
    from scheduler_lite.sim.rounds import CoordinatorRounds

class JobSpeeds:
    def __init__(self, clock: Clock, rounds: CoordinatorRounds, *, perf: PerfModel, policy: PolicySpec,
                 on_gpu: dict[int, dict[str, SimJob]]) -> None:
        self.clock = clock
        self.rounds = rounds
        self.perf = perf
        self.policy = policy
        self.on_gpu = on_gpu
        self.gpu_util = dict.fromkeys(on_gpu, 0.0)
        self.gpu_mem = dict.fromkeys(on_gpu, 0)
        self.gpu_busy = dict.fromkeys(on_gpu, False)
        self.util_sum = 0.0
        self.mem_sum = 0
        self.busy_gpus = 0
        # Integrals of the three totals over time, advanced only when a total changes (to
        # `integrated_to`): events that change nothing (a round that decides nothing) do not
        # split the sums, so the figures do not depend on how many such events the engine runs.
        self.util_integral = 0.0
        self.mem_integral = 0.0
        self.busy_integral = 0.0
        self.integrated_to = 0.0

    def _integrate(self) -> None:
        """Add the totals held since the last change to the integrals (a total changes next)."""
        now = self.clock.now
        dt = now - self.integrated_to
        if dt > 0:
            self.util_integral += self.util_sum * dt
            self.mem_integral += self.mem_sum * dt
            self.busy_integral += self.busy_gpus * dt
            self.integrated_to = now

    def settle(self, sj: SimJob) -> None:
        now = self.clock.now
        dt = now - sj.last_t
        if dt > 0 and sj.speed > 0:
            sj.remaining -= sj.speed * dt
            sj.work_done += sj.speed * dt
        if dt > 0 and sj.state == "running":
            sj.busy_gpu_s += dt * len(sj.gpus)
        sj.last_t = now

    def set_phase(self, sj: SimJob) -> None:
        """Its phase and next phase edge at its work done (an edge within `work_tolerance`
        counts as reached, the same bound JobLifecycle.progress and Clock.reschedule use: an edge they call
        reached must be passed here): at a (re)start, which may repeat or redo work, and at each
        edge. Between two calls its work only grows, so `edge_at` alone tells progress and
        reschedule when the phase changes next."""
        edges = sj.trace.cpu_phases
        if edges:
            done = sj.trace.runtime_s - sj.remaining + work_tolerance(self.clock.now, sj.speed)
            i = bisect.bisect_right(edges, done)
            sj.cpu = i % 2 == 1  # odd: inside a CPU phase
            sj.u = 0.0 if sj.cpu else sj.trace.utilisation
            sj.edge_at = edges[i] if i < len(edges) else math.inf

    def recompute(self, gpus: set[int]) -> None:
        """Speeds of the jobs on `gpus`, and the GPUs' totals, from the performance model: a
        gang at its gang speed, held back on its GPUs (`_held_back`) in one pass, not a fixed
        point (docs/simulator.md, "A gang runs at its gang speed", says what each GPU sees; a
        co-runner's new speed feeding back into the gang speed would loop over every gang
        sharing a GPU with another).
        """
        touched: dict[str, SimJob] = {}
        gpu_util, gpu_mem, gpu_busy = self.gpu_util, self.gpu_mem, self.gpu_busy
        # Totals of the GPUs with a gang member, set once the gang speeds are known.
        ganged: dict[int, tuple[float, int, bool]] = {}
        for g in gpus:
            jobs = self.on_gpu[g]
            if not jobs:  # its last job left: nothing runs, nothing is held
                if gpu_util[g] or gpu_mem[g] or gpu_busy[g]:
                    self._gpu_totals(g, 0.0, 0, False)
                continue
            util, mem_used, gang = self._shared_gpu(g, jobs, touched, None)
            if gang:
                ganged[g] = (util, mem_used, True)
            elif util != gpu_util[g] or mem_used != gpu_mem[g] or not gpu_busy[g]:
                self._gpu_totals(g, util, mem_used, True)
        gang_speed = self._held_back(gpus, touched, ganged) if ganged else {}
        watch = self.policy.coordinated and not self.rounds.periodic
        guarantee = Role.GUARANTEE
        deferred = self.rounds.deferred
        for jid, sj in touched.items():
            speed = gang_speed[jid] if jid in gang_speed else sj.gpu_speed[sj.gpus[0]]
            if abs(speed - sj.speed) > 1e-12:
                # The deferred rounds of a lone guarantee job read its steps: those due up to now
                # run first, at the old speed. From 0 (its start) none is: its first round, due
                # now, has no steps to read at either speed (no step ended since), and it was
                # deferred now. A lone opportunistic job's rounds read no steps: they wait as
                # they were.
                for g in sj.gpus if sj.role is guarantee and sj.speed > 0 else ():
                    if g in deferred:
                        self.rounds.catch_up(g, inclusive=True, still_alone=True)
                self.settle(sj)
                sj.speed = speed
                sj.changed_at = self.clock.now
                sj.epoch += 1
                self.clock.reschedule(sj)
                if watch:
                    self.rounds.watch(sj)

    def _shared_gpu(self, g: int, jobs: dict[str, SimJob], touched: dict[str, SimJob],
                    gangs: dict[str, float] | None) -> tuple[float, int, bool]:
        """Speeds of the jobs on GPU `g`; its utilisation and memory in use, and whether a gang
        member is there.

        `gangs` None: every job at its full demand (the per-GPU speeds a gang speed is made of).
        Else the gang speed of each gang member there: its demand is held back by gang speed /
        its speed here, its speed here is left as it was, and the GPU reads it at its gang speed.
        """
        perf = self.perf
        isolated = self.policy.isolated
        k = perf.contention_slowdown
        c = perf.colocation_interference
        opp = Role.OPPORTUNISTIC
        n = len(jobs)
        capped = isolated and n > 1
        ganged = False
        demands = []
        for jid, sj in jobs.items():
            u = sj.u
            if capped and sj.role is opp:
                u = min(u, sj.shares.get(g, 1.0))
            if gangs is not None and jid in gangs:
                here = sj.gpu_speed[g]
                u = u * (gangs[jid] / here) if here > 0 else 0.0
            demands.append(u)
        demand = 0.0
        for u in demands:
            demand += u
        # With isolation every job is slowed by 1 + k (D - 1) once the summed demand D > 1.
        slow = 1.0 + k * (demand - 1.0) if demand > 1.0 else 1.0
        compute = None
        if not isolated and n > 1 and demand > 1.0:
            compute = iter(perf.unisolated_speeds(
                demands if gangs is not None else [sj.u for sj in jobs.values()]))
            slow = 1.0
        util = 0.0
        mem_used = 0
        for (jid, sj), u in zip(jobs.items(), demands, strict=True):
            limit = sj.limits.get(g, 0)
            want = sj.demand
            spilled = limit < want and want > 0
            mem_used += limit if spilled else want
            fair = 1.0 if compute is None else next(compute)
            if len(sj.gpus) > 1:
                ganged = True
                if gangs is not None:
                    util += sj.u * gangs[jid]  # what it runs at, not what this GPU would allow
                    continue
            # Bandwidth interference (docs/simulator.md, "Performance model"): 1 + c x the
            # co-runners' effective utilisation, however far below 1 the total is.
            s = fair / (slow * (1.0 + c * (demand - u)))
            if sj.cpu:
                s = 1.0  # a CPU phase: the GPU's contention is not its own
            elif spilled:
                s /= sj.perf.memory_slowdown(limit / want)
            if u < sj.u:
                s *= u / sj.u
            sj.gpu_speed[g] = s
            util += sj.u * s
            touched[jid] = sj
        return (1.0 if util > 1.0 else util), mem_used, ganged

    def _gang_speed(self, sj: SimJob) -> float:
        if sj.cpu:
            return 1.0  # no all-reduce on the CPU: locality does not matter
        return min(sj.gpu_speed[g] for g in sj.gpus) * sj.locality

    def _held_back(self, gpus: set[int], touched: dict[str, SimJob],
                   ganged: dict[int, tuple[float, int, bool]]) -> dict[str, float]:
        """The gang speed of each gang touched; the totals of the GPUs with a gang member.

        Where a gang member runs below the speed its GPU allows (another GPU or its locality
        holds it back), the GPU is recomputed with it held back (`_shared_gpu`): among `gpus`,
        and the other GPUs of a gang whose speed changed (their co-runners and readings follow
        it, though nothing there changed). Elsewhere the totals of the first pass stand.
        """
        speeds = {jid: self._gang_speed(sj) for jid, sj in touched.items() if len(sj.gpus) > 1}
        again: set[int] = set()
        for jid, v in speeds.items():
            sj = touched[jid]
            moved = abs(v - sj.speed) > 1e-12
            for g in sj.gpus:
                if (moved and g not in gpus) or (g in gpus and sj.gpu_speed[g] != v):
                    again.add(g)
        for g, totals in ganged.items():
            if g not in again and totals != (self.gpu_util[g], self.gpu_mem[g], self.gpu_busy[g]):
                self._gpu_totals(g, *totals)
        for g in sorted(again):
            jobs = self.on_gpu[g]
            here = {}
            for jid, sj in jobs.items():
                if len(sj.gpus) > 1:
                    v = speeds.get(jid)
                    if v is None:
                        v = speeds[jid] = self._gang_speed(sj)
                    here[jid] = v
            util, mem_used, _ = self._shared_gpu(g, jobs, touched, here)
            self._gpu_totals(g, util, mem_used, True)
        return speeds

    def _gpu_totals(self, g: int, util: float, mem_used: int, busy: bool) -> None:
        new_util, new_mem, new_busy = util != self.gpu_util[g], mem_used != self.gpu_mem[g], busy != self.gpu_busy[g]
        if not (new_util or new_mem or new_busy):
            return
        self._integrate()  # once for the three, and only before a real change
        if new_util:
            self.util_sum += util - self.gpu_util[g]
            self.gpu_util[g] = util
            self.clock.stale(g)
        if new_mem:
            self.mem_sum += mem_used - self.gpu_mem[g]
            self.gpu_mem[g] = mem_used
        if new_busy:
            self.gpu_busy[g] = busy
            self.busy_gpus += 1 if busy else -1
