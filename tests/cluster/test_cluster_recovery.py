"""The global scheduler's fault handling, driven step by step: node hosts frozen, killed or
fenced, the global scheduler restarted from its store, gangs whose parts end apart.

The agents are real `NodeHost`s running real job processes; only Ray's transport is a stand-in
(tests/cluster/fake_ray.py), so that a frozen agent, a restart in the middle of a booking or the
time that passes can be set up exactly. The clock the daemons read is moved forward by the test
(`Harness.advance`) where a fault waits for `node_timeout_s`. What each test asserts is what ran:
the processes of the jobs (their start log, their wrappers), the store's states and events.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from scheduler_lite.cli import _print_status
from scheduler_lite.cluster.host import ClusterJobHost, cluster_daemon
from scheduler_lite.cluster.nodes import Nodes
from scheduler_lite.cluster.parts import job_nodes
from scheduler_lite.config import Config, parse_config
from scheduler_lite.daemon import Daemon
from scheduler_lite.launcher import read_exit, wrappers_under
from scheduler_lite.recovery import LAUNCH_GRACE_S
from scheduler_lite.storage import JobStatus, SqliteStorage
from scheduler_lite.testing import run_until
from tests.cluster.fake_ray import FakeRay
from tests.scheduler.configs import scheduler_config
from tests.scheduler.test_daemon_fakes import JOB_ENV, fake_command, wait_for


def host(d: Daemon) -> ClusterJobHost:
    """The global scheduler's job host (its nodes, its cluster config)."""
    assert isinstance(d.host, ClusterJobHost)
    return d.host

TIMEOUT_S = 10.0  # cluster.node_timeout_s: agents fence after 5 s

# A job part that logs its start ("<job>.<rank>") and exits with the status a test writes into
# the file exit-<job>.<rank> (a gang's parts ending apart, when the test says).
PART_JOB = r"""
import os, sys, time
from pathlib import Path
here = Path(sys.argv[1])
name = os.environ["SCHEDULER_LITE_JOB_ID"] + "." + os.environ["SCHEDULER_LITE_NODE_RANK"]
with open(here / "runs.log", "a") as log:
    log.write(name + "\n")
while not (here / ("exit-" + name)).exists():
    time.sleep(0.02)
sys.exit(int((here / ("exit-" + name)).read_text()))
"""


class Harness:
    """Global schedulers over one store and one (fake) Ray cluster of 2-GPU nodes; tenant A
    (quota 4) may span nodes, B (quota 4) may not."""

    def __init__(self, tmp: Path, nodes: Sequence[str] = ("n0", "n1")) -> None:
        self.tmp = tmp
        self.log = tmp / "runs.log"
        data = scheduler_config(
            ["1GiB", "1GiB"], {"A": 4, "B": 4}, nvlink_group="nv", state_dir=str(tmp),
            jobs={"cancel_grace_s": 1},
            daemon={"tick_interval_s": 0.1, "schedule_interval_s": 0.3},
            coordinator={"min_memory_bytes": "64MiB", "round_interval_s": 0.5},
            cluster={"kind": "ray", "address": "auto", "nodes": list(nodes), "span_tenants": ["A"],
                     "node_timeout_s": TIMEOUT_S})
        self.config: Config = parse_config(data, base_dir=tmp)
        self.ray = FakeRay(nodes)
        self.offset = 0.0

    def clock(self) -> float:
        return time.time() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds

    def daemon(self) -> Daemon:
        """A global scheduler starting on the store (the one before it may have died anywhere)."""
        return cluster_daemon(self.config, SqliteStorage(self.config.db_path), clock=self.clock,
                             nodes=Nodes(self.config, ray_module=self.ray))

    def submit(self, d: Daemon, tenant: str, gpus: int = 1, command: list[str] | None = None) -> str:
        env = {**JOB_ENV, "FAKE_RUNS_LOG": str(self.log)}
        return d.submit(command or fake_command(), tenant=tenant, kind="guarantee", gpus=gpus, env=env)

    def runs(self) -> list[str]:
        return self.log.read_text().split() if self.log.exists() else []

    def alive(self, node: str) -> list[str]:
        """The jobs with a process alive on the node."""
        return [name.split(":")[1] for _, name in wrappers_under(self.tmp / "nodes" / node / "jobs")]

    def part_job(self) -> list[str]:
        return [sys.executable, "-c", PART_JOB, str(self.tmp)]

    def end_part(self, job_id: str, rank: int, status: int) -> None:
        (self.tmp / f"exit-{job_id}.{rank}").write_text(str(status))


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(tmp_path)
    yield h
    for pid, _ in wrappers_under(tmp_path / "nodes"):  # jobs outlive their schedulers by design
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def kinds(d: Daemon, job_id: str) -> list[str]:
    return [e.kind for e in d.storage.events(job_id)]


