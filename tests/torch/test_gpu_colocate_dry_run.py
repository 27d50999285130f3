"""bench/gpu_colocate.py's CPU dry run (`--device cpu --quick`): the GPU command's whole pipeline
(solo runs, the daemon with real PyTorch jobs, the coordinator acting on them, Table 2's four
rows, the JSON line, the timeline) runs end to end on CPU PyTorch, so that a GPU session does not
spend its time on a broken command. Nothing here judges a figure (those are GPU measurements).

Needs a Python with torch ($TF_ANTMAN_TORCH_PYTHON, tests/torch/test_colocate_e2e.py); skipped
without one (CI). About 2 minutes per part on 2 shared cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.torch.python_with_torch import torch_python

BENCH = REPO / "bench" / "gpu_colocate.py"


def dry_run(part: int) -> dict:
    python, why = torch_python()
    if python is None:
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANTMAN_")}
    env.update(PYTHONUNBUFFERED="1", PATH=os.pathsep.join([str(Path(python).parent), env.get("PATH", "")]))
    proc = subprocess.run([python, str(BENCH), "--part", str(part), "--device", "cpu", "--quick"], env=env,
                          capture_output=True, text=True, timeout=900, cwd=str(REPO))
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    last = proc.stdout.strip().splitlines()[-1]
    out = json.loads(last)
    # Never mistaken for a GPU figure.
    assert out["device"] == "cpu" and out["dry_run"] is True and "no figure here is a GPU measurement" in out["note"]
    assert out["bench"] == "gpu_colocate" and out["part"] == part
    return out


def test_part1_runs_end_to_end_on_cpu(tmp_path: Path) -> None:
    out = dry_run(1)
    assert out["failed_jobs"] == 0 and out["repeats"] == 1
    [run] = out["runs"]
    assert run["rg_solo_steps"] > 0 and run["rg_co_steps"] > 0
    # The first opportunistic job ran next to the guarantee job (the second may wait for the GPU
    # to read below the utilisation threshold: then it is listed, not counted).
    assert run["op_progress_ratio"] and set(run["op_progress_ratio"]) | set(run["ops_not_placed"]) == \
        {"op-resnet18", "op-mobilenet"}
    assert all(v > 0 for v in run["op_progress_ratio"].values())
    # The timeline the plot is drawn from: the coordinator cut the opportunistic job's share while
    # the guarantee job ran, as the job reported it.
    rows = json.loads(Path(out["timeline_json"]).read_text())
    shares = [r["share"] for r in rows if r["job"] == "op-resnet18" and r["share"] is not None]
    assert shares and shares[0] == 1.0 and min(shares) < 1.0
    if out["timeline_plot"] is None:  # the torch venv has no matplotlib: draw it with this one
        pytest.importorskip("matplotlib")
        sys.path.insert(0, str(REPO / "bench"))
        import gpu_colocate

        gpu_colocate.plot_timeline(rows, tmp_path / "timeline.png", "dry run")
        assert (tmp_path / "timeline.png").stat().st_size > 0
    # A dry run never writes where the GPU figure belongs.
    assert "docs" not in Path(out["timeline_plot"] or out["timeline_json"]).parts


def test_part2_runs_end_to_end_on_cpu() -> None:
    out = dry_run(2)
    assert set(out["table2"]) == {"FIFO", "Pack", "UMem", "tf-antman"}
    assert out["failed_jobs"] == 0
    assert out["table2"]["tf-antman"]["A_state"] == "finished" and out["table2"]["tf-antman"]["B_state"] == "finished"
    assert out["a_batch"] > 0 and out["b_batch"] > 0
