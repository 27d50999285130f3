"""Cluster mode faults on 3 Ray nodes: the global scheduler killed mid-launch and restarted from its
store (through `scheduler-lite serve`), then a node removed mid-run. Order matters: the last test
removes node n2 from this module's cluster."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler_lite.cli import main
from scheduler_lite.cluster.host import ClusterJobHost, cluster_daemon
from scheduler_lite.daemon import Daemon
from scheduler_lite.launcher import wrappers_under
from scheduler_lite.model import Place, Role
from scheduler_lite.storage import JobStatus, SqliteStorage
from scheduler_lite.testing import run_until
from tests.cluster.conftest import NODES, REPO, STORE, RayCluster, cluster_config
from tests.scheduler.configs import scheduler_config, to_toml
from tests.scheduler.test_daemon_fakes import JOB_ENV, fake_command, wait_for


def host(d: Daemon) -> ClusterJobHost:
    """The global scheduler's job host (its nodes, its cluster config)."""
    assert isinstance(d.host, ClusterJobHost)
    return d.host


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    return rc, capsys.readouterr().out


def runs(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


def wrappers(state: Path, node: str) -> list[str]:
    """Job processes alive on the node (by their wrapper's name scheduler-lite:<job>:<token>)."""
    return [name.split(":")[1] for _, name in wrappers_under(state / "nodes" / node / "jobs")]


def tf_job() -> list[str]:
    """A tiny Keras training job (examples/colocate_job.py): real TensorFlow under tf-antman."""
    return [sys.executable, str(REPO / "examples" / "colocate_job.py"), "--width", "64", "--batch", "16",
            "--steps", "100000", "--print-every", "50"]


def step_of(d: Daemon, job_id: str) -> int:
    placement = d.jobs.book.jobs[job_id].placement
    job = d.status().gpu(placement[0]).job(job_id) if placement else None
    return 0 if job is None or job.step is None else job.step


def write_config(path: Path, rc: RayCluster, namespace: str) -> Path:
    """Two GPUs on each node, tenant A alone (its gangs may span nodes), for `serve` as a process."""
    path.write_text(to_toml(scheduler_config(
        ["1GiB", "1GiB"], {"A": 4}, jobs={"cancel_grace_s": 2},
        daemon={"tick_interval_s": 0.1, "schedule_interval_s": 0.3},
        cluster={"kind": "ray", "address": rc.address, "namespace": namespace, "nodes": list(NODES),
                 "span_tenants": ["A"], "node_timeout_s": 20})))
    return path


def test_global_scheduler_killed_mid_launch_restarts_without_starting_twice(
        ray_cluster: RayCluster, namespace: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = str(write_config(tmp_path / "cluster.toml", ray_cluster, namespace))
    state = tmp_path / "state"
    log = tmp_path / "runs.log"
    # The second launch kills the global scheduler after its processes started, before their pid
    # is recorded (the daemon's fault hook): the restart must find them on their nodes, not rerun.
    env = {**os.environ, "PYTHONPATH": str(REPO), "SCHEDULER_LITE_FAULT": "started", "SCHEDULER_LITE_FAULT_AFTER": "2"}
    serve = [sys.executable, "-m", "scheduler_lite", "--config", cfg, "serve"]
    first = subprocess.Popen(serve, cwd=REPO, env=env, stderr=subprocess.DEVNULL)
    second = None
    try:
        assert wait_for(lambda: (state / "scheduler.sock").exists(), timeout=60)
        jobs = []
        for gpus in (1, 3):  # the 3-GPU gang spans nodes n1 and n2
            rc, out = cli(capsys, "--config", cfg, "submit", "--tenant", "A", "--type", "guarantee", "--gpus",
                          str(gpus), "--env", f"PYTHONPATH={REPO}", "--env", f"FAKE_RUNS_LOG={log}", "--",
                          *fake_command())
            assert rc == 0
            jobs.append(out.strip())
            assert wait_for(lambda: len(runs(log)) >= 1, timeout=60)
        assert first.wait(timeout=60) == -signal.SIGKILL
        one, gang = jobs
        assert wait_for(lambda: sorted(runs(log)) == sorted([one, gang, gang]), timeout=30)
        store = SqliteStorage(state / "scheduler.db")
        record = store.get_job(gang)
        assert record is not None and record.state is JobStatus.RUNNING and record.pid is None
        store.close()

        env.pop("SCHEDULER_LITE_FAULT")
        second = subprocess.Popen(serve, cwd=REPO, env=env, stderr=subprocess.DEVNULL)
        assert wait_for(lambda: (state / "scheduler.sock").exists(), timeout=60)

        def adopted() -> bool:
            rc, out = cli(capsys, "--config", cfg, "show", gang, "--json")
            return rc == 0 and any(e["kind"] == "adopted" for e in json.loads(out)["events"])

        assert wait_for(adopted, timeout=60, interval=0.5)
        rc, out = cli(capsys, "--config", cfg, "show", gang, "--json")
        shown = json.loads(out)["job"]
        assert shown["state"] == "running" and shown["placement"] == [100, 101, 200] and shown["pid"] is not None
        # Nothing started twice: one process per job part, ever, and each still there.
        assert sorted(runs(log)) == sorted([one, gang, gang])
        assert wrappers(state, "n0") == [one] and wrappers(state, "n1") == [gang] and wrappers(state, "n2") == [gang]
        rc, out = cli(capsys, "--config", cfg, "logs", gang)  # rank 0's log, read by n1's agent
        assert rc == 0 and out.startswith("env emulated 0 100,101,200")
        rc, out = cli(capsys, "--config", cfg, "status")
        lines = out.splitlines()
        assert rc == 0 and lines[0].split()[:2] == ["NODE", "GPU"]
        assert [ln.split()[0] for ln in lines[1:] if ln.split() and ln.split()[0] in NODES] == list(NODES)
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=60) == 0
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        # The jobs outlive the scheduler by design: stop them through a scheduler of this store.
        config = cluster_config(state, namespace)
        d = cluster_daemon(config, SqliteStorage(config.db_path))
        ray_cluster.made.append(d)


def test_restart_with_a_stopped_agent_keeps_healthy_jobs_and_runs_nothing_twice(
        ray_cluster: RayCluster, namespace: str, tmp_path: Path) -> None:
    """The global scheduler restarts while one node's agent is stopped (SIGSTOP). The other
    nodes' jobs are adopted, not fenced while the start waited on the stopped agent; the stopped
    node's job is not rerun while its process may run there: after node_timeout_s the agent is
    killed, a new one sweeps the node, and only then does the job run again."""
    log = tmp_path / "runs.log"
    env = {**JOB_ENV, "FAKE_RUNS_LOG": str(log)}
    config = cluster_config(tmp_path, namespace)
    d = cluster_daemon(config, SqliteStorage(config.db_path))
    ray_cluster.made.append(d)
    healthy = d.submit(fake_command(), tenant="B", kind="guarantee", gpus=2, env=env)
    lonely = d.submit(fake_command(), tenant="A", kind="guarantee", env=env)
    assert run_until(d, lambda d: sorted(runs(log)) == sorted([healthy, lonely]), timeout=60, interval=0.1)
    node = host(d).cc.node_of(d.jobs.book.jobs[lonely].placement[0])
    home = host(d).cc.node_of(d.jobs.book.jobs[healthy].placement[0])
    assert node != home
    pid = d.storage.get_job(healthy).pid  # type: ignore[union-attr]
    stopped = host(d).nodes.actor_pids[node]
    os.kill(stopped, signal.SIGSTOP)  # and the global scheduler dies (d is not ticked again)
    try:
        again = cluster_daemon(config, SqliteStorage(config.db_path))
        ray_cluster.made.append(again)
        assert node not in host(again).nodes.actors and home in host(again).nodes.actors
        assert "adopted" in [e.kind for e in again.storage.events(healthy)]
        assert again.storage.get_job(healthy).pid == pid  # type: ignore[union-attr]
        assert again.storage.get_job(lonely).state is JobStatus.RUNNING  # type: ignore[union-attr]
        assert run_until(again, lambda d: runs(log).count(lonely) == 2, timeout=90, interval=0.1)
        assert [e.detail["reason"] for e in again.storage.events(lonely) if e.kind == "requeued"] == [
            f"node {node} lost"]
        assert sorted(w for n in NODES for w in wrappers(tmp_path, n)) == sorted([healthy, lonely])
        assert runs(log).count(healthy) == 1 and again.storage.get_job(healthy).pid == pid  # type: ignore[union-attr]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stopped, signal.SIGCONT)


def test_node_lost_mid_run(ray_cluster: RayCluster, namespace: str, tmp_path: Path) -> None:
    log = tmp_path / "runs.log"
    env = {**JOB_ENV, "FAKE_RUNS_LOG": str(log)}
    config = cluster_config(tmp_path, namespace)
    d = cluster_daemon(config, SqliteStorage(config.db_path))
    ray_cluster.made.append(d)
    b1 = d.submit(fake_command(), tenant="B", kind="guarantee", env=env)
    b2 = d.submit(fake_command(), tenant="B", kind="guarantee", env=env)
    first = d.tick()
    assert Place(b1, (0,), Role.GUARANTEE) in first.decisions and Place(b2, (1,), Role.GUARANTEE) in first.decisions
    gang = d.submit(fake_command(), tenant="A", kind="guarantee", gpus=3, env=env)
    assert Place(gang, (100, 101, 200), Role.GUARANTEE) in d.tick().decisions
    opp = d.submit(tf_job(), tenant="C", kind="opportunistic", env=env)  # real TF under tf-antman
    assert Place(opp, (201,), Role.OPPORTUNISTIC) in d.tick().decisions
    assert run_until(d, lambda d: sorted(runs(log)) == sorted([b1, b2, gang, gang]), timeout=60, interval=0.1)
    assert run_until(d, lambda d: step_of(d, opp) >= 1, timeout=120, interval=0.2)
    assert d.jobs.book.quota_used("A") == 3 and d.jobs.book.quota_used("B") == 2

    # Node n2 goes away: its raylet is removed, and its processes with it (on this one machine
    # they would outlive the raylet, so the test kills them: what a dead machine does).
    ray_cluster.cluster.remove_node(ray_cluster.nodes["n2"])
    for pid, _ in wrappers_under(tmp_path / "nodes" / "n2" / "jobs"):
        os.killpg(pid, signal.SIGKILL)
    assert run_until(d, lambda d: 200 not in d.jobs.gpus, timeout=60, interval=0.1)
    assert sorted(d.jobs.gpus) == [0, 1, 100, 101]
    assert {g.node for g in d.status().gpus} == {"n0", "n1"}
    # The gang's part on n1 was stopped before anything else: it must not run next to a rerun.
    # (run_until keeps ticking: an agent that hears nothing for node_timeout_s / 2 fences its jobs)
    assert run_until(d, lambda d: gang not in wrappers(tmp_path, "n1"), timeout=4, interval=0.1)
    # Requeued once nothing of them can run on n2: its Ray node is gone, so node_timeout_s after
    # its last answer (an agent still running there, cut off, has fenced them by then).
    for job in (gang, opp):
        assert [e.detail["reason"] for e in d.storage.events(job) if e.kind == "lost"] == ["node n2 lost"]
    assert run_until(d, lambda d: all("requeued" in [e.kind for e in d.storage.events(job)] for job in (gang, opp)),
                       timeout=60, interval=0.1)
    for job in (gang, opp):
        events = [e for e in d.storage.events(job) if e.kind == "requeued"]
        assert events and events[0].detail["reason"] == "node n2 lost"
    # Quotas released exactly: A's gang is queued again (3 GPUs, only 2 free: it waits), B keeps 2.
    assert d.jobs.book.quota_used("A") == 0 and d.jobs.book.quota_used("B") == 2
    tenants = {t.name: t for t in d.status().tenants}
    assert tenants["A"].quota_used == 0 and tenants["B"].quota_used == 2
    # The opportunistic TF job starts again on a surviving node and trains there; the gang waits.
    assert run_until(d, lambda d: len(d.jobs.book.jobs[opp].placement) == 1, timeout=60, interval=0.1)
    assert d.jobs.book.jobs[opp].placement[0] in (0, 1, 100, 101)
    assert run_until(d, lambda d: step_of(d, opp) >= 1, timeout=120, interval=0.2)
    assert [e.kind for e in d.storage.events(opp)].count("launched") == 2
    assert d.storage.get_job(gang).state is JobStatus.QUEUED  # type: ignore[union-attr]
    # Nothing ran twice: one process per job (part) alive, the B jobs untouched.
    assert runs(log).count(gang) == 2 and runs(log).count(b1) == 1 and runs(log).count(b2) == 1
    alive = wrappers(tmp_path, "n0") + wrappers(tmp_path, "n1")
    assert sorted(alive) == sorted([b1, b2, opp])

    # n2 comes back (a new raylet with its resource): swept, its GPUs join, the gang runs again.
    ray_cluster.nodes["n2"] = ray_cluster.cluster.add_node(num_cpus=1, object_store_memory=STORE,
                                                           resources={"antman_node_n2": 1})
    assert run_until(d, lambda d: 200 in d.jobs.gpus and 201 in d.jobs.gpus, timeout=90, interval=0.2)
    assert run_until(d, lambda d: d.storage.get_job(gang).state is JobStatus.RUNNING, timeout=60,  # type: ignore[union-attr]
                       interval=0.1)
    assert len(d.jobs.book.jobs[gang].placement) == 3 and d.jobs.book.quota_used("A") == 3
    assert run_until(d, lambda d: runs(log).count(gang) == 4, timeout=60, interval=0.1)


def test_node_lost_with_on_node_loss_fail(ray_cluster: RayCluster, namespace: str, tmp_path: Path) -> None:
    """`on_node_loss = "fail"`: a lost node's jobs end failed (not requeued, never rerun), a gang's
    part on another node is stopped, quotas come back. Removes n2 again (after the test above)."""
    log = tmp_path / "runs.log"
    env = {**JOB_ENV, "FAKE_RUNS_LOG": str(log)}
    config = cluster_config(tmp_path, namespace, cluster={"on_node_loss": "fail"})
    d = cluster_daemon(config, SqliteStorage(config.db_path))
    ray_cluster.made.append(d)
    assert run_until(d, lambda d: 200 in d.jobs.gpus and 201 in d.jobs.gpus, timeout=60, interval=0.2)
    b = d.submit(fake_command(), tenant="B", kind="guarantee", gpus=2, env=env)
    assert Place(b, (0, 1), Role.GUARANTEE) in d.tick().decisions
    gang = d.submit(fake_command(), tenant="A", kind="guarantee", gpus=3, env=env)
    assert Place(gang, (100, 101, 200), Role.GUARANTEE) in d.tick().decisions
    assert run_until(d, lambda d: sorted(runs(log)) == sorted([b, gang, gang]), timeout=60, interval=0.1)
    assert d.jobs.book.quota_used("A") == 3

    ray_cluster.cluster.remove_node(ray_cluster.nodes["n2"])
    for pid, _ in wrappers_under(tmp_path / "nodes" / "n2" / "jobs"):
        os.killpg(pid, signal.SIGKILL)
    assert run_until(d, lambda d: 200 not in d.jobs.gpus, timeout=60, interval=0.1)
    record = d.storage.get_job(gang)
    assert record is not None and record.state is JobStatus.FAILED and record.reason == "node n2 lost"
    assert [e.kind for e in d.storage.events(gang)].count("requeued") == 0
    assert run_until(d, lambda d: wrappers(tmp_path, "n1") == [], timeout=4, interval=0.1)  # its n1 part stopped
    assert d.jobs.book.quota_used("A") == 0 and d.jobs.book.quota_used("B") == 2
    # Failed means failed: a few more passes, nothing reruns it; B's job runs on.
    run_until(d, lambda d: False, timeout=1.5, interval=0.1)
    assert runs(log).count(gang) == 2 and wrappers(tmp_path, "n0") == [b]
    assert d.storage.get_job(gang).state is JobStatus.FAILED  # type: ignore[union-attr]


def test_jobs_fenced_by_a_silent_global_scheduler_are_requeued(ray_cluster: RayCluster, namespace: str,
                                                               tmp_path: Path) -> None:
    """The global scheduler stalls (a VM hiccup, a blocked call) for longer than the agents' fence
    (node_timeout_s / 2) but less than node_timeout_s: the agent kills its jobs (nothing may run
    twice), and they are requeued as for a lost node (cluster.on_node_loss), not recorded as
    ended with an unknown status."""
    log = tmp_path / "runs.log"
    config = cluster_config(tmp_path, namespace, cluster={"node_timeout_s": 6})  # fences after 3 s
    d = cluster_daemon(config, SqliteStorage(config.db_path))
    ray_cluster.made.append(d)
    job = d.submit(fake_command(), tenant="A", kind="guarantee", env={**JOB_ENV, "FAKE_RUNS_LOG": str(log)})
    assert run_until(d, lambda d: runs(log) == [job], timeout=60, interval=0.1)
    node = host(d).cc.node_of(d.jobs.book.jobs[job].placement[0])
    assert wait_for(lambda: wrappers(tmp_path, node) == [], timeout=20, interval=0.2)  # the stall: no ticks
    d.tick()  # requeued, and (the same tick) placed again
    [requeued] = [e for e in d.storage.events(job) if e.kind == "requeued"]
    assert "(fencing)" in requeued.detail["reason"]
    assert run_until(d, lambda d: runs(log) == [job, job], timeout=60, interval=0.1)  # runs again, once
    assert not any(e.kind == "exited" for e in d.storage.events(job))


def test_a_job_too_big_for_the_nodes_left_waits_for_the_node_away(ray_cluster: RayCluster, namespace: str,
                                                                  tmp_path: Path) -> None:
    """n2 is away: the cluster's size is unknown, so a gang bigger than n0 + n1 waits instead of
    failing at pick-up; when n2 joins it runs, and a job that can never run on the whole cluster
    fails then, with the reason."""
    config = cluster_config(tmp_path, namespace)
    d = cluster_daemon(config, SqliteStorage(config.db_path))
    ray_cluster.made.append(d)
    if "n2" in host(d).nodes.actors:  # run alone (the tests above leave it removed)
        ray_cluster.cluster.remove_node(ray_cluster.nodes["n2"])
        assert run_until(d, lambda d: 200 not in d.jobs.gpus, timeout=60, interval=0.1)
    assert "n2" not in host(d).nodes.actors and sorted(d.jobs.gpus) == [0, 1, 100, 101]
    big = d.submit(fake_command(), tenant="A", kind="opportunistic", gpus=5, env=JOB_ENV)  # A may span
    never = d.submit(fake_command(), tenant="B", kind="opportunistic", gpus=3, env=JOB_ENV)  # B may not
    run_until(d, lambda d: False, timeout=1.0, interval=0.1)
    assert d.storage.get_job(big).state is JobStatus.QUEUED  # type: ignore[union-attr]
    assert d.storage.get_job(never).state is JobStatus.QUEUED  # type: ignore[union-attr]
    ray_cluster.nodes["n2"] = ray_cluster.cluster.add_node(num_cpus=1, object_store_memory=STORE,
                                                           resources={"antman_node_n2": 1})
    assert run_until(d, lambda d: d.storage.get_job(big).state is JobStatus.RUNNING, timeout=90, interval=0.2)
    record = d.storage.get_job(never)
    assert record is not None and record.state is JobStatus.FAILED
    assert record.reason == "needs 3 GPUs; the largest node has 2 and tenant 'B' may not span nodes (cluster.span_tenants)"
