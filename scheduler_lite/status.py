"""`scheduler-lite status`: what runs where, from the store and the jobs' own statistics.

The limit and compute share shown are the ones the job reports in force (its stats.json), not
what the daemon last decided: a job that has not applied a control yet shows its old settings,
the daemon's decision next to them (`target_*`), and how many control files are pending.
The daemon builds it (`Daemon.status`), with utilisation, coordinator phases and reservations;
the CLI prints the daemon's answer (scheduler_lite.client.cluster_status).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scheduler_lite.config import Config
from scheduler_lite.model import Gpu, Role
from scheduler_lite.storage import JobStatus, Storage
from tf_antman.protocol import Stats


@dataclass(frozen=True, slots=True)
class JobOnGpu:
    job_id: str
    tenant: str
    role: Role
    # In force, as the job's stats report them; None until its first stats.json.
    memory_limit_bytes: int | None
    compute_share: float | None
    # The daemon's latest decision (the placements table); equal to the above once applied.
    target_memory_limit_bytes: int | None = None
    target_compute_share: float | None = None
    controls_pending: int = 0  # control.json seqs written that the job has not applied yet
    in_use_bytes: int | None = None  # None: no stats yet
    host_in_use_bytes: int | None = None  # kept in host memory past the limit
    host_fallbacks: int | None = None
    step: int | None = None
    last_step_ms: float | None = None
    step_ms_median: float | None = None
    achieved_share: float | None = None
    stats_error: str | None = None  # why the last stats.json was refused
    # Since its process now running was launched (None: not known): a migrated job's new process
    # counts from its new launch (how long it has run without stats.json), not from its first.
    running_s: float | None = None
    # How old its stats.json is (the job writes it at its steps, and every few seconds while
    # paused), and whether it says paused: a job held at share 0 writes nothing, and its last
    # step time would otherwise look like a healthy one.
    stats_age_s: float | None = None
    paused: bool = False


# JobOnGpu's fields read as they are from the job's stats (and from its entry for this device).
STATS_FIELDS = ("compute_share", "step", "last_step_ms", "step_ms_median", "achieved_share")
DEVICE_FIELDS = ("in_use_bytes", "host_in_use_bytes", "host_fallbacks")


@dataclass(frozen=True, slots=True)
class GpuStatus:
    id: int
    memory_bytes: int
    nvlink_group: str
    utilisation: float | None  # averaged over daemon.utilisation_window_s; None outside the daemon
    jobs: tuple[JobOnGpu, ...]
    reserved_for: str | None = None
    coordinator_phase: str | None = None
    node: str | None = None  # the machine it is on (cluster mode groups GPUs by node)

    def job(self, job_id: str) -> JobOnGpu | None:
        return next((j for j in self.jobs if j.job_id == job_id), None)


@dataclass(frozen=True, slots=True)
class TenantStatus:
    name: str
    gpu_quota: int
    quota_used: int  # GPUs of its running guarantee jobs
    running: int
    queued: int


@dataclass(frozen=True, slots=True)
class ClusterStatus:
    time: float
    gpus: tuple[GpuStatus, ...]
    tenants: tuple[TenantStatus, ...]
    queued: tuple[str, ...]
    running: tuple[str, ...]
    # Cluster mode: configured nodes whose agent is not connected (their GPUs are not served).
    absent_nodes: tuple[str, ...] = ()

    def gpu(self, gpu_id: int) -> GpuStatus:
        return next(g for g in self.gpus if g.id == gpu_id)


def build_status(
    config: Config,
    storage: Storage,
    gpus: Sequence[Gpu],
    now: float,
    stats: Mapping[str, tuple[Stats | None, str | None]],
    utilisation: Mapping[int, float],
    phases: Mapping[int, str],
    reservations: Mapping[str, tuple[int, ...]],
) -> ClusterStatus:
    """Per GPU: its jobs with limits and shares in force, memory in use, host fallback, step times.
    `stats`: the daemon's newest read of each running job's stats, or why it was refused."""
    running = storage.list_jobs([JobStatus.RUNNING])
    queued = storage.list_jobs([JobStatus.QUEUED])
    settings = {(p.job_id, p.gpu): p for p in storage.placements()}
    reserved_for = {g: j for j, gs in reservations.items() for g in gs}
    per_gpu: dict[int, list[JobOnGpu]] = {g.id: [] for g in gpus}
    for record in running:
        found, error = stats.get(record.id, (None, None))
        applied = 0 if found is None else found.control_seq_applied
        launched = record.launched_at if record.launched_at is not None else record.started_at  # before schema 5
        for index, gpu in enumerate(record.placement):
            if gpu not in per_gpu:
                continue
            setting = settings.get((record.id, gpu))
            device = None if found is None else next((d for d in found.devices if d.device == index), None)
            per_gpu[gpu].append(JobOnGpu(
                job_id=record.id, tenant=record.tenant, role=record.role or Role.OPPORTUNISTIC,
                memory_limit_bytes=None if device is None else device.limit_bytes,
                target_memory_limit_bytes=setting.memory_limit_bytes if setting else None,
                target_compute_share=setting.compute_share if setting else None,
                controls_pending=max(0, record.control_seq - applied),
                **{name: None if device is None else getattr(device, name) for name in DEVICE_FIELDS},
                **{name: None if found is None else getattr(found, name) for name in STATS_FIELDS},
                stats_error=error,
                running_s=None if launched is None else max(0.0, now - launched),
                stats_age_s=None if found is None or found.wall_time <= 0 else max(0.0, now - found.wall_time),
                paused=found is not None and found.state == "paused",
            ))
    gpu_status = tuple(
        GpuStatus(g.id, g.memory_bytes, g.nvlink_group, utilisation.get(g.id), tuple(per_gpu[g.id]),
                  reserved_for.get(g.id), phases.get(g.id), g.node)
        for g in gpus
    )
    tenants = []
    quotas = {t.name: t.gpu_quota for t in config.tenants}
    for name in sorted(set(quotas) | {r.tenant for r in running} | {r.tenant for r in queued}):
        mine = [r for r in running if r.tenant == name]
        tenants.append(TenantStatus(
            name, quotas.get(name, 0),
            sum(r.num_gpus for r in mine if r.role is Role.GUARANTEE),
            len(mine), sum(1 for r in queued if r.tenant == name),
        ))
    return ClusterStatus(now, gpu_status, tuple(tenants), tuple(r.id for r in queued), tuple(r.id for r in running))


__all__ = ["ClusterStatus", "GpuStatus", "JobOnGpu", "TenantStatus", "build_status"]
