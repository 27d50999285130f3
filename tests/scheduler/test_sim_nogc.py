"""The cyclic collector is paused during a simulation and restored after it (engine.simulate)."""

from __future__ import annotations

import gc

import pytest

from scheduler_lite.policy.registry import POLICIES
from scheduler_lite.sim import engine
from scheduler_lite.sim.engine import simulate
from scheduler_lite.sim.perf import load_perf_model
from scheduler_lite.sim.workload import paper_recipe

PERF = load_perf_model()
WL = paper_recipe(PERF, num_jobs=30, seed=1, nodes=1, gpus_per_node=4, quota_a=2, load=1.5)


@pytest.fixture
def collector_on():
    enabled = gc.isenabled()
    gc.enable()
    yield
    if not enabled:
        gc.disable()


def test_simulation_runs_without_the_collector_and_gives_it_back(collector_on, monkeypatch):
    seen = []
    run = engine.Simulator.run

    def spy(self):
        seen.append(gc.isenabled())
        return run(self)

    monkeypatch.setattr(engine.Simulator, "run", spy)
    r = simulate(WL, POLICIES["tf-antman"], PERF, seed=1)
    assert r.summary["finished"] > 0
    assert seen == [False]
    assert gc.isenabled()


def test_the_collector_comes_back_after_an_error(collector_on, monkeypatch):
    def boom(self):
        assert not gc.isenabled()
        raise RuntimeError("boom")

    monkeypatch.setattr(engine.Simulator, "run", boom)
    with pytest.raises(RuntimeError, match="boom"):
        simulate(WL, POLICIES["tf-antman"], PERF, seed=1)
    assert gc.isenabled()


def test_a_caller_that_had_it_off_keeps_it_off(collector_on):
    gc.disable()
    simulate(WL, POLICIES["tf-antman"], PERF, seed=1)
    assert not gc.isenabled()


def test_a_simulation_leaves_no_cyclic_garbage(collector_on):
    """With the collector paused, a cycle through the simulator (e.g. a bound method kept on it)
    would keep its whole state alive until the next collection instead of freeing it at once."""
    gc.collect()
    gc.disable()
    simulate(WL, POLICIES["tf-antman"], PERF, seed=1)
    found = gc.collect()
    assert found == 0
