from __future__ import annotations

import pytest

from scheduler_lite.model import JobKind, Place, Reject, Reserve, Role, Unreserve, Upgrade
from scheduler_lite.policy.global_scheduler import SchedulerConfig, schedule
from scheduler_lite.policy.validation import ConfigError
from tests.scheduler.builders import book, job

CFG = SchedulerConfig()


def run(b, now=0.0, cfg=CFG):
    decisions = schedule(b.snapshot(now), cfg)
    for d in decisions:
        b.apply(d)
    return decisions


WAIT = SchedulerConfig(gang_locality="wait")


@pytest.mark.parametrize(
    ("busy", "gang", "expect_group", "cfg"),
    [
        ((), 4, "n0", CFG),  # an empty group fits
        ((0,), 3, "n0", CFG),  # best fit: the group with exactly 3 free
        ((0, 4), 4, None, WAIT),  # no group has 4 free: reserve and wait for one
        ((0, 4), 4, "both", CFG),  # ...or, by default, spread over the two groups now
    ],
)
def test_guarantee_gang_stays_inside_one_nvlink_group(busy, gang, expect_group, cfg):
    b = book()
    for i, gpu in enumerate(busy):
        b.submit(job(f"x{i}"))
        b.apply(Place(f"x{i}", (gpu,), Role.GUARANTEE))
    b.submit(job("g", gpus=gang))
    d = run(b, cfg=cfg)
    if expect_group is None:
        assert d == [Reserve("g", d[0].gpus)] and len(d[0].gpus) == 3
    elif expect_group == "both":
        assert len(d) == 1 and isinstance(d[0], Place) and not set(d[0].gpus) & set(busy)
        assert {b.gpus[g].nvlink_group for g in d[0].gpus} == {"n0", "n1"}
    else:
        assert len(d) == 1 and isinstance(d[0], Place)
        assert {b.gpus[g].nvlink_group for g in d[0].gpus} == {expect_group}


def test_reserved_gpus_take_opportunistic_but_not_guarantee_jobs():
    b = book(nodes=1, per_node=4, quotas={"A": 8, "B": 0})  # the gang waits for GPUs, not quota
    b.submit(job("x"))
    b.apply(Place("x", (0,), Role.GUARANTEE))
    b.submit(job("gang", gpus=4, t=1))
    assert isinstance(run(b)[0], Reserve)
    b.submit(job("small", t=2))
    b.submit(job("opp", tenant="B", kind=JobKind.OPPORTUNISTIC, t=3))
    d = run(b)
    placed = {x.job_id: x for x in d if isinstance(x, Place)}
    assert "small" not in placed  # no overtaking, and reserved GPUs refuse other guarantee jobs
    assert placed["opp"].role is Role.OPPORTUNISTIC


def test_reserved_gpus_take_opportunistic_jobs_in_later_passes():
    # GPU 0 runs a guarantee job above M: the only GPUs an opportunistic job may use are the
    # three reserved for the gang (the paper: reserved GPUs "can be utilized by opportunistic jobs").
    b = book(nodes=1, per_node=4, quotas={"A": 8, "B": 0})
    b.submit(job("x"))
    b.apply(Place("x", (0,), Role.GUARANTEE))
    b.set_utilisation(0, 0.95)
    b.submit(job("gang", gpus=4, t=1))
    assert run(b) == [Reserve("gang", (1, 2, 3))]
    b.submit(job("opp", tenant="B", kind=JobKind.OPPORTUNISTIC, t=2))
    d = run(b)
    assert [x.gpus[0] in (1, 2, 3) for x in d if isinstance(x, Place) and x.job_id == "opp"] == [True]
    assert b.reservations == {"gang": (1, 2, 3)}  # the gang keeps them


def test_a_job_blocked_by_its_own_quota_reserves_nothing():
    # A is at its quota on GPU 0; its next job waits for A's quota, not for GPUs, so it must not
    # keep GPU 1 from tenant C (within its quota) or from opportunistic jobs.
    b = book(nodes=1, per_node=2, quotas={"A": 1, "B": 0, "C": 1})
    b.submit(job("a1"))
    run(b)
    b.submit(job("a2", t=1))
    b.submit(job("c1", tenant="C", t=2))
    d = run(b)
    assert not any(isinstance(x, Reserve) for x in d)
    assert [(x.job_id, x.gpus) for x in d if isinstance(x, Place)] == [("c1", (1,))]
    # A reservation made before A reached its quota is dropped.
    b.finish("c1")
    b.apply(Reserve("a2", (1,)))
    b.submit(job("o", tenant="B", kind=JobKind.OPPORTUNISTIC, t=3))
    d = run(b)
    assert Unreserve("a2") in d and not any(isinstance(x, Place) and x.job_id == "a2" for x in d)
    assert b.reservations == {}


