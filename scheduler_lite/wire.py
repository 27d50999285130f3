"""The daemon socket's wire format, and the checks of a request's arguments (scheduler_lite.server).

Wire format (version 1): the client sends one line of JSON, at most `MAX_REQUEST_BYTES`,
`{"version": 1, "op": OP, "args": {...}}`, and reads one line back: `{"ok": true, "result": ...}`
or `{"ok": false, "error": "<one line>"}` (with `"retry": true` when nothing was read and the
client may simply connect again: the caller's uid had too many connections open). An answer is at
most `MAX_ANSWER_BYTES`: a larger one is replaced by an error saying so. Ops: ping, submit, cancel,
list, show, status, logs, tenants (docs/scheduler.md, "Clients and the socket").

`list` is paged (added within version 1): with `limit` (1..MAX_LIST_LIMIT) or `cursor` (a job id,
a previous answer's `next_cursor`) its answer is `{"jobs": [...], "more", "remaining",
"next_cursor"}`: the newest `limit` (default DEFAULT_LIST_LIMIT) matching jobs older than the
cursor, oldest first. A request with neither, as clients before paging send, is answered as it
was, a list of jobs, but only the newest MAX_LIST_LIMIT of them.

`submit` takes `request_id` (added within version 1; 1-64 of A-Z a-z 0-9 _ . : -): the store
records one job per request id and submitter, so a submit sent again after its answer was lost
(the daemon died after committing it) is answered with the job recorded the first time, marked
`"repeated": true`; the same id with a different submission is refused. The CLI sends a new
random id with each submit and retries with it while the answer is lost (scheduler_lite.cli).

A malformed or out-of-range argument raises `RequestError`, whose message names the field and
what is accepted; the server answers it as the request's one-line error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import socket
import time
import unicodedata
from collections.abc import Mapping
from typing import Any, Final

PROTOCOL_VERSION: Final = 1
MAX_REQUEST_BYTES: Final = 1 << 20
# The largest answer a client reads (and the daemon sends): a larger one is answered with an
# error instead, never cut short.
MAX_ANSWER_BYTES: Final = 64 << 20
# The most jobs one `list` answer carries. The largest job a user can make takes about 120 KB of
# answer (64 KiB of command and --env in control characters, 6 bytes each as JSON, a 4 KiB
# workdir of them and a failure reason quoting it, a 256-character name): 200 of them take 24 MB,
# so no page comes near MAX_ANSWER_BYTES (tests/scheduler/test_security_answers.py).
MAX_LIST_LIMIT: Final = 200
DEFAULT_LIST_LIMIT: Final = 50  # a page without `limit`; the CLI's default too
MAX_STRING: Final = 65536
MAX_ENV_PAIRS: Final = 256
# Unicode categories refused in a job's name (and escaped by the CLI's tables): control (Cc:
# newline, tab, ESC), format (Cf: the right-to-left override), lone surrogates (Cs), line and
# paragraph separators (Zl, Zp).
UNPRINTABLE: Final = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


class RequestError(ValueError):
    """A malformed or out-of-range request; the message names the field and what is accepted."""


# ----------------------------------------------------------------------------------------------
# Request checking.


def parse(line: bytes) -> tuple[str, Mapping[str, Any]]:
    try:
        doc = json.loads(line)
    except (ValueError, RecursionError):
        raise RequestError("the request is not JSON (one line: {\"version\": 1, \"op\": ..., \"args\": {...}})") from None
    if not isinstance(doc, dict):
        raise RequestError("the request must be a JSON object")
    if doc.get("version") != PROTOCOL_VERSION:
        raise RequestError(f"version {doc.get('version')!r} is not supported: accepted {PROTOCOL_VERSION} "
                           "(the client and the daemon must come from the same scheduler-lite)")
    op, args = doc.get("op"), doc.get("args", {})
    if not isinstance(op, str) or not isinstance(args, dict):
        raise RequestError("op must be a string and args an object")
    return op, args


def read_line(conn: socket.socket, deadline_s: float, since: float) -> bytes:
    """The request line, all of it arrived `deadline_s` seconds after `since` (a `time.monotonic()`):
    a client that trickles a byte at a time is cut off there, not only one that stops sending (a
    per-recv timeout alone never fires for it)."""
    late = RequestError(f"the request did not arrive within {deadline_s:g} s of connecting: accepted one line "
                        "sent at once; the connection is closed")
    chunks, size = [], 0
    while True:
        left = since + deadline_s - time.monotonic()
        if left <= 0:
            raise late
        conn.settimeout(left)
        try:
            chunk = conn.recv(65536)
        except TimeoutError:
            raise late from None
        chunks.append(chunk)
        size += len(chunk)
        if not chunk or b"\n" in chunk or size > MAX_REQUEST_BYTES:  # closed, a line, or more than one can be
            break
    line = b"".join(chunks).split(b"\n", 1)[0]
    if len(line) > MAX_REQUEST_BYTES:
        raise RequestError(f"the request is larger than {MAX_REQUEST_BYTES} bytes")
    return line


def encode_answer(doc: Mapping[str, Any], op: str) -> bytes:
    """The answer's line; one larger than MAX_ANSWER_BYTES becomes a one-line error saying so
    (a client would otherwise read a truncated document)."""
    data = json.dumps(doc).encode() + b"\n"
    if len(data) <= MAX_ANSWER_BYTES:
        return data
    hint = " (e.g. `scheduler-lite list --limit 10`)" if op == "list" else ""
    return json.dumps({"ok": False, "error": f"the answer to {op} is {len(data)} bytes: accepted at most "
                                             f"{MAX_ANSWER_BYTES} bytes per answer; ask for less{hint}"}).encode() + b"\n"


def send(conn: socket.socket, doc: Mapping[str, Any] | bytes) -> None:
    with contextlib.suppress(OSError):
        conn.sendall(doc if isinstance(doc, bytes) else json.dumps(doc).encode() + b"\n")


def only(args: Mapping[str, Any], accepted: tuple[str, ...]) -> None:
    unknown = sorted(set(args) - set(accepted))
    if unknown:
        raise RequestError(f"argument {unknown[0]!r} is unknown: accepted " + (", ".join(accepted) or "none"))


def string(args: Mapping[str, Any], key: str, max_len: int, required: bool = False,
           label: bool = False) -> str | None:
    """A string without NUL; a `label` (shown in `list`'s columns) without any control character:
    a newline or a tab would forge a row, ESC drive the reader's terminal. The CLI escapes them in
    any cell too, for the commands, which may hold them legitimately, and for jobs stored before
    this check. One message for each field's every refusal (NUL is a control character too)."""
    value = args.get(key)
    if value is None and not required:
        return None
    if (not isinstance(value, str) or not value and required or len(value) > max_len
            or (any(unicodedata.category(c) in UNPRINTABLE for c in value) if label else "\0" in value)):
        rule = "control characters (newline, tab, escape, bidirectional overrides...)" if label else "NUL"
        raise RequestError(f"{key} {short(value)} is invalid: accepted a string of at most {max_len} characters "
                           f"without {rule}" + (" (required)" if required else ""))
    return value


def strings(args: Mapping[str, Any], key: str, max_items: int, required: bool = False,
            empty_after_first: bool = False) -> list[str] | None:
    """A list of strings; `empty_after_first`: a command's arguments may be "" (its program not)."""
    value = args.get(key)
    if value is None and not required:
        return None
    ok = isinstance(value, list) and 0 < len(value) <= max_items and all(
        isinstance(v, str) and (v or (empty_after_first and i > 0)) and len(v) <= MAX_STRING and "\0" not in v
        for i, v in enumerate(value))
    if not ok:
        what = "strings, the first non-empty," if empty_after_first else "non-empty strings"
        raise RequestError(f"{key} {short(value)} is invalid: accepted a list of 1-{max_items} {what} without NUL")
    return list(value)  # type: ignore[arg-type]


def integer(args: Mapping[str, Any], key: str, default: int | None = None,
            within: tuple[int, int] | None = None) -> Any:
    """An optional integer, in [low, high] when `within` (one message for a wrong type and a wrong
    value); without `within`, its range is the caller's to check, with the user's name for the field."""
    value = args.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or (within and not within[0] <= value <= within[1]):
        accepted = "an integer" if within is None else f"an integer in [{within[0]}, {within[1]}]"
        raise RequestError(f"{key} {short(value)} is invalid: accepted {accepted}")
    return value


def pairs(args: Mapping[str, Any], key: str) -> list[tuple[str, str]]:
    value = args.get(key, [])
    ok = isinstance(value, list) and len(value) <= MAX_ENV_PAIRS and all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in value)
    if not ok:
        raise RequestError(f"{key} is invalid: accepted at most {MAX_ENV_PAIRS} [name, value] string pairs")
    return [(k, checked_value(k, v)) for k, v in value]


def checked_value(key: str, value: object) -> str:
    if not isinstance(value, str) or len(value) > MAX_STRING or "\0" in value:
        raise RequestError(f"--env {key}: the value must be a string of at most {MAX_STRING} characters without NUL")
    return value


def short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ----------------------------------------------------------------------------------------------
# Answers.


def plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value
