"""bench/gpu: the core on a real GPU, in one command, without TensorFlow or Bazel.

    python bench/gpu/run.py [--quick] [--rounds N] [--out DIR] [--build-only | --no-build]
                            [--budget S] [--timeout S] [--ready-timeout S]

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

A failure does not stop the run: both halves and the RG rounds run whatever the other parts did
(the RG rounds need the share run's calibration: fma_iters, mean_kernel_ms), and the JSON line is
printed in every case but a skip, with `ok`, `failures` (one line per failure) and, per part, its
exit status and error text: memory_rc / memory_error / memory_failed_checks, compute_rc /
compute_error (a failed `compute_bench probe` is told there too), rg_error, and on a build
failure build_error alone. A crashed binary's figures are null; a binary past --timeout, an
opportunist that does not print READY within --ready-timeout, and anything past --budget (the
whole command's wall time, build included; an opportunist that ignores SIGTERM gets what is left
of it before SIGKILL) are killed and recorded as errors, so the line comes out before a device
call's own time limit. Killed itself (SIGTERM, SIGINT: the device call's limit, Ctrl-C), the
command SIGKILLs every process group it started and exits 128 + the signal, without a JSON line;
it kills what is left at a normal exit too, so no bench process stays on the GPU.

Exit status: 0 ran and every check passed, 1 a build error, a crash, a timeout or a failed check
(after the JSON line), 77 skipped: no nvcc, or no CUDA device or driver (one `SKIP:` line says
which, and no JSON), 2 usage. Figures and the exact command: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _procs import (  # bench/gpu/_procs.py, beside this script
    ERROR_TAIL,
    SKIP,
    BenchError,
    Budget,
    Run,
    describe_rc,
    forget,
    install_stop_handlers,
    last_json,
    run_captured,
    run_json,
    start_child,
    stop_opportunist,
    tail,
    wait_ready,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
MEMORY_KEYS = ("shrink_gib_per_ms", "limit_overshoot_bytes", "host_fallback_ok",
               "host_fallback_slowdown")
SHARE_KEYS = ("share_achieved", "natural_share", "mean_kernel_ms", "manager_share_window",
              "gate_errors", "gate_anchor_uncertainty_ns")
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


def nvml_share(sampler: NvmlSampler, share: dict[str, Any] | None) -> dict[str, Any]:
    """NVML's view of the share phases (natural, 25, 50, 75%), beside the bench's own events."""
    if sampler.error is not None:
        return {"nvml_share_achieved": None, "nvml_share_error_points_max": None,
                "nvml_error": sampler.error}
    windows = (share or {}).get("phase_epoch_s")
    if not isinstance(windows, list) or len(windows) != 1 + len(SHARE_TARGETS):
        return {"nvml_share_achieved": None, "nvml_share_error_points_max": None,
                "nvml_error": "no share phases (compute_bench share printed none)"}
    means = sampler.phase_means(windows)
    natural, achieved = means[0], means[1:]
    if natural is None or any(a is None for a in achieved):
        return {"nvml_share_achieved": achieved, "nvml_share_error_points_max": None,
                "nvml_error": "too few NVML samples inside a phase"}
    worst = max(abs(a - min(t, natural)) * 100.0 for a, t in zip(achieved, SHARE_TARGETS, strict=True)
                if a is not None)
    return {"nvml_natural_share": natural, "nvml_share_achieved": achieved,
            "nvml_share_error_points_max": round(worst, 3)}


def skip(reason: str) -> None:
    print(f"SKIP: {reason}", flush=True)
    sys.exit(SKIP)


def build(out: Path, budget: Budget) -> None:
    for script in ("build.sh", "build_compute.sh"):
        path = HERE / script
        if not path.exists():
            raise BenchError(f"{path} is missing (build.sh comes with the memory half of bench/gpu)")
        rc, _, err = run_captured(["bash", str(path), str(out)], budget.timeout(1800, script))
        if rc == SKIP:
            skip(err.strip().splitlines()[-1] if err.strip() else "nvcc not found")
        if rc is None:
            raise BenchError(f"{script}: not done within --budget (killed)")
        if rc != 0:
            raise BenchError(f"{script} failed ({describe_rc(rc)}): {tail(err, 3000)}")


def guarantee_run(bench: Path, iters: int, kernels: int, opportunist_share: float | None,
                  budget: Budget, timeout: float, ready_timeout: float, probe_ok: bool = True) -> float:
    """Wall seconds of the guarantee job, alone or beside an opportunist at the given share."""
    cmd = [str(bench), "guarantee", "--iters", str(iters), "--kernels", str(kernels)]

    def guarantee() -> float:
        run = run_json(cmd, "guarantee", budget.timeout(timeout, "guarantee"), probe_ok)
        if run.error is not None:
            raise BenchError(run.error)
        assert run.result is not None
        wall = run.result.get("wall_s")
        if not isinstance(wall, (int, float)) or isinstance(wall, bool):
            raise BenchError(f"guarantee: no wall_s in {json.dumps(run.result)[:300]}")
        return float(wall)

    if opportunist_share is None:
        return guarantee()
    what = f"opportunist (share {opportunist_share})"
    ready_s = budget.timeout(ready_timeout, what)
    with tempfile.TemporaryFile() as errf:

        def err_text() -> str:
            errf.seek(0)
            return errf.read().decode(errors="replace")

        opp = start_child([str(bench), "opportunist", "--iters", str(iters), "--share",
                           str(opportunist_share)], stdout=subprocess.PIPE, stderr=errf,
                          text=True, errors="replace")
        line = None
        try:
            line = wait_ready(opp, ready_s)
            if line is None:
                raise BenchError(f"{what}: no READY within {ready_s:.0f} s (killed)")
            if line.strip() != "READY":
                if line:
                    how = f"printed {line.strip()[:200]!r} instead of READY"
                else:  # end of its stdout: it ended
                    try:
                        opp.wait(5)
                        forget(opp)
                    except subprocess.TimeoutExpired:
                        pass
                    how = ("ended before READY" if opp.returncode is None
                           else f"ended before READY ({describe_rc(opp.returncode)})")
                err = err_text()
                raise BenchError(f"{what}: {how}" + (f"; stderr: {tail(err)}" if err.strip() else ""))
            wall = guarantee()
        finally:
            # SIGTERM's grace comes out of what is left of --budget, less 2 s to SIGKILL and print.
            left_running = stop_opportunist(opp, stuck=line is None,
                                            grace=min(30.0, budget.left() - 2.0))
        if left_running is not None:
            raise BenchError(f"{what}: {left_running}")
        if opp.returncode != 0:
            raise BenchError(f"{what} failed ({describe_rc(opp.returncode)}) after the guarantee run: "
                             f"{tail(err_text())}")
    return wall


RG_FIGURES = ("rg_slowdown_throttled", "rg_slowdown_throttled_worst", "rg_slowdown_throttled_spread",
              "rg_slowdown_unthrottled", "rg_slowdown_unthrottled_worst",
              "rg_slowdown_unthrottled_spread", "rg_alone_wall_s", "rg_alone_spread")


def rg(bench: Path, iters: int, kernel_ms: float, rounds: int, seconds: float, budget: Budget,
       timeout: float, ready_timeout: float, probe_ok: bool = True) -> dict[str, Any]:
    """The RG rounds. A failed run ends them: its error is `rg_error`, and the figures are those
    of the rounds completed before it (null if none)."""
    kernels = max(200, int(seconds * 1000.0 / kernel_ms))
    conditions = {"alone": None, "throttled": THROTTLED_SHARE, "unthrottled": 1.0}
    walls: dict[str, list[float]] = {c: [] for c in conditions}
    ratios: dict[str, list[float]] = {"throttled": [], "unthrottled": []}
    error = None
    done = 0
    try:
        for r in range(rounds):
            # Alternate the order so that drift (clocks, temperature) does not favour one condition.
            order = (["alone", "throttled", "alone", "unthrottled"] if r % 2 == 0
                     else ["unthrottled", "alone", "throttled", "alone"])
            this: dict[str, list[float]] = {c: [] for c in conditions}
            for cond in order:
                this[cond].append(guarantee_run(bench, iters, kernels, conditions[cond], budget,
                                                timeout, ready_timeout, probe_ok))
            alone = statistics.mean(this["alone"])
            for cond in ("throttled", "unthrottled"):
                ratios[cond].append(this[cond][0] / alone)
            for cond, values in this.items():
                walls[cond].extend(values)
            done += 1
    except BenchError as e:
        error = f"rg round {done + 1}: {e}"
    out: dict[str, Any] = {"rg_kernels_per_run": kernels, "rg_rounds": rounds, "rg_rounds_done": done,
                           "rg_opportunist_share": THROTTLED_SHARE}
    out.update(dict.fromkeys(RG_FIGURES))
    if done:
        for cond in ("throttled", "unthrottled"):
            out[f"rg_slowdown_{cond}"] = round(statistics.median(ratios[cond]) - 1.0, 4)
            out[f"rg_slowdown_{cond}_worst"] = round(max(ratios[cond]) - 1.0, 4)
            out[f"rg_slowdown_{cond}_spread"] = [round(min(ratios[cond]) - 1.0, 4),
                                                 round(max(ratios[cond]) - 1.0, 4)]
        alone = walls["alone"]
        out["rg_alone_wall_s"] = [round(min(alone), 4), round(max(alone), 4)]
        out["rg_alone_spread"] = round(max(alone) / min(alone) - 1.0, 4)  # the noise floor
    out["rg_error"] = error
    return out


def memory_part(run: Run) -> dict[str, Any]:
    """The memory half's keys, its exit status, its failed checks and its error."""
    result = run.result or {}
    failed = [line.split("CHECK FAILED:", 1)[1].strip() for line in run.stderr.splitlines()
              if "CHECK FAILED:" in line]
    out: dict[str, Any] = {k: result.get(k) for k in MEMORY_KEYS}
    out["memory_checks_ok"] = result.get("checks_ok")
    out["memory_rc"] = run.rc
    out["memory_failed_checks"] = failed
    error = run.error
    if error is None and result.get("checks_ok") is not True:
        error = "memory_bench: exit 0 but checks_ok is not true"
    if failed:
        error = f"{error or 'memory_bench'}; failed checks: {'; '.join(failed)}"
    out["memory_error"] = error
    return out


