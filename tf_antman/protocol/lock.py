"""One job agent per job directory.

Every process that imports TensorFlow with ANTMAN_JOB_DIR set would start an agent: a
multiprocessing "spawn" child or a data-loading worker inherits the variable, and its agent would
overwrite the job's stats.json (its own pid, state "finished" when it exits) and apply the
coordinator's controls to itself. The agent's process therefore holds an exclusive flock(2) on
`<job_dir>/agent.lock` for as long as the agent lives; a process that finds it taken gets
`JobDirBusy` and runs without an agent (tf_antman/jobside.py).

flock and not a pid file: the kernel drops the lock when its process dies, however it dies
(SIGKILL included), so a new job process in the same directory is never locked out by a dead one.
The descriptor is close-on-exec (exec'd children do not hold the lock) and a forked child shares
the parent's lock (it is the same job); closing the child's copy leaves the parent's lock in place.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

from tf_antman.protocol.errors import ProtocolError
from tf_antman.protocol.layout import AGENT_LOCK_FILE, agent_lock_path

# Never follow a link planted in the directory; never block on a FIFO; not inherited by exec.
_OPEN_FLAGS = os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class JobDirBusy(ProtocolError):
    """Another process holds the job directory's agent lock: its agent serves the directory."""

    def __init__(self, job_dir: Path) -> None:
        super().__init__(AGENT_LOCK_FILE, f"held by another process: its job agent serves {job_dir}")
        self.job_dir = job_dir


class AgentLock:
    """The exclusive lock on `<job_dir>/agent.lock`, held until `release()` or the process ends."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd
        self._pid = os.getpid()  # the process that took it (a forked child shares the descriptor)

    @classmethod
    def acquire(cls, job_dir: Path) -> AgentLock:
        """Raises JobDirBusy when another process holds it, ProtocolError when the lock file is not a
        regular file, OSError when it cannot be created or opened."""
        path = agent_lock_path(job_dir)
        try:
            fd = os.open(path, _OPEN_FLAGS, 0o644)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise ProtocolError(AGENT_LOCK_FILE, "is a symbolic link; it must be a regular file") from None
            if err.errno == errno.EISDIR:
                raise ProtocolError(AGENT_LOCK_FILE, "is a directory; it must be a regular file") from None
            raise
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ProtocolError(AGENT_LOCK_FILE, "must be a regular file")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise JobDirBusy(job_dir) from None
        except BaseException:
            os.close(fd)
            raise
        return cls(fd)

    def release(self) -> None:
        """Unlocks and closes the descriptor. Idempotent.

        Unlocked explicitly, not only closed: a forked child (a fork-started worker still running)
        shares the open file description, and closing the last descriptor of this process left the
        directory locked until the child exited, so a restarted job in it ran without an agent.
        Only the process that took the lock unlocks it: a child's unlock would free the directory
        under the parent's running agent."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if os.getpid() == self._pid:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
