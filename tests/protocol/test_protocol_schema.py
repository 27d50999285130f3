"""Schemas: round trips, and every refusal names the field and the accepted range."""

from __future__ import annotations

import json

import pytest

from tf_antman.protocol import (
    Control,
    DeviceStats,
    MemoryLimit,
    ProtocolError,
    Rejection,
    Stats,
)
from tf_antman.protocol.schema import (
    MAX_BYTES,
    MAX_CONTROL_BYTES,
    MAX_FIELD_CHARS,
    MAX_REASON_CHARS,
    MAX_SEQ,
    STEP_WINDOW,
    parse_control,
    parse_stats,
    seq_hint,
)


def control_doc(**fields: object) -> dict[str, object]:
    doc: dict[str, object] = {"schema": "tf-antman/control", "version": 1, "seq": 7}
    doc.update(fields)
    return doc


def full_stats() -> Stats:
    return Stats(
        seq=3,
        pid=4242,
        state="running",
        step=120,
        last_step_ms=12.5,
        step_ms_window=(11.0, 12.5, 14.0),
        step_ms_mean=12.5,
        step_ms_median=12.5,
        devices=(
            DeviceStats(0, 2**30, 900, 1000, 1200, 800, 64, 128, 3),
            DeviceStats(1, None, 0, 0, 0, 0, 0, 0, 0),
        ),
        compute_share=0.5,
        achieved_share=0.45,
        control_seq_applied=9,
        controls_applied=4,
        controls_rejected=2,
        last_rejected=Rejection(10, "compute_share", "must be a number in [0.0, 1.0], got 2 (integer)"),
        wall_time=1_700_000_000.25,
        controls_applied_fallback=1,
        last_applied_by="fallback",
    )


def test_control_round_trip_keeps_every_field() -> None:
    control = Control(
        seq=12,
        memory_limits=(MemoryLimit(0, 4 * 2**30), MemoryLimit(3, 0)),
        compute_share=0.25,
        paused=False,
    )
    parsed = parse_control(control.to_json())
    assert parsed == control
    assert json.loads(control.to_json())["memory_limits"] == [
        {"device": 0, "limit_bytes": 4 * 2**30},
        {"device": 3, "limit_bytes": 0},
    ]


def test_control_absent_fields_stay_absent() -> None:
    doc = json.loads(Control(seq=1).to_json())
    assert doc == {"schema": "tf-antman/control", "version": 1, "seq": 1}
    parsed = parse_control(json.dumps(doc))
    assert (parsed.memory_limits, parsed.compute_share, parsed.paused) == ((), None, None)


def test_control_normalizes_integer_share_to_float() -> None:
    parsed = parse_control(json.dumps(control_doc(compute_share=1)))
    assert parsed.compute_share == 1.0 and type(parsed.compute_share) is float
    built = Control(seq=1, compute_share=0, memory_limits=[MemoryLimit(0, 5)])  # type: ignore[arg-type]
    assert type(built.compute_share) is float and built.memory_limits == (MemoryLimit(0, 5),)


def test_stats_round_trip_keeps_every_field() -> None:
    stats = full_stats()
    assert parse_stats(stats.to_json()) == stats


def test_stats_written_by_python_is_plain_json() -> None:
    doc = json.loads(full_stats().to_json())
    assert doc["schema"] == "tf-antman/stats" and doc["version"] == 3
    assert doc["controls_applied_fallback"] == 1 and doc["last_applied_by"] == "fallback"
    assert doc["devices"][1]["limit_bytes"] is None
    assert doc["last_rejected"] == {
        "seq": 10,
        "field": "compute_share",
        "reason": "must be a number in [0.0, 1.0], got 2 (integer)",
    }


