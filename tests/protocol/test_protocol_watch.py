"""Change detection: inotify delivers without the periodic re-read; polling takes over when it cannot."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from tests.protocol.protocol_helpers import wait_for
from tf_antman.protocol import (
    Control,
    ControlWatcher,
    MemoryLimit,
    atomic_write_text,
    control_path,
    temp_dir,
    write_control,
)
from tf_antman.protocol.watch import ControlUpdate

HOUR = 3600.0


def take_when_ready(watcher: ControlWatcher) -> ControlUpdate:
    return wait_for(watcher.take, "the watcher hands something over")  # type: ignore[return-value]


@pytest.fixture
def inotify_watcher(tmp_path: Path):
    watcher = ControlWatcher(tmp_path, reread_interval_s=HOUR)
    watcher.start()
    yield watcher
    watcher.close()


def test_inotify_delivers_a_rename_without_periodic_reread(inotify_watcher: ControlWatcher, tmp_path: Path) -> None:
    assert inotify_watcher.mode == "inotify"
    assert inotify_watcher.take() is None
    control = Control(seq=1, memory_limits=(MemoryLimit(0, 123),), compute_share=0.5)
    write_control(tmp_path, control)
    update = take_when_ready(inotify_watcher)
    assert update == ControlUpdate(control=control, last_rejection=None, rejected=0)
    assert inotify_watcher.reads_by_poll == 0
    assert inotify_watcher.reads_by_event >= 1


def test_inotify_delivers_an_in_place_write(inotify_watcher: ControlWatcher, tmp_path: Path) -> None:
    # A coordinator that does not rename: the close-after-write event still wakes the watcher.
    with open(control_path(tmp_path), "w", encoding="utf-8") as handle:
        handle.write(Control(seq=2, paused=True).to_json())
    update = take_when_ready(inotify_watcher)
    assert update.control == Control(seq=2, paused=True)
    assert inotify_watcher.reads_by_poll == 0


def test_newest_of_a_burst_wins_and_older_ones_are_not_rejected(
    inotify_watcher: ControlWatcher, tmp_path: Path
) -> None:
    for seq in range(1, 51):
        write_control(tmp_path, Control(seq=seq, compute_share=seq / 100), fsync=False)
    seen: list[int] = []

    def newest_arrived() -> bool:
        update = inotify_watcher.take()
        if update is not None:
            assert update.rejected == 0, update.last_rejection
            assert update.control is not None
            seen.append(update.control.seq)
        return bool(seen) and seen[-1] == 50

    wait_for(newest_arrived, "seq 50 handed over")
    assert seen == sorted(seen)
    assert inotify_watcher.take() is None


def test_stale_seq_is_rejected_with_the_field(inotify_watcher: ControlWatcher, tmp_path: Path) -> None:
    write_control(tmp_path, Control(seq=5))
    assert take_when_ready(inotify_watcher).control == Control(seq=5)
    write_control(tmp_path, Control(seq=3, compute_share=0.2))
    update = take_when_ready(inotify_watcher)
    assert update.control is None and update.rejected == 1
    assert update.last_rejection is not None
    assert (update.last_rejection.seq, update.last_rejection.field) == (3, "seq")
    assert "greater than 5" in update.last_rejection.reason


def test_invalid_file_is_handed_over_as_rejection(inotify_watcher: ControlWatcher, tmp_path: Path) -> None:
    text = '{"schema": "tf-antman/control", "version": 1, "seq": 4, "paused": 0}'
    atomic_write_text(control_path(tmp_path), text, tmp_dir=temp_dir(tmp_path))
    update = take_when_ready(inotify_watcher)
    assert update.control is None and update.rejected == 1
    assert update.last_rejection is not None
    assert (update.last_rejection.seq, update.last_rejection.field) == (4, "paused")


def test_periodic_reread_does_not_deliver_the_same_file_twice(tmp_path: Path) -> None:
    watcher = ControlWatcher(tmp_path, reread_interval_s=0.005, use_inotify=False)
    watcher.start()
    try:
        assert watcher.mode == "polling"
        write_control(tmp_path, Control(seq=1))
        assert take_when_ready(watcher).control == Control(seq=1)
        polls = watcher.reads_by_poll
        wait_for(lambda: watcher.reads_by_poll >= polls + 5, "five more periodic reads")
        assert watcher.take() is None
        os.unlink(control_path(tmp_path))  # a vanished file leaves the settings in force alone
        wait_for(lambda: watcher.reads_by_poll >= polls + 10, "five more periodic reads")
        assert watcher.take() is None
    finally:
        watcher.close()


def test_falls_back_to_polling_when_inotify_cannot_start(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def no_inotify() -> object:
        raise OSError(28, "inotify watch limit reached")

    watcher = ControlWatcher(tmp_path, reread_interval_s=HOUR, fallback_poll_s=0.005, observer_factory=no_inotify)
    with caplog.at_level(logging.WARNING, logger="tf_antman"):
        watcher.start()
    try:
        assert watcher.mode == "polling"
        assert any("inotify watch limit reached" in r.getMessage() for r in caplog.records)
        write_control(tmp_path, Control(seq=8, compute_share=1.0))
        assert take_when_ready(watcher).control == Control(seq=8, compute_share=1.0)
        assert watcher.reads_by_poll >= 1 and watcher.reads_by_event == 0
    finally:
        watcher.close()


def test_control_present_at_start_is_read_synchronously(tmp_path: Path) -> None:
    write_control(tmp_path, Control(seq=3, memory_limits=(MemoryLimit(0, 77),)))
    watcher = ControlWatcher(tmp_path, reread_interval_s=HOUR)
    watcher.start()
    try:
        update = watcher.take()  # no waiting: start() read it
        assert update is not None and update.control == Control(seq=3, memory_limits=(MemoryLimit(0, 77),))
    finally:
        watcher.close()
    assert watcher.mode == "stopped"


def test_watchdogs_own_stop_race_logs_no_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # watchdog's emitter logged "queue_events() called when the thread is inactive" at ERROR when
    # stop() won the race with its read (2 job exits in 60). Forced here: the emitter reads once
    # more after its stop, through watchdog's own code, which logs the real line.
    from watchdog.observers.inotify import InotifyEmitter

    stop = InotifyEmitter.on_thread_stop

    def stop_then_read(self: InotifyEmitter) -> None:
        stop(self)
        self.queue_events(0)  # what the emitter thread does when it loses the race
        logging.getLogger("watchdog.observers.inotify").error("another watchdog error")

    monkeypatch.setattr(InotifyEmitter, "on_thread_stop", stop_then_read)
    watcher = ControlWatcher(tmp_path, reread_interval_s=HOUR)
    watcher.start()
    assert watcher.mode == "inotify"
    with caplog.at_level(logging.ERROR):
        watcher.close()
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["another watchdog error"]  # the race's line only is dropped
    assert logging.getLogger("watchdog.observers.inotify").filters == []  # and only while stopping
