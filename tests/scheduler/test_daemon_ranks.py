"""A job of one process per GPU (torchrun's shape) under the daemon: every rank is managed.

The stand-in job starts one process per GPU with LOCAL_RANK set, as torchrun does; each rank
speaks the protocol in its own directory (rank 0 the job directory, rank r `ranks/<r>/`:
tf_antman/protocol/layout.py rank_dir), for device r, and refuses a control naming another
device as tf-antman's agent does. The real torch job side under torchrun:
tests/torch/test_multi_rank.py.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler_lite.daemon import Daemon
from scheduler_lite.isolation import JobUser, prepare_job_dir
from scheduler_lite.model import Place, Role, SetMemoryLimit
from scheduler_lite.ranks import merge_rank_stats, rank_control
from scheduler_lite.storage import JobStatus, SqliteStorage
from scheduler_lite.testing import run_until, stop_all_jobs
from tests.scheduler.test_daemon_fakes import JOB_ENV, MIB, REPO, fake_command, make_config
from tf_antman.protocol import Control, DeviceStats, MemoryLimit, Stats, control_path, parse_control, read_stats
from tf_antman.protocol.layout import rank_dir

# argv: memory demand of rank 0 in bytes; rank r demands r * 100 MiB more (tells the ranks apart);
# optionally the number of documents rank 1 writes before it writes no more (a rank gone silent)
RANK_JOB = r"""
import os, statistics, sys, time
from pathlib import Path
from tf_antman.protocol import (DeviceStats, Stats, atomic_write_text, control_path, parse_control,
                                read_text, stats_path, temp_dir)
from tf_antman.protocol.layout import rank_dir
rank = int(os.environ["LOCAL_RANK"])
job_dir = rank_dir(Path(os.environ["ANTMAN_JOB_DIR"]), rank)
demand = int(sys.argv[1]) + rank * 100 * 2**20
quiet_after = int(sys.argv[2]) if len(sys.argv) > 2 and rank == 1 else None
limit, share = int(os.environ["ANTMAN_MEMORY_LIMIT"]), float(os.environ["ANTMAN_COMPUTE_SHARE"])
applied = seen = rejected = n = 0
window = []
while True:
    text = read_text(control_path(job_dir))
    c = parse_control(text) if text else None
    if c is not None and c.seq > seen:
        seen = c.seq
        if any(m.device != rank for m in c.memory_limits):
            rejected += 1  # one device a rank: the whole control refused
        else:
            applied = c.seq
            limit = next((m.limit_bytes for m in c.memory_limits), limit)
            share = share if c.compute_share is None else c.compute_share
    t = time.monotonic()
    time.sleep(0.02 * (1 + rank))  # rank 1 is the slower one
    n += 1
    if quiet_after is not None and n > quiet_after:
        continue
    window = (window + [(time.monotonic() - t) * 1000])[-32:]
    on = min(demand, limit)
    s = Stats(seq=n, pid=os.getpid(), state="running", step=n, last_step_ms=window[-1],
              step_ms_window=tuple(window), step_ms_median=statistics.median(window),
              devices=(DeviceStats(rank, limit, on, on, on, on, demand - on, demand - on, 0),),
              compute_share=share, control_seq_applied=applied, controls_applied=applied,
              controls_rejected=rejected, wall_time=time.time())
    atomic_write_text(stats_path(job_dir), s.to_json(), fsync=False, tmp_dir=temp_dir(job_dir))
"""

# torchrun's part: one process per GPU, LOCAL_RANK = its index; all stop with the launcher.
LAUNCHER = r"""
import os, signal, subprocess, sys
n = len(os.environ["SCHEDULER_LITE_GPUS"].split(","))
procs = [subprocess.Popen([sys.executable, "-c", *sys.argv[1:]], env={**os.environ, "LOCAL_RANK": str(r)})
         for r in range(n)]
signal.signal(signal.SIGTERM, lambda *_: [p.terminate() for p in procs])
for p in procs:
    p.wait()
