"""The daemon's socket: the caller comes from SO_PEERCRED; every argument is checked before a write."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from scheduler_lite import server as server_module
from scheduler_lite.auth import AccessPolicy, Identity, TenantMembers, identity_of_uid
from scheduler_lite.client import ClientError, call_socket
from scheduler_lite.daemon import Daemon
from scheduler_lite.model import JobKind
from scheduler_lite.server import Server, _Pending
from scheduler_lite.storage import JobSpec, JobStatus, MemoryStorage
from scheduler_lite.wire import DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT, MAX_REQUEST_BYTES, short
from tests.scheduler.serving import answering
from tests.scheduler.test_daemon_fakes import make_config

ME = identity_of_uid(os.getuid())
OTHER = Identity(ME.uid + 4242, 100, "someone-else", frozenset({"users"}))


@pytest.fixture
def server(tmp_path: Path) -> Server:
    config = make_config(tmp_path / "state")
    policy = AccessPolicy(os.geteuid(), ME.user, (TenantMembers("A"), TenantMembers("B", users=frozenset({"x"}))))
    return Server(Daemon(config, MemoryStorage()), config, policy)


def submit_args(**changes: Any) -> dict[str, Any]:
    args: dict[str, Any] = {"command": ["/bin/true"], "tenant": "A", "workdir": "/", "env": []}
    args.update(changes)
    return args


@pytest.mark.parametrize(("args", "message"), [
    (submit_args(command="true"), "command 'true' is invalid: accepted a list of 1-4096 strings, the first "
                                  "non-empty, without NUL"),
    (submit_args(command=[]), "command [] is invalid"),
    (submit_args(command=["", "x"]), "command ['', 'x'] is invalid"),
    (submit_args(memory_bytes=10**23), "--memory 100000000000000000000000 is invalid: accepted a size in [1, "),
    (submit_args(gpus=10**20), "--gpus 100000000000000000000 is invalid: accepted an integer in [1, 1]"),
    (submit_args(steps=10**20), "--steps 100000000000000000000 is invalid: accepted an integer in [1, "),
    (submit_args(command=["a\0b"]), "without NUL"),
    (submit_args(workdir="relative"), "workdir 'relative' is invalid: accepted an absolute path"),
    (submit_args(gpus=True), "gpus True is invalid: accepted an integer"),
    (submit_args(gpus=9), "--gpus 9 is invalid: accepted an integer in [1, 1]"),
    (submit_args(duration_s="60"), "--duration '60' is invalid: accepted seconds in (0, "),
    (submit_args(share=True), "--share True is invalid: accepted a fraction of one GPU in (0, 1]"),
    (submit_args(restartable=1), "--restartable 1 is invalid: accepted true or false"),
    (submit_args(env=[["ANTMAN_MEMORY_LIMIT", "1"]]), "--env ANTMAN_MEMORY_LIMIT: set by the scheduler"),
    (submit_args(env=[["SCHEDULER_LITE_JOB_DIR", "/x"]]), "--env SCHEDULER_LITE_JOB_DIR: set by the scheduler"),
    (submit_args(env=[["CUDA_VISIBLE_DEVICES", "3"]]), "--env CUDA_VISIBLE_DEVICES: set by the scheduler"),
    (submit_args(env=[["ANTMAN_NOPE", "1"]]), "--env ANTMAN_NOPE: set by the scheduler"),
    (submit_args(env=[["A B", "1"]]), "not a variable name"),
    (submit_args(env=[["K"]]), "env is invalid: accepted at most 256 [name, value] string pairs"),
    (submit_args(env=[["K", "v\0"]]), "--env K: the value must be a string"),
    (submit_args(session_env={"LD_PRELOAD": "/tmp/x.so"}), "session_env is invalid: accepted an object with keys"),
    (submit_args(uid=0), "argument 'uid' is unknown"),  # the caller is never taken from the request
    (submit_args(user="root"), "argument 'user' is unknown"),
    (submit_args(kind="urgent"), "--type 'urgent' is invalid"),
    (submit_args(memory_bytes=0), "--memory 0 is invalid"),
    (submit_args(name="n" * 300), "name 'nnnn"),
    (submit_args(name="n" * 257), "is invalid: accepted a string of at most 256 characters without control characters"),
    (submit_args(name=7), "name 7 is invalid: accepted a string of at most 256 characters without control"),
    # A name is a column of `list`: a newline or a tab would forge rows, ESC drive the terminal.
    (submit_args(name="evil\nname\tX"), "name 'evil\\nname\\tX' is invalid: accepted a string of at most 256 "
                                         "characters without control characters"),
    (submit_args(name="\x1b[2J"), "name '\\x1b[2J' is invalid"),
    (submit_args(name="abc\u202efdp.exe"), "name 'abc\\u202efdp.exe' is invalid"),  # right-to-left override
    (submit_args(name="a\u2028b"), "name 'a\\u2028b' is invalid"),  # line separator
])
def test_a_refused_submission_names_the_field_and_writes_nothing(server: Server, args: dict[str, Any],
                                                                 message: str) -> None:
    answer = server.handle(ME, "submit", args)
    assert answer["ok"] is False and message in answer["error"], answer
    assert "\n" not in answer["error"]
    assert server.daemon.storage.list_jobs() == []


def test_a_name_may_be_any_printable_text(server: Server) -> None:
    answer = server.handle(ME, "submit", submit_args(name="résumé 漢字 run #3 (lr=0.1)"))
    assert answer["ok"], answer
    record = server.daemon.storage.get_job(answer["result"]["id"])
    assert record is not None and record.name == "résumé 漢字 run #3 (lr=0.1)"


def test_a_command_s_arguments_may_be_empty(server: Server) -> None:
    answer = server.handle(ME, "submit", submit_args(command=["/bin/echo", "a", "", "b"]))
    assert answer["ok"], answer
    record = server.daemon.storage.get_job(answer["result"]["id"])
    assert record is not None and record.command == ("/bin/echo", "a", "", "b")


def test_a_request_the_client_gave_up_on_is_never_carried_out(server: Server,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The client was told "nothing was done": the daemon's thread must then skip the request
    (a retried submit would otherwise run twice); one it already took is answered instead."""
    monkeypatch.setattr(server_module, "ANSWER_TIMEOUT_S", 0.2)
    server.config.state_dir.mkdir(parents=True, exist_ok=True)
    server.start()
    try:
        with pytest.raises(ClientError, match="did not take the request within 0.2 s .busy.: nothing was done"):
            call_socket(server.path, "submit", submit_args())  # the daemon is busy: nobody serves requests
        server.serve_requests(0.3)  # now it serves: the abandoned submit is skipped
        assert server.daemon.storage.list_jobs() == []
    finally:
        server.close()
    taken = _Pending(ME, "submit", {})
    assert taken.claim("taken") and not taken.claim("dropped")


