"""One way to reject a bad configuration value: name the field and the accepted range."""

from __future__ import annotations

import math
import re
from typing import Final

_NAME_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
NAME_RULE: Final = "1-64 characters of letters, digits, '_', '.', '-', starting with a letter or digit"


class ConfigError(ValueError):
    def __init__(self, field: str, value: object, accepted: str) -> None:
        super().__init__(f"{field}={value!r} is invalid: accepted {accepted}")
        self.field = field
        self.value = value
        self.accepted = accepted


def check_range(
    field: str, value: float, low: float, high: float, *, low_open: bool = False
) -> None:
    # NaN last: math.isnan raises OverflowError for an int too large for a float (TOML allows one).
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or (value <= low if low_open else value < low) or value > high or math.isnan(value)):
        raise ConfigError(field, value, f"a number in {'(' if low_open else '['}{low}, {high}]")


def check_int(field: str, value: int, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(field, value, f"an integer in [{low}, {high}]")


def check_name(field: str, value: object) -> str:
    """A name of the configuration (tenant, NVLink group, node, Ray namespace): NAME_RULE."""
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ConfigError(field, value, NAME_RULE)
    return value


def check_choice(field: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(field, value, "one of " + ", ".join(choices))