"""


def ranked_command(demand: int, rank1_quiet_after: int | None = None) -> list[str]:
    quiet = [] if rank1_quiet_after is None else [str(rank1_quiet_after)]
    return [sys.executable, "-c", LAUNCHER, RANK_JOB, str(demand), *quiet]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    config = make_config(tmp_path, gpus=2)
    d = Daemon(config, SqliteStorage(config.db_path))
    yield d
    stop_all_jobs(d, grace_s=1)


def test_each_rank_reports_its_gpu_and_takes_its_gpus_control(daemon: Daemon) -> None:
    d = daemon
    opp = d.submit(ranked_command(300 * MIB), tenant="B", kind="opportunistic", gpus=2, env=JOB_ENV)
    assert Place(opp, (0, 1), Role.OPPORTUNISTIC) in d.tick().decisions
    job_dir = d.job_dir(opp)
    # Made by the daemon before the job ran, with its seq-only control.
    assert parse_control(control_path(rank_dir(job_dir, 1)).read_text()).seq == 1

    def both_report(d: Daemon) -> bool:
        status = d.status()
        return all((j := status.gpu(g).job(opp)) is not None and j.in_use_bytes is not None for g in (0, 1))
    assert run_until(d, both_report, timeout=20, interval=0.02)
    status = d.status()
    # Each GPU's figures are its own rank's: 300 MiB on GPU 0, 400 MiB on GPU 1.
    assert status.gpu(0).job(opp).in_use_bytes == 300 * MIB
    assert status.gpu(1).job(opp).in_use_bytes == 400 * MIB

    g = d.submit(fake_command(demand=512 * MIB), tenant="A", kind="guarantee", memory_bytes=512 * MIB, env=JOB_ENV)
    arrival = d.tick()
    (placed,) = [x for x in arrival.decisions if isinstance(x, Place) and x.job_id == g]
    shrunk = placed.gpus[0]  # the opportunistic job's rank on that GPU, and only that one, shrinks
    min_memory = d.config.coordinator.min_memory_bytes
    assert SetMemoryLimit(opp, shrunk, min_memory, 1 << 30) in arrival.decisions
    controls = {r: parse_control(control_path(rank_dir(job_dir, r)).read_text()) for r in (0, 1)}
    limits = {r: [(m.device, m.limit_bytes) for m in c.memory_limits] for r, c in controls.items()}
    assert limits == {r: [(r, min_memory if r == shrunk else 1 << 30)] for r in (0, 1)}

    def applied(d: Daemon) -> bool:
        found = [read_stats(rank_dir(job_dir, r)) for r in (0, 1)]
        return all(s is not None and s.control_seq_applied == controls[0].seq for s in found)
    assert run_until(d, applied, timeout=20, interval=0.02)
    assert run_until(d, lambda d: d.status().gpu(shrunk).job(opp).memory_limit_bytes == min_memory,
                     timeout=20, interval=0.02)
    for r in (0, 1):
        stats = read_stats(rank_dir(job_dir, r))
        assert stats is not None and stats.controls_rejected == 0
    status = d.status()
    assert status.gpu(1 - shrunk).job(opp).memory_limit_bytes == 1 << 30
    assert status.gpu(shrunk).job(opp).host_in_use_bytes == (300 + 100 * shrunk) * MIB - min_memory


def test_a_rank_that_stops_reporting_makes_the_job_silent(tmp_path: Path) -> None:
    config = make_config(tmp_path, gpus=2, jobs={"silent_after_s": 1})
    d = Daemon(config, SqliteStorage(config.db_path))
    try:
        opp = d.submit(ranked_command(300 * MIB, rank1_quiet_after=2), tenant="B", kind="opportunistic", gpus=2,
                       env=JOB_ENV)
        d.tick()

        def silent(d: Daemon) -> bool:
            return ("silent", opp) in [(f.kind, f.job_id) for f in d.host.findings() or ()]

        def rank0_stepping(d: Daemon) -> bool:  # rank 0 kept stepping and writing
            stats = read_stats(d.job_dir(opp))
            return stats is not None and stats.step > 2
        # Deadlines for a loaded machine: starting three interpreters can take seconds there, and
        # the job can go silent (none new for silent_after_s) before rank 0 is past step 2.
        assert run_until(d, lambda d: read_stats(rank_dir(d.job_dir(opp), 1)) is not None, timeout=60, interval=0.02)
        assert run_until(d, silent, timeout=60, interval=0.05)
        assert run_until(d, rank0_stepping, timeout=60, interval=0.05)
        # ...and rank 0 writing does not end it: rank 1's silence holds the job's document.
        assert run_until(d, silent, timeout=60, interval=0.05)
    finally:
        stop_all_jobs(d, grace_s=1)


def rank_stats(rank: int, step: int, median: float, seq: int, applied: int = 0) -> Stats:
    return Stats(seq=seq, pid=100 + rank, state="running", step=step, last_step_ms=median,
                 step_ms_window=(median,), step_ms_median=median,
                 devices=(DeviceStats(rank, 1 << 30, 10 + rank, 10, 10, 10, 0, 0, 0),),
                 compute_share=0.5 + rank / 4, achieved_share=0.2 * (rank + 1), control_seq_applied=applied,
                 wall_time=1000.0 + rank)


def test_a_jobs_steps_are_its_slowest_ranks() -> None:
    merged = merge_rank_stats([rank_stats(0, 12, 50.0, seq=9, applied=3), rank_stats(1, 10, 80.0, seq=7, applied=2)])
    assert (merged.step, merged.step_ms_median, merged.pid) == (10, 80.0, 100)
    assert [(d.device, d.in_use_bytes) for d in merged.devices] == [(0, 10), (1, 11)]
    # New once the least advanced rank wrote again; applied once every rank applied.
    assert (merged.seq, merged.control_seq_applied, merged.compute_share, merged.achieved_share) == (7, 2, 0.5, 0.4)


def test_rank_controls_split_by_gpu() -> None:
    control = Control(seq=5, memory_limits=(MemoryLimit(0, 300), MemoryLimit(1, 200)), compute_share=0.4)
    assert rank_control(control, 1, ranked=True).memory_limits == (MemoryLimit(1, 200),)
    assert rank_control(control, 0, ranked=True).memory_limits == (MemoryLimit(0, 300),)
    # Not known to run a process per GPU: one process may stand for both, the tightest for device 0.
    assert rank_control(control, 0, ranked=False).memory_limits == (MemoryLimit(0, 200),)
    assert rank_control(control, 1, ranked=True).compute_share == 0.4


def test_rank_directories_are_laid_out_like_the_job_directory(tmp_path: Path) -> None:
    job_dir = tmp_path / "job-1"
    prepare_job_dir(job_dir, None, 3)
    for r in (1, 2):
        here = rank_dir(job_dir, r)
        assert parse_control(control_path(here).read_text()).seq == 1
        assert (here / ".tmp").is_dir()
        assert stat.S_IMODE(os.stat(here).st_mode) == 0o700
    assert not (job_dir / "ranks" / "3").exists()
    prepare_job_dir(job_dir, None, 1)  # relaunched on one GPU: the ranks of before are gone
    assert not (job_dir / "ranks").exists()


# Run as the job's user: what it may do in its rank's directory (errno per attempt, 0 = done).
RANK_PROBE = r"""
import errno, json, os, sys
here = sys.argv[1]
def attempt(fn):
    try:
        fn()
        return 0
    except OSError as e:
        return e.errno
