"""Small builders for policy tests."""

from __future__ import annotations

from scheduler_lite.model import GIB, Gpu, Job, JobKind, Tenant
from scheduler_lite.policy.book import ClusterBook


def book(nodes: int = 2, per_node: int = 4, quotas: dict[str, int] | None = None) -> ClusterBook:
    gpus = [Gpu(n * per_node + i, f"n{n}", 32 * GIB, f"n{n}") for n in range(nodes) for i in range(per_node)]
    tenants = [Tenant(t, q) for t, q in (quotas or {"A": nodes * per_node, "B": 0}).items()]
    return ClusterBook(gpus, tenants)


def job(jid: str, tenant: str = "A", gpus: int = 1, kind: JobKind = JobKind.GUARANTEE, t: float = 0.0) -> Job:
    return Job(id=jid, tenant=tenant, num_gpus=gpus, kind=kind, submit_time=t, memory_demand_bytes=8 * GIB)
