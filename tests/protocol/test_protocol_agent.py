"""JobAgent: controls applied at step boundaries through the actuator, stats written back."""

from __future__ import annotations

import json
import logging
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.protocol.protocol_helpers import read_stats, wait_for
from tests.protocol.simulated_job import Applied, SimulatedJob
from tf_antman.agent import JobAgent, ShareNotEnforced
from tf_antman.holds import SHARE_ZERO, HoldClock
from tf_antman.protocol import (
    Control,
    JobDirBusy,
    MemoryLimit,
    ProtocolError,
    Stats,
    atomic_write_text,
    control_path,
    temp_dir,
)
from tf_antman.protocol.schema import MAX_BYTES, MAX_FIELD_CHARS, MAX_REASON_CHARS

HOUR = 3600.0
ROOT = Path(__file__).resolve().parents[2]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[Callable[..., JobAgent]]:
    made: list[JobAgent] = []

    def make(job: SimulatedJob, **kwargs: Any) -> JobAgent:
        kwargs.setdefault("reread_interval_s", HOUR)
        agent = JobAgent(tmp_path, job, job, **kwargs)
        made.append(agent)
        return agent

    yield make
    for agent in made:
        agent.close()


def write_control(job_dir: Path, control: Control | str) -> None:
    text = control if isinstance(control, str) else control.to_json()
    atomic_write_text(control_path(job_dir), text, tmp_dir=temp_dir(job_dir))


def stats_now(agent: JobAgent, job_dir: Path) -> Stats:
    assert agent.flush_stats()
    stats = read_stats(job_dir)
    assert stats is not None
    return stats


def step_until(agent: JobAgent, job_dir: Path, done: Callable[[Stats], bool], training: bool = True) -> Stats:
    def stepped() -> Stats | None:
        agent.step_end(0.01, training=training)
        stats = stats_now(agent, job_dir)
        return stats if done(stats) else None

    return wait_for(stepped, "stats reached the expected state")  # type: ignore[return-value]


def values(log: list[Applied]) -> list[tuple[str, int | None, float | int | None]]:
    return [(a.what, a.device, a.value) for a in log]


def test_control_present_at_start_is_applied_before_the_first_step(tmp_path: Path, agents) -> None:
    write_control(tmp_path, Control(seq=1, memory_limits=(MemoryLimit(0, 2**30),), compute_share=0.3))
    job = SimulatedJob(devices=1)
    agent = agents(job)
    agent.start()
    assert values(job.log) == [("memory_limit", 0, 2**30), ("compute_share", None, 0.3)]
    stats = stats_now(agent, tmp_path)
    assert (stats.state, stats.step, stats.control_seq_applied, stats.controls_applied) == ("starting", 0, 1, 1)
    assert stats.devices[0].limit_bytes == 2**30 and stats.compute_share == 0.3


def test_step_end_applies_and_acknowledges(tmp_path: Path, agents) -> None:
    job = SimulatedJob(devices=2)
    agent = agents(job)
    agent.start()
    control = Control(seq=4, memory_limits=(MemoryLimit(1, 5_000_000), MemoryLimit(0, 7_000_000)), compute_share=0.5)
    write_control(tmp_path, control)
    stats = step_until(agent, tmp_path, lambda s: s.control_seq_applied == 4)
    assert values(job.log) == [
        ("memory_limit", 1, 5_000_000),
        ("memory_limit", 0, 7_000_000),
        ("compute_share", None, 0.5),
    ]
    assert [d.limit_bytes for d in stats.devices] == [7_000_000, 5_000_000]
    assert stats.state == "running" and stats.controls_applied == 1 and stats.last_rejected is None


def test_evaluation_steps_apply_controls_but_are_not_counted(tmp_path: Path, agents) -> None:
    job = SimulatedJob()
    agent = agents(job)
    agent.start()
    agent.step_end(0.020)
    write_control(tmp_path, Control(seq=1, compute_share=0.75))
    stats = step_until(agent, tmp_path, lambda s: s.control_seq_applied == 1, training=False)
    assert job.share == 0.75
    assert stats.step == 1 and stats.step_ms_window == (20.0,) and stats.last_step_ms == 20.0


