"""Who may do what (docs/security.md): pure functions over a caller's identity and the config.

The daemon learns the caller's uid from the socket (SO_PEERCRED, scheduler_lite.server) and looks
up its user name and groups in the system's user database; these functions then decide. Nothing
here trusts a name or a tenant that the client claims.

Rules:
  * A daemon that does not run as root serves only its own user (`SingleUser`): any other caller
    is refused, because it could not run that caller's jobs as that caller.
  * Admins: root, the users named in `access.admins` and the members of `access.admin_groups`.
    An admin may submit to any tenant and cancel or read the logs of any job.
  * A tenant that names `users` and/or `groups` accepts submissions from those users and the
    members of those groups only; a tenant that names neither is open to every local user.
  * Cancel and logs: the job's owner (the uid that submitted it) or an admin.
  * list, show, status, tenants: every caller the daemon serves (a shared box is visible to its
    users); `show` hides the values of another user's `--env` (they may hold tokens).
"""

from __future__ import annotations

import grp
import os
import pwd
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

ROOT_UID: Final = 0


class AccessDenied(PermissionError):
    """A request the caller may not make; the message is one line saying why and what is allowed."""


@dataclass(frozen=True, slots=True)
class Identity:
    """A caller as the daemon established it: uid from the kernel, names from the user database."""

    uid: int
    gid: int
    user: str
    groups: frozenset[str] = frozenset()  # names of all its groups, the primary one included


@dataclass(frozen=True, slots=True)
class TenantMembers:
    tenant: str
    users: frozenset[str] = frozenset()
    groups: frozenset[str] = frozenset()  # neither users nor groups: open to every local user


@dataclass(frozen=True, slots=True)
class AccessPolicy:
    daemon_uid: int
    daemon_user: str
    members: tuple[TenantMembers, ...] = ()
    admins: frozenset[str] = frozenset()
    admin_groups: frozenset[str] = frozenset()

    @property
    def multi_user(self) -> bool:
        """Root: serves every local user and runs their jobs as them."""
        return self.daemon_uid == ROOT_UID

    def tenant(self, name: str) -> TenantMembers | None:
        return next((m for m in self.members if m.tenant == name), None)


def check_served(policy: AccessPolicy, who: Identity) -> None:
    if not policy.multi_user and who.uid != policy.daemon_uid:
        raise AccessDenied(
            f"this daemon runs as {policy.daemon_user!r} (uid {policy.daemon_uid}, not root) and serves only "
            f"that user; you are {who.user!r} (uid {who.uid}). Run your own daemon, or ask for one run as root"
        )


def is_admin(policy: AccessPolicy, who: Identity) -> bool:
    return who.uid == ROOT_UID or who.user in policy.admins or bool(who.groups & policy.admin_groups)


def may_submit(policy: AccessPolicy, who: Identity, tenant: str) -> bool:
    members = policy.tenant(tenant)
    if members is None:
        return False
    is_open = not members.users and not members.groups
    return is_open or is_admin(policy, who) or who.user in members.users or bool(who.groups & members.groups)


def tenants_of(policy: AccessPolicy, who: Identity) -> tuple[str, ...]:
    """The tenants `who` may submit to, in config order."""
    return tuple(m.tenant for m in policy.members if may_submit(policy, who, m.tenant))


def check_submit(policy: AccessPolicy, who: Identity, tenant: str | None) -> str:
    """The tenant the submission goes to (the caller's only one when not given); AccessDenied if not allowed."""
    check_served(policy, who)
    mine = tenants_of(policy, who)
    if tenant is None:
        if len(mine) == 1:
            return mine[0]
        if not mine:
            raise AccessDenied(f"user {who.user!r} belongs to no tenant; ask an admin to add you to one")
        raise AccessDenied("--tenant is required; your tenants: " + ", ".join(mine))
    if policy.tenant(tenant) is None:
        raise AccessDenied(f"unknown tenant {tenant!r}; tenants: " + ", ".join(m.tenant for m in policy.members))
    if not may_submit(policy, who, tenant):
        raise AccessDenied(f"user {who.user!r} may not submit to tenant {tenant!r}; your tenants: "
                           + (", ".join(mine) or "none"))
    return tenant


def check_owner(policy: AccessPolicy, who: Identity, action: str, job_id: str, owner_uid: int | None,
                owner: str) -> None:
    """`action` ("cancel", "read the logs of") on a job: its owner or an admin.

    A job without a recorded owner (submitted through the library, `Daemon.submit`) belongs to the
    daemon's user.
    """
    check_served(policy, who)
    owner_uid = policy.daemon_uid if owner_uid is None else owner_uid
    if is_admin(policy, who) or owner_uid == who.uid:
        return
    raise AccessDenied(f"user {who.user!r} may not {action} {job_id}: it belongs to {owner or 'another user'!r} "
                       "(only its owner and admins may)")


# ----------------------------------------------------------------------------------------------
# The system's user database (not pure: kept apart from the rules above).


def identity_of_uid(uid: int, gid: int | None = None) -> Identity:
    """The identity of a uid from the user database; a uid without an entry gets no groups but its own."""
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return Identity(uid, uid if gid is None else gid, f"uid:{uid}", frozenset())
    primary = entry.pw_gid
    try:
        gids: Iterable[int] = os.getgrouplist(entry.pw_name, primary)
    except OSError:
        gids = (primary,)
    return Identity(uid, primary, entry.pw_name, frozenset(_group_name(g) for g in gids))


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return f"gid:{gid}"


__all__ = ["AccessDenied", "AccessPolicy", "Identity", "TenantMembers", "check_owner", "check_served",
           "check_submit", "identity_of_uid", "is_admin", "may_submit", "tenants_of"]
