"""Jobs that do not cooperate: the checks of what a job reports and what the GPUs show.

The coordinator trusts what a job writes in stats.json and that the job applies the controls it
is sent. These checks say when that trust is broken (pure functions of what the daemon saw; the
local job host runs them each tick, scheduler_lite.containment_host):

  rejects_controls   the job's stats say it refused the newest control the daemon wrote (its
                     `control_seq_applied` stays below it and `last_rejected` names a refusal):
                     e.g. a control.json seq of 2**53 - 1 that makes every later one look stale;
  silent             no stats.json for `jobs.silent_after_s` after its launch, or none newer
                     for that long (a job that unset its ANTMAN_* variables runs stock and writes
                     none);
  impossible         figures no job can have: more memory in use on a device than the GPU
                     has plus the job's host allowance, more than 1 PiB anywhere, an achieved
                     share above 1 or more than SHARE_SLACK above the share in force;
  over_limit         (NVML) the job's processes hold more device memory than its limit;
  unmanaged          (NVML) a process on a managed GPU that belongs to no job.

The NVML checks take `nvmlDeviceGetComputeRunningProcesses` of each GPU (pid, used bytes;
`read_gpu_processes`), run each tick by the local job host with `devices.kind = "nvml"` and
containment (a job's pids are its cgroup's); they ran against a fake NVML only
(tests/scheduler/test_misbehaviour.py), never a real GPU. The bytes a finding says are taken are
counted by the coordinator (`taken_by_gpu` -> GpuView.unmanaged_bytes: not handed out to
the jobs). What a finding leads to (an event, a warning in `status`, and for opportunistic
jobs with `jobs.misbehaviour = "stop"` or `"requeue"` a SIGTERM, the latter putting the job back in
its queue when it has ended) is the host's and the daemon's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from tf_antman.protocol import Stats

ACTIONS: Final = ("warn", "stop", "requeue")  # jobs.misbehaviour: what is done to an opportunistic job found
MAX_PLAUSIBLE_BYTES: Final = 1 << 50  # 1 PiB: no device or host figure of one job is larger
SHARE_SLACK: Final = 0.1  # an achieved share may exceed the share in force by this much (measurement noise)
SHARE_WINDOW_S: Final = 10.0  # after a share change, the share before it is allowed this long


@dataclass(frozen=True, slots=True)
class Finding:
    kind: str  # rejects_controls, silent, impossible, over_limit, unmanaged
    job_id: str | None  # None: a process of no job (unmanaged)
    detail: str  # one line for people
    gpu: int | None = None
    bytes_taken: int = 0  # device memory seen but not controlled (over_limit, unmanaged)

    def line(self) -> str:
        who = self.job_id or f"GPU {self.gpu}"
        return f"{who}: {self.kind}: {self.detail}"


@dataclass(frozen=True, slots=True)
class Sent:
    """The newest control the daemon wrote to a job, and the shares of the ones before."""

    seq: int
    share: float  # its compute share
    # seq -> compute share of the controls written (the newest few): a job applies a control at
    # its next step boundary and measures its achieved share over a window of steps, so it is
    # held to the share of the control it says it applied, or of the one before.
    shares: tuple[tuple[int, float], ...] = ()
    written_at: float = 0.0  # when the newest was written (the daemon's clock)

    def ceiling(self, applied: int, now: float) -> float:
        """The largest share the job may be running at, having applied control `applied`: that
        control's, and for SHARE_WINDOW_S after a newer one was written, the one before too (its
        achieved share is measured over steps that may straddle the change)."""
        known = dict(self.shares)
        earlier = [seq for seq in known if seq <= applied]
        if not earlier:  # before any control it knows of: the launch's, or the newest
            return max([self.share, *known.values()])
        at = max(earlier)
        before = [known[seq] for seq in known if seq < at] if now - self.written_at < SHARE_WINDOW_S else []
        return max([known[at], *before[-1:]])


def check_stats(job_id: str, stats: Stats | None, *, sent: Sent | None, gpu_memory: Sequence[int],
                host_allowance: int, now: float, stats_since: float | None, launched_at: float,
                silent_after_s: float) -> list[Finding]:
    """What one job's stats (None: none readable) say is wrong. `gpu_memory`: the memory of its
    GPUs in placement order; `stats_since`: when the daemon last saw a new stats document."""
    found: list[Finding] = []
    last = launched_at if stats_since is None else stats_since
    if now - last > silent_after_s:
        what = "no stats.json since its launch" if stats is None else "no new stats.json"
        found.append(Finding("silent", job_id, f"{what} for {now - last:.0f} s (jobs.silent_after_s = "
                                               f"{silent_after_s:g}): it may not run tf-antman"))
    if stats is None:
        return found
    if sent is not None and stats.control_seq_applied < sent.seq and stats.last_rejected is not None:
        reason = stats.last_rejected.reason
        found.append(Finding("rejects_controls", job_id, f"control seq {sent.seq} not applied (applied "
                                                         f"{stats.control_seq_applied}; {stats.controls_rejected} "
                                                         f"refused, the last: {reason})"))
    for d in stats.devices:
        cap = (gpu_memory[d.device] if 0 <= d.device < len(gpu_memory) else 0) + host_allowance
        for name in ("in_use_bytes", "reserved_bytes", "step_peak_bytes", "host_in_use_bytes"):
            value = getattr(d, name)
            limit = MAX_PLAUSIBLE_BYTES if name.startswith("host") else min(cap, MAX_PLAUSIBLE_BYTES)
            if not 0 <= value <= limit:  # one finding per device: the first figure that cannot be
                found.append(Finding("impossible", job_id, f"device {d.device} {name} = {value} (accepted at most "
                                                           f"{limit})"))
                break
    share = stats.achieved_share
    if share is not None:
        allowed = 1.0 if sent is None else sent.ceiling(stats.control_seq_applied, now)
        ceiling = min(1.0, allowed + SHARE_SLACK)
        if not 0.0 <= share <= ceiling:
            found.append(Finding("impossible", job_id, f"achieved share {share:g} above the share in force "
                                                       f"({allowed:g}, +{SHARE_SLACK:g})"))
    return found


def read_gpu_processes(nvml: Any, indices: Iterable[int]) -> dict[int, list[tuple[int, int]]]:
    """(pid, used device bytes) of the compute processes on each GPU, from NVML
    (`nvmlDeviceGetComputeRunningProcesses`; usedGpuMemory None, as NVML reports under some
    drivers and in MIG mode, counts as 0)."""
    out: dict[int, list[tuple[int, int]]] = {}
    for index in indices:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        out[index] = [(int(p.pid), int(p.usedGpuMemory or 0)) for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)]
    return out


def check_gpu_processes(processes: Mapping[int, Sequence[tuple[int, int]]], owner: Mapping[int, str],
                        limits: Mapping[tuple[str, int], int]) -> list[Finding]:
    """Per-process device memory against the jobs: `owner` maps a pid to its job (from the jobs'
    cgroups), `limits` (job, GPU) to the job's memory limit there. A process of no job is
    `unmanaged`; a job holding more than its limit on a GPU is `over_limit`; both count as taken
    (`bytes_taken`: the memory the coordinator sees but does not control)."""
    found: list[Finding] = []
    for gpu, procs in sorted(processes.items()):
        held: dict[str, int] = {}
        for pid, used in procs:
            job = owner.get(pid)
            if job is None:
                found.append(Finding("unmanaged", None, f"pid {pid} holds {used} bytes and belongs to no job", gpu,
                                     used))
            else:
                held[job] = held.get(job, 0) + used
        for job, used in sorted(held.items()):
            limit = limits.get((job, gpu))
            if limit is not None and used > limit:
                found.append(Finding("over_limit", job, f"holds {used} bytes on GPU {gpu}, its limit is {limit}",
                                     gpu, used - limit))
    return found


def taken_by_gpu(found: Iterable[Finding]) -> dict[int, int]:
    """The bytes taken (`bytes_taken` of the NVML findings) on each GPU: what the coordinator
    counts as used and does not hand out (GpuView.unmanaged_bytes)."""
    taken: dict[int, int] = {}
    for f in found:
        if f.gpu is not None and f.bytes_taken > 0:
            taken[f.gpu] = taken.get(f.gpu, 0) + f.bytes_taken
    return taken


__all__ = ["ACTIONS", "MAX_PLAUSIBLE_BYTES", "SHARE_SLACK", "SHARE_WINDOW_S", "Finding", "Sent", "check_gpu_processes", "check_stats",
           "read_gpu_processes", "taken_by_gpu"]
