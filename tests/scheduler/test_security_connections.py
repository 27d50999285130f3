"""Connections to the daemon's socket: one user cannot hold every slot (slowloris, docs/security.md).

Each connection must deliver its whole request line within REQUEST_DEADLINE_S of the accept (a
per-recv timeout never fires for a client trickling a byte at a time), and one uid may hold at
most MAX_CONNECTIONS_PER_UID connections: the excess is refused at once with one line, which the
client retries.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from scheduler_lite import client as client_module
from scheduler_lite import server as server_module
from scheduler_lite.auth import AccessPolicy, TenantMembers, identity_of_uid
from scheduler_lite.client import call_socket
from scheduler_lite.daemon import Daemon
from scheduler_lite.server import Server
from scheduler_lite.storage import MemoryStorage
from tests.scheduler.serving import answering
from tests.scheduler.test_daemon_fakes import make_config

ME = identity_of_uid(os.getuid())
NOBODY = 65534
GUARD_S = 30.0  # how long a test waits for what must happen before it fails (not a speed requirement)


@contextmanager
def listening(state_dir: Path, policy: AccessPolicy | None = None) -> Iterator[Server]:
    """A server answering requests on a thread of its own (no ticks)."""
    config = make_config(state_dir)
    server = Server(Daemon(config, MemoryStorage()), config,
                    policy or AccessPolicy(os.geteuid(), ME.user, (TenantMembers("A"),)))
    with answering(server):
        yield server


def connect(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(GUARD_S)
    s.connect(str(path))
    return s


def read_until_closed(s: socket.socket) -> bytes:
    data = b""
    while chunk := s.recv(1 << 16):
        data += chunk
    return data


def test_a_client_trickling_its_request_is_cut_off_at_the_deadline(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """One space every 0.05 s never lets a per-recv timeout fire; the deadline counts from the
    accept and closes the connection with one line."""
    monkeypatch.setattr(server_module, "REQUEST_DEADLINE_S", 0.5)
    with listening(tmp_path / "state") as server, connect(server.path) as s:
        guard = time.monotonic() + GUARD_S
        answer = b""
        while time.monotonic() < guard:
            try:
                s.sendall(b" ")
            except (BrokenPipeError, ConnectionResetError):
                pass  # closed: the answer is read below
            if select.select([s], [], [], 0.05)[0]:
                answer = read_until_closed(s)
                break
        assert answer, f"the connection was still open after {GUARD_S} s of trickling"
        line, rest = answer.split(b"\n", 1)
        assert rest == b""  # one line, then closed (read_until_closed returned: EOF)
        assert json.loads(line) == {"ok": False, "error": "the request did not arrive within 0.5 s of connecting: "
                                    "accepted one line sent at once; the connection is closed"}
        assert server.daemon.storage.list_jobs() == []


def test_one_uid_s_excess_connections_are_refused_with_one_line(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_module, "MAX_CONNECTIONS_PER_UID", 2)
    refusals: list[int] = []
    refuse = server_module._refuse

    def counted(conn: socket.socket, uid: int) -> None:
        refusals.append(uid)
        refuse(conn, uid)

    monkeypatch.setattr(server_module, "_refuse", counted)
    with listening(tmp_path / "state") as server:
        held = [connect(server.path), connect(server.path)]  # idle: they send nothing
        try:
            with connect(server.path) as third:
                answer = read_until_closed(third)
            assert answer.count(b"\n") == 1 and answer.endswith(b"\n")
            assert json.loads(answer) == {
                "ok": False, "retry": True,
                "error": f"uid {os.getuid()} has 2 connections to the daemon open: accepted at most 2 at once per "
                         "user; nothing was done, try again when one has closed"}
            # The client retries such a refusal: its ping is answered once a connection closes.
            result: dict[str, Any] = {}
            pinging = threading.Thread(target=lambda: result.update(call_socket(server.path, "ping", {})))
            pinging.start()
            guard = time.monotonic() + GUARD_S
            while len(refusals) < 3 and time.monotonic() < guard:  # the ping refused, then retried
                time.sleep(0.01)
            assert len(refusals) >= 3 and "uid" not in result  # not served while both are held
            held.pop().close()
            pinging.join(GUARD_S)
            assert result.get("uid") == os.getuid()
        finally:
            for s in held:
                s.close()
        # Every connection, refused or served, gives its slot back. A connection's thread does so
        # after it has closed it, so its client may see the answer (or the EOF) a moment before:
        # a raw connection opened in that moment is refused, which the client retries (below), but
        # these two do not. So: wait for the slots, then two at once are served again.
        wait_until_no_slot_is_held(server, os.getuid())
        with connect(server.path) as a, connect(server.path) as b:
            for s in (a, b):
                s.sendall(b'{"version": 1, "op": "ping"}\n')
                assert json.loads(read_until_closed(s))["ok"] is True


def wait_until_no_slot_is_held(server: Server, uid: int) -> None:
    """Until `uid` holds none of the server's per-uid connection slots (a slot never given back fails)."""
    guard = time.monotonic() + GUARD_S
    while True:
        with server._per_uid_lock:
            held = server._per_uid.get(uid, 0)
        if not held:
            return
        assert time.monotonic() < guard, f"uid {uid} still holds {held} connection slots {GUARD_S} s after closing all"
        time.sleep(0.01)