def test_a_tenant_of_others_is_refused_before_anything_else(server: Server) -> None:
    server.policy = AccessPolicy(0, "root", server.policy.members)
    answer = server.handle(OTHER, "submit", submit_args(tenant="B", workdir="/nonexistent"))
    assert answer == {"ok": False, "error": "user 'someone-else' may not submit to tenant 'B'; your tenants: A"}
    assert server.daemon.storage.list_jobs() == []


def test_a_submission_records_the_caller_and_its_session(server: Server) -> None:
    answer = server.handle(ME, "submit", submit_args(env=[["K", "V"]], session_env={"PATH": "/opt/bin:/usr/bin"}))
    assert answer["ok"], answer
    record = server.daemon.storage.get_job(answer["result"]["id"])
    assert record is not None and (record.uid, record.user) == (ME.uid, ME.user)
    assert dict(record.env) == {"K": "V", "PATH": "/opt/bin:/usr/bin"}
    # --env wins over the session's value of the same variable.
    answer = server.handle(ME, "submit", submit_args(env=[["PATH", "/mine"]], session_env={"PATH": "/session"}))
    record = server.daemon.storage.get_job(answer["result"]["id"])
    assert record is not None and dict(record.env) == {"PATH": "/mine"}


def test_other_users_cannot_cancel_or_read_and_cannot_see_env(server: Server) -> None:
    job = server.handle(ME, "submit", submit_args(env=[["TOKEN", "s3cret"]]))["result"]["id"]
    policy = AccessPolicy(0, "root", server.policy.members)  # as a root daemon, serving both
    server.policy = policy
    assert server.handle(OTHER, "cancel", {"jobs": [job]})["error"].startswith("user 'someone-else' may not cancel")
    assert "may not read the logs of" in server.handle(OTHER, "logs", {"job": job})["error"]
    assert server.handle(OTHER, "show", {"job": job})["result"]["job"]["env"] == {"TOKEN": "<hidden>"}
    assert server.handle(ME, "show", {"job": job})["result"]["job"]["env"] == {"TOKEN": "s3cret"}
    record = server.daemon.storage.get_job(job)
    assert record is not None and not record.cancel_requested


