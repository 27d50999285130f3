"""Placement across nodes: Algorithm 1 with the node level above the NVLink group.

Algorithm 1 (scheduler_lite.policy.global_scheduler) places a gang inside one group when it fits,
else over whole groups; `node_aware` then refuses a gang that would span nodes unless its tenant
is in `cluster.span_tenants`: a guarantee gang holds (Reserve) the GPUs it found on its best node
and waits there, an opportunistic one waits in its queue. Used by the global scheduler
(scheduler_lite.cluster.host) as its driver's policy.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import replace
from typing import Any

from scheduler_lite.driver import SchedulePolicy
from scheduler_lite.model import ClusterState, GlobalDecision, JobState, Place, Reserve, Role, Unreserve


def node_aware(policy: SchedulePolicy, span_tenants: Iterable[str], node_of: Callable[[int], str],
               on_wait: Callable[[str, str], None] | None = None) -> SchedulePolicy:
    """Algorithm 1 with the node level: a multi-node Place only for tenants allowed to span nodes.

    A guarantee gang that may not span holds (Reserve) what it found on its best node that can
    hold it, and waits there. A gang that may not span and is larger than every node here (a
    node is away) is kept out of the pass: it would take GPUs of the pass (for a placement then
    dropped) and hold a node it can never run on, blocking every guarantee job behind it. It
    waits, holding nothing; `on_wait(job id, why)` is told each pass."""
    span = frozenset(span_tenants)

    def run(state: ClusterState, config: object) -> list[GlobalDecision]:
        sizes = Counter(node_of(g) for g in state.gpus)
        largest = max(sizes.values(), default=0)
        too_big = {j.id for j in state.jobs.values()
                   if j.state is JobState.PENDING and j.tenant not in span and j.num_gpus > largest}
        out: list[GlobalDecision] = [Unreserve(j) for j in sorted(too_big) if j in state.reservations]
        for job_id in sorted(too_big):
            if on_wait is not None:
                on_wait(job_id, f"needs {state.jobs[job_id].num_gpus} GPUs on one node (tenant "
                                f"{state.jobs[job_id].tenant!r} may not span nodes) and the largest node here has "
                                f"{largest}: it waits, holding nothing, for a larger node to join")
        if too_big:
            state = replace(state, index=_Without(state.index, too_big))
        for d in policy(state, config):
            if isinstance(d, Place | Reserve) and state.jobs[d.job_id].tenant not in span:
                d = _on_one_node(d, state.jobs[d.job_id].num_gpus, sizes, node_of)
                if d is None:
                    continue
            out.append(d)
        return out

    return run


def _on_one_node(d: Place | Reserve, num_gpus: int, sizes: Counter[str],
                 node_of: Callable[[int], str]) -> Place | Reserve | None:
    """A decision for a gang that may not span nodes: a Place within one node as it is; over
    several, a guarantee gang holds the GPUs found on its best node that can hold it (most
    found there, then the name), an opportunistic one waits. A hold likewise."""
    per_node = Counter(node_of(g) for g in d.gpus)
    if isinstance(d, Place) and len(per_node) <= 1:
        return d
    if isinstance(d, Place) and d.role is not Role.GUARANTEE:
        return None
    fits = [n for n in per_node if sizes[n] >= num_gpus]
    if not fits:
        return None
    best = min(fits, key=lambda n: (-per_node[n], n))
    return Reserve(d.job_id, tuple(g for g in d.gpus if node_of(g) == best))


class _Without:
    """The book's queries with some pending jobs left out of the queues (node_aware)."""

    def __init__(self, index: Any, hidden: set[str]) -> None:
        self._index = index
        self._hidden = hidden

    def pending_guarantee_queue(self, tenant: str) -> Collection[str]:
        return [j for j in self._index.pending_guarantee_queue(tenant) if j not in self._hidden]

    def pending_opportunistic_queue(self) -> Collection[str]:
        return [j for j in self._index.pending_opportunistic_queue() if j not in self._hidden]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._index, name)
