"""Jobs that do not cooperate are caught (scheduler_lite.misbehaviour): the checks alone, the
NVML per-process side against a fake NVML, and the real daemon with jobs that write their own
stats.json (impossible figures, refused controls) or none at all."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from scheduler_lite.config import JobsConfig
from scheduler_lite.devices import NvmlDevices
from scheduler_lite.misbehaviour import (
    MAX_PLAUSIBLE_BYTES,
    SENT_LIMITS,
    Judge,
    Sent,
    check_gpu_processes,
    check_stats,
    limit_in_force,
)
from scheduler_lite.model import Role
from scheduler_lite.tick import LiveJob
from tests.scheduler.configs import scheduler_config, to_toml
from tests.scheduler.test_daemon_devices import FakeNvml as DevicesFakeNvml
from tests.scheduler.test_daemon_fakes import REPO, wait_for
from tests.scheduler.test_submit_idempotent import serving
from tf_antman.protocol import Control, DeviceStats, MemoryLimit, Rejection, Stats

GIB = 1 << 30


def stats(**kw: object) -> Stats:
    fields: dict = {"seq": 1, "pid": 1, "state": "running", "step": 3, "wall_time": 1.0}
    fields.update(kw)
    return Stats(**fields)


def device(in_use: int) -> DeviceStats:
    return DeviceStats(0, None, in_use, in_use, in_use, 0, 0, 0, 0)


def kinds(found: list) -> list[str]:
    return [f.kind for f in found]


CHECK = {"gpu_memory": [GIB], "host_allowance": GIB, "now": 100.0, "silent_after_s": 60.0}


def test_the_checks() -> None:
    assert check_stats("j", stats(), sent=Sent(2, 1.0), since=90.0, **CHECK) == []
    # 1 PiB in use, an achieved share of 1.0 against 0.05 in force, controls refused, silence.
    assert kinds(check_stats("j", stats(devices=(device(MAX_PLAUSIBLE_BYTES),)), sent=None, since=90.0,
                             **CHECK)) == ["impossible"]
    assert kinds(check_stats("j", stats(achieved_share=1.0), sent=Sent(2, 0.05), since=90.0, **CHECK)) == [
        "impossible"]
    assert check_stats("j", stats(achieved_share=0.14), sent=Sent(2, 0.05), since=90.0, **CHECK) == []
    # The share the job says it applied counts, and for a while after a change the one before it.
    changed = Sent(3, 0.05, ((2, 0.5), (3, 0.05)), written_at=95.0)
    assert check_stats("j", stats(achieved_share=0.5, control_seq_applied=2), sent=changed, since=99.0,
                       **CHECK) == []
    assert check_stats("j", stats(achieved_share=0.5, control_seq_applied=3), sent=changed, since=99.0,
                       **CHECK) == []  # 5 s after the change: its window may straddle it
    assert kinds(check_stats("j", stats(achieved_share=0.5, control_seq_applied=3), sent=changed, since=99.0,
                             **{**CHECK, "now": 120.0})) == ["impossible"]  # 25 s after: held at 0.05
    refused = stats(control_seq_applied=1, controls_rejected=4,
                    last_rejected=Rejection.clipped(2, "seq", "must be greater than 9007199254740991"))
    found = check_stats("j", refused, sent=Sent(2, 0.05), since=90.0, **CHECK)
    assert kinds(found) == ["rejects_controls"] and "must be greater than 9007199254740991" in found[0].detail
    assert kinds(check_stats("j", None, sent=None, since=0.0, **CHECK)) == ["silent"]
    assert kinds(check_stats("j", stats(), sent=None, since=30.0, **CHECK)) == ["silent"]


@dataclass
class Proc:
    pid: int
    usedGpuMemory: int | None  # noqa: N815 - NVML's field name


class FakeNvml(DevicesFakeNvml):
    """test_daemon_devices' NVML, with per-process memory per GPU."""

    def __init__(self, processes: dict[int, list[Proc]]) -> None:
        super().__init__()
        self.processes = processes

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Proc]:  # noqa: N802
        return self.processes[handle]