def reasons(d: Daemon, job_id: str, kind: str) -> list[str]:
    return [str(e.detail.get("reason")) for e in d.storage.events(job_id) if e.kind == kind]


def state(d: Daemon, job_id: str) -> JobStatus:
    record = d.storage.get_job(job_id)
    assert record is not None
    return record.state


def test_jobs_fenced_while_the_global_scheduler_was_down_are_requeued(harness: Harness) -> None:
    """The global scheduler is down for longer than the fence: the agent stops its job. The next
    global scheduler requeues it (it was lost with its node, as docs/cluster.md says), not
    recorded as failed by SIGKILL 'while the daemon was down'."""
    d = harness.daemon()
    job = harness.submit(d, "B")
    assert run_until(d, lambda d: harness.runs() == [job], timeout=30, interval=0.05)
    node = host(d).cc.node_of(d.jobs.book.jobs[job].placement[0])
    harness.ray.agent(node).fence()  # d is gone: no word for half of node_timeout_s
    assert wait_for(lambda: harness.alive(node) == [], timeout=10)

    again = harness.daemon()
    assert reasons(again, job, "requeued") == [
        f"node {node} stopped it: no word from the global scheduler for half of cluster.node_timeout_s (fencing)"]
    assert "exited" not in kinds(again, job)
    assert run_until(again, lambda d: harness.runs() == [job, job], timeout=30, interval=0.05)
    assert state(again, job) is JobStatus.RUNNING


def test_a_late_fencing_report_leaves_the_rerun_alone(harness: Harness) -> None:
    """An agent frozen (SIGSTOP) across a restart of the global scheduler, which Ray cannot
    kill: its job waits, and when the agent resumes it fences its old part, the node is swept
    and the job runs again there. The agent's next report names the part it fenced: that is the
    old launch, and must not stop the new one."""
    d = harness.daemon()
    filler = harness.submit(d, "B", gpus=2)  # n0
    job = harness.submit(d, "B")  # n1
    assert run_until(d, lambda d: sorted(harness.runs()) == sorted([filler, job]), timeout=30, interval=0.05)
    assert harness.alive("n1") == [job]
    frozen = harness.ray.agent("n1")
    frozen.freeze()
    frozen.unkillable = True

    again = harness.daemon()
    assert "n1" not in host(again).nodes.actors and state(again, job) is JobStatus.RUNNING
    harness.advance(TIMEOUT_S + 1)
    again.tick()  # n1 has not come: its job is lost, and waits until nothing of it runs there
    assert reasons(again, job, "lost") == ["node n1 lost"] and harness.runs().count(job) == 1
    frozen.resume(silent_for=60)  # SIGCONT: it fences its part first, then answers
    assert run_until(again, lambda d: harness.runs().count(job) == 2, timeout=30, interval=0.05)
    run_until(again, lambda d: False, timeout=1.0, interval=0.05)  # its reports come in
    assert reasons(again, job, "requeued") == ["node n1 lost"]
    assert kinds(again, job).count("launched") == 2 and state(again, job) is JobStatus.RUNNING
    assert harness.alive("n1") == [job] and harness.runs().count(job) == 2


