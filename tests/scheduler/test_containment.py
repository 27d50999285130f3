"""Each job in a cgroup of its own (scheduler_lite.containment): the real daemon, real jobs.

A job whose child leaves its process group (`start_new_session=True`) leaves nothing running
after a cancel or after its end; a job can be frozen whole; a job on one GPU cannot open another
GPU's device node (cgroup v1 devices controller; nodes made here with mknod); a restarted daemon
finds a job's wrapper by its cgroup, not by the pid file the job forged. Needs root and a
writable cgroup2 hierarchy (skipped otherwise, as the daemon then runs without containment).
With `jobs.containment = "off"` (what the daemon did before) the same tests fail: that is how
they were seen red.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler_lite.config import load_config
from scheduler_lite.containment import Containment, ContainmentUnavailable, mounts, own_cgroups
from scheduler_lite.faults import FAULT_ENV
from scheduler_lite.isolation import prepare_job_dir
from scheduler_lite.jobhost import local_job_host
from scheduler_lite.model import JobKind
from scheduler_lite.storage import JobSpec, MemoryStorage
from tests.scheduler.configs import scheduler_config, to_toml
from tests.scheduler.test_daemon_fakes import REPO, wait_for
from tests.scheduler.test_submit_idempotent import serving

PROBE = Containment(Path("/tmp/sl-containment-probe"))
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not PROBE.active,
                                reason=f"needs root and cgroups: {PROBE.detail}")
MODE = os.environ.get("SL_TEST_CONTAINMENT", "auto")  # "off": the same tests against uncontained jobs (red)


def config_text(gpus: int = 1) -> str:
    return to_toml(scheduler_config(["1GiB"] * gpus, {"A": gpus, "B": 0}, jobs={"cancel_grace_s": 1,
                                                                                 "containment": MODE},
                                    daemon={"tick_interval_s": 0.05}, coordinator={"min_memory_bytes": "64MiB"}))


class Site:
    def __init__(self, base: Path, gpus: int = 1) -> None:
        self.base = base
        self.config = base / "sl.toml"
        self.config.write_text(config_text(gpus))
        self.log = base / "daemon.log"
        self.daemon: subprocess.Popen[bytes] | None = None

    def start(self, fault: str | None = None) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.pop(FAULT_ENV, None)
        if fault:
            env[FAULT_ENV] = fault
        with open(self.log, "ab") as out:
            self.daemon = subprocess.Popen([sys.executable, "-m", "scheduler_lite", "--config", str(self.config),
                                            "serve"], env=env, stdout=out, stderr=out, start_new_session=True)
        assert wait_for(lambda: serving(self.config) or self.daemon.poll() is not None, 30), self.log.read_text()

    def stop(self) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            os.killpg(self.daemon.pid, signal.SIGTERM)
            self.daemon.wait(30)

    def cli(self, *argv: str) -> str:
        done = subprocess.run([sys.executable, "-m", "scheduler_lite", "--config", str(self.config), *argv],
                              capture_output=True, text=True, cwd=self.base, timeout=60, check=False,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        assert done.returncode == 0, done.stderr
        return done.stdout

    def job(self, job_id: str) -> dict:
        return json.loads(self.cli("--json", "show", job_id))["job"]

    def state(self, job_id: str) -> str:
        return str(self.job(job_id)["state"])


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    made = Site(tmp_path)
    yield made
    made.stop()


def processes_with(word: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if word.encode() in (entry / "cmdline").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def escaping_job(tag: str, then: str = "time.sleep(300)") -> list[str]:
    """A job whose child leaves the job's process group (and session), then `then`."""
    return [sys.executable, "-c", f"import subprocess, time; subprocess.Popen(['sleep', '{tag}'], "
                                  f"start_new_session=True); {then}"]


def tag() -> str:
    return f"3041.{uuid.uuid4().int % 10**9}"  # a sleep argument no other process has


def test_a_cancelled_job_leaves_no_process_behind(site: Site) -> None:
    site.start()
    mark = tag()
    job = site.cli("submit", "--tenant", "A", "--", *escaping_job(mark)).strip()
    assert wait_for(lambda: processes_with(mark) != [], 30), site.log.read_text()[-2000:]
    site.cli("cancel", job)
    assert wait_for(lambda: site.state(job) == "cancelled", 30)
    assert wait_for(lambda: processes_with(mark) == [], 10), f"{mark} survived the cancel: {processes_with(mark)}"
    assert "containment: on: each job in a cgroup of its own" in site.cli("status")


