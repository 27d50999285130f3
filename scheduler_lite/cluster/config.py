"""The `[cluster]` table of the scheduler's config (docs/cluster.md, "`[cluster]` keys").

    [cluster]
    kind = "ray"
    address = "auto"              # what ray.init(address=...) gets
    nodes = ["gpu-a", "gpu-b"]    # one node host each, where Ray resource "antman_node_<name>" is

Parsed without importing Ray: a config with a bad `[cluster]` table is refused with the field and
its accepted range on any machine, and the single-machine path never imports Ray.

GPU ids are global: GPU `l` of node number `i` (its position in `nodes`) is `i * GPU_ID_STRIDE + l`,
so the store's placements stay meaningful across restarts and node losses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from scheduler_lite.policy.validation import ConfigError, check_choice, check_name, check_range

CLUSTER_KINDS: Final = ("ray",)
ON_NODE_LOSS: Final = ("requeue", "fail")
GPU_ID_STRIDE: Final = 100  # node i holds global GPU ids [i * 100, i * 100 + 99]
MAX_NODES: Final = 64
NODE_RESOURCE_PREFIX: Final = "antman_node_"
FENCE_FRACTION: Final = 0.5  # of node_timeout_s: a node actor stops its jobs before the global requeues them
REPORT_WAIT_S: Final = 2.0  # a tick waits this long at most for the nodes' reports
_KEYS: Final = ("kind", "address", "namespace", "nodes", "span_tenants", "on_node_loss", "jobs_dir",
                "node_timeout_s")


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    kind: str  # "ray"
    address: str  # ray.init(address=...): "auto", "ray://host:10001", "host:6379"
    nodes: tuple[str, ...]  # node names, in GPU id order (GPU_ID_STRIDE)
    namespace: str = "scheduler-lite"  # Ray namespace of the node hosts (named, detached actors)
    span_tenants: tuple[str, ...] = ()  # tenants whose multi-GPU jobs may span nodes
    on_node_loss: str = "requeue"  # a lost node's jobs: back to their queue, or failed
    # Job directories on each node; None: <state_dir>/nodes/<node>/jobs (distinct per node, so
    # several raylets on one machine never share one).
    jobs_dir: Path | None = None
    node_timeout_s: float = 10.0  # a node host silent this long is lost (a dead actor is lost at once)

    def global_gpu(self, node: str, local_id: int) -> int:
        return self.nodes.index(node) * GPU_ID_STRIDE + local_id

    def node_of(self, gpu: int) -> str:
        return self.nodes[gpu // GPU_ID_STRIDE]

    def local_gpu(self, gpu: int) -> int:
        return gpu % GPU_ID_STRIDE

    def node_jobs_dir(self, state_dir: Path, node: str) -> Path:
        return (self.jobs_dir / node) if self.jobs_dir is not None else state_dir / "nodes" / node / "jobs"

    @staticmethod
    def resource(node: str) -> str:
        """The Ray custom resource that marks the node a node actor must run on."""
        return NODE_RESOURCE_PREFIX + node


def check_fencing(cluster: ClusterConfig, tick_interval_s: float) -> None:
    """A node actor fences (kills its jobs) after node_timeout_s x FENCE_FRACTION without a report
    call; a tick reaches each actor once per tick_interval_s plus up to REPORT_WAIT_S of waiting
    for a slow node's report, so a shorter fence would kill healthy jobs as a matter of course."""
    least = (tick_interval_s + REPORT_WAIT_S) / FENCE_FRACTION
    if cluster.node_timeout_s < least:
        raise ConfigError("cluster.node_timeout_s", cluster.node_timeout_s,
                          f"at least {least:g} s with daemon.tick_interval_s = {tick_interval_s:g}: a node actor stops "
                          f"its jobs after {FENCE_FRACTION:g} x node_timeout_s without a tick, which must outlast "
                          f"one tick (tick_interval_s + up to {REPORT_WAIT_S:g} s waiting for the nodes' reports)")


def parse_cluster(data: object, base_dir: Path, tenants: Sequence[str],
                  device_ids: Sequence[tuple[str, int]]) -> ClusterConfig:
    """Validate the `[cluster]` table; ConfigError names the field (`cluster.nodes[2]`) and range."""
    if not isinstance(data, Mapping):
        raise ConfigError("cluster", data, "a table")
    unknown = sorted(set(data) - set(_KEYS))
    if unknown:
        raise ConfigError(f"cluster.{unknown[0]}", "<unknown key>", "one of " + ", ".join(_KEYS))
    kind = data.get("kind")
    check_choice("cluster.kind", kind, CLUSTER_KINDS)
    address = data.get("address", "auto")
    if not isinstance(address, str) or not address.strip() or len(address) > 256:
        raise ConfigError("cluster.address", address, "a Ray address (\"auto\", \"host:port\", \"ray://host:port\")")
    namespace = data.get("namespace", "scheduler-lite")
    check_name("cluster.namespace", namespace)
    nodes = data.get("nodes")
    if not isinstance(nodes, list) or not 1 <= len(nodes) <= MAX_NODES:
        raise ConfigError("cluster.nodes", nodes, f"a list of 1 to {MAX_NODES} node names")
    for i, n in enumerate(nodes):
        check_name(f"cluster.nodes[{i}]", n)
        if nodes.index(n) != i:
            raise ConfigError(f"cluster.nodes[{i}]", n, "a name not used by another node")
    span = data.get("span_tenants", [])
    if not isinstance(span, list):
        raise ConfigError("cluster.span_tenants", span, "a list of configured tenant names")
    for i, t in enumerate(span):
        if t not in tenants:
            raise ConfigError(f"cluster.span_tenants[{i}]", t, "one of the configured tenants: " + ", ".join(tenants))
    loss = data.get("on_node_loss", "requeue")
    check_choice("cluster.on_node_loss", loss, ON_NODE_LOSS)
    jobs_dir_value = data.get("jobs_dir")
    jobs_dir = None
    if jobs_dir_value is not None:
        if not isinstance(jobs_dir_value, str) or not jobs_dir_value.strip() or "\0" in jobs_dir_value:
            raise ConfigError("cluster.jobs_dir", jobs_dir_value, "a directory path (the same on every node)")
        jobs_dir = (base_dir / Path(jobs_dir_value).expanduser()).resolve()
    timeout = data.get("node_timeout_s", 10.0)
    check_range("cluster.node_timeout_s", timeout, 0.5, 3600.0)
    for field, d in device_ids:  # (field, GPU index on a node): each node's GPUs fit the stride
        if not 0 <= d < GPU_ID_STRIDE:
            raise ConfigError(field, d, f"a GPU index in [0, {GPU_ID_STRIDE - 1}] in cluster mode")
    return ClusterConfig(kind, address, tuple(nodes), namespace, tuple(span), loss, jobs_dir, float(timeout))


__all__ = ["CLUSTER_KINDS", "GPU_ID_STRIDE", "ON_NODE_LOSS", "ClusterConfig", "parse_cluster"]