def test_step_window_keeps_the_latest_training_steps(tmp_path: Path, agents) -> None:
    agent = agents(SimulatedJob(), min_write_interval_s=0.0)
    agent.start()
    times_ms = [float(3 * i % 17 + i) for i in range(40)]
    for ms in times_ms:
        agent.step_end(ms / 1000.0)
        agent.step_end(99.0, training=False)  # evaluation: ignored by the window
    stats = stats_now(agent, tmp_path)
    window = times_ms[-32:]
    assert stats.step == 40
    assert stats.step_ms_window == pytest.approx(tuple(window))
    assert stats.step_ms_mean == pytest.approx(statistics.fmean(window))
    assert stats.step_ms_median == pytest.approx(statistics.median(window))
    assert stats.last_step_ms == pytest.approx(times_ms[-1])


def test_stats_writes_are_rate_limited_by_the_clock(tmp_path: Path, agents) -> None:
    clock = FakeClock()
    # Binary fractions keep the arithmetic exact: a write at most every 4 steps of 1/64 s.
    agent = agents(SimulatedJob(), clock=clock, min_write_interval_s=1 / 16)
    agent.start()
    first = agent.stats_seq
    for _ in range(20):
        clock.now += 1 / 64
        agent.step_end(1 / 64)
    assert agent.stats_seq - first == 5
    clock.now += 1 / 128
    agent.step_end(1 / 64)
    assert agent.stats_seq - first == 5
    clock.now += 1.0
    agent.step_end(1 / 64)
    assert agent.stats_seq - first == 6
    assert stats_now(agent, tmp_path).seq == agent.stats_seq


def test_a_control_is_acknowledged_at_once_despite_the_rate_limit(tmp_path: Path, agents) -> None:
    clock = FakeClock()  # frozen: without the forced write, stats would never move again
    agent = agents(SimulatedJob(), clock=clock, min_write_interval_s=HOUR)
    agent.start()
    agent.step_end(0.01)
    write_control(tmp_path, Control(seq=2, compute_share=0.1))
    stats = step_until(agent, tmp_path, lambda s: s.control_seq_applied == 2)
    assert stats.compute_share == 0.1


def test_failed_apply_is_rejected_and_the_previous_settings_restored(tmp_path: Path, agents) -> None:
    job = SimulatedJob(
        devices=2,
        fail_when=lambda what, _device, value: "share out of stock" if what == "compute_share" and value == 0.25 else None,
    )
    agent = agents(job)
    agent.start()
    write_control(tmp_path, Control(seq=1, memory_limits=(MemoryLimit(0, 1000),), compute_share=0.5))
    step_until(agent, tmp_path, lambda s: s.control_seq_applied == 1)
    write_control(
        tmp_path,
        Control(seq=2, memory_limits=(MemoryLimit(0, 2000), MemoryLimit(1, 3000)), compute_share=0.25),
    )
    stats = step_until(agent, tmp_path, lambda s: s.controls_rejected == 1)
    assert stats.last_rejected is not None
    assert (stats.last_rejected.seq, stats.last_rejected.field) == (2, "compute_share")
    assert "share out of stock" in stats.last_rejected.reason
    assert stats.control_seq_applied == 1
    # Every grant undone: device 0 back to its old limit, device 1 to "no effective limit".
    assert job.limits == {0: 1000, 1: MAX_BYTES} and job.share == 0.5
    assert values(job.log)[-4:] == [
        ("memory_limit", 0, 2000),
        ("memory_limit", 1, 3000),
        ("memory_limit", 1, MAX_BYTES),
        ("memory_limit", 0, 1000),
    ]


def test_unknown_device_is_rejected_before_touching_anything(tmp_path: Path, agents) -> None:
    job = SimulatedJob(devices=1)
    agent = agents(job)
    agent.start()
    write_control(tmp_path, Control(seq=1, memory_limits=(MemoryLimit(0, 10), MemoryLimit(5, 10))))
    stats = step_until(agent, tmp_path, lambda s: s.controls_rejected == 1)
    assert stats.last_rejected is not None and stats.last_rejected.field == "memory_limits[1]"
    assert "device 5 is not used by this job" in stats.last_rejected.reason
    assert values(job.log) == [("memory_limit", 0, 10), ("memory_limit", 0, MAX_BYTES)]
    assert job.limits == {0: MAX_BYTES}


