"""scheduler_lite across machines: one global scheduler and one node agent per node, on Ray.

docs/cluster.md tells how to run it. Nothing here imports Ray at import time: the config
(`cluster.config`), the Ray options helper (`ray_options`) and `request_placement` (until it
asks the node agent) work without it; the agent and the
cluster scheduler import it when they start.
"""

from scheduler_lite.cluster.config import ClusterConfig
from scheduler_lite.cluster.options import ray_options
from scheduler_lite.cluster.tasks import PlacementError, RayPlacement, request_placement

__all__ = ["ClusterConfig", "PlacementError", "RayPlacement", "ray_options", "request_placement"]
