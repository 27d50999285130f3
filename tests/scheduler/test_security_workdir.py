"""`--workdir` is resolved by the submitter, never by root (docs/security.md, docs/scheduler.md).

The server runs `cd -P -- "$1" && pwd -P` as the submitter and stores what that printed: a
logical `cd` removes `x/..` as text and would pass `private/link/../..` without searching
`private`, and root resolving the same string afterwards would follow `link` where the
submitter cannot (storing, and showing to everyone, a name inside `private`; or answering
differently for a path that exists and one that does not).

The tests that submit as another user need root (they use uid 65534, "nobody").
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler_lite.auth import AccessPolicy, TenantMembers, identity_of_uid
from scheduler_lite.daemon import Daemon
from scheduler_lite.server import Server
from scheduler_lite.storage import MemoryStorage
from scheduler_lite.submission import SubmitError, make_job_spec
from tests.scheduler.test_daemon_fakes import make_config

ME = identity_of_uid(os.getuid())
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: submits as uid 65534")


@pytest.fixture
def server(tmp_path: Path) -> Server:
    config = make_config(tmp_path / "state")
    # As a root daemon serving everyone when the tests run as root (CI), else as a user's own.
    policy = AccessPolicy(os.geteuid(), ME.user, (TenantMembers("A"),))
    return Server(Daemon(config, MemoryStorage()), config, policy)


@pytest.fixture
def tree() -> Iterator[Path]:
    """base/ (0755, root's)
         private/ (0700)  s1/s2/s3/s4/   current -> private/s1/s2/s3/s4
         hidden/ (0700)   exists/
         pub/ (0755)      real/deep/     link -> pub/real     deep-link -> pub/real/deep
    """
    base = Path(tempfile.mkdtemp(prefix="sl-workdir-"))  # not under pytest's 0700 tmp_path: others must reach it
    os.chmod(base, 0o755)
    (base / "private" / "s1" / "s2" / "s3" / "s4").mkdir(parents=True)
    (base / "private" / "current").symlink_to(base / "private" / "s1" / "s2" / "s3" / "s4")
    os.chmod(base / "private", 0o700)
    (base / "hidden" / "exists").mkdir(parents=True)
    os.chmod(base / "hidden", 0o700)
    (base / "pub" / "real" / "deep").mkdir(parents=True)
    (base / "pub" / "link").symlink_to(base / "pub" / "real")
    (base / "pub" / "deep-link").symlink_to(base / "pub" / "real" / "deep")
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def submit(server: Server, who_uid: int, workdir: str) -> dict[str, object]:
    return server.handle(identity_of_uid(who_uid), "submit",
                         {"command": ["/bin/true"], "tenant": "A", "workdir": workdir, "env": []})


@needs_root
def test_dot_dot_after_a_link_in_a_private_directory_reveals_nothing(server: Server, tree: Path) -> None:
    """The reviewer's case: `private/current/../../..` (private 0700, current a link inside it)
    was accepted and stored as `private/s1`, a name only its owner may see."""
    server.policy = AccessPolicy(0, "root", server.policy.members)
    workdir = f"{tree}/private/current/../../.."
    answer = submit(server, 65534, workdir)
    assert answer == {"ok": False, "error": f"--workdir {workdir!r}: user 'nobody' cannot enter it (accepted a "
                      "directory the submitter can search, and every directory above it)"}
    assert server.daemon.storage.list_jobs() == []


@needs_root
def test_a_path_through_an_unreadable_directory_gets_one_answer_whether_it_exists_or_not(
        server: Server, tree: Path) -> None:
    """`hidden/exists/../../pub` and `hidden/nothere/../../pub` were told apart (accepted vs "not a
    directory"): an existence oracle for names in a directory the submitter cannot search."""
    server.policy = AccessPolicy(0, "root", server.policy.members)
    answers = {}
    for name in ("exists", "nothere"):
        workdir = f"{tree}/hidden/{name}/../../pub"
        answer = submit(server, 65534, workdir)
        assert answer["ok"] is False, answer
        answers[name] = str(answer["error"]).replace(workdir, "<workdir>")
    assert answers["exists"] == answers["nothere"] == (
        "--workdir '<workdir>': user 'nobody' cannot enter it (accepted a directory the submitter can search, "
        "and every directory above it)")
    assert server.daemon.storage.list_jobs() == []


@needs_root
def test_another_user_s_workdir_is_stored_as_its_own_shell_resolved_it(server: Server, tree: Path) -> None:
    server.policy = AccessPolicy(0, "root", server.policy.members)
    for given, physical in ((f"{tree}/pub/link", f"{tree}/pub/real"),
                            (f"{tree}/pub/deep-link/..", f"{tree}/pub/real"),  # physical `..`: real, not pub
                            (f"{tree}/pub", f"{tree}/pub")):
        answer = submit(server, 65534, given)
        assert answer["ok"], answer
        record = server.daemon.storage.get_job(answer["result"]["id"])  # type: ignore[index]
        assert record is not None and (record.workdir, record.uid) == (physical, 65534), given


def test_the_daemon_s_own_user_gets_the_same_resolution_and_the_same_refusal(server: Server, tree: Path) -> None:
    answer = submit(server, os.getuid(), f"{tree}/pub/deep-link/..")
    assert answer["ok"], answer
    record = server.daemon.storage.get_job(answer["result"]["id"])  # type: ignore[index]
    assert record is not None and record.workdir == f"{tree}/pub/real"
    missing = f"{tree}/pub/absent"
    assert submit(server, os.getuid(), missing) == {
        "ok": False, "error": f"--workdir {missing!r}: user {ME.user!r} cannot enter it (accepted a directory the "
                              "submitter can search, and every directory above it)"}


def test_make_job_spec_does_not_look_at_a_resolved_workdir(tmp_path: Path) -> None:
    """The server's probe resolved it as the submitter: the daemon stores it without a look of its own."""
    config = make_config(tmp_path / "state")
    spec = make_job_spec(config, ["/bin/true"], tenant="A", workdir="/no/such/dir", workdir_resolved=True)
    assert spec.workdir == "/no/such/dir"
    with pytest.raises(SubmitError, match="--workdir 'rel' is invalid: accepted an absolute path"):
        make_job_spec(config, ["/bin/true"], tenant="A", workdir="rel", workdir_resolved=True)
    with pytest.raises(SubmitError, match="is not a directory"):  # the library's own submissions still check
        make_job_spec(config, ["/bin/true"], tenant="A", workdir="/no/such/dir")
