from __future__ import annotations

import csv
import statistics
from collections import defaultdict
from pathlib import Path

import pytest

from scheduler_lite.model import (
    GIB,
    Gpu,
    GpuView,
    LocalJob,
    Role,
    SetComputeShare,
    SetMemoryLimit,
    StepSample,
)
from scheduler_lite.policy.coordinator import (
    CoordinatorConfig,
    CoordinatorMemo,
    Phase,
    is_degraded,
    round,
)
from scheduler_lite.policy.validation import ConfigError

CFG = CoordinatorConfig()
MIB = 1 << 20
GPU = Gpu(0, "n0", 32 * GIB, "n0")
TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "alibaba-minibatch"


def steps(t0: float, n: int, seconds: float) -> tuple[StepSample, ...]:
    return tuple(StepSample(t0 + i + 1, seconds) for i in range(n))


def g_job(limit=20 * GIB, spill=0, st=()):
    return LocalJob("g", Role.GUARANTEE, 20 * GIB, limit, spill, 1.0, st)


def o_job(limit=12 * GIB, share=1.0, jid="o"):
    return LocalJob(jid, Role.OPPORTUNISTIC, 10 * GIB, limit, 0, share)


def limits_after(view, decisions):
    lim = {j.job_id: j.memory_limit_bytes for j in view.jobs}
    for d in decisions:
        if isinstance(d, SetMemoryLimit):
            lim[d.job_id] = d.limit_bytes
    return lim


def test_guarantee_arrival_shrinks_opportunistic_first_then_grows_step_by_step():
    view = GpuView(GPU, (g_job(limit=0), o_job(limit=30 * GIB)))
    d, memo = round(0.0, view, CFG, CoordinatorMemo())
    lim = limits_after(view, d)
    assert lim["o"] == CFG.min_memory_bytes and lim["g"] == 20 * GIB
    assert sum(lim.values()) <= GPU.memory_bytes
    assert SetComputeShare("o", 0, CFG.floor_share, 1.0) in d
    assert d[0] == SetMemoryLimit("o", 0, CFG.min_memory_bytes, 30 * GIB)  # shrink comes first
    # stable steps: baseline taken, opportunistic job gets the rest of the memory
    view = GpuView(GPU, (g_job(st=steps(0, 10, 1.0)), o_job(limit=CFG.min_memory_bytes, share=CFG.floor_share)))
    d, memo = round(11.0, view, CFG, memo)
    assert memo.phase is Phase.GROWING and memo.baseline_s == 1.0
    assert limits_after(view, d)["o"] == GPU.memory_bytes - 20 * GIB  # all the guarantee job leaves
    # undisturbed: share rises by one step
    view = GpuView(GPU, (g_job(st=steps(11, 10, 1.01)), o_job(share=CFG.floor_share)))
    d, memo = round(22.0, view, CFG, memo)
    assert d == [SetComputeShare("o", 0, pytest.approx(CFG.floor_share + CFG.share_step), CFG.floor_share)]
    # degraded by 15%: back to the floor at once, ceiling below the level that hurt
    level = memo.level
    view = GpuView(GPU, (g_job(st=steps(22, 10, 1.15)), o_job(share=level)))
    d, memo = round(33.0, view, CFG, memo)
    assert d == [SetComputeShare("o", 0, CFG.floor_share, level)]
    assert memo.ceiling == pytest.approx(max(CFG.floor_share, level - CFG.share_step))


def test_spill_of_guarantee_job_raises_its_limit_and_shrinks_others():
    memo = CoordinatorMemo(guarantee_job="g", phase=Phase.STEADY, baseline_s=1.0, level=0.5,
                           opportunistic=frozenset({"o"}), since=0.0)
    view = GpuView(GPU, (g_job(limit=20 * GIB, spill=4 * GIB), o_job(limit=12 * GIB)))
    d, _ = round(50.0, view, CFG, memo)
    lim = limits_after(view, d)
    assert lim["g"] == 24 * GIB and lim["o"] == 8 * GIB


