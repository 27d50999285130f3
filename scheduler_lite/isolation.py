"""Jobs run as their users and cannot touch the scheduler or each other (docs/security.md).

When the daemon runs as root, a job runs as the user that submitted it (uid, primary gid,
supplementary groups, home) with a small, fixed base environment, and its job directory is
laid out so that the job can write its statistics and nothing else of the scheduler's:

    state_dir/                 root 0755   (scheduler.db* 0600: the daemon's alone)
      scheduler.sock           root 0666   (anyone may connect; the caller is identified by SO_PEERCRED)
      jobs/                    root 0755
        job-7/                 root 1770 + ACL user:<owner>:rwx  (sticky: a file can be replaced or
                                                                  removed by its owner and root only)
          control.json         root 0644   the job reads it, cannot write, replace or remove it
          stdout.log, stderr.log root 0600 written through the descriptors the job inherits;
                                           read with `scheduler-lite logs` (owner and admins)
          .tmp/                root 1770 + ACL user:<owner>:rwx  (temporary files of both writers)
          stats.json, pid, exit_status      the job's own (the daemon checks their owner)
          ranks/               (a job on n > 1 GPUs) root 1770 + ACL, as job-7/
            <r>/               r = 1..n-1: rank r's control.json, .tmp/, stats.json as above

Other users have no access to the directory at all. The daemon creates control.json (a seq-only
control, `INITIAL_CONTROL_SEQ`) and the logs before the directory is opened to the job, so the job
can never create them itself; a directory used before (a requeued job) is locked down and emptied
of everything the job could have left in it first.

When the daemon does not run as root, jobs run as the daemon's user (which is the only user it
serves, scheduler_lite.auth): the directory is 0700, and nothing stops a job from rewriting its own
control file (the same uid owns both). docs/security.md says so.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import shutil
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from tf_antman.protocol import (
    TMP_DIR,
    Control,
    ProtocolError,
    Stats,
    parse_stats,
    read_text,
    stats_path,
    write_control,
)
from tf_antman.protocol.layout import RANKS_DIR, rank_dir
from tf_antman.protocol.schema import MAX_STATS_BYTES

INITIAL_CONTROL_SEQ: Final = 1  # the placeholder control written at launch; the daemon's next is 2
LOG_FILES: Final = ("stdout.log", "stderr.log")  # launcher.STDOUT_FILE, STDERR_FILE
DEFAULT_PATH: Final = "/usr/local/bin:/usr/bin:/bin"
ACL_XATTR: Final = "system.posix_acl_access"
# Variables a client may hand over from its own session (submit records them with the job unless
# --env sets them): what a user expects `python` or `train.py` to resolve against.
SESSION_VARIABLES: Final = ("PATH", "LANG", "LC_ALL", "TZ", "VIRTUAL_ENV", "PYTHONPATH")
_SMALL_FILE_BYTES: Final = 64


class IsolationError(OSError):
    """A job directory cannot be set up as described above (the message says why)."""


@dataclass(frozen=True, slots=True)
class JobUser:
    """The account a job runs as."""

    uid: int
    gid: int
    gids: tuple[int, ...]  # supplementary groups (the primary one included)
    name: str
    home: str
    shell: str


def job_user(uid: int | None) -> JobUser | None:
    """The account to switch to for a job submitted by `uid`; None: run it as the daemon's user.

    Only a root daemon switches. A uid that has no entry in the user database any more cannot be
    run (its home, groups are unknown): IsolationError.
    """
    if uid is None or os.geteuid() != 0 or uid == os.geteuid():
        return None
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        raise IsolationError(errno.ENOENT, f"uid {uid} has no entry in the user database; its job cannot run") from None
    gids = tuple(os.getgrouplist(entry.pw_name, entry.pw_gid))
    return JobUser(uid, entry.pw_gid, gids, entry.pw_name, entry.pw_dir, entry.pw_shell or "/bin/sh")


def base_environment(user: JobUser | None) -> Mapping[str, str] | None:
    """The environment a job of `user` starts from (None: the daemon's own, for its own user's jobs).

    Root's environment never reaches another user's job: only these, then the job's recorded
    variables (its --env and the session variables the client sent), then the scheduler's.
    """
    if user is None:
        return None
    return {"HOME": user.home, "USER": user.name, "LOGNAME": user.name, "SHELL": user.shell, "PATH": DEFAULT_PATH}


# ----------------------------------------------------------------------------------------------
# The job directory.


def prepare_job_dir(job_dir: Path, user: JobUser | None, ranks: int = 1) -> None:
    """Create (or reclaim) `job_dir` for a launch: the layout in the module docstring.

    `ranks`: the job's GPUs. A job on several may run one training process per GPU (torchrun),
    each with its own agent: rank r > 0 in `ranks/<r>/` (tf_antman.protocol.layout.rank_dir), made here
    like the job directory (a daemon-owned control.json before anything is open to the job), so
    that the rank writes only its stats there and the daemon's controls reach it."""
    job_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(job_dir, 0o700)
    except FileExistsError:
        _reclaim(job_dir)
    opened: list[Path] = []  # directories opened to the job's user, innermost first
    for rank in range(ranks - 1, 0, -1):
        if not opened:
            os.mkdir(job_dir / RANKS_DIR, 0o700)
        here = rank_dir(job_dir, rank)
        os.mkdir(here, 0o700)
        os.mkdir(here / TMP_DIR, 0o700)
        write_control(here, Control(seq=INITIAL_CONTROL_SEQ))
        opened += [here / TMP_DIR, here]
    if opened:
        opened.append(job_dir / RANKS_DIR)
    tmp = job_dir / TMP_DIR
    os.mkdir(tmp, 0o700)
    write_control(job_dir, Control(seq=INITIAL_CONTROL_SEQ))
    for name in LOG_FILES:
        with contextlib.suppress(FileExistsError):  # kept from an earlier attempt: appended to
            os.close(os.open(job_dir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    if user is None:
        os.chmod(tmp, 0o700)
        return
    for path in (*opened, tmp, job_dir):  # the directory itself last: nothing is open to the job before
        os.chmod(path, 0o1770)
        _grant(path, user.uid)


def _reclaim(job_dir: Path) -> None:
    """A directory used before: locked down (the daemon's alone), then emptied of all the job
    could have put there; the daemon's own logs kept (appended to)."""
    me = os.geteuid()
    info = os.lstat(job_dir)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != me:
        raise IsolationError(errno.EPERM, f"{job_dir} is not a directory owned by the daemon; refusing to use it")
    os.chmod(job_dir, 0o700)
    with contextlib.suppress(OSError):
        os.removexattr(job_dir, ACL_XATTR)
    for entry in os.scandir(job_dir):
        info = entry.stat(follow_symlinks=False)
        if entry.name in LOG_FILES and stat.S_ISREG(info.st_mode) and info.st_uid == me and info.st_nlink == 1:
            continue
        if stat.S_ISDIR(info.st_mode):
            shutil.rmtree(entry.path)  # fd-based on Linux: does not follow links planted inside
        else:
            os.unlink(entry.path)


def _grant(path: Path, uid: int) -> None:
    """POSIX ACL: owner (root) rwx, `uid` rwx, group and others nothing (mask rwx)."""
    undefined = 0xFFFFFFFF
    entries = ((0x01, 7, undefined), (0x02, 7, uid), (0x04, 0, undefined), (0x10, 7, undefined), (0x20, 0, undefined))
    value = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, perm, ident) for tag, perm, ident in entries)
    try:
        os.setxattr(path, ACL_XATTR, value)
    except OSError as err:
        if err.errno in (errno.EOPNOTSUPP, errno.ENOTSUP):
            raise IsolationError(err.errno, f"the file system of {path} does not support POSIX ACLs, which give a "
                                 "job's user its job directory alone; put paths.state_dir on ext4/xfs/btrfs/tmpfs "
                                 "mounted with ACLs") from None
        raise


