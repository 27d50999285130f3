"""A daemon with its socket server inside the test process, for tests that run the CLI in-process.

`ticks=False` answers requests but never ticks: submitted jobs stay queued, so the CLI's answers
about the store are deterministic. `ticks=True` is the real loop (`cli.cmd_serve`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from scheduler_lite.config import load_config
from scheduler_lite.daemon import Daemon
from scheduler_lite.server import Server
from scheduler_lite.state_dir import lock_state_dir, secure_state_dir
from scheduler_lite.storage import SqliteStorage
from scheduler_lite.testing import stop_all_jobs


@contextmanager
def serving(config_path: str | Path, *, ticks: bool = False) -> Iterator[Server]:
    config = load_config(Path(config_path))
    ready = threading.Event()
    box: dict[str, object] = {}

    def run() -> None:
        lock = lock_state_dir(config.state_dir)
        secure_state_dir(config, os.geteuid() == 0)
        storage = SqliteStorage(config.db_path)  # opened on the thread that uses it (sqlite3's rule)
        try:
            daemon = Daemon(config, storage)
            server = Server(daemon, config)
            server.start()
            box["server"] = server
            ready.set()
            try:
                if ticks:
                    daemon.serve(between_ticks=server.serve_requests)
                else:
                    while not daemon.stopping:
                        server.serve_requests(0.05)
                stop_all_jobs(daemon, grace_s=1.0)
            finally:
                server.close()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e
            ready.set()
        finally:
            storage.close()
            os.close(lock)

    thread = threading.Thread(target=run, name="test-daemon", daemon=True)
    thread.start()
    assert ready.wait(60), "the test daemon did not start"
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    server = box["server"]
    assert isinstance(server, Server)
    try:
        yield server
    finally:
        server.daemon.stop()
        thread.join(60)


@contextmanager
def answering(server: Server) -> Iterator[Server]:
    """`server` started and answering requests on a thread of its own (no ticks); closed after."""
    server.config.state_dir.mkdir(parents=True, exist_ok=True)
    server.start()
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            server.serve_requests(0.05)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        stop.set()
        thread.join(10)
        server.close()
