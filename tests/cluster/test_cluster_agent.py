"""The node agent's own logic, without Ray: start, report, fencing, sweep."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from scheduler_lite.cluster.agent import NodeAgent, _wrappers_under
from scheduler_lite.model import GIB, Gpu, JobKind
from scheduler_lite.storage import JobRecord
from tests.cluster.conftest import REPO, cluster_config
from tests.scheduler.test_daemon_fakes import JOB_ENV, fake_command, wait_for


def record(job_id: str, token: str) -> JobRecord:
    return JobRecord(id=job_id, seq=1, tenant="A", kind=JobKind.GUARANTEE, num_gpus=1,
                     command=tuple(fake_command()), workdir=str(REPO), submit_time=time.time(),
                     env=tuple(JOB_ENV.items()), launch_token=token)


def start(agent: NodeAgent, job_id: str, token: str = "t1") -> int:
    pid, _, job_dir = agent.start(record(job_id, token), 0, [Gpu(0, "n0", GIB, "nv")], 256 << 20, 1.0, {})
    assert Path(job_dir) == agent.jobs_dir / job_id
    return pid


def alive(agent: NodeAgent) -> list[str]:
    return [name for _, name in _wrappers_under(agent.jobs_dir)]


def test_agent_fences_its_jobs_when_the_global_scheduler_goes_silent(tmp_path: Path) -> None:
    config = cluster_config(tmp_path, "ns", cluster={"node_timeout_s": 1.0})  # fences after 0.5 s
    agent = NodeAgent("n0", config)
    try:
        start(agent, "job-1")
        assert wait_for(lambda: (agent.report().parts["job-1"].stats or None) is not None, timeout=20)
        for _ in range(10):  # heard from every 0.2 s: the job keeps running
            time.sleep(0.2)
            assert agent.report().parts["job-1"].exit is None
        # Silent for longer than half of node_timeout_s: the job is stopped and forgotten.
        assert wait_for(lambda: alive(agent) == [], timeout=10)
        assert agent.report().parts == {}
    finally:
        agent.sweep([])


def test_sweep_keeps_the_parts_the_store_counts_and_kills_the_rest(tmp_path: Path) -> None:
    config = cluster_config(tmp_path, "ns")
    agent = NodeAgent("n0", config, fence=False)
    try:
        start(agent, "job-1", "a")
        start(agent, "job-2", "b")
        assert wait_for(lambda: len(alive(agent)) == 2, timeout=20)
        # A fresh agent on the same node (the old one died, its processes did not) knows nothing:
        # the sweep finds the leftovers by name and job directory.
        fresh = NodeAgent("n0", config, fence=False)
        assert fresh.sweep([("job-1", "a.0")]) == ["job-2"]
        assert wait_for(lambda: [n.split(":")[1] for n in alive(agent)] == ["job-1"], timeout=10)
        assert agent.report().parts["job-2"].exit is not None  # the old agent sees it gone
        assert agent.signal("job-1", signal.SIGTERM)
    finally:
        agent.sweep([])