def test_per_process_memory_from_a_fake_nvml() -> None:
    nvml = FakeNvml({0: [Proc(10, 3 * GIB), Proc(11, GIB)], 1: [Proc(12, None), Proc(99, 2 * GIB)]})
    seen = NvmlDevices([0, 1], nvml=nvml).compute_processes()
    assert seen == {0: [(10, 3 * GIB), (11, GIB)], 1: [(12, 0), (99, 2 * GIB)]}
    owner, limits = {10: "job-1", 11: "job-1", 12: "job-2"}, {("job-1", 0): 2 * GIB, ("job-2", 1): GIB}
    found, taken = check_gpu_processes(seen, owner, limits, GIB)
    assert [(f.kind, f.job_id, f.gpu, f.bytes_taken) for f in found] == [
        ("over_limit", "job-1", 0, 2 * GIB),  # 4 GiB held against a 2 GiB limit, 1 GiB allowed
        ("unmanaged", None, 1, 2 * GIB),  # pid 99 is no job's: all it holds is taken
    ]
    assert found[0].detail == (f"holds {4 * GIB} bytes on GPU 0, its limit in force is {2 * GIB} (+{GIB} allowed "
                               "for the CUDA context and libraries)")
    assert taken == {0: 2 * GIB, 1: 2 * GIB}
    judge = Judge(JobsConfig())
    for (job, gpu), limit in limits.items():
        judge.launched(job, 1.0, {gpu: limit})
    judge.gpu_processes(seen, owner, 0.0)
    # What the coordinator does not hand out.
    assert (judge.taken_bytes(0), judge.taken_bytes(1)) == (2 * GIB, 2 * GIB)


def guarantee() -> LiveJob:
    """What Judge.check reads of a LiveJob: a guarantee job's (warned about, never stopped)."""
    return SimpleNamespace(record=SimpleNamespace(role=Role.GUARANTEE), stop_sent_at=None)  # type: ignore[return-value]


def judged(judge: Judge, job: str, found: Stats, held: int) -> list[str]:
    """One tick of the local job host for a job alone on GPU 0 (pid 10): its stats checked, NVML
    read (`held` bytes), and its findings as the next check records them."""
    judge.check(job, guarantee(), found, [80 * GIB])
    judge.gpu_processes({0: [(10, held)]}, {10: job}, found.wall_time)
    judge.check(job, guarantee(), found, [80 * GIB])
    return [f.detail for f in judge.findings()]


def test_over_a_limit_within_the_allowance_is_taken_but_no_misbehaviour() -> None:
    """A job holding 0.77 GiB past its limit (the CUDA context and cuBLAS/cuDNN workspaces of the
    H200 run's ResNet-50 job): within the 1 GiB allowance no finding, and still every byte over its
    limit taken; with a smaller allowance over_limit, the same bytes taken."""
    held = {0: [(10, 6 * GIB + (770 << 20))]}
    found, taken = check_gpu_processes(held, {10: "job-3"}, {("job-3", 0): 6 * GIB}, GIB)
    assert (found, taken) == ([], {0: 770 << 20})
    found, taken = check_gpu_processes(held, {10: "job-3"}, {("job-3", 0): 6 * GIB}, 512 << 20)
    assert (kinds(found), taken) == (["over_limit"], {0: 770 << 20})
    assert check_gpu_processes({0: [(10, GIB)]}, {10: "job-3"}, {("job-3", 0): 2 * GIB}, 0) == ([], {})
    judge = Judge(JobsConfig())  # the default allowance, 1 GiB
    judge.launched("job-3", 1.0, {0: 6 * GIB})
    assert judged(judge, "job-3", stats(), 6 * GIB + (770 << 20)) == []
    assert judge.taken_bytes(0) == 770 << 20
    assert judged(judge, "job-3", stats(), 7 * GIB + 1) == [
        f"holds {7 * GIB + 1} bytes on GPU 0, its limit in force is {6 * GIB} (+{GIB} allowed for the CUDA "
        "context and libraries)"]


def lowered(seq: int, limit: int) -> Control:
    return Control(seq=seq, memory_limits=(MemoryLimit(0, limit),))


