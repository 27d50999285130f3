"""Every global policy, registered once; the simulator and the CLI both read this table."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scheduler_lite.model import ClusterState, GlobalDecision
from scheduler_lite.policy.baselines import (
    GandivaConfig,
    YarnConfig,
    gandiva_schedule,
    yarn_cs_schedule,
)
from scheduler_lite.policy.global_scheduler import SchedulerConfig, schedule
from scheduler_lite.policy.migration import MigrationConfig
from scheduler_lite.policy.validation import ConfigError


@dataclass(frozen=True, slots=True)
class PolicySpec:
    name: str
    schedule: Callable[[ClusterState, Any], list[GlobalDecision]]
    config: Any
    coordinated: bool  # runs the local coordinator (policy.coordinator.round) on every GPU
    universal_memory: bool  # a job over its memory limit spills to host memory instead of failing
    isolated: bool  # compute shares are enforced (opportunistic jobs cannot slow a guarantee job)
    description: str
    migration: MigrationConfig | None = None  # re-places stranded opportunistic jobs (migration.py)


POLICIES: dict[str, PolicySpec] = {
    p.name: p
    for p in (
        PolicySpec("yarn-cs", yarn_cs_schedule, YarnConfig(), False, False, True,
                   "YARN capacity scheduler: exclusive GPUs, tenant quotas, no preemption"),
        PolicySpec("yarn-cs-preempt", yarn_cs_schedule, YarnConfig(preempt=True), False, False, True,
                   "YARN capacity scheduler; jobs within quota preempt jobs beyond quota"),
        PolicySpec("gandiva", gandiva_schedule, GandivaConfig(), False, False, False,
                   "Gandiva packing: least utilised GPU with enough memory, no isolation"),
        PolicySpec("tf-antman", schedule, SchedulerConfig(), True, True, True,
                   "AntMan (OSDI'20) global scheduler and local coordinator; stranded "
                   "opportunistic jobs re-placed on idle GPUs", MigrationConfig()),
        PolicySpec("tf-antman-sjf", schedule, SchedulerConfig(opportunistic_order="shortest_predicted"),
                   True, True, True,
                   "AntMan with opportunistic jobs ordered by predicted run time (NSDI'22 §5.2)",
                   MigrationConfig()),
    )
}


def get_policy(name: str) -> PolicySpec:
    if name not in POLICIES:
        raise ConfigError("policy", name, "one of " + ", ".join(POLICIES))
    return POLICIES[name]
