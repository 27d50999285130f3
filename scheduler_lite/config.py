"""The daemon's TOML configuration (docs/scheduler.md), parsed once into frozen, validated objects.

    config = load_config(Path("scheduler.toml"))

Every rejection is a `ConfigError` whose field is the key path in the file
(`devices.emulated[1].memory`, `coordinator.floor_share`) and whose message gives the accepted
range. `[jobs]`, `[daemon]`, `[scheduler]`, `[coordinator]` and `[migration]` are passed through to their
config classes (the policies' own in scheduler_lite/policy/) and validated by them, so each range lives in one place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import grp
import os
import pwd
import re
import stat
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Final, TypeVar

from scheduler_lite.auth import TenantMembers
from scheduler_lite.cluster.config import ClusterConfig, check_fencing, parse_cluster
from scheduler_lite.containment import CONTAINMENT_MODES
from scheduler_lite.model import Tenant
from scheduler_lite.policy.coordinator import CoordinatorConfig
from scheduler_lite.policy.global_scheduler import SchedulerConfig
from scheduler_lite.policy.migration import MigrationConfig
from scheduler_lite.policy.validation import ConfigError, check_choice, check_int, check_name, check_range
from tf_antman.units import parse_bytes

VERSION: Final = 1
SUPPORTED_VERSIONS: Final = (1,)
CONFIG_ENV: Final = "SCHEDULER_LITE_CONFIG"
DEVICE_KINDS: Final = ("emulated", "nvml")
MIB: Final = 1 << 20
MIN_DEVICE_BYTES: Final = 64 * MIB  # ANTMAN_DEVICE_MEMORY's lower bound (docs/configuration.md)
MAX_BYTES: Final = 1 << 50
MAX_GPU_OVERHEAD_BYTES: Final = 64 << 30  # jobs.gpu_overhead_bytes: more than any GPU's context and libraries
MAX_CONFIG_BYTES: Final = 1 << 20  # a config file's size: a real one is a few KiB
MAX_DEVICE_ID: Final = 1023  # a GPU id of this machine (a job sees its GPUs as 0.. through ANTMAN_DEVICE_ID)
C = TypeVar("C")
SOCKET_FILE: Final = "scheduler.sock"
MAX_SOCKET_PATH_BYTES: Final = 107  # sockaddr_un.sun_path is 108 bytes with its NUL (Linux)
PRIORITIES: Final = ("low", "normal")  # jobs.opportunistic_priority
MISBEHAVIOUR_ACTIONS: Final = ("warn", "stop", "requeue")  # jobs.misbehaviour (scheduler_lite.misbehaviour)
# POSIX portable user and group names (useradd's default NAME_REGEX, without the trailing '$').
_ACCOUNT_RE: Final = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
ACCOUNT_RULE: Final = "a list of user or group names (1-32 of a-z, 0-9, '_', '-', starting with a letter or '_')"


@dataclass(frozen=True, slots=True)
class EmulatedDevice:
    id: int
    memory_bytes: int
    nvlink_group: str


@dataclass(frozen=True, slots=True)
class DevicesConfig:
    kind: str  # "emulated" | "nvml"
    emulated: tuple[EmulatedDevice, ...] = ()
    nvml_ids: tuple[int, ...] | None = None  # None: every GPU NVML reports


@dataclass(frozen=True, slots=True)
class JobsConfig:
    # ANTMAN_HOST_MEMORY of every job: host memory universal memory may use past the limit.
    host_memory_bytes: int = 8 << 30
    # SIGTERM, then SIGKILL after this long: long enough for a checkpoint on exit.
    cancel_grace_s: float = 10.0
    # ANTMAN_DEVICE_PRIORITY of opportunistic jobs on emulated devices (tf_antman/priority.py).
    opportunistic_priority: str = "low"  # one of PRIORITIES
    # Each job in a cgroup of its own (scheduler_lite.containment): "auto" where the daemon can
    # create cgroups, "required" (serve refuses to start without), "off".
    containment: str = "auto"
    # A job that does not cooperate (scheduler_lite.misbehaviour): "warn" (an event, a warning in
    # `status`, a log line), "stop" (opportunistic jobs are also stopped: SIGTERM, SIGKILL
    # after cancel_grace_s) or "requeue" (stopped so, then back in their queue as never run);
    # guarantee jobs are only warned about.
    misbehaviour: str = "warn"
    # A job with no new stats.json for this long is reported `silent`.
    silent_after_s: float = 60.0
    # NVML's bytes of a job a GPU may show past its memory limit before it is `over_limit`: the
    # CUDA context and library workspaces (cuBLAS, cuDNN), which no framework allocator hands out
    # and the limit does not govern. Measured 0.77 GiB on an H200 with PyTorch 2.11 training
    # ResNet-50 (bench/gpu_colocate.py, 2026-11-27); the coordinator counts them as taken anyway.
    # In the file: bytes or a size such as "1GiB".
    gpu_overhead_bytes: int = 1 << 30

    def validate(self) -> JobsConfig:
        check_range("cancel_grace_s", self.cancel_grace_s, 0.0, 3600.0)
        check_choice("opportunistic_priority", self.opportunistic_priority, PRIORITIES)
        check_choice("containment", self.containment, CONTAINMENT_MODES)
        check_choice("misbehaviour", self.misbehaviour, MISBEHAVIOUR_ACTIONS)
        check_range("silent_after_s", self.silent_after_s, 1.0, 86400.0)
        check_int("gpu_overhead_bytes", self.gpu_overhead_bytes, 0, MAX_GPU_OVERHEAD_BYTES)
        return self


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    # Latency of everything the daemon does (pick up a submission, notice an exit, read stats).
    tick_interval_s: float = 0.5
    # A global pass runs on every event, and this often while jobs wait (utilisation drifts).
    schedule_interval_s: float = 5.0
    # The paper's "GPU utilisation over the last 10 s" for the opportunistic threshold M.
    utilisation_window_s: float = 10.0

    def validate(self) -> DaemonConfig:
        check_range("tick_interval_s", self.tick_interval_s, 0.01, 60.0)
        check_range("schedule_interval_s", self.schedule_interval_s, 0.01, 3600.0)
        check_range("utilisation_window_s", self.utilisation_window_s, 0.1, 3600.0)
        return self


@dataclass(frozen=True, slots=True)
class AccessConfig:
    """Who may use which tenant, and who administers (scheduler_lite.auth applies it)."""

    members: tuple[TenantMembers, ...] = ()  # per tenant: its users and groups (none: open to all)
    admins: tuple[str, ...] = ()
    admin_groups: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Config:
    version: int
    state_dir: Path
    devices: DevicesConfig
    tenants: tuple[Tenant, ...]
    jobs: JobsConfig = field(default_factory=JobsConfig)
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    source: str = "<memory>"
    access: AccessConfig = field(default_factory=AccessConfig)
    cluster: ClusterConfig | None = None  # [cluster]: cluster mode (scheduler_lite.cluster); None: one machine
    # Re-placing restartable opportunistic jobs held below a share (policy/migration.py).
    migration: MigrationConfig = field(default_factory=MigrationConfig)
    # `state_dir` as the config writes it (absolute, `~` expanded, links not followed): where a
    # planted symbolic link shows (scheduler_lite.state_dir); None: the same as state_dir.
    state_dir_as_written: Path | None = None

    @property
    def db_path(self) -> Path:
        return self.state_dir / "scheduler.db"

    @property
    def jobs_dir(self) -> Path:
        return self.state_dir / "jobs"

    @property
    def socket_path(self) -> Path:
        """The daemon's Unix socket: every client command goes through it (scheduler_lite.server)."""
        return self.state_dir / SOCKET_FILE

    def tenant(self, name: str) -> Tenant | None:
        return next((t for t in self.tenants if t.name == name), None)


