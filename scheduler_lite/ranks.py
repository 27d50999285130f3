"""A job of one training process per GPU (torchrun, accelerate, deepspeed): its ranks' files.

Rank r of a job placed on n GPUs serves the placement's r-th GPU and runs its own agent: rank 0
in the job directory, rank r > 0 in `ranks/<r>/` (tf_antman.protocol.layout.rank_dir,
docs/protocol.md "Several training processes"). Pure functions of the ranks' documents, the same
translation the cluster mode makes between a job and its parts on its nodes
(scheduler_lite.cluster.parts: `split_control`, `merge_stats`), with a rank for a part:

  the daemon's control (limits by the job's device index)  ->  rank r's: device r's limit only
  the ranks' stats.json (one device each)                  ->  the job's: device r from rank r

A rank reports and takes limits for device r, its index among the job's devices (scheduler_lite
makes every GPU of a job visible to each of its processes, so LOCAL_RANK r selects device r).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from scheduler_lite.isolation import read_job_stats
from scheduler_lite.jobenv import process_control
from tf_antman.protocol import Control, MemoryLimit, Stats, stats_path, write_control
from tf_antman.protocol.layout import rank_dir


def job_stats(job_dir: Path, uid: int | None, gpus: int) -> Stats | None:
    """The job's stats (isolation.read_job_stats of each rank's, merged): rank 0's alone while no
    rank r > 0 has reported (one process for all its GPUs, or its ranks > 0 not started yet);
    None while one of its ranks reports nothing (no new document: silent, as a job writing none)."""
    first = read_job_stats(job_dir, uid)
    ranks = [read_job_stats(rank_dir(job_dir, r), uid) for r in range(1, gpus)]
    if all(s is None for s in ranks):
        return first
    if first is None or any(s is None for s in ranks):
        return None
    return merge_rank_stats([first, *ranks])


def write_controls(job_dir: Path, gpus: int, control: Control) -> None:
    """The job's control as each rank takes it (`rank_control`): rank r's GPU is the placement's r-th."""
    ranked = gpus > 1 and any(stats_path(rank_dir(job_dir, r)).exists() for r in range(1, gpus))
    for rank in range(gpus - 1, 0, -1):
        here = rank_dir(job_dir, rank)
        if here.is_dir():  # made at prepare (a job launched before ranks existed has none)
            write_control(here, rank_control(control, rank, ranked))
    write_control(job_dir, rank_control(control, 0, ranked))


def rank_control(control: Control, rank: int, ranked: bool) -> Control:
    """Rank `rank`'s control.json: the memory limit of its own GPU, the job's share and pause.

    `ranked`: a rank r > 0 of the job has written its stats.json, so it runs a process per GPU
    (not one process for all of them, which reports device 0 alone in the job directory).
    Rank 0 of a job not known to run a process per GPU (`ranked` False) may be one process for
    all its GPUs: it gets the tightest limit, for device 0 (jobenv.process_control), which is safe
    for a rank 0 too. The share is the job's (the lowest of its GPUs'): ranks of a data-parallel
    job wait for each other at every step, so a rank allowed more than the slowest would wait."""
    if rank == 0 and not ranked:
        return process_control(control)
    mine = tuple(MemoryLimit(rank, m.limit_bytes) for m in control.memory_limits if m.device == rank)
    return replace(control, memory_limits=mine)


def merge_rank_stats(ranks: Sequence[Stats]) -> Stats:
    """One Stats for a job from its ranks' (rank order), as the coordinator reads a job.

    Devices: rank r's (its first entry: one device a rank) as the job's device r. Steps, from the
    slowest rank (fewest steps, then the longest median step, then the lowest rank): the job
    has made as many synchronised steps as its slowest rank, and a step takes it as long as that
    rank takes (DDP's all-reduce waits for it). seq and control_seq_applied: the lowest, so the
    job's document is new only once its least advanced rank has written again (a rank that stops
    writing holds it: the job goes silent, as a job writing nothing does) and a control counts as
    applied once every rank applied it. Share in force: the lowest; achieved share: the highest
    (the misbehaviour checks hold every rank to the share it was sent)."""
    if len(ranks) == 1:
        return ranks[0]
    slowest = min(range(len(ranks)),
                  key=lambda r: (ranks[r].step, -(ranks[r].step_ms_median or 0.0), r))
    base = ranks[slowest]
    devices = tuple(replace(s.devices[0], device=r) for r, s in enumerate(ranks) if s.devices)
    applied = min(s.control_seq_applied for s in ranks)
    achieved = [s.achieved_share for s in ranks if s.achieved_share is not None]
    behind = [s for s in ranks if s.control_seq_applied == applied and s.last_rejected is not None]
    return replace(
        base,
        seq=min(s.seq for s in ranks),
        pid=ranks[0].pid,
        devices=devices,
        compute_share=min(s.compute_share for s in ranks),
        achieved_share=max(achieved) if achieved else None,
        control_seq_applied=applied,
        controls_applied=min(s.controls_applied for s in ranks),
        controls_rejected=sum(s.controls_rejected for s in ranks),
        last_rejected=behind[0].last_rejected if behind else base.last_rejected,
        wall_time=min(s.wall_time for s in ranks),
    )