def test_a_lowered_limit_counts_once_the_job_applied_it_and_a_raise_at_once() -> None:
    """The H200 run's job-1: sent 256 MiB (seq 1) while holding 3.4 GiB under its 4 GiB limit, it
    is judged against 4 GiB until its stats say it applied seq 1, then against 256 MiB."""
    judge, held = Judge(JobsConfig(gpu_overhead_bytes=0)), 3 * GIB + (400 << 20)
    judge.launched("job-1", 1.0, {0: 4 * GIB})
    judge.sent("job-1", [0], lowered(1, 256 << 20))
    assert judged(judge, "job-1", stats(seq=1), held) == []  # not applied yet: 4 GiB in force
    assert judge.taken_bytes(0) == 0
    assert judged(judge, "job-1", stats(seq=2, control_seq_applied=1), held) == [
        f"holds {held} bytes on GPU 0, its limit in force is {256 << 20} (+0 allowed for the CUDA context and "
        "libraries)"]
    assert judge.taken_bytes(0) == held - (256 << 20)
    # A raise counts before the job applies it; a lowering after it waits again.
    judge.sent("job-1", [0], lowered(2, 4 * GIB))
    assert judged(judge, "job-1", stats(seq=2, control_seq_applied=1), held) == []
    judge.sent("job-1", [0], lowered(3, GIB))
    assert judged(judge, "job-1", stats(seq=3, control_seq_applied=2), held) == []  # the raise's 4 GiB
    assert [d.split(", ")[1] for d in judged(judge, "job-1", stats(seq=4, control_seq_applied=3), held)] == [
        f"its limit in force is {GIB} (+0 allowed for the CUDA context and libraries)"]
    # The rule alone: the newest applied, and any higher sent after it.
    assert limit_in_force([(0, 4 * GIB), (1, GIB), (2, 2 * GIB)], 0) == 4 * GIB
    assert limit_in_force([(0, 4 * GIB), (1, GIB), (2, 2 * GIB)], 1) == 2 * GIB
    assert limit_in_force([(0, GIB), (1, 4 * GIB)], 0) == 4 * GIB
    assert limit_in_force([(58, GIB)], 57) is None  # applied none of them: unknown


def test_an_adopted_job_is_judged_once_it_applied_a_limit_sent_since() -> None:
    """After a daemon restart the judge does not know the limit a job had (adopted: no limits,
    control seqs go on from its control.json): a cut it has not applied is not in force, nothing
    is taken for it, until its stats say it applied a control sent since."""
    judge, held = Judge(JobsConfig(gpu_overhead_bytes=0)), 30 * GIB
    judge.launched("job-7", 1.0)  # adopted
    judge.sent("job-7", [0], lowered(58, 4 * GIB))
    assert judged(judge, "job-7", stats(seq=1, control_seq_applied=57), held) == []
    assert judge.taken_bytes(0) == 0
    assert [d.split(", ")[1] for d in judged(judge, "job-7", stats(seq=2, control_seq_applied=58), held)] == [
        f"its limit in force is {4 * GIB} (+0 allowed for the CUDA context and libraries)"]


def test_a_job_that_applies_nothing_cannot_grow_what_is_kept_of_its_limits() -> None:
    """Every control carries every GPU's limit: an unchanged one is not kept again, and past
    SENT_LIMITS pending ones the oldest merge into the larger limit (towards the job)."""
    judge = Judge(JobsConfig(gpu_overhead_bytes=0))
    judge.launched("job-1", 1.0, {0: 8 * GIB})
    for seq in range(1, 10_001):
        judge.sent("job-1", [0], lowered(seq, GIB if seq % 2 else 2 * GIB if seq % 3 else 8 * GIB))
    kept = judge._jobs["job-1"].limits[0]
    assert len(kept) <= SENT_LIMITS
    assert kept[0] == (0, 8 * GIB)  # the applied one stays
    assert limit_in_force(kept, 0) == 8 * GIB
    assert limit_in_force(kept, 10_000) == kept[-1][1]
    judge.sent("job-1", [0], lowered(10_001, kept[-1][1]))
    assert judge._jobs["job-1"].limits[0] == kept  # unchanged: not kept again


# -- the real daemon ------------------------------------------------------------------------------