@pytest.mark.parametrize(("op", "args", "message"), [
    ("launch", {}, "op 'launch' is unknown"),
    ("list", {"states": ["done"]}, "states is invalid: accepted queued, running"),
    ("logs", {"job": "job-1", "offset": -1}, "no job 'job-1'"),
    ("cancel", {"jobs": "job-1"}, "jobs 'job-1' is invalid"),
    ("status", {"verbose": True}, "argument 'verbose' is unknown: accepted none"),
])
def test_other_ops_check_their_arguments(server: Server, op: str, args: dict[str, Any], message: str) -> None:
    answer = server.handle(ME, op, args)
    assert answer["ok"] is False and message in answer["error"], answer


@pytest.fixture
def listening(server: Server) -> Iterator[Server]:
    with answering(server):
        yield server


def raw(path: Path, data: bytes) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(path))
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        return json.loads(s.makefile("rb").readline())


def test_the_caller_is_the_socket_s_peer(listening: Server) -> None:
    result = call_socket(listening.path, "ping", {})
    assert (result["uid"], result["user"]) == (os.getuid(), ME.user)
    assert oct(listening.path.stat().st_mode & 0o777) == ("0o666" if os.geteuid() == 0 else "0o600")


@pytest.mark.parametrize(("data", "message"), [
    (b"not json\n", "the request is not JSON"),
    (b"[1]\n", "must be a JSON object"),
    (b'{"version": 2, "op": "ping"}\n', "version 2 is not supported: accepted 1"),
    (b'{"version": 1, "op": 3}\n', "op must be a string"),
    (b'{"version": 1, "op": "ping", "args": {}, "pad": "' + b"x" * (MAX_REQUEST_BYTES + 10) + b'"}\n',
     f"larger than {MAX_REQUEST_BYTES} bytes"),
])
def test_malformed_requests_get_one_line(listening: Server, data: bytes, message: str) -> None:
    answer = raw(listening.path, data)
    assert answer["ok"] is False and message in answer["error"]
    assert listening.daemon.storage.list_jobs() == []


def test_a_client_without_a_daemon_gets_one_line(tmp_path: Path) -> None:
    with pytest.raises(ClientError, match="no scheduler-lite daemon is serving .* start it with 'scheduler-lite serve'"):
        call_socket(tmp_path / "scheduler.sock", "ping", {}, state_dir=tmp_path)


def test_close_leaves_a_socket_that_is_no_longer_its_own(server: Server) -> None:
    # A daemon that lost its state directory stops; a daemon started since on the same path
    # must keep its socket.
    server.config.state_dir.mkdir(parents=True, exist_ok=True)
    server.start()
    os.unlink(server.path)
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        other.bind(str(server.path))
        server.close()
        assert server.path.exists()
    finally:
        other.close()
    os.unlink(server.path)
    server.start()
    server.close()
    assert not server.path.exists()  # its own socket it removes


# -- list: pages -----------------------------------------------------------------------------------


def add_jobs(server: Server, n: int) -> list[str]:
    """Jobs put in the store directly (a submission through the socket starts a shell per job)."""
    return [server.daemon.storage.add_job(JobSpec("A", JobKind.AUTO, 1, ("/bin/true",), "/", 0.0, uid=ME.uid)).id
            for _ in range(n)]


def listed(answer: dict[str, Any]) -> tuple[list[str], bool, int, str | None]:
    assert answer["ok"] is True, answer
    page = answer["result"]
    assert set(page) == {"jobs", "more", "remaining", "next_cursor"}
    return [j["id"] for j in page["jobs"]], page["more"], page["remaining"], page["next_cursor"]


def test_list_answers_a_page_and_the_cursor_of_the_next(listening: Server) -> None:
    jobs = add_jobs(listening, 7)
    first = call_socket(listening.path, "list", {"limit": 3})  # through the socket: the wire's fields
    assert first == {"jobs": first["jobs"], "more": True, "remaining": 4, "next_cursor": jobs[4]}
    assert [j["id"] for j in first["jobs"]] == jobs[4:]  # the newest, oldest first
    assert listed(listening.handle(ME, "list", {"limit": 3, "cursor": jobs[4]})) == (jobs[1:4], True, 1, jobs[1])
    assert listed(listening.handle(ME, "list", {"limit": 3, "cursor": jobs[1]})) == (jobs[:1], False, 0, None)
    assert listed(listening.handle(ME, "list", {"limit": 7})) == (jobs, False, 0, None)
    # A cursor without a limit: the default page (DEFAULT_LIST_LIMIT); a null limit is no limit.
    assert listed(listening.handle(ME, "list", {"cursor": jobs[6]})) == (jobs[:6], False, 0, None)
    many = add_jobs(listening, DEFAULT_LIST_LIMIT + 5)
    assert listed(listening.handle(ME, "list", {"limit": None, "cursor": "job-999999"})) == (
        many[5:], True, 12, many[5])


