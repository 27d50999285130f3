"""ANTMAN_* settings: parsing, validation messages, and the documentation staying complete."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.conftest import REPO
from tf_antman import config
from tf_antman.protocol.schema import MAX_DEVICE_INDEX
from tf_antman.units import GiB, MiB, format_bytes, parse_bytes


def test_defaults_when_only_enable_is_set() -> None:
    s = config.load({"ANTMAN_ENABLE": "1"})
    assert s.enabled and s.device == "auto" and s.device_memory == 4 * GiB
    assert s.memory_limit == s.device_memory and s.compute_share == 1.0 and s.job_dir is None
    assert s.control_fallback_ms == 1000
    assert config.load({"ANTMAN_CONTROL_FALLBACK_MS": "250"}).control_fallback_ms == 250
    assert s.device_priority == "normal"
    assert config.load({"ANTMAN_DEVICE_PRIORITY": "Low"}).device_priority == "low"


def test_any_variable_implies_enable_unless_disabled() -> None:
    assert config.requested({"ANTMAN_COMPUTE_SHARE": "0.5"})
    assert not config.requested({"ANTMAN_COMPUTE_SHARE": "0.5", "ANTMAN_ENABLE": "0"})
    assert not config.requested({"PATH": "/bin"})
    assert config.load({"ANTMAN_DEVICE_MEMORY": "1GiB"}).enabled


@pytest.mark.parametrize(("name", "value", "accepted"), [
    ("ANTMAN_ENABLE", "maybe", "0/1"),
    ("ANTMAN_ENABLE", "", "0/1"),  # was read as off, silently, with other ANTMAN_* set
    ("ANTMAN_DEVICE", "tpu", "auto, emulated or cuda"),
    ("ANTMAN_DEVICE_ID", "-1", "0..63"),
    ("ANTMAN_DEVICE_ID", "1.5", "0..63"),
    ("ANTMAN_DEVICE_ID", "64", "0..63"),  # the protocol's device index: 100 made every stats.json invalid
    ("ANTMAN_DEVICE_ID", "1023", "0..63"),
    ("ANTMAN_DEVICE_MEMORY", "10MiB", "64MiB..1PiB"),
    ("ANTMAN_DEVICE_MEMORY", "lots", "64MiB..1PiB"),
    ("ANTMAN_MEMORY_LIMIT", "8GiB", "ANTMAN_DEVICE_MEMORY"),
    ("ANTMAN_HOST_MEMORY", "-1", "0..1PiB"),
    ("ANTMAN_COMPUTE_SHARE", "1.5", "0.0..1.0"),
    ("ANTMAN_COMPUTE_SHARE", "nan", "0.0..1.0"),
    ("ANTMAN_STATS_INTERVAL_MS", "0", "1..60000"),
    ("ANTMAN_STATS_INTERVAL_MS", "1_000", "1..60000"),  # Python's int() reads these; a user means none
    ("ANTMAN_DEVICE_ID", "\u0663", "0..63"),
    ("ANTMAN_CONTROL_FALLBACK_MS", "5", "10..600000"),
    ("ANTMAN_CONTROL_FALLBACK_MS", "1e3", "10..600000"),
    ("ANTMAN_JOB_DIR", "  ", "an existing directory this process can write to"),
    ("ANTMAN_JOB_DIR", "/nonexistent/job", "an existing directory this process can write to"),
    ("ANTMAN_JOB_DIR", "/etc/hostname", "an existing directory this process can write to"),
    ("ANTMAN_JOB_DIR", "/proc/self", "an existing directory this process can write to"),
    ("ANTMAN_DEVICE_PRIORITY", "idle", "normal or low"),
    ("ANTMAN_MEMROY_LIMIT", "1GiB", "no such variable"),
])
def test_bad_value_names_variable_and_range(name: str, value: str, accepted: str) -> None:
    with pytest.raises(config.ConfigError) as err:
        config.load({"ANTMAN_DEVICE_MEMORY": "4GiB", name: value} if name != "ANTMAN_DEVICE_MEMORY" else {name: value})
    assert err.value.variable == name
    assert name in str(err.value) and accepted in str(err.value)


def test_sizes() -> None:
    assert parse_bytes("4GiB") == 4 * GiB and parse_bytes("512 MiB") == 512 * MiB
    assert parse_bytes("1.5GB") == 1_500_000_000 and parse_bytes("1073741824") == GiB
    with pytest.raises(ValueError, match="KiB, MiB, GiB"):
        parse_bytes("4 gigs")
    for ambiguous in ("512m", "4g", "1k"):  # MiB to Docker, MB to others: refused, not guessed
        with pytest.raises(ValueError, match="KiB, MiB, GiB"):
            parse_bytes(ambiguous)
    for huge in ("1e999", "1e308GiB", "9" * 400):  # float overflow: an error, not OverflowError
        with pytest.raises(ValueError, match="too large"):
            parse_bytes(huge)
    assert format_bytes(1536 * MiB) == "1.5 GiB"


def test_every_variable_is_documented() -> None:
    doc = (REPO / "docs" / "configuration.md").read_text()
    documented = set(re.findall(r"`(ANTMAN_[A-Z_]+)`", doc))
    assert {v.name for v in config.VARIABLES} <= documented
    # and nothing documented that the code does not know
    assert documented <= {v.name for v in config.VARIABLES}



def test_documented_type_default_and_range_match_the_code() -> None:
    rows = {}
    for line in (REPO / "docs" / "configuration.md").read_text().splitlines():
        cells = [c.strip().replace("`", "") for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("ANTMAN_"):
            rows[cells[0]] = cells[1:4]
    for var in config.VARIABLES:
        assert rows.get(var.name) == [var.kind, var.default, var.accepted], var.name


def test_device_id_range_is_the_protocols() -> None:
    # The id is reported in stats.json, whose device index is 0..MAX_DEVICE_INDEX.
    assert config.load({"ANTMAN_DEVICE_ID": str(MAX_DEVICE_INDEX)}).device_id == MAX_DEVICE_INDEX == 63


def test_job_dir_is_an_existing_writable_directory(tmp_path: Path) -> None:
    assert config.load({"ANTMAN_JOB_DIR": str(tmp_path)}).job_dir == str(tmp_path)
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o500)
    if os.access(read_only, os.W_OK):  # root writes anywhere: the mode cannot show it here
        pytest.skip("running as root")
    with pytest.raises(config.ConfigError, match="ANTMAN_JOB_DIR=.*accepted an existing directory"):
        config.load({"ANTMAN_JOB_DIR": str(read_only)})


def test_enable_options_override_the_environment_and_turn_tf_antman_on(tmp_path: Path) -> None:
    job_dir = str(tmp_path)
    environ = {"ANTMAN_COMPUTE_SHARE": "0.5", "ANTMAN_ENABLE": "0", "ANTMAN_JOB_DIR": job_dir, "PATH": "/bin"}
    env = config.enable_environment({"compute_share": 0.25, "device_memory": "1GiB"}, environ)
    assert env == {"ANTMAN_COMPUTE_SHARE": "0.25", "ANTMAN_DEVICE_MEMORY": "1GiB", "ANTMAN_ENABLE": "1",
                   "ANTMAN_JOB_DIR": job_dir}
    assert config.load(env).compute_share == 0.25
    # Every option sets a variable that load() knows (a typo there would be refused at activation).
    assert set(config.ENABLE_OPTIONS.values()) <= {v.name for v in config.VARIABLES}
    with pytest.raises(TypeError, match=r"unknown option 'memroy_limit'; known: \['compute_share'"):
        config.enable_environment({"memroy_limit": "1GiB"}, {})


def test_enable_0_keeps_tf_antman_off_whatever_the_other_variables_say() -> None:
    # ANTMAN_ENABLE=0 with a bad ANTMAN_COMPUTE_SHARE or a missing job directory raised ConfigError.
    for other in ({"ANTMAN_COMPUTE_SHARE": "abc"}, {"ANTMAN_JOB_DIR": "/nonexistent/job"},
                  {"ANTMAN_MEMORY_LIMIT": "8GiB"}, {"ANTMAN_MEMROY_LIMIT": "1GiB"}):
        for off in ("0", "false", "off"):
            assert not config.load({"ANTMAN_ENABLE": off, **other}).enabled
    with pytest.raises(config.ConfigError, match="ANTMAN_ENABLE='nope'"):  # its own value still checked
        config.load({"ANTMAN_ENABLE": "nope", "ANTMAN_COMPUTE_SHARE": "abc"})
    with pytest.raises(config.ConfigError, match="ANTMAN_COMPUTE_SHARE"):
        config.load({"ANTMAN_ENABLE": "1", "ANTMAN_COMPUTE_SHARE": "abc"})


def test_pib_is_a_unit_so_the_documented_ranges_hold() -> None:
    # The ranges read 64MiB..1PiB and 0..1PiB, but "1PiB" was not a size.
    assert parse_bytes("1PiB") == config.MAX_BYTES == 1 << 50 and parse_bytes("1PB") == 10**15
    assert config.load({"ANTMAN_DEVICE_MEMORY": "1PiB", "ANTMAN_HOST_MEMORY": "1PiB"}).device_memory == 1 << 50
    with pytest.raises(config.ConfigError, match="64MiB..1PiB"):
        config.load({"ANTMAN_DEVICE_MEMORY": "1.5PiB"})
    with pytest.raises(ValueError, match="TiB, PiB"):
        parse_bytes("1EiB")
