"""One contract (scheduler_lite/storage: Storage), run against a database file and an in-memory one."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from scheduler_lite.model import JobKind, Role
from scheduler_lite.storage import (
    JobPage,
    JobSpec,
    JobStatus,
    MemoryStorage,
    SqliteStorage,
    Storage,
    StorageError,
)


@pytest.fixture(params=["memory", "sqlite"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Storage]:
    store: Storage = MemoryStorage() if request.param == "memory" else SqliteStorage(tmp_path / "s.db")
    yield store
    store.close()


def spec(tenant: str = "A", t: float = 1.0, **kw: object) -> JobSpec:
    fields: dict = {"tenant": tenant, "kind": JobKind.GUARANTEE, "num_gpus": 1, "command": ("python", "x.py"),
                        "workdir": "/tmp", "submit_time": t}
    fields.update(kw)
    return JobSpec(**fields)


def test_add_job_assigns_distinct_ids_in_submission_order(storage: Storage) -> None:
    a = storage.add_job(spec(t=5.0))
    b = storage.add_job(spec(t=1.0, kind=JobKind.OPPORTUNISTIC, env=(("K", "V"),), memory_bytes=7, name="n"))
    assert a.id != b.id and a.seq < b.seq
    assert [j.id for j in storage.list_jobs()] == [a.id, b.id]  # submission order, not submit_time
    got = storage.get_job(b.id)
    assert got == b
    assert got is not None and got.state is JobStatus.QUEUED and got.env == (("K", "V"),)
    assert got.kind is JobKind.OPPORTUNISTIC and got.memory_bytes == 7 and got.name == "n"
    assert storage.get_job("job-999") is None


def test_update_job_sets_only_given_columns(storage: Storage) -> None:
    job = storage.add_job(spec())
    storage.update_job(job.id, cancel_requested=True)
    updated = storage.update_job(job.id, state=JobStatus.RUNNING, role=Role.OPPORTUNISTIC, placement=(2, 3),
                                 pid=1234, pid_start=99, job_dir="/x", started_at=3.5, launched_at=3.5)
    assert updated.cancel_requested  # an earlier write of another column survives
    assert (updated.started_at, updated.launched_at) == (3.5, 3.5)
    assert updated.state is JobStatus.RUNNING and updated.role is Role.OPPORTUNISTIC
    assert updated.placement == (2, 3) and updated.pid == 1234 and updated.pid_start == 99
    assert storage.get_job(job.id) == updated
    assert storage.update_job(job.id, launched_at=9.0).started_at == 3.5  # a migrated job's new launch
    done = storage.update_job(job.id, state="finished", exit_code=0, ended_at=4.0, role=None)
    assert done.state is JobStatus.FINISHED and done.role is None and done.exit_code == 0


def test_update_job_refuses_unknown_job_and_fixed_columns(storage: Storage) -> None:
    job = storage.add_job(spec())
    with pytest.raises(StorageError, match="no job"):
        storage.update_job("job-404", state=JobStatus.RUNNING)
    with pytest.raises(StorageError, match="tenant"):
        storage.update_job(job.id, tenant="B")
    assert storage.get_job(job.id) == job


def test_list_jobs_by_state(storage: Storage) -> None:
    a, b, c = (storage.add_job(spec()) for _ in range(3))
    storage.update_job(b.id, state=JobStatus.RUNNING)
    storage.update_job(c.id, state=JobStatus.CANCELLED)
    assert [j.id for j in storage.list_jobs([JobStatus.QUEUED])] == [a.id]
    assert [j.id for j in storage.list_jobs([JobStatus.QUEUED, JobStatus.RUNNING])] == [a.id, b.id]
    assert storage.list_jobs([JobStatus.FAILED]) == []


def test_transaction_commits_or_rolls_back_everything(storage: Storage) -> None:
    kept = storage.add_job(spec())
    with pytest.raises(RuntimeError), storage.transaction():
        storage.update_job(kept.id, state=JobStatus.RUNNING)
        lost = storage.add_job(spec())
        storage.add_event(1.0, "x", lost.id)
        storage.set_placement(kept.id, 0, 10, 0.5)
        with storage.transaction():  # nested: joins the outer one
            storage.set_quota("A", 3)
        raise RuntimeError("boom")
    assert storage.get_job(kept.id) == kept
    assert [j.id for j in storage.list_jobs()] == [kept.id]
    assert storage.events() == [] and storage.placements() == [] and storage.quotas() == {}
    with storage.transaction():
        storage.update_job(kept.id, state=JobStatus.RUNNING)
        storage.set_quota("A", 3)
    assert storage.get_job(kept.id).state is JobStatus.RUNNING  # type: ignore[union-attr]
    assert storage.quotas() == {"A": 3}


def test_events_are_ordered_filtered_and_keep_details(storage: Storage) -> None:
    a, b = storage.add_job(spec()), storage.add_job(spec())
    ids = [
        storage.add_event(1.0, "submitted", a.id, kind="guarantee", gpus=[0, 1]),  # 'kind' as a detail key
        storage.add_event(2.0, "submitted", b.id),
        storage.add_event(3.0, "daemon_started"),
        storage.add_event(4.0, "exited", a.id, exit_code=-15, reason="killed"),
    ]
    assert ids == sorted(ids) and len(set(ids)) == 4
    events = storage.events()
    assert [e.kind for e in events] == ["submitted", "submitted", "daemon_started", "exited"]
    assert events[0].detail == {"kind": "guarantee", "gpus": [0, 1]}
    assert events[2].job_id is None
    assert [e.id for e in storage.events(a.id)] == [ids[0], ids[3]]
    assert [e.id for e in storage.events(after_id=ids[1])] == ids[2:]
    assert [e.id for e in storage.events(limit=2)] == ids[:2]
    with pytest.raises(TypeError):
        storage.add_event(5.0, "bad", None, obj=object())


def test_placements_upsert_order_and_clear(storage: Storage) -> None:
    a, b = storage.add_job(spec()), storage.add_job(spec())
    storage.set_placement(b.id, 1, 100, 1.0)
    storage.set_placement(a.id, 3, 300, 0.5)
    storage.set_placement(a.id, 2, 200, 0.5)
    storage.set_placement(a.id, 3, 30, 0.05)  # update in place
    got = [(p.job_id, p.gpu, p.memory_limit_bytes, p.compute_share) for p in storage.placements()]
    assert got == [(a.id, 2, 200, 0.5), (a.id, 3, 30, 0.05), (b.id, 1, 100, 1.0)]
    assert [p.gpu for p in storage.placements(b.id)] == [1]
    storage.clear_placements(a.id)
    assert [p.job_id for p in storage.placements()] == [b.id]
    with pytest.raises(StorageError):
        storage.set_placement("job-404", 0, 1, 1.0)


def test_quotas(storage: Storage) -> None:
    storage.set_quota("B", 0)
    storage.set_quota("A", 2)
    storage.set_quota("A", 4)
    assert storage.quotas() == {"A": 4, "B": 0}


def test_prune_events_keeps_the_newest_and_ids_keep_increasing(storage: Storage) -> None:
    ids = [storage.add_event(float(i), "tick", None, i=i) for i in range(10)]
    assert storage.prune_events(keep=3) == 7
    assert [e.detail["i"] for e in storage.events()] == [7, 8, 9]
    assert storage.prune_events(keep=3) == 0
    later = storage.add_event(10.0, "tick", None, i=10)
    assert later > ids[-1]  # never reused: readers resuming after an id miss nothing new
    assert [e.detail["i"] for e in storage.events(after_id=ids[-1])] == [10]


def test_launch_fields_round_trip(storage: Storage) -> None:
    spec = JobSpec(tenant="t", kind=JobKind.AUTO, num_gpus=1, command=("x",), workdir="/", submit_time=0.0,
                   expected_steps=500, expected_duration_s=60.0)
    job = storage.add_job(spec)
    assert (job.expected_steps, job.expected_duration_s, job.launch_token) == (500, 60.0, None)
    assert storage.update_job(job.id, launch_token="abc").launch_token == "abc"


def test_share_restartable_and_migrating_round_trip(storage: Storage) -> None:
    plain = storage.add_job(spec())
    assert (plain.requested_share, plain.restartable, plain.migrating) == (None, False, False)
    job = storage.add_job(spec(requested_share=0.25, restartable=True))
    assert (job.requested_share, job.restartable, job.migrating) == (0.25, True, False)
    assert storage.update_job(job.id, migrating=True).migrating is True
    assert storage.get_job(job.id).migrating is True  # type: ignore[union-attr]
    assert storage.update_job(job.id, migrating=False).migrating is False


# -- pages of jobs (`list`) ----------------------------------------------------------------------


def ids(page: JobPage) -> list[str]:
    return [j.id for j in page.jobs]


def walk(storage: Storage, limit: int, states: Sequence[JobStatus] | None = None) -> list[list[str]]:
    """Every page, newest first, each page's cursor the previous page's next_cursor."""
    pages, cursor = [], None
    while len(pages) <= 1000:  # a page that fails to move on would loop
        page = storage.jobs_page(limit, cursor, states)
        pages.append(ids(page))
        assert page.more is (page.remaining > 0) and (page.next_cursor is None) is (not page.more)
        if not page.more:
            return pages
        assert page.next_cursor == page.jobs[0].id
        cursor = page.next_cursor
    raise AssertionError(f"no last page after {len(pages)}: {pages[-3:]}")


def test_a_page_is_the_newest_jobs_in_submission_order_and_says_what_remains(storage: Storage) -> None:
    empty = storage.jobs_page(5)
    assert (empty.jobs, empty.remaining, empty.more, empty.next_cursor) == ((), 0, False, None)
    jobs = [storage.add_job(spec()).id for _ in range(6)]  # job-1 .. job-6
    first = storage.jobs_page(4)
    assert (ids(first), first.remaining, first.more, first.next_cursor) == (jobs[2:], 2, True, jobs[2])
    last = storage.jobs_page(4, first.next_cursor)
    assert (ids(last), last.remaining, last.more, last.next_cursor) == (jobs[:2], 0, False, None)
    # Boundaries: a page that ends exactly at the oldest job, one larger than the store, limit 1.
    exact = storage.jobs_page(3, jobs[3])
    assert (ids(exact), exact.remaining, exact.next_cursor) == (jobs[:3], 0, None)
    assert (ids(storage.jobs_page(6)), storage.jobs_page(6).remaining) == (jobs, 0)
    assert (ids(storage.jobs_page(100)), storage.jobs_page(100).remaining) == (jobs, 0)
    assert [ids(storage.jobs_page(1, c)) for c in (None, jobs[5], jobs[1])] == [[jobs[5]], [jobs[4]], [jobs[0]]]
    assert walk(storage, 2) == [jobs[4:], jobs[2:4], jobs[:2]]
    assert walk(storage, 4) == [jobs[2:], jobs[:2]]
    # The cursor is a position, not a lookup: the oldest job's id gives an empty page; an id past
    # the newest (a job never submitted) the newest jobs.
    assert storage.jobs_page(3, jobs[0]) == JobPage((), 0)
    assert ids(storage.jobs_page(2, "job-999")) == jobs[4:]


def test_a_cursor_is_stable_when_jobs_are_submitted_between_pages(storage: Storage) -> None:
    """A keyset, not an offset: jobs submitted after the first page shift nothing; none is shown
    twice or skipped (with OFFSET 3 the second page would repeat job-7..9 after three submissions)."""
    old = [storage.add_job(spec()).id for _ in range(10)]
    first = storage.jobs_page(3)
    assert ids(first) == old[7:] and first.remaining == 7
    new = [storage.add_job(spec()).id for _ in range(3)]
    second = storage.jobs_page(3, first.next_cursor)
    assert ids(second) == old[4:7] and second.remaining == 4
    storage.update_job(old[2], state=JobStatus.FINISHED)  # a state change moves nothing either
    rest = walk_from(storage, 3, second.next_cursor)
    assert rest == [old[1:4], old[:1]]
    assert ids(storage.jobs_page(3)) == new  # a new first page starts at the newest


def walk_from(storage: Storage, limit: int, cursor: str | None) -> list[list[str]]:
    pages: list[list[str]] = []
    while cursor is not None and len(pages) <= 1000:
        page = storage.jobs_page(limit, cursor)
        pages.append(ids(page))
        cursor = page.next_cursor
    return pages


def test_a_state_filter_applies_before_the_page_is_cut(storage: Storage) -> None:
    jobs = [storage.add_job(spec()) for _ in range(9)]
    for j in jobs[::3]:  # job-1, job-4, job-7
        storage.update_job(j.id, state=JobStatus.FINISHED)
    storage.update_job(jobs[8].id, state=JobStatus.RUNNING)
    done = [JobStatus.FINISHED]
    first = storage.jobs_page(2, None, done)
    assert (ids(first), first.remaining, first.next_cursor) == ([jobs[3].id, jobs[6].id], 1, jobs[3].id)
    assert walk(storage, 2, done) == [[jobs[3].id, jobs[6].id], [jobs[0].id]]
    both = [JobStatus.FINISHED, JobStatus.RUNNING]
    assert walk(storage, 2, both) == [[jobs[6].id, jobs[8].id], [jobs[0].id, jobs[3].id]]
    assert walk(storage, 10, [JobStatus.QUEUED]) == [[jobs[i].id for i in (1, 2, 4, 5, 7)]]
    assert storage.jobs_page(5, None, [JobStatus.CANCELLED]) == JobPage((), 0)
    # A cursor that is not one of the filter's jobs works as well (the oldest shown may change state).
    assert ids(storage.jobs_page(5, jobs[5].id, done)) == [jobs[0].id, jobs[3].id]


@pytest.mark.parametrize("seed", range(4))
def test_pages_agree_with_reading_every_job(storage: Storage, seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(rng.choice([1, 7, 40])):
        job = storage.add_job(spec())
        storage.update_job(job.id, state=rng.choice(list(JobStatus)))
    for states in (None, [JobStatus.QUEUED], [JobStatus.FINISHED, JobStatus.FAILED], list(JobStatus)):
        everything = [j.id for j in storage.list_jobs(states)]
        for limit in (1, 3, 7, 100):
            expected = [everything[max(0, end - limit):end] for end in range(len(everything), 0, -limit)] or [[]]
            assert walk(storage, limit, states) == expected, (seed, states, limit)


@pytest.mark.parametrize("limit", [0, -1, True, 2.0, "3", None])
def test_a_page_limit_is_a_positive_integer(storage: Storage, limit: object) -> None:
    storage.add_job(spec())
    with pytest.raises(StorageError, match="page limit .* is invalid: accepted an integer >= 1"):
        storage.jobs_page(limit)  # type: ignore[arg-type]


@pytest.mark.parametrize("cursor", ["", "job-", "job-0", "job-01", "job-1x", "job-\u0661", "x-1", "JOB-1",
                                    "job-99999999999999999999", 7])
def test_a_cursor_is_a_job_id(storage: Storage, cursor: object) -> None:
    storage.add_job(spec())
    with pytest.raises(StorageError, match="is not a job id: accepted job-N"):
        storage.jobs_page(5, cursor)  # type: ignore[arg-type]


def test_a_request_id_is_recorded_once_per_submitter(storage: Storage) -> None:
    first = storage.add_job(spec(uid=1000, request_id="r-1"))
    assert first.request_id == "r-1"
    assert storage.job_by_request(1000, "r-1") == first
    assert storage.job_by_request(1001, "r-1") is None  # another user's id is another submission
    assert storage.job_by_request(1000, "r-2") is None
    with pytest.raises(StorageError, match="request id 'r-1' of uid 1000 is already recorded as job-1"):
        storage.add_job(spec(uid=1000, request_id="r-1"))
    other = storage.add_job(spec(uid=1001, request_id="r-1"))
    mine = storage.add_job(spec(request_id="r-1"))  # the daemon's own user (uid None): one per id too
    assert storage.job_by_request(None, "r-1") == mine and storage.job_by_request(1001, "r-1") == other
    with pytest.raises(StorageError, match="already recorded as job-3"):
        storage.add_job(spec(request_id="r-1"))
    assert [j.id for j in storage.list_jobs()] == ["job-1", "job-2", "job-3"]
    assert storage.add_job(spec()).request_id is None  # none given: no limit on those


@pytest.mark.parametrize("request_id", ["", "a b", "x" * 65, "é", 7])
def test_a_request_id_has_a_bounded_plain_form(storage: Storage, request_id: object) -> None:
    with pytest.raises(StorageError, match="request id .* is invalid: accepted 1-64 characters"):
        storage.add_job(spec(request_id=request_id))
    assert storage.list_jobs() == []
