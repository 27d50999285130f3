"""`scheduler-lite sim` as a user runs it: bad options and input files get one line naming the
option or the file, line and field; what it writes is strict JSON and CSV."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler_lite.sim.cli import main
from tests.scheduler.test_daemon_fakes import REPO

HEADER = "name,num_gpu,gpu_milli,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"
NODES = "sn,gpu,model\nn1,8,V100M32\n"


def files(tmp_path: Path, *pods: str, header: str = HEADER, encoding: str = "utf-8") -> list[str]:
    (tmp_path / "pods.csv").write_text(header + "".join(p + "\n" for p in pods), encoding=encoding)
    (tmp_path / "nodes.csv").write_text(NODES)
    return ["--workload", "alibaba", "--pods", str(tmp_path / "pods.csv"), "--node-list", str(tmp_path / "nodes.csv"),
            "--policy", "yarn-cs"]


def one_error(capsys: pytest.CaptureFixture[str], argv: list[str], *words: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("scheduler-lite sim: error: "), err
    for w in words:
        assert w in err, (w, err)


def test_a_run_time_past_the_bound_is_refused_not_simulated(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 1e12 s of work used to build ~1e9 phase edges up front (minutes, tens of GB).
    one_error(capsys, files(tmp_path, "p1,1,500,BE,Succeeded,0,1e12,10"), "pods.csv:2 deletion_time", "1e+08")


def test_duplicate_and_fractional_values_name_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one_error(capsys, files(tmp_path, "p1,1,500,BE,Succeeded,0,100,10", "p1,1,500,BE,Succeeded,5,100,10"),
              "pods.csv:3 name='p1'", "line 2 has it")
    one_error(capsys, files(tmp_path, "p1,1.7,500,BE,Succeeded,0,100,10"), "pods.csv:2 num_gpu='1.7'", "a whole number")


def test_a_pod_larger_than_the_cluster_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one_error(capsys, files(tmp_path, "big,16,1000,LS,Running,0,100,10"), "pod big num_gpu=16",
              "at most the node list's 8 GPUs")


def test_columns_encodings_and_headers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    no_start = HEADER.replace(",scheduled_time", "")
    one_error(capsys, files(tmp_path, "p1,1,500,BE,Succeeded,0,100", header=no_start), "missing: scheduled_time")
    one_error(capsys, files(tmp_path, "p\xe9,1,500,BE,Succeeded,0,100,10", encoding="latin-1"), "UTF-8 text")
    # As Excel saves it (a byte-order mark) and as the trace's README writes the header (", "):
    for header in ("\ufeff" + HEADER, HEADER.replace(",", ", ")):
        argv = files(tmp_path, "p1,1,500,BE,Succeeded,0,100,10", header=header)
        assert main([*argv, "--out", str(tmp_path / "o")]) == 0, capsys.readouterr().err
        rows = (tmp_path / "o" / "jobs-yarn-cs.csv").read_text().splitlines()
        assert rows[2].startswith("p1,alibaba,opportunistic,generic,1,"), rows  # the name kept


def test_options_of_the_other_workload_are_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = files(tmp_path, "p1,1,500,BE,Succeeded,0,100,10")
    one_error(capsys, [*argv, "--jobs", "50"], "--jobs=50", "an option of the paper workload")
    one_error(capsys, ["--pods", str(tmp_path / "pods.csv")], "--pods=", "an option of the alibaba workload")
    # The option as typed, not the workload builder's parameter (`num_jobs=0`, `quota_a=-5` before).
    one_error(capsys, [*argv, "--cluster-gpus", "0"], "--cluster-gpus=0", "an integer in [1, ")
    one_error(capsys, [*argv, "--time-compression", "0"], "--time-compression=0.0", "a number in (0.0, ")
    one_error(capsys, ["--jobs", "20", "--quota-a", "-5"], "--quota-a=-5")
    one_error(capsys, ["--jobs", "0"], "--jobs=0", "an integer in [1, ")
    one_error(capsys, ["--jobs", "20", "--load", "-1"], "--load=-1.0", "a number in (0.0, ")
    one_error(capsys, ["--jobs", "20", "--plots"], "--plots=True", "together with --out")


def test_a_bad_perf_model_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model.json"
    model.write_text("a,b\n1,2\n")
    one_error(capsys, ["--jobs", "20", "--perf-model", str(model)], "model.json", "a JSON object")
    shipped = json.loads((REPO / "scheduler_lite" / "data" / "perf_model.json").read_text())
    for change, words in (
        (lambda m: m.pop("step_noise_cv"), ("model.json step_noise_cv", "required")),
        (lambda m: m["models"]["generic"].update(memory_curve=[]), ("models.generic.memory_curve",)),
        (lambda m: m["cpu_phases"].update(evaluation_every_s=1.0), ("evaluation_every_s=1.0", "[60, ")),
    ):
        broken = json.loads(json.dumps(shipped))
        change(broken)
        model.write_text(json.dumps(broken))
        one_error(capsys, ["--jobs", "20", "--perf-model", str(model)], *words)
    broken = json.loads(json.dumps(shipped))
    del broken["models"]["generic"]
    for family, names in broken["families"].items():
        broken["families"][family] = [n for n in names if n != "generic"]
    model.write_text(json.dumps(broken))
    one_error(capsys, [*files(tmp_path, "p1,1,500,BE,Succeeded,0,100,10"), "--perf-model", str(model)],
              "models.generic")


def test_out_is_checked_first_and_summary_is_strict_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "afile").write_text("")
    one_error(capsys, ["--jobs", "20", "--policy", "yarn-cs", "--out", str(tmp_path / "afile")], "afile")
    # Only opportunistic pods: no guarantee JCT to average (NaN), written as null.
    argv = files(tmp_path, "p1,1,500,BE,Succeeded,0,100,10")
    assert main([*argv, "--out", str(tmp_path / "o")]) == 0

    def strict(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    [summary] = json.loads((tmp_path / "o" / "summary.json").read_text(), parse_constant=strict)
    assert summary["guarantee_avg_jct_s"] is None and summary["avg_jct_s"] == 90.0


def test_a_closed_pipe_stops_the_printing_not_the_run(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # `sim ... | head -0`
    try:
        done = subprocess.run([sys.executable, "-m", "scheduler_lite", "sim", "--jobs", "20", "--policy", "yarn-cs",
                               "--policy", "gandiva", "--out", str(tmp_path / "o")], cwd=REPO, stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (0, "")
    assert len(json.loads((tmp_path / "o" / "summary.json").read_text())) == 2


@pytest.mark.parametrize("argv", [["--workload", "foo"], ["--seed", "x"], ["--no-such-option"],
                                  ["--workload", "alibaba", "--cluster-gpus", "8", "--peak-ratio", "1.25"]])
def test_option_mistakes_are_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.count("\n") == 1 and err.startswith("scheduler-lite sim: error: "), err
    assert "scheduler-lite sim --help" in err


def test_an_unreadable_input_names_its_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = files(tmp_path, "p1,1,500,BE,Succeeded,0,100,10")
    missing = str(tmp_path / "nope.csv")
    one_error(capsys, [*argv, "--pods", missing], f"--pods='{missing}'", "No such file")
    one_error(capsys, [*argv, "--node-list", missing], f"--node-list='{missing}'", "No such file")
    one_error(capsys, [*argv, "--pods", str(tmp_path)], "--pods=", "Is a directory")
    one_error(capsys, ["--jobs", "5", "--perf-model", missing], f"--perf-model='{missing}'", "No such file")
    # The default pod and node lists come from --trace-dir.
    one_error(capsys, ["--workload", "alibaba", "--trace-dir", str(tmp_path)], f"--trace-dir='{tmp_path}'",
              "alibaba-gpu-v2023/openb_pod_list_default.csv", "or give --pods")


def test_out_must_be_a_directory_and_trace_dir_belongs_to_the_alibaba_workload(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "afile").write_text("")
    one_error(capsys, ["--jobs", "5", "--out", str(tmp_path / "afile")], "--out=", "a directory (this is a file)")
    one_error(capsys, ["--jobs", "5", "--out", str(tmp_path / "afile" / "sub")], "--out=", "a writable directory")
    # Ignored before, unlike the other Alibaba options.
    one_error(capsys, ["--jobs", "5", "--trace-dir", str(tmp_path)], f"--trace-dir='{tmp_path}'",
              "an option of the alibaba workload")


def test_plots_write_both_figures(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.image

    assert main(["--jobs", "20", "--out", str(tmp_path), "--plots"]) == 0
    for name in ("jct_cdf.png", "utilisation.png"):
        image = matplotlib.image.imread(tmp_path / name)
        assert image.shape[0] > 100 and image.shape[1] > 100, name