# ----------------------------------------------------------------------------------------------


def read_config_file(path: Path) -> str:
    """The text of a config file: a regular file (links to one are followed) of at most
    MAX_CONFIG_BYTES. Opened without blocking and checked before a byte is read: a FIFO would
    hang `serve` and every client until someone wrote to it, and /dev/zero would be read until
    memory ran out. ConfigError (one line) for anything else; OSError if it cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise ConfigError(str(path), "<file>", f"a regular file of at most {MAX_CONFIG_BYTES} bytes (this is "
                              f"{_file_kind(found.st_mode)})")
        data = os.read(fd, MAX_CONFIG_BYTES + 1)  # a regular file: O_NONBLOCK changes nothing here
        if len(data) > MAX_CONFIG_BYTES:
            raise ConfigError(str(path), "<file>", f"a regular file of at most {MAX_CONFIG_BYTES} bytes (this one "
                              f"is {max(found.st_size, len(data))} bytes or more)")
    finally:
        os.close(fd)
    return data.decode("utf-8")


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def load_config(path: Path) -> Config:
    """Read and validate a config file; ConfigError for a bad value, OSError if unreadable."""
    try:
        data = tomllib.loads(read_config_file(path))
    except OSError as err:
        # Say which file it is: "No such file or directory: nope.toml" does not (same errno, so
        # the same exception class: callers catching FileNotFoundError still do).
        raise OSError(err.errno, f"config file {path}: {err.strerror or err}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(str(path), "<file>", f"valid TOML ({err})") from None
    except UnicodeDecodeError as err:
        raise ConfigError(str(path), "<file>", f"UTF-8 text (byte {err.start} is not)") from None
    return parse_config(data, base_dir=path.resolve().parent, source=str(path))


def load_default_config() -> Config:
    """The packaged default (one emulated 4 GiB device, one tenant), state under the user's home."""
    text = resources.files("scheduler_lite.data").joinpath("default_config.toml").read_text(encoding="utf-8")
    return parse_config(tomllib.loads(text), base_dir=Path.home(), source="<default>")


