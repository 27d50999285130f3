"""Real Unix users against a root daemon (issue 14): what user B cannot do to user A's job.

Needs root and useradd (CI runs as root); the users are created here and removed afterwards.
The test users run the CLI and their jobs with an interpreter they may execute: the venv's own
when they can, else the system's /usr/bin/python3 (3.11 or newer) with world-readable copies of
the few packages the CLI and the jobs import (THIRD_PARTY, from the venv) and, when the checkout
itself is out of their reach (a clone under root's 0700 home), of scheduler_lite and tf_antman.
scripts/test.sh sets SCHEDULER_LITE_MULTIUSER=required when run as root (CI): then finding no
such interpreter fails the tests instead of skipping them.
Every refused attempt must print one line and change nothing: the store (dumped read-only by
root) and A's job directory are compared before and after. Jobs are plain Python, no TensorFlow.
"""

from __future__ import annotations

import errno
import hashlib
import importlib
import json
import os
import pwd
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from scheduler_lite.containment import sweep
from tests.scheduler.configs import scheduler_config, to_toml
from tests.scheduler.test_daemon_fakes import REPO, wait_for

REQUIRED = os.environ.get("SCHEDULER_LITE_MULTIUSER") == "required"  # scripts/test.sh as root: CI
if REQUIRED and (os.geteuid() != 0 or shutil.which("useradd") is None):
    raise RuntimeError("SCHEDULER_LITE_MULTIUSER=required: the multi-user tests need root and useradd")
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("useradd") is None,
                                reason="needs root and useradd (creates Unix users)")
# Third-party packages `scheduler_lite` (the CLI, the daemon) and `tf_antman.protocol` (the jobs
# here) import: copied where the test users can read them when the venv is out of their reach.
THIRD_PARTY = ("absl",)

def site_config(a: str, b: str, adm: str, state_dir: str = "state") -> str:
    """Two GPUs; tenant ta is user a's, tb user b's (one GPU each); adm administers."""
    return to_toml(scheduler_config(["1GiB", "1GiB"], {"ta": 1, "tb": 1}, users={"ta": [a], "tb": [b]},
                                    state_dir=state_dir, access={"admins": [adm]}, jobs={"cancel_grace_s": 1},
                                    daemon={"tick_interval_s": 0.1}))

# A's job: what it can and cannot touch, as one JSON line on stdout; then it waits to be cancelled.
PROBE = r"""
import errno, json, os, sqlite3, sys, time
from pathlib import Path
from tf_antman.protocol import Stats, atomic_write_text, stats_path, temp_dir
job_dir, other_dir, db = Path(os.environ["ANTMAN_JOB_DIR"]), Path(sys.argv[1]), sys.argv[2]
out = {"uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(), "groups": sorted(os.getgroups()),
       "home": os.environ.get("HOME"), "user": os.environ.get("USER"), "cwd": os.getcwd(),
       "canary": os.environ.get("SL_CANARY")}
def attempt(name, action):
    try:
        action()
        out[name] = 0
    except OSError as e:
        out[name] = e.errno
    except sqlite3.Error as e:
        out[name] = "sqlite: " + str(e)
attempt("write_own_control", lambda: open(job_dir / "control.json", "w").close())
attempt("append_own_control", lambda: open(job_dir / "control.json", "a").close())
attempt("remove_own_control", lambda: os.unlink(job_dir / "control.json"))
(job_dir / "mine").write_text("x")
attempt("replace_own_control", lambda: os.replace(job_dir / "mine", job_dir / "control.json"))
attempt("write_own_log", lambda: open(job_dir / "stdout.log", "a").close())
attempt("write_other_dir", lambda: open(other_dir / "planted", "w").close())
attempt("list_other_dir", lambda: os.listdir(other_dir))
attempt("write_other_control", lambda: open(other_dir / "control.json", "w").close())
attempt("write_store", lambda: open(db, "r+b").close())
attempt("write_store_sqlite", lambda: sqlite3.connect(db).execute("UPDATE jobs SET tenant = 'x'"))
stats = Stats(seq=1, pid=os.getpid(), state="running", step=0, wall_time=time.time())
attempt("write_own_stats", lambda: atomic_write_text(stats_path(job_dir), stats.to_json(), tmp_dir=temp_dir(job_dir)))
print(json.dumps(out), flush=True)
time.sleep(300)
"""