@pytest.mark.parametrize("order", ["request after the refusal", "request before the refusal"])
def test_a_client_over_the_limit_reads_the_refusal_and_retries_whatever_the_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, order: str) -> None:
    """The server refuses at the accept, without reading: the client's request may reach a
    connection already closed (its write fails with EPIPE) or one closed with the request unread
    (ECONNRESET after the line). Either way the client reads the refusal line and retries: no
    traceback. Each interleaving is forced here, not left to the scheduler."""
    monkeypatch.setattr(server_module, "MAX_CONNECTIONS_PER_UID", 1)
    monkeypatch.setattr(client_module, "TIMEOUT_S", GUARD_S)
    refused, sent = threading.Event(), threading.Event()
    sends: list[str] = []  # how each of the client's writes went
    refuse = server_module._refuse

    def refusing(conn: socket.socket, uid: int) -> None:
        first = not refused.is_set()
        if first and order == "request before the refusal":
            sent.wait(GUARD_S)  # the client's request is in the connection, unread
        refuse(conn, uid)  # the line written, the connection closed
        if first:
            held.close()  # the retry is served once the server gives this slot back
            refused.set()

    class Client(socket.socket):
        def sendall(self, data: Any, flags: int = 0) -> None:  # type: ignore[override]
            first = not sends
            if first and order == "request after the refusal":
                refused.wait(GUARD_S)
            try:
                super().sendall(data, flags)
            except OSError as e:
                sends.append(type(e).__name__)
                raise
            finally:
                sent.set()
            sends.append("sent")

    monkeypatch.setattr(server_module, "_refuse", refusing)
    monkeypatch.setattr(client_module, "socket", SimpleNamespace(**{**vars(socket), "socket": Client}))
    with listening(tmp_path / "state") as server:
        held = connect(server.path)  # the uid's one slot (accepted first: one thread accepts, in order)
        try:
            result = call_socket(server.path, "ping", {})
        finally:
            held.close()
    assert refused.is_set() and result["uid"] == os.getuid()
    assert sends[0] == ("BrokenPipeError" if order == "request after the refusal" else "sent"), sends


# Another user's ping, raw (the checkout's virtualenv may not be usable by that user).
PING = """
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(float(sys.argv[2]))
s.connect(sys.argv[1])
s.sendall(b'{"version": 1, "op": "ping"}\\n')
data = b""
while not data.endswith(b"\\n"):
    chunk = s.recv(65536)
    if not chunk:
        break
    data += chunk
print(json.loads(data)["result"]["uid"])
"""


def _system_python() -> str | None:
    """A Python another user can run: the test's own may live under /root."""
    for candidate in (sys.executable, shutil.which("python3"), "/usr/bin/python3"):
        try:
            probe = subprocess.run([candidate or "-", "-c", "pass"], user=NOBODY, group=NOBODY, extra_groups=[],
                                   capture_output=True, check=False, cwd="/")
        except OSError:
            continue
        if probe.returncode == 0:
            return candidate
    return None


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: connects as another uid")
def test_another_user_is_served_while_one_user_opens_every_connection_it_can(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The reviewer's attack: one user opens more connections than the daemon serves and keeps
    them open; everybody else must still get answers."""
    python = _system_python()
    if python is None:
        pytest.skip("no Python that uid 65534 can run")
    monkeypatch.setattr(server_module, "MAX_CONNECTIONS", 4)
    monkeypatch.setattr(server_module, "MAX_CONNECTIONS_PER_UID", 2)
    monkeypatch.setattr(server_module, "REQUEST_DEADLINE_S", 600.0)  # the attacker's connections stay
    base = Path(tempfile.mkdtemp(prefix="sl-conn-"))
    os.chmod(base, 0o755)  # the other user reaches the socket (0666 for a root daemon)
    try:
        policy = AccessPolicy(0, "root", (TenantMembers("A"),))
        with listening(base / "state", policy) as server:
            os.chmod(server.config.state_dir, 0o755)
            attacker = [connect(server.path) for _ in range(4)]  # every global slot
            try:
                other = subprocess.run([python, "-c", PING, str(server.path), str(GUARD_S)], user=NOBODY,
                                       group=NOBODY, extra_groups=[], capture_output=True, text=True, cwd="/",
                                       timeout=GUARD_S + 10, check=False)
                assert other.returncode == 0 and other.stdout.strip() == str(NOBODY), other.stderr[-500:]
            finally:
                for s in attacker:
                    s.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
