"""The node host's own logic, without Ray: start, report, fencing, sweep."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from scheduler_lite.cluster.node_host import NodeHost
from scheduler_lite.launcher import wrappers_under
from scheduler_lite.model import GIB, Gpu, JobKind
from scheduler_lite.storage import JobRecord
from tests.cluster.conftest import REPO, cluster_config
from tests.scheduler.test_daemon_fakes import JOB_ENV, fake_command, wait_for


def record(job_id: str, token: str) -> JobRecord:
    return JobRecord(id=job_id, seq=1, tenant="A", kind=JobKind.GUARANTEE, num_gpus=1,
                     command=tuple(fake_command()), workdir=str(REPO), submit_time=time.time(),
                     env=tuple(JOB_ENV.items()), launch_token=token)


def start(agent: NodeHost, job_id: str, token: str = "t1") -> int:
    pid, _, job_dir = agent.start(record(job_id, token), 0, [Gpu(0, "n0", GIB, "nv")], 256 << 20, 1.0, {})
    assert Path(job_dir) == agent.jobs_dir / job_id
    return pid


def alive(agent: NodeHost) -> list[str]:
    return [name for _, name in wrappers_under(agent.jobs_dir)]


def test_agent_fences_its_jobs_when_the_global_scheduler_goes_silent(tmp_path: Path) -> None:
    config = cluster_config(tmp_path, "ns")
    agent = NodeHost("n0", config)
    agent.fence_s = 0.5  # a config refuses so short a fence for its tick (check_fencing): the agent alone
    try:
        start(agent, "job-1")
        assert wait_for(lambda: (agent.report().parts["job-1"].stats or None) is not None, timeout=20)
        for _ in range(10):  # heard from every 0.2 s: the job keeps running
            time.sleep(0.2)
            assert agent.report().parts["job-1"].exit is None
        # Silent for longer than the fence: the job is stopped, and the next report says so
        # (the global scheduler then requeues or fails it as for a lost node).
        assert wait_for(lambda: alive(agent) == [], timeout=10)
        report = agent.report()
        assert report.parts == {} and report.fenced == (("job-1", "t1.0"),)
        assert agent.report().fenced == ()  # said once
    finally:
        agent.sweep([])


def test_an_agent_resuming_after_a_long_silence_fences_before_it_answers(tmp_path: Path) -> None:
    """A frozen agent (SIGSTOP) resumes with a call queued: it must not answer as if its jobs
    were still its to run (the global scheduler may have requeued them). The call fences them
    first, whichever thread runs first; what it fenced is kept, with the launch, for a global
    scheduler that starts (`info`) until the job is launched here again."""
    config = cluster_config(tmp_path, "ns")
    agent = NodeHost("n0", config, fence=False)  # no fencing thread: only the calls check
    try:
        start(agent, "job-1")
        assert wait_for(lambda: alive(agent) == ["scheduler-lite:job-1:t1.0"], timeout=20)
        agent._contact -= agent.fence_s  # stopped for the whole fence
        info = agent.info()
        assert info["parts"] == [] and info["fenced"] == {"job-1": "t1.0"}
        assert wait_for(lambda: alive(agent) == [], timeout=10)
        assert agent.report().fenced == (("job-1", "t1.0"),)
        assert agent.info()["fenced"] == {"job-1": "t1.0"}  # still told to a scheduler that starts
        start(agent, "job-1", "t2")  # launched here again: that fencing is settled
        assert agent.info()["fenced"] == {} and agent.report().parts["job-1"].exit is None
    finally:
        agent.sweep([])


def test_find_ignores_a_pid_file_of_another_launch(tmp_path: Path) -> None:
    """The pid file names a live process of launch `a`: asked for launch `b`, the agent finds none."""
    config = cluster_config(tmp_path, "ns")
    agent = NodeHost("n0", config, fence=False)
    try:
        pid = start(agent, "job-1", "a")
        assert wait_for(lambda: (agent.jobs_dir / "job-1" / "pid").exists(), timeout=20)
        assert agent.find("job-1", "a", 0, None) == pid
        assert agent.find("job-1", "b", 0, None) is None
    finally:
        agent.sweep([])


def test_sweep_keeps_the_parts_the_store_counts_and_kills_the_rest(tmp_path: Path) -> None:
    config = cluster_config(tmp_path, "ns")
    agent = NodeHost("n0", config, fence=False)
    try:
        start(agent, "job-1", "a")
        start(agent, "job-2", "b")
        assert wait_for(lambda: len(alive(agent)) == 2, timeout=20)
        # A fresh agent on the same node (the old one died, its processes did not) knows nothing:
        # the sweep finds the leftovers by name and job directory.
        fresh = NodeHost("n0", config, fence=False)
        assert fresh.sweep([("job-1", "a.0")]) == (["job-2"], {})
        assert wait_for(lambda: [n.split(":")[1] for n in alive(agent)] == ["job-1"], timeout=10)
        assert agent.report().parts["job-2"].exit is not None  # the old agent sees it gone
        assert agent.signal("job-1", signal.SIGTERM)
    finally:
        agent.sweep([])


def task_record(job_id: str, token: str) -> JobRecord:
    from scheduler_lite.cluster.tasks import TASK_COMMAND

    return JobRecord(id=job_id, seq=1, tenant="C", kind=JobKind.OPPORTUNISTIC, num_gpus=1,
                     command=(TASK_COMMAND,), workdir=str(REPO), submit_time=time.time(), launch_token=token)


def test_ray_task_booking_claimed_adopted_ended_and_released(tmp_path: Path, monkeypatch) -> None:
    """The agent's half of a Ray task's booking, with a plain process standing in for the Ray
    worker (the real one: tests/cluster/test_cluster_placement.py): no process started by the
    agent, a claim by pid file, adoption by a restarted global scheduler, the end by the exit
    status the task records, and a booking no task claims released after the timeout."""
    import os
    import subprocess
    import sys

    import pytest

    from scheduler_lite.cluster import node_host as node_host_module
    from scheduler_lite.cluster.tasks import PlacementError, _run_booked

    config = cluster_config(tmp_path, "ns")
    agent = NodeHost("n0", config, fence=False)
    pid, _, job_dir = agent.start(task_record("job-1", "t"), 0, [Gpu(0, "n0", GIB, "nv")], 256 << 20, 0.5, {})
    assert pid == 0 and alive(agent) == []  # Ray starts the task, not the agent
    env = agent.task_options("job-1")
    assert env is not None and env["ANTMAN_JOB_DIR"] == job_dir and env["ANTMAN_MEMORY_LIMIT"] == str(256 << 20)
    assert env["ANTMAN_COMPUTE_SHARE"] == "0.5" and env["ANTMAN_DEVICE_ID"] == "0" and "PATH" not in env
    assert agent.report().parts["job-1"].exit is None  # booked, not claimed: it runs
    assert agent.find("job-1", "t", 0, None) == 0  # a restarted scheduler re-adopts it, unclaimed
    assert agent.adopt("job-1", "t", 0, None, 0, None) == (0, None)

    # The task starts in its worker: the wrapper writes the pid (here: a sleeping child's).
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (Path(job_dir) / "pid").write_text(f"{worker.pid}\n")
        assert agent.report().parts["job-1"].exit is None
        assert agent.find("job-1", "t", 0, None) == worker.pid
        assert agent.adopt("job-1", "t", 0, None, 0, None)[0] == worker.pid  # type: ignore[index]
        (Path(job_dir) / "exit_status").write_text("0\n")  # the wrapper, at the task's end
        assert agent.report().parts["job-1"].exit is not None
        assert agent.report().parts["job-1"].exit.exit_code == 0  # type: ignore[union-attr]
        agent.cleanup("job-1")
        assert (Path(job_dir) / "released").exists() and agent.task_options("job-1") is None
        assert worker.poll() is None  # the worker is Ray's: not killed by the release
    finally:
        worker.kill()
        worker.wait()

    # A second booking: stopped (cancel, node loss) while its worker runs: that process alone is killed.
    agent.start(task_record("job-2", "u"), 0, [Gpu(0, "n0", GIB, "nv")], 256 << 20, 0.5, {})
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (agent.jobs_dir / "job-2" / "pid").write_text(f"{worker.pid}\n")
        assert agent.report().parts["job-2"].exit is None
        ended = agent.stop("job-2", 5.0)
        assert ended is not None and worker.wait(timeout=10) == -signal.SIGTERM
    finally:
        worker.kill()
        worker.wait()
    # A task that starts after its booking was released refuses to run.
    monkeypatch.setenv("ANTMAN_JOB_DIR", str(agent.jobs_dir / "job-2"))
    monkeypatch.setenv("SCHEDULER_LITE_JOB_ID", "job-2")
    with pytest.raises(PlacementError, match="released"):
        _run_booked("job-2", lambda: "ran")
    assert int((agent.jobs_dir / "job-2" / "pid").read_text()) == os.getpid()

    # A booking no task claims: released after TASK_CLAIM_TIMEOUT_S, as a failure.
    monkeypatch.setattr(node_host_module, "TASK_CLAIM_TIMEOUT_S", 0.0)
    agent.start(task_record("job-3", "v"), 0, [Gpu(0, "n0", GIB, "nv")], 256 << 20, 0.5, {})
    time.sleep(0.01)
    ended3 = agent.report().parts["job-3"].exit
    assert ended3 is not None and ended3.exit_code is None
    assert (agent.jobs_dir / "job-3" / "released").exists()

    # A booking cancelled before any task claimed it ends at once (not after the claim timeout).
    monkeypatch.setattr(node_host_module, "TASK_CLAIM_TIMEOUT_S", 300.0)
    agent.start(task_record("job-4", "w"), 0, [Gpu(0, "n0", GIB, "nv")], 256 << 20, 0.5, {})
    assert agent.report().parts["job-4"].exit is None
    assert agent.signal("job-4", signal.SIGTERM)
    ended4 = agent.report().parts["job-4"].exit
    assert ended4 is not None and ended4.exit_code is None


def test_ray_actor_claims_its_booking_once_at_construction(tmp_path: Path, monkeypatch) -> None:
    """An actor class made for a booking (`booked_class`, what `placement.actor` decorates with
    Ray): its constructor claims the booking before the class's own `__init__` (the agent adopts
    that process), a second instance is refused, a constructor that raises records exit status 1,
    and an actor started after the booking was released refuses to run."""
    import os

    import pytest

    from scheduler_lite.cluster.actors import booked_class
    from scheduler_lite.cluster.tasks import PlacementError, RayPlacement

    class Model:
        def __init__(self, width: int) -> None:
            if width < 0:
                raise ValueError("width")
            self.width = width
            self.claimed = (Path(os.environ["ANTMAN_JOB_DIR"]) / "pid").exists()  # before our __init__

    from scheduler_lite.cluster import actors

    at_exit: list[object] = []  # the actor's atexit hook, kept out of pytest's own exit
    monkeypatch.setattr(actors.atexit, "register", lambda fn, *args: at_exit.append((fn, args)))
    config = cluster_config(tmp_path, "ns")
    agent = NodeHost("n0", config, fence=False)
    gpu = [Gpu(0, "n0", GIB, "nv")]
    _, _, job_dir = agent.start(task_record("job-1", "t"), 0, gpu, 256 << 20, 0.5, {})
    monkeypatch.setenv("ANTMAN_JOB_DIR", job_dir)
    monkeypatch.setenv("SCHEDULER_LITE_JOB_ID", "job-1")
    cls = booked_class("job-1", Model)
    assert issubclass(cls, Model) and cls.__name__ == "Model"
    m = cls(8)
    assert m.width == 8 and m.claimed and int((Path(job_dir) / "pid").read_text()) == os.getpid()
    assert agent.report().parts["job-1"].exit is None  # claimed by a live process: the booking runs
    assert agent.find("job-1", "t", 0, None) == os.getpid()  # adopted: this process is the actor's
    with pytest.raises(PlacementError, match="claimed already"):
        cls(8)  # a second actor under the same booking
    assert int((Path(job_dir) / "pid").read_text()) == os.getpid()
    # A graceful exit of the actor's process (Python runs atexit): exit status 0, the booking ends.
    assert len(at_exit) == 1
    fn, args = at_exit[0]  # type: ignore[misc]
    fn(*args)
    assert agent.report().parts["job-1"].exit.exit_code == 0  # type: ignore[union-attr]

    # A constructor that raises: exit status 1 (the actor dies; its end is a failure).
    _, _, dir2 = agent.start(task_record("job-2", "u"), 0, gpu, 256 << 20, 0.5, {})
    monkeypatch.setenv("ANTMAN_JOB_DIR", dir2)
    monkeypatch.setenv("SCHEDULER_LITE_JOB_ID", "job-2")
    with pytest.raises(ValueError):
        booked_class("job-2", Model)(-1)
    assert (Path(dir2) / "exit_status").read_text().strip() == "1"
    assert agent.report().parts["job-2"].exit.exit_code == 1  # type: ignore[union-attr]

    # Released before the actor started (cancelled): the actor refuses to run.
    _, _, dir3 = agent.start(task_record("job-3", "v"), 0, gpu, 256 << 20, 0.5, {})
    assert agent.signal("job-3", signal.SIGTERM)  # unclaimed: marked released, ends at once
    monkeypatch.setenv("ANTMAN_JOB_DIR", dir3)
    monkeypatch.setenv("SCHEDULER_LITE_JOB_ID", "job-3")
    with pytest.raises(PlacementError, match="released before the actor started"):
        booked_class("job-3", Model)(8)
    assert len(at_exit) == 1  # only a constructed actor records a graceful end
    fn(Path(dir3))  # an exit after a release (cancel, node loss) is no success: nothing recorded
    assert not (Path(dir3) / "exit_status").exists()

    # Ray options: the node pin and environment of a task, no task-only option, no restart.
    placement = RayPlacement("job-1", "n0", 0, "opportunistic", job_dir, {"ANTMAN_JOB_DIR": job_dir})
    opts = placement.options({"env_vars": {"MINE": "1"}}, actor=True)
    assert opts["resources"] == {"antman_node_n0": 0.001} and opts["max_restarts"] == 0
    assert opts["max_task_retries"] == 0 and "max_calls" not in opts and "max_retries" not in opts
    assert opts["runtime_env"]["env_vars"] == {"MINE": "1", "ANTMAN_JOB_DIR": job_dir}
    with pytest.raises(TypeError, match="cls="):
        booked_class("job-1", lambda: None)  # type: ignore[arg-type]
