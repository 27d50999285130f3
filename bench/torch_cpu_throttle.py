"""The PyTorch op hook on CPU: its cost at share 1 and the throttle below 1 (host-timed mode).

    python bench/torch_cpu_throttle.py [--quick]      # a Python with torch, a C++ compiler, ninja

Each run is a fresh process training a small MLP on CPU (1 intra-op thread) for a fixed number
of steps and timing every step itself (wall clock), independently of tf-antman's figures.
Modes, alternated and repeated: `stock` (no tf-antman), `share1` (tf-antman on the emulated
device: memory core, step hook, op hook installed but disabled), `share0.5`, `share0.25` (op hook
enabled: every top-level op admitted by the op manager). Figures: share1_cost = median step at
share 1 / stock (the hook's cost when not throttling); slowdown_at_S = median step at S / share 1
(an op-bound job held to S should take about 1/S as long); the manager's achieved share.
Exits 77 with one line where torch is not installed. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = """
import json, statistics, sys, time
mode, steps = sys.argv[1], int(sys.argv[2])
import torch
torch.set_num_threads(1)
if mode != "stock":
    import tf_antman, tf_antman.torch
    share = 1.0 if mode == "share1" else float(mode[len("share"):])
    tf_antman.torch.enable(device="emulated", device_memory="256MiB", compute_share=share)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                            torch.nn.ReLU(), torch.nn.Linear(512, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
times = []
for i in range(steps + 20):
    t0 = time.perf_counter()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    if i >= 20:
        times.append((time.perf_counter() - t0) * 1000)
out = {"mode": mode, "median_ms": statistics.median(times), "loss": float(loss)}
if mode != "stock":
    s = tf_antman.compute_stats()
    out.update(achieved=s.get("achieved_share_window"), steps_seen=tf_antman._state().steps.steps,
               hook=tf_antman.torch.op_hook_stats())
print(json.dumps(out))
"""


def run(mode: str, steps: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANTMAN_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    p = subprocess.run([sys.executable, "-c", CHILD, mode, str(steps)], env=env, capture_output=True,
                       text=True, timeout=1800)
    if p.returncode != 0:
        raise SystemExit(f"torch_cpu_throttle: {mode} run failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 repeats of 150 steps (else 4 of 400)")
    a = ap.parse_args()
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        print("torch_cpu_throttle: skipped, PyTorch is not installed: nothing measured", flush=True)
        sys.exit(77)
    repeats, steps = (2, 150) if a.quick else (4, 400)
    run("share1", 5)  # builds the op hook once (cached by PyTorch) before anything is timed
    modes = ["stock", "share1", "share0.5", "share0.25"]
    res: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(repeats):
        for m in (modes if r % 2 == 0 else modes[::-1]):  # alternate the order
            res[m].append(run(m, steps))
    med = {m: statistics.median(x["median_ms"] for x in rs) for m, rs in res.items()}
    for m in modes:
        per = ", ".join(f"{x['median_ms']:.3f}" for x in res[m])
        extra = "" if m == "stock" else f"  achieved share {statistics.median(x['achieved'] for x in res[m]):.3f}"
        print(f"{m:<10} median step {med[m]:.3f} ms (runs: {per}){extra}")
    gated = res["share0.5"][0]["hook"].get("gated", 0)
    out = {
        "share1_cost": round(med["share1"] / med["stock"], 4),
        "share1_cost_worst": round(max(x["median_ms"] for x in res["share1"]) / min(x["median_ms"] for x in res["stock"]), 4),
        "slowdown_at_0.5": round(med["share0.5"] / med["share1"], 3),
        "slowdown_at_0.25": round(med["share0.25"] / med["share1"], 3),
        "achieved_at_0.5": round(statistics.median(x["achieved"] for x in res["share0.5"]), 3),
        "achieved_at_0.25": round(statistics.median(x["achieved"] for x in res["share0.25"]), 3),
        "ops_gated_per_run_at_0.5": gated, "median_ms": {m: round(v, 3) for m, v in med.items()},
        "repeats": repeats, "steps": steps, "torch": __import__("torch").__version__, "quick": a.quick,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