BAD_CONTROLS = [
    # (text, field, words the reason must contain)
    ("not json", "$", "invalid JSON"),
    ("", "$", "invalid JSON"),
    ('{"schema": "tf-antman/control", "version": 1, "seq": 7', "$", "invalid JSON"),
    ("[1, 2]", "$", "JSON object"),
    ('"text"', "$", "JSON object"),
    (json.dumps(control_doc(schema="tf-antman/stats")), "schema", "'tf-antman/control'"),
    (json.dumps({"version": 1, "seq": 1}), "schema", "'tf-antman/control'"),
    (json.dumps(control_doc(version=2)), "version", "{1}"),
    (json.dumps(control_doc(version="1")), "version", "{1}"),
    (json.dumps(control_doc(version=True)), "version", "{1}"),
    (json.dumps({"schema": "tf-antman/control", "version": 1}), "seq", f"required (must be an integer in [1, {MAX_SEQ}])"),
    (json.dumps(control_doc(seq=0)), "seq", f"[1, {MAX_SEQ}]"),
    (json.dumps(control_doc(seq=-3)), "seq", f"[1, {MAX_SEQ}]"),
    (json.dumps(control_doc(seq=True)), "seq", "boolean"),
    (json.dumps(control_doc(seq=1.0)), "seq", "integer in"),
    (json.dumps(control_doc(seq=MAX_SEQ + 1)), "seq", f"[1, {MAX_SEQ}]"),
    (json.dumps(control_doc(seq="7")), "seq", "string"),
    (json.dumps(control_doc(seq=None)), "seq", "null"),
    ('{"schema": "tf-antman/control", "version": 1, "seq": 1' + "0" * 30 + "}", "$", "20 digits"),
    (json.dumps(control_doc(compute_share=1.5)), "compute_share", "[0.0, 1.0]"),
    (json.dumps(control_doc(compute_share=-0.01)), "compute_share", "[0.0, 1.0]"),
    (json.dumps(control_doc(compute_share=True)), "compute_share", "boolean"),
    (json.dumps(control_doc(compute_share="0.5")), "compute_share", "[0.0, 1.0]"),
    (json.dumps(control_doc(compute_share=None)), "compute_share", "[0.0, 1.0]"),
    ('{"schema": "tf-antman/control", "version": 1, "seq": 2, "compute_share": NaN}', "$", "NaN"),
    ('{"schema": "tf-antman/control", "version": 1, "seq": 2, "compute_share": Infinity}', "$", "NaN"),
    ('{"schema": "tf-antman/control", "version": 1, "seq": 2, "compute_share": -Infinity}', "$", "NaN"),
    ('{"schema": "tf-antman/control", "version": 1, "seq": 2, "compute_share": 1e999}', "$", "double range"),
    (json.dumps(control_doc(paused=1)), "paused", "true or false"),
    (json.dumps(control_doc(paused="false")), "paused", "true or false"),
    (json.dumps(control_doc(memory_limits={"0": 5})), "memory_limits", "list of at most 64"),
    (json.dumps(control_doc(memory_limits=[{"device": 0}])), "memory_limits[0].limit_bytes", "required"),
    (json.dumps(control_doc(memory_limits=[5])), "memory_limits[0]", "JSON object"),
    (
        json.dumps(control_doc(memory_limits=[{"device": 0, "limit_bytes": MAX_BYTES + 1}])),
        "memory_limits[0].limit_bytes",
        f"[0, {MAX_BYTES}]",
    ),
    (
        json.dumps(control_doc(memory_limits=[{"device": 0, "limit_bytes": -1}])),
        "memory_limits[0].limit_bytes",
        f"[0, {MAX_BYTES}]",
    ),
    (
        json.dumps(control_doc(memory_limits=[{"device": 0, "limit_bytes": True}])),
        "memory_limits[0].limit_bytes",
        "boolean",
    ),
    (
        json.dumps(control_doc(memory_limits=[{"device": 0, "limit_bytes": 2.5e9}])),
        "memory_limits[0].limit_bytes",
        "integer in",
    ),
    (
        json.dumps(control_doc(memory_limits=[{"device": 64, "limit_bytes": 1}])),
        "memory_limits[0].device",
        "[0, 63]",
    ),
    (
        json.dumps(control_doc(memory_limits=[{"device": 1, "limit_bytes": 1}, {"device": 1, "limit_bytes": 2}])),
        "memory_limits[1].device",
        "twice",
    ),
    (
        json.dumps(control_doc(memory_limits=[{"device": 0, "limit_bytes": 1, "unit": "GiB"}])),
        "memory_limits[0].unit",
        "unknown field",
    ),
    (
        json.dumps(control_doc(memory_limits=[{"device": i % 64, "limit_bytes": 1} for i in range(65)])),
        "memory_limits",
        "list of at most 64",
    ),
    (json.dumps(control_doc(colour="blue")), "colour", "unknown field (accepted: schema, version, seq"),
    ('{"schema": "tf-antman/control", "version": 1, "seq": 2, "seq": 3}', "$", "duplicate key 'seq'"),
    ("[" * 30_000 + "]" * 30_000, "$", "nested too deeply"),
    (json.dumps(control_doc(pad="x" * MAX_CONTROL_BYTES)), "$", f"at most {MAX_CONTROL_BYTES}"),
]


