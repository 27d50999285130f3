"""scheduler_lite across machines: one global scheduler and one node agent per node, on Ray.

docs/cluster.md tells how to run it. Nothing here imports Ray at import time: the config
(`cluster.config`) and the Ray options helper (`ray_options`) work without it; the agent and the
cluster scheduler import it when they start.
"""

from scheduler_lite.cluster.config import ClusterConfig
from scheduler_lite.cluster.options import ray_options

__all__ = ["ClusterConfig", "ray_options"]