SLEEPER = "import time; time.sleep(300)"


@dataclass
class User:
    name: str
    uid: int
    gid: int
    workdir: Path


@dataclass
class Site:
    base: Path
    config: Path
    state: Path
    python: str
    pythonpath: str  # where the test users' interpreter finds scheduler_lite, tf_antman and THIRD_PARTY
    users: dict[str, User]
    daemon: subprocess.Popen[bytes]

    def cli(self, who: str, *argv: str) -> subprocess.CompletedProcess[str]:
        """scheduler-lite as user `who` ('root' for root)."""
        return self.run(who, [self.python, "-m", "scheduler_lite", "--config", str(self.config), *argv])

    def run(self, who: str, argv: list[str]) -> subprocess.CompletedProcess[str]:
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": self.pythonpath, "HOME": "/"}
        if who == "root":
            return subprocess.run(argv, env=env, cwd=self.base, capture_output=True, text=True, timeout=60)
        u = self.users[who]
        return subprocess.run(argv, env=env, cwd=u.workdir, user=u.uid, group=u.gid, extra_groups=[],
                              capture_output=True, text=True, timeout=60)

    def job(self, job_id: str) -> dict:
        done = self.cli("root", "show", "--json", job_id)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)["job"]


def _usable_python(uid: int, gid: int, pythonpath: str) -> str | None:
    """An interpreter user `uid` may run with scheduler_lite importable from `pythonpath`."""
    for candidate in (sys.executable, "/usr/bin/python3"):
        if not Path(candidate).exists():
            continue
        try:
            probe = subprocess.run([candidate, "-c", "import scheduler_lite.cli, scheduler_lite.server, "
                                    "tf_antman.protocol, tomllib"], user=uid, group=gid, extra_groups=[],
                                   env={"PYTHONPATH": pythonpath}, cwd="/", capture_output=True, timeout=60)
        except PermissionError:
            continue
        if probe.returncode == 0:
            return candidate
    return None


def _runtime(base: Path, uid: int, gid: int) -> tuple[str, str] | None:
    """(interpreter, PYTHONPATH) that user `uid` can run the CLI and the jobs with, copying under
    `base` (0755) what it cannot read: the venv's THIRD_PARTY packages, then, if needed, the checkout's."""
    lib = base / "pylib"
    for name in THIRD_PARTY:
        package = Path(importlib.import_module(name).__file__ or "").parent
        shutil.copytree(package, lib / name, ignore=shutil.ignore_patterns("__pycache__"))
    for pythonpath in (os.pathsep.join([str(REPO), str(lib)]), None):
        if pythonpath is None:  # the checkout is out of reach: its packages, copied
            src = base / "src"
            for name in ("scheduler_lite", "tf_antman"):
                shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
            pythonpath = os.pathsep.join([str(src), str(lib)])
        for copied in (lib, base / "src"):  # readable (and directories searchable) by everyone
            for top, dirs, files in os.walk(copied):
                for entry in dirs + files:
                    path = Path(top, entry)
                    if not path.is_symlink():
                        path.chmod(path.stat().st_mode | 0o444 | (0o111 if path.is_dir() else 0))
        python = _usable_python(uid, gid, pythonpath)
        if python is not None:
            return python, pythonpath
    return None