out = {
    "write_stats": attempt(lambda: open(os.path.join(here, "stats.json"), "w").write("{}")),
    "write_tmp": attempt(lambda: open(os.path.join(here, ".tmp", "x"), "w").write("x")),
    "write_control": attempt(lambda: open(os.path.join(here, "control.json"), "r+").write("x")),
    "remove_control": attempt(lambda: os.unlink(os.path.join(here, "control.json"))),
    "replace_control": attempt(lambda: os.replace(os.path.join(here, "stats.json"), os.path.join(here, "control.json"))),
}
print(json.dumps(out))
"""


SYSTEM_PYTHON = "/usr/bin/python3"  # stdlib only: a user other than root may run it (not .venv under /root)


@pytest.mark.skipif(os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK),
                    reason="needs root and /usr/bin/python3: the rank's directory is opened to uid 65534")
def test_a_rank_of_another_user_writes_its_stats_and_cannot_touch_its_control(tmp_path: Path) -> None:

    top = Path(tempfile.mkdtemp(dir="/tmp", prefix="h29-ranks-"))  # tmp_path is root's alone (0700)
    try:
        os.chmod(top, 0o755)
        job_dir = top / "job-1"
        prepare_job_dir(job_dir, JobUser(65534, 65534, (65534,), "nobody", "/nonexistent", "/bin/sh"), 2)
        here = rank_dir(job_dir, 1)
        for path in (job_dir / "ranks", here, here / ".tmp"):
            info = os.stat(path)
            assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (0, 0o1770), path
        assert os.stat(control_path(here)).st_uid == 0

        def as_nobody() -> None:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
        done = subprocess.run([SYSTEM_PYTHON, "-c", RANK_PROBE, str(here)], capture_output=True, text=True,
                              preexec_fn=as_nobody, check=True)
        probe = json.loads(done.stdout)
        assert (probe["write_stats"], probe["write_tmp"]) == (0, 0)
        assert probe["write_control"] == errno.EACCES
        assert probe["remove_control"] in (errno.EPERM, errno.EACCES)  # sticky: root's file stays
        assert probe["replace_control"] in (errno.EPERM, errno.EACCES)
        assert parse_control(control_path(here).read_text()).seq == 1
    finally:
        shutil.rmtree(top)


# A DDP job of the real PyTorch job side, stepping until the test says stop (the file STOP).
DDP_SCRIPT = """
import os, time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
dist.init_process_group("gloo")
model = DistributedDataParallel(torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
stop = torch.zeros(1)
while True:
    loss = model(torch.randn(8, 16)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.02)
    stop[0] = float(os.path.exists("STOP"))
    dist.all_reduce(stop)  # the ranks leave together
    if stop[0] > 0:
        break
dist.destroy_process_group()
"""


def test_a_torchrun_ddp_job_under_the_daemon_has_both_ranks_managed(tmp_path: Path) -> None:
    from tests.torch.python_with_torch import torch_python  # only here: CI without torch skips
    from tf_antman.importhook import PTH_LINE

    python, why = torch_python()
    if python is None:
        pytest.skip(why)
    work = tmp_path / "work"
    work.mkdir()
    (work / "ddp.py").write_text(DDP_SCRIPT)
    site = tmp_path / "site"  # the wheel's .pth line: activation at `import torch` in each rank
    site.mkdir()
    (site / "sitecustomize.py").write_text(PTH_LINE)
    config = make_config(tmp_path / "state", gpus=2)
    d = Daemon(config, SqliteStorage(config.db_path))
    try:
        env = {"PYTHONPATH": os.pathsep.join([str(site), str(REPO)]), "OMP_NUM_THREADS": "1",
               "ANTMAN_STATS_INTERVAL_MS": "1", "PATH": os.pathsep.join([str(Path(python).parent), "/usr/bin:/bin"])}
        opp = d.submit([python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "ddp.py"],
                       tenant="B", kind="opportunistic", gpus=2, env=env, workdir=str(work))
        d.tick()
        job_dir = d.job_dir(opp)

        def both_step(d: Daemon) -> bool:
            found = [read_stats(rank_dir(job_dir, r)) for r in (0, 1)]
            return all(s is not None and s.step >= 3 for s in found)
        assert run_until(d, both_step, timeout=300, interval=0.1), (job_dir / "stderr.log").read_text()[-4000:]
        status = d.status()
        assert all(status.gpu(g).job(opp).in_use_bytes is not None for g in (0, 1))

        g = d.submit(fake_command(demand=512 * MIB), tenant="A", kind="guarantee", memory_bytes=512 * MIB,
                     env=JOB_ENV)
        arrival = d.tick()
        (placed,) = [x for x in arrival.decisions if isinstance(x, Place) and x.job_id == g]
        shrunk = placed.gpus[0]
        min_memory = d.config.coordinator.min_memory_bytes
        seq = parse_control(control_path(job_dir).read_text()).seq

        def applied(d: Daemon) -> bool:
            found = [read_stats(rank_dir(job_dir, r)) for r in (0, 1)]
            return all(s is not None and s.control_seq_applied >= seq for s in found)
        assert run_until(d, applied, timeout=120, interval=0.1), (job_dir / "stderr.log").read_text()[-4000:]
        for r in (0, 1):
            stats = read_stats(rank_dir(job_dir, r))
            assert stats is not None and stats.controls_rejected == 0, (r, stats)
            assert stats.devices[0].device == r
            assert stats.devices[0].limit_bytes == (min_memory if r == shrunk else 1 << 30), (r, stats)
        (work / "STOP").touch()
        def finished(d: Daemon) -> bool:
            record = d.storage.get_job(opp)
            return record is not None and record.state is JobStatus.FINISHED
        assert run_until(d, finished, timeout=120, interval=0.1), (job_dir / "stderr.log").read_text()[-4000:]
    finally:
        stop_all_jobs(d, grace_s=1)
