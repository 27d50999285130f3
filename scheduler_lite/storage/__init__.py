"""Durable state of the daemon behind one contract (`Storage`), kept by SQLite (in a file or in memory)."""

from __future__ import annotations

from scheduler_lite.storage.base import (
    MAX_EVENTS,
    SCHEMA_VERSION,
    EventRecord,
    JobPage,
    JobRecord,
    JobSpec,
    JobStatus,
    PlacementRecord,
    StorageError,
)
from scheduler_lite.storage.sqlite import MemoryStorage, SqliteStorage

Storage = SqliteStorage  # the contract is what its methods promise; MemoryStorage is one too

__all__ = [
    "MAX_EVENTS",
    "SCHEMA_VERSION",
    "EventRecord",
    "JobPage",
    "JobRecord",
    "JobSpec",
    "JobStatus",
    "MemoryStorage",
    "PlacementRecord",
    "SqliteStorage",
    "Storage",
    "StorageError",
]
