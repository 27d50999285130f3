"""A job of several training processes (torchrun, accelerate, deepspeed: one rank per GPU): each
rank takes its own device (LOCAL_RANK) and its own job agent, in its own directory (local rank 0
in the job directory, rank r in ranks/<r>/: docs/protocol.md), so every rank reports its
statistics and takes the controls for its own GPU. Before, every rank got ANTMAN_DEVICE_ID=0 and
only the first had an agent: the second warned that it "writes no stats and takes no controls".

The choice of device and directory is a pure function (no torch); the end-to-end test runs a
2-rank DistributedDataParallel job on the CPU (gloo) under torchrun, with the Python of
$TF_ANTMAN_TORCH_PYTHON (skipped, with the reason, without one)."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO, clean_env
from tests.torch.python_with_torch import torch_python
from tf_antman.config import ConfigError
from tf_antman.importhook import PTH_LINE
from tf_antman.torch.settings import rank_placement


@pytest.mark.parametrize(("env", "device"), [
    ({}, 3),  # a single-process job: ANTMAN_DEVICE_ID as given
    ({"LOCAL_RANK": "1"}, 1),  # all the job's GPUs visible (scheduler_lite): the rank-th
    ({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "4,6"}, 1),
    ({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "6"}, 0),  # the launcher gave the rank one GPU
    ({"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "4,6"}, 0),
])
def test_each_rank_takes_its_own_device(env: dict[str, str], device: int) -> None:
    assert rank_placement(env, 3, None)[1] == device


def test_each_rank_above_zero_gets_its_own_agent_directory(tmp_path: Path) -> None:
    assert rank_placement({"LOCAL_RANK": "0"}, 0, str(tmp_path)) == (0, 0, str(tmp_path))
    rank, _, job_dir = rank_placement({"LOCAL_RANK": "2"}, 0, str(tmp_path))
    assert rank == 2 and job_dir == str(tmp_path / "ranks" / "2") and Path(job_dir).is_dir()
    assert rank_placement({}, 0, str(tmp_path)) == (None, 0, str(tmp_path))


@pytest.mark.parametrize(("env", "message"), [
    ({"LOCAL_RANK": "x"}, r"LOCAL_RANK='x' is invalid: accepted an integer in 0\.\."),
    ({"LOCAL_RANK": "-1"}, r"LOCAL_RANK='-1' is invalid"),
    ({"LOCAL_RANK": "2", "CUDA_VISIBLE_DEVICES": "0,1"}, r"a rank below the 2 devices"),
])
def test_a_bad_rank_is_one_error_naming_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        rank_placement(env, 0, None)


DDP_SCRIPT = """
import os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(STEPS):
    loss = model(torch.randn(8, 16)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
dist.destroy_process_group()
print("rank", os.environ["LOCAL_RANK"], "done", flush=True)
"""


def test_a_two_rank_ddp_job_under_torchrun_has_an_agent_on_each_rank(tmp_path: Path) -> None:
    python, why = torch_python()
    if python is None:
        pytest.skip(why)
    steps = 30
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT.replace("STEPS", str(steps)))
    site = tmp_path / "site"  # the wheel's .pth line: activation at `import torch` in each rank
    site.mkdir()
    (site / "sitecustomize.py").write_text(PTH_LINE)
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    env = clean_env(ANTMAN_DEVICE="emulated", ANTMAN_JOB_DIR=str(job_dir), ANTMAN_STATS_INTERVAL_MS="1",
                    PYTHONPATH=os.pathsep.join([str(site), str(REPO)]), OMP_NUM_THREADS="1",
                    PATH=os.pathsep.join([str(Path(python).parent), os.environ.get("PATH", "")]))
    done = subprocess.run([python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script)], env=env, capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "runs without one" not in out, textwrap.shorten(out, 4000)
    for rank, directory in ((0, job_dir), (1, job_dir / "ranks" / "1")):
        stats = json.loads((directory / "stats.json").read_text())
        assert stats["step"] == steps, (rank, stats)
        assert stats["devices"][0]["device"] == rank and stats["state"] == "finished", (rank, stats)
