"""Daemon and simulator: scripted scenarios through both settings of the driver, same decisions.

The simulator runs the scenario on its performance model. The daemon runs it with a scripted
world in place of processes: each job writes stats.json as a job under the file protocol would
(steps at its step time, its utilisation as achieved share, its memory demand against the limit
in force: the launch environment, then its control.json) and ends after the time it ran in the
simulator. The daemon ticks every 0.5 s of an injected clock.

Compared: every global decision (placements, upgrades, reservations, in order) and every
coordinator decision taken when a GPU's jobs changed (arrivals, departures, upgrades), as
(kind, job, GPU, new value). Not compared: rounds on a timer (the daemon's scripted steps are not
the model's), the `previous` fields those rounds move, and times (the daemon sees a step one tick
late and averages utilisation over its window, so a mark may lift up to ~3 s later than at the
simulator's 10 s refresh; the scenario leaves no decision within that distance of another).

SCENARIO exercises busy marks, a guarantee arrival and an upgrade with jobs that state no share;
MOVE exercises placement by requested share (a job waits for share room, not for utilisation)
and migration: a restartable job cut to the floor by a guarantee arrival is moved to a GPU that
becomes idle (in the daemon: SIGTERM, the world's process ends, the job starts again there).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from scheduler_lite.config import parse_config
from scheduler_lite.daemon import Daemon
from scheduler_lite.driver import Driver
from scheduler_lite.jobhost import LocalJobHost
from scheduler_lite.launcher import ExitInfo, LaunchSpec, ProcessHandle
from scheduler_lite.model import (
    GIB,
    Gpu,
    JobKind,
    LocalDecision,
    Place,
    Reserve,
    SetComputeShare,
    SetMemoryLimit,
    Tenant,
    Upgrade,
)
from scheduler_lite.policy.registry import get_policy
from scheduler_lite.sim.engine import Simulator
from scheduler_lite.sim.perf import load_perf_model
from scheduler_lite.sim.workload import TraceJob, Workload
from scheduler_lite.storage import MemoryStorage
from tf_antman.protocol import (
    DeviceStats,
    Stats,
    atomic_write_text,
    control_path,
    parse_control,
    read_text,
    stats_path,
    temp_dir,
)

TICK = 0.5
MODEL = "gcn"  # any model of perf_model.json: only its memory curve matters here


@dataclass(frozen=True)
class Spec:
    name: str
    tenant: str
    kind: JobKind
    at: float
    demand_gib: float
    utilisation: float
    runtime_s: float
    share: float | None = None  # requested share (submit --share), None: unstated
    restartable: bool = False  # submit --restartable (the simulator may move any job)


SCENARIO = (
    Spec("o1", "B", JobKind.OPPORTUNISTIC, 0.0, 1, 0.3, 90),
    Spec("o2", "B", JobKind.OPPORTUNISTIC, 2.0, 3, 0.5, 140),
    Spec("o3", "B", JobKind.OPPORTUNISTIC, 4.0, 2, 0.2, 120),  # both GPUs marked busy: waits
    Spec("g1", "A", JobKind.GUARANTEE, 20.0, 1, 0.9, 30),  # next to o1 and o3: they shrink
    Spec("a1", "A", JobKind.AUTO, 25.0, 1, 0.4, 200),  # quota taken: opportunistic, upgraded later
)
MOVE = (
    Spec("m1", "B", JobKind.OPPORTUNISTIC, 0.0, 1, 0.6, 200, 0.6, True),
    Spec("f1", "B", JobKind.OPPORTUNISTIC, 2.0, 1, 0.6, 17, 0.6),  # no share room on GPU 0
    # No share room anywhere until f1 ends at 19, although both GPUs read 0.6 (below M = 0.8)
    # from ~12 on: placed by utilisation alone it would start there.
    Spec("s1", "B", JobKind.OPPORTUNISTIC, 4.0, 1, 0.5, 15, 0.5),
    Spec("g1", "A", JobKind.GUARANTEE, 20.0, 1, 0.9, 100, 0.9),  # next to m1: cut to the floor
)  # s1 ends at ~34: GPU 1 idles and m1, still at the floor (settled at 30, grows at 40), moves there
SCENARIOS = {"busy-marks-upgrade": SCENARIO, "share-migration": MOVE}
STEP_S = 0.5


# -- recording what the driver decides, in either setting ---------------------------------------


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, list]]:
    """Per setting: global decisions, and coordinator decisions of rounds where a GPU's jobs changed."""
    logs: dict[str, list] = {}
    last_jobs: dict[tuple[int, int], tuple] = {}
    schedule, round_, migrate = Driver.schedule, Driver.round, Driver.migrate

    def names(driver: Driver) -> dict[str, str]:
        return getattr(driver, "_names", {})

    def record_schedule(self: Driver, now: float):  # type: ignore[no-untyped-def]
        decisions, launches = schedule(self, now)
        log = logs.setdefault(self._setting, [])  # type: ignore[attr-defined]
        n = names(self)
        for d in decisions:
            if isinstance(d, Place):
                log.append(("place", n.get(d.job_id, d.job_id), d.gpus, str(d.role)))
            elif isinstance(d, Upgrade | Reserve):
                log.append((type(d).__name__.lower(), n.get(d.job_id, d.job_id)))
        return decisions, launches

    def record_round(self: Driver, now: float, gpu: int, view):  # type: ignore[no-untyped-def]
        decisions = round_(self, now, gpu, view)
        n = names(self)
        jobs = tuple((n.get(j.job_id, j.job_id), str(j.role)) for j in view.jobs)
        key = (id(self), gpu)
        if jobs and jobs != last_jobs.get(key):  # a GPU without jobs: no decisions, by contract
            last_jobs[key] = jobs
            logs.setdefault(self._setting, []).append(("round", gpu, jobs, _values(decisions, n)))  # type: ignore[attr-defined]
        return decisions

    def record_migrate(self: Driver, move, now: float):  # type: ignore[no-untyped-def]
        logs.setdefault(self._setting, []).append(("migrate", names(self).get(move.job_id, move.job_id), move.gpus))  # type: ignore[attr-defined]
        return migrate(self, move, now)

    monkeypatch.setattr(Driver, "schedule", record_schedule)
    monkeypatch.setattr(Driver, "round", record_round)
    monkeypatch.setattr(Driver, "migrate", record_migrate)
    yield logs


