"""Durable state of the daemon behind one contract (base.Storage): memory and SQLite implementations."""

from __future__ import annotations

from pathlib import Path

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


def open_storage(path: Path | str | None) -> Storage:
    """SQLite at `path`; in memory when path is None."""
    return MemoryStorage() if path is None else SqliteStorage(path)


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
    "open_storage",
]