def test_bad_control_is_logged_once_and_reported(tmp_path: Path, agents, caplog: pytest.LogCaptureFixture) -> None:
    job = SimulatedJob()
    agent = agents(job, reread_interval_s=0.002)  # the same bad file is re-read many times
    agent.start()
    with caplog.at_level(logging.WARNING, logger="tf_antman"):
        write_control(tmp_path, '{"schema": "tf-antman/control", "version": 1, "seq": 3, "compute_share": 2}')
        stats = step_until(agent, tmp_path, lambda s: s.controls_rejected == 1)
        polls = agent._watcher.reads_by_poll
        wait_for(lambda: agent._watcher.reads_by_poll > polls + 5, "more periodic re-reads")
        agent.step_end(0.01)
    assert stats.last_rejected is not None
    assert (stats.last_rejected.seq, stats.last_rejected.field) == (3, "compute_share")
    assert "[0.0, 1.0]" in stats.last_rejected.reason
    messages = [r.getMessage() for r in caplog.records if "compute_share" in r.getMessage()]
    assert len(messages) == 1 and "seq 3" in messages[0]
    assert stats_now(agent, tmp_path).controls_rejected == 1
    assert job.log == []


def test_a_rejection_too_long_for_stats_is_clipped_and_stats_keep_flowing(tmp_path: Path, agents) -> None:
    # The field of a rejection echoes the file: a 300-character unknown key is longer than stats.json
    # accepts (MAX_FIELD_CHARS). Unclipped, every later stats document was refused, never written.
    agent = agents(SimulatedJob(), min_write_interval_s=0.0)
    agent.start()
    key = "x" * 300
    write_control(tmp_path, json.dumps({"schema": "tf-antman/control", "version": 1, "seq": 1, key: 1}))
    stats = step_until(agent, tmp_path, lambda s: s.controls_rejected == 1)
    assert stats.last_rejected is not None and stats.last_rejected.seq == 1
    # The schema quotes and clips a long unknown name itself (it reached the daemon's log whole).
    assert len(stats.last_rejected.field) <= MAX_FIELD_CHARS
    assert stats.last_rejected.field == '"' + "x" * 37 + '..."'
    write_control(tmp_path, Control(seq=2, compute_share=0.5))
    stats = step_until(agent, tmp_path, lambda s: s.control_seq_applied == 2)
    assert stats.compute_share == 0.5 and stats.controls_rejected == 1


def test_an_actuator_refusal_with_a_long_message_is_clipped(tmp_path: Path, agents) -> None:
    job = SimulatedJob(fail_when=lambda what, _device, _value: "no! " * 400 if what == "compute_share" else None)
    agent = agents(job)
    agent.start()
    write_control(tmp_path, Control(seq=1, compute_share=0.5))
    stats = step_until(agent, tmp_path, lambda s: s.controls_rejected == 1)
    assert stats.last_rejected is not None and stats.last_rejected.field == "compute_share"
    assert len(stats.last_rejected.reason) == MAX_REASON_CHARS and stats.last_rejected.reason.endswith("...")


def run_steps(agent: JobAgent, stop: threading.Event, counter: list[int], errors: list[BaseException]) -> None:
    try:
        while not stop.is_set():
            agent.step_end(0.001)
            counter[0] += 1
    except BaseException as err:  # noqa: BLE001 - reported to the test
        errors.append(err)


def test_pause_blocks_the_step_loop_and_resume_releases_it(tmp_path: Path, agents) -> None:
    job = SimulatedJob()
    agent = agents(job, paused_heartbeat_s=0.005)
    agent.start()
    stop, counter, errors = threading.Event(), [0], []
    thread = threading.Thread(target=run_steps, args=(agent, stop, counter, errors))
    thread.start()
    try:
        wait_for(lambda: counter[0] > 10, "the loop runs")
        write_control(tmp_path, Control(seq=1, paused=True))
        paused = wait_for(
            lambda: (s := read_stats(tmp_path)) is not None and s.state == "paused" and s, "paused state reported"
        )
        frozen = counter[0]
        # Heartbeats keep stats fresh while no step completes: the loop is blocked inside step_end.
        wait_for(lambda: (s := read_stats(tmp_path)) is not None and s.seq >= paused.seq + 3, "heartbeats")  # type: ignore[union-attr]
        assert counter[0] == frozen
        assert job.paused and [a.what for a in job.log] == ["pause"]
        # Controls still apply while paused (the coordinator may shrink a paused job's memory).
        write_control(tmp_path, Control(seq=2, memory_limits=(MemoryLimit(0, 4096),)))
        wait_for(lambda: (s := read_stats(tmp_path)) is not None and s.control_seq_applied == 2, "applied while paused")
        assert counter[0] == frozen and job.limits[0] == 4096
        write_control(tmp_path, Control(seq=3, paused=False))
        wait_for(lambda: counter[0] > frozen + 10, "the loop runs again")
        stats = stats_now(agent, tmp_path)
        assert stats.state == "running" and stats.control_seq_applied == 3
        assert [a.what for a in job.log] == ["pause", "memory_limit", "resume"]
    finally:
        stop.set()
        agent.close()
        thread.join(timeout=10)
    assert not thread.is_alive() and errors == []