def test_a_job_that_ends_leaves_no_process_behind(site: Site) -> None:
    site.start()
    mark = tag()
    job = site.cli("submit", "--tenant", "A", "--", *escaping_job(mark, "time.sleep(1)")).strip()
    assert wait_for(lambda: processes_with(mark) != [], 30)
    assert wait_for(lambda: site.state(job) == "finished", 30)
    assert wait_for(lambda: processes_with(mark) == [], 10), f"{mark} outlived its job: {processes_with(mark)}"


def test_a_job_on_one_gpu_cannot_open_another_gpu_s_device_node(tmp_path: Path) -> None:
    site = Site(tmp_path, gpus=2)
    if PROBE.devices_root is None:  # no v1 devices controller
        pytest.skip(PROBE.detail)
    nodes = []
    for minor in (0, 1):
        node = tmp_path / f"nvidia{minor}"
        os.mknod(node, 0o666 | 0o020000, os.makedev(195, minor))  # S_IFCHR
        nodes.append(str(node))
    opener = ("import os, sys\nfor n in sys.argv[1:]:\n    try:\n        os.open(n, os.O_RDWR)\n        print(n, 0)\n"
              "    except OSError as e:\n        print(n, e.errno)\nsys.stdout.flush()\n")
    try:
        site.start()
        job = site.cli("submit", "--tenant", "A", "--", sys.executable, "-c", opener, *nodes).strip()
        assert wait_for(lambda: site.state(job) == "finished", 30)
        placed = site.job(job)["placement"]
        assert len(placed) == 1
        out = dict(line.split() for line in site.cli("logs", job).splitlines())
        mine, other = nodes[placed[0]], nodes[1 - placed[0]]
        assert int(out[mine]) == errno.ENXIO, out  # its own GPU's node: reached (no driver behind it here)
        assert int(out[other]) == errno.EPERM, out  # the other GPU's: refused by the devices cgroup
    finally:
        site.stop()


def test_a_whole_job_can_be_frozen(tmp_path: Path) -> None:
    """Freeze the cgroup of a job the daemon's own host started, whose child left its session."""
    config_path = tmp_path / "sl.toml"
    config_path.write_text(config_text())
    config = load_config(config_path)
    host = local_job_host(config)
    if not host.containment.can_freeze:
        pytest.skip("no cgroup.freeze on this kernel")
    store = MemoryStorage()
    counter = tmp_path / "counter"
    child = tmp_path / "child.py"
    child.write_text(f"import time\nn = 0\nwhile True:\n    n += 1\n    open({str(counter)!r}, 'w').write(str(n))\n"
                     "    time.sleep(0.01)\n")
    script = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, {str(child)!r}], "
              "start_new_session=True); time.sleep(300)")
    record = store.add_job(JobSpec(tenant="A", kind=JobKind.GUARANTEE, num_gpus=1,
                                   command=(sys.executable, "-c", script), workdir=str(tmp_path), submit_time=0.0))
    config.jobs_dir.mkdir(parents=True)
    job_dir = config.jobs_dir / record.id
    prepare_job_dir(job_dir, None)
    token = uuid.uuid4().hex
    handle = host.launch(record, list(host.devices.inventory())[:1], 1 << 30, 1.0, job_dir, token)
    try:
        assert wait_for(lambda: counter.exists() and counter.read_text() != "", 30)
        cg = host.containment.cgroup(record.id, token)
        assert cg is not None and len(host.containment.pids(cg)) >= 3  # wrapper, command, the escaped child
        assert host.containment.freeze(cg, True)
        assert wait_for(lambda: host.containment.frozen(cg), 10)
        before = counter.read_text()
        time.sleep(0.3)
        assert counter.read_text() == before  # the child outside the job's session is stopped too
        assert host.containment.freeze(cg, False)
        assert wait_for(lambda: counter.read_text() != before, 10)
    finally:
        host.stop(handle, 0.5)
    assert host.containment.pids(cg) == [] and not cg.v2.exists()


def test_a_restart_finds_the_job_by_its_cgroup_not_its_forged_pid_file(site: Site) -> None:
    """The job replaces its pid file with another process's pid; the daemon dies right after the
    launch (fault point `started`: pid not yet recorded) and starts again."""
    decoy = subprocess.Popen(["sleep", "300"])  # root's, as the job's own user is here: the pid the job forges
    mark = tag()
    forge = (f"import os, subprocess, time\nd = os.environ['SCHEDULER_LITE_JOB_DIR']\ntime.sleep(0.2)\n"
             f"open(d + '/.forged', 'w').write('{decoy.pid}\\n')\nos.rename(d + '/.forged', d + '/pid')\n"
             f"subprocess.Popen(['sleep', '{mark}'], start_new_session=True)\ntime.sleep(300)\n")
    try:
        site.start(fault="started")
        job = site.cli("submit", "--tenant", "A", "--", sys.executable, "-c", forge).strip()
        assert site.daemon is not None
        assert site.daemon.wait(30) == -signal.SIGKILL
        assert wait_for(lambda: processes_with(mark) != [], 30)  # the job ran on without its daemon
        site.start()
        assert wait_for(lambda: site.state(job) != "queued", 30)
        time.sleep(1.0)  # a few ticks: a wrongly judged job would be recorded failed by now
        record = site.job(job)
        assert record["state"] == "running", (record["state"], record["reason"])
        assert record["pid"] != decoy.pid
        site.cli("cancel", job)
        assert wait_for(lambda: site.state(job) == "cancelled", 30)
        assert wait_for(lambda: processes_with(mark) == [], 10), "the job's processes outlived it"
        assert decoy.poll() is None  # the forged pid's process was never signalled
    finally:
        decoy.kill()
        decoy.wait()


