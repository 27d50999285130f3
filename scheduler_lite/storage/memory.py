"""Storage in process memory: for tests and for using the daemon as a library without a file.

Transactions are real: a block that raises restores what was there before it. A call that
changes one thing, all at once, needs none of its own.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from scheduler_lite.storage.base import (
    MAX_EVENTS,
    EventRecord,
    JobPage,
    JobRecord,
    JobSpec,
    JobStatus,
    PlacementRecord,
    StorageError,
    check_fields,
    check_limit,
    check_new_job,
    check_states,
    job_id_for,
    seq_of,
)


class MemoryStorage:
    def __init__(self) -> None:
        self._jobs: dict[str, JobRecord] = {}
        self._events: list[EventRecord] = []
        self._placements: dict[tuple[str, int], PlacementRecord] = {}
        self._quotas: dict[str, int] = {}
        self._seq = 0
        self._last_event = 0
        self._open = False  # inside a transaction block: a nested one joins it

    @contextmanager
    def transaction(self) -> Iterator[None]:
        if self._open:
            yield
            return
        saved = (dict(self._jobs), list(self._events), dict(self._placements), dict(self._quotas), self._seq,
                 self._last_event)
        self._open = True
        try:
            yield
        except BaseException:
            self._jobs, self._events, self._placements, self._quotas, self._seq, self._last_event = saved
            raise
        finally:
            self._open = False

    def add_job(self, spec: JobSpec) -> JobRecord:
        check_new_job(self, spec)
        with self.transaction():
            self._seq += 1
            asked = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
            record = JobRecord(id=job_id_for(self._seq), seq=self._seq,
                               **asked | {"command": tuple(spec.command), "env": tuple(spec.env)})
            self._jobs[record.id] = record
            return record

    def job_by_request(self, uid: int | None, request_id: str) -> JobRecord | None:
        # A scan: the memory store holds a test's or a library user's few jobs.
        return next((j for j in self._jobs.values() if j.request_id == request_id and j.uid == uid), None)

    def get_job(self, job_id: str) -> JobRecord | None:
        return self._jobs.get(job_id)

    def list_jobs(self, states: Iterable[JobStatus] | None = None) -> list[JobRecord]:
        wanted = check_states(states)
        jobs = sorted(self._jobs.values(), key=lambda j: j.seq)
        return [j for j in jobs if wanted is None or j.state in wanted]

    def jobs_page(self, limit: int, before: str | None = None,
                  states: Iterable[JobStatus] | None = None) -> JobPage:
        check_limit(limit)
        below = None if before is None else seq_of(before)
        wanted = check_states(states)
        # _jobs is in submission order (ids are added in seq order; updates keep their place).
        older = (j for j in reversed(self._jobs.values())
                 if (below is None or j.seq < below) and (wanted is None or j.state in wanted))
        page = list(itertools.islice(older, limit))
        return JobPage(tuple(reversed(page)), sum(1 for _ in older))

    def update_job(self, job_id: str, **fields: Any) -> JobRecord:
        check_fields(fields)
        if job_id not in self._jobs:
            raise StorageError(f"no job {job_id!r}")
        if "state" in fields:
            fields["state"] = JobStatus(fields["state"])
        if "placement" in fields:
            fields["placement"] = tuple(fields["placement"])
        record = self._jobs[job_id] = dataclasses.replace(self._jobs[job_id], **fields)
        return record

    def add_event(self, time: float, kind: str, job_id: str | None = None, /, **detail: Any) -> int:
        # Round-trip through JSON: the same check (and the same copies) as the SQLite store.
        detail = json.loads(json.dumps(detail))
        self._last_event += 1
        self._events.append(EventRecord(self._last_event, time, job_id, kind, detail))
        return self._last_event

    def events(self, job_id: str | None = None, after_id: int = 0, limit: int | None = None) -> list[EventRecord]:
        out = [copy.deepcopy(e) for e in self._events if e.id > after_id and (job_id is None or e.job_id == job_id)]
        return out if limit is None else out[:limit]

    def newest_events(self, job_id: str, n: int) -> tuple[list[EventRecord], int]:
        mine = [e for e in self._events if e.job_id == job_id]
        newest = mine[-n:] if n > 0 else []
        return [copy.deepcopy(e) for e in newest], len(mine) - len(newest)

    def prune_events(self, keep: int = MAX_EVENTS) -> int:
        dropped = max(0, len(self._events) - keep)
        self._events = self._events[dropped:]
        return dropped

    def set_placement(self, job_id: str, gpu: int, memory_limit_bytes: int, compute_share: float) -> None:
        if job_id not in self._jobs:
            raise StorageError(f"no job {job_id!r}")
        self._placements[(job_id, gpu)] = PlacementRecord(job_id, gpu, memory_limit_bytes, float(compute_share))

    def placements(self, job_id: str | None = None) -> list[PlacementRecord]:
        order = {j.id: j.seq for j in self._jobs.values()}
        found = (p for p in self._placements.values() if job_id is None or p.job_id == job_id)
        return sorted(found, key=lambda p: (order.get(p.job_id, 0), p.gpu))

    def clear_placements(self, job_id: str) -> None:
        for key in [k for k in self._placements if k[0] == job_id]:
            del self._placements[key]

    def set_quota(self, tenant: str, gpu_quota: int) -> None:
        self._quotas[tenant] = gpu_quota

    def quotas(self) -> dict[str, int]:
        return dict(self._quotas)

    def close(self) -> None:
        pass
