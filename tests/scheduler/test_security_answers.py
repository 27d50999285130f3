"""Answers stay bounded whatever one user submits or one job writes (docs/security.md).

A submission's command and environment are at most MAX_SUBMISSION_BYTES (75 submissions of
~1 MiB each made every `list` larger than a client reads, for everyone); `show` answers a job's
newest SHOW_EVENTS events with long strings cut (a job writing a new bad stats.json every 0.1 s
made one `show` over 64 MiB); an answer larger than MAX_ANSWER_BYTES becomes a one-line error.
"""

from __future__ import annotations

import json
import os
import random
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from scheduler_lite import client as client_module
from scheduler_lite import server as server_module
from scheduler_lite import wire as wire_module
from scheduler_lite.auth import AccessPolicy, TenantMembers, identity_of_uid
from scheduler_lite.client import ClientError, call_socket
from scheduler_lite.daemon import Daemon
from scheduler_lite.model import JobKind
from scheduler_lite.server import MAX_EVENT_TEXT, SHOW_EVENTS, Server
from scheduler_lite.storage import JobSpec, MemoryStorage, SqliteStorage
from scheduler_lite.submission import MAX_SUBMISSION_BYTES, SubmitError, make_job_spec, submission_bytes
from scheduler_lite.wire import MAX_LIST_LIMIT, encode_answer
from tests.scheduler.test_daemon_fakes import make_config
from tests.scheduler.test_security_connections import listening

ME = identity_of_uid(os.getuid())


@pytest.fixture
def server(tmp_path: Path) -> Server:
    config = make_config(tmp_path / "state")
    policy = AccessPolicy(os.geteuid(), ME.user, (TenantMembers("A"),))
    return Server(Daemon(config, MemoryStorage()), config, policy)


def submit_args(**changes: Any) -> dict[str, Any]:
    args: dict[str, Any] = {"command": ["/bin/true"], "tenant": "A", "workdir": "/", "env": []}
    args.update(changes)
    return args


# -- the size of a submission --------------------------------------------------------------------


@pytest.mark.parametrize("args", [
    submit_args(command=["/bin/true"] + ["A" * 65000] * 15),  # the reviewer's submission, ~1 MiB
    submit_args(command=["/bin/true", "A" * 40000], env=[["K", "B" * 30000]]),  # together over
    submit_args(command=["/bin/true", "A" * 40000], session_env={"PATH": "/bin:" + "C" * 30000}),  # session too
    submit_args(command=["/bin/true", "\x01" * 12000]),  # 12,000 characters, 72,000 bytes as JSON
])
def test_a_submission_over_the_size_limit_is_refused_naming_it(server: Server, args: dict[str, Any]) -> None:
    answer = server.handle(ME, "submit", args)
    assert answer["ok"] is False
    assert answer["error"].startswith("the command and --env take "), answer
    assert f"bytes: accepted at most {MAX_SUBMISSION_BYTES} bytes together" in answer["error"]
    assert server.daemon.storage.list_jobs() == []


def test_a_submission_just_under_the_limit_is_accepted(server: Server) -> None:
    overhead = len(json.dumps(["/bin/true", ""])) + len(json.dumps([["K", ""]]))
    room = MAX_SUBMISSION_BYTES - overhead
    answer = server.handle(ME, "submit", submit_args(command=["/bin/true", "A" * (room - 10)], env=[["K", "B" * 10]]))
    assert answer["ok"], answer
    with pytest.raises(SubmitError, match=f"take {MAX_SUBMISSION_BYTES + 1} bytes"):  # the library's too
        make_job_spec(server.config, ["/bin/true", "A" * (room + 1)], tenant="A", workdir="/", env={"K": ""})


# -- show: the newest events ---------------------------------------------------------------------


def test_show_answers_the_newest_events_and_says_older_ones_were_left_out(server: Server) -> None:
    job = server.handle(ME, "submit", submit_args())["result"]["id"]
    other = server.handle(ME, "submit", submit_args())["result"]["id"]
    storage = server.daemon.storage
    for i in range(3 * SHOW_EVENTS):
        storage.add_event(float(i), "stats_error", job, error=f"bad stats {i}")
        storage.add_event(float(i), "stats_error", other, error="unrelated")
    shown = server.handle(ME, "show", {"job": job})["result"]
    assert [e["detail"]["error"] for e in shown["events"]] == [f"bad stats {i}" for i in range(2 * SHOW_EVENTS,
                                                                                             3 * SHOW_EVENTS)]
    assert shown["older_events_omitted"] == 2 * SHOW_EVENTS + 1  # with "submitted"
    few = server.handle(ME, "submit", submit_args())["result"]["id"]
    shown = server.handle(ME, "show", {"job": few})["result"]
    assert [e["kind"] for e in shown["events"]] == ["submitted"] and shown["older_events_omitted"] == 0


