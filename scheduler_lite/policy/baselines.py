"""Baseline global policies of the paper's trace experiment (§5.2), over the same snapshot.

* YARN-CS: Apache YARN's capacity scheduler as used in Philly: exclusive GPUs, a FIFO queue per
  tenant, tenants least served first. A job within its tenant's quota runs in the guarantee role;
  idle GPUs may be lent to jobs beyond quota (elastic, opportunistic role), except while a job
  within quota waits for GPUs. With `preempt`, a waiting job within quota kills the newest
  elastic jobs it needs (they go back to their queue and start over).
* Gandiva packing: one FIFO queue, each job onto the least utilised GPUs that still have its
  (profiled) memory free; no quota, no performance isolation, no universal memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_lite.model import ClusterState, GlobalDecision, Job, Place, Preempt, Role
from scheduler_lite.policy.book import ClusterBook
from scheduler_lite.policy.global_scheduler import served_ratio


@dataclass(frozen=True, slots=True)
class YarnConfig:
    preempt: bool = False

    def validate(self) -> YarnConfig:
        return self


@dataclass(frozen=True, slots=True)
class GandivaConfig:
    def validate(self) -> GandivaConfig:
        return self


def _book(state: ClusterState) -> ClusterBook:
    # The baselines ask for indexes beyond ClusterQueries (empty GPUs, committed memory).
    assert isinstance(state.index, ClusterBook)
    return state.index


def yarn_cs_schedule(state: ClusterState, config: YarnConfig) -> list[GlobalDecision]:
    idx = _book(state)
    out: list[GlobalDecision] = []
    taken: set[int] = set()
    used = {t: idx.quota_used(t) for t in state.tenants}
    waiting_in_quota = False
    for tenant in sorted(state.tenants.values(), key=served_ratio(used)):
        for job_id in list(idx.pending_guarantee_queue(tenant.name)) + [
            j for j in idx.pending_opportunistic_queue() if state.jobs[j].tenant == tenant.name
        ]:
            job = state.jobs[job_id]
            in_quota = used[tenant.name] + job.num_gpus <= tenant.gpu_quota
            if not in_quota and waiting_in_quota:
                break
            gpus = _empty_gpus(idx, job.num_gpus, taken)
            if gpus is None and in_quota and config.preempt:
                gpus = _preempt_for(state, idx, job, taken, out)
            if gpus is None:
                waiting_in_quota = waiting_in_quota or in_quota
                break  # FIFO per tenant
            role = Role.GUARANTEE if in_quota else Role.OPPORTUNISTIC
            out.append(Place(job_id, tuple(gpus), role))
            taken.update(gpus)
            if in_quota:
                used[tenant.name] += job.num_gpus
    return out


def _empty_gpus(idx: ClusterBook, n: int, taken: set[int]) -> list[int] | None:
    """n GPUs with no job: one group when the gang fits one (best fit), else fewest groups."""
    size = idx.largest_group_size()
    if n <= size:
        for count in range(n, size + 1):
            for group in idx.groups_with_empty_count(count):
                avail = idx.empty_gpus(group) - taken
                if len(avail) >= n:
                    return sorted(avail)[:n]
        # YARN does not know NVLink: any empty GPUs will do.
    chosen: list[int] = []
    for count in range(size, 0, -1):
        for group in idx.groups_with_empty_count(count):
            chosen.extend(sorted(idx.empty_gpus(group) - taken)[: n - len(chosen)])
            if len(chosen) >= n:
                return chosen
    return None


def _preempt_for(
    state: ClusterState, idx: ClusterBook, job: Job, taken: set[int], out: list[GlobalDecision]
) -> list[int] | None:
    victims: list[Job] = []
    for tenant in state.tenants:
        victims.extend(state.jobs[j] for j in idx.running_jobs(tenant, Role.OPPORTUNISTIC))
    victims.sort(key=lambda j: (-j.submit_time, j.id))  # newest first: least work lost
    freed: set[int] = set()
    for g in idx.gpus:
        if not idx.jobs_on(g) and g not in taken and idx.reserved_for(g) is None:
            freed.add(g)
    chosen: list[Job] = []
    for victim in victims:
        if len(freed) >= job.num_gpus:
            break
        if any(g in taken for g in victim.placement):
            continue
        chosen.append(victim)
        freed.update(victim.placement)
    if len(freed) < job.num_gpus:
        return None
    out.extend(Preempt(v.id) for v in chosen)
    victim_gpus = sorted(g for v in chosen for g in v.placement)
    rest = sorted(freed - set(victim_gpus))
    return (victim_gpus + rest)[: job.num_gpus]


def gandiva_schedule(state: ClusterState, config: GandivaConfig) -> list[GlobalDecision]:
    idx = _book(state)
    out: list[GlobalDecision] = []
    pending = [state.jobs[j] for t in state.tenants for j in idx.pending_guarantee_queue(t)]
    pending += [state.jobs[j] for j in idx.pending_opportunistic_queue()]
    pending.sort(key=lambda j: (j.submit_time, j.id))
    placed_now: dict[int, int] = {}  # memory handed out in this pass
    for job in pending:
        gpus: list[int] = []
        for gpu in idx.gpus_by_utilisation(1.01):
            if gpu in placed_now:
                continue  # utilisation unknown until the new job runs
            if idx.memory_free(gpu) >= job.memory_demand_bytes:
                gpus.append(gpu)
                if len(gpus) == job.num_gpus:
                    break
        if len(gpus) < job.num_gpus:
            break  # FIFO
        out.append(Place(job.id, tuple(gpus), Role.OPPORTUNISTIC))
        for gpu in gpus:
            placed_now[gpu] = job.memory_demand_bytes
    return out
