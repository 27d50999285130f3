"""AntMan's global scheduler (paper §3.2 Algorithm 1 and §3.3), as one pure function.

    schedule(state, config) -> list[GlobalDecision]

One pass, in this order:

1. Tenants are visited least-served first (quota used / quota).
2. Job upgrade: a running opportunistic job submitted as `auto` becomes a guarantee job in place
   when its tenant's free quota covers it and none of its GPUs holds a guarantee job or is
   reserved for another gang (the paper prefers this to launching a new job).
3. The tenant's guarantee queue, oldest first (no overtaking, so large gangs are not starved):
   Algorithm 1 lines 1, 4-8. `findNodes(job.gpu, topo)` picks GPUs held by no guarantee job and
   reserved for nobody, inside one NVLink group when the gang fits one (best fit), else whole
   groups first. A job beyond its tenant's free quota waits and reserves nothing (it stops the
   tenant's queue). All found: Place. Otherwise Reserve what was found and stop this tenant's
   queue; reserved GPUs still take opportunistic jobs, never guarantee ones.
   An `auto` job goes this way unless its wait for quota (what it has waited plus the estimated
   rest) exceeds `auto_opportunistic_after_s`, in which case it is scheduled as an opportunistic job.
4. Opportunistic jobs (Algorithm 1 lines 2-3, 9-10): `findNodes(job.gpu, M)` keeps GPUs whose
   10 s utilisation is below M, `minLoadNodes` takes the least loaded. A GPU gets at most one
   new opportunistic job per pass, because its utilisation is only known once the job runs.
   With `opportunistic_placement = "share"` (the default) a GPU also needs room for the job's
   requested share: the requested shares of the jobs already there (guarantee job included)
   plus this one's stay within one GPU; among those, GPUs with the job's memory free come first.
   Utilisation alone is not enough: a throttled opportunistic job keeps its GPU's utilisation
   low, so "paper" placement kept sending more of them to the same GPU (docs/simulator.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from scheduler_lite.model import (
    ClusterState,
    GlobalDecision,
    Job,
    JobKind,
    Place,
    Reject,
    Reserve,
    Role,
    Tenant,
    Unreserve,
    Upgrade,
)
from scheduler_lite.policy.validation import check_choice, check_range

OPPORTUNISTIC_ORDERS = ("fifo", "shortest_predicted")
OPPORTUNISTIC_PLACEMENTS = ("utilisation", "share")
GANG_LOCALITY = ("wait", "spread")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Global scheduler knobs. `validate()` names the bad field and its accepted range."""

    # M of the paper: GPUs busier than this over the last 10 s take no new opportunistic job.
    utilisation_threshold: float = 0.8
    # An auto job waiting longer than this for quota (waited + estimated rest) runs
    # opportunistically instead. Ten minutes
    # is long next to the median Philly job (about 20 minutes) and short next to its mean.
    auto_opportunistic_after_s: float = 600.0
    # Remaining run time assumed for a running job that reports none (delay estimation only).
    default_remaining_s: float = 3600.0
    # "fifo" is the paper; "shortest_predicted" orders opportunistic jobs by predicted run time
    # (MLaaS in the wild, NSDI'22 §5.2: recurring tasks are predictable within ~25%).
    opportunistic_order: str = "fifo"
    enable_upgrade: bool = True
    # "utilisation": Algorithm 1 as written; "share": requested shares must fit too (module doc).
    opportunistic_placement: str = "share"
    # Share counted for a job that states none. 0 keeps utilisation-only placement for such jobs
    # (the daemon's jobs state none today).
    unknown_requested_share: float = 0.0
    # A gang that fits one NVLink group but finds none free: "wait" reserves and waits for one
    # (Algorithm 1 as written); "spread" takes free GPUs of several groups now and pays the
    # slower interconnect. Waiting blocks the tenant's queue behind it (no overtaking).
    gang_locality: str = "spread"

    def validate(self) -> SchedulerConfig:
        check_range("utilisation_threshold", self.utilisation_threshold, 0.0, 1.0, low_open=True)
        check_range("auto_opportunistic_after_s", self.auto_opportunistic_after_s, 0.0, 1e9)
        check_range("default_remaining_s", self.default_remaining_s, 0.0, 1e9, low_open=True)
        check_choice("opportunistic_order", self.opportunistic_order, OPPORTUNISTIC_ORDERS)
        check_choice("opportunistic_placement", self.opportunistic_placement, OPPORTUNISTIC_PLACEMENTS)
        check_range("unknown_requested_share", self.unknown_requested_share, 0.0, 1.0)
        check_choice("gang_locality", self.gang_locality, GANG_LOCALITY)
        return self


