"""scheduler_lite across machines: one global scheduler and one node host per node, on Ray.

docs/cluster.md tells how to run it. Three concerns: global scheduling over nodes (`host`: the
daemon's job host for a cluster, with `node_loss`, `nodes`, `placement`, `parts`), the node side
(`node_host`), and the API for Ray users (`options`, `tasks`, `actors`, `booking`). Nothing here
imports Ray at import time: the config (`cluster.config`), the Ray options helper (`ray_options`)
and `request_placement` (until it asks the node host) work without it; the node host and the
cluster's job host import it when they start.
"""

from scheduler_lite.cluster.config import ClusterConfig
from scheduler_lite.cluster.options import ray_options
from scheduler_lite.cluster.tasks import PlacementError, RayPlacement, request_placement

__all__ = ["ClusterConfig", "PlacementError", "RayPlacement", "ray_options", "request_placement"]
