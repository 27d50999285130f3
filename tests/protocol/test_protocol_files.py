"""Atomic writes never show a torn file; guarded reads refuse what is not a small regular UTF-8 file."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tf_antman.protocol import (
    Control,
    ProtocolError,
    Stats,
    atomic_write_text,
    parse_stats,
    read_snapshot,
    read_text,
)
from tf_antman.protocol.schema import MAX_CONTROL_BYTES, MAX_STATS_BYTES

ROOT = Path(__file__).resolve().parents[2]


WRITER = """
import sys
from tf_antman.protocol import DeviceStats, Stats, atomic_write_text
from pathlib import Path

path, writes = Path(sys.argv[1]), int(sys.argv[2])
for seq in range(2, writes + 2):
    # Lengths vary a lot from one write to the next, so a torn read shows up as bad JSON or as a
    # document whose fields disagree with its seq.
    devices = tuple(DeviceStats(d, seq, seq, seq, seq, seq, seq, seq, seq) for d in range(seq % 9))
    window = tuple(float(seq) for _ in range(seq % 33))
    text = Stats(seq=seq, pid=1, state="running", step=seq, step_ms_window=window, devices=devices).to_json()
    atomic_write_text(path, text, fsync=False)
"""


def test_reader_never_sees_a_partial_stats_file(tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    atomic_write_text(path, Stats(seq=1, pid=1, state="starting", step=1).to_json())
    writes = 3000
    # The writer is another process, as the job is for the coordinator reading its stats.
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), str(writes)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    failures: list[str] = []
    seqs_seen: set[int] = set()
    while writer.poll() is None:
        text = read_text(path, MAX_STATS_BYTES)
        try:
            stats = parse_stats(text or "")
        except ProtocolError as err:
            failures.append(f"{err} in {text!r}")
            continue
        seqs_seen.add(stats.seq)
        if stats.seq > 1 and (stats.step != stats.seq or len(stats.devices) != stats.seq % 9):
            failures.append(f"mixed document {text!r}")
    assert writer.returncode == 0
    assert failures == []
    assert len(seqs_seen) > 10, "the reader hardly overlapped the writer"
    assert parse_stats(path.read_text()).seq == writes + 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stats.json"], "temporary files left behind"


def test_atomic_write_with_fsync_sets_content_and_mode(tmp_path: Path) -> None:
    path = tmp_path / "control.json"
    atomic_write_text(path, Control(seq=4).to_json())
    assert Control.parse(path.read_text()) == Control(seq=4)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_failed_write_leaves_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "control.json"
    target.mkdir()  # os.replace cannot put a file over a directory
    with pytest.raises(OSError):
        atomic_write_text(target, "{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["control.json"]


def test_missing_file_reads_as_none(tmp_path: Path) -> None:
    assert read_text(tmp_path / "control.json") is None
    assert read_snapshot(tmp_path / "control.json") is None


def test_regular_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "control.json"
    path.write_text("héllo", encoding="utf-8")
    assert read_text(path) == "héllo"


def refused(path: Path, max_bytes: int = MAX_CONTROL_BYTES) -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        read_text(path, max_bytes)
    assert caught.value.field == path.name
    return caught.value


def test_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "control.json").mkdir()
    assert "directory" in refused(tmp_path / "control.json").reason


def test_symlink_is_refused_not_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = elsewhere / "real.json"
    target.write_text(Control(seq=9, compute_share=0.1).to_json())
    (tmp_path / "control.json").symlink_to(target)
    assert "symbolic link" in refused(tmp_path / "control.json").reason
    (tmp_path / "control.json").unlink()
    (tmp_path / "control.json").symlink_to(elsewhere)
    assert "symbolic link" in refused(tmp_path / "control.json").reason
    (tmp_path / "control.json").unlink()
    (tmp_path / "control.json").symlink_to(tmp_path / "dangling")
    assert "symbolic link" in refused(tmp_path / "control.json").reason


def test_oversized_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "control.json"
    path.write_bytes(b" " * (MAX_CONTROL_BYTES + 1))
    assert str(MAX_CONTROL_BYTES) in refused(path).reason
    path.write_bytes(b" " * MAX_CONTROL_BYTES)
    assert read_text(path) == " " * MAX_CONTROL_BYTES


def test_non_utf8_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "control.json"
    path.write_bytes(b'{"seq": 1, "x": "\xff\xfe"}')
    reason = refused(path).reason
    assert "UTF-8" in reason and "offset 17" in reason


def test_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    path = tmp_path / "control.json"
    os.mkfifo(path)
    assert "regular file" in refused(path).reason


def test_snapshot_identity_changes_with_each_rename_only(tmp_path: Path) -> None:
    path = tmp_path / "control.json"
    atomic_write_text(path, Control(seq=1).to_json())
    first = read_snapshot(path)
    again = read_snapshot(path)
    atomic_write_text(path, Control(seq=1).to_json())  # same bytes, new file
    renamed = read_snapshot(path)
    assert first is not None and again is not None and renamed is not None
    assert first.identity == again.identity
    assert renamed.identity != first.identity
    assert renamed.text == first.text