def test_restart_with_a_frozen_agent_keeps_healthy_jobs_and_reruns_nothing_early(harness: Harness) -> None:
    """The global scheduler restarts while n1's agent is frozen. n0's job is adopted, not
    fenced by a start that waited on n1; n1's job is not rerun while its process may run
    there: it waits node_timeout_s for n1, then the frozen agent is killed and replaced, the
    new one's sweep stops the old process, and only then does the job run again."""
    d = harness.daemon()
    healthy = harness.submit(d, "B", gpus=2)  # n0
    lonely = harness.submit(d, "B")  # n1
    assert run_until(d, lambda d: sorted(harness.runs()) == sorted([healthy, lonely]), timeout=30, interval=0.05)
    pid = d.storage.get_job(healthy).pid  # type: ignore[union-attr]
    frozen = harness.ray.agent("n1")
    frozen.freeze()

    again = harness.daemon()
    assert sorted(host(again).nodes.actors) == ["n0"]
    assert "adopted" in kinds(again, healthy) and again.storage.get_job(healthy).pid == pid  # type: ignore[union-attr]
    run_until(again, lambda d: False, timeout=1.0, interval=0.05)
    assert state(again, lonely) is JobStatus.RUNNING and "requeued" not in kinds(again, lonely)
    assert harness.alive("n1") == [lonely] and harness.runs().count(lonely) == 1

    harness.advance(TIMEOUT_S + 1)
    assert run_until(again, lambda d: harness.runs().count(lonely) == 2, timeout=30, interval=0.05)
    assert frozen.dead and harness.ray.agent("n1") is not frozen  # killed and replaced
    assert reasons(again, lonely, "requeued") == ["node n1 lost"]
    assert sorted(harness.alive("n0") + harness.alive("n1")) == sorted([healthy, lonely])  # one process each
    assert harness.runs().count(healthy) == 1 and kinds(again, healthy).count("launched") == 1
    assert state(again, healthy) is JobStatus.RUNNING


def test_an_agent_killed_on_a_live_node_gets_its_jobs_rerun_only_after_its_sweep(harness: Harness) -> None:
    """kill -9 of a node's agent: its job's process runs on (its own session). The job is not
    rerun until the node's new agent has swept that process away."""
    d = harness.daemon()
    job = harness.submit(d, "B")
    assert run_until(d, lambda d: harness.runs() == [job], timeout=30, interval=0.05)
    node = host(d).cc.node_of(d.jobs.book.jobs[job].placement[0])
    [(old, _)] = wrappers_under(harness.tmp / "nodes" / node / "jobs")
    harness.ray.agent(node).kill()

    d.tick()
    assert node not in host(d).nodes.actors and state(d, job) is JobStatus.RUNNING
    assert reasons(d, job, "lost") == [f"node {node} lost"] and kinds(d, job).count("launched") == 1
    assert harness.alive(node) == [job]  # still there: nothing may run next to it
    assert run_until(d, lambda d: harness.runs().count(job) == 2, timeout=30, interval=0.05)
    assert reasons(d, job, "requeued") == [f"node {node} lost"]
    assert wait_for(lambda: not os.path.exists(f"/proc/{old}/cmdline") or
                    open(f"/proc/{old}/cmdline", "rb").read() == b"", timeout=10)
    assert harness.alive("n0") + harness.alive("n1") == [job]


def test_restart_adopts_a_gang_whose_other_part_ended_well(harness: Harness) -> None:
    """A gang's rank 1 exits 0 while the global scheduler is down; rank 0 runs on. The restart
    adopts the gang (rank 0 is not stopped) and it ends when rank 0 does, with rank 0's status."""
    d = harness.daemon()
    gang = harness.submit(d, "A", gpus=3, command=harness.part_job())
    assert run_until(d, lambda d: sorted(harness.runs()) == [f"{gang}.0", f"{gang}.1"], timeout=30, interval=0.05)
    rank0, rank1 = job_nodes(host(d).cc, d.jobs.book.jobs[gang].placement)
    harness.end_part(gang, 1, 0)
    assert wait_for(lambda: harness.alive(rank1) == [], timeout=10)

    again = harness.daemon()
    assert "adopted" in kinds(again, gang) and state(again, gang) is JobStatus.RUNNING
    assert harness.alive(rank0) == [gang]
    harness.end_part(gang, 0, 0)
    assert run_until(again, lambda d: state(d, gang).done, timeout=30, interval=0.05)
    record = again.storage.get_job(gang)
    assert record is not None and record.state is JobStatus.FINISHED and record.exit_code == 0
    recorded = read_exit(harness.tmp / "nodes" / rank0 / "jobs" / gang)
    assert recorded is not None and recorded.exit_code == 0  # it ended by itself, not by our SIGTERM