def test_opportunistic_only_gpu_trial_is_undone_when_progress_falls():
    a = LocalJob("a", Role.OPPORTUNISTIC, 20 * GIB, 16 * GIB, 0, 1.0, steps(0, 10, 1.0), 1.0)
    b = LocalJob("b", Role.OPPORTUNISTIC, 20 * GIB, 16 * GIB, 0, 1.0, steps(0, 10, 1.0), 1.0)
    memo = CoordinatorMemo(opportunistic=frozenset({"a", "b"}), since=0.0)
    d, memo = round(11.0, GpuView(GPU, (a, b)), CFG, memo)
    assert memo.trial is not None and len(d) == 2
    moved = limits_after(GpuView(GPU, (a, b)), d)
    assert sum(moved.values()) <= GPU.memory_bytes
    a2 = LocalJob("a", Role.OPPORTUNISTIC, 20 * GIB, moved["a"], 0, 1.0, steps(11, 10, 2.0), 1.0)
    b2 = LocalJob("b", Role.OPPORTUNISTIC, 20 * GIB, moved["b"], 0, 1.0, steps(11, 10, 1.0), 1.0)
    d, memo = round(22.0, GpuView(GPU, (a2, b2)), CFG, memo)
    assert limits_after(GpuView(GPU, (a2, b2)), d) == {"a": 16 * GIB, "b": 16 * GIB}
    assert memo.failed_trials == 1


def test_opportunistic_jobs_alone_get_their_demands_and_the_whole_rest_when_all_fit():
    # Three jobs on a GPU with nobody to protect, all demands fitting (one not measured yet): each
    # gets its demand plus an even part of the rest, the odd bytes too, and no trial follows.
    gpu = Gpu(0, "n0", 10 * GIB + 1, "n0")  # 4 GiB + 1 left: 2 odd bytes over three jobs
    jobs = (LocalJob("a", Role.OPPORTUNISTIC, 4 * GIB, GIB, 0, 1.0),
            LocalJob("b", Role.OPPORTUNISTIC, 0, GIB, 0, 1.0),
            LocalJob("c", Role.OPPORTUNISTIC, 2 * GIB, GIB, 0, 1.0))
    view = GpuView(gpu, jobs)
    d, memo = round(0.0, view, CFG, CoordinatorMemo())
    lim = limits_after(view, d)
    assert sum(lim.values()) == gpu.memory_bytes  # no byte of the GPU left to nobody
    rest = (gpu.memory_bytes - 6 * GIB) // 3
    assert lim["a"] - 4 * GIB in (rest, rest + 1) and lim["b"] in (rest, rest + 1)
    assert lim["c"] - 2 * GIB in (rest, rest + 1)
    assert memo.next_round_at is None and memo.trial is None  # all fit: nothing to trade


def _series():
    if not TRACES.is_dir():
        pytest.skip("traces absent")
    out = []
    for path in sorted(TRACES.glob("job_*_norm.csv")):
        per = defaultdict(list)
        with open(path) as f:
            for row in csv.DictReader(f):
                per[row["worker"]].append((int(row["time"]), float(row["batch_time_norm"])))
        out.extend([b for _, b in sorted(v)] for v in per.values())
    return out


def _detections(series, factor):
    """Baseline from the first window, then every later window judged (with `factor` applied)."""
    w = CFG.detector_window
    flagged = total = 0
    for s in series:
        base = statistics.median(s[:w])
        for start in range(w, len(s) - w + 1, w):
            total += 1
            flagged += is_degraded([x * factor for x in s[start:start + w]], base, CFG)
    return flagged / total


def test_detector_false_positive_rate_on_real_minibatch_series_is_low():
    rate = _detections(_series(), 1.0)
    assert rate < 0.05, rate


def test_detector_catches_an_injected_15_percent_slowdown():
    # One window catches ~90% (docs/policies.md); a persistent slowdown is caught within two.
    single = _detections(_series(), 1.15)
    assert single > 0.8, single
    assert 1 - (1 - single) ** 2 > 0.98


