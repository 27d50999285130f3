"""Versioned JSON documents of the protocol: `Stats` (job -> coordinator), `Control` (coordinator -> job).

Every accepted range lives here (docs/protocol.md lists the same numbers). Objects can only exist in a
valid state: constructing one runs the same validation as parsing, so a coordinator cannot write a
control file that the job would refuse, and the job cannot report figures the coordinator would refuse.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Final

from tf_antman.protocol.errors import ProtocolError

STATS_SCHEMA: Final = "tf-antman/stats"
CONTROL_SCHEMA: Final = "tf-antman/control"
# Each document has its own version. A reader refuses any version it does not list instead of
# guessing (unknown fields are refused as well, so every change to a document needs a new version).
CONTROL_VERSION: Final = 1
CONTROL_VERSIONS: Final = frozenset({1})
# Stats 3 is the version of the first release (0.1.0); versions 1 and 2 were never released, so
# a reader refuses them like any other version it does not list (docs/protocol.md, "Versioning").
STATS_VERSION: Final = 3
STATS_VERSIONS: Final = frozenset({STATS_VERSION})

MAX_SEQ: Final = 2**53 - 1  # the largest integer that every JSON implementation holds exactly
MAX_COUNT: Final = MAX_SEQ
MAX_BYTES: Final = 2**50  # 1 PiB: far above any device or host, far below int64 overflow
MAX_DEVICE_INDEX: Final = 63
MAX_DEVICES: Final = MAX_DEVICE_INDEX + 1
MAX_PID: Final = 2**22  # Linux PID_MAX_LIMIT
MAX_STEP_MS: Final = 86_400_000.0  # one day
STEP_WINDOW: Final = 32  # training step times kept in stats (the most recent ones)
MAX_WALL_TIME: Final = float(2**33)  # seconds since the epoch (year 2242)
MAX_FIELD_CHARS: Final = 256
MAX_REASON_CHARS: Final = 512
MAX_CONTROL_BYTES: Final = 64 * 1024
MAX_STATS_BYTES: Final = 256 * 1024
MAX_INT_DIGITS: Final = 20  # longer integer literals are refused before Python converts them

# "terminated": the process ended by SIGTERM (the scheduler's cancel or migration sends it), told
# apart from "failed" (an exception or a non-zero exit status).
STATES: Final = ("starting", "running", "paused", "finished", "failed", "terminated")
FINAL_STATES: Final = ("finished", "failed", "terminated")
# Where the last applied control was put into force: at the agent's start, at a step boundary, or
# by the fallback from the agent's own thread when no step boundary came in time.
APPLIED_BY: Final = ("start", "step", "fallback")


@dataclass(frozen=True)
class MemoryLimit:
    """Control entry: the GPU memory limit of one device of the job (device = index within the job)."""

    device: int
    limit_bytes: int


@dataclass(frozen=True)
class Control:
    """A control document. Absent optional fields leave the setting in force unchanged."""

    seq: int
    memory_limits: tuple[MemoryLimit, ...] = ()
    compute_share: float | None = None
    paused: bool | None = None

    def __post_init__(self) -> None:
        _adopt(self, _control_fields(self.to_dict()))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema": CONTROL_SCHEMA, "version": CONTROL_VERSION, "seq": self.seq}
        if self.memory_limits:
            out["memory_limits"] = [
                _entry_dict(entry, MemoryLimit, f"memory_limits[{i}]")
                for i, entry in enumerate(self.memory_limits)
            ]
        if self.compute_share is not None:
            out["compute_share"] = self.compute_share
        if self.paused is not None:
            out["paused"] = self.paused
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), allow_nan=False)

    @classmethod
    def parse(cls, text: str) -> Control:
        return cls(**_control_fields(_load_json(text, MAX_CONTROL_BYTES)))


@dataclass(frozen=True)
class DeviceStats:
    """Stats entry: memory figures of one device of the job, as the allocator reports them.

    step_peak_bytes / step_min_bytes cover the last completed training step (in a final document:
    the time since the last step boundary); limit_bytes is None while no limit is set.
    """

    device: int
    limit_bytes: int | None
    in_use_bytes: int
    reserved_bytes: int
    step_peak_bytes: int
    step_min_bytes: int
    host_in_use_bytes: int
    host_peak_bytes: int
    host_fallbacks: int


@dataclass(frozen=True)
class Rejection:
    """The last control the job refused. seq is None when the file held no readable seq.

    Build one with `Rejection.clipped()` from anything a control file can put in it: field and
    reason echo that file (an unknown key of any length), and stats.json refuses more than
    MAX_FIELD_CHARS / MAX_REASON_CHARS, which would stop every later stats document.
    """

    seq: int | None
    field: str
    reason: str

    @classmethod
    def clipped(cls, seq: int | None, field: str, reason: str) -> Rejection:
        return cls(seq, clip_text(field, MAX_FIELD_CHARS), clip_text(reason, MAX_REASON_CHARS))


_ELLIPSIS: Final = "..."


def clip_text(text: str, max_chars: int) -> str:
    """`text` cut to `max_chars` characters, ending in "..." when it was cut."""
    if len(text) <= max_chars:
        return text
    return text[: max_chars - len(_ELLIPSIS)] + _ELLIPSIS


@dataclass(frozen=True)
class Stats:
    """A stats document, rewritten by the job at step boundaries (rate-limited)."""

    seq: int
    pid: int
    state: str
    step: int
    last_step_ms: float | None = None
    step_ms_window: tuple[float, ...] = ()
    step_ms_mean: float | None = None
    step_ms_median: float | None = None
    devices: tuple[DeviceStats, ...] = ()
    compute_share: float = 1.0
    achieved_share: float | None = None
    control_seq_applied: int = 0
    controls_applied: int = 0
    controls_rejected: int = 0
    last_rejected: Rejection | None = None
    wall_time: float = 0.0
    controls_applied_fallback: int = 0
    last_applied_by: str | None = None

    def __post_init__(self) -> None:
        _adopt(self, _stats_fields(self.to_dict()))

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": STATS_SCHEMA,
            "version": STATS_VERSION,
            "seq": self.seq,
            "pid": self.pid,
            "state": self.state,
            "step": self.step,
            "last_step_ms": self.last_step_ms,
            "step_ms_window": list(self.step_ms_window),
            "step_ms_mean": self.step_ms_mean,
            "step_ms_median": self.step_ms_median,
            "devices": [
                _entry_dict(entry, DeviceStats, f"devices[{i}]") for i, entry in enumerate(self.devices)
            ],
            "compute_share": self.compute_share,
            "achieved_share": self.achieved_share,
            "control_seq_applied": self.control_seq_applied,
            "controls_applied": self.controls_applied,
            "controls_rejected": self.controls_rejected,
            "last_rejected": None
            if self.last_rejected is None
            else _entry_dict(self.last_rejected, Rejection, "last_rejected"),
            "wall_time": self.wall_time,
            "controls_applied_fallback": self.controls_applied_fallback,
            "last_applied_by": self.last_applied_by,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), allow_nan=False)

    @classmethod
    def parse(cls, text: str) -> Stats:
        return cls(**_stats_fields(_load_json(text, MAX_STATS_BYTES)))


def parse_control(text: str) -> Control:
    """Parse and validate control.json text; raises ProtocolError naming the field."""
    return Control.parse(text)


def parse_stats(text: str) -> Stats:
    """Parse and validate stats.json text; raises ProtocolError naming the field."""
    return Stats.parse(text)


def seq_hint(text: str) -> int | None:
    """The seq of a control document that may be invalid otherwise, to label its rejection."""
    try:
        data = _load_json(text, MAX_CONTROL_BYTES)
    except ProtocolError:
        return None
    if isinstance(data, dict):
        seq = data.get("seq")
        if type(seq) is int and 1 <= seq <= MAX_SEQ:
            return seq
    return None


# ---------------------------------------------------------------------------------------------
# Validation. One reader per document; each returns constructor arguments with normalized types.


def _control_fields(data: object) -> dict[str, Any]:
    doc = _Fields(data, "")
    doc.schema(CONTROL_SCHEMA, CONTROL_VERSIONS)
    out: dict[str, Any] = {"seq": doc.int("seq", 1, MAX_SEQ)}
    entries = doc.list("memory_limits", MAX_DEVICES, required=False)
    limits: list[MemoryLimit] = []
    seen: set[int] = set()
    for i, item in enumerate(entries or []):
        entry = _Fields(item, f"memory_limits[{i}]")
        device = entry.int("device", 0, MAX_DEVICE_INDEX)
        if device in seen:
            raise ProtocolError(entry.path("device"), f"device {device} appears twice; give each device once")
        seen.add(device)
        limits.append(MemoryLimit(device=device, limit_bytes=entry.int("limit_bytes", 0, MAX_BYTES)))
        entry.finish()
    out["memory_limits"] = tuple(limits)
    out["compute_share"] = doc.number("compute_share", 0.0, 1.0, required=False)
    out["paused"] = doc.bool("paused", required=False)
    doc.finish()
    return out


def _stats_fields(data: object) -> dict[str, Any]:
    doc = _Fields(data, "")
    doc.schema(STATS_SCHEMA, STATS_VERSIONS)
    out: dict[str, Any] = {
        "seq": doc.int("seq", 1, MAX_SEQ),
        "pid": doc.int("pid", 1, MAX_PID),
        "state": doc.choice("state", STATES),
        "step": doc.int("step", 0, MAX_COUNT),
        "last_step_ms": doc.number("last_step_ms", 0.0, MAX_STEP_MS, nullable=True),
    }
    window = doc.list("step_ms_window", STEP_WINDOW) or []
    out["step_ms_window"] = tuple(
        _number(v, f"step_ms_window[{i}]", 0.0, MAX_STEP_MS) for i, v in enumerate(window)
    )
    out["step_ms_mean"] = doc.number("step_ms_mean", 0.0, MAX_STEP_MS, nullable=True)
    out["step_ms_median"] = doc.number("step_ms_median", 0.0, MAX_STEP_MS, nullable=True)
    devices: list[DeviceStats] = []
    seen: set[int] = set()
    for i, item in enumerate(doc.list("devices", MAX_DEVICES) or []):
        entry = _Fields(item, f"devices[{i}]")
        device = entry.int("device", 0, MAX_DEVICE_INDEX)
        if device in seen:
            raise ProtocolError(entry.path("device"), f"device {device} appears twice; give each device once")
        seen.add(device)
        devices.append(
            DeviceStats(
                device=device,
                limit_bytes=entry.int("limit_bytes", 0, MAX_BYTES, nullable=True),
                in_use_bytes=entry.int("in_use_bytes", 0, MAX_BYTES),
                reserved_bytes=entry.int("reserved_bytes", 0, MAX_BYTES),
                step_peak_bytes=entry.int("step_peak_bytes", 0, MAX_BYTES),
                step_min_bytes=entry.int("step_min_bytes", 0, MAX_BYTES),
                host_in_use_bytes=entry.int("host_in_use_bytes", 0, MAX_BYTES),
                host_peak_bytes=entry.int("host_peak_bytes", 0, MAX_BYTES),
                host_fallbacks=entry.int("host_fallbacks", 0, MAX_COUNT),
            )
        )
        entry.finish()
    out["devices"] = tuple(devices)
    out["compute_share"] = doc.number("compute_share", 0.0, 1.0)
    out["achieved_share"] = doc.number("achieved_share", 0.0, 1.0, nullable=True)
    out["control_seq_applied"] = doc.int("control_seq_applied", 0, MAX_SEQ)
    out["controls_applied"] = doc.int("controls_applied", 0, MAX_COUNT)
    out["controls_rejected"] = doc.int("controls_rejected", 0, MAX_COUNT)
    rejected = doc.object("last_rejected", nullable=True)
    if rejected is None:
        out["last_rejected"] = None
    else:
        out["last_rejected"] = Rejection(
            seq=rejected.int("seq", 1, MAX_SEQ, nullable=True),
            field=rejected.text("field", MAX_FIELD_CHARS),
            reason=rejected.text("reason", MAX_REASON_CHARS),
        )
        rejected.finish()
    out["wall_time"] = doc.number("wall_time", 0.0, MAX_WALL_TIME)
    out["controls_applied_fallback"] = doc.int("controls_applied_fallback", 0, MAX_COUNT)
    out["last_applied_by"] = doc.choice("last_applied_by", APPLIED_BY, nullable=True)
    if out["controls_applied_fallback"] > out["controls_applied"]:
        raise ProtocolError("controls_applied_fallback",
                            f"must be at most controls_applied ({out['controls_applied']}), "
                            f"got {out['controls_applied_fallback']}")
    doc.finish()
    return out


_ABSENT: Final = object()


class _Fields:
    """The members of one JSON object; remembers which were read so that unknown ones are refused."""

    def __init__(self, data: object, path: str) -> None:
        if type(data) is not dict:
            raise ProtocolError(path or "$", f"must be a JSON object, got {_describe(data)}")
        self._data: dict[str, Any] = data
        self._path = path
        self._read: list[str] = []

    def path(self, key: str) -> str:
        return f"{self._path}.{key}" if self._path else key

    def _take(self, key: str, required: bool, nullable: bool, accepted: str) -> Any:
        self._read.append(key)
        if key not in self._data:
            if required:
                raise ProtocolError(self.path(key), f"is required ({accepted})")
            return _ABSENT
        value = self._data[key]
        if value is None and nullable:
            return _ABSENT
        return value

    def schema(self, expected: str, supported: frozenset[int]) -> None:
        schema = self._take("schema", True, False, f"must be {expected!r}")
        if schema != expected:
            raise ProtocolError("schema", f"must be {expected!r}, got {_describe(schema)}")
        versions = ", ".join(str(v) for v in sorted(supported))
        version = self._take("version", True, False, f"must be one of {{{versions}}}")
        if type(version) is not int or version not in supported:
            # An older version comes from a job whose tf-antman predates this reader's: no
            # compatibility is kept for documents no release wrote (docs/protocol.md).
            older = " (older than this reader: run job and scheduler from the same tf-antman release)" \
                if type(version) is int and version < min(supported) else ""
            raise ProtocolError("version", f"must be one of {{{versions}}}, got {_describe(version)}{older}")

    def int(self, key: str, lo: int, hi: int, *, required: bool = True, nullable: bool = False) -> Any:
        value = self._take(key, required, nullable, f"must be an integer in [{lo}, {hi}]")
        return None if value is _ABSENT else _int(value, self.path(key), lo, hi, nullable)

    def number(
        self, key: str, lo: float, hi: float, *, required: bool = True, nullable: bool = False
    ) -> Any:
        value = self._take(key, required, nullable, f"must be a number in [{lo}, {hi}]")
        return None if value is _ABSENT else _number(value, self.path(key), lo, hi, nullable)

    def bool(self, key: str, *, required: bool = True) -> bool | None:
        value = self._take(key, required, False, "must be true or false")
        if value is _ABSENT:
            return None
        if type(value) is not bool:
            raise ProtocolError(self.path(key), f"must be true or false, got {_describe(value)}")
        return value

    def choice(self, key: str, choices: tuple[str, ...], *, nullable: bool = False) -> Any:
        also = " or null" if nullable else ""
        value = self._take(key, True, nullable, f"must be one of {'|'.join(choices)}{also}")
        if value is _ABSENT:
            return None
        if type(value) is not str or value not in choices:
            raise ProtocolError(self.path(key), f"must be one of {'|'.join(choices)}{also}, got {_describe(value)}")
        return value

    def text(self, key: str, max_chars: int) -> str:
        value = self._take(key, True, False, f"must be a string of at most {max_chars} characters")
        if type(value) is not str or len(value) > max_chars:
            raise ProtocolError(
                self.path(key), f"must be a string of at most {max_chars} characters, got {_describe(value)}"
            )
        return value

    def list(self, key: str, max_items: int, *, required: bool = True) -> list[Any] | None:
        value = self._take(key, required, False, f"must be a list of at most {max_items} items")
        if value is _ABSENT:
            return None
        if type(value) is not list or len(value) > max_items:
            raise ProtocolError(
                self.path(key), f"must be a list of at most {max_items} items, got {_describe(value)}"
            )
        return value

    def object(self, key: str, *, nullable: bool = False) -> _Fields | None:
        value = self._take(key, True, nullable, "must be a JSON object" + (" or null" if nullable else ""))
        return None if value is _ABSENT else _Fields(value, self.path(key))

    def finish(self) -> None:
        unknown = sorted(set(self._data) - set(self._read))
        if unknown:
            accepted = ", ".join(self._read)
            # The name is the writer's: quoted and clipped (a 250,000-character key was echoed
            # whole into the daemon's log and store).
            name = unknown[0]
            if not (name.isidentifier() and name.isascii() and len(name) <= 40):
                name = json.dumps(clip_text(name, 40))
            more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
            raise ProtocolError(self.path(name), f"unknown field{more} (accepted: {accepted})")


def _int(value: object, path: str, lo: int, hi: int, nullable: bool = False) -> int:
    if type(value) is not int or not lo <= value <= hi:
        also = " or null" if nullable else ""
        raise ProtocolError(path, f"must be an integer in [{lo}, {hi}]{also}, got {_describe(value)}")
    return value


def _number(value: object, path: str, lo: float, hi: float, nullable: bool = False) -> float:
    # bool is an int subclass in Python but a different type in JSON: refuse it.
    if type(value) not in (int, float) or not lo <= value <= hi:  # NaN fails the comparison
        also = " or null" if nullable else ""
        raise ProtocolError(path, f"must be a number in [{lo}, {hi}]{also}, got {_describe(value)}")
    return float(value)  # type: ignore[arg-type]


def _describe(value: object) -> str:
    if value is _ABSENT:
        return "nothing"
    kind = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "object"}
    text = json.dumps(value) if type(value) in (bool, int, str) or value is None else repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{text} ({kind.get(type(value), type(value).__name__)})" if value is not None else "null"


def _entry_dict(entry: object, kind: type, path: str) -> dict[str, Any]:
    if type(entry) is not kind:
        raise ProtocolError(path, f"must be a {kind.__name__}, got {type(entry).__name__}")
    return dict(entry.__dict__)


def _adopt(obj: object, fields: dict[str, Any]) -> None:
    # Normalized values (1 -> 1.0, list -> tuple) replace what the caller passed.
    for name, value in fields.items():
        object.__setattr__(obj, name, value)


class _BadLiteral(Exception):
    pass


def _parse_int(literal: str) -> int:
    if len(literal.lstrip("-")) > MAX_INT_DIGITS:
        raise _BadLiteral(f"integer literal with more than {MAX_INT_DIGITS} digits")
    return int(literal)


def _parse_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise _BadLiteral(f"number {literal[:40]} is out of the double range")
    return value


def _parse_constant(literal: str) -> float:
    raise _BadLiteral(f"{literal} is not JSON (NaN and infinities are refused)")


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _BadLiteral(f"duplicate key {key[:40]!r}")
        out[key] = value
    return out


def _load_json(text: object, max_bytes: int) -> object:
    if type(text) is not str:
        raise ProtocolError("$", f"must be text, got {type(text).__name__}")
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise ProtocolError("$", f"document is {size} bytes; at most {max_bytes} are accepted")
    try:
        return json.loads(
            text,
            parse_int=_parse_int,
            parse_float=_parse_float,
            parse_constant=_parse_constant,
            object_pairs_hook=_unique_object,
        )
    except _BadLiteral as err:
        raise ProtocolError("$", str(err)) from None
    except json.JSONDecodeError as err:
        raise ProtocolError("$", f"invalid JSON: {err.msg} (line {err.lineno}, column {err.colno})") from None
    except RecursionError:
        raise ProtocolError("$", "nested too deeply") from None
