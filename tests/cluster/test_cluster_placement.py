"""Cluster mode on 3 Ray nodes x 2 emulated GPUs: Algorithm 1 across nodes, gangs, the coordinator."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from scheduler_lite.cluster.host import cluster_daemon
from scheduler_lite.daemon import Daemon
from scheduler_lite.model import Place, Reserve, Role, SetComputeShare
from scheduler_lite.storage import JobStatus, SqliteStorage
from scheduler_lite.testing import run_until
from tests.cluster.conftest import REPO, RayCluster, cluster_config
from tests.scheduler.configs import scheduler_config, to_toml
from tests.scheduler.test_daemon_fakes import JOB_ENV, fake_command


def new_daemon(rc: RayCluster, state: Path, namespace: str, **sections: dict) -> Daemon:
    config = cluster_config(state, namespace, **sections)
    d = cluster_daemon(config, SqliteStorage(config.db_path))
    rc.made.append(d)
    return d


def step_of(d: Daemon, job_id: str, gpu: int) -> int:
    job = d.status().gpu(gpu).job(job_id)
    return 0 if job is None or job.step is None else job.step


def test_algorithm_1_over_nodes_and_gangs(ray_cluster: RayCluster, namespace: str, tmp_path: Path) -> None:
    d = new_daemon(ray_cluster, tmp_path, namespace)
    assert sorted(d.jobs.gpus) == [0, 1, 100, 101, 200, 201]
    assert {g.node for g in d.jobs.gpus.values()} == {"n0", "n1", "n2"}
    assert d.jobs.gpus[101].nvlink_group == "n1/nv"  # an NVLink group never spans nodes

    # Best fit: a 1-GPU guarantee job takes the first group that fits (node n0).
    one = d.submit(fake_command(), tenant="A", kind="guarantee", env=JOB_ENV)
    first = d.tick()
    assert Place(one, (0,), Role.GUARANTEE) in first.decisions and first.launched == (one,)

    # A 3-GPU gang of a tenant allowed to span nodes: whole groups first (n1), then n2.
    gang = d.submit(fake_command(), tenant="A", kind="guarantee", gpus=3, env=JOB_ENV)
    second = d.tick()
    assert Place(gang, (100, 101, 200), Role.GUARANTEE) in second.decisions
    # One process per node, each with its own job directory on its node, both stepping.
    assert run_until(d, lambda d: all(step_of(d, gang, g) >= 2 for g in (100, 101, 200)), timeout=60, interval=0.1)
    for node in ("n1", "n2"):
        stats = json.loads((tmp_path / "nodes" / node / "jobs" / gang / "stats.json").read_text())
        assert stats["step"] >= 1
    record = d.storage.get_job(gang)
    assert record is not None and record.job_dir == str(tmp_path / "nodes" / "n1" / "jobs" / gang)

    # A 2-GPU gang of a tenant that may not span nodes: free GPUs are 1 (n0) and 201 (n2), so
    # Algorithm 1 would spread it; the node level makes it hold GPU 1 on n0 and wait there.
    b = d.submit(fake_command(), tenant="B", kind="guarantee", gpus=2, env=JOB_ENV)
    third = d.tick()
    assert Reserve(b, (1,)) in third.decisions and not any(isinstance(x, Place) and x.job_id == b
                                                          for x in third.decisions)
    assert d.storage.get_job(b).state is JobStatus.QUEUED  # type: ignore[union-attr]
    # Its node frees up: it starts there, both GPUs on n0.
    d.cancel(one)
    assert run_until(d, lambda d: d.jobs.book.jobs[b].placement == (0, 1), timeout=60, interval=0.1)
    assert run_until(d, lambda d: step_of(d, b, 1) >= 1, timeout=60, interval=0.1)
    assert d.jobs.book.quota_used("A") == 3 and d.jobs.book.quota_used("B") == 2


def tf_job(steps: int = 100000) -> list[str]:
    """A tiny Keras training job (examples/colocate_job.py): real TensorFlow under tf-antman."""
    return [sys.executable, str(REPO / "examples" / "colocate_job.py"), "--width", "64", "--batch", "16",
            "--steps", str(steps), "--print-every", "50"]


def test_guarantee_job_protected_on_its_node(ray_cluster: RayCluster, namespace: str, tmp_path: Path) -> None:
    d = new_daemon(ray_cluster, tmp_path, namespace)
    floor, min_memory = d.config.coordinator.floor_share, d.config.coordinator.min_memory_bytes
    # Light fake processes hold every GPU but 201 on node n2: a 4-GPU gang (whole groups of n0
    # and n1), then a 1-GPU job (best fit: n2).
    gang = d.submit(fake_command(), tenant="A", kind="guarantee", gpus=4, env=JOB_ENV)
    assert Place(gang, (0, 1, 100, 101), Role.GUARANTEE) in d.tick().decisions
    one = d.submit(fake_command(), tenant="B", kind="guarantee", env=JOB_ENV)
    assert Place(one, (200,), Role.GUARANTEE) in d.tick().decisions
    opp = d.submit(tf_job(), tenant="C", kind="opportunistic", env=JOB_ENV)
    assert Place(opp, (201,), Role.OPPORTUNISTIC) in d.tick().decisions
    assert run_until(d, lambda d: step_of(d, opp, 201) >= 20, timeout=120, interval=0.2)
    alone = d.status().gpu(201).job(opp)
    assert alone is not None and alone.compute_share == 1.0
    # A guarantee job arrives on the same GPU of n2: the coordinator (run by the global scheduler,
    # applied by n2's agent) cuts the opportunistic job to the floor, and TF applies it.
    g = d.submit(tf_job(), tenant="B", kind="guarantee", env=JOB_ENV)
    arrival = d.tick()
    assert Place(g, (201,), Role.GUARANTEE) in arrival.decisions
    assert SetComputeShare(opp, 201, floor, 1.0) in arrival.decisions

    def protected(d: Daemon) -> bool:
        o = d.status().gpu(201).job(opp)
        return o is not None and o.compute_share == floor and o.memory_limit_bytes == min_memory

    assert run_until(d, protected, timeout=120, interval=0.2), [
        (j.job_id, j.compute_share, j.memory_limit_bytes, j.target_compute_share, j.controls_pending)
        for j in d.status().gpu(201).jobs] + [(e.kind, e.detail) for e in d.storage.events(opp)]
    assert run_until(d, lambda d: step_of(d, g, 201) >= 5, timeout=120, interval=0.2)
    view = d.status().gpu(201)
    assert view.node == "n2" and view.job(g).compute_share == 1.0  # type: ignore[union-attr]


def test_ray_options_enforce_a_fraction_in_a_ray_actor(ray_cluster: RayCluster, tmp_path: Path) -> None:
    """A Ray actor asking for half an (emulated) GPU and 256 MiB trains under tf-antman with that
    limit and share in force: read back from the stats.json its worker writes."""
    import ray

    from scheduler_lite.cluster import ray_options

    @ray.remote
    class Trainer:
        def train(self, steps: int) -> dict:
            import numpy as np
            import tensorflow as tf

            import tf_antman

            model = tf.keras.Sequential([tf.keras.Input(shape=(16,)), tf.keras.layers.Dense(32),
                                         tf.keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse")
            x = np.zeros((64, 16), dtype="float32")
            model.fit(x, x[:, :1], batch_size=8, epochs=1, steps_per_epoch=steps, verbose=0)
            s = tf_antman.settings()
            return {"active": tf_antman.is_active(), "limit": s.memory_limit, "share": s.compute_share}

    job_dir = tmp_path / "trainer"
    job_dir.mkdir()
    options = ray_options(0.5, memory="256MiB", device="emulated", device_memory="1GiB", job_dir=job_dir)
    assert "num_gpus" not in options  # an emulated GPU is nothing Ray has to reserve
    trainer = Trainer.options(**options).remote()  # type: ignore[attr-defined]
    try:
        inside = ray.get(trainer.train.remote(8), timeout=240)
    finally:
        ray.kill(trainer)
    assert inside == {"active": True, "limit": 256 << 20, "share": 0.5}
    # Written at a step boundary (at most every ANTMAN_STATS_INTERVAL_MS): the settings in force.
    stats = json.loads((job_dir / "stats.json").read_text())
    assert stats["step"] >= 1 and stats["compute_share"] == 0.5
    assert stats["devices"][0]["limit_bytes"] == 256 << 20


def ray_task_config(address: str, namespace: str) -> str:
    """One GPU on each of nodes n1 and n2; tenant B (quota 2) and C (opportunistic only)."""
    return to_toml(scheduler_config(
        ["1GiB"], {"B": 2, "C": 0}, jobs={"cancel_grace_s": 2, "host_memory": "1GiB"},
        daemon={"tick_interval_s": 0.1, "schedule_interval_s": 0.3, "utilisation_window_s": 1.0},
        coordinator={"min_memory_bytes": "64MiB", "round_interval_s": 0.5},
        cluster={"kind": "ray", "address": address, "namespace": namespace, "nodes": ["n1", "n2"],
                 "node_timeout_s": 20}))


def train_until(stop: str) -> dict:
    """A Ray task: tiny Keras training under tf-antman until the file `stop` exists."""
    import os
    import time

    import numpy as np
    import tensorflow as tf

    import tf_antman

    model = tf.keras.Sequential([tf.keras.Input(shape=(16,)), tf.keras.layers.Dense(32), tf.keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.zeros((64, 16), dtype="float32")
    deadline = time.monotonic() + 300
    while not os.path.exists(stop) and time.monotonic() < deadline:
        model.fit(x, x[:, :1], batch_size=8, epochs=1, steps_per_epoch=4, verbose=0)
    return {"active": tf_antman.is_active(), "pid": os.getpid(),
            "node_resources": sorted(ray_resources())}


def ray_resources() -> list[str]:
    import ray

    return list(ray.get_runtime_context().get_assigned_resources())


def test_ray_task_placed_and_protected_by_the_global_scheduler(ray_cluster: RayCluster, namespace: str,
                                                                tmp_path: Path) -> None:
    """A Ray task booked through `request_placement` with `scheduler-lite serve`: Algorithm 1 puts
    it on the least utilised GPU (n2), it runs there with the booking's limit and share, a
    guarantee job arriving on that GPU cuts its share (read from the task's own stats.json), a
    SIGKILL of the global scheduler (between the agent's booking and its record, then while the
    task runs) neither loses nor doubles the booking, and its end releases it."""
    import concurrent.futures
    import os
    import signal
    import subprocess

    import ray

    from scheduler_lite.client import call
    from scheduler_lite.cluster.tasks import request_placement
    from scheduler_lite.config import load_config
    from tests.scheduler.test_daemon_fakes import wait_for

    path = tmp_path / "cluster.toml"
    path.write_text(ray_task_config(ray_cluster.address, namespace))
    config = load_config(path)
    serve = [sys.executable, "-m", "scheduler_lite", "--config", str(path), "serve"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # The second launch (the Ray task's booking, after the guarantee job's) kills the scheduler
    # after the node agent took the booking, before it was recorded (the daemon's fault hook).
    faulty = {**env, "SCHEDULER_LITE_FAULT": "started", "SCHEDULER_LITE_FAULT_AFTER": "2"}
    procs = [subprocess.Popen(serve, cwd=REPO, env=faulty, stderr=subprocess.DEVNULL)]
    stop = tmp_path / "stop"
    try:
        assert wait_for(lambda: config.socket_path.exists(), timeout=60)

        def submit(kind: str) -> str:
            return str(call(config, "submit", command=fake_command(), tenant="B", gpus=1, kind=kind,
                            workdir=str(tmp_path), env=[["PYTHONPATH", str(REPO)]])["id"])

        def gpu(gid: int) -> dict:
            return next(g for g in call(config, "status")["gpus"] if g["id"] == gid)

        first = submit("guarantee")  # best fit: GPU 0 on n1
        assert wait_for(lambda: (gpu(0)["utilisation"] or 0) > 0, timeout=60, interval=0.2), (
            call(config, "status"), call(config, "show", job=first))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(request_placement, config, num_gpus=0.25, kind="opportunistic", tenant="C",
                                  timeout_s=90)
            assert procs[0].wait(timeout=60) == -signal.SIGKILL
            procs.append(subprocess.Popen(serve, cwd=REPO, env=env, stderr=subprocess.DEVNULL))
            placement = pending.result(timeout=120)  # the client waited through the restart
        # Re-adopted from its node (the agent still held the booking), not requeued.
        kinds = [e["kind"] for e in _events(config, placement.job_id)]
        # The scheduler died before recording "launched": the restart records it, then "adopted".
        assert "adopted" in kinds and "requeued" not in kinds and kinds.count("launched") == 1, kinds
        # Algorithm 1: an opportunistic job goes to the least utilised GPU: 100, on n2.
        assert (placement.node, placement.gpu, placement.role) == ("n2", 100, "opportunistic")
        shown = call(config, "show", job=placement.job_id)
        booked = shown["placements"][0]
        assert shown["job"]["memory_bytes"] == 256 << 20 and booked["gpu"] == 100
        assert placement.env["ANTMAN_DEVICE_ID"] == "0" and placement.env["ANTMAN_DEVICE"] == "emulated"
        assert placement.env["ANTMAN_COMPUTE_SHARE"] == repr(booked["compute_share"])
        assert placement.env["ANTMAN_MEMORY_LIMIT"] == str(booked["memory_limit_bytes"])
        ref = placement.remote(train_until).remote(str(stop))
        stats_file = Path(placement.job_dir) / "stats.json"

        def stats() -> dict:
            try:
                return json.loads(stats_file.read_text())
            except (OSError, ValueError):
                return {}

        assert wait_for(lambda: stats().get("step", 0) >= 5, timeout=180, interval=0.2)
        assert stats()["compute_share"] == booked["compute_share"]
        assert stats()["devices"][0]["limit_bytes"] == booked["memory_limit_bytes"]

        # The global scheduler dies (SIGKILL) and comes back: the booking is re-adopted from
        # its node, once, on the same GPU.
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(timeout=30)
        procs.append(subprocess.Popen(serve, cwd=REPO, env=env, stderr=subprocess.DEVNULL))
        assert wait_for(lambda: [e["kind"] for e in _events(config, placement.job_id)].count("adopted") == 2,
                        timeout=60, interval=0.3)
        assert [j["job_id"] for j in gpu(100)["jobs"]] == [placement.job_id]
        assert call(config, "show", job=placement.job_id)["job"]["state"] == "running"

        # A guarantee job arrives; GPU 100 is the only one without a guarantee job: the
        # coordinator cuts the task to the floor share, and TF in the Ray worker applies it.
        second = submit("guarantee")
        floor = config.coordinator.floor_share
        assert wait_for(lambda: stats().get("compute_share") == floor, timeout=120, interval=0.2), stats()
        assert sorted(j["job_id"] for j in gpu(100)["jobs"]) == sorted([placement.job_id, second])
        steps = stats()["step"]
        assert wait_for(lambda: stats().get("step", 0) > steps, timeout=120, interval=0.2)  # throttled, not stopped

        # A Ray task's booking is one GPU: a larger one (only possible by hand) is rejected.
        big = call(config, "submit", command=["scheduler-lite:ray-task"], tenant="B", gpus=2, kind="guarantee",
                   workdir=str(tmp_path))["id"]
        assert wait_for(lambda: call(config, "show", job=big)["job"]["state"] == "failed", timeout=30)
        assert "a Ray task's booking is one GPU, not 2" in call(config, "show", job=big)["job"]["reason"]

        stop.touch()
        result = ray.get(ref, timeout=120)
        assert result["active"]  # (settings() are the start-up ones; the share in force is in stats.json)
        assert "antman_node_n2" in result["node_resources"]
        # Its end releases the booking: finished, off GPU 100, the guarantee jobs untouched.
        assert wait_for(lambda: call(config, "show", job=placement.job_id)["job"]["state"] == "finished",
                        timeout=60, interval=0.2)
        assert [j["job_id"] for j in gpu(100)["jobs"]] == [second]
        assert call(config, "show", job=placement.job_id)["placements"] == []
        tenants = {t["name"]: t for t in call(config, "tenants")}
        assert tenants["B"]["quota_used"] == 2 and tenants["C"]["quota_used"] == 0
        kinds = [e["kind"] for e in _events(config, placement.job_id)]
        assert kinds.count("adopted") == 2 and "requeued" not in kinds and kinds[-1] == "exited", kinds
        del first
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        stop.touch()
        from scheduler_lite.cluster.host import cluster_daemon as _CD
        d = _CD(config, SqliteStorage(config.db_path))
        ray_cluster.made.append(d)


def _events(config: object, job_id: str) -> list[dict]:
    """The job's events; none while no scheduler answers (it is restarting)."""
    from scheduler_lite.client import ClientError, call

    try:
        return list(call(config, "show", job=job_id)["events"])  # type: ignore[arg-type]
    except ClientError:
        return []


class Stepper:
    """A Ray actor's class (plain: `placement.actor` makes it remote): a tiny Keras model trained
    a few steps per call, in the actor's own process under tf-antman."""

    def __init__(self, width: int) -> None:
        import tensorflow as tf

        self.model = tf.keras.Sequential([tf.keras.Input(shape=(16,)), tf.keras.layers.Dense(width),
                                          tf.keras.layers.Dense(1)])
        self.model.compile(optimizer="sgd", loss="mse")

    def train(self, steps: int) -> dict:
        import os

        import numpy as np

        import tf_antman

        x = np.zeros((64, 16), dtype="float32")
        self.model.fit(x, x[:, :1], batch_size=8, epochs=1, steps_per_epoch=steps, verbose=0)
        return {"active": tf_antman.is_active(), "pid": os.getpid(), "node_resources": sorted(ray_resources())}


class Idle:
    """A Ray actor's class that holds its booking and does nothing."""

    def pid(self) -> int:
        import os

        return os.getpid()


def test_ray_actor_booked_runs_under_its_booking_until_killed(ray_cluster: RayCluster, namespace: str,
                                                              tmp_path: Path) -> None:
    """A Ray actor booked through `request_placement` (opportunistic) and made with
    `placement.actor`: its process claims the booking at construction, trains TF under the
    booking's limit and share over several calls (its stats.json), and `ray.kill` ends the
    booking: off its GPU, no placement left, failed (exit unknown); a second actor ended
    gracefully leaves its booking finished."""
    import os
    import subprocess

    import ray

    from scheduler_lite.client import call
    from scheduler_lite.cluster.tasks import request_placement
    from scheduler_lite.config import load_config
    from tests.scheduler.test_daemon_fakes import wait_for

    path = tmp_path / "cluster.toml"
    path.write_text(ray_task_config(ray_cluster.address, namespace))
    config = load_config(path)
    serve = subprocess.Popen([sys.executable, "-m", "scheduler_lite", "--config", str(path), "serve"], cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.DEVNULL)
    try:
        assert wait_for(lambda: config.socket_path.exists(), timeout=60)
        placement = request_placement(config, num_gpus=0.25, kind="opportunistic", tenant="C", timeout_s=90)
        assert placement.role == "opportunistic" and placement.node in ("n1", "n2")
        booked = call(config, "show", job=placement.job_id)["placements"][0]
        trainer = placement.actor(Stepper).remote(32)  # type: ignore[attr-defined]
        first = ray.get(trainer.train.remote(4), timeout=240)
        again = ray.get(trainer.train.remote(4), timeout=120)
        assert first["active"] and first["pid"] == again["pid"]  # one process, the actor's
        assert f"antman_node_{placement.node}" in first["node_resources"]
        assert int((Path(placement.job_dir) / "pid").read_text()) == first["pid"]  # claimed at construction
        stats = json.loads((Path(placement.job_dir) / "stats.json").read_text())
        assert stats["step"] >= 1 and stats["compute_share"] == booked["compute_share"]
        assert stats["devices"][0]["limit_bytes"] == booked["memory_limit_bytes"]

        def on_gpu() -> list[str]:
            g = next(g for g in call(config, "status")["gpus"] if g["id"] == placement.gpu)
            return [j["job_id"] for j in g["jobs"]]

        assert on_gpu() == [placement.job_id]
        assert call(config, "show", job=placement.job_id)["job"]["state"] == "running"
        ray.kill(trainer)  # the actor's worker exits: the agent sees the claiming process gone
        assert wait_for(lambda: call(config, "show", job=placement.job_id)["job"]["state"] != "running",
                        timeout=60, interval=0.2)
        shown = call(config, "show", job=placement.job_id)
        # Killed: Ray gives the process no hook to record an exit status, so the end is "failed"
        # with the exit unknown, as for any task whose worker died.
        assert shown["job"]["state"] == "failed" and shown["placements"] == []
        assert on_gpu() == []
        assert {t["name"]: t["quota_used"] for t in call(config, "tenants")}["C"] == 0

        # A graceful end (`__ray_terminate__`, as when the last handle goes): Python runs the
        # actor's exit, exit status 0 is recorded, the job is finished.
        second = request_placement(config, num_gpus=0.25, kind="opportunistic", tenant="C", timeout_s=90)
        idle = second.actor(Idle).remote()  # type: ignore[attr-defined]
        assert ray.get(idle.pid.remote(), timeout=120) == int((Path(second.job_dir) / "pid").read_text())
        idle.__ray_terminate__.remote()
        assert wait_for(lambda: call(config, "show", job=second.job_id)["job"]["state"] == "finished",
                        timeout=60, interval=0.2), call(config, "show", job=second.job_id)
        assert call(config, "show", job=second.job_id)["placements"] == []
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
        from scheduler_lite.cluster.host import cluster_daemon as _CD
        d = _CD(config, SqliteStorage(config.db_path))
        ray_cluster.made.append(d)
