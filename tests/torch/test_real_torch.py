"""With a real PyTorch (skipped where torch is not installed: scripts/test.sh runs this file
again in .torchvenv, which has PyPI's CUDA build of torch, on the CPU): the op hook built with
torch.utils.cpp_extension gates ops on every thread, including autograd's, and only while the
share is below 1. Runs on CPU tensors in the hook's host-timed mode; needs libantman_core.so.
On a GPU machine bench/gpu_colocate.py covers the device-timed mode."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="no torch in this venv: scripts/test.sh runs this file in .torchvenv")

from tf_antman import core as antman_core  # noqa: E402
from tf_antman.torch.compute import Compute, build_hook  # noqa: E402


@pytest.fixture(scope="module")
def compute() -> Compute:
    try:
        core = antman_core.load()
    except antman_core.CoreError as err:
        pytest.skip(str(err))
    return Compute(core, 1.0, 0, on_cuda=False, hook_module=build_hook(with_cuda=False))


def train_steps(n: int) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(n):
        loss = model(torch.randn(32, 64)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_ops_pass_untouched_at_share_one(compute: Compute) -> None:
    before = compute.hook_stats()
    train_steps(3)
    after = compute.hook_stats()
    assert not after["enabled"] and after["gated"] == before["gated"]


def test_every_thread_is_gated_below_one_and_time_is_charged(compute: Compute) -> None:
    compute.set_share(0.5)
    try:
        before, ops_before = compute.hook_stats(), compute.stats().ops_total
        worker = threading.Thread(target=train_steps, args=(3,))
        worker.start()
        train_steps(3)
        worker.join()
        after, s = compute.hook_stats(), compute.stats()
    finally:
        compute.set_share(1.0)
    assert after["enabled"] and after["errors"] == 0
    assert after["inspect_errors"] == 0  # every op's inputs were read (a build mismatch shows here)
    assert after["gated"] - before["gated"] > 50  # forward, backward and optimizer ops
    assert after["nested"] > before["nested"]  # linear -> addmm: covered by the outer op
    assert after["threads"] >= 2
    assert s.ops_total - ops_before == after["gated"] - before["gated"]  # each admitted op finished
    assert s.busy_ns > 0


def test_the_backward_pass_is_gated_op_by_op(compute: Compute) -> None:
    # autograd runs each backward node inside `evaluate_function: XBackward0`, a wrapper with no
    # tensor inputs: it is not gated, and it must not count its ops (mm, sum, threshold_backward)
    # as covered by it, or the whole backward pass ran at full speed below the share.
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    compute.set_share(0.5)
    try:
        loss = model(torch.randn(32, 64)).square().mean()
        before = compute.hook_stats()
        loss.backward()
        after = compute.hook_stats()
    finally:
        compute.set_share(1.0)
    # Backward nodes: mean, pow, addmm x2, relu, t x2 and the parameters' AccumulateGrad.
    assert after["gated"] - before["gated"] >= 6, (before, after)



def test_a_lock_left_by_a_killed_build_does_not_hold_the_next_job(compute: Compute) -> None:
    # A job cancelled while it compiled the hook left PyTorch's lock file, and every later job
    # waited for it for ever inside `import torch`, saying nothing.
    from torch.utils import cpp_extension

    from tf_antman.torch.compute import extensions_root, hook_build_dir

    name, build_dir = hook_build_dir(False, ["-O2", "-DNDEBUG"], extensions_root())
    assert any(build_dir.glob(f"{name}*.so"))  # the module fixture built it here
    (build_dir / "lock").write_text("")
    code = ("from tf_antman.torch.compute import build_hook; "
            "print(build_hook(with_cuda=False).stats()['gated'] >= 0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr
    if getattr(cpp_extension, "FileLock", None) is None:  # torch <= 2.13: the file is the lock
        assert not (build_dir / "lock").exists()
    else:  # torch 2.14: an OS lock on a file that stays; nothing to remove, nothing to warn about
        assert "left by a build that did not finish" not in done.stderr


SHUTDOWN_SNIPPET = """
import atexit, threading, time, torch
from tf_antman import core as antman_core
from tf_antman.torch.compute import Compute, build_hook
seen = {}
stop = threading.Event()
def after_compute_shutdown():
    # Registered before Compute's own handler, so it runs after it (atexit is last in, first
    # out), where Python goes on to free the manager and the gate: the worker still runs ops.
    hook = seen["compute"].hook
    first = hook.stats()
    time.sleep(0.3)
    second = hook.stats()
    stop.set()  # then the worker ends (a daemon thread inside torch at teardown aborts stock torch)
    seen["worker"].join()
    print("after-exit", first, second["gated"] - first["gated"], flush=True)
atexit.register(after_compute_shutdown)
compute = Compute(antman_core.load(), 0.5, 0, on_cuda=False, hook_module=build_hook(with_cuda=False))
seen["compute"] = compute
def busy():
    x = torch.randn(64, 64)
    while not stop.is_set():
        x = (x @ x).tanh()
seen["worker"] = threading.Thread(target=busy, daemon=True)
seen["worker"].start()
while compute.hook.stats()["gated"] < 50:
    pass
"""


def test_the_hook_stops_gating_at_exit_before_its_manager_is_freed(compute: Compute) -> None:
    # Below share 1 the hook holds raw pointers to the op manager and the gate; Python frees
    # them when it tears the interpreter down, while a daemon thread may still run ops. atexit
    # now stops the hook for good and waits for the ops in flight first.
    done = subprocess.run([sys.executable, "-c", SHUTDOWN_SNIPPET], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("after-exit"))
    assert "'shutdown': True" in line and "'in_flight': 0" in line and "'enabled': False" in line, line
    assert line.endswith(" 0"), line  # the worker's ops after shutdown were not gated
