"""Opportunistic placement by requested share and memory (global_scheduler, "share" placement)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from scheduler_lite.model import GIB, JobKind, Place, Role
from scheduler_lite.policy.global_scheduler import SchedulerConfig, schedule
from tests.scheduler.builders import book, job

SHARE = SchedulerConfig()
UTILISATION = SchedulerConfig(opportunistic_placement="utilisation")


def _opp(jid: str, share: float | None, memory_gib: float = 4.0, t: float = 1.0):
    return replace(job(jid, tenant="B", kind=JobKind.OPPORTUNISTIC, t=t),
                   requested_share=share, memory_demand_bytes=int(memory_gib * GIB))


@pytest.mark.parametrize(
    ("cfg", "most_on_gpu0"),
    [
        (UTILISATION, 6),  # Algorithm 1 as written: a throttled GPU keeps attracting jobs
        (SHARE, 1),  # 0.4 (guarantee) + 0.5 fits once, a second 0.5 does not
    ],
)
def test_throttled_jobs_no_longer_pile_onto_one_gpu(cfg, most_on_gpu0):
    b = book(nodes=1, per_node=4)
    b.submit(replace(job("g"), requested_share=0.4))
    b.apply(Place("g", (0,), Role.GUARANTEE))
    for gpu in (1, 2, 3):  # each busy with a guarantee job asking for the whole GPU
        b.submit(replace(job(f"h{gpu}"), requested_share=1.0))
        b.apply(Place(f"h{gpu}", (gpu,), Role.GUARANTEE))
        b.set_utilisation(gpu, 0.5)
    for i in range(6):
        # Opportunistic jobs on GPU 0 are held to the floor share: its utilisation stays low.
        b.set_utilisation(0, 0.3)
        b.submit(_opp(f"o{i}", 0.5, t=1.0 + i))
        for d in schedule(b.snapshot(float(i)), cfg):
            b.apply(d)
    assert len(b.jobs_on(0)) - 1 == most_on_gpu0


def test_a_gpu_with_the_memory_free_comes_first():
    b = book(nodes=1, per_node=2)
    b.submit(replace(job("big"), requested_share=0.3, memory_demand_bytes=30 * GIB))
    b.apply(Place("big", (0,), Role.GUARANTEE))
    b.submit(replace(job("small"), requested_share=0.3, memory_demand_bytes=2 * GIB))
    b.apply(Place("small", (1,), Role.GUARANTEE))
    b.set_utilisation(0, 0.2)  # less utilised, but without the job's 8 GiB free
    b.set_utilisation(1, 0.4)
    b.submit(_opp("o", 0.3, memory_gib=8))
    d = schedule(b.snapshot(0.0), SHARE)
    assert d == [Place("o", (1,), Role.OPPORTUNISTIC)]
    assert schedule(b.snapshot(0.0), UTILISATION) == [Place("o", (0,), Role.OPPORTUNISTIC)]


def test_unstated_share_counts_as_configured():
    b = book(nodes=1, per_node=1)
    b.submit(job("g"))  # states no share
    b.apply(Place("g", (0,), Role.GUARANTEE))
    b.submit(_opp("o", None))
    assert schedule(b.snapshot(0.0), SHARE) == [Place("o", (0,), Role.OPPORTUNISTIC)]  # counts 0
    strict = SchedulerConfig(unknown_requested_share=0.6)
    assert schedule(b.snapshot(0.0), strict) == []  # 0.6 + 0.6 > 1: it waits
    assert _committed(b, 0.6) == pytest.approx(0.6)


def _committed(b, unstated: float) -> float:
    """GPU 0's committed share, as the placement reads it (its room: 1 - committed)."""
    return 1.0 - dict(b.gpus_with_room(1.1, 0.0, unstated))[0]


def test_committed_share_follows_place_and_release():
    b = book(nodes=1, per_node=1)
    b.submit(_opp("a", 0.25))
    b.apply(Place("a", (0,), Role.OPPORTUNISTIC))
    b.submit(_opp("b", 0.5))
    b.apply(Place("b", (0,), Role.OPPORTUNISTIC))
    assert _committed(b, 0.0) == pytest.approx(0.75)
    b.finish("a")
    assert _committed(b, 0.0) == pytest.approx(0.5)
    b.finish("b")
    assert _committed(b, 0.0) == 0.0


def test_bad_placement_choice_is_rejected_with_its_name():
    from scheduler_lite.policy.validation import ConfigError

    with pytest.raises(ConfigError, match="opportunistic_placement"):
        SchedulerConfig(opportunistic_placement="random").validate()
    with pytest.raises(ConfigError, match="gang_locality"):
        SchedulerConfig(gang_locality="never").validate()


