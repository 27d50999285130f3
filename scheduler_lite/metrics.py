"""Prometheus metrics of the daemon (`scheduler-lite serve --metrics-port PORT`).

Every scrape reads the latest status snapshot the daemon published (scheduler_lite.server: after
each tick and on every `status` request), the very object `status --json` prints, so the two agree
whenever `scheduler_lite_status_time_seconds` equals the `time` of a `status --json`. A value the
status does not have (no statistics from a job yet) is left out, not reported as 0.

prometheus_client is an optional dependency (`pip install tf-antman[metrics]`); without it,
`--metrics-port` stops the daemon at start with one line saying so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from scheduler_lite.server import Server

PREFIX: Final = "scheduler_lite"
# name, help, what it reads (docs/scheduler.md, "Metrics", lists the same)
GPU_METRICS: Final = (
    ("gpu_memory_bytes", "Device memory of the GPU"),
    ("gpu_utilisation_ratio", "GPU utilisation averaged over daemon.utilisation_window_s (0..1)"),
)
JOB_METRICS: Final = (  # the JobOnGpu field; step_ms_median is reported in seconds
    ("job_memory_limit_bytes", "Device memory limit in force, as the job reports it", "memory_limit_bytes"),
    ("job_memory_in_use_bytes", "Bytes of live tensors on the device", "in_use_bytes"),
    ("job_host_memory_bytes", "Bytes of the job's tensors served from host memory past its limit",
     "host_in_use_bytes"),
    ("job_host_fallbacks", "Allocations served from host memory since the job started", "host_fallbacks"),
    ("job_compute_share", "Compute share in force (0..1)", "compute_share"),
    ("job_achieved_share", "Share of the device's compute the job actually used (0..1)", "achieved_share"),
    ("job_step_seconds", "Median training step time over the job's recent window", "step_ms_median"),
)
TENANT_METRICS: Final = (  # the TenantStatus field
    ("tenant_queued_jobs", "Jobs of the tenant waiting in the queue", "queued"),
    ("tenant_quota_used_gpus", "GPUs held by the tenant's guarantee jobs", "quota_used"),
    ("tenant_quota_gpus", "The tenant's GPU quota", "gpu_quota"),
    ("tenant_running_jobs", "Running jobs of the tenant", "running"),
)


class MetricsUnavailable(RuntimeError):
    pass


class StatusCollector:
    """A prometheus_client collector over the socket server's copies, made on the daemon's thread:
    its status snapshot (None before the first tick: no samples), the jobs that do not cooperate
    (`scheduler_lite_job_misbehaving{job, check}`, misbehaviour.py) and whether jobs are contained
    (`scheduler_lite_containment_active`: 1 each job in a cgroup, 0 not contained)."""

    def __init__(self, server: Callable[[], Server | None]) -> None:
        self.server = server

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        server = self.server()
        if server is None or server.snapshot is None:
            return
        status = server.snapshot

        def family(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)

        when = family("status_time_seconds", "Time of the status snapshot these samples come from", [])
        when.add_metric([], status.time)
        yield when
        gpu = {name: family(name, doc, ["gpu"]) for name, doc in GPU_METRICS}
        job = {name: family(name, doc, ["job", "gpu", "tenant", "role"]) for name, doc, _ in JOB_METRICS}
        state = family("job_state", "1 for the job's state (running or queued)", ["job", "tenant", "state"])
        for g in status.gpus:
            gpu["gpu_memory_bytes"].add_metric([str(g.id)], g.memory_bytes)
            if g.utilisation is not None:
                gpu["gpu_utilisation_ratio"].add_metric([str(g.id)], g.utilisation)
            for j in g.jobs:
                labels = [j.job_id, str(g.id), j.tenant, str(j.role)]
                for name, _, field in JOB_METRICS:
                    value = getattr(j, field)
                    if value is not None:
                        job[name].add_metric(labels, value / 1000.0 if field == "step_ms_median" else value)
        tenant_of = {j.job_id: j.tenant for g in status.gpus for j in g.jobs}
        for job_id in status.running:
            state.add_metric([job_id, tenant_of.get(job_id, ""), "running"], 1)
        for job_id in status.queued:
            state.add_metric([job_id, "", "queued"], 1)
        tenant = {name: family(name, doc, ["tenant"]) for name, doc, _ in TENANT_METRICS}
        for t in status.tenants:
            for name, _, field in TENANT_METRICS:
                tenant[name].add_metric([t.name], getattr(t, field))
        yield from gpu.values()
        yield from job.values()
        yield state
        yield from tenant.values()
        bad = family("job_misbehaving", "1 while a job does not cooperate (the check that found it: "
                     "rejects_controls, silent, impossible, ...)", ["job", "check"])
        for job_id, check in server.findings:
            bad.add_metric([job_id, check], 1)
        yield bad
        if server.contained is not None:
            contained = family("containment_active",
                               "1 when each job runs in a cgroup of its own, 0 when jobs are not contained", [])
            contained.add_metric([], 1 if server.contained else 0)
            yield contained


def start_metrics_server(port: int, address: str, server: Callable[[], Server | None]) -> Callable[[], None]:
    """Serve /metrics on address:port from a thread; returns a function that stops it."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise MetricsUnavailable(f"--metrics-port {port!r} is invalid: accepted an integer in [1, 65535]")
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise MetricsUnavailable("--metrics-port needs prometheus_client: pip install 'tf-antman[metrics]' "
                                 "(or prometheus_client)") from None
    registry = CollectorRegistry(auto_describe=False)  # the collector has no describe(): samples exist at scrape time only
    registry.register(StatusCollector(server))  # type: ignore[arg-type]
    try:
        server, thread = start_http_server(port, addr=address, registry=registry)
    except OSError as e:
        raise MetricsUnavailable(f"--metrics-port {port}: cannot listen on {address}: {e.strerror or e}") from None

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5)

    return stop


__all__ = ["MetricsUnavailable", "StatusCollector", "start_metrics_server"]
