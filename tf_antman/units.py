"""Byte sizes as people write them ("4GiB", "512 MiB", "1e9") and back."""

from __future__ import annotations

import math
import re

# Bare "k", "m", "g", "t" are not sizes here: Docker and the JVM read "512m" as MiB, other tools
# as MB; a limit that is 5% off without a word is worse than a one-line error.
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4, "pb": 1000**5,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "pib": 1 << 50,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*$")

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def parse_bytes(text: str) -> int:
    """Parses a size; raises ValueError with the accepted forms on anything else."""
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise ValueError(
            f"{text!r} is not a size: use bytes or a number with KiB, MiB, GiB, TiB, PiB (or KB, MB, GB, TB, PB)"
        )
    value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value):  # "1e999": a float overflow, not a size
        raise ValueError(f"{text!r} is too large to be a size")
    return int(value)


def format_bytes(n: int | float) -> str:
    """Human-readable binary size, e.g. 1.5 GiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
