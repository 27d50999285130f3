"""Replay any pod list and node list in the Alibaba cluster-trace-gpu-v2023 format.

docs/simulator.md ("Workloads" (b)) gives the rules: which pods are skipped, run time and
arrival, QoS -> job kind, gpu_milli -> share, utilisation and memory, how the cluster is picked
from the node list (`_pick_nodes`) or sized to the trace's peak demand (`peak_demand`), and the
input checks: anything malformed is an error naming the file, line and field, never a skip.
"""

from __future__ import annotations

import csv
import itertools
import math
import random
from collections.abc import Iterator
from pathlib import Path

from scheduler_lite.model import GIB, Gpu, JobKind
from scheduler_lite.model import Tenant as _Tenant
from scheduler_lite.policy.validation import ConfigError, check_int, check_range
from scheduler_lite.sim.perf import PerfModel
from scheduler_lite.sim.workload import (
    MAX_SUBMIT_TIME_S,
    PREDICTION_ERROR_SIGMA,
    TraceJob,
    Workload,
)

# GPU memory per model of the Alibaba node list. G2 and G3 are undisclosed: assumed 32 GiB.
GPU_MEMORY_GIB = {"P100": 16, "T4": 16, "V100M16": 16, "V100M32": 32, "A10": 24, "G2": 32, "G3": 32}
DEFAULT_GPU_MEMORY_GIB = 16  # a model not listed above
DEMAND_REFERENCE_GIB = 16  # gpu_milli is a share of this much memory (the smallest GPU)
GUARANTEE_QOS = ("LS", "Burstable", "Guaranteed")
OPPORTUNISTIC_QOS = ("BE",)
POD_PHASES = ("Pending", "Running", "Succeeded", "Failed")  # the trace's (Kubernetes' but Unknown)
SKIPPED_PHASES = ("Pending",)
POD_COLUMNS = ("num_gpu", "gpu_milli", "qos", "pod_phase", "creation_time", "deletion_time", "scheduled_time")
NODE_COLUMNS = ("gpu",)
# The 2023 trace's longest run is ~1.3e7 s (5 months). A pod's CPU phases are listed up front
# (one evaluation per perf_model cpu_phases.evaluation_every_s of work): a bound on the run time
# keeps a stray value from building millions of them.
MAX_RUNTIME_S = 1e8
# The 2023 trace's files in a trace directory.
PODS = Path("alibaba-gpu-v2023/openb_pod_list_default.csv")
NODES = Path("alibaba-gpu-v2023/openb_node_list_gpu_node.csv")


def _num(row: dict[str, str], field: str, where: str, low: float, high: float, whole: bool = False) -> float:
    raw = row.get(field)
    try:
        value = float(raw) if raw not in (None, "") else math.nan
    except ValueError:
        value = math.nan
    if not low <= value <= high or (whole and not value.is_integer()):
        kind = "a whole number" if whole else "a number"
        raise ConfigError(f"{where} {field}", raw, f"{kind} in [{low:g}, {high:g}]")
    return value