# ----------------------------------------------------------------------------------------------
# Files the job writes, read by root: never follow a link, never block on a FIFO, check the owner.


def read_job_stats(job_dir: Path, owner_uid: int | None) -> Stats | None:
    """stats.json like tf_antman.protocol.read_stats, refused unless `owner_uid` (or the daemon) owns it."""
    found = read_job_file(stats_path(job_dir), owner_uid, MAX_STATS_BYTES)
    return None if found is None else parse_stats(found[0])


def read_small_int(path: Path) -> int | None:
    """An integer file the job's wrapper writes (pid); None when absent or refused.

    Any owner: only the job's user and root can create files in its directory.
    """
    try:
        found = read_job_file(path, any_owner=True)
        return None if found is None else small_int(found[0].strip())
    except (ProtocolError, OSError):
        return None


def small_int(word: str) -> int | None:
    try:
        return int(word) if len(word) <= 12 else None
    except ValueError:
        return None


def read_job_file(path: Path, owner_uid: int | None = None, max_bytes: int = _SMALL_FILE_BYTES, *,
                  any_owner: bool = False) -> tuple[str, float] | None:
    """(text, modification time) of a file in a job's directory; None when there is none.

    ProtocolError unless it is a regular UTF-8 file of at most `max_bytes` owned by `owner_uid`
    or the daemon (`any_owner`: by anyone). The owner check is made on the descriptor that is
    read: another user's file linked or renamed into the directory is refused, not parsed.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:
        read_text(path, max_bytes)  # a link or worse: read_text names the refusal
        raise
    label = path.name
    try:
        info = os.fstat(fd)
        allowed = {os.geteuid()} | ({owner_uid} if owner_uid is not None else set())
        if not any_owner and info.st_uid not in allowed:
            raise ProtocolError(label, f"is owned by uid {info.st_uid}, not by the job's user; refused")
        if not stat.S_ISREG(info.st_mode):
            raise ProtocolError(label, "must be a regular file")
        if info.st_size > max_bytes:
            raise ProtocolError(label, f"is {info.st_size} bytes; at most {max_bytes} bytes are accepted")
        data = os.read(fd, max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise ProtocolError(label, f"is more than {max_bytes} bytes")
    try:
        return data.decode("utf-8"), info.st_mtime
    except UnicodeDecodeError as err:
        raise ProtocolError(label, f"is not UTF-8 (invalid byte at offset {err.start})") from None


def process_uid(pid: int) -> int | None:
    """Real uid of a live process (None if gone)."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def read_log(path: Path, offset: int, limit: int) -> tuple[bytes, int]:
    """Up to `limit` bytes of a job's log from `offset` (for `logs`); refuses links and non-files."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return b"", offset
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ProtocolError(path.name, "must be a regular file")
        data = os.pread(fd, limit, offset)
    finally:
        os.close(fd)
    return data, offset + len(data)


__all__ = ["DEFAULT_PATH", "INITIAL_CONTROL_SEQ", "SESSION_VARIABLES", "IsolationError", "JobUser",
           "base_environment", "job_user", "prepare_job_dir", "process_uid", "read_job_file",
           "read_job_stats", "read_log", "read_small_int", "small_int"]
