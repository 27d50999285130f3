"""bench/gpu: the core on a real GPU, in one command, without TensorFlow or Bazel.

    python bench/gpu/run.py [--quick] [--rounds N] [--out DIR] [--build-only | --no-build]

Builds what it needs with bench/gpu/build.sh (memory half: memory_bench) and
bench/gpu/build_compute.sh (compute half: libantman_core.so + compute_bench), runs both halves and
prints ONE JSON line with every key:

  memory half (memory_bench.cu): shrink_gib_per_ms, limit_overshoot_bytes, host_fallback_ok,
      host_fallback_slowdown
  compute half (compute_bench.cu): share_error_points_max (25/50/75% of a job of real kernels gated
      through the op manager and the CUDA event gate, measured with the bench's own CUDA events
      around every kernel, not with the manager's timers; NVML utilisation, sampled by this
      script, is a second witness: nvml_share_*), rg_slowdown_throttled and
      rg_slowdown_unthrottled (a guarantee process at 100% with an opportunistic process at 5% vs
      at 100%; the guarantee alone is the baseline, measured in the same run, rounds alternated)

Exit status: 0 ran, 1 a build error or a half failed its checks, 77 skipped: no nvcc, or no CUDA
device or driver (one line says which), 2 usage. Figures and the exact command: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SKIP = 77
MEMORY_KEYS = ("shrink_gib_per_ms", "limit_overshoot_bytes", "host_fallback_ok",
               "host_fallback_slowdown")
THROTTLED_SHARE = 0.05
SHARE_TARGETS = (0.25, 0.5, 0.75)
NVML_PERIOD_S = 0.05
NVML_TRIM_S = 0.3  # NVML averages over its own sample period: drop phase edges


class NvmlSampler(threading.Thread):
    """A second, coarser witness of the share: NVML's GPU utilisation ("percent of time over the
    past sample period during which one or more kernels was executing"), polled with Unix time
    stamps. Optional: without pynvml or NVML, `error` says why and the figures are null."""

    def __init__(self, index: int = 0) -> None:
        super().__init__(daemon=True)
        self.index = index
        self.samples: list[tuple[float, float]] = []
        self.error: str | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
                while not self._stop_event.is_set():
                    util = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
                    self.samples.append((time.time(), util / 100.0))
                    self._stop_event.wait(NVML_PERIOD_S)
            finally:
                pynvml.nvmlShutdown()
        except Exception as e:  # noqa: BLE001 - optional witness: report, never fail the bench
            self.error = f"{type(e).__name__}: {e}"

    def stop(self) -> None:
        self._stop_event.set()
        self.join(10)

    def phase_means(self, windows: list[list[float]]) -> list[float | None]:
        means: list[float | None] = []
        for start, end in windows:
            values = [v for t, v in self.samples if start + NVML_TRIM_S <= t <= end - NVML_TRIM_S]
            means.append(round(statistics.mean(values), 4) if values else None)
        return means


def nvml_share(sampler: NvmlSampler, share: dict[str, Any]) -> dict[str, Any]:
    """NVML's view of the share phases (natural, 25, 50, 75%), beside the bench's own events."""
    if sampler.error is not None:
        return {"nvml_share_achieved": None, "nvml_share_error_points_max": None,
                "nvml_error": sampler.error}
    means = sampler.phase_means(share["phase_epoch_s"])
    natural, achieved = means[0], means[1:]
    if natural is None or any(a is None for a in achieved):
        return {"nvml_share_achieved": achieved, "nvml_share_error_points_max": None,
                "nvml_error": "too few NVML samples inside a phase"}
    worst = max(abs(a - min(t, natural)) * 100.0 for a, t in zip(achieved, SHARE_TARGETS, strict=True)
                if a is not None)
    return {"nvml_natural_share": natural, "nvml_share_achieved": achieved,
            "nvml_share_error_points_max": round(worst, 3)}


class BenchError(RuntimeError):
    pass


def skip(reason: str) -> None:
    print(f"SKIP: {reason}", flush=True)
    sys.exit(SKIP)


def last_json(stdout: str, what: str) -> dict[str, Any]:
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise BenchError(f"{what} printed no JSON line")


def build(out: Path) -> None:
    for script in ("build.sh", "build_compute.sh"):
        path = HERE / script
        if not path.exists():
            raise BenchError(f"{path} is missing (build.sh comes with the memory half of bench/gpu)")
        proc = subprocess.run(["bash", str(path), str(out)], capture_output=True, text=True)
        if proc.returncode == SKIP:
            skip(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "nvcc not found")
        if proc.returncode != 0:
            raise BenchError(f"{script} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")


def run_json(cmd: list[str], what: str, timeout: float) -> dict[str, Any]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode == SKIP:
        skip(f"{what}: no CUDA device or driver")
    result = last_json(proc.stdout, what)
    if proc.returncode != 0:
        raise BenchError(f"{what} failed (rc {proc.returncode}): {result}\n{proc.stderr[-3000:]}")
    return result


def guarantee_run(bench: Path, iters: int, kernels: int, opportunist_share: float | None) -> float:
    """Wall seconds of the guarantee job, alone or beside an opportunist at the given share."""
    if opportunist_share is None:
        return float(run_json([str(bench), "guarantee", "--iters", str(iters), "--kernels",
                               str(kernels)], "guarantee", 600)["wall_s"])
    with tempfile.TemporaryFile() as err:
        opp = subprocess.Popen([str(bench), "opportunist", "--iters", str(iters), "--share",
                                str(opportunist_share)], stdout=subprocess.PIPE, stderr=err,
                               text=True)
        try:
            assert opp.stdout is not None
            if opp.stdout.readline().strip() != "READY":
                raise BenchError("the opportunistic process did not start")
            wall = float(run_json([str(bench), "guarantee", "--iters", str(iters), "--kernels",
                                   str(kernels)], "guarantee", 600)["wall_s"])
        finally:
            opp.send_signal(signal.SIGTERM)
            try:
                opp.wait(60)
            except subprocess.TimeoutExpired:
                opp.kill()
                opp.wait()
        if opp.returncode != 0:
            err.seek(0)
            raise BenchError(f"opportunist failed (rc {opp.returncode}): "
                             f"{err.read().decode(errors='replace')[-2000:]}")
    return wall


def rg(bench: Path, iters: int, kernel_ms: float, rounds: int, seconds: float) -> dict[str, Any]:
    kernels = max(200, int(seconds * 1000.0 / kernel_ms))
    conditions = {"alone": None, "throttled": THROTTLED_SHARE, "unthrottled": 1.0}
    walls: dict[str, list[float]] = {c: [] for c in conditions}
    ratios: dict[str, list[float]] = {"throttled": [], "unthrottled": []}
    for r in range(rounds):
        # Alternate the order so that drift (clocks, temperature) does not favour one condition.
        order = (["alone", "throttled", "alone", "unthrottled"] if r % 2 == 0
                 else ["unthrottled", "alone", "throttled", "alone"])
        this: dict[str, list[float]] = {c: [] for c in conditions}
        for cond in order:
            this[cond].append(guarantee_run(bench, iters, kernels, conditions[cond]))
        alone = statistics.mean(this["alone"])
        for cond in ("throttled", "unthrottled"):
            ratios[cond].append(this[cond][0] / alone)
        for cond, values in this.items():
            walls[cond].extend(values)
    out: dict[str, Any] = {"rg_kernels_per_run": kernels, "rg_rounds": rounds,
                           "rg_opportunist_share": THROTTLED_SHARE}
    for cond in ("throttled", "unthrottled"):
        out[f"rg_slowdown_{cond}"] = round(statistics.median(ratios[cond]) - 1.0, 4)
        out[f"rg_slowdown_{cond}_worst"] = round(max(ratios[cond]) - 1.0, 4)
        out[f"rg_slowdown_{cond}_spread"] = [round(min(ratios[cond]) - 1.0, 4),
                                             round(max(ratios[cond]) - 1.0, 4)]
    alone = walls["alone"]
    out["rg_alone_wall_s"] = [round(min(alone), 4), round(max(alone), 4)]
    out["rg_alone_spread"] = round(max(alone) / min(alone) - 1.0, 4)  # the noise floor
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter phases, 2 RG rounds")
    parser.add_argument("--rounds", type=int, default=None, help="RG rounds (default 2 quick, 4)")
    parser.add_argument("--out", type=Path, default=REPO / "out" / "bench_gpu",
                        help="build directory (default out/bench_gpu)")
    parser.add_argument("--build-only", action="store_true", help="build, then stop")
    parser.add_argument("--no-build", action="store_true",
                        help="use the binaries already in --out (from an earlier build)")
    args = parser.parse_args(argv)
    rounds = args.rounds if args.rounds is not None else (2 if args.quick else 4)
    if not 1 <= rounds <= 50:
        parser.error(f"--rounds: {rounds} is outside the accepted range [1, 50]")
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        if not args.no_build:
            build(args.out)
        compute_bench = args.out / "compute_bench"
        memory_bench = args.out / "memory_bench"
        if args.build_only:
            print(json.dumps({"bench": "gpu", "version": 1, "built": [
                str(p) for p in (memory_bench, compute_bench, args.out / "libantman_core.so")]}))
            return 0
        probe = subprocess.run([str(compute_bench), "probe"], capture_output=True, text=True)
        if probe.returncode == SKIP:
            skip(last_json(probe.stdout, "probe").get("skipped", "no CUDA device or driver"))
        if probe.returncode != 0:
            raise BenchError(f"probe failed: {probe.stderr[-2000:]}")
        quick = ["--quick"] if args.quick else []
        memory = run_json([str(memory_bench), *quick], "memory_bench", 600)
        sampler = NvmlSampler()
        sampler.start()
        try:
            share = run_json([str(compute_bench), "share", *quick], "compute_bench share", 600)
        finally:
            sampler.stop()
        rg_result = rg(compute_bench, int(share["fma_iters"]), float(share["mean_kernel_ms"]),
                       rounds, 1.0 if args.quick else 3.0)
    except BenchError as e:
        print(f"bench/gpu: {e}", file=sys.stderr)
        return 1
    result: dict[str, Any] = {"bench": "gpu", "version": 1, "quick": args.quick,
                              "device": memory.get("device")}
    result.update({k: memory.get(k) for k in MEMORY_KEYS})
    result["memory_checks_ok"] = memory.get("checks_ok")
    result["share_error_points_max"] = share["share_error_points_max"]
    result.update({k: share[k] for k in ("share_achieved", "natural_share", "mean_kernel_ms",
                                         "manager_share_window", "gate_errors",
                                         "gate_anchor_uncertainty_ns")})
    result.update(nvml_share(sampler, share))
    result.update(rg_result)
    print(json.dumps(result), flush=True)
    return 0 if memory.get("checks_ok") and share["gate_errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
