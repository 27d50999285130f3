"""Driver.run_pass: the one decision loop of the daemon and the simulator.

Each decision of a pass reaches the world once, in the policy's order, after the driver applied it
(a Place with its own Launch, whatever comes between two Places); decisions a world does not act on
(here Preempt, Unreserve, Upgrade) fall to PassWorld's no-ops.
"""

from __future__ import annotations

from scheduler_lite.driver import Driver, Launch, PassWorld
from scheduler_lite.model import (
    GIB,
    ClusterState,
    GlobalDecision,
    Gpu,
    Job,
    JobKind,
    Place,
    Reject,
    Reserve,
    Role,
    Tenant,
)
from scheduler_lite.policy.coordinator import CoordinatorConfig

DECISIONS: list[GlobalDecision] = [
    Place("a", (0,), Role.OPPORTUNISTIC),
    Reject("r", "needs 4 GPUs, quota is 1"),
    Reserve("g", (1,)),
    Place("b", (1,), Role.OPPORTUNISTIC),
]


class Recorder(PassWorld):
    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self.calls: list[tuple[str, str]] = []

    def place(self, launch: Launch) -> None:
        # Applied before the world hears of it: the job runs in the book, its settings exist.
        assert self.driver.book.jobs[launch.job_id].placement == launch.gpus
        assert launch.job_id in self.driver.settings
        self.calls.append(("place", launch.job_id))

    def reject(self, decision: Reject) -> None:
        self.calls.append(("reject", decision.job_id))

    def reserve(self, decision: Reserve) -> None:
        self.calls.append(("reserve", decision.job_id))


def _driver(decisions: list[GlobalDecision]) -> Driver:
    def policy(state: ClusterState, config: object) -> list[GlobalDecision]:
        return list(decisions)

    gpus = [Gpu(i, "n0", 32 * GIB, "n0") for i in range(2)]
    driver = Driver(gpus, [Tenant("A", 1), Tenant("B", 0)], policy=policy, scheduler_config=None,
                    coordinator_config=CoordinatorConfig())
    for job_id, tenant, kind in (("a", "B", JobKind.OPPORTUNISTIC), ("r", "A", JobKind.GUARANTEE),
                                 ("g", "A", JobKind.GUARANTEE), ("b", "B", JobKind.OPPORTUNISTIC)):
        driver.book.submit(Job(job_id, tenant, 1, kind, 0.0, memory_demand_bytes=GIB))
    return driver


def test_each_decision_reaches_the_world_once_in_the_policys_order() -> None:
    driver = _driver(DECISIONS)
    world = Recorder(driver)
    assert driver.run_pass(0.0, world) == DECISIONS
    assert world.calls == [("place", "a"), ("reject", "r"), ("reserve", "g"), ("place", "b")]