def test_close_releases_a_paused_step(tmp_path: Path, agents) -> None:
    job = SimulatedJob()
    agent = agents(job)
    write_control(tmp_path, Control(seq=1, paused=True))
    agent.start()
    returned = threading.Event()
    thread = threading.Thread(target=lambda: (agent.step_end(0.01), returned.set()))
    thread.start()
    wait_for(lambda: (s := read_stats(tmp_path)) is not None and s.state == "paused" and s.step == 1, "blocked")
    assert not returned.is_set()
    agent.close("failed")
    thread.join(timeout=10)
    assert returned.is_set()
    stats = read_stats(tmp_path)
    assert stats is not None and stats.state == "failed"
    agent.step_end(0.01)  # after close: a no-op, not an error
    assert read_stats(tmp_path) == stats


def test_set_state_is_reported_and_paused_is_not_settable(tmp_path: Path, agents) -> None:
    agent = agents(SimulatedJob())
    agent.start()
    agent.set_state("running")
    assert stats_now(agent, tmp_path).state == "running"
    with pytest.raises(ValueError, match="starting|running|finished|failed"):
        agent.set_state("paused")
    agent.close("finished")
    assert stats_now(agent, tmp_path).state == "finished"


def test_vanished_job_directory_never_raises_into_training(
    tmp_path: Path, agents, caplog: pytest.LogCaptureFixture
) -> None:
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    job = SimulatedJob()
    agent = JobAgent(job_dir, job, job, reread_interval_s=HOUR, min_write_interval_s=0.0)
    agent.start()
    agent.flush_stats()  # no write in flight: rmtree must not race the writer's temp file
    shutil.rmtree(job_dir)
    with caplog.at_level(logging.WARNING, logger="tf_antman"):
        for _ in range(50):
            agent.step_end(0.01)
            agent.flush_stats()
        agent.close()
    assert sum("cannot write" in r.getMessage() for r in caplog.records) == 1


def test_failing_stats_source_still_reports_progress(tmp_path: Path, agents) -> None:
    class Broken(SimulatedJob):
        def device_stats(self):  # type: ignore[override]
            raise RuntimeError("driver gone")

    job = Broken()
    agent = JobAgent(tmp_path, job, job, reread_interval_s=HOUR)
    agent.start()
    agent.step_end(0.02)
    agent.step_end(0.02)
    agent.close()
    stats = read_stats(tmp_path)
    assert stats is not None and stats.devices == () and stats.step == 2 and stats.state == "finished"


def test_from_env_names_the_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("ANTMAN_JOB_DIR", raising=False)
    with pytest.raises(ProtocolError) as caught:
        JobAgent.from_env(SimulatedJob(), SimulatedJob())
    assert caught.value.field == "ANTMAN_JOB_DIR"
    monkeypatch.setenv("ANTMAN_JOB_DIR", str(tmp_path / "missing"))
    with pytest.raises(ProtocolError) as caught:
        JobAgent.from_env(SimulatedJob(), SimulatedJob())
    assert caught.value.field == "ANTMAN_JOB_DIR" and "existing directory" in caught.value.reason


def test_one_agent_per_job_directory(tmp_path: Path, agents) -> None:
    # A child process that inherits ANTMAN_JOB_DIR must not start a second agent there: it would
    # overwrite the job's stats.json and apply the coordinator's controls to itself.
    first = agents(SimulatedJob())
    first.start()
    with pytest.raises(JobDirBusy) as caught:
        JobAgent(tmp_path, SimulatedJob(), SimulatedJob())
    assert caught.value.field == "agent.lock" and str(tmp_path) in caught.value.reason
    # The refused agent stopped the writer thread it had started.
    assert sum(t.name == "tf_antman-write-stats.json" for t in threading.enumerate()) == 1
    other = subprocess.run(
        [sys.executable, "-c", "import sys; from tf_antman.agent import JobAgent; "
         "from tests.protocol.simulated_job import SimulatedJob; from tf_antman.protocol import JobDirBusy\n"
         "try:\n    JobAgent(sys.argv[1], SimulatedJob(), SimulatedJob())\nexcept JobDirBusy:\n    sys.exit(3)",
         str(tmp_path)], cwd=ROOT, capture_output=True, text=True, check=False)
    assert other.returncode == 3, other.stderr
    first.close()  # its final stats are written: the directory is free for the next agent
    second = agents(SimulatedJob())
    second.start()
    assert stats_now(second, tmp_path).pid == first._pid


