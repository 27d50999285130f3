"""One Ray cluster per test module: 3 raylets on this machine (ray.cluster_utils.Cluster), each
node marked with its `antman_node_<name>` resource; the tests that use it are skipped when Ray is not installed.

Every test gets its own Ray namespace and state directory, so its node hosts (detached, named
actors) are its own; they are killed when the test ends, and its jobs stopped.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from scheduler_lite.cluster.nodes import actor_name
from scheduler_lite.config import Config, parse_config
from scheduler_lite.testing import stop_all_jobs
from tests.scheduler.configs import merge_tables, scheduler_config

REPO = Path(__file__).resolve().parents[2]
NODES = ("n0", "n1", "n2")
STORE = 80 << 20  # Ray's smallest object store: nothing big travels through it
_namespaces = itertools.count()


@dataclass
class RayCluster:
    cluster: Any
    nodes: dict[str, Any]  # name -> ray.cluster_utils node (n0 is the head)
    made: list[Any] = field(default_factory=list)  # daemons to stop after a test

    @property
    def address(self) -> str:
        return str(self.cluster.address)


def cluster_config(state_dir: Path, namespace: str, **sections: dict) -> Config:
    data = scheduler_config(
        ["1GiB", "1GiB"], {"A": 4, "B": 2, "C": 0}, nvlink_group="nv", state_dir=str(state_dir),
        jobs={"cancel_grace_s": 2, "host_memory": "1GiB"},
        daemon={"tick_interval_s": 0.1, "schedule_interval_s": 0.3, "utilisation_window_s": 1.0},
        coordinator={"min_memory_bytes": "64MiB", "round_interval_s": 0.5},
        cluster={"kind": "ray", "address": "auto", "namespace": namespace, "nodes": list(NODES),
                 "span_tenants": ["A"], "node_timeout_s": 10})
    return parse_config(merge_tables(data, **sections), base_dir=state_dir)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    ray = pytest.importorskip("ray")  # the optional extra: tf-antman[ray]
    from ray.cluster_utils import Cluster

    # Workers (node hosts, Ray tasks) import this checkout, and jobs inherit it; restored after
    # the module, so that later tests do not run with this checkout on PYTHONPATH.
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL", "PYTHONBREAKPOINT",
                                             "RAY_CLIENT_MODE")}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    common = {"num_cpus": 1, "object_store_memory": STORE}
    c = Cluster(initialize_head=True, head_node_args={**common, "include_dashboard": False,
                                                      "resources": {"antman_node_n0": 1}})
    nodes = {"n0": c.head_node}
    for name in NODES[1:]:
        nodes[name] = c.add_node(**common, resources={f"antman_node_{name}": 1})
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    try:
        yield RayCluster(c, nodes)
    finally:
        ray.shutdown()
        c.shutdown()
        for key, value in saved.items():  # ray.init sets the last two
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def namespace(ray_cluster: RayCluster) -> Iterator[str]:
    """A fresh namespace; at the end the test's daemons stop their jobs and its agents are killed."""
    import ray

    ns = f"test{os.getpid()}-{next(_namespaces)}"
    yield ns
    for d in ray_cluster.made:
        with contextlib.suppress(Exception):
            stop_all_jobs(d, grace_s=1)
    ray_cluster.made.clear()
    for node in NODES:
        with contextlib.suppress(Exception):
            ray.kill(ray.get_actor(actor_name(node), namespace=ns))