def test_a_gang_fails_with_the_status_of_the_part_that_failed(harness: Harness) -> None:
    """Rank 1 exits 3: the other part is stopped (SIGTERM), and the job's exit is rank 1's 3,
    not the SIGTERM the global scheduler sent."""
    d = harness.daemon()
    gang = harness.submit(d, "A", gpus=3, command=harness.part_job())
    assert run_until(d, lambda d: sorted(harness.runs()) == [f"{gang}.0", f"{gang}.1"], timeout=30, interval=0.05)
    rank0, _ = job_nodes(host(d).cc, d.jobs.book.jobs[gang].placement)
    harness.end_part(gang, 1, 3)
    assert run_until(d, lambda d: state(d, gang).done, timeout=30, interval=0.05)
    record = d.storage.get_job(gang)
    assert record is not None and record.state is JobStatus.FAILED
    assert record.exit_code == 3 and record.reason == "exit status 3"
    stopped = read_exit(harness.tmp / "nodes" / rank0 / "jobs" / gang)
    assert stopped is not None and stopped.exit_code == -15  # rank 0: our SIGTERM


def test_a_requeued_job_booked_again_on_its_node_is_not_ended_by_its_old_launch(harness: Harness) -> None:
    """A job fenced on n1 is requeued and booked on n1 again; the global scheduler dies after
    the booking, before the start. The restart finds no process of the new launch: requeued as
    never started, not 'ended' with the previous run's pid file."""
    d = harness.daemon()
    filler = harness.submit(d, "B", gpus=2)  # n0: the job can only go back to n1
    job = harness.submit(d, "B")
    assert run_until(d, lambda d: sorted(harness.runs()) == sorted([filler, job]), timeout=30, interval=0.05)
    first = d.storage.get_job(job)
    assert first is not None and host(d).cc.node_of(first.placement[0]) == "n1"
    harness.ray.agent("n1").fence()
    d._start_booked = lambda now, out: None  # type: ignore[method-assign]  # dies after booking
    assert run_until(d, lambda d: kinds(d, job).count("requeued") == 1 and state(d, job) is JobStatus.RUNNING,
                       timeout=10, interval=0.05)
    booked = d.storage.get_job(job)
    assert booked is not None and booked.pid is None and booked.launch_token != first.launch_token
    assert host(d).cc.node_of(booked.placement[0]) == "n1"

    harness.advance(LAUNCH_GRACE_S + 1)  # the restart need not wait for a late process
    again = harness.daemon()
    assert reasons(again, job, "requeued")[-1] == "never started" and "exited" not in kinds(again, job)
    assert run_until(again, lambda d: harness.runs().count(job) == 2, timeout=30, interval=0.05)


def test_a_node_missing_from_ray_is_named_at_the_start(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """cluster.nodes names n2, but no Ray node offers antman_node_n2 (one offers antman_node_N2):
    the start says so, naming the entry and what Ray offers instead."""
    h = Harness(tmp_path, nodes=("n0", "n1", "n2"))
    h.ray.alive.discard("n2")
    h.ray.extra.add("antman_node_N2")
    with caplog.at_level("WARNING", logger="scheduler_lite.cluster"):
        d = h.daemon()
    assert sorted(host(d).nodes.actors) == ["n0", "n1"]
    assert ("cluster.nodes[2] 'n2': no Ray node has resource antman_node_n2; its GPUs are not served until it "
            "joins (Ray offers antman_node_N2, which no cluster.nodes entry names)") in caplog.messages
    # and `status` names it for as long as it is away
    assert d.status().absent_nodes == ("n2",)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        _print_status(d.status())
    assert "nodes not connected: n2" in printed.getvalue()
