"""The daemon's Unix socket: every client command goes through it; the daemon is the only writer.

The wire format (one line of JSON each way) and the checks of each argument's type and size are
in scheduler_lite.wire.

The caller is whoever the kernel says is at the other end (SO_PEERCRED): its uid, never a name or
tenant the request carries; scheduler_lite.auth decides what it may do. Every argument is checked
here (types, sizes, the --env allow-list through submission.make_job_spec) before anything is
written: a refused request changes nothing.

Threads: one accepts connections, one per connection reads the request and writes the answer;
the requests themselves run on the daemon's thread, between ticks (`Daemon.serve(between_ticks=
server.serve_requests)`), so the store, the driver and the job directories are touched by one
thread only.

Connections (docs/security.md): at most MAX_CONNECTIONS at once, at most MAX_CONNECTIONS_PER_UID
of them from one uid (the excess is refused at once, with one line), and the whole request line
must arrive within REQUEST_DEADLINE_S of the accept: one user cannot hold every slot.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import logging
import os
import queue
import socket
import struct
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from scheduler_lite.auth import (
    AccessDenied,
    AccessPolicy,
    Identity,
    TenantMembers,
    check_owner,
    check_served,
    check_submit,
    identity_of_uid,
    is_admin,
    tenants_of,
)
from scheduler_lite.config import Config, file_identity
from scheduler_lite.faults import Faults
from scheduler_lite.isolation import SESSION_VARIABLES, IsolationError, job_user
from scheduler_lite.model import JobKind
from scheduler_lite.status import ClusterStatus
from scheduler_lite.storage import JobRecord, JobStatus, StorageError
from scheduler_lite.storage.base import seq_of
from scheduler_lite.submission import SubmitError, make_job_spec, request_cancel, submit_once
from scheduler_lite.wire import (
    DEFAULT_LIST_LIMIT,
    MAX_LIST_LIMIT,
    PROTOCOL_VERSION,
    RequestError,
    checked_value,
    encode_answer,
    integer,
    only,
    pairs,
    parse,
    plain,
    read_line,
    send,
    short,
    string,
    strings,
)
from tf_antman.protocol import ProtocolError

log = logging.getLogger("scheduler_lite")

MAX_LOG_CHUNK: Final = 1 << 20
MAX_LOG_OFFSET: Final = 1 << 62  # a file offset: larger ones overflow a seek
REQUEST_DEADLINE_S: Final = 10.0  # the whole request line, from the accept: a slower client is cut off
ANSWER_TIMEOUT_S: Final = 60.0
MAX_CONNECTIONS: Final = 64
MAX_CONNECTIONS_PER_UID: Final = 8  # one user cannot hold every slot (the excess is refused, not queued)
WORKDIR_CHECK_TIMEOUT_S: Final = 10.0
SHOW_EVENTS: Final = 100  # `show` answers a job's newest events, at most this many
MAX_EVENT_TEXT: Final = 1024  # longer strings in a shown event's detail are cut (a job writes its errors' text)
MAX_COMMAND_WORDS: Final = 4096
MAX_NAME: Final = 256
MAX_JOBS_PER_CANCEL: Final = 1024
REDACTED: Final = "<hidden>"
_PEERCRED: Final = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass
class _Pending:
    who: Identity
    op: str
    args: Mapping[str, Any]
    done: threading.Event = field(default_factory=threading.Event)
    answer: dict[str, Any] | None = None
    # Who got it first: the daemon's thread ("taken") or the connection giving up on it
    # ("dropped"). Under the lock, so a request the client was told failed is never carried out.
    lock: threading.Lock = field(default_factory=threading.Lock)
    claimed: str | None = None

    def claim(self, by: str) -> bool:
        """True if `by` got it first; False: the other side had (the client was told it timed out,
        or the daemon's thread is carrying it out)."""
        with self.lock:
            if self.claimed is None:
                self.claimed = by
            return self.claimed == by


def access_policy(config: Config) -> AccessPolicy:
    """The config's access rules, for a daemon running as this process's user; a tenant the
    config gives no users or groups is open to all."""
    named = {m.tenant: m for m in config.access.members}
    members = tuple(named.get(t.name, TenantMembers(t.name)) for t in config.tenants)
    uid = os.geteuid()
    return AccessPolicy(uid, identity_of_uid(uid).user, members, frozenset(config.access.admins),
                        frozenset(config.access.admin_groups))


# ----------------------------------------------------------------------------------------------


class Server:
    """Listens on `config.socket_path`; `serve_requests(seconds)` answers on the caller's thread."""

    def __init__(self, daemon: Any, config: Config, policy: AccessPolicy | None = None) -> None:
        self.daemon = daemon
        self.config = config
        self.policy = policy or access_policy(config)
        self.path = config.socket_path
        self.snapshot: ClusterStatus | None = None  # the latest status (the metrics endpoint reads it)
        self.findings: tuple[tuple[str, str], ...] = ()  # (job, check) of jobs that do not cooperate, for metrics
        self.contained: bool | None = None  # containment on (None: a host without it)
        # What `status` adds to the snapshot, from the same reads as the copies above.
        self._containment_doc: dict[str, Any] | None = None
        self._warnings: list[str] | None = None
        self._requests: queue.Queue[_Pending] = queue.Queue()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._per_uid: Counter[int] = Counter()  # open connections by the peer's uid
        self._per_uid_lock = threading.Lock()
        self._closed = threading.Event()
        self._sock: socket.socket | None = None
        self._socket_id: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None
        self._faults = Faults()  # the crash tests' "submitted" point (scheduler_lite.faults)
        # Each op: its handler and the arguments it accepts (any other is refused before it runs).
        self._handlers: dict[str, tuple[Callable[[Identity, Mapping[str, Any]], Any], tuple[str, ...]]] = {
            "ping": (self._ping, ()), "cancel": (self._cancel, ("jobs",)), "show": (self._show, ("job",)),
            "submit": (self._submit, ("command", "tenant", "gpus", "kind", "workdir", "env", "session_env",
                                      "memory_bytes", "name", "steps", "duration_s", "share", "restartable",
                                      "request_id")),
            "list": (self._list, ("states", "limit", "cursor")), "status": (self._status, ()),
            "logs": (self._logs, ("job", "stderr", "offset")), "tenants": (self._tenants, ()),
        }

    # -- socket -----------------------------------------------------------------------------------

    def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a stale socket: the state directory lock says no daemon uses it
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(self.path))
        self._socket_id = file_identity(self.path)  # close() unlinks the path only while it is still this socket
        # Anyone may connect when the daemon serves every user; the caller's uid decides the rest.
        os.chmod(self.path, 0o666 if self.policy.multi_user else 0o600)
        sock.listen(256)
        sock.settimeout(0.2)
        self._sock = sock
        self._thread = threading.Thread(target=self._accept, name="scheduler-lite-socket", daemon=True)
        self._thread.start()
        if self.policy.multi_user:
            log.info("serving every local user on %s (jobs run as their submitters)", self.path)
        else:
            log.warning("not running as root: serving only user %r (uid %d) on %s; jobs run as that user and "
                        "are not isolated from the scheduler's files (docs/security.md)",
                        self.policy.daemon_user, self.policy.daemon_uid, self.path)

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(2)
        if self._sock is not None:
            self._sock.close()
        # A daemon that lost its state directory (Daemon.serve stops) must not delete the socket
        # of a daemon started since on the same path.
        if self._socket_id is not None and file_identity(self.path) == self._socket_id:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def _accept(self) -> None:
        assert self._sock is not None
        while not self._closed.is_set():
            # A slot first: beyond MAX_CONNECTIONS, clients wait in the listen backlog (their
            # connect() blocks) instead of being refused.
            if not self._slots.acquire(timeout=0.2):
                continue
            try:
                conn, _ = self._sock.accept()
            except OSError:  # the timeout included
                self._slots.release()
                continue
            accepted = time.monotonic()  # the request's deadline counts from here
            try:
                _, uid, gid = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
            except OSError:
                conn.close()
                self._slots.release()
                continue
            if not self._enter(uid):
                _refuse(conn, uid)
                self._slots.release()
                continue
            try:
                threading.Thread(target=self._connection, args=(conn, uid, gid, accepted), daemon=True).start()
            except RuntimeError:  # no thread to be had: the client is told nothing, its slots are free
                conn.close()
                self._leave(uid)
                self._slots.release()

    def _enter(self, uid: int) -> bool:
        """Count a connection of `uid`; False (nothing counted) when it has MAX_CONNECTIONS_PER_UID open."""
        with self._per_uid_lock:
            if self._per_uid[uid] >= MAX_CONNECTIONS_PER_UID:
                return False
            self._per_uid[uid] += 1
            return True

    def _leave(self, uid: int) -> None:
        with self._per_uid_lock:
            self._per_uid -= Counter({uid: 1})  # in place; a uid at 0 goes

    def _connection(self, conn: socket.socket, uid: int, gid: int, accepted: float) -> None:
        try:
            try:
                op, args = parse(read_line(conn, REQUEST_DEADLINE_S, since=accepted))
            except RequestError as e:
                conn.settimeout(1.0)  # one short line; a client that reads nothing does not hold the slot
                send(conn, {"ok": False, "error": str(e)})
                return
            # Not what was left of the request's deadline: each answer's whole send (sendall's timeout is its total).
            conn.settimeout(ANSWER_TIMEOUT_S)
            pending = _Pending(identity_of_uid(uid, gid), op, args)
            self._requests.put(pending)
            if not pending.done.wait(ANSWER_TIMEOUT_S):
                if pending.claim("dropped"):
                    send(conn, {"ok": False, "error": f"the daemon did not take the request within "
                                f"{ANSWER_TIMEOUT_S:g} s (busy): nothing was done, try again"})
                    return
                # Being carried out: a submit's answer names the job, which a retry would duplicate.
                if not pending.done.wait(ANSWER_TIMEOUT_S):
                    send(conn, {"ok": False, "error": "the daemon did not finish the request in time: it may "
                                "still take effect (check with `scheduler-lite list`)"})
                    return
            assert pending.answer is not None
            send(conn, encode_answer(pending.answer, op))
        except OSError:
            pass  # the client went away
        finally:
            conn.close()
            self._leave(uid)
            self._slots.release()

    # -- the daemon's thread ----------------------------------------------------------------------

    def serve_requests(self, seconds: float) -> None:
        """Answer requests for `seconds` (the pause between two ticks); publishes a status snapshot first."""
        deadline = time.monotonic() + seconds
        self.refresh_snapshot()
        while not self.daemon.stopping:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                pending = self._requests.get(timeout=min(left, 0.1))
            except queue.Empty:
                continue
            if not pending.claim("taken"):
                continue  # its client was told that nothing was done
            pending.answer = self.handle(pending.who, pending.op, pending.args)
            pending.done.set()

    def refresh_snapshot(self) -> ClusterStatus:
        self.snapshot = self.daemon.status()
        findings = self.daemon.host.findings()  # jobs that do not cooperate (misbehaviour)
        containment = self.daemon.host.containment
        # Copied here, on the daemon's thread: the metrics thread reads only these copies.
        self.findings = tuple((f.job_id or "", f.kind) for f in findings or ())
        self.contained = None if containment is None else containment.active
        self._containment_doc = (None if containment is None
                                 else {"active": containment.active, "detail": containment.detail})
        self._warnings = None if findings is None else [f.line() for f in findings]
        return self.snapshot

    def handle(self, who: Identity, op: str, args: Mapping[str, Any]) -> dict[str, Any]:
        """One request, as `who`: the answer document (never raises)."""
        if op not in self._handlers:
            return {"ok": False, "error": f"op {op!r} is unknown: accepted " + ", ".join(sorted(self._handlers))}
        handler, accepted = self._handlers[op]
        try:
            check_served(self.policy, who)
            only(args, accepted)
            return {"ok": True, "result": handler(who, args)}
        except (AccessDenied, RequestError, SubmitError, StorageError, ProtocolError, IsolationError) as e:
            if isinstance(e, AccessDenied):
                log.warning("refused %s from %s (uid %d): %s", op, who.user, who.uid, e)
            return {"ok": False, "error": str(e)}
        except Exception as e:  # noqa: BLE001 - a bad request must not take the daemon down
            log.exception("%s from %s failed", op, who.user)
            return {"ok": False, "error": f"internal error in {op}: {e!r} (see the daemon's log)"}

    # -- ops --------------------------------------------------------------------------------------

    def _ping(self, who: Identity, args: Mapping[str, Any]) -> Any:
        return {"user": who.user, "uid": who.uid, "admin": is_admin(self.policy, who),
                "tenants": list(tenants_of(self.policy, who)), "daemon_user": self.policy.daemon_user,
                "multi_user": self.policy.multi_user, "version": PROTOCOL_VERSION}

    def _submit(self, who: Identity, args: Mapping[str, Any]) -> Any:
        command = strings(args, "command", MAX_COMMAND_WORDS, required=True, empty_after_first=True)
        tenant = string(args, "tenant", MAX_NAME)
        gpus = integer(args, "gpus", default=1)
        kind = string(args, "kind", 32) or str(JobKind.AUTO)
        workdir = string(args, "workdir", 4096, required=True) or ""
        if not os.path.isabs(workdir):
            raise RequestError(f"workdir {workdir!r} is invalid: accepted an absolute path")
        env = pairs(args, "env")
        session = args.get("session_env", {})
        if not isinstance(session, dict) or not all(k in SESSION_VARIABLES for k in session):
            raise RequestError("session_env is invalid: accepted an object with keys among " + ", ".join(SESSION_VARIABLES))
        memory = integer(args, "memory_bytes")
        name = string(args, "name", MAX_NAME, label=True) or ""
        steps = integer(args, "steps")
        request_id = string(args, "request_id", 64)  # its form: make_job_spec
        chosen = check_submit(self.policy, who, tenant)
        # The session's variables that --env does not set are recorded with the job (and count
        # towards its size limit, in make_job_spec).
        given = {k for k, _ in env}
        env = env + [(k, checked_value(k, v)) for k, v in session.items() if k not in given]
        # Resolved by the submitter's own shell, as the submitter: the daemon (root) never looks
        # at the path itself, so what it stores and answers (where a link or `..` leads, whether
        # something exists) is only what the submitter can see anyway.
        physical = resolve_workdir(who, workdir)
        # The --env allow-list, every range, duration_s's, share's and restartable's types: as the library's.
        spec = make_job_spec(self.config, command, tenant=chosen, gpus=gpus, kind=kind, workdir=physical,
                             workdir_resolved=True, env=env, memory_bytes=memory, name=name, expected_steps=steps,
                             expected_duration_s=args.get("duration_s"), requested_share=args.get("share"),
                             restartable=args.get("restartable", False), now=self.daemon.clock(), request_id=request_id)
        spec = dataclasses.replace(spec, uid=who.uid, user=who.user)
        record, new = submit_once(self.daemon.storage, spec)
        if new:
            log.info("%s submitted by %s (uid %d) to tenant %s", record.id, who.user, who.uid, record.tenant)
        else:
            log.info("%s: a retried submit by %s (uid %d), request id %r, answered with the job recorded the "
                     "first time", record.id, who.user, who.uid, request_id)
        # Committed: a crash from here on loses only the answer (the client's retry finds the job).
        self._faults.at("submitted")
        return {"id": record.id, "job": job_dict(record, who, self.policy), "repeated": not new}

    def _cancel(self, who: Identity, args: Mapping[str, Any]) -> Any:
        ids = strings(args, "jobs", MAX_JOBS_PER_CANCEL, required=True)
        records = [self._job(job_id) for job_id in ids]
        for record in records:  # all are checked before any is touched: a refusal changes nothing
            check_owner(self.policy, who, "cancel", record.id, record.uid, record.user)
        out = []
        for record in records:
            after = request_cancel(self.daemon.storage, record.id, self.daemon.clock())
            if after.state.done:
                note = f"already {after.state}"
            else:  # a second cancel does not restart the grace: say that it is under way
                note = "cancel already requested" if record.cancel_requested else "cancel requested"
            out.append({"id": record.id, "state": str(after.state), "result": note})
        return out

    def _list(self, who: Identity, args: Mapping[str, Any]) -> Any:
        states = strings(args, "states", 8)
        try:
            wanted = None if states is None else [JobStatus(s) for s in states]
        except ValueError:
            raise RequestError("states is invalid: accepted " + ", ".join(s.value for s in JobStatus)) from None
        limit = integer(args, "limit", within=(1, MAX_LIST_LIMIT))
        cursor = args.get("cursor")
        if cursor is not None:
            try:
                seq_of(cursor)
            except StorageError:
                raise RequestError(f"cursor {short(cursor)} is invalid: accepted a job id (job-N), e.g. the "
                                   "next_cursor of the previous answer") from None
        storage = self.daemon.storage
        if limit is None and cursor is None:
            # A client from before paging: the answer it reads, a list, but bounded (the newest
            # MAX_LIST_LIMIT jobs): every job ever submitted outgrew an answer on a busy machine.
            return [job_dict(r, who, self.policy) for r in storage.jobs_page(MAX_LIST_LIMIT, None, wanted).jobs]
        page = storage.jobs_page(limit or DEFAULT_LIST_LIMIT, cursor, wanted)
        return {"jobs": [job_dict(r, who, self.policy) for r in page.jobs], "more": page.more,
                "remaining": page.remaining, "next_cursor": page.next_cursor}

    def _show(self, who: Identity, args: Mapping[str, Any]) -> Any:
        record = self._job(string(args, "job", MAX_NAME, required=True) or "")
        storage = self.daemon.storage
        events, older = storage.newest_events(record.id, SHOW_EVENTS)
        return {"job": job_dict(record, who, self.policy),
                "placements": [dataclasses.asdict(p) for p in storage.placements(record.id)],
                "events": [_shortened(dataclasses.asdict(e)) for e in events],
                "older_events_omitted": older}  # a count (older daemons: a boolean)

    def _status(self, who: Identity, args: Mapping[str, Any]) -> Any:
        doc = plain(self.refresh_snapshot())
        # How the jobs are contained (cgroups), or why they are not: a host without cgroups says nothing.
        if self._containment_doc is not None:
            doc["containment"] = self._containment_doc
        if self._warnings is not None:  # jobs that do not cooperate
            doc["warnings"] = self._warnings
        return doc

    def _tenants(self, who: Identity, args: Mapping[str, Any]) -> Any:
        return [dataclasses.asdict(t) for t in self.refresh_snapshot().tenants]

    def _logs(self, who: Identity, args: Mapping[str, Any]) -> Any:
        record = self._job(string(args, "job", MAX_NAME, required=True) or "")
        check_owner(self.policy, who, "read the logs of", record.id, record.uid, record.user)
        stderr = args.get("stderr", False)
        if not isinstance(stderr, bool):
            raise RequestError(f"stderr {stderr!r} is invalid: accepted true or false")
        offset = integer(args, "offset", default=0, within=(0, MAX_LOG_OFFSET))
        if not record.job_dir:
            return {"data": "", "offset": offset, "done": record.state.done, "started": False,
                    "state": str(record.state)}
        try:
            data, offset = self.daemon.host.read_log(record, stderr, offset, MAX_LOG_CHUNK)  # on its node in a cluster
        except IsolationError:
            raise
        except OSError as e:  # in cluster mode: the job's node is not connected
            raise RequestError(f"cannot read the log of {record.id}: {e}") from None
        return {"data": base64.b64encode(data).decode(), "offset": offset, "done": record.state.done,
                "started": True, "state": str(record.state)}

    def _job(self, job_id: str) -> JobRecord:
        record = self.daemon.storage.get_job(job_id)
        if record is None:
            raise RequestError(f"no job {job_id!r} (see 'scheduler-lite list')")
        return record


