"""Cluster bookkeeping: applies global decisions and keeps the indexes the policies query.

The daemon and the simulator both own one `ClusterBook`; the pure policies only ever see the
read-only `ClusterState` it hands out (`snapshot(now)`). Indexes are updated per decision, so a
scheduling pass costs time in proportion to what it places, not to the size of the cluster.
The snapshot's mappings are read-only views valid until the next mutation of the book: policies
must not keep them across calls.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence
from types import MappingProxyType

from scheduler_lite.frozen import replacer
from scheduler_lite.model import (
    ClusterState,
    GlobalDecision,
    Gpu,
    Job,
    JobKind,
    JobState,
    Place,
    Preempt,
    Reject,
    Reserve,
    Role,
    Tenant,
    Unreserve,
    Upgrade,
)
from scheduler_lite.policy.migration import Migrate

UTILISATION_BUCKETS = 20  # 5% wide: finer than that is noise for a 10 s average
# Stated share committed on a GPU, counted in 1% rungs per utilisation bucket: enough to tell
# a share-0.85 request (room needs <= 0.15 committed) from the GPUs that cannot take it.
SHARE_RUNGS = 100


class BookError(RuntimeError):
    """A decision that contradicts the book (a policy bug): never silently ignored."""


class _GroupFreeIndex:
    """Per NVLink group: which GPUs are free, and which groups have exactly c free GPUs."""

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.size = max((len(g) for g in groups.values()), default=0)
        self.free: dict[str, set[int]] = {g: set(ids) for g, ids in groups.items()}
        self.by_count: list[dict[str, None]] = [{} for _ in range(self.size + 1)]
        for g, ids in groups.items():
            self.by_count[len(ids)][g] = None

    def set_free(self, group: str, gpu: int, free: bool) -> None:
        members = self.free[group]
        if (gpu in members) is free:
            return  # most calls (every placement refreshes both indexes of each GPU)
        before = len(members)
        if free:
            members.add(gpu)
        else:
            members.discard(gpu)
        del self.by_count[before][group]
        self.by_count[len(members)][group] = None


class ClusterBook:
    """Mutable truth about placements, reservations and queues, plus the query indexes."""

    def __init__(self, gpus: Iterable[Gpu], tenants: Iterable[Tenant]) -> None:
        self.gpus: dict[int, Gpu] = {g.id: g for g in gpus}
        self.tenants: dict[str, Tenant] = {t.name: t for t in tenants}
        self.jobs: dict[str, Job] = {}
        self.reservations: dict[str, tuple[int, ...]] = {}
        groups: dict[str, list[int]] = {}
        for g in self.gpus.values():
            groups.setdefault(g.nvlink_group, []).append(g.id)
        self._guarantee_free = _GroupFreeIndex(groups)
        self._empty = _GroupFreeIndex(groups)  # no job at all and no reservation
        self._holder: dict[int, str] = {}
        self._reserved: dict[int, str] = {}
        self._jobs_on: dict[int, dict[str, None]] = {g: {} for g in self.gpus}
        self._memory_committed: dict[int, int] = dict.fromkeys(self.gpus, 0)
        # Requested shares of the jobs on each GPU: the sum of those stated, and how many stated none.
        self._share_stated: dict[int, float] = dict.fromkeys(self.gpus, 0.0)
        self._share_unstated: dict[int, int] = dict.fromkeys(self.gpus, 0)
        self._pending_g: dict[str, dict[str, None]] = {t: {} for t in self.tenants}
        self._pending_o: dict[str, None] = {}
        self._running: dict[tuple[str, Role], dict[str, None]] = {
            (t, r): {} for t in self.tenants for r in Role
        }
        self._upgradable: dict[str, dict[str, None]] = {t: {} for t in self.tenants}
        self._quota_used: dict[str, int] = dict.fromkeys(self.tenants, 0)
        self._buckets: list[dict[int, None]] = [{} for _ in range(UTILISATION_BUCKETS)]
        self._bucket_of: dict[int, int] = {}
        # GPUs per (utilisation bucket, rung of stated share): may_have_room's counts.
        self._rung_counts: list[list[int]] = [[0] * (SHARE_RUNGS + 1) for _ in range(UTILISATION_BUCKETS)]
        self._rung_of: dict[int, int] = dict.fromkeys(self.gpus, 0)
        # Read-only views of the live mappings, made once: a snapshot per pass (23k in a 20k-job
        # simulation) needs no new ones, and a view shows its mapping as it is when read.
        self._views = (MappingProxyType(self.gpus), MappingProxyType(self.jobs), MappingProxyType(self.tenants),
                       MappingProxyType(self.reservations))
        for g in self.gpus.values():
            b = _bucket(g.utilisation)
            self._buckets[b][g.id] = None
            self._bucket_of[g.id] = b
            self._rung_counts[b][0] += 1

    # -- ClusterQueries (model.py says what each answers) ---------------------------------------

    def pending_guarantee_queue(self, tenant: str) -> Collection[str]:
        return self._pending_g[tenant].keys()

    def pending_opportunistic_queue(self) -> Collection[str]:
        return self._pending_o.keys()

    def pending_count(self) -> int:
        return len(self._pending_o) + sum(map(len, self._pending_g.values()))

    def quota_used(self, tenant: str) -> int:
        return self._quota_used[tenant]

    def running_jobs(self, tenant: str, role: Role) -> Sequence[str]:
        return tuple(self._running[(tenant, role)])

    def upgradable_jobs(self, tenant: str) -> Sequence[str]:
        return tuple(self._upgradable[tenant])

    def guarantee_holder(self, gpu: int) -> str | None:
        return self._holder.get(gpu)

    def reserved_for(self, gpu: int) -> str | None:
        return self._reserved.get(gpu)

    def jobs_on(self, gpu: int) -> Sequence[str]:
        return tuple(self._jobs_on[gpu])

    def memory_free(self, gpu: int) -> int:
        return self.gpus[gpu].memory_bytes - self._memory_committed[gpu]

    def free_for_guarantee(self, group: str) -> set[int]:
        return self._guarantee_free.free[group]

    def groups_with_free_count(self, count: int) -> Sequence[str]:
        return self._guarantee_free.by_count[count].keys()  # type: ignore[return-value]

    def empty_gpus(self, group: str) -> set[int]:
        return self._empty.free[group]

    def groups_with_empty_count(self, count: int) -> Sequence[str]:
        return self._empty.by_count[count].keys()  # type: ignore[return-value]

    def largest_group_size(self) -> int:
        return self._guarantee_free.size

    def gpus_by_utilisation(self, below: float) -> Iterator[int]:
        for b, bucket in enumerate(self._buckets):
            if b / UTILISATION_BUCKETS >= below:
                return
            boundary = (b + 1) / UTILISATION_BUCKETS > below
            for gpu in bucket:
                if not boundary or self.gpus[gpu].utilisation < below:
                    yield gpu

    def gpus_with_room(self, below: float, min_room: float, unstated: float) -> Iterator[tuple[int, float]]:
        stated, count, gpus = self._share_stated, self._share_unstated, self.gpus
        limit = 1.0 - min_room + 1e-9
        # gpus_by_utilisation's loop, inlined: a pass on a 6,504-GPU cluster pulls hundreds of
        # GPUs through here, and a nested generator doubled the cost of each (same order).
        for b, bucket in enumerate(self._buckets):
            if b / UTILISATION_BUCKETS >= below:
                return
            boundary = (b + 1) / UTILISATION_BUCKETS > below
            for gpu in bucket:
                if boundary and gpus[gpu].utilisation >= below:
                    continue
                # unstated is 0 by default: x + 0.0 * n == x exactly, so the count is skipped.
                committed = stated[gpu] + unstated * count[gpu] if unstated else stated[gpu]
                if committed <= limit:
                    yield gpu, 1.0 - committed

    def may_have_room(self, below: float, share: float, n: int) -> bool:
        """When the cluster is full, a request finds no room after reading every GPU below the
        threshold (4,800 per pass at the 20k run's peaks: most of the time of its placement);
        this says so at once. The counts are by the rung of the stated share, which never
        exceeds the committed one, and include the whole boundary bucket: an upper bound,
        summed only until it reaches n (usually within the least utilised bucket).
        """
        rungs = _rung(1.0 - share + 1e-9) + 1
        total = 0
        for b, counts in enumerate(self._rung_counts):
            if b / UTILISATION_BUCKETS >= below:
                return False
            total += sum(counts[:rungs])
            if total >= n:
                return True
        return False

    def first_with_room(self, below: float, share: float, unstated: float, demand: int, n: int,
                        skip: set[int], skip_too: set[int]) -> tuple[list[int], list[int]]:
        """One pass over the same order as `gpus_with_room`, for a scheduling pass with a single
        opportunistic job (98% of the passes of a 20k-job run): most GPUs it reads have room
        but not the memory, and a generator, a buffer and a method call per GPU cost 3x this.
        """
        stated, count, gpus, committed_mem = (self._share_stated, self._share_unstated, self.gpus,
                                              self._memory_committed)
        limit = 1.0 - share + 1e-9
        fits: list[int] = []
        tight: list[int] = []
        for b, bucket in enumerate(self._buckets):
            if b / UTILISATION_BUCKETS >= below:
                break
            boundary = (b + 1) / UTILISATION_BUCKETS > below
            for gpu in bucket:
                committed = stated[gpu] + unstated * count[gpu] if unstated else stated[gpu]
                if committed > limit or gpu in skip or gpu in skip_too:
                    continue  # most GPUs read end here: the cheapest test comes first
                if boundary and gpus[gpu].utilisation >= below:
                    continue
                if share > 1.0 - committed + 1e-9:
                    continue
                if gpus[gpu].memory_bytes - committed_mem[gpu] >= demand:
                    fits.append(gpu)
                    if len(fits) == n:
                        return fits, tight
                elif len(tight) < n:
                    tight.append(gpu)
        return fits, tight

    # -- snapshot -------------------------------------------------------------------------------

    def snapshot(self, now: float) -> ClusterState:
        gpus, jobs, tenants, reservations = self._views
        return ClusterState(now, gpus, jobs, tenants, reservations, self)

    # -- mutations ------------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        if job.id in self.jobs:
            raise BookError(f"job {job.id!r} submitted twice")
        if job.tenant not in self.tenants:
            raise BookError(f"job {job.id!r}: unknown tenant {job.tenant!r}")
        if job.state is not JobState.PENDING or job.role is not None or job.placement:
            job = _evolve(job, state=JobState.PENDING, role=None, placement=())  # else as it is: frozen
        self.jobs[job.id] = job
        self._enqueue(job)

    def update_hints(self, job_id: str, **hints: object) -> None:
        """Refresh reported statistics (step time, remaining time) of a job."""
        self.jobs[job_id] = _evolve(self.jobs[job_id], **hints)

    def set_memory_demand(self, job_id: str, demand_bytes: int) -> None:
        """A running job's memory demand changed (surge): committed memory follows."""
        job = self.jobs[job_id]
        for gpu in job.placement:
            self._memory_committed[gpu] += demand_bytes - job.memory_demand_bytes
        self.jobs[job_id] = _evolve(job, memory_demand_bytes=demand_bytes)

    def set_utilisation(self, gpu: int, utilisation: float) -> bool:
        """True if the reading changed the GPU's utilisation."""
        g = self.gpus[gpu]
        if g.utilisation == utilisation:
            return False
        self.gpus[gpu] = Gpu(g.id, g.node, g.memory_bytes, g.nvlink_group, utilisation)
        b = _bucket(utilisation)
        old = self._bucket_of[gpu]
        if b != old:
            del self._buckets[old][gpu]
            self._buckets[b][gpu] = None
            self._bucket_of[gpu] = b
            rung = self._rung_of[gpu]
            self._rung_counts[old][rung] -= 1
            self._rung_counts[b][rung] += 1
        return True

    def finish(self, job_id: str, failed: bool = False) -> None:
        """The job ended on its own: release everything it held."""
        job = self.jobs[job_id]
        if job.state is JobState.RUNNING:
            self._release(job)
        else:
            self._dequeue(job)
            self._drop_reservation(job_id)
        state = JobState.FAILED if failed else JobState.FINISHED
        self.jobs[job_id] = _ended(job, state, ())

    def apply(self, d: GlobalDecision | Migrate) -> None:
        match d:
            case Place():
                self._place(d)
            case Preempt():
                job = self._running_job(d.job_id)
                self._release(job)
                job = _evolve(job, state=JobState.PENDING, role=None, placement=())
                self.jobs[job.id] = job
                self._enqueue(job)
            case Reserve():
                self._reserve(d)
            case Unreserve():
                self._drop_reservation(d.job_id)
            case Upgrade():
                self._upgrade(d.job_id)
            case Migrate():
                job = self._running_job(d.job_id)
                self._release(job)
                self.jobs[job.id] = _evolve(job, state=JobState.PENDING, placement=())
                assert job.role is not None
                self._place(Place(job.id, d.gpus, job.role))
            case Reject():
                job = self.jobs[d.job_id]
                self._dequeue(job)
                self._drop_reservation(job.id)
                self.jobs[job.id] = _evolve(job, state=JobState.FAILED)
            case _:
                raise BookError(f"not a global decision: {d!r}")

    # -- internals ------------------------------------------------------------------------------

    def _running_job(self, job_id: str) -> Job:
        job = self.jobs[job_id]
        if job.state is not JobState.RUNNING:
            raise BookError(f"job {job_id!r} is {job.state}, not running")
        return job

    def _enqueue(self, job: Job) -> None:
        if job.kind is JobKind.OPPORTUNISTIC:
            self._pending_o[job.id] = None
        else:
            self._pending_g[job.tenant][job.id] = None

    def _dequeue(self, job: Job) -> None:
        self._pending_o.pop(job.id, None)
        self._pending_g[job.tenant].pop(job.id, None)

    def _refresh_free(self, gpu: int) -> None:
        group = self.gpus[gpu].nvlink_group
        reserved = gpu in self._reserved
        self._guarantee_free.set_free(group, gpu, gpu not in self._holder and not reserved)
        self._empty.set_free(group, gpu, not self._jobs_on[gpu] and not reserved)

    def _place(self, d: Place) -> None:
        job = self.jobs[d.job_id]
        if job.state is not JobState.PENDING:
            raise BookError(f"place {job.id!r}: job is {job.state}")
        if len(d.gpus) != job.num_gpus or len(set(d.gpus)) != job.num_gpus:
            raise BookError(f"place {job.id!r}: {len(d.gpus)} GPUs for a {job.num_gpus}-GPU job")
        self._drop_reservation(job.id)
        for gpu in d.gpus:
            if gpu not in self.gpus:
                raise BookError(f"place {job.id!r}: unknown GPU {gpu}")
            if d.role is Role.GUARANTEE:
                if gpu in self._holder:
                    raise BookError(f"place {job.id!r}: GPU {gpu} held by {self._holder[gpu]!r}")
                if gpu in self._reserved:
                    raise BookError(f"place {job.id!r}: GPU {gpu} reserved for another job")
        self._dequeue(job)
        job = _placed(job, JobState.RUNNING, d.role, tuple(d.gpus))
        self.jobs[job.id] = job
        for gpu in d.gpus:
            if d.role is Role.GUARANTEE:
                self._holder[gpu] = job.id
            self._jobs_on[gpu][job.id] = None
            self._memory_committed[gpu] += job.memory_demand_bytes
            self._commit_share(gpu, job, 1)
            self._refresh_free(gpu)
        self._running[(job.tenant, d.role)][job.id] = None
        if d.role is Role.GUARANTEE:
            self._quota_used[job.tenant] += job.num_gpus
        elif job.kind is JobKind.AUTO:
            self._upgradable[job.tenant][job.id] = None

    def _release(self, job: Job) -> None:
        role = job.role
        assert role is not None
        for gpu in job.placement:
            if self._holder.get(gpu) == job.id:
                del self._holder[gpu]
            del self._jobs_on[gpu][job.id]
            self._memory_committed[gpu] -= job.memory_demand_bytes
            self._commit_share(gpu, job, -1)
            self._refresh_free(gpu)
        del self._running[(job.tenant, role)][job.id]
        self._upgradable[job.tenant].pop(job.id, None)
        if role is Role.GUARANTEE:
            self._quota_used[job.tenant] -= job.num_gpus

    def _commit_share(self, gpu: int, job: Job, sign: int) -> None:
        if job.requested_share is None:
            self._share_unstated[gpu] += sign
            return
        if self._jobs_on[gpu]:
            self._share_stated[gpu] += sign * job.requested_share
        else:
            self._share_stated[gpu] = 0.0  # no job left: no float residue
        rung = _rung(self._share_stated[gpu])
        old = self._rung_of[gpu]
        if rung != old:
            counts = self._rung_counts[self._bucket_of[gpu]]
            counts[old] -= 1
            counts[rung] += 1
            self._rung_of[gpu] = rung

    def _reserve(self, d: Reserve) -> None:
        job = self.jobs[d.job_id]
        if job.state is not JobState.PENDING:
            raise BookError(f"reserve for {job.id!r}: job is {job.state}")
        self._drop_reservation(job.id)
        for gpu in d.gpus:
            if gpu in self._holder or self._reserved.get(gpu, job.id) != job.id:
                raise BookError(f"reserve for {job.id!r}: GPU {gpu} is not free for guarantee")
        self.reservations[job.id] = tuple(d.gpus)
        for gpu in d.gpus:
            self._reserved[gpu] = job.id
            self._refresh_free(gpu)

    def _drop_reservation(self, job_id: str) -> None:
        gpus = self.reservations.pop(job_id, ())
        for gpu in gpus:
            del self._reserved[gpu]
            self._refresh_free(gpu)

    def _upgrade(self, job_id: str) -> None:
        job = self._running_job(job_id)
        if job.role is not Role.OPPORTUNISTIC or job.kind is JobKind.OPPORTUNISTIC:
            raise BookError(f"upgrade {job_id!r}: not an upgradable opportunistic job")
        for gpu in job.placement:
            if gpu in self._holder or self._reserved.get(gpu, job_id) != job_id:
                raise BookError(f"upgrade {job_id!r}: GPU {gpu} not free for guarantee")
        del self._running[(job.tenant, Role.OPPORTUNISTIC)][job_id]
        self._upgradable[job.tenant].pop(job_id, None)
        self._running[(job.tenant, Role.GUARANTEE)][job_id] = None
        self._quota_used[job.tenant] += job.num_gpus
        self.jobs[job_id] = _evolve(job, role=Role.GUARANTEE)
        for gpu in job.placement:
            self._holder[gpu] = job_id
            self._refresh_free(gpu)


# dataclasses.replace without its checks (~80k book updates in a 20k-job simulation),
# and the two most frequent updates (40k) without even _evolve's tests of which fields changed.
_evolve = replacer(Job)
_placed = replacer(Job, "state", "role", "placement")
_ended = replacer(Job, "state", "placement")


def _bucket(utilisation: float) -> int:
    # Comparisons, not min(max()): two builtin calls fewer on every utilisation reading.
    b = int(utilisation * UTILISATION_BUCKETS)
    return UTILISATION_BUCKETS - 1 if b >= UTILISATION_BUCKETS else (b if b > 0 else 0)


def _rung(share: float) -> int:
    """Monotone in `share` (a float residue below 0 counts as 0, anything above 1 as 1)."""
    r = int(share * SHARE_RUNGS)
    return SHARE_RUNGS if r > SHARE_RUNGS else (r if r > 0 else 0)