def compute_part(run: Run | None, probe_error: str | None) -> dict[str, Any]:
    result = (run.result if run else None) or {}
    out: dict[str, Any] = {"share_error_points_max": result.get("share_error_points_max")}
    out.update({k: result.get(k) for k in SHARE_KEYS})
    out["compute_rc"] = run.rc if run else None
    error = run.error if run else None
    gate_errors = result.get("gate_errors")
    if result and "skipped" not in result and gate_errors != 0:  # a skip's line has no figures
        note = f"compute_bench share: gate_errors {gate_errors}"
        error = note if error is None else f"{note}; {error}"
    if probe_error is not None:
        error = probe_error if error is None else f"{probe_error}; {error}"
    out["compute_error"] = error
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
    parser.add_argument("--budget", type=float, default=540.0,
                        help="wall seconds for the whole command, build included (default 540, "
                             "inside a 600 s device call): what is still running then is killed "
                             "and the JSON line printed")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds one bench binary may run before it is killed (default 300)")
    parser.add_argument("--ready-timeout", type=float, default=60.0,
                        help="seconds an opportunist may take to print READY (default 60)")
    args = parser.parse_args(argv)
    install_stop_handlers()
    rounds = args.rounds if args.rounds is not None else (2 if args.quick else 4)
    if not 1 <= rounds <= 50:
        parser.error(f"--rounds: {rounds} is outside the accepted range [1, 50]")
    for name in ("budget", "timeout", "ready_timeout"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')}: must be positive")
    budget = Budget(args.budget)
    args.out.mkdir(parents=True, exist_ok=True)
    compute_bench = args.out / "compute_bench"
    memory_bench = args.out / "memory_bench"
    head: dict[str, Any] = {"bench": "gpu", "version": 1, "quick": args.quick}
    try:
        if not args.no_build:
            build(args.out, budget)
    except BenchError as e:
        print(f"bench/gpu: {e}", file=sys.stderr, flush=True)
        print(json.dumps({**head, "ok": False, "failures": [f"build: {e}"[:ERROR_TAIL]],
                          "build_error": str(e)}), flush=True)
        return 1
    if args.build_only:
        print(json.dumps({"bench": "gpu", "version": 1, "built": [
            str(p) for p in (memory_bench, compute_bench, args.out / "libantman_core.so")]}))
        return 0

    probe_error = None
    try:
        probe_s = budget.timeout(60, "compute_bench probe")
        rc, out, err = run_captured([str(compute_bench), "probe"], probe_s)
        if rc == SKIP:
            skip((last_json(out) or {}).get("skipped", "no CUDA device or driver"))
        if rc != 0:
            probe_error = (f"compute_bench probe: {describe_rc(rc) if rc is not None else f'no answer within {probe_s:.0f} s'}"
                           + (f"; stderr: {tail(err)}" if err.strip() else ""))
    except (BenchError, OSError) as e:
        probe_error = f"compute_bench probe: {e}"

    quick = ["--quick"] if args.quick else []

    def run_bin(cmd: list[str], what: str) -> Run:
        try:
            return run_json(cmd, what, budget.timeout(args.timeout, what), probe_error is None)
        except BenchError as e:
            return Run(what, None, None, "", str(e))

    # The memory half runs whatever the probe said: it does not use compute_bench.
    memory = run_bin([str(memory_bench), *quick], "memory_bench")
    sampler = NvmlSampler()
    sampler.start()
    try:
        share = run_bin([str(compute_bench), "share", *quick], "compute_bench share")
    finally:
        sampler.stop()
    share_result = share.result or {}
    iters, kernel_ms = share_result.get("fma_iters"), share_result.get("mean_kernel_ms")
    rg_result: dict[str, Any] = {"rg_kernels_per_run": None, "rg_rounds": rounds, "rg_rounds_done": 0,
                                 "rg_opportunist_share": THROTTLED_SHARE, **dict.fromkeys(RG_FIGURES)}
    if isinstance(iters, int) and iters > 0 and isinstance(kernel_ms, (int, float)) and kernel_ms > 0:
        try:
            rg_result = rg(compute_bench, iters, float(kernel_ms), rounds, 1.0 if args.quick else 3.0,
                           budget, args.timeout, args.ready_timeout, probe_error is None)
        except Exception as e:  # noqa: BLE001 - a bug here must not cost the line
            rg_result["rg_error"] = f"rg: internal error {type(e).__name__}: {e}"
    else:
        rg_result["rg_error"] = "rg: not run, compute_bench share gave no calibration (fma_iters, mean_kernel_ms)"

    result: dict[str, Any] = {**head, "ok": None, "failures": None,
                              "device": (memory.result or {}).get("device")}
    result.update(memory_part(memory))
    result.update(compute_part(share, probe_error))
    try:
        result.update(nvml_share(sampler, share.result))
    except Exception as e:  # noqa: BLE001 - the optional witness never fails the bench
        result.update(nvml_share_achieved=None, nvml_share_error_points_max=None,
                      nvml_error=f"{type(e).__name__}: {e}")
    result.update(rg_result)
    failures = [result[key] for key in ("memory_error", "compute_error", "rg_error")
                if result[key] is not None]
    result["failures"] = failures
    result["ok"] = not failures
    for line in failures:
        print(f"bench/gpu: FAILED: {line}", file=sys.stderr)
    print(json.dumps(result), flush=True)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
