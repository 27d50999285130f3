"""The daemon's state directory: checked before `serve` uses it, locked (one daemon), made the daemon's own.

`serve` runs as root on a shared machine and sets the modes of, and writes into, `paths.state_dir`
(the store, the socket, every job's directory). A directory others can change, or a symbolic link
someone planted on the way, would make root do that to a place of their choosing: these checks
refuse it (docs/security.md, "Root and the config").
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from pathlib import Path
from typing import Final

from scheduler_lite.config import Config, ConfigError

LOCK_FILE: Final = "daemon.lock"  # the daemon's lock (lock_state_dir)


class DaemonLockedError(RuntimeError):
    pass


def check_state_dir(config: Config) -> None:
    """Refuse a state directory that is not the scheduler's own, or whose path others could change.

    `serve` sets the directory's mode (0700, 0755 as root) and fills it, as the daemon's user
    (root): that must not happen to a shared directory such as /tmp, to another user's, or, through
    a symbolic link someone planted, to whatever the link points to. So the directory itself is
    not a link, is the daemon's user's and not writable by its group or others; and every
    directory above it, as written and as resolved, is owned by root or the daemon's user and not
    writable by group or others unless sticky (sshd's StrictModes rule): nobody else can replace
    an entry on the way (a directory that does not exist yet is created by serve).

    The config resolves links in `paths.state_dir` when it is loaded, so the path as the config
    file writes it (`Config.state_dir_as_written`) is checked too: a link planted there is
    otherwise already followed."""
    written = config.state_dir_as_written
    given = str(written or config.state_dir)
    for state in dict.fromkeys(p for p in (written, config.state_dir) if p is not None):
        _check_state_path(state if state.is_absolute() else Path.cwd() / state, given)
    # The lock is opened O_NOFOLLOW (root truncates and writes it): a link there failed with a
    # bare "Too many levels of symbolic links". Said here, with the path and what to do.
    lock = config.state_dir / LOCK_FILE
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISREG(os.lstat(lock).st_mode):
            raise ConfigError("paths.state_dir", given, f"a directory of the scheduler's own: {lock} is not a regular "
                              "file (a symbolic link?), and serve truncates and writes it; remove it")


def _check_state_path(state: Path, given: str) -> None:
    field_name = "paths.state_dir"
    daemon_uid = os.geteuid()
    try:
        st = os.lstat(state)
    except FileNotFoundError:
        st = None  # created by serve, with the right owner and mode
    if st is not None:
        if stat.S_ISLNK(st.st_mode):
            raise ConfigError(field_name, given, f"a directory, not a symbolic link ({state} is one: serve would set "
                              "the mode of, and write into, whatever it points to)")
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError(field_name, given, "a directory (this path is not one)")
        if st.st_mode & (stat.S_IWOTH | stat.S_IWGRP | stat.S_ISVTX):
            raise ConfigError(field_name, given,
                              f"a directory of the scheduler's own, not a shared one (mode {stat.S_IMODE(st.st_mode):04o}): "
                              "serve makes it 0700 (0755 as root); e.g. a new subdirectory of it")
        if st.st_uid != daemon_uid:
            raise ConfigError(field_name, given,
                              f"a directory owned by the daemon's user (uid {daemon_uid}), not by uid {st.st_uid}")
    resolved = Path(os.path.realpath(state.parent))
    for above in dict.fromkeys((state.parent, *state.parent.parents, resolved, *resolved.parents)):
        try:
            st = os.lstat(above)
        except FileNotFoundError:
            continue  # serve creates it
        if stat.S_ISLNK(st.st_mode):
            continue  # its own directory is checked here, and where it leads is in the resolved chain
        if st.st_uid not in (0, daemon_uid):
            raise ConfigError(field_name, given,
                              f"a path whose every directory is owned by root or the daemon's user (uid {daemon_uid}): "
                              f"{above} is owned by uid {st.st_uid}, who could replace what is below it")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            raise ConfigError(field_name, given,
                              f"a path whose every directory is writable only by its owner (or sticky, as /tmp): "
                              f"{above} is writable by its group or others (mode {stat.S_IMODE(st.st_mode):04o}), "
                              "who could replace what is below it with a symbolic link")


def secure_state_dir(config: Config, multi_user: bool) -> None:
    """The store is the daemon's alone (0600); the directories are traversable so clients reach the socket.

    Nothing here follows a symbolic link (check_state_dir refused one in place of the directory;
    one found inside it now was planted since, or before the directory was the daemon's own)."""
    state = config.state_dir
    state.mkdir(parents=True, exist_ok=True)
    _chmod_directory(state, 0o755 if multi_user else 0o700)
    config.jobs_dir.mkdir(exist_ok=True)
    _chmod_directory(config.jobs_dir, 0o755 if multi_user else 0o700)
    for suffix in ("", "-wal", "-shm"):
        path = Path(f"{config.db_path}{suffix}")
        if suffix == "":  # created 0600 before SQLite sees it: its -wal and -shm copy the mode
            with contextlib.suppress(FileExistsError):
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode):  # SQLite would follow a link
            raise ConfigError("paths.state_dir", str(state), f"a directory of the scheduler's own: {path} is not a "
                              "regular file (a symbolic link?); remove it")
        os.chmod(path, 0o600, follow_symlinks=False)


def _chmod_directory(path: Path, mode: int) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ConfigError("paths.state_dir", str(path), "a directory, not a symbolic link or another "
                              "file") from None
        raise
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def lock_state_dir(state_dir: Path) -> int:
    """Hold the state directory for this process (one daemon per store); returns the lock's fd."""
    state_dir.mkdir(parents=True, exist_ok=True)
    # Not through a link: root truncates and writes this file (one planted in the state directory
    # would make it any file of the link's choosing).
    fd = os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise DaemonLockedError(f"another scheduler-lite daemon (pid {holder}) is serving {state_dir}") from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd
