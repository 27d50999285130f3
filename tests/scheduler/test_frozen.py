"""quick_init: the cheaper constructor must build exactly the records the dataclass would."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from scheduler_lite.frozen import quick_init, replacer
from scheduler_lite.model import Job, JobKind, JobState, LocalJob, Role, StepSample
from scheduler_lite.policy.coordinator import CoordinatorMemo, Phase


@dataclass(frozen=True, slots=True)
class Plain:
    a: int
    b: str = "x"
    c: tuple[int, ...] = ()


Quick = quick_init(dataclass(frozen=True, slots=True)(type("Quick", (), {
    "__annotations__": {"a": "int", "b": "str", "c": "tuple[int, ...]"}, "b": "x", "c": ()})))


def test_same_fields_defaults_and_keywords_as_the_generated_init():
    for args, kwargs in [((1,), {}), ((1, "y"), {}), ((1,), {"c": (2, 3)}), ((), {"a": 4, "b": "z"})]:
        q, p = Quick(*args, **kwargs), Plain(*args, **kwargs)
        assert (q.a, q.b, q.c) == (p.a, p.b, p.c)
    with pytest.raises(TypeError):
        Quick()  # a is required
    with pytest.raises(TypeError):
        Quick(1, "y", (), 5)  # too many


def test_records_stay_frozen_equal_hashable_and_replaceable():
    memo = CoordinatorMemo(guarantee_job="g", phase=Phase.GROWING, level=0.3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        memo.level = 0.5  # type: ignore[misc]
    assert memo == CoordinatorMemo(guarantee_job="g", phase=Phase.GROWING, level=0.3)
    assert hash(memo) == hash(CoordinatorMemo(guarantee_job="g", phase=Phase.GROWING, level=0.3))
    assert dataclasses.replace(memo, level=0.4).level == 0.4
    assert CoordinatorMemo().phase is Phase.IDLE and CoordinatorMemo().opportunistic == frozenset()
    job = Job("j", "a", 1, JobKind.GUARANTEE, 0.0)
    assert dataclasses.replace(job, memory_demand_bytes=5).memory_demand_bytes == 5 and job.memory_demand_bytes == 0
    local = LocalJob("j", Role.GUARANTEE, 1, 1, 0, 1.0, (StepSample(1.0, 0.5),))
    assert local.steps[0].seconds == 0.5 and local.solo_step_time_s is None


def test_replacer_builds_what_dataclasses_replace_builds():
    job = Job("j", "a", 2, JobKind.AUTO, 1.0, memory_demand_bytes=7)
    assert replacer(Job)(job, state=JobState.RUNNING, placement=(1, 2)) == dataclasses.replace(
        job, state=JobState.RUNNING, placement=(1, 2))
    assert replacer(Job)(job) == job
    assert replacer(Job, "role", "placement")(job, Role.GUARANTEE, (3, 4)) == dataclasses.replace(
        job, role=Role.GUARANTEE, placement=(3, 4))


def test_refuses_what_it_cannot_build_faithfully():
    with pytest.raises(TypeError, match="not a frozen, slotted"):
        quick_init(dataclass(frozen=True)(type("NoSlots", (), {"__annotations__": {"a": "int"}})))

    @dataclass(frozen=True, slots=True)
    class Factory:
        a: list[int] = field(default_factory=list)

    with pytest.raises(TypeError, match="plain positional"):
        quick_init(Factory)

    @dataclass(frozen=True, slots=True)
    class Post:
        a: int

        def __post_init__(self) -> None:
            pass

    with pytest.raises(TypeError, match="__post_init__"):
        quick_init(Post)