def _values(decisions: list[LocalDecision], names: dict[str, str]) -> tuple:
    out = []
    for d in decisions:
        if isinstance(d, SetMemoryLimit):
            out.append(("limit", names.get(d.job_id, d.job_id), d.limit_bytes))
        elif isinstance(d, SetComputeShare):
            out.append(("share", names.get(d.job_id, d.job_id), round(d.share, 9)))
    return tuple(sorted(out))


# -- the simulator -------------------------------------------------------------------------------


def run_simulator(scenario: tuple[Spec, ...] = SCENARIO) -> tuple[Simulator, dict[str, float]]:
    perf = load_perf_model()
    gpus = (Gpu(0, "n0", 4 * GIB, "g"), Gpu(1, "n0", 4 * GIB, "g"))
    jobs = tuple(
        TraceJob(s.name, s.tenant, s.kind, s.at, 1, s.runtime_s, MODEL, int(s.demand_gib * GIB), s.utilisation, STEP_S,
                 requested_share=s.share)
        for s in scenario
    )
    workload = Workload("scripted", gpus, (Tenant("A", 1), Tenant("B", 0)), jobs)
    sim = Simulator(workload, get_policy("tf-antman"), perf, rounds="periodic", check_invariants=True)
    sim.driver._setting = "simulator"  # type: ignore[attr-defined]
    result = sim.run()
    assert all(r["state"] == "finished" for r in result.records), result.records
    ran = {str(r["id"]): float(r["end_s"]) - float(r["start_s"]) for r in result.records}  # type: ignore[arg-type]
    return sim, ran


# -- the daemon, with a scripted world -----------------------------------------------------------


class ScriptedWorld:
    """Stands in for job processes: stats.json as the job would write it, exits on schedule."""

    def __init__(self, clock: list[float], specs: dict[str, Spec], ran: dict[str, float]) -> None:
        self.clock = clock
        self.specs = specs  # by job id
        self.ran = ran  # by scenario name
        self.started: dict[str, tuple[float, LaunchSpec]] = {}
        self.first_start: dict[str, float] = {}  # a job started again ends when it would have
        self.stopped: set[str] = set()  # job dirs whose process got SIGTERM: it ends at once
        self.pids = iter(range(10_000_000, 20_000_000))

    # the Launcher interface the daemon uses
    def start(self, spec: LaunchSpec) -> ProcessHandle:
        spec.job_dir.mkdir(parents=True, exist_ok=True)
        key = str(spec.job_dir)
        assert key not in self.started or key in self.stopped, f"{spec.job_id} started twice"
        self.stopped.discard(key)
        self.started[key] = (self.clock[0], spec)
        self.first_start.setdefault(key, self.clock[0])
        return ProcessHandle(next(self.pids), None, spec.job_dir)

    def poll(self, handle: ProcessHandle) -> ExitInfo | None:
        key = str(handle.job_dir)
        if key in self.stopped:
            return ExitInfo(-15)
        _, spec = self.started[key]
        runtime = self.ran[self.specs[spec.job_id].name]
        return ExitInfo(0) if self.clock[0] >= self.first_start[key] + runtime - 1e-9 else None

    def signal(self, handle: ProcessHandle, sig: int) -> bool:
        if self.poll(handle) is not None:
            return False
        self.stopped.add(str(handle.job_dir))
        return True

    def cleanup(self, handle: ProcessHandle) -> None:
        pass

    def write_stats(self, running: list[str]) -> None:
        for key, (start, spec) in self.started.items():
            if spec.job_id not in running or key in self.stopped:
                continue
            s = self.specs[spec.job_id]
            limit = int(spec.env["ANTMAN_MEMORY_LIMIT"])
            share = float(spec.env["ANTMAN_COMPUTE_SHARE"])
            text = read_text(control_path(Path(key)))
            control = None if text is None else parse_control(text)
            if control is not None:
                limit = next((m.limit_bytes for m in control.memory_limits if m.device == 0), limit)
                share = share if control.compute_share is None else control.compute_share
            step = int((self.clock[0] - start) / STEP_S)
            demand = int(s.demand_gib * GIB)
            on = min(demand, limit)
            window = (STEP_S * 1000.0,) * min(step, 32)
            stats = Stats(seq=step + 1, pid=1, state="running", step=step, last_step_ms=window[-1] if window else None,
                          step_ms_window=window, step_ms_median=window[-1] if window else None,
                          devices=(DeviceStats(0, limit, on, on, on, on, demand - on, demand - on, 0),),
                          compute_share=share, achieved_share=min(s.utilisation, share) if step else None,
                          control_seq_applied=0 if control is None else control.seq, wall_time=self.clock[0])
            atomic_write_text(stats_path(Path(key)), stats.to_json(), fsync=False, tmp_dir=temp_dir(Path(key)))