def test_config_validation_names_the_field():
    with pytest.raises(ConfigError, match="detector_window"):
        CoordinatorConfig(detector_window=1).validate()
    with pytest.raises(ConfigError, match="floor_share"):
        CoordinatorConfig(floor_share=0.9, max_share=0.5).validate()


# -- measured demand, anchored baseline, arrivals next to a guarantee job holding the whole GPU ------


def _settled(demand: int, limit: int, base: float = 1.0) -> tuple[GpuView, CoordinatorMemo, list]:
    g = LocalJob("g", Role.GUARANTEE, demand, limit, 0, 1.0)
    view = GpuView(GPU, (g, o_job(limit=CFG.min_memory_bytes, share=CFG.floor_share)))
    memo = CoordinatorMemo(guarantee_job="g", phase=Phase.SETTLING, since=0.0, level=CFG.floor_share,
                           opportunistic=frozenset({"o"}))
    view = GpuView(GPU, (LocalJob("g", Role.GUARANTEE, demand, limit, 0, 1.0, steps(0, 10, base)), view.jobs[1]))
    d, memo = round(11.0, view, CFG, memo)
    return view, memo, d


def test_guarantee_limit_follows_measured_peak_plus_headroom_and_opportunistic_jobs_get_the_rest():
    view, memo, d = _settled(demand=4 * GIB, limit=GPU.memory_bytes - CFG.min_memory_bytes)
    lim = limits_after(view, d)
    wanted = int(4 * GIB * (1 + CFG.demand_headroom)) + 1
    assert abs(lim["g"] - wanted) <= 1
    assert lim["o"] == GPU.memory_bytes - lim["g"]  # the rest: more than its 10 GiB demand
    assert memo.anchor_s == memo.baseline_s == 1.0


def test_opportunistic_jobs_measured_small_share_the_whole_rest_and_never_drop_below_the_minimum():
    # The README demo's shape: a guarantee job measured at 6.5 MiB, two opportunistic jobs whose
    # peaks so far are 1.8 MiB and 3 GiB. Limited to their peaks, 25+ GiB would serve nobody and
    # the small one would spill to host memory as soon as its use grew.
    g = LocalJob("g", Role.GUARANTEE, 6 * MIB + MIB // 2, GPU.memory_bytes - 2 * CFG.min_memory_bytes, 0, 1.0,
                 steps(0, 10, 1.0))
    small = LocalJob("s", Role.OPPORTUNISTIC, 1887436, CFG.min_memory_bytes, 0, CFG.floor_share)
    big = LocalJob("b", Role.OPPORTUNISTIC, 3 * GIB, CFG.min_memory_bytes, 0, CFG.floor_share)
    memo = CoordinatorMemo(guarantee_job="g", phase=Phase.SETTLING, since=0.0, level=CFG.floor_share,
                           opportunistic=frozenset({"s", "b"}))
    view = GpuView(GPU, (g, small, big))
    d, _ = round(11.0, view, CFG, memo)
    lim = limits_after(view, d)
    assert sum(lim.values()) == GPU.memory_bytes
    assert lim["s"] >= CFG.min_memory_bytes and lim["b"] >= 3 * GIB
    assert abs(lim["s"] - (lim["b"] - (3 * GIB - CFG.min_memory_bytes))) <= 1  # the rest split evenly


