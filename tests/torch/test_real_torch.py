"""With a real PyTorch (skipped where torch is not installed, as in CI): the op hook built with
torch.utils.cpp_extension gates ops on every thread, including autograd's, and only while the
share is below 1. Runs on CPU tensors in the hook's host-timed mode; needs libantman_core.so.
On a GPU machine bench/gpu_colocate.py covers the device-timed mode."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

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