def _rows(path: Path, required: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    """(line, row) of a CSV file with a header naming `required`; ConfigError naming the file
    for anything else (not UTF-8, not CSV, a column missing). Header names are stripped (the
    trace's README writes them with spaces after the commas); a byte-order mark is skipped."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f, skipinitialspace=True)
            header = [h.strip() for h in reader.fieldnames or ()]
            missing = [c for c in required if c not in header]
            if missing:
                raise ConfigError(f"{path}", f"columns {header}", "a header row with " + ", ".join(required)
                                  + f" (missing: {', '.join(missing)})")
            reader.fieldnames = header
            for i, row in enumerate(reader, start=2):
                # DictReader fills a short row with None and files a long row's extra fields
                # under None: a truncated or shifted line, not a row to read with holes.
                if None in row or None in row.values():
                    count = sum(v is not None for k, v in row.items() if k is not None) + len(row.get(None, ()))
                    raise ConfigError(f"{path}:{i}", f"{count} fields", f"one field per header column ({len(header)})")
                yield i, row
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}", f"byte {e.start}", "UTF-8 text") from None
    except csv.Error as e:
        raise ConfigError(f"{path}", "<file>", f"CSV ({e})") from None


def read_nodes(path: Path) -> list[tuple[str, int, str]]:
    """(serial number, GPUs, GPU model) of every node with at least one GPU."""
    nodes = []
    for i, row in _rows(path, NODE_COLUMNS):
        count = int(_num(row, "gpu", f"{path}:{i}", 0, 64, whole=True))
        if count:
            nodes.append((row.get("sn") or f"node-{i}", count, row.get("model") or ""))
    if not nodes:
        raise ConfigError(f"{path}", "no GPU node", "at least one row with gpu > 0")
    return nodes


def _pick_nodes(nodes: list[tuple[str, int, str]], gpus: int) -> list[tuple[str, int, str]]:
    """m nodes spread evenly over the list, the pick with the fewest GPUs that is at least `gpus`
    (the fewest nodes among equal totals).

    The GPUs of the m-node pick are not monotone in m (nodes hold 1 to 8 GPUs): the first m
    that reaches `gpus` can overshoot it while a larger m lands on it (2023 node list: 13 nodes
    give 86 GPUs, 14 give 70), so every m is tried, up to where m nodes must exceed the best.
    """
    total = sum(n[1] for n in nodes)
    if gpus >= total:
        return nodes
    best, best_total = nodes, total
    fewest = min(n[1] for n in nodes)
    for m in range(1, len(nodes) + 1):
        if m * fewest >= best_total:
            break  # every pick of m or more nodes holds at least as many GPUs as the best
        picked = [nodes[(j * len(nodes)) // m] for j in range(m)]
        got = sum(n[1] for n in picked)
        if gpus <= got < best_total:
            best, best_total = picked, got
    return best


def _pod(row: dict[str, str], where: str, name: str, num: int, milli: float, perf: PerfModel,
         time_compression: float, rng: random.Random, predictions: random.Random) -> TraceJob:
    """The job of a GPU pod that ran (Running, Succeeded, Failed): every field it needs must be
    there, in range (a missing scheduled_time is an error, not a pod that never ran). Its surge
    is drawn from `rng`, its predicted run time from `predictions`."""
    qos = row["qos"]
    if qos not in GUARANTEE_QOS + OPPORTUNISTIC_QOS:
        raise ConfigError(f"{where} qos", qos, "one of " + ", ".join(GUARANTEE_QOS + OPPORTUNISTIC_QOS))
    created = _num(row, "creation_time", where, 0, 1e12)
    if created / time_compression > MAX_SUBMIT_TIME_S:
        raise ConfigError("time_compression", time_compression,
                          f"a value that keeps every creation_time / time_compression within "
                          f"{MAX_SUBMIT_TIME_S:g} s ({where} creation_time {created:g} needs at least "
                          f"{created / MAX_SUBMIT_TIME_S:.10g})")
    started = _num(row, "scheduled_time", where, created, 1e12)
    deleted = _num(row, "deletion_time", where, started, started + MAX_RUNTIME_S)
    share = max(milli / 1000 if num == 1 else 1.0, 0.001)
    runtime = max(1.0, deleted - started)
    return TraceJob(
        id=name, tenant="alibaba",
        kind=JobKind.OPPORTUNISTIC if qos in OPPORTUNISTIC_QOS else JobKind.GUARANTEE,
        submit_time=created / time_compression, num_gpus=num, runtime_s=runtime, model="generic",
        memory_demand_bytes=int(share * DEMAND_REFERENCE_GIB * GIB), utilisation=share,
        step_time_s=perf.models["generic"].step_time_s, surge_growth=perf.surge_growth,
        requested_share=share, cpu_phases=perf.cpu_phases(runtime),
        surge_at_fraction=perf.surge_at_fraction if rng.random() < perf.surge_probability else None,
        predicted_runtime_s=runtime * math.exp(predictions.gauss(0.0, PREDICTION_ERROR_SIGMA)),
    )


def peak_demand(jobs: list[TraceJob]) -> int:
    """Most whole GPUs asked for at once if every job started on arrival."""
    events = sorted([(j.submit_time, j.num_gpus) for j in jobs]  # departures (< 0) first at equal times
                    + [(j.submit_time + j.runtime_s, -j.num_gpus) for j in jobs])
    return max(itertools.accumulate(d for _, d in events), default=0)


def load_alibaba(
    perf: PerfModel,
    pods: Path,
    nodes: Path,
    *,
    gpus: int | None = None,
    peak_ratio: float | None = None,
    time_compression: float = 1.0,
    seed: int = 0,
) -> Workload:
    check_range("time_compression", time_compression, 0.0, 1e6, low_open=True)
    if gpus is not None and peak_ratio is not None:
        raise ConfigError("gpus/peak_ratio", (gpus, peak_ratio), "at most one of the two")
    if peak_ratio is not None:
        check_range("peak_ratio", peak_ratio, 0.0, 1000.0, low_open=True)
    if "generic" not in perf.models:
        raise ConfigError("perf_model.models.generic", None, "a model named generic (the Alibaba replay's pods)")
    rng = random.Random(seed)
    # tf-antman-sjf's predictions: the run time with the recipe's documented error, from a stream
    # of their own (as the recipe's auto jobs), so the other draws and policies are unchanged.
    predictions = random.Random(f"prediction-{seed}")
    jobs: list[TraceJob] = []
    skipped = 0
    seen: dict[str, int] = {}
    for i, row in _rows(pods, POD_COLUMNS):
        where = f"{pods}:{i}"
        num = int(_num(row, "num_gpu", where, 0, 64, whole=True))
        milli = _num(row, "gpu_milli", where, 0, 1000)  # every row: a typo is not a skip
        phase = row["pod_phase"]
        if phase not in POD_PHASES:
            raise ConfigError(f"{where} pod_phase", phase, "one of " + ", ".join(POD_PHASES))
        if num == 0 or phase in SKIPPED_PHASES:
            skipped += 1  # CPU-only, or never ran: no run time to replay
            continue
        name = row.get("name") or f"pod-{i}"
        if name in seen:
            raise ConfigError(f"{where} name", name, f"a name used once (line {seen[name]} has it)")
        seen[name] = i
        jobs.append(_pod(row, where, name, num, milli, perf, time_compression, rng, predictions))
    if not jobs:
        raise ConfigError(f"{pods}", "no GPU pod that ran", "at least one row with num_gpu > 0, "
                          "a scheduled_time and a pod_phase other than Pending")
    jobs.sort(key=lambda j: (j.submit_time, j.id))
    all_nodes = read_nodes(nodes)
    largest = max(j.num_gpus for j in jobs)
    if gpus is not None:
        check_int("cluster_gpus", gpus, 1, 10_000_000)
    capacity = sum(n[1] for n in all_nodes)
    if largest > capacity:
        pod = next(j for j in jobs if j.num_gpus == largest)
        raise ConfigError(f"{pods} pod {pod.id} num_gpu", largest,
                          f"at most the node list's {capacity} GPUs ({nodes}): it could never run")
    if peak_ratio is not None:
        gpus = max(largest, math.ceil(peak_demand(jobs) / peak_ratio))
    chosen = all_nodes if gpus is None else _pick_nodes(all_nodes, max(gpus, largest))
    cluster: list[Gpu] = []
    for sn, count, model in chosen:
        mem = GPU_MEMORY_GIB.get(model, DEFAULT_GPU_MEMORY_GIB) * GIB
        for _ in range(count):
            cluster.append(Gpu(len(cluster), sn, mem, sn))
    name = f"alibaba({pods.name}, {len(cluster)} GPUs, x{time_compression:g})"
    return Workload(name, tuple(cluster), (_Tenant("alibaba", len(cluster)),), tuple(jobs), skipped)


__all__ = ["NODES", "PODS", "load_alibaba", "peak_demand", "read_nodes"]
