"""The daemon's TOML config: every rejection names the key path and the accepted range."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from scheduler_lite.config import load_config, load_default_config, parse_config
from scheduler_lite.policy.validation import ConfigError

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "scheduler.toml"


def base() -> dict:
    return {
        "version": 1,
        "paths": {"state_dir": "state"},
        "devices": {"kind": "emulated", "emulated": [{"id": 0, "memory": "2GiB"}]},
        "tenants": [{"name": "A", "gpu_quota": 1}],
    }


def test_example_and_default_configs_load(tmp_path: Path) -> None:
    config = load_config(EXAMPLE)
    assert [(d.id, d.memory_bytes, d.nvlink_group) for d in config.devices.emulated] == [
        (0, 2 << 30, "pair0"), (1, 2 << 30, "pair0")]
    assert [(t.name, t.gpu_quota) for t in config.tenants] == [("research", 1), ("batch", 0)]
    assert config.state_dir == (REPO / "out" / "scheduler-state").resolve()  # relative to the file
    assert config.coordinator.min_memory_bytes == 128 << 20 and config.coordinator.round_interval_s == 5.0
    assert config.jobs.host_memory_bytes == 4 << 30 and config.jobs.gpu_overhead_bytes == 1 << 30
    default = load_default_config()
    assert default.devices.kind == "emulated" and default.tenants[0].name == "default"
    assert default.db_path.name == "scheduler.db"


def test_passes_policy_sections_through() -> None:
    data = base()
    data["scheduler"] = {"utilisation_threshold": 0.5, "enable_upgrade": False, "opportunistic_order":
                         "shortest_predicted", "auto_opportunistic_after_s": 60}
    data["coordinator"] = {"floor_share": 0, "min_memory_bytes": 1048576, "detector_window": 5}
    config = parse_config(data, Path("/base"))
    assert config.scheduler.utilisation_threshold == 0.5 and not config.scheduler.enable_upgrade
    assert config.scheduler.auto_opportunistic_after_s == 60.0
    assert config.coordinator.floor_share == 0.0 and config.coordinator.detector_window == 5
    assert config.state_dir == Path("/base/state")
    assert config.jobs.opportunistic_priority == "low"  # the default
    assert config.jobs.gpu_overhead_bytes == 1 << 30  # the default: 0.77 GiB measured on an H200
    data["jobs"] = {"gpu_overhead_bytes": "1.5GiB"}  # a size, as jobs.host_memory
    assert parse_config(data, Path("/base")).jobs.gpu_overhead_bytes == 3 << 29
    data["jobs"] = {"opportunistic_priority": "normal", "gpu_overhead_bytes": 0}
    jobs = parse_config(data, Path("/base")).jobs
    assert jobs.opportunistic_priority == "normal" and jobs.gpu_overhead_bytes == 0


@pytest.mark.parametrize(
    ("path", "value", "field", "accepted"),
    [
        (("version",), 2, "version", "one of 1"),
        (("devices", "kind"), "tpu", "devices.kind", "one of emulated, nvml"),
        (("devices", "emulated", 0, "memory"), "1MiB", "devices.emulated[0].memory", "[67108864, "),
        (("devices", "emulated", 0, "memory"), "lots", "devices.emulated[0].memory", "a size such as"),
        (("devices", "emulated", 0, "id"), 5000, "devices.emulated[0].id", "an integer in [0, 1023]"),
        (("devices", "emulated", 0, "nvlink_group"), "a b", "devices.emulated[0].nvlink_group", "letters"),
        (("devices", "emulated", 0, "memroy"), 1, "devices.emulated[0].memroy", "one of id, memory"),
        (("tenants", 0, "gpu_quota"), -1, "tenants[0].gpu_quota", "an integer in [0, 4096]"),
        (("tenants", 0, "name"), "", "tenants[0].name", "1-64 characters"),
        (("jobs", "cancel_grace_s"), -1, "jobs.cancel_grace_s", "[0.0, 3600.0]"),
        (("jobs", "host_memory"), True, "jobs.host_memory", "bytes"),
        (("jobs", "opportunistic_priority"), "idle", "jobs.opportunistic_priority", "one of low, normal"),
        (("jobs", "misbehaviour"), "kill", "jobs.misbehaviour", "one of warn, stop, requeue"),
        (("jobs", "containment"), 1, "jobs.containment", "one of auto, off, required"),
        (("jobs", "gpu_overhead_bytes"), "lots", "jobs.gpu_overhead_bytes", "in [0, 68719476736] bytes"),
        (("jobs", "gpu_overhead_bytes"), "65GiB", "jobs.gpu_overhead_bytes", "in [0, 68719476736] bytes"),
        (("jobs", "gpu_overhead_bytes"), True, "jobs.gpu_overhead_bytes", "in [0, 68719476736] bytes"),
        (("jobs", "gpu_overhead_bytes"), -1, "jobs.gpu_overhead_bytes", "in [0, 68719476736] bytes"),
        (("jobs", "gpu_overhead_bytes"), (64 << 30) + 1, "jobs.gpu_overhead_bytes", "in [0, 68719476736] bytes"),
        (("scheduler", "gang_locality"), 1, "scheduler.gang_locality", "one of wait, spread"),
        (("daemon", "tick_interval_s"), 0, "daemon.tick_interval_s", "[0.01, 60.0]"),
        (("scheduler", "utilisation_threshold"), 1.5, "scheduler.utilisation_threshold", "(0.0, 1.0]"),
        (("scheduler", "enable_upgrade"), "yes", "scheduler.enable_upgrade", "true or false"),
        (("scheduler", "opportunistic_order"), "lifo", "scheduler.opportunistic_order", "fifo"),
        (("coordinator", "floor_share"), 2.0, "coordinator.floor_share", "[0.0, 1.0]"),
        (("coordinator", "min_memory_bytes"), "-1", "coordinator.min_memory_bytes", "bytes"),
        (("coordinator", "round_interval"), 1, "coordinator.round_interval", "round_interval_s"),
        (("colour",), "red", "colour", "one of version"),
        (("paths", "state_dir"), "st\0ate", "paths.state_dir", "a directory path"),
        (("paths", "state_dir"), "s" * 100, "paths.state_dir", "room for the socket 'scheduler.sock': at most 92"),
        (("devices", "emulated", 0, "memory"), "1e999", "devices.emulated[0].memory", "a size such as"),
        # Integers too large for a float (TOML allows them): the range, not an OverflowError.
        (("jobs", "cancel_grace_s"), 10**400, "jobs.cancel_grace_s", "[0.0, 3600.0]"),
        (("daemon", "tick_interval_s"), -(10**400), "daemon.tick_interval_s", "[0.01, 60.0]"),
        (("coordinator", "floor_share"), 10**400, "coordinator.floor_share", "[0.0, 1.0]"),
    ],
)
def test_rejections_name_the_key_and_the_accepted_range(path: tuple, value: object, field: str,
                                                        accepted: str) -> None:
    data = base()
    target = data
    for key in path[:-1]:
        target = target.setdefault(key, {}) if isinstance(key, str) else target[key]
    target[path[-1]] = value
    with pytest.raises(ConfigError) as err:
        parse_config(data, Path("/"))
    assert err.value.field == field
    assert accepted in err.value.accepted
    assert str(err.value).startswith(f"{field}=")


def test_structural_rejections() -> None:
    data = base()
    data["devices"]["emulated"].append({"id": 0, "memory": "1GiB"})
    with pytest.raises(ConfigError, match=r"devices\.emulated\[1\]\.id=0"):
        parse_config(data, Path("/"))
    data = base()
    data["tenants"].append({"name": "A", "gpu_quota": 0})
    with pytest.raises(ConfigError, match=r"tenants\[1\]\.name"):
        parse_config(data, Path("/"))
    data = base()
    del data["tenants"]
    with pytest.raises(ConfigError, match="tenants=None is invalid: accepted a value"):
        parse_config(data, Path("/"))
    data = base()
    data["devices"] = {"kind": "nvml", "emulated": [{"memory": "1GiB"}]}
    with pytest.raises(ConfigError, match="devices.emulated"):
        parse_config(data, Path("/"))
    data["devices"] = {"kind": "nvml", "ids": [0, 0]}
    with pytest.raises(ConfigError, match="devices.ids"):
        parse_config(data, Path("/"))
    data["devices"] = {"kind": "nvml", "ids": [1, 0]}
    assert parse_config(data, Path("/")).devices.nvml_ids == (1, 0)


def test_bad_toml_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("version = = 1\n")
    with pytest.raises(ConfigError, match="bad.toml"):
        load_config(bad)
    bad.write_bytes(b"version = 1\n# \xff\n")  # not UTF-8: an error naming the file, no traceback
    with pytest.raises(ConfigError, match="bad.toml.*UTF-8 text .byte 14"):
        load_config(bad)


def test_a_missing_config_file_is_named_as_the_config_file(tmp_path: Path) -> None:
    """Not a bare "No such file or directory: nope.toml": which file it is, and still the same
    exception class for callers that catch it."""
    with pytest.raises(FileNotFoundError, match=r"^\[Errno 2\] config file .*nope\.toml: No such file or directory$"):
        load_config(tmp_path / "nope.toml")
    # A directory is refused before it is read, as every file that is not a regular one
    # (tests/scheduler/test_config_files.py).
    with pytest.raises(ConfigError, match="accepted a regular file of at most 1048576 bytes .this is a directory."):
        load_config(tmp_path)


def test_every_key_of_the_example_is_documented() -> None:
    doc = (REPO / "docs" / "scheduler.md").read_text()
    keys: set[str] = set()

    def walk(value: object, prefix: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(v, dict | list):  # leaves; tables are documented as [name]
                    keys.add(f"{prefix}.{k}" if prefix else k)
                walk(v, f"{prefix}.{k}" if prefix else k)
        elif isinstance(value, list):
            for item in value:
                walk(item, f"{prefix}[]")

    walk(tomllib.loads(EXAMPLE.read_text()), "")
    for key in sorted(keys):
        leaf = key.rsplit(".", 1)[-1]
        assert re.search(rf"`{re.escape(key)}`|`{re.escape(leaf)}`", doc), (
            f"{key} is not documented in docs/scheduler.md")
