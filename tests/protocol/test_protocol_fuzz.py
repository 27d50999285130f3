"""Thousands of random, truncated and hostile control files against a running agent.

Each file is written only after the previous one was acknowledged in stats.json, so every file has
exactly one outcome: applied exactly as written (the actuator saw exactly those values, in order),
or rejected with a field and a reason in stats.json while the settings in force stay unchanged.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.protocol.protocol_helpers import read_stats, wait_for
from tests.protocol.simulated_job import SimulatedJob
from tf_antman.agent import JobAgent
from tf_antman.protocol import Control, MemoryLimit, Stats, control_path, temp_dir
from tf_antman.protocol.schema import (
    MAX_BYTES,
    MAX_CONTROL_BYTES,
    MAX_DEVICE_INDEX,
    MAX_SEQ,
)

CASES = 2000
DEVICES = 2
FAULTY_SHARE = 0.125  # the simulated device refuses exactly this share


@dataclass
class Expect:
    applied: bool
    control: Control | None = None
    seq: int | None = None  # the seq the rejection must carry (None: not checked)
    field: str | None = None  # the field the rejection must name (None: any)
    reason: str | None = None  # words the reason must contain


@dataclass
class Model:
    """What must be in force on the simulated device."""

    limits: dict[int, int] = field(default_factory=lambda: dict.fromkeys(range(DEVICES), MAX_BYTES))
    share: float = 1.0
    paused: bool = False


class Generator:
    def __init__(self, rng: random.Random, job_dir: Path, scratch: Path) -> None:
        self.rng = rng
        self.job_dir = job_dir
        self.scratch = scratch
        self.seq = 0  # the greatest seq handed out
        self.received = 0  # the greatest seq the job has read (the bound for a stale seq)
        self.last_kind = ""
        self.last_payload: bytes | None = None

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def valid_control(self, seq: int) -> Control:
        rng = self.rng
        devices = rng.sample(range(DEVICES), rng.randint(0, DEVICES))
        limits = tuple(
            MemoryLimit(d, rng.choice([0, 1, MAX_BYTES, rng.randrange(MAX_BYTES + 1), rng.randrange(2**34)]))
            for d in devices
        )
        # No share of 0: it holds a real job's ops, so its next controls are applied at once by
        # the fallback thread (a pause then also holds the ops: other calls than at a step;
        # test_protocol_agent covers it). This stand-in job steps on at share 0, which a held
        # job cannot, and the model here knows only step boundaries. A tiny share stays.
        share = rng.choice([None, 0.001, 1, 0.5, rng.random()])
        if share == FAULTY_SHARE or share == 0.0:
            share = 0.5
        return Control(seq=seq, memory_limits=limits, compute_share=share, paused=rng.choice([None, None, True, False]))

    # --- writing -----------------------------------------------------------------------------

    def clear_directory_slot(self) -> None:
        path = control_path(self.job_dir)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)

    def place_bytes(self, data: bytes) -> None:
        self.clear_directory_slot()
        fd, tmp = tempfile.mkstemp(dir=temp_dir(self.job_dir), prefix="fuzz.")
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, control_path(self.job_dir))

    def place_special(self, kind: str) -> None:
        path = control_path(self.job_dir)
        self.clear_directory_slot()
        tmp = temp_dir(self.job_dir) / f"fuzz-{kind}"
        if kind == "directory":
            tmp.mkdir()
            if path.exists() or path.is_symlink():
                path.unlink()
            tmp.rename(path)
            return
        if kind == "symlink":
            target = self.scratch / f"elsewhere-{self.seq}.json"
            target.write_text(Control(seq=self.next_seq(), compute_share=0.01).to_json())
            tmp.symlink_to(target)
        else:
            os.mkfifo(tmp)
        os.replace(tmp, path)

    # --- cases -------------------------------------------------------------------------------

    def case(self, model: Model) -> Expect:
        kinds = [
            ("valid", 40), ("faulty_share", 5), ("unknown_device", 5), ("stale_seq", 3), ("mutated", 17),
            ("lexical", 6), ("truncated", 10), ("random_bytes", 5), ("garbage_text", 3), ("directory", 2),
            ("symlink", 2), ("oversized", 1), ("fifo", 1),
        ]
        while True:
            kind = self.rng.choices([k for k, _ in kinds], [w for _, w in kinds])[0]
            if kind in ("directory", "symlink", "fifo") and kind == self.last_kind:
                continue  # the same refusal twice in a row may look like the same file again
            self.last_kind = kind
            expect, payload = getattr(self, kind)(model)
            if payload is not None:
                if payload == self.last_payload:
                    continue  # identical bytes in a recycled inode can be the same file to the watcher
                self.last_payload = payload
                self.place_bytes(payload)
            if expect.control is not None:
                self.received = max(self.received, expect.control.seq)
            if expect.seq is not None:
                self.received = max(self.received, expect.seq)
            return expect

    def valid(self, model: Model) -> tuple[Expect, bytes]:
        control = self.valid_control(self.next_seq())
        return Expect(applied=True, control=control), control.to_json().encode()

    def faulty_share(self, model: Model) -> tuple[Expect, bytes]:
        control = Control(seq=self.next_seq(), memory_limits=(MemoryLimit(0, 99),), compute_share=FAULTY_SHARE)
        return Expect(False, seq=control.seq, field="compute_share", reason="refused by the device"), control.to_json().encode()

    def unknown_device(self, model: Model) -> tuple[Expect, bytes]:
        device = self.rng.randint(DEVICES, MAX_DEVICE_INDEX)
        limits = (MemoryLimit(0, 5), MemoryLimit(device, 5))
        control = Control(seq=self.next_seq(), memory_limits=limits)
        return Expect(False, seq=control.seq, field="memory_limits[1]", reason="not used by this job"), control.to_json().encode()

    def stale_seq(self, model: Model) -> tuple[Expect, bytes]:
        if self.received == 0:
            return self.valid(model)
        # Not above `received`: a seq handed out to a truncated file was never read by the job.
        control = self.valid_control(self.rng.randint(1, self.received))
        return Expect(False, seq=control.seq, field="seq", reason="must be greater than"), control.to_json().encode()

    def mutated(self, model: Model) -> tuple[Expect, bytes]:
        rng = self.rng
        seq = self.next_seq()
        doc: dict[str, Any] = {
            "schema": "tf-antman/control",
            "version": 1,
            "seq": seq,
            "memory_limits": [{"device": 0, "limit_bytes": 1024}],
            "compute_share": 0.5,
            "paused": False,
        }
        wrong = [True, False, None, "1", 1.5, [], {}, -1, MAX_BYTES + 1, MAX_SEQ + 1, 2.0]
        choice = rng.randrange(8)
        expect_seq: int | None = seq
        if choice == 0:
            key = rng.choice(["schema", "version", "seq"])
            del doc[key]
            fld = key
            expect_seq = None if key == "seq" else seq
        elif choice == 1:
            doc["version"] = rng.choice([0, 2, "1", True, 1.0])
            fld = "version"
        elif choice == 2:
            doc["seq"] = rng.choice([0, -5, True, "3", 3.0, None, MAX_SEQ + 1])
            fld, expect_seq = "seq", None
        elif choice == 3:
            doc["compute_share"] = rng.choice([v for v in wrong if not (type(v) in (int, float) and 0 <= v <= 1)])
            fld = "compute_share"
        elif choice == 4:
            doc["paused"] = rng.choice([0, 1, "false", None, [], 0.0])
            fld = "paused"
        elif choice == 5:
            entry = doc["memory_limits"][0]
            key = rng.choice(["device", "limit_bytes"])
            bad = [v for v in wrong if not (type(v) is int and 0 <= v <= (MAX_DEVICE_INDEX if key == "device" else MAX_BYTES))]
            entry[key] = rng.choice([*bad, 64] if key == "device" else bad)
            fld = f"memory_limits[0].{key}"
        elif choice == 6:
            doc[rng.choice(["colour", "memory_limit", "Seq", "pause"])] = 1
            fld = None  # named, but which of the unknown keys comes first is the parser's business
        else:
            doc["memory_limits"] = rng.choice([{}, "1GiB", 5, [[0, 1]], [{"device": 0, "limit_bytes": 1, "x": 0}]])
            fld = None
        return Expect(False, seq=expect_seq, field=fld), json.dumps(doc).encode()

    def lexical(self, model: Model) -> tuple[Expect, bytes]:
        seq = self.next_seq()
        head = f'{{"schema": "tf-antman/control", "version": 1, "seq": {seq}, '
        tail = self.rng.choice(
            [
                '"compute_share": NaN}',
                '"compute_share": Infinity}',
                '"compute_share": -Infinity}',
                '"compute_share": 1e400}',
                '"memory_limits": [{"device": 0, "limit_bytes": 1' + "0" * 25 + "}]}",
                '"paused": true, "paused": false}',
            ]
        )
        return Expect(False, seq=None, field="$"), (head + tail).encode()

    def truncated(self, model: Model) -> tuple[Expect, bytes]:
        text = self.valid_control(self.next_seq()).to_json()
        cut = self.rng.randrange(len(text))
        return Expect(False, seq=None, field="$"), text[:cut].encode()

    def random_bytes(self, model: Model) -> tuple[Expect, bytes]:
        return Expect(False, seq=None), self.rng.randbytes(self.rng.randint(1, 300))

    def garbage_text(self, model: Model) -> tuple[Expect, bytes]:
        alphabet = '{}[]":,0123456789.eE-+ truefalsnul\n\\schema'
        text = "".join(self.rng.choice(alphabet) for _ in range(self.rng.randint(1, 120)))
        return Expect(False, seq=None), text.encode()

    def oversized(self, model: Model) -> tuple[Expect, bytes]:
        control = self.valid_control(self.next_seq())
        text = control.to_json()[:-1] + ', "pad": "' + "x" * MAX_CONTROL_BYTES + '"}'
        return Expect(False, seq=None, field="control.json", reason="bytes"), text.encode()

    def directory(self, model: Model) -> tuple[Expect, None]:
        self.place_special("directory")
        return Expect(False, seq=None, field="control.json", reason="directory"), None

    def symlink(self, model: Model) -> tuple[Expect, None]:
        self.place_special("symlink")
        return Expect(False, seq=None, field="control.json", reason="symbolic link"), None

    def fifo(self, model: Model) -> tuple[Expect, None]:
        self.place_special("fifo")
        return Expect(False, seq=None, field="control.json", reason="regular file"), None


def expected_calls(control: Control, model: Model) -> list[tuple[str, int | None, Any]]:
    calls: list[tuple[str, int | None, Any]] = [("memory_limit", m.device, m.limit_bytes) for m in control.memory_limits]
    if control.compute_share is not None:
        calls.append(("compute_share", None, control.compute_share))
    if control.paused is not None and control.paused != model.paused:
        calls.append(("pause" if control.paused else "resume", None, None))
    return calls


def in_force(job: SimulatedJob) -> Model:
    limits = {d: MAX_BYTES if b is None else b for d, b in job.limits.items()}
    return Model(limits=limits, share=job.share, paused=job.paused)


def test_agent_survives_thousands_of_hostile_control_files(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    job_dir = tmp_path / "job"
    scratch = tmp_path / "scratch"
    job_dir.mkdir()
    scratch.mkdir()
    rng = random.Random(1104)
    job = SimulatedJob(
        devices=DEVICES,
        fail_when=lambda what, _d, value: "refused by the device" if what == "compute_share" and value == FAULTY_SHARE else None,
    )
    agent = JobAgent(job_dir, job, job, reread_interval_s=0.5, paused_heartbeat_s=0.05)
    stop = threading.Event()
    errors: list[BaseException] = []
    steps = [0]

    def loop() -> None:
        try:
            while not stop.is_set():
                time.sleep(0.0002)  # the step itself: like TensorFlow, it lets other threads run
                agent.step_end(0.001)
                steps[0] += 1
        except BaseException as err:  # noqa: BLE001 - must stay empty
            errors.append(err)

    caplog.set_level(logging.WARNING, logger="tf_antman")
    agent.start()
    thread = threading.Thread(target=loop, name="fuzz-steps")
    thread.start()
    generator = Generator(rng, job_dir, scratch)
    model = Model()
    last: Stats | None = None
    outcomes = {"applied": 0, "rejected": 0}
    try:
        for case in range(CASES):
            before_log = len(job.log)
            handled = 0 if last is None else last.controls_applied + last.controls_rejected
            expect = generator.case(model)
            stats: Stats = wait_for(  # type: ignore[assignment]
                lambda h=handled: (s := read_stats(job_dir)) is not None
                and s.controls_applied + s.controls_rejected > h
                and s,
                f"case {case} acknowledged",
            )
            assert stats.controls_applied + stats.controls_rejected == handled + 1, f"case {case}"
            new_calls = [(a.what, a.device, a.value) for a in job.log[before_log:]]
            if expect.applied:
                assert expect.control is not None
                assert stats.control_seq_applied == expect.control.seq, (case, stats.last_rejected)
                assert new_calls == expected_calls(expect.control, model), case
                for entry in expect.control.memory_limits:
                    model.limits[entry.device] = entry.limit_bytes
                if expect.control.compute_share is not None:
                    model.share = expect.control.compute_share
                if expect.control.paused is not None:
                    model.paused = expect.control.paused
                outcomes["applied"] += 1
            else:
                rejection = stats.last_rejected
                assert rejection is not None and rejection.field and rejection.reason, case
                assert last is None or stats.control_seq_applied == last.control_seq_applied
                if expect.field is not None:
                    assert rejection.field == expect.field, (case, rejection)
                if expect.seq is not None:
                    assert rejection.seq == expect.seq, (case, rejection)
                if expect.reason is not None:
                    assert expect.reason in rejection.reason, (case, rejection)
                outcomes["rejected"] += 1
            assert in_force(job) == model, case
            assert stats.state == ("paused" if model.paused else stats.state)
            last = stats
    finally:
        stop.set()
        agent.close()
        thread.join(timeout=10)
    assert not thread.is_alive() and errors == []
    assert not [r for r in caplog.records if "step_end failed" in r.getMessage()]
    assert outcomes["applied"] > CASES // 4 and outcomes["rejected"] > CASES // 4