def test_jobs_submitted_between_pages_shift_nothing(server: Server) -> None:
    jobs = add_jobs(server, 6)
    assert listed(server.handle(ME, "list", {"limit": 2})) == (jobs[4:], True, 4, jobs[4])
    newer = add_jobs(server, 3)
    assert listed(server.handle(ME, "list", {"limit": 2, "cursor": jobs[4]})) == (jobs[2:4], True, 2, jobs[2])
    assert listed(server.handle(ME, "list", {"limit": 2, "cursor": jobs[2]})) == (jobs[:2], False, 0, None)
    assert listed(server.handle(ME, "list", {"limit": 2})) == (newer[1:], True, 7, newer[1])


def test_list_pages_only_the_states_asked_for(server: Server) -> None:
    jobs = add_jobs(server, 8)
    for job in jobs[1::2]:  # job-2, 4, 6, 8
        server.daemon.storage.update_job(job, state=JobStatus.FINISHED)
    server.daemon.storage.update_job(jobs[0], state=JobStatus.FAILED)
    ended = ["finished", "failed"]
    assert listed(server.handle(ME, "list", {"states": ["finished"], "limit": 3})) == (
        [jobs[3], jobs[5], jobs[7]], True, 1, jobs[3])
    assert listed(server.handle(ME, "list", {"states": ended, "limit": 3, "cursor": jobs[3]})) == (
        [jobs[0], jobs[1]], False, 0, None)
    assert listed(server.handle(ME, "list", {"states": ["queued"], "limit": 2})) == (
        [jobs[4], jobs[6]], True, 1, jobs[4])


@pytest.mark.parametrize("limit", [0, -1, MAX_LIST_LIMIT + 1, 10**30, True, "10", 2.5, [5], {}])
def test_a_bad_list_limit_is_refused_naming_it_and_the_range(server: Server, limit: Any) -> None:
    add_jobs(server, 2)
    answer = server.handle(ME, "list", {"limit": limit})
    assert answer["ok"] is False, answer
    assert answer["error"] == f"limit {short(limit)} is invalid: accepted an integer in [1, {MAX_LIST_LIMIT}]"


@pytest.mark.parametrize("cursor", ["", "job-0", "job-01", "7", 7, "job-1 ", "job-\u0661", "job-1_0",
                                    "job-99999999999999999999", ["job-1"]])
def test_a_bad_list_cursor_is_refused_naming_it(server: Server, cursor: Any) -> None:
    add_jobs(server, 2)
    answer = server.handle(ME, "list", {"limit": 5, "cursor": cursor})
    assert answer["ok"] is False, answer
    assert answer["error"] == (f"cursor {short(cursor)} is invalid: accepted a job id (job-N), e.g. the next_cursor "
                               "of the previous answer")


def test_a_list_request_from_before_pages_gets_the_list_it_reads_bounded(listening: Server) -> None:
    """A client that sends no limit (or cursor) reads a list of jobs, as before paging: it gets
    one, oldest first, of the newest MAX_LIST_LIMIT jobs (every job ever submitted outgrew an
    answer), never the page object it could not read."""
    jobs = add_jobs(listening, MAX_LIST_LIMIT + 10)
    listening.daemon.storage.update_job(jobs[-1], state=JobStatus.RUNNING)
    for args in ({}, {"states": None}, {"states": None, "limit": None, "cursor": None}):
        old = call_socket(listening.path, "list", args)
        assert isinstance(old, list) and [j["id"] for j in old] == jobs[10:], args
    assert [j["id"] for j in call_socket(listening.path, "list", {"states": ["running"]})] == [jobs[-1]]
    assert len(call_socket(listening.path, "list", {"states": ["queued"]})) == MAX_LIST_LIMIT
    answer = listening.handle(ME, "list", {"offset": 3})
    assert answer["error"] == "argument 'offset' is unknown: accepted states, limit, cursor"


def test_a_page_hides_other_users_env_as_a_list_did(server: Server) -> None:
    server.policy = AccessPolicy(0, "root", server.policy.members)  # as a root daemon, serving both
    server.daemon.storage.add_job(JobSpec("A", JobKind.AUTO, 1, ("/bin/true",), "/", 0.0, env=(("TOKEN", "s"),),
                                          uid=ME.uid))
    assert server.handle(OTHER, "list", {"limit": 1})["result"]["jobs"][0]["env"] == {"TOKEN": "<hidden>"}
    assert server.handle(OTHER, "list", {})["result"][0]["env"] == {"TOKEN": "<hidden>"}
    assert server.handle(ME, "list", {"limit": 1})["result"]["jobs"][0]["env"] == {"TOKEN": "s"}