# ----------------------------------------------------------------------------------------------
# Request checking.


def resolve_workdir(who: Identity, workdir: str) -> str:
    """The physical path of `workdir` as the submitter resolves it: `cd -P -- "$1" && pwd -P` run
    as the submitter (uid, gid, groups). `-P` matters: a logical `cd` removes `a/..` as text, so
    `private/link/../..` would be entered without ever searching `private`, and root resolving the
    same string afterwards would follow `link` where the submitter cannot. The answer is the same
    whether an unreachable path exists or not, and names only the path given."""
    user = job_user(who.uid)  # None: the daemon's own user, the probe runs as that user
    as_user: dict[str, Any] = {} if user is None else {"user": user.uid, "group": user.gid,
                                                       "extra_groups": list(user.gids)}
    refused = RequestError(f"--workdir {workdir!r}: user {who.user!r} cannot enter it (accepted a directory the "
                           "submitter can search, and every directory above it)")
    try:
        probe = subprocess.run(["/bin/sh", "-c", 'cd -P -- "$1" && pwd -P', "scheduler-lite-workdir-check", workdir],
                               cwd="/", env={}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, timeout=WORKDIR_CHECK_TIMEOUT_S, check=False, **as_user)
    except subprocess.TimeoutExpired:
        raise refused from None
    out = probe.stdout
    if probe.returncode != 0 or not out.startswith(b"/") or not out.endswith(b"\n"):
        raise refused
    try:
        return out[:-1].decode()  # only pwd's newline: a directory's name may end with one
    except UnicodeDecodeError:
        raise RequestError(f"--workdir {workdir!r}: its physical path is not UTF-8: accepted a directory whose "
                           "path is UTF-8 text") from None


