"""Jobs that do not cooperate: the checks of what a job reports and what the GPUs show.

The coordinator trusts what a job writes in stats.json and that the job applies the controls it
is sent. These checks say when that trust is broken (pure functions of what the daemon saw; the
`Judge` keeps what they need per job and the local job host, scheduler_lite.jobhost, runs it
each tick):

  rejects_controls   the job's stats say it refused the newest control the daemon wrote (its
                     `control_seq_applied` stays below it and `last_rejected` names a refusal):
                     e.g. a control.json seq of 2**53 - 1 that makes every later one look stale;
  silent             no stats.json for `jobs.silent_after_s` after its launch, or none newer
                     for that long (a job that unset its ANTMAN_* variables runs stock and writes
                     none);
  impossible         figures no job can have: more memory in use on a device than the GPU
                     has plus the job's host allowance, more than 1 PiB anywhere, an achieved
                     share above 1 or more than SHARE_SLACK above the share in force;
  over_limit         (NVML) the job's processes hold more device memory than its limit in
                     force plus `jobs.gpu_overhead_bytes` (see below);
  unmanaged          (NVML) a process on a managed GPU that belongs to no job.

The NVML checks take `nvmlDeviceGetComputeRunningProcesses` of each GPU (pid, used bytes;
`NvmlDevices.compute_processes`), run each tick by the local job host with `devices.kind = "nvml"`
and containment (a job's pids are its cgroup's). Their first real-GPU run (bench/gpu_colocate.py
on an H200, 2026-11-27) called two well-behaved PyTorch jobs `over_limit`, which is why:
  - a job is held to its limit *in force* (`limit_in_force`): a control that lowers it counts
    once the job's stats say it applied it (`control_seq_applied`; a job applies a control at
    its next step, ~700 ms for an opportunistic job at share 0.05), a raise at once;
  - NVML's per-process bytes include the CUDA context and library workspaces (cuBLAS, cuDNN)
    that no framework allocator hands out and the limit does not govern (0.77 GiB for ResNet-50
    under PyTorch 2.11 there): only bytes past the limit plus `jobs.gpu_overhead_bytes` are
    misbehaviour.
Every byte a job holds above its limit in force, and every byte of a process of no job, is
taken all the same: counted by the coordinator (`Judge.taken_bytes` -> GpuView.unmanaged_bytes:
not handed out to the jobs), finding or not. What a finding leads to: an event `misbehaving`
and a log warning when new, a warning in `status` while it lasts (`Judge.findings`), and for
opportunistic jobs with `jobs.misbehaviour = "stop"` a SIGTERM (event `misbehaviour_stop`; the
daemon's SIGKILL follows after jobs.cancel_grace_s), with `"requeue"` the same and the job marked
(`LiveJob.requeue`) for the daemon to queue it again when it has ended.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from scheduler_lite.model import Role
from tf_antman.protocol import Control, Stats

if TYPE_CHECKING:
    from scheduler_lite.config import JobsConfig
    from scheduler_lite.storage import Storage
    from scheduler_lite.tick import LiveJob

log = logging.getLogger("scheduler_lite")

MAX_PLAUSIBLE_BYTES: Final = 1 << 50  # 1 PiB: no device or host figure of one job is larger
SHARE_SLACK: Final = 0.1  # an achieved share may exceed the share in force by this much (measurement noise)
SHARE_WINDOW_S: Final = 10.0  # after a share change, the share before it is allowed this long
SENT_HISTORY: Final = 8  # controls whose shares are kept per job (Sent.shares)


@dataclass(frozen=True, slots=True)
class Finding:
    kind: str  # rejects_controls, silent, impossible, over_limit, unmanaged
    job_id: str | None  # None: a process of no job (unmanaged)
    detail: str  # one line for people
    gpu: int | None = None
    bytes_taken: int = 0  # its part of the GPU's taken bytes (check_gpu_processes: over_limit, unmanaged)

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
                host_allowance: int, now: float, since: float, silent_after_s: float) -> list[Finding]:
    """What one job's stats (None: none readable) say is wrong. `gpu_memory`: the memory of its
    GPUs in placement order; `since`: when the daemon last saw a new stats document (none yet:
    when the job was launched)."""
    found: list[Finding] = []
    if now - since > silent_after_s:
        what = "no stats.json since its launch" if stats is None else "no new stats.json"
        found.append(Finding("silent", job_id, f"{what} for {now - since:.0f} s (jobs.silent_after_s = "
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


SENT_LIMITS: Final = 16  # (seq, limit) entries kept per job and GPU (_Watched.limits)


def _newest_applied(sent: Sequence[tuple[int, int]], applied: int) -> int | None:
    """The index in `sent` ((seq, limit), oldest first) of the newest control the job applied;
    None where it applied none of them."""
    return max((i for i, (seq, _) in enumerate(sent) if seq <= applied), default=None)


def limit_in_force(sent: Sequence[tuple[int, int]], applied: int) -> int | None:
    """A job's memory limit on one GPU that `over_limit` holds it to: `sent` the (seq, limit) of
    the controls that set it, oldest first (a launch's is seq 0), `applied` its stats'
    `control_seq_applied`. The newest control it applied is in force, and any sent after it that
    is higher: a raise counts at once, a lowering only once applied (until then the job may still
    hold what the limit before allowed). None where it applied none of them: a job adopted after
    a restart, whose limit before it is not known, is not judged until it applies one sent since."""
    first = _newest_applied(sent, applied)
    return None if first is None else max(limit for _, limit in sent[first:])


def _record_limit(sent: Sequence[tuple[int, int]], applied: int, seq: int, limit: int) -> list[tuple[int, int]]:
    """`sent` with a control's limit added: from the newest applied entry on (those before it are
    done with); an unchanged limit is not added (every control carries every GPU's limit); past
    SENT_LIMITS entries the two oldest pending ones become one with the larger limit, which errs
    towards the job (a job that applies nothing cannot grow the list)."""
    first = _newest_applied(sent, applied)
    kept = list(sent[first or 0:])
    if kept and kept[-1][1] == limit:
        return kept
    kept.append((seq, limit))
    if len(kept) > SENT_LIMITS:
        (_, a), (seq_b, b) = kept[1], kept[2]
        kept[1:3] = [(seq_b, max(a, b))]
    return kept


def check_gpu_processes(processes: Mapping[int, Sequence[tuple[int, int]]], owner: Mapping[int, str],
                        limits: Mapping[tuple[str, int], int],
                        allowance: int) -> tuple[list[Finding], dict[int, int]]:
    """Per-process device memory against the jobs: `owner` maps a pid to its job (from the jobs'
    cgroups), `limits` (job, GPU) to the job's memory limit in force there (`limit_in_force`).
    Returns the findings and the bytes taken per GPU: what the coordinator sees used but does not
    control, i.e. all a process of no job holds (`unmanaged`) and all a job holds above its
    limit. A job is `over_limit` only past its limit plus `allowance` (jobs.gpu_overhead_bytes):
    NVML counts the CUDA context and library workspaces, which its limit does not govern."""
    found: list[Finding] = []
    taken: dict[int, int] = {}
    for gpu, procs in sorted(processes.items()):
        held: dict[str, int] = {}
        for pid, used in procs:
            job = owner.get(pid)
            if job is None:
                taken[gpu] = taken.get(gpu, 0) + used
                found.append(Finding("unmanaged", None, f"pid {pid} holds {used} bytes and belongs to no job", gpu,
                                     used))
            else:
                held[job] = held.get(job, 0) + used
        for job, used in sorted(held.items()):
            limit = limits.get((job, gpu))
            over = 0 if limit is None else used - limit
            if over > 0:  # used, though perhaps no misbehaviour: the allowance decides that
                taken[gpu] = taken.get(gpu, 0) + over
            if over > allowance:
                found.append(Finding("over_limit", job, f"holds {used} bytes on GPU {gpu}, its limit in force is "
                                                        f"{limit} (+{allowance} allowed for the CUDA context and "
                                                        f"libraries)", gpu, over))
    return found, taken


@dataclass(slots=True)
class _Watched:
    """What the judge keeps of one job."""

    since: float  # when its newest stats were first seen (none yet: when the host launched or adopted it)
    sent: Sent | None = None  # the newest control written to it
    # Per GPU, the (seq, limit) of the controls that set its memory limit there, from the newest
    # it applied on (limit_in_force; a launch's limit is seq 0).
    limits: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    applied: int = 0  # control_seq_applied of its newest stats
    stats_seq: int | None = None  # of its newest stats
    findings: list[Finding] = field(default_factory=list)  # what its latest stats (and NVML) showed
    on_gpus: list[Finding] = field(default_factory=list)  # NVML's of it (over_limit), by the last read


class Judge:
    """The checks run on one host's jobs: what each was sent and when it last reported, its
    findings recorded (an event and a log line when new) and acted on (jobs.misbehaviour)."""

    def __init__(self, jobs: JobsConfig, storage: Storage | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.jobs = jobs
        self.storage = storage  # where findings are recorded as events (None: logged only)
        self.clock = clock
        self._jobs: dict[str, _Watched] = {}  # from its launch (or adoption) to its end
        self.by_gpu: dict[int, list[Finding]] = {}  # NVML's processes of no job (unmanaged)
        self._taken: dict[int, int] = {}  # by GPU: NVML's bytes of no job and above limits (taken_bytes)

    def findings(self) -> list[Finding]:
        """The GPUs' findings, then the jobs' (by job id): `status` warnings and metrics."""
        return [*(f for gpu in sorted(self.by_gpu) for f in self.by_gpu[gpu]),
                *(f for job in sorted(self._jobs) for f in self._jobs[job].findings)]

    def launched(self, job_id: str, share: float, limits: Mapping[int, int] | None = None) -> None:
        """A launch (`limits`: its memory limit per GPU) or an adoption of the job starts afresh."""
        now = self.clock()
        self._jobs[job_id] = _Watched(now, Sent(0, share, ((0, share),), now),
                                      {gpu: [(0, limit)] for gpu, limit in (limits or {}).items()})

    def ended(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)

    def sent(self, job_id: str, placement: Sequence[int], control: Control) -> None:
        job = self._jobs.setdefault(job_id, _Watched(self.clock()))  # launched or adopted first, as a rule
        for entry in control.memory_limits:  # device = the GPU's index within the job
            if 0 <= entry.device < len(placement):
                gpu = placement[entry.device]
                job.limits[gpu] = _record_limit(job.limits.get(gpu, []), job.applied, control.seq,
                                                entry.limit_bytes)
        before = job.sent
        share = control.compute_share if control.compute_share is not None else (1.0 if before is None else before.share)
        history = (() if before is None else before.shares)[-(SENT_HISTORY - 1):] + ((control.seq, share),)
        job.sent = Sent(control.seq, share, history, self.clock())

    def check(self, job_id: str, live: LiveJob, found: Stats | None, gpu_memory: Sequence[int]) -> bool:
        """The job's stats (None: none readable) checked with NVML's findings of it, what is new
        recorded; True where it must be stopped now (SIGTERM: jobs.misbehaviour, an opportunistic
        job). A stop under way (a cancel's, a migration's or this one) is finished by the daemon's
        own SIGKILL after jobs.cancel_grace_s (Daemon._kill_after_grace), which records it."""
        now = self.clock()
        job = self._jobs.setdefault(job_id, _Watched(now))
        if found is not None and job.stats_seq != found.seq:
            job.stats_seq, job.since, job.applied = found.seq, now, found.control_seq_applied
        findings = check_stats(job_id, found, sent=job.sent, gpu_memory=gpu_memory,
                               host_allowance=self.jobs.host_memory_bytes, now=now, since=job.since,
                               silent_after_s=self.jobs.silent_after_s)
        findings += job.on_gpus
        known = {f.kind for f in job.findings}
        job.findings = findings
        for f in findings:
            if f.kind in known:
                continue
            log.warning("%s does not cooperate: %s", job_id, f.line())
            if self.storage is not None:
                self.storage.add_event(now, "misbehaving", job_id, check=f.kind, detail=f.detail)
        action = self.jobs.misbehaviour
        if not findings or live.record.role is not Role.OPPORTUNISTIC or action not in ("stop", "requeue") \
                or live.stop_sent_at is not None:
            return False
        live.stop_sent_at = now
        checks = sorted({f.kind for f in findings})
        if action == "requeue":  # the daemon queues it again once it has ended (Daemon.finish)
            live.requeue = "misbehaving: " + ", ".join(checks)
        log.warning("%s stopped: an opportunistic job that does not cooperate (jobs.misbehaviour = \"%s\")",
                    job_id, action)
        if self.storage is not None:
            self.storage.add_event(now, "misbehaviour_stop", job_id, signal="SIGTERM", action=action, checks=checks)
        return True

    def gpu_processes(self, processes: Mapping[int, Sequence[tuple[int, int]]], owner: Mapping[int, str],
                      now: float) -> None:
        """Each GPU's compute processes (pid, bytes) against the jobs (`owner`: pid -> job id, from
        their cgroups) and their limits in force (as of their newest stats): a job over its limit
        plus jobs.gpu_overhead_bytes is `over_limit` (judged with its stats, `check`), a process
        of no job `unmanaged` (an event once, a finding while it lasts)."""
        in_force = {(job_id, gpu): limit_in_force(sent, job.applied)
                    for job_id, job in self._jobs.items() for gpu, sent in job.limits.items()}
        limits = {key: limit for key, limit in in_force.items() if limit is not None}
        for job in self._jobs.values():
            job.on_gpus = []
        unmanaged: dict[int, list[Finding]] = {}
        found, self._taken = check_gpu_processes(processes, owner, limits, self.jobs.gpu_overhead_bytes)
        for f in found:
            if f.job_id is not None:  # over_limit: a job with limits, so watched
                self._jobs[f.job_id].on_gpus.append(f)
            elif f.gpu is not None:
                unmanaged.setdefault(f.gpu, []).append(f)
        for gpu, items in unmanaged.items():
            if gpu not in self.by_gpu:
                log.warning("%s", "; ".join(f.line() for f in items))
                if self.storage is not None:
                    for f in items:
                        self.storage.add_event(now, "misbehaving", None, check=f.kind, gpu=f.gpu, detail=f.detail,
                                               bytes_taken=f.bytes_taken)
        self.by_gpu = unmanaged

    def taken_bytes(self, gpu: int) -> int:
        """JobHost.taken_bytes as the last NVML read saw it (check_gpu_processes): what the
        coordinator counts as used and does not hand out (GpuView.unmanaged_bytes)."""
        return self._taken.get(gpu, 0)


__all__ = ["MAX_PLAUSIBLE_BYTES", "SENT_LIMITS", "SHARE_SLACK", "SHARE_WINDOW_S", "Finding", "Judge", "Sent",
           "check_gpu_processes", "check_stats", "limit_in_force"]
