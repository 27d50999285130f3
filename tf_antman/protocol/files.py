"""Atomic writes and guarded reads of the protocol's files.

Writers never modify a file in place: they write a temporary file in the same directory, fsync it and
rename it over the target, so a reader sees either the old or the new document, never a torn one.
Readers refuse anything but a small regular UTF-8 file, and never follow a symbolic link: the job
directory may be writable by others than the coordinator.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tf_antman.protocol.errors import ProtocolError
from tf_antman.protocol.layout import control_path, stats_path, temp_dir
from tf_antman.protocol.schema import (
    MAX_CONTROL_BYTES,
    MAX_STATS_BYTES,
    Control,
    Stats,
    parse_stats,
)

FileIdentity = tuple[int, int, int, int, int]


@dataclass(frozen=True)
class FileSnapshot:
    """What was found at a path: its identity and either its text or why it was refused.

    The identity (device, inode, size, mtime ns, content hash) tells a watcher "the same file read
    again" from "a new file". The hash matters: ext4 timestamps move in jiffies and a freed inode
    number is reused at once, so two quick writes of equal size can share everything else. ctime
    is left out: rename() updates it, and a reader racing the rename can see it change afterwards.
    """

    identity: FileIdentity
    text: str | None
    error: ProtocolError | None


def atomic_write_text(
    path: Path, text: str, *, fsync: bool = True, mode: int = 0o644, tmp_dir: Path | None = None
) -> None:
    """Replace `path` with `text` so that no reader ever sees a partial file.

    tmp_dir must be on the same file system as `path` (default: next to it; for a job directory
    use layout.temp_dir(), see there why).
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=tmp_dir or path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            os.fchmod(handle.fileno(), mode)  # mkstemp creates 0600: the other side may be another user
            handle.write(text)
            handle.flush()
            if fsync:
                # Without it a crash after the rename can leave an empty file under the final name.
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def read_snapshot(path: Path, max_bytes: int = MAX_CONTROL_BYTES) -> FileSnapshot | None:
    """Read `path` defensively; None when nothing is there."""
    label = path.name
    try:
        # O_NOFOLLOW: a link is refused, not followed; O_NONBLOCK: a FIFO cannot hang the reader.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as err:
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            return None
        if stat.S_ISLNK(info.st_mode) or err.errno == errno.ELOOP:
            reason = "is a symbolic link; refused (write a regular file and rename it into place)"
        else:
            reason = f"cannot be opened: {err.strerror}"
        return FileSnapshot(_identity(info), None, ProtocolError(label, reason))
    try:
        info = os.fstat(fd)
        identity = _identity(info)
        if stat.S_ISDIR(info.st_mode):
            return FileSnapshot(identity, None, ProtocolError(label, "is a directory; must be a regular file"))
        if not stat.S_ISREG(info.st_mode):
            return FileSnapshot(identity, None, ProtocolError(label, "must be a regular file"))
        if info.st_size > max_bytes:
            return FileSnapshot(identity, None, _too_big(label, info.st_size, max_bytes))
        data = _read_at_most(fd, max_bytes + 1)
    except OSError as err:
        return FileSnapshot((0, 0, 0, 0, 0), None, ProtocolError(label, f"cannot be read: {err.strerror}"))
    finally:
        os.close(fd)
    identity = _identity(info, data)
    if len(data) > max_bytes:  # it grew after fstat: someone writes in place
        return FileSnapshot(identity, None, _too_big(label, len(data), max_bytes))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        return FileSnapshot(identity, None, ProtocolError(label, f"is not UTF-8 (invalid byte at offset {err.start})"))
    return FileSnapshot(identity, text, None)


def read_text(path: Path, max_bytes: int = MAX_CONTROL_BYTES) -> str | None:
    """The text at `path` (None when absent); raises ProtocolError when the file is refused."""
    snapshot = read_snapshot(path, max_bytes)
    if snapshot is None:
        return None
    if snapshot.error is not None:
        raise snapshot.error
    return snapshot.text


def _identity(info: os.stat_result, data: bytes = b"") -> FileIdentity:
    digest = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, digest)


def _too_big(label: str, size: int, max_bytes: int) -> ProtocolError:
    return ProtocolError(label, f"is {size} bytes or more; at most {max_bytes} bytes are accepted")


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    remaining = limit
    while remaining > 0:
        chunk = os.read(fd, remaining)
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


class LatestTextWriter:
    """Writes, from its own thread, the most recent text submitted for one file.

    The job's training thread only builds a document and hands it over; the rename costs a
    millisecond or more on ext4 (it flushes the new file's data) and must not stall a step.
    Intermediate documents submitted while a write is in progress are skipped: only the newest
    matters to a reader.
    """

    def __init__(
        self,
        path: Path,
        *,
        fsync: bool = False,
        tmp_dir: Path | None = None,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        self._path = path
        self._tmp_dir = tmp_dir
        self._fsync = fsync
        self._on_error = on_error
        self._cond = threading.Condition()
        self._pending: str | None = None
        self._submitted = 0
        self._done = 0  # submissions written (or failed) so far
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"tf_antman-write-{path.name}", daemon=True)
        self._thread.start()

    def submit(self, text: str) -> None:
        with self._cond:
            if self._closed:
                return
            self._pending = text
            self._submitted += 1
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far is on disk; False on timeout."""
        with self._cond:
            target = self._submitted
            return self._cond.wait_for(lambda: self._done >= target or not self._thread.is_alive(), timeout)

    def close(self, timeout: float | None = 5.0) -> None:
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return
                text, self._pending, upto = self._pending, None, self._submitted
            try:
                atomic_write_text(self._path, text, fsync=self._fsync, tmp_dir=self._tmp_dir)
            except Exception as err:  # noqa: BLE001 - reported to the owner, the thread goes on
                if self._on_error is not None:
                    self._on_error(err)
            with self._cond:
                self._done = upto
                self._cond.notify_all()


def write_control(job_dir: Path, control: Control, *, fsync: bool = True) -> None:
    """The coordinator's write of control.json: atomic, with its temporary file in .tmp/."""
    atomic_write_text(control_path(job_dir), control.to_json(), fsync=fsync, tmp_dir=temp_dir(job_dir))


def read_stats(job_dir: Path) -> Stats | None:
    """The coordinator's read of stats.json: None while the job has not written one yet.

    Raises ProtocolError (naming the field) for a file that is refused or does not validate.
    """
    text = read_text(stats_path(job_dir), MAX_STATS_BYTES)
    return None if text is None else parse_stats(text)