def test_show_cuts_the_long_strings_a_job_wrote(server: Server) -> None:
    """A stats error quotes the job's unknown key: 250,000 characters per event in the review."""
    job = server.handle(ME, "submit", submit_args())["result"]["id"]
    server.daemon.storage.add_event(1.0, "stats_error", job, error="$.k" + "x" * 250_000)
    event = server.handle(ME, "show", {"job": job})["result"]["events"][-1]
    assert event["detail"]["error"] == "$.k" + "x" * (MAX_EVENT_TEXT - 3) + "... (248979 more characters)"
    stored = server.daemon.storage.events(job)[-1]
    assert len(stored.detail["error"]) == 250_003  # the store keeps it whole


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kind", ["sqlite", "memory"])
def test_newest_events_agrees_with_reading_them_all(tmp_path: Path, seed: int, kind: str) -> None:
    """The store's tail query against the obvious answer, with other jobs' events interleaved."""
    rng = random.Random(seed)
    storage = SqliteStorage(tmp_path / "s.db") if kind == "sqlite" else MemoryStorage()
    jobs = ["job-1", "job-2", "job-3"]
    try:
        with storage.transaction():
            for _ in range(rng.choice([0, 5, 60, 400])):
                storage.add_event(0.0, "x", rng.choice(jobs) if rng.random() < 0.8 else "job-1")
                if rng.random() < 0.05:  # long runs of others' events
                    for _ in range(rng.randrange(1, 300)):
                        storage.add_event(0.0, "y", "job-2")
        for job in jobs:
            everything = storage.events(job)
            for n in (0, 1, 2, 7, SHOW_EVENTS):
                got, older = storage.newest_events(job, n)
                assert got == (everything[-n:] if n else []), (seed, job, n)
                assert older == len(everything) - len(got), (seed, job, n)
    finally:
        storage.close()


def test_an_answer_over_the_limit_is_one_line_saying_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire_module, "MAX_ANSWER_BYTES", 20_000)
    with listening(tmp_path / "state") as server:
        for _ in range(10):
            assert server.handle(ME, "submit", submit_args(command=["/bin/true", "A" * 3000]))["ok"]
        with pytest.raises(ClientError) as refused:
            call_socket(server.path, "list", {})
        message = str(refused.value)
        assert message.startswith("the answer to list is ") and "\n" not in message
        assert message.endswith(" bytes: accepted at most 20000 bytes per answer; ask for less (e.g. "
                                "`scheduler-lite list --limit 10`)")
        assert len(call_socket(server.path, "list", {"states": ["running"]})) == 0  # a smaller one is answered
        assert len(call_socket(server.path, "list", {"limit": 3})["jobs"]) == 3


def test_the_largest_list_page_of_the_largest_jobs_fits_in_an_answer(server: Server) -> None:
    """`list` answers at most MAX_LIST_LIMIT jobs: so many of the largest jobs a user can make
    (command at the submission limit in control characters, 6 bytes each as JSON, the longest
    workdir and a failure reason quoting it, a 256-character name of 12-byte characters) still
    fit in one answer, with or without a limit (a client from before pages)."""
    command = ["/bin/true", "\x01" * ((MAX_SUBMISSION_BYTES - len(json.dumps(["/bin/true", ""]))) // 6)]
    assert MAX_SUBMISSION_BYTES - 6 < submission_bytes(command, ()) <= MAX_SUBMISSION_BYTES
    workdir = "/" + "\x01" * 4095  # PATH_MAX
    spec = JobSpec("A", JobKind.AUTO, 1, tuple(command), workdir, 0.0, name="\U0001f600" * 256, uid=ME.uid,
                   user="u" * 32)
    storage = server.daemon.storage
    for _ in range(MAX_LIST_LIMIT + 1):
        job = storage.add_job(spec)
        storage.update_job(job.id, state="failed", reason=f"cannot start {job.id}: Permission denied ({workdir})")
    for args in ({"limit": MAX_LIST_LIMIT}, {}):
        answer = server.handle(ME, "list", args)
        data = encode_answer(answer, "list")
        assert json.loads(data)["ok"] is True and len(data) <= wire_module.MAX_ANSWER_BYTES, len(data)
        jobs = answer["result"] if args == {} else answer["result"]["jobs"]
        assert len(jobs) == MAX_LIST_LIMIT and len(data) > 100_000 * MAX_LIST_LIMIT  # as large as promised


def test_the_client_says_an_answer_is_too_large_rather_than_not_json(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "MAX_ANSWER_BYTES", 1000)
    path = tmp_path / "fake.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def answer_too_much() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(1 << 16)
            conn.sendall(b'{"ok": true, "result": "' + b"x" * 5000 + b'"}\n')

    thread = threading.Thread(target=answer_too_much, daemon=True)
    thread.start()
    try:
        with pytest.raises(ClientError, match="the daemon's answer is larger than 1000 bytes"):
            call_socket(path, "ping", {})
    finally:
        thread.join(10)
        listener.close()


def test_the_server_module_keeps_its_limits_where_the_docs_say() -> None:
    assert (server_module.SHOW_EVENTS, server_module.MAX_EVENT_TEXT, MAX_SUBMISSION_BYTES,
            wire_module.MAX_ANSWER_BYTES) == (100, 1024, 65536, 64 << 20)
