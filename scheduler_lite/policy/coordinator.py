"""AntMan's local coordinator (paper §3.3), one GPU at a time, as a pure function.

    round(now, gpu_view, config, memo) -> (decisions, memo)

The caller keeps one `CoordinatorMemo` per GPU (start with `CoordinatorMemo()`) and calls
`round` whenever the jobs on the GPU change, and otherwise every `round_interval_s`; the
simulator may skip calls until `memo.next_round_at` because its inputs do not drift. For a GPU
without jobs `round` returns no decisions and `CoordinatorMemo()`, whatever the memo, so a
caller may skip that call and reset the memo itself.

GPU with a guarantee job:
  * arrival: opportunistic jobs are cut to `min_memory_bytes` and a compute share of
    `floor_share` at once, so the guarantee job initialises on an uncontended GPU;
  * once its step time is stable: the baseline is the median step time and becomes the anchor;
    with opportunistic jobs next to it (then, or when the first one arrives) its limit drops to
    its measured peak x (1 + `demand_headroom`) (LocalJob.memory_demand_bytes: measured by the
    daemon, modelled by the simulator) and the opportunistic jobs get the rest;
    their combined compute share rises by `share_step` per round while the median of the last
    `detector_window` steps stays within `slowdown_tolerance` of the baseline;
  * slow while the opportunistic jobs are already at the floor: the baseline is measured again,
    but never above anchor x (1 + `slowdown_tolerance`), so interference the share does not
    control cannot erode the protection step by step;
  * an opportunistic job arriving before that gets `min_memory_bytes`, taken from the guarantee
    job's limit if the GPU has no room left (never a limit of 0);
  * degradation: share back to the floor at once (pessimistic) and no higher than one step below
    the level that hurt, until `probe_after_s` has passed;
  * spill to host memory: its limit grows by the spilled bytes, opportunistic jobs shrink.
GPU with opportunistic jobs only: one job gets the whole GPU; several whose demands do not fit
get memory by introspective trial and error, moving `trial_chunk_fraction` of the GPU from one
job to another and undoing the move when normalised aggregate progress fell.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler_lite.frozen import quick_init, replacer
from scheduler_lite.model import (
    GpuView,
    LocalDecision,
    LocalJob,
    Role,
    SetComputeShare,
    SetMemoryLimit,
)
from scheduler_lite.policy.validation import ConfigError, check_int, check_range

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    """Defaults and why; `validate()` names the bad field and its accepted range."""

    # Revisit a GPU being tuned this often: ten 1 s mini-batches give a usable median.
    round_interval_s: float = 10.0
    # Steps whose median is compared with the baseline. Measured on the Alibaba PAI mini-batch
    # series (docs/policies.md): with 10 steps a median moves ~2% from noise alone.
    detector_window: int = 10
    # Degraded when that median exceeds the baseline by more than this. Natural drift of the
    # real series stays under 5%; an interference of 15% must be caught: 8% sits between.
    slowdown_tolerance: float = 0.08
    # The guarantee job is "stable" when its steps vary less than this (coefficient of
    # variation); the real series have CVs of 1-5%, warm-up steps far more.
    stable_cv: float = 0.10
    # ...or after this long, so a naturally noisy job does not starve its neighbours forever.
    settle_timeout_s: float = 120.0
    # Combined compute share of opportunistic jobs right after a guarantee job arrives. Not 0,
    # so they keep making some progress; small enough not to slow device initialisation.
    floor_share: float = 0.05
    # Growth per round; 10 rounds from the floor to a full GPU.
    share_step: float = 0.1
    max_share: float = 1.0
    # After a cut, try the higher level again this much later (load of a job changes by phase).
    probe_after_s: float = 600.0
    # Smallest limit an opportunistic job is shrunk to: enough for its working set of one
    # operator; universal memory keeps the rest in host memory.
    min_memory_bytes: int = 256 * MIB
    # Trial-and-error memory moves between opportunistic jobs, as a fraction of the GPU.
    trial_chunk_fraction: float = 0.1
    # Stop trying after this many consecutive moves that did not help (until jobs change).
    max_failed_trials: int = 4
    # A guarantee job's limit follows its measured peak plus this fraction once its baseline is
    # measured (and at each re-measure): room for the step-to-step variation of the peak; a real
    # surge spills to host memory and takes the bytes back (see the module docstring).
    demand_headroom: float = 0.1

    def validate(self) -> CoordinatorConfig:
        check_range("round_interval_s", self.round_interval_s, 0.0, 3600.0, low_open=True)
        check_int("detector_window", self.detector_window, 3, 1000)
        check_range("slowdown_tolerance", self.slowdown_tolerance, 0.0, 1.0, low_open=True)
        check_range("stable_cv", self.stable_cv, 0.0, 1.0, low_open=True)
        check_range("settle_timeout_s", self.settle_timeout_s, 0.0, 86400.0)
        check_range("floor_share", self.floor_share, 0.0, 1.0)
        check_range("share_step", self.share_step, 0.0, 1.0, low_open=True)
        check_range("max_share", self.max_share, 0.0, 1.0, low_open=True)
        if self.floor_share > self.max_share:
            raise ConfigError("floor_share", self.floor_share, f"at most max_share={self.max_share}")
        check_range("probe_after_s", self.probe_after_s, 0.0, 1e7)
        check_int("min_memory_bytes", self.min_memory_bytes, 0, 1 << 40)
        check_range("trial_chunk_fraction", self.trial_chunk_fraction, 0.0, 0.5, low_open=True)
        check_int("max_failed_trials", self.max_failed_trials, 0, 1000)
        check_range("demand_headroom", self.demand_headroom, 0.0, 1.0)
        return self


class Phase(enum.StrEnum):
    IDLE = "idle"  # no guarantee job
    SETTLING = "settling"  # guarantee job arrived, opportunistic jobs held at the floor
    GROWING = "growing"  # raising the opportunistic share step by step
    STEADY = "steady"


@quick_init
@dataclass(frozen=True, slots=True)
class Trial:
    moves: tuple[SetMemoryLimit, ...]
    score_before: float


@quick_init
@dataclass(frozen=True, slots=True)
class CoordinatorMemo:
    guarantee_job: str | None = None
    phase: Phase = Phase.IDLE
    since: float = float("-inf")  # last change; older steps say nothing about now
    baseline_s: float | None = None
    # The first baseline, measured while the opportunistic jobs were held at the floor: a
    # re-measure never raises the baseline above anchor x (1 + slowdown_tolerance).
    anchor_s: float | None = None
    level: float = 0.0  # combined compute share of the opportunistic jobs
    ceiling: float = 1.0
    cut_at: float | None = None
    opportunistic: frozenset[str] = frozenset()
    trial: Trial | None = None
    failed_trials: int = 0
    cursor: int = 0
    # When round() wants to run again although nothing changed; None: only on a change.
    next_round_at: float | None = None


_evolve = replacer(CoordinatorMemo)  # a round's main cost was dataclasses.replace's loop over the fields
_NO_IDS: frozenset[str] = frozenset()


def is_stable(samples: Sequence[float], config: CoordinatorConfig) -> bool:
    if len(samples) < config.detector_window:
        return False
    recent = samples[-config.detector_window :]
    n = len(recent)
    mean = math.fsum(recent) / n
    # Float variance, not statistics.pstdev: that one sums exact fractions, ~20x slower, and a
    # step time's last bits say nothing about stability.
    std = math.sqrt(math.fsum([(x - mean) ** 2 for x in recent]) / n)  # a list: no generator frames
    return mean > 0 and std / mean <= config.stable_cv


def is_degraded(samples: Sequence[float], baseline_s: float, config: CoordinatorConfig) -> bool:
    """Interference detector: median of the last window against the baseline.

    The median, not the mean: one straggler step (common in the real series) must not look
    like interference.
    """
    if len(samples) < config.detector_window:
        return False
    recent = samples[-config.detector_window :]
    return statistics.median(recent) > baseline_s * (1.0 + config.slowdown_tolerance)


def round(
    now: float, view: GpuView, config: CoordinatorConfig, memo: CoordinatorMemo
) -> tuple[list[LocalDecision], CoordinatorMemo]:
    # The guarantee job and the opportunistic ones, in one loop (this runs every round).
    guarantee = None
    opps: list[LocalJob] = []
    for job in view.jobs:
        if job.role is Role.GUARANTEE:
            if guarantee is None:
                guarantee = job
        elif job.role is Role.OPPORTUNISTIC:
            opps.append(job)
    if len(opps) > 1:
        opps.sort(key=_job_id)
    if guarantee is None:
        out, memo = _opportunistic_only(now, view, opps, config, memo)
    else:
        out, memo = _with_guarantee(now, view, guarantee, opps, config, memo)
    # Shrinks first, so that applying the list in order never over-commits the GPU's memory.
    # (Most rounds decide nothing or one thing: nothing to order then.)
    if len(out) > 1:
        out.sort(key=lambda d: 0 if isinstance(d, SetMemoryLimit) and d.limit_bytes < d.previous_bytes else 1)
    return out, memo


def _job_id(job: LocalJob) -> str:
    return job.job_id


def _memory(view: GpuView, cfg: CoordinatorConfig) -> int:
    """What the round hands out: the GPU less the memory taken outside the jobs' limits (NVML),
    but never less than `min_memory_bytes` per job. A job's own bytes above its limit count as
    taken, so a job slow to apply a lower limit would otherwise be cut again at each round, down
    to nothing."""
    whole = view.gpu.memory_bytes
    if not view.unmanaged_bytes:
        return whole
    return max(whole - view.unmanaged_bytes, min(whole, len(view.jobs) * cfg.min_memory_bytes))


# ----------------------------------------------------------------------------------------------


def _with_guarantee(
    now: float,
    view: GpuView,
    g: LocalJob,
    opps: list[LocalJob],
    cfg: CoordinatorConfig,
    memo: CoordinatorMemo,
) -> tuple[list[LocalDecision], CoordinatorMemo]:
    mem = _memory(view, cfg)
    gid = view.gpu.id
    out: list[LocalDecision] = []
    ids = frozenset([j.job_id for j in opps]) if opps else _NO_IDS
    if memo.guarantee_job != g.job_id:
        # Arrival: opportunistic jobs down to the minimum first, the guarantee job gets the rest.
        g_limit = max(0, min(max(g.memory_demand_bytes, g.memory_limit_bytes), mem - len(opps) * cfg.min_memory_bytes))
        _limit(out, gid, g, g_limit)
        each = (mem - g_limit) // len(opps) if opps else 0
        for job in opps:
            _limit(out, gid, job, min(cfg.min_memory_bytes, each))
        _shares(out, gid, opps, cfg.floor_share)
        return out, CoordinatorMemo(
            guarantee_job=g.job_id,
            phase=Phase.SETTLING,
            since=now,
            level=cfg.floor_share,
            ceiling=cfg.max_share,
            opportunistic=ids,
            next_round_at=now + cfg.round_interval_s,
        )
    if ids != memo.opportunistic:
        # A new opportunistic job starts small; the shared level is split again.
        arrived = ids - memo.opportunistic
        if memo.baseline_s is not None and opps:
            # The guarantee job is measured: its peak plus headroom, the opportunistic jobs the rest.
            g_limit = _measured_limit(g, cfg, mem, len(opps))
            _limit(out, gid, g, g_limit)
            _fit_opportunistic(out, gid, opps, mem - g_limit, cfg.min_memory_bytes)
            _shares(out, gid, opps, memo.level)
            return out, _evolve(
                memo, opportunistic=ids, since=now, phase=Phase.GROWING, next_round_at=now + cfg.round_interval_s
            )
        others = sum(j.memory_limit_bytes for j in opps if j.job_id not in arrived)
        free = mem - g.memory_limit_bytes - others
        need = len(arrived) * min(cfg.min_memory_bytes, mem // (len(opps) + 1))
        if free < need:
            # No room left: the guarantee job gives up what the arrivals need (as at its own
            # arrival, it keeps all but min_memory_bytes per opportunistic job).
            g_limit = max(0, g.memory_limit_bytes - (need - free))
            _limit(out, gid, g, g_limit)
            free = mem - g_limit - others
        for job in opps:
            if job.job_id in arrived:
                _limit(out, gid, job, max(0, min(cfg.min_memory_bytes, free // len(arrived))))
        _shares(out, gid, opps, memo.level)
        if memo.phase is Phase.SETTLING:
            return out, _evolve(memo, opportunistic=ids)
        return out, _evolve(
            memo, opportunistic=ids, since=now, phase=Phase.GROWING, next_round_at=now + cfg.round_interval_s
        )

    if view.unmanaged_bytes and opps and g.memory_limit_bytes + sum(j.memory_limit_bytes for j in opps) > mem:
        # Memory taken outside the jobs' limits (view.unmanaged_bytes) grew past the room the
        # limits leave: the opportunistic jobs give it up (not below the minimum), the guarantee
        # job keeps its limit. Checked only with memory taken, so a GPU without changes nothing.
        room = max(mem - g.memory_limit_bytes, len(opps) * cfg.min_memory_bytes)  # never a limit of 0
        _fit_opportunistic(out, gid, opps, room, cfg.min_memory_bytes)
        if out:
            return out, _evolve(memo, next_round_at=now + cfg.round_interval_s)
    samples = [s.seconds for s in g.steps if s.ended_at > memo.since]
    tick = now + cfg.round_interval_s
    if memo.phase is Phase.SETTLING:
        stable = is_stable(samples, cfg)
        timed_out = now - memo.since >= cfg.settle_timeout_s and len(samples) >= cfg.detector_window
        if not (stable or timed_out):
            return out, _evolve(memo, next_round_at=tick)
        baseline = statistics.median(samples[-cfg.detector_window :])
        # Alone, a lower limit would give nothing to anybody: it follows the peak once there are
        # opportunistic jobs (here, or when the first one arrives).
        g_limit = _measured_limit(g, cfg, mem, len(opps)) if opps else g.memory_limit_bytes
        _limit(out, gid, g, g_limit)
        _fit_opportunistic(out, gid, opps, mem - g_limit, cfg.min_memory_bytes)
        anchor = baseline if memo.anchor_s is None else memo.anchor_s
        return out, _evolve(
            memo, phase=Phase.GROWING, baseline_s=baseline, anchor_s=anchor, since=now, next_round_at=tick
        )

    if g.host_spill_bytes > 0:
        # Demand surge of the guarantee job: take the spilled bytes back from the others.
        room = mem - len(opps) * min(cfg.min_memory_bytes, mem // (len(opps) + 1))
        new_limit = min(g.memory_limit_bytes + g.host_spill_bytes, room)
        if new_limit > g.memory_limit_bytes:
            _limit(out, gid, g, new_limit)
            _fit_opportunistic(out, gid, opps, mem - new_limit, cfg.min_memory_bytes)
            return out, _evolve(memo, since=now, next_round_at=tick)
    if not opps:
        return out, _evolve(memo, phase=Phase.STEADY, next_round_at=None)

    assert memo.baseline_s is not None
    if len(samples) < cfg.detector_window:
        return out, _evolve(memo, next_round_at=tick)
    if is_degraded(samples, memo.baseline_s, cfg):
        if memo.level > cfg.floor_share:
            ceiling = max(cfg.floor_share, memo.level - cfg.share_step)
            _shares(out, gid, opps, cfg.floor_share)
            return out, _evolve(
                memo, level=cfg.floor_share, ceiling=ceiling, cut_at=now, since=now,
                phase=Phase.GROWING, next_round_at=tick,
            )
        # Slow with neighbours already at the floor: not their doing. The job itself changed
        # (phase, input pipeline), so measure a new baseline instead of cutting forever, but
        # anchored: never above the first baseline plus the tolerance.
        baseline = statistics.median(samples[-cfg.detector_window :])
        if memo.anchor_s is not None:
            baseline = min(baseline, memo.anchor_s * (1.0 + cfg.slowdown_tolerance))
        return out, _evolve(memo, baseline_s=baseline, since=now, next_round_at=tick)
    ceiling = memo.ceiling
    if memo.cut_at is not None and now - memo.cut_at >= cfg.probe_after_s:
        ceiling = cfg.max_share
    if memo.level < ceiling - 1e-9:
        level = min(ceiling, memo.level + cfg.share_step)
        _shares(out, gid, opps, level)
        return out, _evolve(
            memo, level=level, ceiling=ceiling, since=now, phase=Phase.GROWING, next_round_at=tick
        )
    wake = None
    if ceiling < cfg.max_share and memo.cut_at is not None:
        wake = memo.cut_at + cfg.probe_after_s
    return out, _evolve(memo, ceiling=ceiling, phase=Phase.STEADY, next_round_at=wake)


def _opportunistic_only(
    now: float,
    view: GpuView,
    opps: list[LocalJob],
    cfg: CoordinatorConfig,
    memo: CoordinatorMemo,
) -> tuple[list[LocalDecision], CoordinatorMemo]:
    mem = _memory(view, cfg)
    gid = view.gpu.id
    out: list[LocalDecision] = []
    ids = frozenset(j.job_id for j in opps)
    if not opps:
        return out, CoordinatorMemo()
    _each_share(out, gid, opps, 1.0)  # each a whole GPU: nobody to protect, the GPU time-slices between them
    if len(opps) == 1:
        _limit(out, gid, opps[0], mem)
        return out, CoordinatorMemo(opportunistic=ids)
    fits = demands_fit([j.memory_demand_bytes for j in opps], mem)
    if fits or ids != memo.opportunistic or memo.guarantee_job is not None:
        # Every demand met and the rest split evenly, or (too little for all) the smallest
        # demands met first; then, if not all fit, trials move memory between them.
        for job, limit in zip(opps, _share_out(mem, [j.memory_demand_bytes for j in opps]), strict=True):
            _limit(out, gid, job, limit)
        if fits:
            return out, CoordinatorMemo(opportunistic=ids)
        return out, CoordinatorMemo(opportunistic=ids, since=now, next_round_at=now + cfg.round_interval_s)

    tick = now + cfg.round_interval_s
    score = _aggregate_progress(opps, memo.since, cfg.detector_window)
    if score is None:
        return out, _evolve(memo, next_round_at=tick)
    if memo.trial is not None:
        failed = 0
        if score < memo.trial.score_before:
            out.extend(m.reverted() for m in reversed(memo.trial.moves))
            failed = memo.failed_trials + 1
        return out, _evolve(memo, trial=None, failed_trials=failed, since=now, next_round_at=tick)
    if memo.failed_trials >= cfg.max_failed_trials:
        return out, _evolve(memo, next_round_at=None)
    pairs = [(a, b) for a in opps for b in opps if a is not b]
    chunk = int(mem * cfg.trial_chunk_fraction)
    for step in range(len(pairs)):
        giver, taker = pairs[(memo.cursor + step) % len(pairs)]
        moved = min(chunk, giver.memory_limit_bytes - cfg.min_memory_bytes,
                    taker.memory_demand_bytes - taker.memory_limit_bytes)
        if moved > 0:
            moves = (
                SetMemoryLimit(giver.job_id, gid, giver.memory_limit_bytes - moved, giver.memory_limit_bytes),
                SetMemoryLimit(taker.job_id, gid, taker.memory_limit_bytes + moved, taker.memory_limit_bytes),
            )
            out.extend(moves)
            return out, _evolve(
                memo, trial=Trial(moves, score), cursor=memo.cursor + step + 1, since=now, next_round_at=tick
            )
    return out, _evolve(memo, next_round_at=None)


# ----------------------------------------------------------------------------------------------


def demands_fit(demands: Sequence[int], memory_bytes: int) -> bool:
    """Whether these memory demands fit on one GPU together. On a GPU without a guarantee job the
    coordinator then meets every demand and reads no step times (memory trials, the only reader
    there, run only when they do not fit): a caller may leave the steps out of such a view, and
    need not ask for a round when only the step times changed."""
    return sum(demands) <= memory_bytes


def _aggregate_progress(opps: list[LocalJob], since: float, window: int) -> float | None:
    """Sum of normalised speeds (solo step time / current step time); None until measurable."""
    total = 0.0
    for job in opps:
        recent = [s.seconds for s in job.steps if s.ended_at > since][-window:]
        if len(recent) < min(3, window):
            return None
        current = statistics.median(recent)
        reference = job.solo_step_time_s or min(recent)
        total += reference / current if current > 0 else 0.0
    return total


def _measured_limit(g: LocalJob, cfg: CoordinatorConfig, mem: int, n_opps: int) -> int:
    """The guarantee job's limit once measured: its peak plus headroom, never above what it has,
    and leaving each opportunistic job at least `min_memory_bytes` (as at its arrival).

    The headroom is at least `min_memory_bytes` too: the measured peak counts bytes in live
    blocks, while the limit bounds the regions the allocator holds (2 MiB and up, with the
    fragmentation of a real step). A job measured at 6.5 MiB and limited to 7.1 MiB (10% only)
    spilled 1.8 GiB of short-lived tensors to host memory in the README demo: a guarantee job
    must never be pushed into host fallback by its own measurement."""
    room = mem - n_opps * min(cfg.min_memory_bytes, mem // (n_opps + 1))
    if g.memory_demand_bytes <= 0:
        return min(g.memory_limit_bytes, room)
    headroom = max(math.ceil(g.memory_demand_bytes * cfg.demand_headroom), cfg.min_memory_bytes)
    return min(g.memory_limit_bytes, g.memory_demand_bytes + headroom, room)


def _limit(out: list[LocalDecision], gpu: int, job: LocalJob, limit: int) -> None:
    if limit != job.memory_limit_bytes:
        out.append(SetMemoryLimit(job.job_id, gpu, limit, job.memory_limit_bytes))


def _shares(out: list[LocalDecision], gpu: int, opps: Sequence[LocalJob], level: float) -> None:
    """`level` split evenly over the opportunistic jobs."""
    _each_share(out, gpu, opps, level / len(opps) if opps else 0.0)


def _each_share(out: list[LocalDecision], gpu: int, opps: Sequence[LocalJob], share: float) -> None:
    """Every opportunistic job at compute share `share`."""
    for job in opps:
        if abs(job.compute_share - share) > 1e-12:
            out.append(SetComputeShare(job.job_id, gpu, share, job.compute_share))


def _fit_opportunistic(out: list[LocalDecision], gpu: int, opps: list[LocalJob], room: int,
                       min_bytes: int) -> None:
    """The opportunistic jobs next to a guarantee job share `room`: each gets at least
    `min_bytes` (an even split of the room when that is less), then up to its demand, then an
    even part of what no demand takes. A measured demand is a peak so far: a job limited to it
    spills to host memory as soon as its use grows, while the rest of the GPU serves nobody."""
    if not opps:
        return
    room = max(0, room)
    floor = min(min_bytes, room // len(opps))
    extra = _share_out(room - floor * len(opps), [max(0, j.memory_demand_bytes - floor) for j in opps])
    for job, add in zip(opps, extra, strict=True):
        _limit(out, gpu, job, floor + add)


def _share_out(total: int, demands: Sequence[int]) -> list[int]:
    """Water-filling: each share at most its demand, the smallest demands met first; then what is
    left (every demand met) evenly over all."""
    limits = [0] * len(demands)
    left = total
    open_ = [i for i, d in enumerate(demands) if d > 0]
    while open_ and left >= len(open_):
        each = left // len(open_)
        still = []
        for i in open_:
            give = min(each, demands[i] - limits[i])
            limits[i] += give
            left -= give
            if limits[i] < demands[i]:
                still.append(i)
        if len(still) == len(open_):
            break
        open_ = still
    if left > 0 and demands and not open_:
        each, odd = divmod(left, len(demands))
        for i in range(len(demands)):
            limits[i] += each + (1 if i < odd else 0)
    return limits


__all__ = ["CoordinatorConfig", "CoordinatorMemo", "Phase", "demands_fit", "is_degraded", "is_stable", "round"]
