"""The typed snapshot every scheduler_lite policy reads, and the decisions it returns.

Units are fixed here, once: memory in bytes (int), time in seconds (float, any epoch the caller
chooses, as long as it is consistent), compute shares and utilisation as fractions of one GPU in
[0, 1].

A policy never mutates what it is given: the snapshot classes are frozen, and the
`ClusterState.index` is typed as the read-only `ClusterQueries` protocol. The bookkeeping that
applies decisions and keeps the indexes current lives in `scheduler_lite.policy.book`.

Decisions are plain records; they carry no undo. The one reversal a policy performs (the
coordinator taking back a memory trial) is a new `SetMemoryLimit` built by `reverted()`, which is
exact because the decision records the limit it replaced. The driver (scheduler_lite.driver)
applies decisions; a caller that fails to carry one out releases what it booked
(`Driver.finish`), it does not replay inverses.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from scheduler_lite.frozen import quick_init

GIB = 1 << 30


class JobKind(enum.StrEnum):
    """What the user asked for at submission."""

    GUARANTEE = "guarantee"  # consumes tenant quota, exclusive of other guarantee jobs
    OPPORTUNISTIC = "opportunistic"  # never consumes quota, never upgraded
    AUTO = "auto"  # guarantee unless its estimated queueing delay is long; may be upgraded


class Role(enum.StrEnum):
    """How a placed job actually runs."""

    GUARANTEE = "guarantee"
    OPPORTUNISTIC = "opportunistic"


class JobState(enum.StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    gpu_quota: int  # GPUs its guarantee jobs may hold at once


@quick_init
@dataclass(frozen=True, slots=True)
class Gpu:
    id: int
    node: str
    memory_bytes: int
    # GPUs sharing a group talk over NVLink; a gang that fits in one group is placed inside it.
    nvlink_group: str
    utilisation: float = 0.0  # SM utilisation averaged over the last 10 s


@quick_init
@dataclass(frozen=True, slots=True)
class Job:
    id: str
    tenant: str
    num_gpus: int
    kind: JobKind
    submit_time: float
    state: JobState = JobState.PENDING
    role: Role | None = None  # set once placed
    placement: tuple[int, ...] = ()
    memory_demand_bytes: int = 0  # peak memory it wants on each of its GPUs
    mean_step_time_s: float | None = None  # reported by the framework once running
    # Optional hints: remaining run time reported by the job (used to estimate queueing delay)
    # and a predicted total run time (used by the shortest-predicted-first variant).
    estimated_remaining_s: float | None = None
    predicted_runtime_s: float | None = None
    # Fraction of one GPU's compute the job asks for (PAI's GPU request, Alibaba's gpu_milli);
    # None: not stated. Opportunistic placement adds these up per GPU (global_scheduler.py).
    requested_share: float | None = None


class ClusterQueries(Protocol):
    """Read-only questions the global scheduler asks; answered from incremental indexes."""

    def pending_guarantee_queue(self, tenant: str) -> Collection[str]:
        """Pending guarantee and auto jobs of a tenant, oldest first (a live view)."""
        ...

    def pending_opportunistic_queue(self) -> Collection[str]:
        """Pending jobs submitted as opportunistic, all tenants, oldest first (a live view)."""
        ...

    def quota_used(self, tenant: str) -> int:
        """GPUs held by the tenant's running guarantee jobs."""
        ...

    def running_jobs(self, tenant: str, role: Role) -> Sequence[str]: ...

    def upgradable_jobs(self, tenant: str) -> Sequence[str]:
        """Running opportunistic jobs of the tenant that were submitted as auto."""
        ...

    def guarantee_holder(self, gpu: int) -> str | None: ...

    def reserved_for(self, gpu: int) -> str | None: ...

    def free_for_guarantee(self, group: str) -> frozenset[int] | set[int]:
        """GPUs of a group held by no guarantee job and reserved for nobody."""
        ...

    def groups_with_free_count(self, count: int) -> Sequence[str]:
        """NVLink groups with exactly `count` GPUs free for guarantee jobs."""
        ...

    def largest_group_size(self) -> int: ...

    def gpus_by_utilisation(self, below: float) -> Iterator[int]:
        """GPUs with utilisation < `below`, least loaded first (5% granularity)."""
        ...

    def memory_free(self, gpu: int) -> int:
        """GPU memory minus the memory demands of the jobs placed on it."""
        ...

    def gpus_with_room(self, below: float, min_room: float, unstated: float) -> Iterator[tuple[int, float]]:
        """(GPU, 1 - committed share) for GPUs below `below` utilisation with at least
        `min_room` share room, least loaded first (gpus_by_utilisation's order). The committed
        share is the sum of `requested_share` of the GPU's jobs, `unstated` for each without one."""
        ...

    def may_have_room(self, below: float, share: float, n: int) -> bool:
        """False only if `gpus_with_room(below, share, unstated)` yields fewer than n GPUs (any
        `unstated` >= 0); answered without visiting GPUs."""
        ...

    def first_with_room(self, below: float, share: float, unstated: float, demand: int, n: int,
                        skip: set[int], skip_too: set[int]) -> tuple[list[int], list[int]]:
        """In `gpus_with_room(below, share, unstated)` order, less `skip` and `skip_too`: the
        first n GPUs with `demand` bytes free (fits), and the first n without them (tight),
        stopping at n fits."""
        ...

    def empty_gpus(self, group: str) -> frozenset[int] | set[int]:
        """GPUs of a group with no job at all and no reservation."""
        ...

    def groups_with_empty_count(self, count: int) -> Sequence[str]:
        """NVLink groups with exactly `count` empty GPUs (no job, no reservation)."""
        ...