WRITER = r"""
import os, sys, time
from pathlib import Path
from tf_antman.protocol import DeviceStats, Rejection, Stats, atomic_write_text, stats_path, temp_dir
d = Path(os.environ["ANTMAN_JOB_DIR"])
mode = sys.argv[1]
seq = 0
while True:
    seq += 1
    extra = {}
    if mode == "huge":
        extra["devices"] = (DeviceStats(0, None, 1 << 50, 1 << 50, 1 << 50, 0, 0, 0, 0),)
    if mode == "refuses":
        extra.update(control_seq_applied=1, controls_rejected=seq,
                     last_rejected=Rejection.clipped(9007199254740991, "seq", "must be greater than 9007199254740991"))
    s = Stats(seq=seq, pid=os.getpid(), state="running", step=seq, wall_time=time.time(), **extra)
    atomic_write_text(stats_path(d), s.to_json(), tmp_dir=temp_dir(d))
    time.sleep(0.1)
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Site:
    """A daemon serving `config_text` from `base` in its own session (`close` ends it), with its
    metrics on a free port, and the CLI on it; `env`: set over the environment of both."""

    def __init__(self, base: Path, config_text: str, env: dict[str, str] | None = None) -> None:
        self.metrics_port = free_port()
        self.base = base
        self.config = base / "sl.toml"
        self.config.write_text(config_text)
        self.env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        with open(base / "daemon.log", "ab") as out:
            self.daemon = subprocess.Popen([sys.executable, "-m", "scheduler_lite", "--config", str(self.config),
                                            "serve", "--metrics-port", str(self.metrics_port)], env=self.env, stdout=out,
                                           stderr=out, start_new_session=True)
        served = wait_for(lambda: serving(self.config), 30)
        if not served:
            self.close()  # no daemon left behind a failed start
        assert served, (base / "daemon.log").read_text()

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as answer:
            return str(answer.read().decode())

    def cli(self, *argv: str) -> str:
        done = subprocess.run([sys.executable, "-m", "scheduler_lite", "--config", str(self.config), *argv],
                              capture_output=True, text=True, cwd=self.base, env=self.env, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def submit(self, *argv: str) -> str:
        return self.cli("submit", *argv).strip()

    def submit_and_wait(self, *argv: str) -> str:
        """Submitted, and its process started (its pid recorded)."""
        job = self.submit(*argv)
        assert wait_for(lambda: self.show(job)["job"]["pid"] is not None, 30)
        return job

    def cancel(self, job: str) -> None:
        self.cli("cancel", job)
        assert wait_for(lambda: self.state(job) == "cancelled", 30)

    def show(self, job: str) -> dict:  # type: ignore[type-arg]
        return json.loads(self.cli("--json", "show", job))  # type: ignore[no-any-return]

    def events(self, job: str) -> list[dict]:
        return self.show(job)["events"]  # type: ignore[no-any-return]

    def state(self, job: str) -> str:
        return str(self.show(job)["job"]["state"])

    def close(self) -> None:
        os.killpg(self.daemon.pid, signal.SIGTERM)
        self.daemon.wait(30)


def site_config(**jobs: object) -> str:
    """One 1 GiB emulated GPU, tenants A (quota 1) and B (0), fast ticks and rounds; `jobs`: the
    [jobs] table's settings over a 1 s cancel grace."""
    return to_toml(scheduler_config(
        ["1GiB"], {"A": 1, "B": 0}, jobs={"cancel_grace_s": 1, **jobs},  # type: ignore[dict-item]
        daemon={"tick_interval_s": 0.05}, coordinator={"min_memory_bytes": "64MiB", "round_interval_s": 0.2}))


@pytest.fixture
def make_site(tmp_path: Path):  # type: ignore[no-untyped-def]
    made: list[Site] = []

    def make(**jobs: object) -> Site:
        made.append(Site(tmp_path, site_config(**jobs)))
        return made[-1]

    yield make
    for site in made:
        for job in ("job-1", "job-2", "job-3"):
            subprocess.run([sys.executable, "-m", "scheduler_lite", "--config", str(site.config), "cancel", job],
                           env=site.env, capture_output=True, timeout=60, check=False)
        # A daemon stopped leaves its jobs running for its next start: they end first.
        wait_for(lambda site=site: "running" not in site.cli("list"), 30)
        site.close()


def misbehaving(site: Site, job: str) -> list[str]:
    return [e["detail"]["check"] for e in site.events(job) if e["kind"] == "misbehaving"]


def test_an_opportunistic_job_reporting_1_pib_is_caught_and_stopped(make_site) -> None:  # type: ignore[no-untyped-def]
    site = make_site(misbehaviour="stop")
    job = site.submit("--tenant", "B", "--type", "opportunistic", "--", sys.executable, "-c", WRITER, "huge")
    assert wait_for(lambda: "impossible" in misbehaving(site, job), 30), site.events(job)
    assert wait_for(lambda: site.state(job) == "failed", 30)  # SIGTERM: it ended by the signal
    kinds = [e["kind"] for e in site.events(job)]
    assert kinds.index("misbehaving") < kinds.index("misbehaviour_stop") < kinds.index("exited")


