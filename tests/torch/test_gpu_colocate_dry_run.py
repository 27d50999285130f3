"""bench/gpu_colocate.py's CPU dry run (`--device cpu --quick`): the GPU command's whole pipeline
(solo runs, the daemon with real PyTorch jobs, the coordinator acting on them, Table 2's four
rows, the JSON line, the timeline) runs end to end on CPU PyTorch, so that a GPU session does not
spend its time on a broken command. Nothing here judges a figure (those are GPU measurements).

Needs a Python with torch ($TF_ANTMAN_TORCH_PYTHON, tests/torch/test_colocate_e2e.py); skipped
without one (CI). About 2 minutes per part on 2 shared cores. The tests of part 2's wait for A's
first completed step (B's arrival counts from it) use stand-in jobs and run everywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.torch.python_with_torch import torch_python

BENCH = REPO / "bench" / "gpu_colocate.py"


def dry_run(part: int, *extra: str) -> dict:
    python, why = torch_python()
    if python is None:
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANTMAN_")}
    env.update(PYTHONUNBUFFERED="1", PATH=os.pathsep.join([str(Path(python).parent), env.get("PATH", "")]))
    proc = subprocess.run([python, str(BENCH), "--part", str(part), "--device", "cpu", "--quick", *extra], env=env,
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


def test_part2_runs_end_to_end_on_cpu(tmp_path: Path) -> None:
    out = dry_run(2, "--out", str(tmp_path))
    assert set(out["table2"]) == {"FIFO", "Pack", "UMem", "tf-antman"}
    assert out["failed_jobs"] == 0
    assert out["table2"]["tf-antman"]["A_state"] == "finished" and out["table2"]["tf-antman"]["B_state"] == "finished"
    assert out["a_batch"] > 0 and out["b_batch"] > 0
    # In every row B arrived the profile's delay (2 s, CPU --quick) after A's first completed
    # step, not 2 s after A's start (values rounded to 0.1 s).
    for row, v in out["table2"].items():
        assert v["A_first_step_s"] > 0, row
        assert v["B_arrival_s"] >= v["A_first_step_s"] + 2.0 - 0.15, (row, v)
    # Each row was also written as soon as it was done (kept if a device call's limit ends the run).
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [r["row"] for r in rows] == ["calibration", "FIFO", "Pack", "UMem", "tf-antman"]
    assert all({k: v for k, v in r.items() if k != "row"} == out["table2"][r["row"]] for r in rows[1:])


# wait_first_step (bench/_gpu_jobs.py), on stand-in jobs (no torch: these run in CI).
def _stand_in(tmp_path: Path, code: str):  # noqa: ANN202 - _gpu_jobs.Started
    if str(REPO / "bench") not in sys.path:
        sys.path.insert(0, str(REPO / "bench"))
    import _gpu_jobs

    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    log = tmp_path / "a.log"
    proc = subprocess.Popen([sys.executable, "-c", code, str(log)], stdout=out, stderr=err)
    return _gpu_jobs, _gpu_jobs.Started(proc, out, err), log


def test_b_waits_for_a_first_completed_step(tmp_path: Path) -> None:
    # Start-up of 1 s, then steps: a half-written line is not a step.
    gj, job, log = _stand_in(tmp_path, textwrap.dedent("""
        import sys, time
        time.sleep(1.0)
        f = open(sys.argv[1], "a")
        f.write("1700000000.0 1"); f.flush(); time.sleep(0.5)
        f.write("2.5\\n"); f.flush()
        time.sleep(30)
    """))
    t0 = time.monotonic()
    try:
        first = gj.wait_first_step(job, log, t0, 20.0, "test")
        assert 1.4 <= first < 15.0
        assert gj.read_log(log) == [(1700000000.0, 12.5)]
    finally:
        job.proc.kill()
        job.proc.wait()


def test_a_that_never_steps_fails_loudly_and_is_killed(tmp_path: Path) -> None:
    gj, job, log = _stand_in(tmp_path, "import sys, time; sys.stderr.write('loading the op hook\\n'); "
                                       "sys.stderr.flush(); time.sleep(60)")
    t0 = time.monotonic()
    try:
        with pytest.raises(SystemExit, match=r"UMem: A made no step within 2 s .*loading the op hook"):
            gj.wait_first_step(job, log, t0, 2.0, "UMem")
        assert time.monotonic() - t0 < 15.0
        assert job.proc.poll() is not None  # killed, not left running
    finally:
        if job.proc.poll() is None:  # red: do not leave it behind
            job.proc.kill()
            job.proc.wait()


def test_a_that_ends_before_a_step_fails_loudly(tmp_path: Path) -> None:
    gj, job, log = _stand_in(tmp_path, "import sys; sys.stderr.write('CUDA out of memory\\n'); sys.exit(3)")
    with pytest.raises(SystemExit, match=r"Pack: A ended \(rc 3\) before its first step: CUDA out of memory"):
        gj.wait_first_step(job, log, time.monotonic(), 30.0, "Pack")


def test_rows_are_written_as_they_finish(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if str(REPO / "bench") not in sys.path:
        sys.path.insert(0, str(REPO / "bench"))
    import gpu_colocate

    rows = tmp_path / "rows.jsonl"
    gpu_colocate.record_row(rows, "FIFO", {"A": 12.345, "A_state": "finished"})
    assert json.loads(rows.read_text()) == {"row": "FIFO", "A": 12.3, "A_state": "finished"}
    gpu_colocate.record_row(rows, "Pack", {"B": 1.0})
    assert [json.loads(x)["row"] for x in rows.read_text().splitlines()] == ["FIFO", "Pack"]
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("gpu_colocate: row {") and json.loads(err[1].split("row ", 1)[1])["B"] == 1.0
