"""The simulator's job performance model, read from `scheduler_lite/data/perf_model.json`.

docs/simulator.md ("Performance model") gives the formula (speed = compute speed / (memory
slowdown x contention x bandwidth interference)), every parameter's source and the file format;
bandwidth interference, caching and locality are in sim/interference.py.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from scheduler_lite.model import GIB
from scheduler_lite.policy.validation import ConfigError, check_range

FORMAT = "scheduler_lite.perf_model"
READABLE = (3, 4)  # v4 added cpu_phases (a v3 file is read as a model without them); v3 renamed
# colocation_overhead to colocation_interference and added cross_group_slowdown, checkpoint_restart_s


@dataclass(frozen=True, slots=True)
class ModelPerf:
    name: str
    memory_bytes: int
    utilisation: float
    step_time_s: float
    curve_x: tuple[float, ...]  # memory fraction, ascending
    curve_y: tuple[float, ...]  # slowdown factor at that fraction

    def memory_slowdown(self, fraction: float) -> float:
        """The curve at `fraction` of the demand on the GPU: linear between points, flat beyond
        its ends (universal memory keeps the rest in host memory)."""
        xs, ys = self.curve_x, self.curve_y
        if fraction >= xs[-1]:
            return ys[-1]
        if fraction <= xs[0]:
            return ys[0]
        i = bisect.bisect_right(xs, fraction)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (fraction - x0) / (x1 - x0)


@dataclass(frozen=True, slots=True)
class PerfModel:
    models: dict[str, ModelPerf]
    families: dict[str, tuple[str, ...]]
    step_noise_cv: float
    contention_slowdown: float
    unisolated_share_exponent: float
    colocation_interference: float  # slowdown per unit of co-runner utilisation (interference.py)
    cross_group_slowdown: float  # a gang over several NVLink groups (named assumption)
    checkpoint_restart_s: float  # solo-seconds of work a migration costs (named assumption)
    surge_probability: float
    surge_growth: float
    surge_at_fraction: float
    # CPU-bound phases (AntMan §2.2): the job computes on the CPU and leaves its GPU idle.
    # Input preprocessing at the start (Fig. 3), evaluation on the CPU every so often (Fig. 4).
    input_phase_s: float = 0.0
    input_phase_max_fraction: float = 0.0  # of the job's run time
    evaluation_every_s: float = 0.0  # of work; 0: no evaluation phases
    evaluation_s: float = 0.0

    def cpu_phases(self, runtime_s: float) -> tuple[float, ...]:
        """Edges of a job's CPU-bound phases in solo-seconds of work, flat and ascending.

        (a0, b0, a1, b1, ...): the job is on the CPU while a_i <= work done < b_i, so
        `bisect_right(edges, w)` is odd inside a phase. The input phase starts at 0; an
        evaluation starts every `evaluation_every_s` of work after it (a job that ends inside
        one ends on the CPU, like a final evaluation).
        """
        edges: list[float] = []
        start = min(self.input_phase_s, self.input_phase_max_fraction * runtime_s)
        if start > 0:
            edges += [0.0, start]
        if self.evaluation_every_s > 0 and self.evaluation_s > 0:
            at = start + self.evaluation_every_s
            while at < runtime_s:
                edges += [at, min(at + self.evaluation_s, runtime_s)]
                at += self.evaluation_every_s
        return tuple(edges)

    def unisolated_speeds(self, demands: list[float]) -> list[float]:
        """Speed of each job (fraction of solo) packed without isolation: kernels interleave
        freely and the job that issues more wins (AntMan §5.1, Fig. 12). Job i gets u_i^a /
        sum_j u_j^a of the GPU and runs at min(1, that / u_i); what it cannot use is lost to
        kernel queueing."""
        if sum(demands) <= 1.0:
            return [1.0] * len(demands)
        a = self.unisolated_share_exponent
        weights = [u**a for u in demands]
        total = sum(weights)
        # A job on the CPU (u = 0) issues no kernels: its speed is not the GPU's to share.
        return [min(1.0, w / total / u) if u > 0 else 1.0 for w, u in zip(weights, demands, strict=True)]


def load_perf_model(path: Path | None = None) -> PerfModel:
    """The shipped model, or the file at `path`; ConfigError naming the field for anything off."""
    where = "<shipped perf_model.json>" if path is None else str(path)
    try:
        source = resources.files("scheduler_lite.data").joinpath("perf_model.json") if path is None else Path(path)
        raw = json.loads(source.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(where, "<file>", f"a JSON object, {FORMAT!r} (docs/simulator.md): {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(where, type(raw).__name__, "a JSON object")
    try:
        return _perf_model(raw)
    except ConfigError:
        raise  # already names its field
    except KeyError as e:  # a required field is missing
        raise ConfigError(f"{where} {e.args[0]}", None, "a value (required; docs/simulator.md)") from None
    except (TypeError, AttributeError, IndexError, ValueError) as e:
        raise ConfigError(where, "<structure>", f"the documented structure (docs/simulator.md): {e}") from None


# The model's numbers: the file's keys (PerfModel's fields) and the range each must be in.
SCALARS = {"step_noise_cv": (0.0, 1.0), "contention_slowdown": (0.0, 100.0),
           "unisolated_share_exponent": (0.0, 10.0), "colocation_interference": (0.0, 10.0),
           "cross_group_slowdown": (0.0, 100.0), "checkpoint_restart_s": (0.0, 86400.0)}
SURGE_FIELDS = {"probability": (0.0, 1.0), "growth": (0.0, 10.0), "at_fraction": (0.0, 1.0)}  # surge_<key>
# cpu_phases' keys (v4): PerfModel's field and the range of each.
PHASE_FIELDS = {"input_s": ("input_phase_s", 0.0, 86400.0),
                "input_max_fraction": ("input_phase_max_fraction", 0.0, 1.0),
                "evaluation_every_s": ("evaluation_every_s", 0.0, 1e7),
                "evaluation_s": ("evaluation_s", 0.0, 86400.0)}
MIN_EVALUATION_EVERY_S = 60.0


def _perf_model(raw: dict) -> PerfModel:
    if raw.get("format") != FORMAT or raw.get("version") not in READABLE:
        raise ConfigError("perf_model.format/version", (raw.get("format"), raw.get("version")),
                          f"({FORMAT!r}, one of {READABLE})")
    models = {}
    for name, m in raw["models"].items():
        check_range(f"models.{name}.memory_gib", m["memory_gib"], 0.0, 1024.0, low_open=True)
        check_range(f"models.{name}.utilisation", m["utilisation"], 0.0, 1.0, low_open=True)
        check_range(f"models.{name}.step_time_s", m["step_time_s"], 0.0, 3600.0, low_open=True)
        points = sorted((float(x), float(y)) for x, y in m["memory_curve"])
        if not points:
            raise ConfigError(f"models.{name}.memory_curve", [], "points [fraction, slowdown], the last [1.0, 1.0]")
        for x, y in points:
            check_range(f"models.{name}.memory_curve.fraction", x, 0.0, 1.0)
            check_range(f"models.{name}.memory_curve.slowdown", y, 1.0, 1000.0)
        if points[-1][0] != 1.0 or points[-1][1] != 1.0:
            raise ConfigError(f"models.{name}.memory_curve", points[-1], "a last point [1.0, 1.0]")
        models[name] = ModelPerf(name, int(m["memory_gib"] * GIB), m["utilisation"], m["step_time_s"],
                                 tuple(p[0] for p in points), tuple(p[1] for p in points))
    families = {f: tuple(ms) for f, ms in raw["families"].items()}
    # The paper recipe draws a family, then a model of it: neither may be an empty choice.
    if not families:
        raise ConfigError("families", {}, "at least one family: {name: [model, ...]}")
    for f, ms in families.items():
        if not ms:
            raise ConfigError(f"families.{f}", [], "at least one name listed under models")
        for m in ms:
            if m not in models:
                raise ConfigError(f"families.{f}", m, "a name listed under models")
    surge = raw["memory_surge"]
    for key, (low, high) in SCALARS.items():
        check_range(key, raw[key], low, high)
    for key, (low, high) in SURGE_FIELDS.items():
        check_range(f"memory_surge.{key}", surge[key], low, high)
    phases = _cpu_phases(raw.get("cpu_phases")) if raw["version"] >= 4 else {}  # v3: none
    return PerfModel(models, families, **{key: raw[key] for key in SCALARS},
                     **{f"surge_{key}": surge[key] for key in SURGE_FIELDS}, **phases)


def _cpu_phases(phases: object) -> dict[str, float]:
    """The v4 `cpu_phases` object, validated (exactly the four fields, each in its range), as
    PerfModel's fields."""
    if not isinstance(phases, dict):
        raise ConfigError("cpu_phases", phases, "an object with " + ", ".join(PHASE_FIELDS))
    for key in phases:
        if key not in PHASE_FIELDS:
            raise ConfigError(f"cpu_phases.{key}", phases[key], "one of " + ", ".join(PHASE_FIELDS))
    for key, (_, low, high) in PHASE_FIELDS.items():
        check_range(f"cpu_phases.{key}", phases.get(key), low, high)  # missing: None, not a number
    # Each evaluation is two events of the job; listed up front for its whole run (cpu_phases).
    if 0 < phases["evaluation_every_s"] < MIN_EVALUATION_EVERY_S:
        raise ConfigError("cpu_phases.evaluation_every_s", phases["evaluation_every_s"],
                          f"0 (no evaluations) or a number in [{MIN_EVALUATION_EVERY_S:g}, "
                          f"{PHASE_FIELDS['evaluation_every_s'][2]:g}]")
    if phases["evaluation_every_s"] > 0 and phases["evaluation_s"] >= phases["evaluation_every_s"]:
        raise ConfigError("cpu_phases.evaluation_s", phases["evaluation_s"],
                          f"below cpu_phases.evaluation_every_s ({phases['evaluation_every_s']})")
    return {field: phases[key] for key, (field, _, _) in PHASE_FIELDS.items()}