def run_daemon(tmp_path: Path, ran: dict[str, float], scenario: tuple[Spec, ...] = SCENARIO) -> Daemon:
    config = parse_config({
        "version": 1, "paths": {"state_dir": str(tmp_path)},
        "devices": {"kind": "emulated", "emulated": [{"id": i, "memory": "4GiB", "nvlink_group": "g"} for i in (0, 1)]},
        "tenants": [{"name": "A", "gpu_quota": 1}, {"name": "B", "gpu_quota": 0}],
        "daemon": {"tick_interval_s": TICK, "schedule_interval_s": 5, "utilisation_window_s": 10},
    }, base_dir=tmp_path)
    clock = [0.0]
    specs: dict[str, Spec] = {}
    world = ScriptedWorld(clock, specs, ran)
    host = LocalJobHost(config, launcher=world)  # type: ignore[arg-type]
    d = Daemon(config, MemoryStorage(), clock=lambda: clock[0], host=host)
    d.jobs.driver._setting = "daemon"  # type: ignore[attr-defined]
    d.jobs.driver._names = {}  # type: ignore[attr-defined]
    pending = list(scenario)
    while pending or d.storage.list_jobs() and not all(j.state.done for j in d.storage.list_jobs()):
        while pending and pending[0].at <= clock[0] + 1e-9:
            s = pending.pop(0)
            job = d.submit(["true"], tenant=s.tenant, kind=s.kind, workdir=tmp_path,
                           memory_bytes=int(s.demand_gib * GIB), requested_share=s.share, restartable=s.restartable)
            specs[job] = s
            d.jobs.driver._names[job] = s.name  # type: ignore[attr-defined]
        world.write_stats([j.id for j in d.storage.list_jobs() if not j.state.done])
        d.tick()
        clock[0] += TICK
        assert clock[0] < 2000, "the scripted scenario did not finish"
    return d


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_daemon_and_simulator_take_the_same_decisions(tmp_path: Path, recorded: dict[str, list], name: str) -> None:
    scenario = SCENARIOS[name]
    _, ran = run_simulator(scenario)
    d = run_daemon(tmp_path, {k: round(v / TICK + 0.5) * TICK for k, v in ran.items()}, scenario)
    sim_log, daemon_log = recorded["simulator"], recorded["daemon"]
    # The scenario does what it is meant to exercise, in both settings:
    if scenario is SCENARIO:
        assert ("place", "o3", (0,), "opportunistic") in sim_log  # waited for a mark to lift
        assert ("upgrade", "a1") in sim_log
        assert any(e[0] == "round" and ("limit", "o1", 256 << 20) in e[3] for e in sim_log)  # guarantee arrival
    else:
        places = [e for e in sim_log if e[0] == "place"]
        assert places[:3] == [("place", "m1", (0,), "opportunistic"), ("place", "f1", (1,), "opportunistic"),
                              ("place", "s1", (1,), "opportunistic")]  # s1 after f1 left: share, not utilisation
        assert ("migrate", "m1", (1,)) in sim_log
        moved = d.storage.list_jobs()[0]
        assert moved.placement == (1,) and not moved.migrating
        assert [e.kind for e in d.storage.events(moved.id) if e.kind in ("migrating", "migrated")] == \
            ["migrating", "migrated"]
    assert all(j.state.value == "finished" for j in d.storage.list_jobs())
    assert daemon_log == sim_log
    assert os.environ.get("SCHEDULER_LITE_FAULT") is None
