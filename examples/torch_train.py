"""A small PyTorch training job to co-locate under scheduler_lite; nothing in it knows about tf-antman.

    python examples/torch_train.py --width 256 --steps 300 --batch 64
    scheduler-lite submit --tenant batch --type opportunistic -- /path/to/venv/bin/python examples/torch_train.py

Synthetic data (no downloads), an MLP of two hidden layers of --width, plain PyTorch: on the GPU
when PyTorch sees one, else on the CPU. One progress line every --print-every steps (step, mean
step time of the last chunk, throughput) and a final JSON line with the figures.

Under scheduler_lite the job runs under tf-antman with nothing added to it: the scheduler sets the
ANTMAN_* variables, tf-antman activates when `import torch` finishes (the wheel's .pth line), and
every `optimizer.step()` ends a step, where memory limits and compute shares from the coordinator
are applied (docs/pytorch.md). Submit it with the Python that has PyTorch (a job's command is
whatever the user types: `/path/to/venv/bin/python train.py`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=256, help="hidden layer width (memory grows with it)")
    p.add_argument("--steps", type=int, default=200, help="training steps in all")
    p.add_argument("--batch", type=int, default=64, help="examples per step")
    p.add_argument("--print-every", type=int, default=20, help="steps between progress lines")
    p.add_argument("--threads", type=int, default=1, help="CPU threads for PyTorch's ops (on the CPU)")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    for name in ("width", "steps", "batch", "print_every", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    try:  # after the arguments: --help works without PyTorch
        import torch
    except ModuleNotFoundError as err:
        if err.name != "torch":
            raise
        sys.exit(f"torch_train.py: PyTorch is not installed in {sys.executable}; run it with a Python "
                 "that has PyTorch (and the tf-antman wheel under scheduler_lite), e.g. "
                 "/path/to/torch-venv/bin/python examples/torch_train.py (docs/pytorch.md)")

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = torch.nn.Sequential(
        torch.nn.Linear(64, args.width), torch.nn.ReLU(),
        torch.nn.Linear(args.width, args.width), torch.nn.ReLU(),
        torch.nn.Linear(args.width, 10),
    ).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()
    # One batch of a fixed random linear task, reused: the input pipeline costs nothing.
    x = torch.randn(args.batch, 64, device=device)
    y = (x @ torch.randn(64, 10, device=device)).argmax(dim=1)

    started = time.monotonic()
    chunk_start = started
    chunk_ms: list[float] = []
    loss = torch.zeros(())
    for step in range(1, args.steps + 1):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        if step % args.print_every == 0 or step == args.steps:
            value = loss.item()  # synchronises (on a GPU): the chunk's kernels are done
            now = time.monotonic()
            n = step % args.print_every or args.print_every
            ms = (now - chunk_start) * 1000.0 / n
            chunk_ms.append(ms)
            chunk_start = now
            print(f"step {step} {ms:.2f} ms/step {args.batch * 1000.0 / ms:.0f} examples/s loss {value:.4f}",
                  flush=True)
    seconds = time.monotonic() - started
    print(json.dumps({"steps": args.steps, "seconds": round(seconds, 3), "device": device.type,
                      "final_loss": round(float(loss.item()), 4),
                      "median_chunk_ms": sorted(chunk_ms)[len(chunk_ms) // 2]}), flush=True)


if __name__ == "__main__":
    main()
