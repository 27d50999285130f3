"""Durable state of the daemon behind one contract (base.Storage): memory and SQLite implementations."""

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
    Storage,
    StorageError,
)
from scheduler_lite.storage.memory import MemoryStorage
from scheduler_lite.storage.sqlite import SqliteStorage

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
