"""scheduler_lite.auth: who may submit where, cancel and read logs; table-driven, no users needed."""

from __future__ import annotations

import pytest

from scheduler_lite.auth import (
    AccessDenied,
    AccessPolicy,
    Identity,
    TenantMembers,
    check_owner,
    check_served,
    check_submit,
    is_admin,
    tenants_of,
)

ROOT = Identity(0, 0, "root", frozenset({"root"}))
ALICE = Identity(1001, 100, "alice", frozenset({"users", "vision"}))
BOB = Identity(1002, 100, "bob", frozenset({"users"}))
CAROL = Identity(1003, 100, "carol", frozenset({"users", "ops"}))  # admin through her group
DAVE = Identity(1004, 100, "dave", frozenset({"users"}))  # admin by name

POLICY = AccessPolicy(
    daemon_uid=0, daemon_user="root",
    members=(
        TenantMembers("vision", users=frozenset(), groups=frozenset({"vision"})),
        TenantMembers("nlp", users=frozenset({"bob"})),
        TenantMembers("shared"),  # names nobody: open to every local user
    ),
    admins=frozenset({"dave"}), admin_groups=frozenset({"ops"}),
)


@pytest.mark.parametrize(("who", "tenant", "allowed"), [
    (ALICE, "vision", True),  # through her group
    (ALICE, "nlp", False),
    (ALICE, "shared", True),
    (BOB, "vision", False),
    (BOB, "nlp", True),  # by name
    (CAROL, "nlp", True),  # admins submit anywhere
    (DAVE, "vision", True),
    (ROOT, "nlp", True),
])
def test_submit_to_a_tenant(who: Identity, tenant: str, allowed: bool) -> None:
    if allowed:
        assert check_submit(POLICY, who, tenant) == tenant
    else:
        with pytest.raises(AccessDenied, match=f"user '{who.user}' may not submit to tenant '{tenant}'"):
            check_submit(POLICY, who, tenant)


@pytest.mark.parametrize(("who", "expected"), [
    (ALICE, ("vision", "shared")), (BOB, ("nlp", "shared")), (CAROL, ("vision", "nlp", "shared")),
])
def test_tenants_of(who: Identity, expected: tuple[str, ...]) -> None:
    assert tenants_of(POLICY, who) == expected


@pytest.mark.parametrize(("who", "tenant", "result"), [
    (ALICE, None, "--tenant is required; your tenants: vision, shared"),
    (ALICE, "nope", "unknown tenant 'nope'; tenants: vision, nlp, shared"),
])
def test_submit_without_or_with_an_unknown_tenant(who: Identity, tenant: str | None, result: str) -> None:
    with pytest.raises(AccessDenied) as refused:
        check_submit(POLICY, who, tenant)
    assert str(refused.value) == result


def test_the_only_tenant_is_taken_when_none_is_given() -> None:
    only = AccessPolicy(0, "root", (TenantMembers("nlp", users=frozenset({"bob"})),))
    assert check_submit(only, BOB, None) == "nlp"
    with pytest.raises(AccessDenied, match="belongs to no tenant"):
        check_submit(only, ALICE, None)


@pytest.mark.parametrize(("who", "owner_uid", "allowed"), [
    (ALICE, ALICE.uid, True),
    (BOB, ALICE.uid, False),
    (BOB, None, False),  # a library submission (no owner): the daemon's user (root here) and admins
    (CAROL, ALICE.uid, True),
    (DAVE, ALICE.uid, True),
    (ROOT, BOB.uid, True),
])
@pytest.mark.parametrize("action", ["cancel", "read the logs of"])
def test_cancel_and_logs_of_a_job(who: Identity, owner_uid: int | None, allowed: bool, action: str) -> None:
    if allowed:
        check_owner(POLICY, who, action, "job-1", owner_uid, "alice")
    else:
        with pytest.raises(AccessDenied, match=f"user '{who.user}' may not {action} job-1: it belongs to 'alice'"):
            check_owner(POLICY, who, action, "job-1", owner_uid, "alice")


@pytest.mark.parametrize(("who", "admin"), [(ROOT, True), (ALICE, False), (CAROL, True), (DAVE, True)])
def test_admins(who: Identity, admin: bool) -> None:
    assert is_admin(POLICY, who) is admin


def test_a_daemon_not_run_as_root_serves_only_its_own_user() -> None:
    mine = AccessPolicy(ALICE.uid, "alice", (TenantMembers("shared"),))
    assert not mine.multi_user
    check_served(mine, ALICE)
    check_owner(mine, ALICE, "cancel", "job-1", None, "")  # a library submission is the daemon user's
    with pytest.raises(AccessDenied, match=r"runs as 'alice' \(uid 1001, not root\) and serves only that user"):
        check_served(mine, BOB)
    with pytest.raises(AccessDenied, match="serves only"):
        check_submit(mine, BOB, "shared")
    with pytest.raises(AccessDenied, match="serves only"):
        check_owner(mine, BOB, "cancel", "job-1", BOB.uid, "bob")