def test_opportunistic_only_on_gpus_below_threshold_least_loaded_first():
    b = book(nodes=1, per_node=3)
    b.set_utilisation(0, 0.9)
    b.set_utilisation(1, 0.5)
    b.set_utilisation(2, 0.1)
    for i in range(3):
        b.submit(job(f"o{i}", tenant="B", kind=JobKind.OPPORTUNISTIC, t=i))
    d = run(b)
    assert [(x.job_id, x.gpus) for x in d] == [("o0", (2,)), ("o1", (1,))]


def test_quota_limits_guarantee_jobs_and_oversized_ones_are_rejected():
    b = book(quotas={"A": 2, "B": 0})
    b.submit(job("a1", gpus=2))
    b.submit(job("a2", gpus=1, t=1))
    b.submit(job("b1", tenant="B", gpus=1, t=2))
    d = run(b)
    assert Place("a1", d[0].gpus, Role.GUARANTEE) == d[0]
    assert Reject("b1", "needs 1 GPUs, quota is 0") in d
    assert not any(isinstance(x, Place) and x.job_id == "a2" for x in d)


def test_auto_job_runs_opportunistic_when_delay_is_long_then_upgrades():
    b = book(nodes=1, per_node=2, quotas={"A": 1})
    b.submit(job("g"))
    b.submit(job("auto", kind=JobKind.AUTO, t=1))
    d = run(b)
    assert Place("auto", d[1].gpus, Role.OPPORTUNISTIC) == d[1]  # default remaining 1 h > 10 min
    b.finish("g")
    assert run(b, now=100) == [Upgrade("auto")]
    assert b.quota_used("A") == 1


def test_an_auto_job_that_has_waited_too_long_runs_opportunistic_though_the_estimate_says_soon():
    """The running guarantee job outlived its prediction (0 s remaining, for good): the estimate
    alone kept the auto job waiting for it however long, next to an idle GPU."""
    b = book(nodes=1, per_node=2, quotas={"A": 1})
    b.submit(job("g"))
    assert run(b) == [Place("g", (0,), Role.GUARANTEE)]
    b.update_hints("g", estimated_remaining_s=0.0)
    b.submit(job("auto", kind=JobKind.AUTO, t=1))
    after = CFG.auto_opportunistic_after_s
    assert run(b, now=2) == []  # waited 1 s, the estimate says it is next: it waits
    assert run(b, now=1 + after - 1) == []
    d = run(b, now=1 + after + 1)  # waited past the threshold: it runs, opportunistically
    assert len(d) == 1 and d[0] == Place("auto", d[0].gpus, Role.OPPORTUNISTIC)


def test_config_validation_names_the_field():
    with pytest.raises(ConfigError, match="utilisation_threshold"):
        SchedulerConfig(utilisation_threshold=1.5).validate()
    with pytest.raises(ConfigError, match="opportunistic_order"):
        SchedulerConfig(opportunistic_order="random").validate()


def test_a_guarantee_job_takes_an_idle_gpu_of_another_group_before_throttling_an_opportunistic_job():
    b = book()  # groups n0 (GPUs 0-3) and n1 (4-7)
    for i, gpu in enumerate((0, 1, 2)):  # n0: three guarantee jobs, GPU 3 runs an opportunistic job
        b.submit(job(f"x{i}"))
        b.apply(Place(f"x{i}", (gpu,), Role.GUARANTEE))
    b.submit(job("o", tenant="B", kind=JobKind.OPPORTUNISTIC))
    b.apply(Place("o", (3,), Role.OPPORTUNISTIC))
    b.submit(job("y"))
    b.apply(Place("y", (4,), Role.GUARANTEE))
    b.submit(job("g"))
    # Best fit by guarantee-free GPUs alone picks n0 (one left: GPU 3, under "o"); n1 has idle GPUs.
    assert run(b) == [Place("g", (5,), Role.GUARANTEE)]
    # With no idle GPU left anywhere, best fit stands and the opportunistic job is next to it.
    for i, gpu in enumerate((6, 7)):
        b.submit(job(f"z{i}"))
        b.apply(Place(f"z{i}", (gpu,), Role.GUARANTEE))
    b.submit(job("h"))
    assert run(b) == [Place("h", (3,), Role.GUARANTEE)]
