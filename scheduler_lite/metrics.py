"""Prometheus metrics of the daemon (`scheduler-lite serve --metrics-port PORT`).

Every scrape reads the latest status snapshot the daemon published (scheduler_lite.server: after
each tick and on every `status` request), the very object `status --json` prints, so the two agree
whenever `scheduler_lite_status_time_seconds` equals the `time` of a `status --json`. A value the
status does not have (no statistics from a job yet) is left out, not reported as 0.

prometheus_client is an optional dependency (`pip install tf-antman[metrics]`); without it,
`--metrics-port` stops the daemon at start with one line saying so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from scheduler_lite.server import Server

PREFIX: Final = "scheduler_lite"
# name, help, what it reads (docs/scheduler.md, "Metrics", lists the same)
GPU_METRICS: Final = (  # the GpuStatus field
    ("gpu_memory_bytes", "Device memory of the GPU", "memory_bytes"),
    ("gpu_utilisation_ratio", "GPU utilisation averaged over daemon.utilisation_window_s (0..1)", "utilisation"),
)
# The JobOnGpu field, then how many of its units make one of the metric's: a divisor, not a factor,
# since 1e-3 is inexact in binary (9 * 1e-3 is 0.009000000000000001, 9 / 1000 is 0.009).
JOB_METRICS: Final = (
    ("job_memory_limit_bytes", "Device memory limit in force, as the job reports it", "memory_limit_bytes", 1),
    ("job_memory_in_use_bytes", "Bytes of live tensors on the device", "in_use_bytes", 1),
    ("job_host_memory_bytes", "Bytes of the job's tensors served from host memory past its limit",
     "host_in_use_bytes", 1),
    ("job_host_fallbacks", "Allocations served from host memory since the job started", "host_fallbacks", 1),
    ("job_compute_share", "Compute share in force (0..1)", "compute_share", 1),
    ("job_achieved_share", "Share of the device's compute the job actually used (0..1)", "achieved_share", 1),
    ("job_step_seconds", "Median training step time over the job's recent window", "step_ms_median", 1000),
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

        def family(name: str, doc: str, labels: list[str],
                   samples: Iterable[tuple[list[str], float | None]]) -> GaugeMetricFamily:
            """The gauge with a sample per (label values, value); a value the status lacks (None) is left out."""
            gauge = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)
            for values, value in samples:
                if value is not None:
                    gauge.add_metric(values, value)
            return gauge

        yield family("status_time_seconds", "Time of the status snapshot these samples come from", [],
                     [([], status.time)])
        for name, doc, field in GPU_METRICS:
            yield family(name, doc, ["gpu"], (([str(g.id)], getattr(g, field)) for g in status.gpus))
        on_gpus = [([j.job_id, str(g.id), j.tenant, str(j.role)], j) for g in status.gpus for j in g.jobs]
        for name, doc, field, per_unit in JOB_METRICS:
            values = ((labels, getattr(j, field)) for labels, j in on_gpus)
            yield family(name, doc, ["job", "gpu", "tenant", "role"],
                         ((labels, None if v is None else v / per_unit) for labels, v in values))
        tenant_of = {j.job_id: j.tenant for _, j in on_gpus}
        yield family("job_state", "1 for the job's state (running or queued)", ["job", "tenant", "state"],
                     [*(([job_id, tenant_of.get(job_id, ""), "running"], 1) for job_id in status.running),
                      *(([job_id, "", "queued"], 1) for job_id in status.queued)])
        for name, doc, field in TENANT_METRICS:
            yield family(name, doc, ["tenant"], (([t.name], getattr(t, field)) for t in status.tenants))
        yield family("job_misbehaving", "1 while a job does not cooperate (the check that found it: "
                     "rejects_controls, silent, impossible, ...)", ["job", "check"],
                     (([job_id, check], 1) for job_id, check in server.findings))
        if server.contained is not None:
            yield family("containment_active", "1 when each job runs in a cgroup of its own, 0 when jobs are not "
                         "contained", [], [([], 1 if server.contained else 0)])


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
