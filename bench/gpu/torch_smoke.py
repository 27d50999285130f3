"""The PyTorch front-end on a real GPU, in well under 90 s (bench/gpu/check.py, step torch_smoke).

Run with tf-antman activated as the installed wheel does it: ANTMAN_* variables in the
environment and the wheel's .pth line (check.py puts it in a sitecustomize on PYTHONPATH), so
that `import torch` activates it; ANTMAN_MEMORY_LIMIT (default here 2GiB) and ANTMAN_HOST_MEMORY
(8GiB) size the over-limit tensor. One JSON line on stdout with the figures and a "checks" object
(each true or false); progress on stderr. Exit 0 once the line is printed (check.py judges the
checks), 1 if it could not get that far.

  antman_active          tf_antman.memory_stats() answers and reports the limit set
  cnn_trains             a small CNN trains 30 steps on one fixed batch: loss finite and lower
  memory_stats_answer    torch.cuda.memory_stats() and max_memory_allocated() answer (> 0)
  over_limit_on_host     an int32 tensor of 1.25 x the limit is served from host memory: the CUDA
                         driver's own pointer attribute (cuPointerGetAttribute, MEMORY_TYPE) says
                         HOST, and tf-antman's host_in_use grew by at least its size
  over_limit_values_ok   kernels write it (arange), read and write it (x * 3 + 7), and the values
                         copied back are exact at sampled positions
  share_half_by_work     at share 0.5, matrix products done per second / those at share 1 is
                         0.5 within 5 points (the work done: a witness outside the gate)
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time

import torch  # tf-antman activates here (the .pth line's import hook)

GiB = 1 << 30
CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
CU_MEMORYTYPE = {1: "host", 2: "device", 3: "array", 4: "unified"}
SHARE_POINTS = 5.0


def log(msg: str) -> None:
    print(f"torch_smoke: {msg}", file=sys.stderr, flush=True)


def parse_bytes(text: str) -> int:
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
    t = text.strip().lower()
    for u, m in units.items():
        if t.endswith(u):
            return int(float(t[: -len(u)]) * m)
    return int(t)


def memory_type(ptr: int) -> str:
    """What the CUDA driver says the pointer is (independent of tf-antman's books)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    value = ctypes.c_uint(0)
    rc = cuda.cuPointerGetAttribute(ctypes.byref(value), CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ctypes.c_uint64(ptr))
    return CU_MEMORYTYPE.get(value.value, f"unknown {value.value}") if rc == 0 else f"error {rc}"


def rate(seconds: float, a: torch.Tensor) -> float:
    """Matrix products per second for `seconds` (synchronised every 10)."""
    done = 0
    torch.cuda.synchronize()
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        for _ in range(10):
            a = torch.mm(a, a).clamp_(-1.0, 1.0)
        torch.cuda.synchronize()
        done += 10
    return done / (time.monotonic() - t0)


def main() -> int:
    import tf_antman

    t_start = time.monotonic()
    limit = parse_bytes(os.environ.get("ANTMAN_MEMORY_LIMIT", "2GiB"))
    out: dict = {"bench": "gpu_torch_smoke", "version": 1, "torch": torch.__version__,
                 "device": torch.cuda.get_device_name(0), "limit_bytes": limit}
    checks: dict[str, bool] = {}
    try:
        stats = tf_antman.memory_stats()
        checks["antman_active"] = int(stats["limit"]) == limit
        out["antman_limit_bytes"] = int(stats["limit"])
    except Exception as e:  # noqa: BLE001 - reported: the rest shows what works without it
        checks["antman_active"] = False
        out["antman_error"] = f"{type(e).__name__}: {e}"

    # 1. A small CNN trains on one fixed batch (its loss must fall).
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(64, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(64, 3, 64, 64, device="cuda")
    y = torch.randint(0, 10, (64,), device="cuda")
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    out.update(train_steps=len(losses), loss_first=round(losses[0], 4), loss_last=round(losses[-1], 4))
    checks["cnn_trains"] = all(map(lambda v: v == v and abs(v) != float("inf"), losses)) and losses[-1] < losses[0]
    log(f"CNN: loss {losses[0]:.3f} -> {losses[-1]:.3f}")

    # 2. PyTorch's own memory queries answer.
    try:
        ms = torch.cuda.memory_stats()
        peak = torch.cuda.max_memory_allocated()
        out.update(memory_stats_keys=len(ms), max_memory_allocated=int(peak))
        checks["memory_stats_answer"] = isinstance(ms, dict) and peak > 0
    except Exception as e:  # noqa: BLE001
        out["memory_stats_error"] = f"{type(e).__name__}: {e}"
        checks["memory_stats_answer"] = False

    # 3. A tensor above the limit lands in host memory, and kernels compute on it right.
    n = int(1.25 * limit) // 4
    before = tf_antman.memory_stats() if checks["antman_active"] else {}
    try:
        big = torch.arange(n, dtype=torch.int32, device="cuda")  # written by a kernel
        big.mul_(3).add_(7)  # read and written by kernels
        torch.cuda.synchronize()
        where = memory_type(big.data_ptr())
        after = tf_antman.memory_stats() if checks["antman_active"] else {}
        grew = int(after.get("host_in_use", 0)) - int(before.get("host_in_use", 0))
        idx = torch.tensor([0, 1, n // 3, n // 2, n - 2, n - 1], dtype=torch.int64)
        got = big.cpu()[idx].tolist()
        want = [3 * int(i) + 7 for i in idx.tolist()]
        out.update(over_limit_bytes=n * 4, over_limit_memory_type=where, host_in_use_growth_bytes=grew,
                   over_limit_samples=got)
        checks["over_limit_on_host"] = where == "host" and grew >= n * 4
        checks["over_limit_values_ok"] = got == want
        del big
    except Exception as e:  # noqa: BLE001
        out["over_limit_error"] = f"{type(e).__name__}: {e}"
        checks["over_limit_on_host"] = checks["over_limit_values_ok"] = False
    log(f"over-limit tensor: {out.get('over_limit_memory_type')}, values ok {checks['over_limit_values_ok']}")

    # 4. Share 0.5 judged by the work done (matrix products per second), beside share 1.
    a = torch.randn(4096, 4096, device="cuda") / 64.0
    rate(0.3, a)  # warm-up
    full = rate(2.0, a)
    try:
        tf_antman.set_compute_share(0.5)
        rate(0.3, a)
        half = rate(2.0, a)
    finally:
        tf_antman.set_compute_share(1.0)
    ratio = half / full
    out.update(share_rate_at_1=round(full, 2), share_rate_at_half=round(half, 2), share_work_ratio=round(ratio, 4),
               share_error_points=round(abs(ratio - 0.5) * 100.0, 3), share_target_points=SHARE_POINTS)
    checks["share_half_by_work"] = abs(ratio - 0.5) * 100.0 <= SHARE_POINTS
    log(f"share 0.5: {half:.1f} vs {full:.1f} products/s at 1 ({ratio:.3f})")

    out["checks"] = checks
    out["seconds"] = round(time.monotonic() - t_start, 3)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