def test_the_lock_file_must_be_a_regular_file(tmp_path: Path) -> None:
    (tmp_path / "agent.lock").mkdir()
    with pytest.raises(ProtocolError) as caught:
        JobAgent(tmp_path, SimulatedJob(), SimulatedJob())
    assert caught.value.field == "agent.lock" and "regular file" in caught.value.reason
    (tmp_path / "agent.lock").rmdir()
    (tmp_path / "agent.lock").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ProtocolError, match="symbolic link"):
        JobAgent(tmp_path, SimulatedJob(), SimulatedJob())
    assert not (tmp_path / "elsewhere").exists()


def test_protocol_and_agent_import_without_tensorflow() -> None:
    code = (
        "import sys, tf_antman.protocol, tf_antman.agent; "
        "sys.exit(1 if 'tensorflow' in sys.modules or 'keras' in sys.modules else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def test_stats_writes_leave_only_the_protocol_files(tmp_path: Path, agents) -> None:
    # Temporary files live in .tmp/: a sibling rename would make watchdog hold events back.
    agent = agents(SimulatedJob(), min_write_interval_s=0.0)
    agent.start()
    write_control(tmp_path, Control(seq=1))
    step_until(agent, tmp_path, lambda s: s.control_seq_applied == 1)
    for _ in range(100):
        agent.step_end(0.001)
    agent.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp", "agent.lock", "control.json", "stats.json"]
    assert list((tmp_path / ".tmp").iterdir()) == []


def test_job_paused_from_the_start_resumes_as_running(tmp_path: Path, agents) -> None:
    job = SimulatedJob()
    agent = agents(job, paused_heartbeat_s=0.005)
    write_control(tmp_path, Control(seq=1, paused=True))
    agent.start()
    thread = threading.Thread(target=agent.step_end, args=(0.01,))
    thread.start()
    wait_for(lambda: (s := read_stats(tmp_path)) is not None and s.state == "paused" and s.step == 1, "blocked")
    write_control(tmp_path, Control(seq=2, paused=False))
    thread.join(timeout=10)
    assert not thread.is_alive()
    stats = stats_now(agent, tmp_path)
    assert (stats.state, stats.step, stats.control_seq_applied) == ("running", 1, 2)
    # Paused at start(), before any step boundary: its ops were held with share 0 until the resume
    # restored the share in force.
    assert values(job.log) == [("pause", None, None), ("compute_share", None, 0.0), ("resume", None, None),
                               ("compute_share", None, 1.0)]


def test_a_control_that_meets_no_step_boundary_is_applied_by_the_fallback(tmp_path: Path, agents) -> None:
    job = SimulatedJob()
    agent = agents(job, control_fallback_s=0.05, paused_heartbeat_s=0.005)
    agent.start()
    write_control(tmp_path, Control(seq=1, memory_limits=(MemoryLimit(0, 4096),), compute_share=0.5))
    stats = wait_for(lambda: (s := read_stats(tmp_path)) is not None and s.control_seq_applied == 1 and s,
                     "applied without a step")
    assert (stats.last_applied_by, stats.controls_applied, stats.controls_applied_fallback) == ("fallback", 1, 1)
    assert values(job.log) == [("memory_limit", 0, 4096), ("compute_share", None, 0.5)]
    # A pause away from a step boundary holds the job's ops with share 0...
    write_control(tmp_path, Control(seq=2, paused=True))
    stats = wait_for(lambda: (s := read_stats(tmp_path)) is not None and s.control_seq_applied == 2 and s, "paused")
    assert stats.state == "paused" and stats.compute_share == 0.5  # the share in force, not the hold
    assert values(job.log)[2:] == [("pause", None, None), ("compute_share", None, 0.0)]
    # ...stats stay fresh (heartbeats from the fallback thread), a new share waits for the resume,
    # and controls are applied at once: a held job reaches no step boundary.
    wait_for(lambda: (s := read_stats(tmp_path)) is not None and s.seq >= stats.seq + 3, "heartbeats")
    write_control(tmp_path, Control(seq=3, compute_share=0.25))
    wait_for(lambda: (s := read_stats(tmp_path)) is not None and s.control_seq_applied == 3, "applied while held")
    assert job.share == 0.0
    write_control(tmp_path, Control(seq=4, paused=False))
    stats = wait_for(lambda: (s := read_stats(tmp_path)) is not None and s.control_seq_applied == 4 and s, "resumed")
    assert stats.state == "starting" and stats.controls_applied_fallback == 4
    assert values(job.log)[4:] == [("resume", None, None), ("compute_share", None, 0.25)]
    assert job.share == 0.25 and not job.paused


def test_a_step_boundary_before_the_fallback_time_applies_the_control(tmp_path: Path, agents) -> None:
    job = SimulatedJob()
    agent = agents(job, control_fallback_s=HOUR)
    agent.start()
    write_control(tmp_path, Control(seq=1, paused=True))
    returned = threading.Event()
    wait_for(lambda: agent._watcher.version > 0, "control read")
    thread = threading.Thread(target=lambda: (agent.step_end(0.01), returned.set()))
    thread.start()
    stats = wait_for(lambda: (s := read_stats(tmp_path)) is not None and s.state == "paused" and s, "paused")
    assert (stats.last_applied_by, stats.controls_applied_fallback) == ("step", 0)
    assert [a.what for a in job.log] == ["pause"]  # held in step_end: the share is left alone
    write_control(tmp_path, Control(seq=2, paused=False))
    thread.join(timeout=10)
    assert returned.is_set() and [a.what for a in job.log] == ["pause", "resume"]


class CountingJob(SimulatedJob):
    """A runtime with the job's hold clock: it counts share 0 in force, as Native.set_share and
    TorchRuntime.set_share do (their own tests check that); the agent is given the clock."""

    def __init__(self) -> None:
        super().__init__()
        self.holds = HoldClock()

    def set_compute_share(self, share: float) -> None:
        super().set_compute_share(share)
        self.holds.set(SHARE_ZERO, share == 0.0)


def test_holds_at_share_zero_count_as_paused_time(tmp_path: Path, agents) -> None:
    # The exit report's "paused" figure: a pause put into force as share 0 by the fallback, and a
    # coordinator share of 0, hold the job as surely as a pause in step_end (the op manager does
    # not count a wait at share 0 as throttling). The agent puts both in force through the
    # actuator, whose runtime counts them on the clock the agent was given.
    job = CountingJob()
    agent = agents(job, control_fallback_s=0.01, paused_heartbeat_s=0.005, hold_clock=job.holds)
    assert agent.hold_clock is job.holds
    agent.start()
    write_control(tmp_path, Control(seq=1, paused=True))
    wait_for(lambda: job.share == 0.0, "held by the fallback")
    time.sleep(0.3)
    assert job.holds.seconds >= 0.3  # a hold in force counts up to now (the report may come first)
    write_control(tmp_path, Control(seq=2, paused=False))
    wait_for(lambda: job.share == 1.0, "resumed")
    held = job.holds.seconds
    assert 0.3 <= held < 5.0
    time.sleep(0.1)
    assert job.holds.seconds == held  # running again: the clock stands
    write_control(tmp_path, Control(seq=3, compute_share=0.0))
    wait_for(lambda: (s := read_stats(tmp_path)) is not None and s.control_seq_applied == 3, "share 0")
    time.sleep(0.2)
    agent.close()
    assert job.holds.seconds >= held + 0.2


def _held_in_step(agent, job_dir: Path, control: Control) -> tuple[threading.Thread, float]:
    """Starts the agent, pauses it with `control`, and holds a training thread in step_end for
    at least 0.2 s; (that thread, when it entered step_end)."""
    agent.start()
    write_control(job_dir, control)
    wait_for(lambda: agent._watcher.version > 0, "control read")
    thread = threading.Thread(target=agent.step_end, args=(0.01,))
    started = time.monotonic()
    thread.start()
    wait_for(lambda: (s := read_stats(job_dir)) is not None and s.state == "paused", "paused at the boundary")
    time.sleep(0.2)
    return thread, started


def test_a_step_pause_at_share_zero_is_counted_once(tmp_path: Path, agents) -> None:
    job = CountingJob()
    agent = agents(job, control_fallback_s=HOUR, paused_heartbeat_s=0.005, hold_clock=job.holds)
    thread, started = _held_in_step(agent, tmp_path, Control(seq=1, compute_share=0.0, paused=True))
    write_control(tmp_path, Control(seq=2, compute_share=1.0, paused=False))
    thread.join(timeout=10)
    assert 0.2 <= job.holds.seconds <= time.monotonic() - started


def test_an_agent_without_a_clock_counts_its_step_pauses_on_its_own_until_closed(tmp_path: Path, agents) -> None:
    # A runtime without a hold clock (a stand-in): the agent's own clock counts the training
    # thread held in step_end; closing the agent releases the thread and stops the clock.
    agent = agents(SimulatedJob(), control_fallback_s=HOUR, paused_heartbeat_s=0.005)
    thread, started = _held_in_step(agent, tmp_path, Control(seq=1, paused=True))
    assert agent.hold_clock.seconds >= 0.2  # in force: counts up to now
    agent.close()
    thread.join(timeout=10)
    held = agent.hold_clock.seconds
    assert 0.2 <= held <= time.monotonic() - started
    time.sleep(0.1)
    assert agent.hold_clock.seconds == held


def test_close_releases_a_job_held_by_the_fallback(tmp_path: Path, agents) -> None:
    job = SimulatedJob()
    agent = agents(job, control_fallback_s=0.01)
    agent.start()
    write_control(tmp_path, Control(seq=1, paused=True))
    wait_for(lambda: job.share == 0.0, "held")
    agent.close()
    assert job.share == 1.0  # the loop goes on unmanaged, not frozen at share 0
    with pytest.raises(ValueError, match="control_fallback_s"):
        JobAgent(tmp_path, job, job, control_fallback_s=0.0)


def test_an_untimed_step_counts_but_stays_out_of_the_window(tmp_path: Path) -> None:
    # tf_antman.step_end()'s first call is not timed: it entered the window as a 0.0 ms step.
    job = SimulatedJob()
    agent = JobAgent(tmp_path, job, job, control_fallback_s=None)
    agent.start()
    agent.step_end(None)
    agent.step_end(0.010)
    agent.close()
    s = read_stats(tmp_path)
    assert s is not None and s.step == 2 and s.step_ms_window == (10.0,) and s.step_ms_mean == 10.0


def test_a_user_share_set_after_a_control_was_read_wins_over_its_share(tmp_path: Path, agents) -> None:
    """The newest of user request and coordinator control wins, for the share as for limits: a
    control read before the user's set_compute_share does not replace it at the next boundary
    (its memory limit still applies); a control read after it does."""
    job = SimulatedJob()
    agent = agents(job, control_fallback_s=HOUR)
    agent.start()
    write_control(tmp_path, Control(seq=1, memory_limits=(MemoryLimit(0, 4096),), compute_share=0.3))
    wait_for(lambda: agent._watcher.version > 0, "control read")
    agent.user_share(1.0)  # after the control was read, before the step boundary applies it
    agent.step_end(0.01)
    stats = stats_now(agent, tmp_path)
    assert stats.control_seq_applied == 1 and job.share == 1.0 and job.limits == {0: 4096}
    version = agent._watcher.version
    write_control(tmp_path, Control(seq=2, compute_share=0.4))
    wait_for(lambda: agent._watcher.version > version, "second control read")
    agent.step_end(0.01)
    assert job.share == 0.4


def test_a_user_share_set_while_held_is_what_the_resume_restores(tmp_path: Path, agents) -> None:
    """A pause away from a step boundary holds the ops at share 0: a user share set meanwhile must
    not lift it, and the resume restores the user's share, not the coordinator's older one."""
    job = SimulatedJob()
    agent = agents(job, control_fallback_s=0.05, paused_heartbeat_s=0.005)
    agent.start()
    write_control(tmp_path, Control(seq=1, compute_share=0.3))
    wait_for(lambda: (s := read_stats(tmp_path)) is not None and s.control_seq_applied == 1, "applied")
    agent.user_share(0.8)
    assert job.share == 0.8
    write_control(tmp_path, Control(seq=2, paused=True))
    wait_for(lambda: (s := read_stats(tmp_path)) is not None and s.control_seq_applied == 2, "paused")
    assert job.share == 0.0
    agent.user_share(0.9)
    assert job.share == 0.0  # still held
    write_control(tmp_path, Control(seq=3, paused=False))
    wait_for(lambda: (s := read_stats(tmp_path)) is not None and s.control_seq_applied == 3, "resumed")
    assert job.share == 0.9 and not job.paused


def test_set_compute_share_goes_through_the_agent_when_there_is_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """tf_antman.set_compute_share: to the agent (it knows pauses and controls), else the runtime."""
    from types import SimpleNamespace

    import tf_antman

    calls: list[tuple[str, float]] = []
    agent = SimpleNamespace(user_share=lambda s: calls.append(("agent", s)))
    native = SimpleNamespace(set_share=lambda s: calls.append(("native", s)))
    state = SimpleNamespace(steps=SimpleNamespace(agent=agent), native=native)
    monkeypatch.setattr(tf_antman, "_state", lambda: state)
    tf_antman.set_compute_share(0.5)
    state.steps.agent = None
    tf_antman.set_compute_share(0.25)
    assert calls == [("agent", 0.5), ("native", 0.25)]


class NoComputeScaling(SimulatedJob):
    """A runtime that cannot hold a share below 1 (TorchRuntime without its op hook)."""

    def set_compute_share(self, share: float) -> None:
        if share < 1.0:
            raise ShareNotEnforced("compute scaling is unavailable in this job: no compiler")
        super().set_compute_share(share)


def test_a_share_the_job_cannot_enforce_leaves_the_rest_of_the_control_applied(
        tmp_path: Path, agents, caplog: pytest.LogCaptureFixture) -> None:
    """The memory limit protects the guarantee job beside it: refusing the whole control for its
    share withheld the memory too. The share stays 1 in stats.json, with one warning."""
    job = NoComputeScaling()
    agent = agents(job)
    agent.start()
    with caplog.at_level(logging.WARNING):
        for seq, share in ((1, 0.05), (2, 0.1)):
            write_control(tmp_path, Control(seq=seq, memory_limits=(MemoryLimit(0, 4096),), compute_share=share))
            stats = step_until(agent, tmp_path, lambda s, seq=seq: s.control_seq_applied == seq)
    assert stats.controls_rejected == 0 and job.limits == {0: 4096} and stats.compute_share == 1.0
    assert sum("is not enforced" in r.getMessage() for r in caplog.records) == 1


def test_a_forked_child_does_not_keep_the_directory_locked_after_close(tmp_path: Path, agents) -> None:
    """A fork-started worker shares the lock's open file description: closing the agent's
    descriptor alone left the directory locked while the child lived (a restarted job in it then
    ran without an agent)."""
    import os

    job = SimulatedJob()
    agent = agents(job)
    agent.start()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: waits until the parent is done, then leaves without cleanup
        os.close(write_end)
        os.read(read_end, 1)
        os._exit(0)
    os.close(read_end)
    try:
        agent.close()
        code = ("from pathlib import Path; from tf_antman.protocol.lock import AgentLock; "
                f"AgentLock.acquire(Path({str(tmp_path)!r})); print('acquired')")
        taken = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                               env={"PYTHONPATH": str(ROOT)})
        assert taken.stdout.strip() == "acquired", taken.stderr
    finally:
        os.close(write_end)
        os.waitpid(pid, 0)