def test_a_small_guarantee_job_keeps_at_least_min_memory_of_headroom():
    # 10% of a 6.5 MiB peak is no room for the allocator's regions: the job would spill to host.
    view, _, d = _settled(demand=6 * MIB + MIB // 2, limit=GPU.memory_bytes - CFG.min_memory_bytes)
    assert limits_after(view, d)["g"] == 6 * MIB + MIB // 2 + CFG.min_memory_bytes


def test_a_remeasured_baseline_never_exceeds_the_anchor_plus_tolerance():
    _, memo, _ = _settled(demand=4 * GIB, limit=8 * GIB)
    assert memo.level == CFG.floor_share  # neighbours at the floor: a slowdown is not theirs
    t = 20.0
    for slower in (1.5, 2.0, 3.0):  # the job keeps slowing down with neighbours at the floor
        g = LocalJob("g", Role.GUARANTEE, 4 * GIB, 8 * GIB, 0, 1.0, steps(t, 10, slower))
        view = GpuView(GPU, (g, o_job(limit=CFG.min_memory_bytes, share=CFG.floor_share)))
        _, memo = round(t + 11, view, CFG, memo)
        t += 11
        assert memo.baseline_s == pytest.approx(1.0 * (1 + CFG.slowdown_tolerance))
    assert memo.anchor_s == 1.0


def test_an_arrival_next_to_a_guarantee_job_holding_the_whole_gpu_gets_the_minimum():
    g = LocalJob("g", Role.GUARANTEE, GPU.memory_bytes, GPU.memory_bytes, 0, 1.0)
    memo = CoordinatorMemo(guarantee_job="g", phase=Phase.STEADY, baseline_s=1.0, anchor_s=1.0, level=0.0)
    view = GpuView(GPU, (g, o_job(limit=CFG.min_memory_bytes)))
    d, _ = round(5.0, view, CFG, memo)
    lim = limits_after(view, d)
    assert lim == {"g": GPU.memory_bytes - CFG.min_memory_bytes, "o": CFG.min_memory_bytes}
    assert [x for x in d if isinstance(x, SetMemoryLimit)][0].job_id == "g"  # the shrink first


# -- memory the coordinator sees but does not control (GpuView.unmanaged_bytes) ----------------------


def test_memory_taken_outside_the_jobs_is_not_handed_out():
    # A process of no job (or a job above its limit) holds 6 GiB of the 32 GiB GPU (NVML): an
    # opportunistic job alone gets the rest, not the whole GPU.
    alone = o_job(limit=GPU.memory_bytes)
    d, _ = round(0.0, GpuView(GPU, (alone,), unmanaged_bytes=6 * GIB), CFG, CoordinatorMemo())
    assert limits_after(GpuView(GPU, (alone,)), d)["o"] == 26 * GIB
    # Never below the minimum per job: a job's own bytes above its limit count as taken, and a
    # job slow to apply a cut must not be cut again at every round down to nothing.
    d, _ = round(0.0, GpuView(GPU, (alone,), unmanaged_bytes=40 * GIB), CFG, CoordinatorMemo())
    assert limits_after(GpuView(GPU, (alone,)), d)["o"] == CFG.min_memory_bytes
    # Next to a guarantee job: its arrival hands out only what is not taken.
    view = GpuView(GPU, (g_job(limit=0), o_job(limit=30 * GIB)), unmanaged_bytes=20 * GIB)
    d, _ = round(0.0, view, CFG, CoordinatorMemo())
    lim = limits_after(view, d)
    assert lim["o"] == CFG.min_memory_bytes and lim["g"] == 12 * GIB - CFG.min_memory_bytes
    # Taken memory more than the room the limits leave: the opportunistic jobs give it up (the
    # guarantee job keeps its limit); none below the minimum.
    memo = CoordinatorMemo(guarantee_job="g", phase=Phase.STEADY, baseline_s=1.0, anchor_s=1.0, level=0.5,
                           ceiling=1.0, opportunistic=frozenset({"o"}), since=0.0)
    view = GpuView(GPU, (g_job(limit=20 * GIB), o_job(limit=12 * GIB)), unmanaged_bytes=4 * GIB)
    d, _ = round(50.0, view, CFG, memo)
    lim = limits_after(view, d)
    assert lim == {"g": 20 * GIB, "o": 8 * GIB}
    view = GpuView(GPU, (g_job(limit=20 * GIB), o_job(limit=12 * GIB)), unmanaged_bytes=30 * GIB)
    d, _ = round(50.0, view, CFG, memo)
    assert limits_after(view, d) == {"g": 20 * GIB, "o": CFG.min_memory_bytes}
    # Nothing taken: the same steady GPU is left alone.
    d, _ = round(50.0, GpuView(GPU, (g_job(limit=20 * GIB), o_job(limit=12 * GIB))), CFG, memo)
    assert not [x for x in d if isinstance(x, SetMemoryLimit)]
