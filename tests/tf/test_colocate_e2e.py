"""End to end on the emulated device: the scheduler_lite daemon co-locates one guarantee job and two
opportunistic jobs, all real TF training processes, and its coordinator acts on them through the
job files (the demo's scenario, shortened). Timing figures (slowdown) belong to bench/colocate.py."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "examples"))


def test_guarantee_and_opportunistic_jobs_colocate(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    import demo

    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    r = demo.run_scenario(quick=True, out_dir=tmp_path, live=False, with_solo=False)
    assert r["failed_jobs"] == 0 and r["op_jobs_finished"] == 2
    assert r["jobs"]["guarantee"]["state"] == "finished"
    import json

    rows = json.loads((tmp_path / "timeline.json").read_text())
    rg_running = {round(x["t"], 3) for x in rows if x["job"] == "guarantee" and (x["step"] or 0) > 0}
    during = [x for x in rows if x["job"].startswith("opportunistic") and round(x["t"], 3) in rg_running]
    rg_placed = min(x["t"] for x in rows if x["job"] == "guarantee")
    before = [x for x in rows if x["job"].startswith("opportunistic") and x["t"] < rg_placed]
    # Settings in force come from each job's own stats: none before its first report.
    def reported(rows: list[dict], key: str) -> list:
        return [x[key] for x in rows if x[key] is not None]

    assert reported(during, "limit") and reported(before, "limit") and reported(during, "share")
    # While the guarantee job trains, the opportunistic jobs were shrunk and throttled...
    assert max(reported(during, "share")) < 1.0
    assert max(reported(during, "limit")) < min(reported(before, "limit"))
    # ...and went on training next to it. (The second opportunistic job may have waited for the
    # GPU to read below the utilisation threshold: a GPU that just got a job counts as busy.)
    progressed = []
    for name in ("opportunistic-1", "opportunistic-2"):
        steps = [x["step"] or 0 for x in during if x["job"] == name]
        if steps and steps[-1] > steps[0]:
            progressed.append(name)
    assert progressed
