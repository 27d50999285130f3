"""One PyTorch training job for bench/gpu_colocate.py: a torchvision model (plain torch if
torchvision is missing) on synthetic data on the GPU, an unchanged loop (tf-antman, when
ANTMAN_* is set, activates at `import torch` and sees steps at optimizer.step()).

`--device cpu --tiny` is the CPU dry run of bench/gpu_colocate.py (`--device cpu`): the same
loop on a small conv net, to check the pipeline, not to measure anything about a GPU.

The job measures its own step times (wall clock around each step, synchronised by loss.item()
as a logging loop does), independently of tf-antman's statistics, and appends one line per step
to --log: "<time.time()> <step ms>". Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def make_model(name: str, tiny: bool = False) -> torch.nn.Module:
    try:
        if tiny:
            raise ImportError("--tiny: the small stand-in")
        import torchvision

        return getattr(torchvision.models, name)(weights=None)
    except ImportError:
        # Similar size without torchvision: a plain conv net (~25M parameters for "resnet50");
        # --tiny: 1/16 of the width, for CPU dry runs.
        width = {"resnet50": 256, "resnet18": 128, "mobilenet_v2": 64}.get(name, 128) // (16 if tiny else 1)
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, width, 7, stride=2, padding=3), torch.nn.ReLU(),
            torch.nn.Conv2d(width, width * 2, 3, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(width * 2, width * 2, 3, padding=1), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(width * 2, 1000))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--image", type=int, default=224)
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: --seconds)")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--log", default="")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="a small conv net instead of the model (dry runs)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: PyTorch's default)")
    a = p.parse_args()
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    model = make_model(a.model, a.tiny).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(a.batch, 3, a.image, a.image, device=dev)
    y = torch.randint(0, 1000, (a.batch,), device=dev)
    loss_fn = torch.nn.CrossEntropyLoss()
    log = open(a.log, "a", buffering=1) if a.log else None  # noqa: SIM115 - kept open for the run
    times: list[float] = []
    t_start = time.time()
    while True:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        loss.item()  # synchronises: the step's kernels are done
        ms = (time.perf_counter() - t0) * 1000.0
        times.append(ms)
        if log:
            log.write(f"{time.time():.6f} {ms:.3f}\n")
        if (a.steps and len(times) >= a.steps) or (not a.steps and time.time() - t_start >= a.seconds):
            break
    out = {"steps": len(times), "seconds": time.time() - t_start, "device": a.device,
           "median_ms": statistics.median(times[min(5, len(times) - 1):])}
    try:
        import tf_antman

        if tf_antman.is_active():
            m = tf_antman.memory_stats()
            out.update(peak_in_use=m["peak_in_use"], host_fallbacks=m["host_fallbacks"],
                       host_peak=m["host_peak"])
    except ImportError:
        pass
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
