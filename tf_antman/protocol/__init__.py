"""The file protocol between a training job and its local coordinator (docs/protocol.md).

Importable without TensorFlow: the coordinator (scheduler_lite) uses it too.
"""

from tf_antman.protocol.errors import ProtocolError
from tf_antman.protocol.files import (
    atomic_write_text,
    read_snapshot,
    read_stats,
    read_text,
    write_control,
)
from tf_antman.protocol.layout import (
    AGENT_LOCK_FILE,
    CONTROL_FILE,
    JOB_DIR_ENV,
    STATS_FILE,
    TMP_DIR,
    agent_lock_path,
    control_path,
    job_dir_from_env,
    stats_path,
    temp_dir,
)
from tf_antman.protocol.lock import AgentLock, JobDirBusy
from tf_antman.protocol.schema import (
    CONTROL_SCHEMA,
    CONTROL_VERSION,
    STATS_SCHEMA,
    STATS_VERSION,
    Control,
    DeviceStats,
    MemoryLimit,
    Rejection,
    Stats,
    clip_text,
    parse_control,
    parse_stats,
)
from tf_antman.protocol.watch import ControlUpdate, ControlWatcher

__all__ = [
    "AGENT_LOCK_FILE",
    "CONTROL_FILE",
    "CONTROL_SCHEMA",
    "CONTROL_VERSION",
    "JOB_DIR_ENV",
    "STATS_FILE",
    "STATS_SCHEMA",
    "STATS_VERSION",
    "TMP_DIR",
    "AgentLock",
    "Control",
    "ControlUpdate",
    "ControlWatcher",
    "DeviceStats",
    "JobDirBusy",
    "MemoryLimit",
    "ProtocolError",
    "Rejection",
    "clip_text",
    "Stats",
    "agent_lock_path",
    "atomic_write_text",
    "control_path",
    "job_dir_from_env",
    "parse_control",
    "parse_stats",
    "read_snapshot",
    "read_stats",
    "read_text",
    "stats_path",
    "temp_dir",
    "write_control",
]
