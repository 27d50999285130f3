"""Memory dynamic scaling: allocator speed, overhead in training, shrink latency, host fallback.

    python bench/memory.py [--quick]

1. alloc+free throughput of tf-antman's allocator (the C API TF's device calls) against
   TensorFlow's own tsl::BFCAllocator on the same pattern (bench/native/alloc_bench.cc, built with
   Bazel): alloc_free_ratio_vs_tf_bfc (worst pattern; target <= 1.2).
2. Keras training step time under tf-antman with no limit against stock TF, medians of
   alternating runs: step_time_ratio_vs_stock (target <= 1.01).
3. Shrink latency for 1 GiB of cached memory on the emulated device: shrink_1gib_ms.
4. A Keras job over its device-memory limit: host bytes served (host_fallback_bytes), its loss
   against an unlimited run with the same seed.
Last line: one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess

from _common import REPO, median, run_job, step_time_ratio_vs_stock, table

BENCH_BIN = REPO / "bazel-bin" / "bench" / "native" / "alloc_bench"


def alloc_bench(ops: int, reps: int) -> dict:
    env = dict(os.environ, TF_ANTMAN_PYTHON=str(REPO / ".venv" / "bin" / "python"), TF_CPP_MIN_LOG_LEVEL="2")
    subprocess.run(["bazel", "build", "-c", "opt", "//bench/native:alloc_bench"], cwd=REPO, env=env, check=True,
                   capture_output=True)
    out = subprocess.run([str(BENCH_BIN), str(ops), str(reps)], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def over_limit(steps: int) -> dict:
    args = ["--mode", "keras", "--steps", str(steps), "--width", "1024", "--batch", "256"]
    free = run_job(args, {"ANTMAN_DEVICE_MEMORY": "2GiB"})
    tight = run_job(args, {"ANTMAN_DEVICE_MEMORY": "2GiB", "ANTMAN_MEMORY_LIMIT": "4MiB"})
    return {
        "host_fallback_bytes": tight["memory"]["host_bytes_served"],
        "host_fallbacks": tight["memory"]["host_fallbacks"],
        "peak_free": free["memory"]["peak_in_use"],
        "loss_free": free["losses"][-1],
        "loss_tight": tight["losses"][-1],
        "step_ms_free": median(free["step_times"]) * 1e3,
        "step_ms_tight": median(tight["step_times"]) * 1e3,
        "failed_allocs": tight["memory"]["failed_allocs"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="shorter runs (about 2 minutes)")
    a = p.parse_args()

    print("1. alloc+free throughput, ns per operation (best of repetitions, thread CPU time)")
    ab = alloc_bench(1_000_000 if a.quick else 4_000_000, 3 if a.quick else 7)
    rows = [[x["slots"], x["tf_bfc_ns"], x["antman_bfc_ns"], x["antman_universal_ns"],
             x["antman_universal_ns"] / x["tf_bfc_ns"]] for x in ab["patterns"]]
    print(table(rows, ["live slots", "TF BFC", "antman BFC", "antman universal (C API)", "ratio"]))
    alloc_ratio = max(r[4] for r in rows)
    print(f"worst ratio: {alloc_ratio:.3f}\n")

    print("2. Keras step time, tf-antman (no limit) vs stock TF, medians of alternating runs")
    ratio, stock, ours = step_time_ratio_vs_stock(3 if a.quick else 7, 40 if a.quick else 150)
    print(table([["stock TF", median(stock) * 1e3], ["tf-antman", median(ours) * 1e3]], ["run", "step ms"]))
    print(f"ratio: {ratio:.4f}\n")

    print(f"3. shrink of 1 GiB of cached regions (emulated device): {ab['shrink_1gib_ms']:.1f} ms\n")

    print("4. Keras MLP (peak above 4 MiB) with a 4 MiB device limit vs unlimited, same seed")
    ol = over_limit(20 if a.quick else 100)
    print(table([
        ["unlimited", ol["peak_free"], 0, ol["loss_free"], ol["step_ms_free"]],
        ["4 MiB limit", 4 << 20, ol["host_fallback_bytes"], ol["loss_tight"], ol["step_ms_tight"]],
    ], ["run", "device bytes (peak / limit)", "host bytes served", "final loss", "step ms"]))
    print()

    print(json.dumps({
        "alloc_free_ratio_vs_tf_bfc": round(alloc_ratio, 4),
        "alloc_ns": ab["patterns"],
        "step_time_ratio_vs_stock": round(ratio, 4),
        "shrink_1gib_ms": round(ab["shrink_1gib_ms"], 2),
        "host_fallback_bytes": ol["host_fallback_bytes"],
        "over_limit_loss_equal": abs(ol["loss_free"] - ol["loss_tight"]) <= 1e-5 * abs(ol["loss_free"]),
        "over_limit_failed_allocs": ol["failed_allocs"],
        "quick": a.quick,
    }))


if __name__ == "__main__":
    main()