def test_without_a_fallback_a_pause_at_start_holds_at_the_first_step_not_at_share_zero(
        tmp_path: Path, agents) -> None:
    """Share 0 is lifted by the fallback thread only (no step boundary comes at share 0): an agent
    without one (control_fallback_s=None) that held the ops at start could never resume."""
    job = SimulatedJob()
    agent = agents(job, control_fallback_s=None, paused_heartbeat_s=0.005)
    write_control(tmp_path, Control(seq=1, paused=True))
    agent.start()
    assert job.share == 1.0 and values(job.log) == [("pause", None, None)]
    thread = threading.Thread(target=agent.step_end, args=(0.01,))
    thread.start()
    wait_for(lambda: (s := read_stats(tmp_path)) is not None and s.state == "paused" and s.step == 1, "blocked")
    write_control(tmp_path, Control(seq=2, paused=False))
    thread.join(timeout=10)
    assert not thread.is_alive() and job.share == 1.0
    assert values(job.log) == [("pause", None, None), ("resume", None, None)]


def test_a_job_held_at_share_zero_keeps_its_stats_fresh_and_takes_controls_at_once(tmp_path: Path, agents) -> None:
    # A scenario run: a control's compute_share 0 (not a pause) held the ops, no step boundary
    # came, stats.json aged as if the job hung, and the next control waited the fallback time.
    job = SimulatedJob()
    agent = agents(job, control_fallback_s=HOUR, paused_heartbeat_s=0.005)
    agent.start()
    write_control(tmp_path, Control(seq=1, compute_share=0.0))
    held = step_until(agent, tmp_path, lambda s: s.control_seq_applied == 1)  # no step boundary after it
    assert held.compute_share == 0.0 and job.share == 0.0
    wait_for(lambda: (s := read_stats(tmp_path)) is not None and s.seq >= held.seq + 3, "heartbeats")
    write_control(tmp_path, Control(seq=2, compute_share=0.5))
    stats = wait_for(lambda: (s := read_stats(tmp_path)) is not None and s.control_seq_applied == 2 and s,
                     "applied without waiting an hour")
    assert stats.compute_share == 0.5 and job.share == 0.5 and stats.step == held.step