def test_misbehaviour_requeue_puts_an_opportunistic_job_back_in_its_queue(make_site) -> None:  # type: ignore[no-untyped-def]
    """jobs.misbehaviour = "requeue": an opportunistic job found is stopped and queued again (as a
    migration or a lost node's never-run job: no placement, no token, a new launch); a guarantee
    job found is only warned about."""
    site = make_site(misbehaviour="requeue")
    guarantee = site.submit("--tenant", "A", "--type", "guarantee", "--", sys.executable, "-c", WRITER, "huge")
    opp = site.submit("--tenant", "B", "--type", "opportunistic", "--", sys.executable, "-c", WRITER, "huge")
    launches = lambda: [e for e in site.events(opp) if e["kind"] == "launched"]  # noqa: E731
    assert wait_for(lambda: len(launches()) >= 2, 60), site.events(opp)  # stopped, requeued, launched again
    kinds = [e["kind"] for e in site.events(opp)]
    assert kinds.index("misbehaving") < kinds.index("misbehaviour_stop") < kinds.index("requeued") \
        < [i for i, k in enumerate(kinds) if k == "launched"][1]
    assert "exited" not in kinds[:kinds.index("requeued")]  # not an end: it runs again
    [requeued] = [e for e in site.events(opp) if e["kind"] == "requeued"][:1]
    assert "misbehaving" in requeued["detail"]["reason"] and "impossible" in requeued["detail"]["reason"]
    [stop] = [e for e in site.events(opp) if e["kind"] == "misbehaviour_stop"][:1]
    assert stop["detail"]["action"] == "requeue"
    assert "impossible" in misbehaving(site, guarantee)
    assert site.state(guarantee) == "running"
    assert [e["kind"] for e in site.events(guarantee)].count("launched") == 1
    assert "misbehaviour_stop" not in [e["kind"] for e in site.events(guarantee)]


def test_a_job_refusing_controls_and_a_silent_one_are_warned_about(make_site) -> None:  # type: ignore[no-untyped-def]
    site = make_site(silent_after_s=1)
    refuses = site.submit("--tenant", "B", "--type", "opportunistic", "--", sys.executable, "-c", WRITER, "refuses")
    assert wait_for(lambda: site.state(refuses) == "running", 30)
    # A guarantee job arrives: the opportunistic job is sent a lower limit and share, and refuses.
    silent = site.submit("--tenant", "A", "--type", "guarantee", "--", "sleep", "60")
    assert wait_for(lambda: "rejects_controls" in misbehaving(site, refuses), 30), site.events(refuses)
    assert wait_for(lambda: "silent" in misbehaving(site, silent), 30), site.events(silent)
    status = site.cli("status")
    assert f"WARNING: {refuses}: rejects_controls: control seq" in status
    assert f"WARNING: {silent}: silent: no stats.json since its launch" in status
    metrics = site.metrics()
    assert f'scheduler_lite_job_misbehaving{{check="rejects_controls",job="{refuses}"}} 1.0' in metrics
    assert f'scheduler_lite_job_misbehaving{{check="silent",job="{silent}"}} 1.0' in metrics
    assert "scheduler_lite_containment_active" in metrics
    assert site.state(refuses) == "running"  # jobs.misbehaviour = "warn": nothing else is done


# -- NVML per-process memory in the real daemon, with a fake pynvml module ---------------------------

FAKE_PYNVML = '''
"""A fake pynvml for the daemon process: one 2 GiB GPU; compute processes from a JSON file."""
import json, os
from types import SimpleNamespace

def nvmlInit(): pass
def nvmlDeviceGetCount(): return 1
def nvmlDeviceGetHandleByIndex(i): return i
def nvmlDeviceGetMemoryInfo(h): return SimpleNamespace(total=2 << 30, used=0, free=2 << 30)
def nvmlDeviceGetUtilizationRates(h): return SimpleNamespace(gpu=0, memory=0)
def nvmlDeviceGetPciInfo(h): raise RuntimeError("Not Supported")
def nvmlDeviceGetNvLinkState(h, link): raise RuntimeError("Not Supported")
def nvmlDeviceGetComputeRunningProcesses(h):
    try:
        with open(os.environ["FAKE_NVML_PROCESSES"]) as f:
            table = json.load(f)
    except (OSError, ValueError):
        return []
    return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in table.get(str(h), [])]
'''