@pytest.fixture(scope="module")
def site() -> Iterator[Site]:
    suffix = str(os.getpid() % 100000)
    names = {"a": f"sla{suffix}", "b": f"slb{suffix}", "adm": f"slm{suffix}"}
    base = Path(tempfile.mkdtemp(prefix="sl-users-", dir="/tmp"))
    os.chmod(base, 0o755)
    created: list[str] = []
    daemon = None
    try:
        users = {}
        for key, name in names.items():
            # -N: every test user gets the same primary group ("users"): isolation must not rest on groups.
            subprocess.run(["useradd", "-M", "-N", "-d", "/nonexistent", "-s", "/bin/sh", name], check=True,
                           capture_output=True)
            created.append(name)
            entry = pwd.getpwnam(name)
            workdir = base / f"work-{key}"
            workdir.mkdir(mode=0o700)
            os.chown(workdir, entry.pw_uid, entry.pw_gid)
            users[key] = User(name, entry.pw_uid, entry.pw_gid, workdir)
        runtime = _runtime(base, users["a"].uid, users["a"].gid)
        if runtime is None:
            message = ("no Python interpreter that the test users may run (the venv's, or /usr/bin/python3 >= 3.11 "
                       "with copies of " + ", ".join(THIRD_PARTY) + ")")
            if REQUIRED:
                pytest.fail(f"SCHEDULER_LITE_MULTIUSER=required: {message}")
            pytest.skip(message)
        python, pythonpath = runtime
        config = base / "sl.toml"
        config.write_text(site_config(**names))
        os.chmod(config, 0o644)
        env = {**os.environ, "PYTHONPATH": str(REPO), "SL_CANARY": "root-only"}
        daemon = subprocess.Popen([sys.executable, "-m", "scheduler_lite", "--config", str(config), "serve"],
                                  env=env, cwd=base, stdout=subprocess.DEVNULL, stderr=open(base / "daemon.log", "wb"))
        state = base / "state"
        assert wait_for(lambda: (state / "scheduler.sock").exists(), timeout=60), (base / "daemon.log").read_text()
        yield Site(base, config, state, python, pythonpath, users, daemon)
    finally:
        if daemon is not None:
            subprocess.run([sys.executable, "-m", "scheduler_lite", "--config", str(base / "sl.toml"), "cancel",
                            *[f"job-{i}" for i in range(1, 8)]], env={**os.environ, "PYTHONPATH": str(REPO)},
                           capture_output=True, timeout=60)
            time.sleep(2)
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(30)
        for name in created:
            subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True)
            subprocess.run(["userdel", name], capture_output=True)
        sweep(base / "state")  # job cgroups of jobs the stopped daemon left running (not under tmp_path)
        shutil.rmtree(base, ignore_errors=True)


def _store_dump(state: Path) -> list[str]:
    db = sqlite3.connect(f"file:{state / 'scheduler.db'}?mode=ro", uri=True)
    try:
        return [line for line in db.iterdump() if "INSERT INTO \"jobs\"" in line or "INSERT INTO \"events\"" in line
                or "INSERT INTO \"placements\"" in line]
    finally:
        db.close()


def _tree(path: Path) -> dict[str, tuple[int, int, str]]:
    out = {}
    for p in sorted(path.rglob("*")):
        info = p.lstat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() and not p.is_symlink() else ""
        out[str(p.relative_to(path))] = (info.st_mode, info.st_uid, digest)
    return out


def _stable(read, settle_s: float = 1.0, timeout: float = 30.0):  # type: ignore[no-untyped-def]
    """The value once two reads `settle_s` apart agree (the daemon may still be recording a launch)."""
    deadline = time.monotonic() + timeout
    before = read()
    while time.monotonic() < deadline:
        time.sleep(settle_s)
        now = read()
        if now == before:
            return now
        before = now
    raise AssertionError("did not settle")


