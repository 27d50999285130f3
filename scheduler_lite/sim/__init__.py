"""Trace-driven simulator driving the scheduler_lite policies unchanged; see docs/simulator.md."""

from scheduler_lite.sim.cli import main
from scheduler_lite.sim.engine import SimResult, Simulator, simulate

__all__ = ["SimResult", "Simulator", "main", "simulate"]
