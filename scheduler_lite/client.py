"""What the CLI calls: one request to the daemon's socket (scheduler_lite.server), one answer.

    result = call(config, "submit", command=[...], tenant="research", workdir="/home/me/run")

The client never opens the store: without a daemon every command but `serve` and `sim` says so.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shlex
import socket
import time
from pathlib import Path
from typing import Any, Final

from scheduler_lite.config import Config
from scheduler_lite.model import JobKind, Role
from scheduler_lite.status import ClusterStatus, GpuStatus, JobOnGpu, TenantStatus
from scheduler_lite.storage import JobRecord, JobStatus
from scheduler_lite.wire import MAX_ANSWER_BYTES, MAX_REQUEST_BYTES, PROTOCOL_VERSION

TIMEOUT_S: Final = 120.0
RETRY_MAX_PAUSE_S: Final = 1.0


class ClientError(Exception):
    """The daemon refused the request, or cannot be reached; the message is one line."""


class AnswerLost(ClientError):
    """The request was sent but no answer came back (the daemon died, or closed the connection):
    it may or may not have been carried out. A submit with a request id can be sent again safely."""


class NoDaemon(ClientError):
    """Nothing listens on the socket: the request was not sent."""


def call(config: Config, op: str, **args: Any) -> Any:
    # The command that starts this config's daemon: a bare `serve` would start one on the default
    # config, in another state directory, and the next command would fail again.
    serve = "scheduler-lite serve" if config.source.startswith("<") else f"scheduler-lite --config {shlex.quote(config.source)} serve"
    return call_socket(config.socket_path, op, args, state_dir=config.state_dir, serve=serve)


def call_socket(path: Path, op: str, args: dict[str, Any], state_dir: Path | None = None,
                serve: str = "scheduler-lite serve") -> Any:
    """One request, one answer. A connection the daemon refused before reading anything (the
    caller's uid had too many open: `"retry": true`) is made again, with growing pauses, for up to
    TIMEOUT_S: a burst of one user's commands is served in turn instead of failing."""
    request = json.dumps({"version": PROTOCOL_VERSION, "op": op, "args": args}).encode() + b"\n"
    if len(request) > MAX_REQUEST_BYTES:
        raise ClientError(f"the request is larger than {MAX_REQUEST_BYTES} bytes (a very long command or --env?)")
    give_up = time.monotonic() + TIMEOUT_S
    pause = 0.02
    while True:
        answer = _exchange(path, request, state_dir, serve)
        if not (answer.get("retry") is True and time.monotonic() + pause < give_up):
            break
        time.sleep(pause * random.uniform(0.5, 1.5))  # jitter: a burst does not come back at once
        pause = min(pause * 2, RETRY_MAX_PAUSE_S)
    if not answer.get("ok"):
        raise ClientError(str(answer.get("error") or "the daemon refused the request"))
    return answer.get("result")


def _exchange(path: Path, request: bytes, state_dir: Path | None, serve: str) -> dict[str, Any]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(TIMEOUT_S)
    try:
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            where = state_dir if state_dir is not None else path.parent
            raise NoDaemon(f"no scheduler-lite daemon is serving {where} (no socket at {path}); start it with "
                           f"'{serve}' (docs/scheduler.md)") from None
        except PermissionError:
            raise ClientError(f"cannot connect to {path}: permission denied (that daemon serves only its own "
                              "user)") from None
        try:
            sock.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before reading the request: its one line is there to read
        data = _read_answer(sock)
    except TimeoutError:
        raise AnswerLost(f"the daemon did not answer within {TIMEOUT_S:.0f} s") from None
    finally:
        sock.close()
    try:
        answer = json.loads(data)
    except ValueError:
        raise ClientError("the daemon's answer is not JSON (is it the same scheduler-lite version?)") from None
    if not isinstance(answer, dict):
        raise ClientError("the daemon refused the request")
    return answer


def _read_answer(sock: socket.socket) -> bytes:
    chunks, size = [], 0
    while True:
        try:
            chunk = sock.recv(1 << 16)
        except ConnectionResetError:
            break  # closed after its line (the line is read first), or without one: said below
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            raise ClientError(f"the daemon's answer is larger than {MAX_ANSWER_BYTES} bytes (the daemon refuses to "
                              "send one: is it the same scheduler-lite version?)")
        if not chunk or chunk.endswith(b"\n"):  # closed, or the whole line
            break
    data = b"".join(chunks)
    if not data:
        raise AnswerLost("the daemon closed the connection without an answer (see its log)")
    if not data.endswith(b"\n"):  # cut off mid-line: the daemon died while sending it
        raise AnswerLost("the daemon closed the connection in the middle of its answer (see its log)")
    return data


# ----------------------------------------------------------------------------------------------
# Answers back into the objects the CLI prints.


def job_record(doc: dict[str, Any]) -> JobRecord:
    fields = {f.name for f in dataclasses.fields(JobRecord)}
    values = {k: v for k, v in doc.items() if k in fields}
    values["kind"] = JobKind(values["kind"])
    values["state"] = JobStatus(values["state"])
    values["role"] = None if values.get("role") is None else Role(values["role"])
    values["command"] = tuple(values["command"])
    values["placement"] = tuple(values.get("placement") or ())
    values["env"] = tuple((doc.get("env") or {}).items())
    return JobRecord(**values)


def cluster_status(doc: dict[str, Any]) -> ClusterStatus:
    gpus = []
    for g in doc["gpus"]:
        jobs = tuple(JobOnGpu(**{**j, "role": Role(j["role"])}) for j in g["jobs"])
        gpus.append(GpuStatus(**{**g, "jobs": jobs}))
    tenants = tuple(TenantStatus(**t) for t in doc["tenants"])
    return ClusterStatus(doc["time"], tuple(gpus), tenants, tuple(doc["queued"]), tuple(doc["running"]),
                         tuple(doc.get("absent_nodes") or ()))  # absent before this field existed


__all__ = ["AnswerLost", "ClientError", "NoDaemon", "call", "call_socket", "cluster_status", "job_record"]