def _shortened(value: Any) -> Any:
    """An event's detail with its long strings cut (a stats error quotes what the job wrote)."""
    if isinstance(value, str) and len(value) > MAX_EVENT_TEXT:
        return f"{value[:MAX_EVENT_TEXT]}... ({len(value) - MAX_EVENT_TEXT} more characters)"
    if isinstance(value, dict):
        return {k: _shortened(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shortened(v) for v in value]
    return value


def _refuse(conn: socket.socket, uid: int) -> None:
    """The connection over its uid's limit: one line (nothing was read, a retry is safe), closed."""
    with contextlib.suppress(OSError):
        conn.settimeout(1.0)
        send(conn, {"ok": False, "retry": True,
                    "error": f"uid {uid} has {MAX_CONNECTIONS_PER_UID} connections to the daemon open: accepted at "
                             f"most {MAX_CONNECTIONS_PER_UID} at once per user; nothing was done, try again when "
                             "one has closed"})
    conn.close()


# ----------------------------------------------------------------------------------------------
# Answers.


def job_dict(record: JobRecord, who: Identity, policy: AccessPolicy) -> dict[str, Any]:
    """A job as a client sees it: another user's --env values are hidden (they may hold secrets)."""
    out = plain(record)
    owner = policy.daemon_uid if record.uid is None else record.uid  # library submissions: the daemon's user
    mine = is_admin(policy, who) or owner == who.uid
    out["env"] = {k: (v if mine else REDACTED) for k, v in record.env}
    return out


__all__ = ["Server", "access_policy", "job_dict"]
