"""Clusters and job traces the simulator runs: `paper_recipe` (AntMan §5.2) and, in alibaba.py,
`load_alibaba` (cluster-trace-gpu-v2023: `alibaba.PODS` and `NODES` under `default_trace_dir()`,
or any pod and node list of that format); docs/simulator.md ("Workloads") describes both.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from scheduler_lite.model import GIB, Gpu, JobKind, Tenant
from scheduler_lite.policy.validation import ConfigError, check_int, check_range
from scheduler_lite.sim.perf import PerfModel

# Gang sizes of the recipe. The paper gives none; 82% single-GPU jobs is Philly's share (MLaaS in
# the wild, NSDI'22 §2, citing Jeon et al. ATC'19), the source of the recipe's run times. The
# split of the other 18% over 2/4/8 GPUs (3:3:2) is an assumption (docs/simulator.md).
RECIPE_GANG_SIZES = ((1, 0.82), (2, 0.0675), (4, 0.0675), (8, 0.045))
# Latest arrival the simulator accepts (about 31,700 years). The clock is a float: at 1e12 s its
# spacing is 1.2e-4 s, well below any step time or round interval; near 1e17 s a 10 s round
# interval no longer moves it and rounds repeat at the same time for ever (the progress events'
# tolerance follows the spacing, speeds.work_tolerance, the rounds' grid cannot).
MAX_SUBMIT_TIME_S = 1e12
# Error of tf-antman-sjf's run-time predictions: log-normal, sigma 0.25 (recurring tasks are
# predicted within ~25%, NSDI'22 §5.2); the recipe's and the Alibaba replay's.
PREDICTION_ERROR_SIGMA = 0.25
# The recipe's run times, drawn from the Philly quantiles, are clamped to [1 min, 4 h].
RECIPE_MIN_RUNTIME_S = 60.0
RECIPE_MAX_RUNTIME_S = 4 * 3600.0


@dataclass(frozen=True, slots=True)
class TraceJob:
    id: str
    tenant: str
    kind: JobKind
    submit_time: float
    num_gpus: int
    runtime_s: float  # run time alone on idle GPUs with all the memory it wants
    model: str
    memory_demand_bytes: int
    utilisation: float  # solo SM utilisation
    step_time_s: float
    predicted_runtime_s: float | None = None
    surge_at_fraction: float | None = None  # progress at which its memory demand grows
    surge_growth: float = 0.0
    requested_share: float | None = None  # what the user asks for (fraction of one GPU)
    # Edges of its CPU-bound phases in solo-seconds of work (PerfModel.cpu_phases).
    cpu_phases: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    gpus: tuple[Gpu, ...]
    tenants: tuple[Tenant, ...]
    jobs: tuple[TraceJob, ...]
    skipped: int = 0  # trace rows not simulated (e.g. CPU-only tasks)


def uniform_cluster(nodes: int, gpus_per_node: int, memory_gib: float) -> tuple[Gpu, ...]:
    check_int("nodes", nodes, 1, 100_000)
    check_int("gpus_per_node", gpus_per_node, 1, 64)
    check_range("gpu_memory_gib", memory_gib, 0.0, 1024.0, low_open=True)
    return tuple(
        Gpu(n * gpus_per_node + i, f"node-{n:04d}", int(memory_gib * GIB), f"node-{n:04d}")
        for n in range(nodes)
        for i in range(gpus_per_node)
    )


def _sample_runtime(quantiles: list[float], rng: random.Random) -> float:
    """A draw from the inverse CDF of the shipped Philly run-time summary (linear between
    quantiles)."""
    u = rng.random() * (len(quantiles) - 1)
    i = int(u)
    if i >= len(quantiles) - 1:
        return quantiles[-1]
    return quantiles[i] + (quantiles[i + 1] - quantiles[i]) * (u - i)


def paper_recipe(
    perf: PerfModel,
    *,
    num_jobs: int = 400,
    seed: int = 0,
    nodes: int = 8,
    gpus_per_node: int = 8,
    gpu_memory_gib: float = 32.0,
    quota_a: int = 64,
    load: float = 1.2,
    auto_fraction: float = 0.0,
) -> Workload:
    """`load`: offered GPU-seconds per second over the cluster size (Poisson arrivals).

    `auto_fraction`: share of tenant A's jobs submitted as `auto` instead of `guarantee` (the
    paper's third job type: guarantee unless the wait is long, upgraded in place later). Drawn
    from its own random stream, so 0 gives exactly the workload without it.
    """
    check_int("num_jobs", num_jobs, 1, 10_000_000)
    check_int("quota_a", quota_a, 0, 10_000_000)
    check_range("auto_fraction", auto_fraction, 0.0, 1.0)
    check_range("load", load, 0.0, 100.0, low_open=True)
    rng = random.Random(seed)
    gpus = uniform_cluster(nodes, gpus_per_node, gpu_memory_gib)
    quantiles = json.loads(resources.files("scheduler_lite.data").joinpath("philly_runtime_quantiles.json")
                           .read_text())["quantiles_s"]
    families = sorted(perf.families)
    sizes = [s for s, _ in RECIPE_GANG_SIZES if s <= len(gpus)]
    weights = [w for s, w in RECIPE_GANG_SIZES if s <= len(gpus)]
    drafts = []
    for i in range(num_jobs):
        model = rng.choice(perf.families[rng.choice(families)])
        m = perf.models[model]
        runtime = min(max(_sample_runtime(quantiles, rng), RECIPE_MIN_RUNTIME_S), RECIPE_MAX_RUNTIME_S)
        num = rng.choices(sizes, weights)[0]
        tenant = "A" if rng.random() < 0.5 else "B"
        surge = rng.random() < perf.surge_probability
        # Recurring tasks are predicted within ~25% (NSDI'22 §5.2): log-normal error.
        predicted = runtime * math.exp(rng.gauss(0.0, PREDICTION_ERROR_SIGMA))
        drafts.append((i, model, m, runtime, num, tenant, surge, predicted))
    mean_work = sum(d[3] * d[4] for d in drafts) / num_jobs
    rate = load * len(gpus) / mean_work
    t = 0.0
    jobs = []
    autos = random.Random(f"auto-{seed}")
    for i, model, m, runtime, num, tenant, surge, predicted in drafts:
        kind = JobKind.GUARANTEE if tenant == "A" else JobKind.OPPORTUNISTIC
        if kind is JobKind.GUARANTEE and auto_fraction > 0 and autos.random() < auto_fraction:
            kind = JobKind.AUTO
        jobs.append(TraceJob(
            id=f"j{i:06d}", tenant=tenant,
            kind=kind,
            submit_time=round(t, 3), num_gpus=num, runtime_s=runtime, model=model,
            memory_demand_bytes=m.memory_bytes, utilisation=m.utilisation,
            step_time_s=m.step_time_s, predicted_runtime_s=predicted,
            surge_at_fraction=perf.surge_at_fraction if surge else None,
            surge_growth=perf.surge_growth, requested_share=m.utilisation,
            cpu_phases=perf.cpu_phases(runtime),
        ))
        t += rng.expovariate(rate)
    if jobs[-1].submit_time > MAX_SUBMIT_TIME_S:
        raise ConfigError("load", load, f"a load at which {num_jobs} jobs arrive within {MAX_SUBMIT_TIME_S:g} s "
                          f"(the last arrives at {jobs[-1].submit_time:.3g} s)")
    tenants = (Tenant("A", quota_a), Tenant("B", 0))
    return Workload(f"paper-recipe(seed={seed})", gpus, tenants, tuple(jobs))


def default_trace_dir() -> Path:
    """`<repo root>/../shared/traces`, found from this file's place in the repository."""
    return Path(__file__).resolve().parents[2].parent / "shared" / "traces"


__all__ = ["MAX_SUBMIT_TIME_S", "PREDICTION_ERROR_SIGMA", "TraceJob", "Workload", "default_trace_dir", "paper_recipe",
           "uniform_cluster"]