def _reference_first_with_room(b, below, share, unstated, demand, n, skip):
    """The buffered loop of global_scheduler._place_by_share for one job, over gpus_with_room."""
    fits, tight = [], []
    for g, room in b.gpus_with_room(below, share, unstated):
        if g in skip or share > room + 1e-9:
            continue
        if b.memory_free(g) >= demand:
            fits.append(g)
            if len(fits) == n:
                break
        elif len(tight) < n:
            tight.append(g)
    return fits, tight


@pytest.mark.parametrize("seed", range(20))
def test_single_job_fast_scan_picks_what_the_buffered_loop_picks(seed):
    rng = random.Random(seed)
    b = book(nodes=4, per_node=4)
    for i in range(rng.randrange(4, 30)):
        gpu = rng.randrange(16)
        b.submit(_opp(f"r{i}", rng.choice((None, 0.1, 0.25, 0.5, 0.9)), memory_gib=rng.uniform(1, 20)))
        b.apply(Place(f"r{i}", (gpu,), Role.OPPORTUNISTIC))
    for gpu in range(16):
        b.set_utilisation(gpu, rng.random())
    for _ in range(20):
        args = (rng.choice((0.5, 0.8, 1.0)), rng.choice((0.1, 0.3, 0.6)), rng.choice((0.0, 0.2)),
                int(rng.uniform(1, 30) * GIB), rng.choice((1, 2, 4)))
        skip = set(rng.sample(range(16), rng.randrange(4)))
        assert b.first_with_room(*args, skip, set()) == _reference_first_with_room(b, *args, skip)


@pytest.mark.parametrize("seed", range(20))
def test_may_have_room_never_denies_room_that_is_there_and_sees_a_full_cluster(seed):
    rng = random.Random(seed)
    b = book(nodes=4, per_node=4)
    placed = []
    for step in range(60):  # places, releases and utilisation moves, in random order
        if placed and rng.random() < 0.3:
            b.finish(placed.pop(rng.randrange(len(placed))))
        else:
            b.submit(_opp(f"r{step}", rng.choice((None, 0.05, 0.1, 0.25, 0.5, 0.9))))
            b.apply(Place(f"r{step}", (rng.randrange(16),), Role.OPPORTUNISTIC))
            placed.append(f"r{step}")
        b.set_utilisation(rng.randrange(16), rng.random())
        for below in (0.3, 0.5, 0.8, 1.0):
            for share in (0.05, 0.1, 0.15, 0.5, 0.85, 1.0):
                with_room = max(len(list(b.gpus_with_room(below, share, u))) for u in (0.0, 0.2))
                for n in range(1, with_room + 1):
                    assert b.may_have_room(below, share, n)
    for job_id in placed:
        b.finish(job_id)
    for gpu in range(16):  # every GPU full (stated share 1): no room for any request
        b.submit(_opp(f"full{gpu}", 1.0))
        b.apply(Place(f"full{gpu}", (gpu,), Role.OPPORTUNISTIC))
    assert not b.may_have_room(1.0, 0.05, 1)
    b.finish("full3")
    assert b.may_have_room(1.0, 0.05, 1)
    assert not b.may_have_room(1.0, 0.05, 2)
    b.set_utilisation(3, 0.9)  # the one GPU with room, now above the threshold
    assert not b.may_have_room(0.8, 0.05, 1)


def test_an_opportunistic_gang_takes_its_gpus_inside_one_nvlink_group():
    # Least utilised first alternates between the two groups (n0: GPUs 0-3, n1: GPUs 4-7); a gang
    # took the first two (0 and 4), spread over both groups, and ran slower for it.
    b = book(nodes=2, per_node=4)
    for gpu, u in enumerate((0.10, 0.20, 0.40, 0.50, 0.15, 0.25, 0.45, 0.55)):
        b.set_utilisation(gpu, u)
    b.submit(replace(_opp("pair", 0.3), num_gpus=2))
    assert schedule(b.snapshot(0.0), SHARE) == [Place("pair", (0, 1), Role.OPPORTUNISTIC)]
    b.submit(replace(_opp("three", 0.3, t=2.0), num_gpus=3))
    for d in schedule(b.snapshot(0.0), SHARE):
        b.apply(d)
    placed = b.jobs["three"].placement
    assert len(placed) == 3 and len({b.gpus[g].nvlink_group for g in placed}) == 1, placed


def test_a_gang_no_group_can_hold_is_spread_rather_than_kept_waiting():
    b = book(nodes=2, per_node=2)
    for gpu in (1, 3):  # one GPU of each group taken whole by a guarantee job
        b.submit(replace(job(f"g{gpu}"), requested_share=1.0))
        b.apply(Place(f"g{gpu}", (gpu,), Role.GUARANTEE))
    b.submit(replace(_opp("pair", 0.5), num_gpus=2))
    assert schedule(b.snapshot(0.0), SHARE) == [Place("pair", (0, 2), Role.OPPORTUNISTIC)]