def _one_error_line(done: subprocess.CompletedProcess[str], *words: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert len(lines) == 1 and lines[0].startswith("scheduler-lite: error: "), done.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_user_b_cannot_touch_user_a_s_job(site: Site) -> None:
    b_sub = site.cli("b", "submit", "--tenant", "tb", "--env", "TOKEN=s3cret", "--", site.python, "-c", SLEEPER)
    assert b_sub.returncode == 0, b_sub.stderr
    b_job = b_sub.stdout.strip()
    assert wait_for(lambda: site.job(b_job)["state"] == "running", timeout=30)
    b_dir = site.job(b_job)["job_dir"]
    db = str(site.state / "scheduler.db")
    a_sub = site.cli("a", "submit", "--tenant", "ta", "--env", f"PYTHONPATH={site.pythonpath}", "--",
                     site.python, "-c", PROBE, b_dir, db)
    assert a_sub.returncode == 0, a_sub.stderr
    a_job = a_sub.stdout.strip()
    assert wait_for(lambda: site.cli("a", "logs", a_job).stdout.strip() != "", timeout=60), \
        site.cli("a", "logs", "--stderr", a_job).stdout
    probe = json.loads(site.cli("a", "logs", a_job).stdout.splitlines()[0])

    # A's job runs as A, with A's groups only, in A's workdir, without the daemon's environment.
    a = site.users["a"]
    assert (probe["uid"], probe["euid"], probe["gid"]) == (a.uid, a.uid, a.gid)
    assert probe["groups"] == sorted(os.getgrouplist(a.name, a.gid))
    assert (probe["user"], probe["home"], probe["cwd"], probe["canary"]) == (a.name, "/nonexistent", str(a.workdir),
                                                                            None)
    # It cannot write, replace or remove its control file, the store, or B's directory; it can write its stats.
    assert probe["write_own_control"] == errno.EACCES
    assert probe["append_own_control"] == errno.EACCES
    assert probe["remove_own_control"] in (errno.EPERM, errno.EACCES)  # sticky directory: root's file stays
    assert probe["replace_own_control"] in (errno.EPERM, errno.EACCES)
    assert probe["write_own_log"] == errno.EACCES
    assert probe["write_other_dir"] == errno.EACCES
    assert probe["list_other_dir"] == errno.EACCES
    assert probe["write_other_control"] == errno.EACCES
    assert probe["write_store"] == errno.EACCES
    assert str(probe["write_store_sqlite"]).startswith("sqlite: ")
    assert probe["write_own_stats"] == 0

    a_dir = Path(site.job(a_job)["job_dir"])
    before_store = _stable(lambda: _store_dump(site.state))
    before_files = _tree(a_dir)

    # B against A's job and tenant: one line each, nothing changed.
    _one_error_line(site.cli("b", "cancel", a_job), "may not cancel", a.name)
    _one_error_line(site.cli("b", "logs", a_job), "may not read the logs")
    _one_error_line(site.cli("b", "logs", "--stderr", a_job), "may not read the logs")
    _one_error_line(site.cli("b", "submit", "--tenant", "ta", "--", "/bin/true"), "may not submit to tenant 'ta'")
    _one_error_line(site.cli("b", "cancel", b_job, a_job), "may not cancel")  # all or nothing: B's own stays
    _one_error_line(site.cli("b", "submit", "--tenant", "tb", "--env", "ANTMAN_MEMORY_LIMIT=1", "--", "/bin/true"),
                    "ANTMAN_MEMORY_LIMIT")
    for target in (a_dir / "control.json", a_dir / "stats.json", a_dir / "stdout.log", Path(db)):
        done = site.run("b", [site.python, "-c", "import sys; open(sys.argv[1], 'r+b')", str(target)])
        assert done.returncode == 1 and "PermissionError: [Errno 13]" in done.stderr, (target, done.stderr)
    done = site.run("b", [site.python, "-c", "import sqlite3, sys; sqlite3.connect(sys.argv[1]).execute("
                          "\"UPDATE jobs SET tenant = 'tb'\")", db])
    assert done.returncode == 1 and "unable to open database file" in done.stderr, done.stderr

    assert _store_dump(site.state) == before_store
    assert _tree(a_dir) == before_files
    assert site.job(a_job)["state"] == "running" and site.job(b_job)["state"] == "running"

    # What B may see of A's job hides A's --env values; A sees B's hidden too.
    shown = json.loads(site.cli("a", "show", "--json", b_job).stdout)["job"]
    assert shown["env"]["TOKEN"] == "<hidden>" and shown["user"] == site.users["b"].name
    assert json.loads(site.cli("b", "show", "--json", b_job).stdout)["job"]["env"]["TOKEN"] == "s3cret"

    # The admin may cancel A's job; B its own.
    assert site.cli("adm", "cancel", a_job).returncode == 0
    assert site.cli("b", "cancel", b_job).returncode == 0
    assert wait_for(lambda: site.job(a_job)["state"] == "cancelled" and site.job(b_job)["state"] == "cancelled",
                    timeout=30)


def test_submit_needs_a_tenant_of_one_s_own_and_a_workdir_one_can_enter(site: Site) -> None:
    _one_error_line(site.cli("a", "submit", "--tenant", "tb", "--", "/bin/true"), "may not submit to tenant 'tb'")
    _one_error_line(site.cli("a", "submit", "--tenant", "nope", "--", "/bin/true"), "unknown tenant")
    done = site.cli("a", "submit", "--workdir", str(site.users["b"].workdir), "--", "/bin/true")
    _one_error_line(done, "cannot enter")
    # The daemon (root) must not tell A whether a path it cannot reach exists, or where a link
    # points: the same answer, naming only the path A gave.
    hidden = site.base / "root-only"
    (hidden / "inner").mkdir(parents=True)
    os.chmod(hidden, 0o700)
    link = site.base / "link-a"
    link.symlink_to(hidden / "inner")
    for workdir in (hidden / "inner", hidden / "absent", link):
        done = site.cli("a", "submit", "--workdir", str(workdir), "--", "/bin/true")
        _one_error_line(done, f"--workdir '{workdir}': user '{site.users['a'].name}' cannot enter it")
    # Only tenant of A: --tenant may be left out.
    done = site.cli("a", "submit", "--", "/bin/true")
    assert done.returncode == 0, done.stderr
    assert site.job(done.stdout.strip())["tenant"] == "ta"


def test_a_daemon_run_by_a_user_serves_only_that_user_and_says_so(site: Site) -> None:
    a, b = site.users["a"], site.users["b"]
    home = site.base / "a-own"
    home.mkdir()
    os.chown(home, a.uid, a.gid)
    config = home / "sl.toml"
    config.write_text(site_config(a.name, b.name, "root", state_dir=f"{home}/state"))
    os.chown(config, a.uid, a.gid)
    log = home / "daemon.log"
    daemon = subprocess.Popen([site.python, "-m", "scheduler_lite", "--config", str(config), "serve"],
                              env={"PATH": "/usr/bin:/bin", "PYTHONPATH": site.pythonpath, "HOME": "/"}, cwd=home,
                              user=a.uid, group=a.gid, extra_groups=[], stdout=subprocess.DEVNULL,
                              stderr=open(log, "wb"))
    try:
        assert wait_for(lambda: (home / "state" / "scheduler.sock").exists(), timeout=60), log.read_text()
        line = "not running as root: serving only user " + repr(a.name)
        assert wait_for(lambda: line in log.read_text(), 10), log.read_text()  # written after the socket is up
        mine = site.run("a", [site.python, "-m", "scheduler_lite", "--config", str(config), "list"])
        assert mine.returncode == 0, mine.stderr
        # No cgroups for an unprivileged daemon without a delegated subtree: jobs run as before,
        # and `status` and the log say so (docs/security.md, "Containment's limits").
        status = site.run("a", [site.python, "-m", "scheduler_lite", "--config", str(config), "status"])
        assert status.returncode == 0, status.stderr
        assert "containment: OFF: the daemon cannot create cgroups under" in status.stdout, status.stdout
        assert "containment off: the daemon cannot create cgroups" in log.read_text()
        # B cannot even reach the socket (state directory 0700, socket 0600).
        theirs = site.run("b", [site.python, "-m", "scheduler_lite", "--config", str(config), "list"])
        _one_error_line(theirs, "permission denied (that daemon serves only its own user)")
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)