@quick_init
@dataclass(frozen=True, slots=True)
class ClusterState:
    """One consistent snapshot: what the global scheduler sees at time `now`."""

    now: float
    gpus: Mapping[int, Gpu]
    jobs: Mapping[str, Job]
    tenants: Mapping[str, Tenant]
    reservations: Mapping[str, tuple[int, ...]]  # job id -> GPUs held for its gang
    index: ClusterQueries


# ----------------------------------------------------------------------------------------------
# Decisions. Frozen so that a batch can be logged and compared (daemon vs simulator).


@quick_init
@dataclass(frozen=True, slots=True)
class Place:
    """Start a job on these GPUs in this role (drops any reservation the job held)."""

    job_id: str
    gpus: tuple[int, ...]
    role: Role


@dataclass(frozen=True, slots=True)
class Preempt:
    """Kill a running job and put it back in its queue (YARN-CS with preemption)."""

    job_id: str


@dataclass(frozen=True, slots=True)
class Reserve:
    """Hold these GPUs for a gang that cannot start yet; replaces the job's previous hold."""

    job_id: str
    gpus: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Unreserve:
    job_id: str


@dataclass(frozen=True, slots=True)
class Upgrade:
    """Opportunistic job becomes a guarantee job in place and consumes its tenant's quota."""

    job_id: str


@dataclass(frozen=True, slots=True)
class Reject:
    """The job can never run under this configuration (e.g. wants more GPUs than its quota)."""

    job_id: str
    reason: str


@quick_init
@dataclass(frozen=True, slots=True)
class SetMemoryLimit:
    job_id: str
    gpu: int
    limit_bytes: int
    previous_bytes: int

    def reverted(self) -> SetMemoryLimit:
        """Back to the limit this one replaced (the coordinator's failed memory trial)."""
        return SetMemoryLimit(self.job_id, self.gpu, self.previous_bytes, self.limit_bytes)


@quick_init
@dataclass(frozen=True, slots=True)
class SetComputeShare:
    job_id: str
    gpu: int
    share: float
    previous: float


GlobalDecision = Place | Preempt | Reserve | Unreserve | Upgrade | Reject
LocalDecision = SetMemoryLimit | SetComputeShare
Decision = GlobalDecision | LocalDecision


# ----------------------------------------------------------------------------------------------
# What the local coordinator sees of one GPU.


@quick_init
@dataclass(frozen=True, slots=True)
class StepSample:
    ended_at: float
    seconds: float


@quick_init
@dataclass(frozen=True, slots=True)
class LocalJob:
    job_id: str
    role: Role
    memory_demand_bytes: int  # what it would use with no limit
    memory_limit_bytes: int
    host_spill_bytes: int  # bytes universal memory currently keeps in host memory
    compute_share: float
    steps: tuple[StepSample, ...] = ()  # recent mini-batches, oldest first
    solo_step_time_s: float | None = None  # step time alone on a GPU, when known


@quick_init
@dataclass(frozen=True, slots=True)
class GpuView:
    gpu: Gpu
    jobs: tuple[LocalJob, ...]
    # Device memory seen on the GPU that no job's limit controls (NVML: a process of no job, the
    # bytes a job holds above its limit; scheduler_lite.misbehaviour): counted as taken.
    unmanaged_bytes: int = 0
