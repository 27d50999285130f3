"""How fast each simulated job runs, and what its GPUs add to the cluster's totals.

After each batch of events the engine hands `_recompute` the GPUs whose jobs changed (arrived,
left, entered or left a CPU phase, had a share or limit moved by a round): the performance model
(sim/perf.py, sim/interference.py) gives every job on them its speed on each GPU, a gang runs at
its slowest GPU's speed times its locality factor, and a job whose speed moved has its work so far
settled (`_settle`: progress is integrated between speed changes, not stepped) and its next
progress event planned again (`Simulator._reschedule`). The GPUs' utilisation, memory in use and
busy flags feed the run's integrals, advanced only when a total changes (`_integrate`).

`JobSpeeds` is a part of `engine.Simulator`, as `CoordinatorRounds` is (rounds.py says why a mixin:
no reference cycle); it reads the simulator's state declared below.
"""

from __future__ import annotations

import bisect
import math
from typing import TYPE_CHECKING

from scheduler_lite.model import Role
from scheduler_lite.sim.simjob import SimJob

if TYPE_CHECKING:
    from scheduler_lite.policy.registry import PolicySpec
    from scheduler_lite.sim.perf import PerfModel

WORK_TOLERANCE_S = 1e-6  # solo-seconds of work left that count as done (float round-off)