def file_identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the file at `path`, None if there is none (or it cannot be reached): the
    daemon checks that its state directory's files are still the ones it started with, and the
    server removes its socket only while the path is still that socket."""
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_dev, found.st_ino


def resolve_config(path: str | None) -> Config:
    """--config FILE, else $SCHEDULER_LITE_CONFIG, else the packaged default."""
    chosen = path or os.environ.get(CONFIG_ENV)
    return load_config(Path(chosen)) if chosen else load_default_config()


def parse_config(data: Mapping[str, Any], base_dir: Path, source: str = "<memory>") -> Config:
    root = _Table(data, "")
    version = root.take("version", required=True)
    if isinstance(version, bool) or version not in SUPPORTED_VERSIONS:
        raise ConfigError("version", version, "one of " + ", ".join(map(str, SUPPORTED_VERSIONS)))

    paths = root.table("paths")
    state = paths.take("state_dir", required=True)
    if not isinstance(state, str) or not state.strip() or "\0" in state:
        raise ConfigError(paths.path("state_dir"), state, "a directory path (relative to the config file)")
    as_written = base_dir / Path(state).expanduser()
    state_dir = as_written.resolve()
    # The socket lives there: a Unix socket's path is at most 107 bytes, else every command
    # would fail later with "AF_UNIX path too long", naming no setting.
    socket_bytes = len(os.fsencode(state_dir / SOCKET_FILE))
    if socket_bytes > MAX_SOCKET_PATH_BYTES:
        raise ConfigError(paths.path("state_dir"), state,
                          f"a directory whose path (here {state_dir}) leaves room for the socket "
                          f"{SOCKET_FILE!r}: at most {MAX_SOCKET_PATH_BYTES - len(SOCKET_FILE) - 1} bytes")
    paths.finish()

    devices = _devices(root.table("devices"))
    tenants, members = _tenants(root.take("tenants", required=True))
    access = _access(root.table("access", required=False), members)
    jobs = _pass_through(root.table("jobs", required=False), JobsConfig,
                         sizes={"host_memory_bytes": MAX_BYTES, "gpu_overhead_bytes": MAX_GPU_OVERHEAD_BYTES},
                         keys={"host_memory_bytes": "host_memory"})
    daemon = _pass_through(root.table("daemon", required=False), DaemonConfig)
    scheduler = _pass_through(root.table("scheduler", required=False), SchedulerConfig)
    coordinator = _pass_through(
        root.table("coordinator", required=False), CoordinatorConfig, sizes={"min_memory_bytes": MAX_BYTES}
    )
    cluster_value = root.take("cluster")
    cluster = None
    if cluster_value is not None:
        ids = ([(f"devices.emulated[{i}].id", d.id) for i, d in enumerate(devices.emulated)]
               + [(f"devices.ids[{i}]", d) for i, d in enumerate(devices.nvml_ids or ())])
        cluster = parse_cluster(cluster_value, base_dir, [t.name for t in tenants], ids)
        check_fencing(cluster, daemon.tick_interval_s)
    migration = _pass_through(root.table("migration", required=False), MigrationConfig)
    root.finish()
    return Config(version, state_dir, devices, tenants, jobs, daemon, scheduler, coordinator, source, access,
                  cluster, migration, as_written if as_written.is_absolute() else Path.cwd() / as_written)


# ----------------------------------------------------------------------------------------------


class _Table:
    """One TOML table; remembers which keys were read so that unknown (misspelt) ones are refused."""

    def __init__(self, data: object, path: str) -> None:
        if not isinstance(data, Mapping):
            raise ConfigError(path or "<root>", _short(data), "a table")
        self.data = data
        self.prefix = path
        self.read: list[str] = []

    def path(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def take(self, key: str, required: bool = False, default: object = None) -> Any:
        self.read.append(key)
        if key not in self.data:
            if required:
                raise ConfigError(self.path(key), None, "a value (the key is required)")
            return default
        return self.data[key]

    def table(self, key: str, required: bool = True) -> _Table:
        value = self.take(key, required=required, default={})
        return _Table(value, self.path(key))

    def finish(self, accepted: list[str] | None = None) -> None:
        unknown = sorted(set(self.data) - set(self.read))
        if unknown:
            keys = accepted or self.read
            raise ConfigError(self.path(unknown[0]), "<unknown key>", "one of " + ", ".join(keys))


def _short(value: object) -> object:
    text = repr(value)
    return value if len(text) <= 60 else text[:57] + "..."


def _size(field: str, value: object, low: int, high: int) -> int:
    accepted = f"bytes (an integer) or a size such as \"4GiB\", in [{low}, {high}] bytes"
    given = value
    if isinstance(value, str):
        try:
            value = parse_bytes(value)
        except ValueError:
            raise ConfigError(field, given, accepted) from None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(field, given, accepted)
    return value


def _devices(t: _Table) -> DevicesConfig:
    kind = t.take("kind", required=True)
    check_choice(t.path("kind"), kind, DEVICE_KINDS)
    entries = t.take("emulated", default=[])
    ids_value = t.take("ids")
    t.finish()
    if kind == "nvml":
        if entries:
            raise ConfigError(t.path("emulated"), "<tables>", "nothing when devices.kind = \"nvml\"")
        ids = None
        if ids_value is not None:
            if not isinstance(ids_value, list) or not ids_value:
                raise ConfigError(t.path("ids"), ids_value, "a non-empty list of NVML GPU indices")
            for i, v in enumerate(ids_value):
                check_int(f"{t.path('ids')}[{i}]", v, 0, MAX_DEVICE_ID)
            if len(set(ids_value)) != len(ids_value):
                raise ConfigError(t.path("ids"), ids_value, "each GPU index once")
            ids = tuple(ids_value)
        return DevicesConfig(kind, (), ids)
    if ids_value is not None:
        raise ConfigError(t.path("ids"), ids_value, "nothing when devices.kind = \"emulated\"")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(t.path("emulated"), _short(entries), "at least one [[devices.emulated]] table")
    devices = []
    seen: set[int] = set()
    for i, entry in enumerate(entries):
        e = _Table(entry, f"{t.path('emulated')}[{i}]")
        dev_id = e.take("id", default=i)
        check_int(e.path("id"), dev_id, 0, MAX_DEVICE_ID)
        if dev_id in seen:
            raise ConfigError(e.path("id"), dev_id, "a device id not used by another device")
        seen.add(dev_id)
        memory = _size(e.path("memory"), e.take("memory", required=True), MIN_DEVICE_BYTES, MAX_BYTES)
        group = check_name(e.path("nvlink_group"), e.take("nvlink_group", default="local"))
        e.finish()
        devices.append(EmulatedDevice(dev_id, memory, group))
    return DevicesConfig(kind, tuple(devices))


def _tenants(value: object) -> tuple[tuple[Tenant, ...], tuple[TenantMembers, ...]]:
    if not isinstance(value, list) or not value:
        raise ConfigError("tenants", _short(value), "at least one [[tenants]] table")
    out = []
    members = []
    for i, entry in enumerate(value):
        t = _Table(entry, f"tenants[{i}]")
        name = check_name(t.path("name"), t.take("name", required=True))
        if any(x.name == name for x in out):
            raise ConfigError(t.path("name"), name, "a name not used by another tenant")
        quota = t.take("gpu_quota", required=True)
        check_int(t.path("gpu_quota"), quota, 0, 4096)
        users = _accounts(t.path("users"), t.take("users", default=[]))
        groups = _accounts(t.path("groups"), t.take("groups", default=[]))
        t.finish()
        out.append(Tenant(name, quota))
        members.append(TenantMembers(name, frozenset(users), frozenset(groups)))
    return tuple(out), tuple(members)


def _accounts(field: str, value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and _ACCOUNT_RE.match(v) for v in value):
        raise ConfigError(field, _short(value), ACCOUNT_RULE)
    return tuple(value)


def check_accounts(config: Config) -> None:
    """Refuse (ConfigError naming the field) a tenant's `users`/`groups` or an `access` name that
    no account on this machine has: a typo would otherwise lock its person out of the tenant, or
    leave the daemon without its admin, silently. Checked by `serve` (the daemon's machine decides
    who exists), not by the pure parser: clients and the simulator read the same file."""
    checks: list[tuple[str, frozenset[str] | tuple[str, ...], bool]] = []
    for i, members in enumerate(config.access.members):  # in the order of [[tenants]]
        checks += [(f"tenants[{i}].users", members.users, True), (f"tenants[{i}].groups", members.groups, False)]
    checks += [("access.admins", config.access.admins, True), ("access.admin_groups", config.access.admin_groups, False)]
    for field_name, names, is_user in checks:
        for name in sorted(names):
            try:
                pwd.getpwnam(name) if is_user else grp.getgrnam(name)
            except KeyError:
                what = "user" if is_user else "group"
                raise ConfigError(field_name, name, f"names of {what}s that exist on this machine (no {what} "
                                  f"{name!r}: `getent {'passwd' if is_user else 'group'} {name}` finds none)") from None


def _access(t: _Table, members: tuple[TenantMembers, ...]) -> AccessConfig:
    admins = _accounts(t.path("admins"), t.take("admins", default=[]))
    admin_groups = _accounts(t.path("admin_groups"), t.take("admin_groups", default=[]))
    t.finish()
    return AccessConfig(members, admins, admin_groups)


def _pass_through(t: _Table, cls: type[C], sizes: Mapping[str, int] | None = None,
                  keys: Mapping[str, str] | None = None) -> C:
    """Keys map onto the config class's fields (`keys`: field -> key where the file names it
    otherwise; `sizes`: fields given in bytes or as "4GiB", each with its largest value); its own
    validate() checks the ranges (a string field's among its choices)."""
    names = {f.name: (keys or {}).get(f.name, f.name) for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    defaults = cls()
    changes: dict[str, Any] = {}
    for name, key in names.items():
        if key not in t.data:
            continue
        value = t.take(key)
        default = getattr(defaults, name)
        if sizes and name in sizes:
            value = _size(t.path(key), value, 0, sizes[name])
        elif isinstance(default, bool):
            if not isinstance(value, bool):
                raise ConfigError(t.path(key), value, "true or false")
        elif isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            with contextlib.suppress(OverflowError):  # too large for a float: validate() names the range
                value = float(value)
        changes[name] = value
    t.finish(list(names.values()))
    config = dataclasses.replace(defaults, **changes)  # type: ignore[type-var]
    try:
        return config.validate()  # type: ignore[attr-defined,no-any-return]
    except ConfigError as err:
        raise ConfigError(t.path(err.field), err.value, err.accepted) from None