@pytest.mark.parametrize(("text", "field", "words"), BAD_CONTROLS)
def test_bad_control_names_field_and_accepted_values(text: str, field: str, words: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_control(text)
    assert caught.value.field == field
    assert words in caught.value.reason
    assert str(caught.value) == f"{field}: {caught.value.reason}"


def test_building_an_invalid_control_is_refused_like_parsing() -> None:
    with pytest.raises(ProtocolError) as caught:
        Control(seq=3, compute_share=True)  # type: ignore[arg-type]
    assert caught.value.field == "compute_share"
    with pytest.raises(ProtocolError) as caught:
        Control(seq=3, memory_limits=(MemoryLimit(0, 1), MemoryLimit(0, 2)))
    assert caught.value.field == "memory_limits[1].device"
    with pytest.raises(ProtocolError) as caught:
        Control(seq=3, memory_limits=((0, 1),))  # type: ignore[arg-type]
    assert caught.value.field == "memory_limits[0]"


def stats_doc(**changes: object) -> str:
    doc = json.loads(full_stats().to_json())
    for path, value in changes.items():
        target = doc
        keys = path.split("__")
        for key in keys[:-1]:
            target = target[int(key)] if isinstance(target, list) else target[key]
        target[keys[-1]] = value
    return json.dumps(doc)


@pytest.mark.parametrize(
    ("text", "field", "words"),
    [
        (stats_doc(state="sleeping"), "state", "starting|running|paused|finished|failed"),
        (stats_doc(pid=0), "pid", "[1, "),
        (stats_doc(step=-1), "step", f"[0, {MAX_SEQ}]"),
        (stats_doc(last_step_ms=-0.5), "last_step_ms", "or null"),
        (stats_doc(step_ms_window=[1.0] * (STEP_WINDOW + 1)), "step_ms_window", f"at most {STEP_WINDOW}"),
        (stats_doc(step_ms_window=[1.0, "2"]), "step_ms_window[1]", "number in"),
        (stats_doc(devices__0__in_use_bytes=-1), "devices[0].in_use_bytes", "[0, "),
        (stats_doc(devices__1__device=0), "devices[1].device", "twice"),
        (stats_doc(devices__0__host_fallbacks=False), "devices[0].host_fallbacks", "boolean"),
        (stats_doc(achieved_share=1.01), "achieved_share", "[0.0, 1.0] or null"),
        (stats_doc(compute_share=None), "compute_share", "[0.0, 1.0]"),
        (stats_doc(last_rejected__reason="x" * 513), "last_rejected.reason", "at most 512"),
        (stats_doc(last_rejected__seq=0), "last_rejected.seq", "or null"),
        (stats_doc(last_rejected__extra=1), "last_rejected.extra", "unknown field"),
        (stats_doc(wall_time=-1), "wall_time", "number in"),
        (stats_doc(schema="tf-antman/control"), "schema", "'tf-antman/stats'"),
    ],
)
def test_bad_stats_names_field(text: str, field: str, words: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_stats(text)
    assert caught.value.field == field
    assert words in caught.value.reason


def test_stats_field_missing_is_named() -> None:
    doc = json.loads(full_stats().to_json())
    del doc["devices"][0]["step_min_bytes"]
    with pytest.raises(ProtocolError) as caught:
        parse_stats(json.dumps(doc))
    assert caught.value.field == "devices[0].step_min_bytes"
    assert caught.value.reason == f"is required (must be an integer in [0, {MAX_BYTES}])"


@pytest.mark.parametrize(
    ("text", "seq"),
    [
        (json.dumps(control_doc(seq=41, compute_share=7)), 41),
        (json.dumps(control_doc(seq=True)), None),
        ('{"seq": 5', None),
        ("[5]", None),
    ],
)
def test_seq_hint_labels_rejections(text: str, seq: int | None) -> None:
    assert seq_hint(text) == seq


@pytest.mark.parametrize("version", [1, 2])
def test_stats_versions_before_the_first_release_are_refused(version: int) -> None:
    # Stats 1 and 2 were never released (0.1.0 writes and reads 3): no compatibility code reads
    # them; the refusal names the field and says what to do.
    doc = json.loads(full_stats().to_json())
    del doc["controls_applied_fallback"], doc["last_applied_by"]
    with pytest.raises(ProtocolError) as err:
        parse_stats(json.dumps({**doc, "version": version}))
    assert err.value.field == "version" and f"must be one of {{3}}, got {version}" in err.value.reason
    assert "same tf-antman release" in err.value.reason
    # Both fields are required in 3.
    with pytest.raises(ProtocolError) as err:
        parse_stats(json.dumps(doc))
    assert err.value.field == "controls_applied_fallback" and "required" in err.value.reason


def test_stats_have_the_terminated_state() -> None:
    # A process ended by SIGTERM (the scheduler's cancel or migration) says so.
    doc = json.loads(full_stats().to_json())
    doc["state"] = "terminated"
    assert parse_stats(json.dumps(doc)).state == "terminated"
    with pytest.raises(ProtocolError) as err:
        parse_stats(json.dumps({**doc, "state": "cancelled"}))
    assert err.value.field == "state" and "finished|failed|terminated" in err.value.reason


def test_a_rejection_is_clipped_to_what_stats_accept() -> None:
    rejection = Rejection.clipped(3, "x" * 1000, "y" * 1000)
    assert (len(rejection.field), len(rejection.reason)) == (MAX_FIELD_CHARS, MAX_REASON_CHARS)
    assert rejection.field.endswith("...") and rejection.reason.endswith("...")
    assert Rejection.clipped(3, "seq", "short") == Rejection(3, "seq", "short")
    parse_stats(Stats(seq=1, pid=1, state="running", step=0, last_rejected=rejection).to_json())


@pytest.mark.parametrize(("change", "field", "accepted"), [
    ({"version": 4}, "version", "{3}"),
    ({"last_applied_by": "boundary"}, "last_applied_by", "start|step|fallback or null"),
    ({"last_applied_by": 1}, "last_applied_by", "start|step|fallback or null"),
    ({"controls_applied_fallback": -1}, "controls_applied_fallback", f"[0, {MAX_SEQ}]"),
    ({"controls_applied_fallback": 5}, "controls_applied_fallback", "at most controls_applied (4)"),
])
def test_stats_v2_fields_are_validated(change: dict[str, object], field: str, accepted: str) -> None:
    doc = json.loads(full_stats().to_json())
    doc.update(change)
    with pytest.raises(ProtocolError) as err:
        parse_stats(json.dumps(doc))
    assert err.value.field == field and accepted in err.value.reason