class JobSpeeds:
    # The simulator's state these methods read (set in Simulator.__init__).
    now: float
    perf: PerfModel
    policy: PolicySpec
    periodic: bool
    on_gpu: dict[int, dict[str, SimJob]]
    deferred: dict[int, float]
    gpu_util: dict[int, float]
    gpu_mem: dict[int, int]
    gpu_busy: dict[int, bool]
    util_sum: float
    mem_sum: int
    busy_gpus: int
    util_integral: float
    mem_integral: float
    busy_integral: float
    integrated_to: float

    if TYPE_CHECKING:  # the simulator's and CoordinatorRounds' (not stubs: they would shadow them)
        def _stale(self, gpu: int) -> None: ...
        def _reschedule(self, sj: SimJob) -> None: ...
        def _catch_up(self, gpu: int, inclusive: bool, still_alone: bool = False) -> None: ...
        def _watch(self, sj: SimJob) -> None: ...

    def _integrate(self) -> None:
        """Add the totals held since the last change to the integrals (a total changes next)."""
        dt = self.now - self.integrated_to
        if dt > 0:
            self.util_integral += self.util_sum * dt
            self.mem_integral += self.mem_sum * dt
            self.busy_integral += self.busy_gpus * dt
            self.integrated_to = self.now

    def _settle(self, sj: SimJob) -> None:
        dt = self.now - sj.last_t
        if dt > 0 and sj.speed > 0:
            sj.remaining -= sj.speed * dt
            sj.work_done += sj.speed * dt
        if dt > 0 and sj.state == "running":
            sj.busy_gpu_s += dt * len(sj.gpus)
        sj.last_t = self.now

    def _set_phase(self, sj: SimJob) -> None:
        """Its phase and next phase edge at its work done (an edge within the tolerance counts
        as reached): at a (re)start, which may repeat or redo work, and at each edge. Between
        two calls its work only grows, so `edge_at` alone tells _progress and _reschedule when
        the phase changes next."""
        edges = sj.trace.cpu_phases
        if edges:
            i = bisect.bisect_right(edges, sj.trace.runtime_s - sj.remaining + WORK_TOLERANCE_S)
            sj.cpu = i % 2 == 1  # odd: inside a CPU phase
            sj.u = 0.0 if sj.cpu else sj.trace.utilisation
            sj.edge_at = edges[i] if i < len(edges) else math.inf

    def _recompute(self, gpus: set[int]) -> None:
        touched: dict[str, SimJob] = {}
        perf = self.perf
        isolated = self.policy.isolated
        k = perf.contention_slowdown
        c = perf.colocation_interference
        opp = Role.OPPORTUNISTIC
        # _gpu_totals' no-change test, inlined below: most recomputations change no total.
        gpu_util, gpu_mem, gpu_busy = self.gpu_util, self.gpu_mem, self.gpu_busy
        for g in gpus:
            jobs = self.on_gpu[g]
            n = len(jobs)
            if n == 1:  # the common case, without the sums (same arithmetic as below)
                (jid, sj), = jobs.items()
                limit = sj.limits.get(g, 0)
                want = sj.demand
                s = 1.0
                if limit < want and want > 0:
                    if not sj.cpu:  # on the CPU it does not touch its tensors in host memory
                        s /= sj.perf.memory_slowdown(limit / want)
                    mem_used = limit
                else:
                    mem_used = want
                sj.gpu_speed[g] = s
                touched[jid] = sj
                u = sj.u * s
                if u > 1.0:
                    u = 1.0
                if u != gpu_util[g] or mem_used != gpu_mem[g] or not gpu_busy[g]:
                    self._gpu_totals(g, u, mem_used, True)
                continue
            capped = isolated and n > 1
            demand = 0.0
            for sj in jobs.values():
                u = sj.u
                if capped and sj.role is opp:
                    u = min(u, sj.shares.get(g, 1.0))
                demand += u
            # perf.contention, inlined: this loop runs after every round that moved a share.
            slow = 1.0 + k * (demand - 1.0) if demand > 1.0 else 1.0
            compute = None
            if not isolated and n > 1 and demand > 1.0:
                compute = iter(perf.unisolated_speeds([sj.u for sj in jobs.values()]))
                slow = 1.0
            util = 0.0
            mem_used = 0
            for jid, sj in jobs.items():
                limit = sj.limits.get(g, 0)
                want = sj.demand
                u = sj.u
                if capped and sj.role is opp:
                    u = min(u, sj.shares.get(g, 1.0))
                # Bandwidth interference (interference.bandwidth_slowdown, inlined): from the
                # co-runners' effective utilisation, however far below 1 the total is.
                s = (1.0 if compute is None else next(compute)) / (slow * (1.0 + c * (demand - u)))
                spilled = limit < want and want > 0
                if sj.cpu:
                    s = 1.0  # a CPU phase: the GPU's contention is not its own
                elif spilled:
                    s /= sj.perf.memory_slowdown(limit / want)
                mem_used += limit if spilled else want
                if u < sj.u:
                    s *= u / sj.u
                u = sj.u
                sj.gpu_speed[g] = s
                util += u * s
                touched[jid] = sj
            if util > 1.0:
                util = 1.0
            if util != gpu_util[g] or mem_used != gpu_mem[g] or gpu_busy[g] != (n > 0):
                self._gpu_totals(g, util, mem_used, n > 0)
        watch = self.policy.coordinated and not self.periodic
        for sj in touched.values():
            if len(sj.gpus) == 1:
                speed = sj.gpu_speed[sj.gpus[0]]
            elif sj.cpu:
                speed = 1.0  # no all-reduce on the CPU: locality does not matter
            else:
                speed = min(sj.gpu_speed[g] for g in sj.gpus) * sj.locality
            if abs(speed - sj.speed) > 1e-12:
                for g in sj.gpus:
                    if g in self.deferred:
                        # A round due now sees the job's old speed. From 0 that view has no steps,
                        # as has a view at the new speed now (no step ended since): it can wait.
                        self._catch_up(g, inclusive=sj.speed > 0, still_alone=True)
                self._settle(sj)
                sj.speed = speed
                sj.changed_at = self.now
                sj.epoch += 1
                self._reschedule(sj)
                if watch:
                    self._watch(sj)

    def _gpu_totals(self, g: int, util: float, mem_used: int, busy: bool) -> None:
        new_util, new_mem, new_busy = util != self.gpu_util[g], mem_used != self.gpu_mem[g], busy != self.gpu_busy[g]
        if not (new_util or new_mem or new_busy):
            return
        self._integrate()  # once for the three, and only before a real change
        if new_util:
            self.util_sum += util - self.gpu_util[g]
            self.gpu_util[g] = util
            self._stale(g)
        if new_mem:
            self.mem_sum += mem_used - self.gpu_mem[g]
            self.gpu_mem[g] = mem_used
        if new_busy:
            self.gpu_busy[g] = busy
            self.busy_gpus += 1 if busy else -1