@contextlib.contextmanager
def nvml_daemon(tmp_path: Path,
                **sections: dict) -> Iterator[tuple[Site, Path, subprocess.Popen[bytes]]]:  # type: ignore[type-arg]
    """A site serving one fake-NVML 2 GiB GPU; with it, the per-process table the test writes
    ({gpu: [[pid, bytes], ...]} for FAKE_PYNVML's nvmlDeviceGetComputeRunningProcesses) and an
    outsider: a process on the GPU in no job's cgroup."""
    from scheduler_lite.containment import Containment

    if os.geteuid() != 0 or not Containment(tmp_path).active:
        pytest.skip("needs containment (root, cgroup2): the pids are told apart by the jobs' cgroups")
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "pynvml.py").write_text(FAKE_PYNVML)
    text = to_toml(scheduler_config(["1GiB"], {"A": 1, "B": 0}, daemon={"tick_interval_s": 0.05}, **sections))
    text = (text.replace('kind = "emulated"', 'kind = "nvml"').split("[[devices.emulated]]")[0]
            + "[[tenants]]" + text.split("[[tenants]]", 1)[1])
    table = tmp_path / "processes.json"
    env = {"PYTHONPATH": f"{fake}{os.pathsep}{REPO}", "FAKE_NVML_PROCESSES": str(table)}
    outsider = subprocess.Popen(["sleep", "300"])
    site = None
    try:
        site = Site(tmp_path, text, env)
        yield site, table, outsider
    finally:
        outsider.kill()
        outsider.wait()
        if site is not None:
            site.close()


def test_nvml_per_process_memory_over_a_limit_and_outside_every_job(tmp_path: Path) -> None:
    # gpu_overhead_bytes 0: 1 GiB over is within the default's
    with nvml_daemon(tmp_path, jobs={"gpu_overhead_bytes": 0}) as (d, table, outsider):
        job = d.submit_and_wait("--tenant", "A", "--", "sleep", "300")
        pid = d.show(job)["job"]["pid"]  # its wrapper: in the job's cgroup
        table.write_text(json.dumps({"0": [[pid, 3 << 30], [outsider.pid, 1 << 30]]}))

        def checks() -> list[tuple[str | None, str]]:
            return [(e["job_id"], e["detail"]["check"]) for e in d.show(job)["events"] if e["kind"] == "misbehaving"]

        assert wait_for(lambda: (job, "over_limit") in checks(), 30), checks()
        status = d.cli("status")
        assert (f"WARNING: {job}: over_limit: holds {3 << 30} bytes on GPU 0, its limit in force is {2 << 30} "
                "(+0 allowed for the CUDA context and libraries)") in status
        assert f"WARNING: GPU 0: unmanaged: pid {outsider.pid} holds {1 << 30} bytes and belongs to no job" in status
        d.cancel(job)


def test_nvml_memory_of_no_job_is_not_handed_out_by_the_coordinator(tmp_path: Path) -> None:
    """An opportunistic job alone on the (fake NVML) 2 GiB GPU gets the whole GPU; once a process
    of no job holds 512 MiB there, the coordinator's next round gives the job the rest only."""
    with nvml_daemon(tmp_path, coordinator={"round_interval_s": 0.2}) as (d, table, outsider):
        job = d.submit_and_wait("--tenant", "B", "--type", "opportunistic", "--", "sleep", "300")
        launched = [e for e in d.show(job)["events"] if e["kind"] == "launched"]
        assert launched[0]["detail"]["memory_limit_bytes"] == 2 << 30  # alone: the whole GPU
        table.write_text(json.dumps({"0": [[outsider.pid, 512 << 20]]}))

        def limits() -> list[int]:
            return [e["detail"]["limit_bytes"] for e in d.show(job)["events"] if e["kind"] == "memory_limit"]

        assert wait_for(lambda: (2 << 30) - (512 << 20) in limits(), 30), limits()
        table.write_text(json.dumps({"0": []}))  # gone: the whole GPU again
        assert wait_for(lambda: limits()[-1:] == [2 << 30], 30), limits()
        d.cancel(job)


def test_a_stopped_job_ignoring_sigterm_gets_the_daemons_one_sigkill(make_site) -> None:  # type: ignore[no-untyped-def]
    # The grace-period SIGKILL is the daemon's own (as for a cancel): sent once, recorded, and the
    # end read as killed; not a second timer in the host sending it every tick unrecorded.
    site = make_site(misbehaviour="stop")
    stubborn = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + WRITER
    job = site.submit("--tenant", "B", "--type", "opportunistic", "--", sys.executable, "-c", stubborn, "huge")
    assert wait_for(lambda: site.state(job) == "failed", 60), site.events(job)
    kills = [e for e in site.events(job) if e["kind"] == "stopping" and e["detail"].get("signal") == "SIGKILL"]
    assert len(kills) == 1, site.events(job)
