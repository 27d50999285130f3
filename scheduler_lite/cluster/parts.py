"""A job over several nodes: one part per node (scheduler_lite.cluster.node_host runs each part).

Pure functions of a placement (global GPU ids, scheduler_lite.cluster.config): the nodes of a job
in rank order, each part's launch token and device indices, and the translation between the
job's control.json / stats.json and its parts' (each part numbers its devices from 0).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from scheduler_lite.cluster.config import GPU_ID_STRIDE, ClusterConfig
from tf_antman.protocol import Control, MemoryLimit, Stats


def part_token(token: str, rank: int) -> str:
    """The launch token of a job's part on its rank-th node: the daemon's sweep and the node
    actor must spell it alike, or the actor kills a part the store says runs."""
    return f"{token}.{rank}"


def job_nodes(cc: ClusterConfig, gpus: Sequence[int]) -> tuple[str, ...]:
    """The nodes of a placement, in order of first GPU (rank 0 holds the first GPU). A GPU id of a
    node no longer in cluster.nodes (the config changed across a restart) names a node that is
    never connected, so the job counts as lost with it (requeued or failed), not as a crash."""
    return tuple(dict.fromkeys(
        cc.node_of(g) if g // GPU_ID_STRIDE < len(cc.nodes) else f"<node {g // GPU_ID_STRIDE} not configured>"
        for g in gpus))


def part_indices(placement: Sequence[int], node_of: Callable[[int], str]) -> dict[str, list[int]]:
    """Per node (rank order), the job's device indices of its GPUs there: local device `j` of the
    node's part is the job's device `indices[j]` (placements may interleave nodes)."""
    out: dict[str, list[int]] = {}
    for i, g in enumerate(placement):
        out.setdefault(node_of(g), []).append(i)
    return out


def split_control(control: Control, placement: Sequence[int], node_of: Callable[[int], str]) -> dict[str, Control]:
    """A job's control.json as each of its nodes' parts sees it: the memory limits of that node's
    GPUs, renumbered from 0 within the part."""
    by_index = {m.device: m.limit_bytes for m in control.memory_limits}
    return {node: replace(control, memory_limits=tuple(MemoryLimit(j, by_index[i]) for j, i in enumerate(indices)
                                                       if i in by_index))
            for node, indices in part_indices(placement, node_of).items()}


def merge_stats(parts: Mapping[str, Stats], placement: Sequence[int], node_of: Callable[[int], str]) -> Stats:
    """One Stats for a job from its parts' (node -> its part's stats): devices renumbered to the
    job's indices, steps and shares from rank 0 (the node of the first GPU), controls applied by all."""
    indices = part_indices(placement, node_of)
    first = parts[next(iter(indices))]
    if len(parts) == 1:
        return first
    devices = sorted((replace(d, device=indices[node][d.device]) for node, p in parts.items() for d in p.devices
                      if 0 <= d.device < len(indices[node])), key=lambda d: d.device)
    applied = min(p.control_seq_applied for p in parts.values())
    return replace(first, devices=tuple(devices), control_seq_applied=applied)
