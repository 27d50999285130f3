"""Re-placing stranded opportunistic jobs, as one pure function (beyond the paper).

    plan_migrations(state, low_shares, config) -> list[Migrate]

An opportunistic job next to a guarantee job can be held at a small compute share for a long
time (the coordinator cuts it to the floor at the first slowdown and retries only every
`probe_after_s`), while another GPU idles. Such a job is *stranded* when its compute share is
below `stranded_share`; if GPUs with no job and no reservation exist, it is checkpointed and
restarted there (the caller pays the checkpoint-restart cost). The most starved jobs move first,
at most `max_per_pass` per call, and a gang moves only when all its GPUs are found, inside one
NVLink group when it fits one.

`low_shares`: job id -> current compute share, for the running opportunistic jobs whose share
is below `stranded_share` (the caller knows the shares: the coordinator's decisions). Jobs not
listed are not considered; listed jobs that are not stranded opportunistic jobs are ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from scheduler_lite.frozen import quick_init
from scheduler_lite.model import ClusterState, JobState, Role
from scheduler_lite.policy.validation import check_int, check_range


@dataclass(frozen=True, slots=True)
class MigrationConfig:
    # Below this compute share an opportunistic job is stranded. A quarter of a GPU: the
    # coordinator's floor (0.05) and the first growth steps are below it, a job sharing a GPU
    # evenly with a light guarantee job is not.
    stranded_share: float = 0.25
    max_per_pass: int = 8  # bounds the checkpoint-restart storm after a burst of departures

    def validate(self) -> MigrationConfig:
        check_range("stranded_share", self.stranded_share, 0.0, 1.0)
        check_int("max_per_pass", self.max_per_pass, 0, 100_000)
        return self


@quick_init
@dataclass(frozen=True, slots=True)
class Migrate:
    """Checkpoint the running job, and restart it on these GPUs in the same role."""

    job_id: str
    gpus: tuple[int, ...]


def plan_migrations(
    state: ClusterState, low_shares: Mapping[str, float], config: MigrationConfig
) -> list[Migrate]:
    if not low_shares or config.max_per_pass == 0:
        return []
    idx = state.index
    stranded = []
    for job_id, share in sorted(low_shares.items(), key=lambda kv: (kv[1], state.jobs[kv[0]].submit_time, kv[0])):
        job = state.jobs[job_id]
        if job.state is not JobState.RUNNING or job.role is not Role.OPPORTUNISTIC:
            continue
        if share >= config.stranded_share:
            continue
        if not any(idx.guarantee_holder(g) is not None for g in job.placement):
            continue  # among opportunistic jobs only: nobody throttles it, it just shares
        stranded.append(job)
        if len(stranded) >= config.max_per_pass:
            break
    if not stranded:
        return []
    # Idle GPUs, fullest groups first (best fit), only as many as the stranded jobs could use:
    # a large cluster has thousands, and this runs after every arrival and finish.
    need = sum(j.num_gpus for j in stranded)
    idle: dict[str, list[int]] = {}
    found = 0
    for count in range(1, idx.largest_group_size() + 1):
        for group in idx.groups_with_empty_count(count):
            idle[group] = sorted(idx.empty_gpus(group))
            found += count
        if found >= need:
            break
    out: list[Migrate] = []
    for job in stranded:
        if not idle:
            break
        gpus = _take(idle, job.num_gpus)
        if gpus is not None:
            out.append(Migrate(job.id, gpus))
    return out


def _take(idle: dict[str, list[int]], n: int) -> tuple[int, ...] | None:
    """n idle GPUs: inside one group when one has room (fullest that fits), else any."""
    fitting = [g for g, free in idle.items() if len(free) >= n]
    if fitting:
        group = min(fitting, key=lambda g: (len(idle[g]), g))
        chosen = idle[group][:n]
        touched = [group]
    else:
        if sum(len(f) for f in idle.values()) < n:
            return None
        chosen = []
        touched = []
        for group in sorted(idle, key=lambda g: (-len(idle[g]), g)):
            chosen.extend(idle[group][: n - len(chosen)])
            touched.append(group)
            if len(chosen) == n:
                break
    # Only the groups the GPUs came from change (a GPU is in one group): with hundreds of idle
    # groups on a large cluster, refiltering all of them was most of a pass.
    taken = set(chosen)
    for group in touched:
        idle[group] = [g for g in idle[group] if g not in taken]
        if not idle[group]:
            del idle[group]
    return tuple(chosen)


__all__ = ["Migrate", "MigrationConfig", "plan_migrations"]