def schedule(state: ClusterState, config: SchedulerConfig) -> list[GlobalDecision]:
    return _Pass(state, config).run()


class _Pass:
    """State local to one pass: what this pass already handed out."""

    def __init__(self, state: ClusterState, config: SchedulerConfig) -> None:
        self.s = state
        self.idx = state.index
        self.cfg = config
        self.out: list[GlobalDecision] = []
        # GPUs closed to guarantee jobs by this pass: granted to one, upgraded, or reserved.
        self.taken: set[int] = set()
        # Of those, the ones closed to opportunistic jobs too: reserved GPUs still take them
        # (paper §3.3: "they can be utilized by opportunistic jobs").
        self.granted: set[int] = set()
        self.opp_taken: set[int] = set()  # GPUs that got a new opportunistic job this pass
        self.quota_used = {t: self.idx.quota_used(t) for t in state.tenants}
        self.routed: list[Job] = []  # auto jobs sent to the opportunistic path
        self.opp_gpus: Iterator[int] | None = None
        self.opp_buffer: list[int] = []
        self.opp_exhausted = False

    def run(self) -> list[GlobalDecision]:
        for tenant in sorted(self.s.tenants.values(), key=served_ratio(self.quota_used)):
            if self.cfg.enable_upgrade:
                self._upgrades(tenant.name, tenant.gpu_quota)
            self._guarantee_queue(tenant.name, tenant.gpu_quota)
        self._opportunistic()
        return self.out

    # -- job upgrade ----------------------------------------------------------------------------

    def _upgrades(self, tenant: str, quota: int) -> None:
        headroom = quota - self.quota_used[tenant]
        if headroom <= 0:
            return
        for job_id in self.idx.upgradable_jobs(tenant):
            job = self.s.jobs[job_id]
            if job.num_gpus > headroom:
                continue
            if all(self._guarantee_free(g, job_id) for g in job.placement):
                self.out.append(Upgrade(job_id))
                self.taken.update(job.placement)
                self.granted.update(job.placement)
                headroom -= job.num_gpus
                self.quota_used[tenant] += job.num_gpus

    def _guarantee_free(self, gpu: int, job_id: str) -> bool:
        if gpu in self.taken or self.idx.guarantee_holder(gpu) is not None:
            return False
        holder = self.idx.reserved_for(gpu)
        return holder is None or holder == job_id

    # -- guarantee queue ------------------------------------------------------------------------

    def _guarantee_queue(self, tenant: str, quota: int) -> None:
        blocked_gpus = 0  # GPUs wanted by blocked guarantee jobs ahead (delay estimation)
        finish_times: list[tuple[float, int]] | None = None
        for job_id in self.idx.pending_guarantee_queue(tenant):
            job = self.s.jobs[job_id]
            if job.num_gpus > quota and job.kind is JobKind.GUARANTEE:
                self.out.append(Reject(job_id, f"needs {job.num_gpus} GPUs, quota is {quota}"))
                continue
            if job.kind is JobKind.AUTO:
                if finish_times is None:
                    finish_times = self._quota_release_times(tenant)
                short = job.num_gpus + blocked_gpus + self.quota_used[tenant] - quota
                # Its wait for quota: what it has waited plus the estimated rest. The estimate
                # alone went to 0 for good once the running jobs outlived their predictions, and
                # the auto job then waited for them however long, next to idle GPUs.
                wait = (self.s.now - job.submit_time + _estimated_delay(short, finish_times, self.s.now)
                        if short > 0 else 0.0)
                if wait > self.cfg.auto_opportunistic_after_s or job.num_gpus > quota:
                    if job_id in self.s.reservations:
                        self.out.append(Unreserve(job_id))
                    self.routed.append(job)
                    continue
            if blocked_gpus:
                continue  # no overtaking: only auto jobs may leave the queue behind a blocked gang
            if self.quota_used[tenant] + job.num_gpus > quota:
                # Blocked by its own tenant's quota, not by the cluster: it holds nothing. A
                # reservation would keep other tenants within their quota (and, before they took
                # reserved GPUs, opportunistic jobs) off GPUs this job cannot use until its
                # tenant's running jobs end and free GPUs of their own.
                if job_id in self.s.reservations:
                    self.out.append(Unreserve(job_id))
                blocked_gpus += job.num_gpus
                continue
            gpus, complete = self._find_guarantee_gpus(job)
            if complete:
                self.out.append(Place(job_id, tuple(gpus), Role.GUARANTEE))
                self.quota_used[tenant] += job.num_gpus
                self.taken.update(gpus)
                self.granted.update(gpus)
                continue
            # Algorithm 1 line 8: hold what is there so no other gang takes it.
            if gpus and tuple(sorted(gpus)) != tuple(sorted(self.s.reservations.get(job_id, ()))):
                self.out.append(Reserve(job_id, tuple(gpus)))
            self.taken.update(gpus)
            blocked_gpus += job.num_gpus

    def _quota_release_times(self, tenant: str) -> list[tuple[float, int]]:
        times = []
        for job_id in self.idx.running_jobs(tenant, Role.GUARANTEE):
            job = self.s.jobs[job_id]
            remaining = job.estimated_remaining_s
            if remaining is None:
                remaining = self.cfg.default_remaining_s
            times.append((self.s.now + remaining, job.num_gpus))
        times.sort()
        return times

    def _find_guarantee_gpus(self, job: Job) -> tuple[list[int], bool]:
        """findNodes(job.gpu, constraints <- job.topo): (GPUs, whether the gang is complete)."""
        n = job.num_gpus
        own = set(self.s.reservations.get(job.id, ()))
        size = self.idx.largest_group_size()

        def available(group: str) -> set[int]:
            free = self.idx.free_for_guarantee(group)
            mine = {g for g in own if self.s.gpus[g].nvlink_group == group}
            return (free | mine) - self.taken if self.taken else free | mine

        own_groups = sorted({self.s.gpus[g].nvlink_group for g in own})
        if n <= size:
            best: list[int] = []
            for group in own_groups:
                avail = available(group)
                if len(avail) >= n:
                    return self._emptiest(group, avail)[:n], True
                if len(avail) > len(best):
                    best = self._emptiest(group, avail)
            # Best fit among GPUs with no job first: a guarantee job next to an opportunistic one
            # throttles it to the floor (and the migration that follows costs a restart), while
            # a group with idle GPUs costs nobody anything. Counting only guarantee-free GPUs
            # picked the fullest group even when its free GPUs all ran opportunistic jobs (at
            # load 0.8, 77 of 250 guarantee placements while another group had idle GPUs).
            for count in range(n, size + 1):
                for group in self.idx.groups_with_empty_count(count):
                    idle = self.idx.empty_gpus(group)
                    if self.taken:
                        idle = idle - self.taken
                    if len(idle) >= n:
                        return sorted(idle)[:n], True
            for count in range(n, size + 1):  # best fit keeps big groups whole for big gangs
                for group in self.idx.groups_with_free_count(count):
                    avail = available(group)
                    if len(avail) >= n:
                        return self._emptiest(group, avail)[:n], True
            for count in range(n - 1, len(best), -1):
                for group in self.idx.groups_with_free_count(count):
                    avail = available(group)
                    if len(avail) > len(best):
                        best = self._emptiest(group, avail)
                        break
                if best and len(best) >= count:
                    break
            if self.cfg.gang_locality == "wait":
                return best, False
        chosen: list[int] = []
        seen: set[str] = set()
        for group in own_groups:
            seen.add(group)
            chosen.extend(self._emptiest(group, available(group))[: n - len(chosen)])
        for count in range(size, 0, -1):  # whole groups first: fewest groups per gang
            for group in self.idx.groups_with_free_count(count):
                if len(chosen) >= n:
                    break
                if group in seen:
                    continue
                chosen.extend(self._emptiest(group, available(group))[: n - len(chosen)])
        return chosen, len(chosen) >= n

    def _emptiest(self, group: str, gpus: set[int]) -> list[int]:
        """GPUs without any job first: a guarantee job placed next to an opportunistic one
        throttles it to the floor, while an idle GPU costs nobody anything."""
        empty = self.idx.empty_gpus(group)
        return sorted(gpus, key=lambda g: (g not in empty, g))

    # -- opportunistic jobs ---------------------------------------------------------------------

    def _opportunistic(self) -> None:
        queue = self.idx.pending_opportunistic_queue()
        if not queue and not self.routed:
            return
        if self._peek_opp_gpu() is None:
            return
        jobs = self.routed + [self.s.jobs[j] for j in queue]
        if self.cfg.opportunistic_order == "shortest_predicted":
            jobs.sort(key=_predicted_key)
        elif self.routed:
            jobs.sort(key=lambda j: (j.submit_time, j.id))
        if self.cfg.opportunistic_placement == "share":
            self._place_by_share(jobs)
            return
        for job in jobs:
            gpus = self._min_load_gpus(job.num_gpus)
            if gpus is None:
                if self.opp_exhausted and not self.opp_buffer:
                    return
                continue
            self.out.append(Place(job.id, tuple(gpus), Role.OPPORTUNISTIC))

    def _place_by_share(self, jobs: list[Job]) -> None:
        # GPUs below M in Algorithm 1's order (least utilised first), each with the share room
        # left on it; a GPU gets at most one new job per pass, so the room is read once. GPUs
        # without room for the smallest request of the pass are dropped as they are pulled
        # (on a 6,504-GPU cluster most of a pass's time went to rescanning them).
        unstated = self.cfg.unknown_requested_share
        below = self.cfg.utilisation_threshold
        if len(jobs) == 1 and jobs[0].num_gpus == 1:  # the common pass: one scan, no buffer
            job = jobs[0]
            share = self._request(job)
            if not self.idx.may_have_room(below, share, job.num_gpus):
                return  # the scan would read every GPU below M and find too few with room
            fits, tight = self.idx.first_with_room(below, share, unstated, job.memory_demand_bytes,
                                                   job.num_gpus, self.granted, self.opp_taken)
            chosen = (fits + tight)[: job.num_gpus]
            if len(chosen) == job.num_gpus:
                self.out.append(Place(job.id, tuple(chosen), Role.OPPORTUNISTIC))
                self.opp_taken.update(chosen)
            return
        smallest = min(self._request(j) for j in jobs)
        buffer: list[tuple[int, float]] = []
        gpus_iter = self.idx.gpus_with_room(below, smallest, unstated)
        exhausted = False
        failed: list[tuple[int, float]] = []  # (GPUs, share) of jobs that found no GPU
        # Hoisted out of the loops below: this pass runs after most events of a 20k-job run.
        taken, opp_taken, memory_free = self.granted, self.opp_taken, self.idx.memory_free
        for job in jobs:
            n, share = job.num_gpus, self._request(job)
            # A job asking at least as much as one that found no GPU finds none either.
            if failed and any(fn <= n and fr <= share for fn, fr in failed):
                continue
            if not self.idx.may_have_room(below, share, n):
                # It would pull every GPU below M and fail. Later jobs pull the same GPUs in
                # the same order when they need them (the book does not change in a pass).
                failed.append((n, share))
                continue
            demand = job.memory_demand_bytes
            fits: list[int] = []
            tight: list[int] = []  # share fits, memory does not (universal memory spills the rest)
            # A gang takes the first NVLink group to offer n GPUs that fit (a gang over several
            # groups runs slower: docs/simulator.md, "Locality"); without one, see _one_group.
            in_group: dict[str, list[int]] = {}
            group_done = n == 1
            i = 0
            while not group_done if n > 1 else len(fits) < n:
                if i == len(buffer):
                    if exhausted:
                        break
                    pulled = next(gpus_iter, None)
                    if pulled is None:
                        exhausted = True
                        break
                    if pulled[0] in taken or pulled[0] in opp_taken:
                        continue
                    buffer.append(pulled)
                g, room = buffer[i]
                i += 1
                if share > room + 1e-9:
                    continue
                if memory_free(g) >= demand:
                    fits.append(g)
                    if n > 1:
                        same = in_group.setdefault(self.s.gpus[g].nvlink_group, [])
                        same.append(g)
                        group_done = len(same) == n
                elif n > 1 or len(tight) < n:
                    tight.append(g)
            chosen = (fits + tight)[:n] if n == 1 else self._one_group(fits, tight, n)
            if len(chosen) < n:
                failed.append((n, share))
                if exhausted and not buffer:
                    return
                continue
            self.out.append(Place(job.id, tuple(chosen), Role.OPPORTUNISTIC))
            chosen_set = set(chosen)
            buffer = [b for b in buffer if b[0] not in chosen_set]
            opp_taken.update(chosen)

    def _one_group(self, fits: list[int], tight: list[int], n: int) -> list[int]:
        """A gang's n GPUs: a group with n that fit (the first found), else a group with n counting
        those without the memory (the group of the earliest), else the first n of all."""
        for ordered in (fits, fits + tight):
            groups: dict[str, list[int]] = {}
            for g in ordered:
                groups.setdefault(self.s.gpus[g].nvlink_group, []).append(g)
            for g in ordered:
                inside = groups[self.s.gpus[g].nvlink_group]
                if len(inside) >= n:
                    return inside[:n]
        return (fits + tight)[:n]

    def _peek_opp_gpu(self) -> int | None:
        if not self.opp_buffer:
            self._pull_opp_gpus(1)
        return self.opp_buffer[0] if self.opp_buffer else None

    def _pull_opp_gpus(self, n: int) -> None:
        if self.opp_gpus is None:
            self.opp_gpus = self.idx.gpus_by_utilisation(self.cfg.utilisation_threshold)
        while len(self.opp_buffer) < n and not self.opp_exhausted:
            gpu = next(self.opp_gpus, None)
            if gpu is None:
                self.opp_exhausted = True
            elif gpu not in self.granted and gpu not in self.opp_taken:
                self.opp_buffer.append(gpu)

    def _request(self, job: Job) -> float:
        share = job.requested_share
        return self.cfg.unknown_requested_share if share is None else share

    def _min_load_gpus(self, n: int) -> list[int] | None:
        """findNodes(job.gpu, M) then minLoadNodes: the n least loaded GPUs below M."""
        self._pull_opp_gpus(n)
        if len(self.opp_buffer) < n:
            return None
        gpus, self.opp_buffer = self.opp_buffer[:n], self.opp_buffer[n:]
        self.opp_taken.update(gpus)
        return gpus


def served_ratio(quota_used: dict[str, int]) -> Callable[[Tenant], tuple[float, str]]:
    """Tenants least served first: quota used / quota (a tenant without quota last), then name."""

    def key(tenant: Tenant) -> tuple[float, str]:
        if tenant.gpu_quota <= 0:
            return (math.inf, tenant.name)
        return (quota_used[tenant.name] / tenant.gpu_quota, tenant.name)

    return key


def _predicted_key(job: Job) -> tuple[float, float, str]:
    predicted = job.predicted_runtime_s if job.predicted_runtime_s is not None else math.inf
    return (predicted, job.submit_time, job.id)


def _estimated_delay(short_gpus: int, release_times: list[tuple[float, int]], now: float) -> float:
    """Time until the tenant's running guarantee jobs free `short_gpus` GPUs of quota."""
    if short_gpus <= 0:
        return 0.0
    freed = 0
    for end, gpus in release_times:
        freed += gpus
        if freed >= short_gpus:
            return max(0.0, end - now)
    return math.inf


__all__ = ["OPPORTUNISTIC_ORDERS", "OPPORTUNISTIC_PLACEMENTS", "SchedulerConfig", "schedule"]