HYBRID_MOUNTS = """\
30 25 0:26 / /sys/fs/cgroup/devices rw,relatime shared:9 - cgroup cgroup rw,devices
35 25 0:31 / /sys/fs/cgroup/unified rw,relatime shared:14 - cgroup2 cgroup2 rw
"""


@pytest.mark.parametrize(("mountinfo", "cgroup", "expected"), [
    (HYBRID_MOUNTS, "5:devices:/a\n0::/b/c\n", (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup/devices"),
                                                  "/b/c", "/a")),
    ("24 1 0:22 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n", "0::/system.slice/sl.service\n",
     (Path("/sys/fs/cgroup"), None, "/system.slice/sl.service", None)),
    ("22 1 0:20 / /proc rw - proc proc rw\n", "1:name=systemd:/\n", (None, None, None, None)),
])
def test_mounts_and_own_cgroups_are_read_from_proc(mountinfo: str, cgroup: str, expected: tuple) -> None:
    assert (*mounts(mountinfo), *own_cgroups(cgroup)) == expected


def test_without_cgroup2_containment_is_off_and_says_why_or_refuses(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "mountinfo").write_text("22 1 0:20 / /proc rw - proc proc rw\n")
    (proc / "self" / "cgroup").write_text("0::/\n")
    off = Containment(tmp_path, "auto", proc=proc)
    assert not off.active and off.cgroup("job-1", "t") is None
    assert off.detail == "no cgroup2 hierarchy is mounted: jobs are not contained (process groups only)"
    with pytest.raises(ContainmentUnavailable, match='jobs.containment = "required" but no cgroup2 hierarchy'):
        Containment(tmp_path, "required", proc=proc)
    assert Containment(tmp_path, "off").detail == 'jobs.containment = "off"'


# -- test hygiene: a test's job cgroups go with it (tests/conftest.py) -------------------------------

LEFT_BEHIND = '''
import subprocess, uuid
from pathlib import Path
from scheduler_lite.containment import Containment

def test_a_daemon_stopped_with_its_job_running(tmp_path: Path) -> None:
    # What a test does that stops its daemon while a job runs and then kills the job's group
    # itself: the job's cgroup stays (its daemon is gone), a process that left the group in it.
    state = tmp_path / "state"
    state.mkdir()
    (state / "daemon.lock").touch()
    c = Containment(state)
    cg = c.cgroup("job-1", uuid.uuid4().hex)
    c.create(cg)
    child = subprocess.Popen(["sleep", "300"], start_new_session=True)
    c.enter(cg, child.pid)
    (tmp_path.parent / "left").write_text(f"{cg.v2} {child.pid}")
    for path in sorted(state.iterdir()):  # a test may delete its state directory (as test_daemon_crash does)
        path.unlink()
    state.rmdir()
'''


def test_a_tests_job_cgroups_are_removed_at_its_teardown_and_no_others(tmp_path: Path) -> None:
    """The shared teardown (tests/conftest.py) ends and removes the job cgroups of every state
    directory under a test's tmp_path, and leaves another state directory's alone."""
    mine = Containment(tmp_path / "other-state")  # a daemon of another state dir: must be untouched
    other = mine.cgroup("job-9", uuid.uuid4().hex)
    assert other is not None
    mine.create(other)
    try:
        (tmp_path / "inner").mkdir()
        (tmp_path / "inner" / "test_left.py").write_text(LEFT_BEHIND)
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                               "--basetemp", str(tmp_path / "base"), str(tmp_path / "inner" / "test_left.py")],
                              cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        assert done.returncode == 0, done.stdout + done.stderr
        v2, pid = (tmp_path / "base" / "left").read_text().split()
        assert not Path(v2).exists() and not Path(v2).parent.exists()  # the job's cgroup and its subtree
        assert wait_for(lambda: not Path(f"/proc/{pid}").exists() or "Z" in _state(int(pid)), 10)
        assert other.v2.is_dir()
    finally:
        mine.remove(other)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
