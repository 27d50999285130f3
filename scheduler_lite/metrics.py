"""Prometheus metrics of the daemon (`scheduler-lite serve --metrics-port PORT`).

Every scrape reads the latest status snapshot the daemon published (scheduler_lite.server: after
each tick and on every `status` request), the very object `status --json` prints, so the two agree
whenever `scheduler_lite_status_time_seconds` equals the `time` of a `status --json`. A value the
status does not have (no statistics from a job yet) is left out, not reported as 0.

prometheus_client is an optional dependency (`pip install tf-antman[metrics]`); without it,
`--metrics-port` stops the daemon at start with one line saying so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

from scheduler_lite.status import ClusterStatus

PREFIX: Final = "scheduler_lite"
# name, help, labels (docs/scheduler.md, "Metrics", lists the same)
GPU_METRICS: Final = (
    ("gpu_memory_bytes", "Device memory of the GPU"),
    ("gpu_utilisation_ratio", "GPU utilisation averaged over daemon.utilisation_window_s (0..1)"),
)
JOB_METRICS: Final = (
    ("job_memory_limit_bytes", "Device memory limit in force, as the job reports it"),
    ("job_memory_in_use_bytes", "Bytes of live tensors on the device"),
    ("job_host_memory_bytes", "Bytes of the job's tensors served from host memory past its limit"),
    ("job_host_fallbacks", "Allocations served from host memory since the job started"),
    ("job_compute_share", "Compute share in force (0..1)"),
    ("job_achieved_share", "Share of the device's compute the job actually used (0..1)"),
    ("job_step_seconds", "Median training step time over the job's recent window"),
)


class MetricsUnavailable(RuntimeError):
    pass


class StatusCollector:
    """A prometheus_client collector over `snapshot()` (None before the first tick: no samples)."""

    def __init__(self, snapshot: Callable[[], ClusterStatus | None]) -> None:
        self.snapshot = snapshot

    def describe(self) -> list[Any]:
        return []  # values are produced at scrape time only

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        status = self.snapshot()
        if status is None:
            return

        def family(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)

        when = family("status_time_seconds", "Time of the status snapshot these samples come from", [])
        when.add_metric([], status.time)
        yield when
        gpu = {name: family(name, doc, ["gpu"]) for name, doc in GPU_METRICS}
        job = {name: family(name, doc, ["job", "gpu", "tenant", "role"]) for name, doc in JOB_METRICS}
        state = family("job_state", "1 for the job's state (running or queued)", ["job", "tenant", "state"])
        for g in status.gpus:
            gpu["gpu_memory_bytes"].add_metric([str(g.id)], g.memory_bytes)
            if g.utilisation is not None:
                gpu["gpu_utilisation_ratio"].add_metric([str(g.id)], g.utilisation)
            for j in g.jobs:
                labels = [j.job_id, str(g.id), j.tenant, str(j.role)]
                step_s = None if j.step_ms_median is None else j.step_ms_median / 1000.0
                for name, value in (
                    ("job_memory_limit_bytes", j.memory_limit_bytes), ("job_memory_in_use_bytes", j.in_use_bytes),
                    ("job_host_memory_bytes", j.host_in_use_bytes), ("job_host_fallbacks", j.host_fallbacks),
                    ("job_compute_share", j.compute_share), ("job_achieved_share", j.achieved_share),
                    ("job_step_seconds", step_s),
                ):
                    if value is not None:
                        job[name].add_metric(labels, value)
        tenant_of = {j.job_id: j.tenant for g in status.gpus for j in g.jobs}
        for job_id in status.running:
            state.add_metric([job_id, tenant_of.get(job_id, ""), "running"], 1)
        queued = family("tenant_queued_jobs", "Jobs of the tenant waiting in the queue", ["tenant"])
        used = family("tenant_quota_used_gpus", "GPUs held by the tenant's guarantee jobs", ["tenant"])
        quota = family("tenant_quota_gpus", "The tenant's GPU quota", ["tenant"])
        running = family("tenant_running_jobs", "Running jobs of the tenant", ["tenant"])
        for t in status.tenants:
            queued.add_metric([t.name], t.queued)
            used.add_metric([t.name], t.quota_used)
            quota.add_metric([t.name], t.gpu_quota)
            running.add_metric([t.name], t.running)
        for job_id in status.queued:
            state.add_metric([job_id, "", "queued"], 1)
        yield from gpu.values()
        yield from job.values()
        yield from (state, queued, used, quota, running)


def start_metrics_server(port: int, address: str, snapshot: Callable[[], ClusterStatus | None],
                         extra: Sequence[object] = ()) -> Callable[[], None]:
    """Serve /metrics on address:port from a thread; returns a function that stops it. `extra`:
    more collectors (the socket server's: jobs that do not cooperate, containment)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise MetricsUnavailable(f"--metrics-port {port!r} is invalid: accepted an integer in [1, 65535]")
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise MetricsUnavailable("--metrics-port needs prometheus_client: pip install 'tf-antman[metrics]' "
                                 "(or prometheus_client)") from None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(snapshot))  # type: ignore[arg-type]
    for collector in extra:
        registry.register(collector)  # type: ignore[arg-type]
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
