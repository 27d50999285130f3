"""ANTMAN_* environment variables: the one place that names, parses and validates them.

A bad value raises ConfigError at start-up (when TensorFlow is imported or tf_antman.enable() is
called) with the variable, the value and the accepted range; nothing is read mid-training.
docs/configuration.md documents every variable and is checked against VARIABLES by a test.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

from tf_antman.protocol.schema import MAX_DEVICE_INDEX
from tf_antman.units import GiB, MiB, format_bytes, parse_bytes

PREFIX = "ANTMAN_"
MIN_DEVICE_MEMORY = 64 * MiB
MAX_BYTES = 1 << 50  # 1 PiB: far above any device, small enough to be clearly a typo beyond it


class ConfigError(ValueError):
    """A bad ANTMAN_* value. `variable` names it."""

    def __init__(self, variable: str, value: str, accepted: str) -> None:
        super().__init__(f"{variable}={value!r} is invalid: accepted {accepted}")
        self.variable = variable


@dataclasses.dataclass(frozen=True)
class Settings:
    enabled: bool
    device: str  # "auto" | "emulated" | "cuda"; activation resolves "auto" (device_select.py)
    device_id: int
    device_memory: int  # bytes: the emulated device's capacity
    memory_limit: int  # bytes: initial upper limit (<= device_memory)
    host_memory: int  # bytes: cap on host fallback; 0 disables it
    compute_share: float  # 0..1
    job_dir: str | None
    stats_interval_ms: int
    control_fallback_ms: int = 1000
    device_priority: str = "normal"  # "normal" | "low" (priority.py)

    def describe(self) -> str:
        parts = [
            f"device={self.device}:{self.device_id}",
            f"device_memory={format_bytes(self.device_memory)}",
            f"memory_limit={format_bytes(self.memory_limit)}",
            f"host_memory={format_bytes(self.host_memory)}",
            f"compute_share={self.compute_share:g}",
            f"device_priority={self.device_priority}",
            f"job_dir={self.job_dir or '-'}",
        ]
        return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class Variable:
    name: str
    kind: str
    default: str
    accepted: str
    doc: str
    parse: Callable[[str], Any]


def _bool(v: str) -> bool:
    low = v.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):  # not "": an empty value says neither, and is refused
        return False
    raise ValueError(v)


def _int_range(lo: int, hi: int) -> Callable[[str], int]:
    def parse(v: str) -> int:
        text = v.strip()
        # ASCII digits only: Python's int() also reads "1_0" (10) and other scripts' digits.
        if not (text.isascii() and text.lstrip("+-").isdigit()):
            raise ValueError(v)
        n = int(text)
        if not lo <= n <= hi:
            raise ValueError(v)
        return n

    return parse


def _bytes_range(lo: int, hi: int) -> Callable[[str], int]:
    def parse(v: str) -> int:
        n = parse_bytes(v)
        if not lo <= n <= hi:
            raise ValueError(v)
        return n

    return parse


def _share(v: str) -> float:
    x = float(v.strip())
    if not 0.0 <= x <= 1.0:  # also rejects NaN
        raise ValueError(v)
    return x


def _choice(*options: str) -> Callable[[str], str]:
    def parse(v: str) -> str:
        if v.strip().lower() not in options:
            raise ValueError(v)
        return v.strip().lower()

    return parse


def _path(v: str) -> str:
    if not v.strip() or "\0" in v:
        raise ValueError(v)
    return os.path.abspath(v)


def _job_dir(v: str) -> str:
    # Checked here, at start-up, so that a typo stops the script with a ConfigError naming the
    # variable instead of a traceback from the job agent's first file operation. What access(2)
    # cannot foresee (a read-only file system such as /sys) fails when the agent starts: logged
    # once, the job runs without it (jobside.start_agent).
    path = _path(v)
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(v)
    return path


VARIABLES: tuple[Variable, ...] = (
    Variable("ANTMAN_ENABLE", "bool", "0 (1 if any other ANTMAN_* is set)", "0/1, true/false, yes/no, on/off",
             "Turn tf-antman on for this process; set to 0 to keep it off despite other ANTMAN_* variables.",
             _bool),
    Variable("ANTMAN_DEVICE", "string", "auto", "auto, emulated or cuda",
             "Backend: a real GPU through the CUDA driver (cuda), TF's CPU device standing in for a "
             "GPU with real GPUs hidden from TF (emulated), or cuda when a driver and a GPU are "
             "present, else emulated (auto).",
             _choice("auto", "emulated", "cuda")),
    # The job reports this id in stats.json and takes limits for it from control.json: an id the
    # protocol cannot carry (schema.MAX_DEVICE_INDEX) would make every stats document invalid.
    Variable("ANTMAN_DEVICE_ID", "int", "0", f"0..{MAX_DEVICE_INDEX}",
             "Which device this job runs on (the emulated device's id, reported in statistics).",
             _int_range(0, MAX_DEVICE_INDEX)),
    Variable("ANTMAN_DEVICE_MEMORY", "size", "4GiB (emulated); TensorFlow's memory limit of the GPU (cuda)",
             "64MiB..1PiB",
             "Emulated: capacity of the device's memory (a budget in host RAM). Cuda: the most of "
             "each GPU's memory the job may use (device_select.native_memory).",
             _bytes_range(MIN_DEVICE_MEMORY, MAX_BYTES)),
    Variable("ANTMAN_MEMORY_LIMIT", "size", "= ANTMAN_DEVICE_MEMORY", "1MiB..ANTMAN_DEVICE_MEMORY",
             "Initial upper limit of device memory; above it tensors go to host memory.",
             _bytes_range(MiB, MAX_BYTES)),
    Variable("ANTMAN_HOST_MEMORY", "size", "8GiB", "0..1PiB (0 = no host fallback)",
             "Cap on host memory used when the device is at its limit.",
             _bytes_range(0, MAX_BYTES)),
    Variable("ANTMAN_COMPUTE_SHARE", "float", "1.0", "0.0..1.0",
             "Share of the device's compute the job may use; 0 pauses at the next op.",
             _share),
    Variable("ANTMAN_JOB_DIR", "path", "unset", "an existing directory this process can write to",
             "Job directory of the file protocol with the local coordinator (docs/protocol.md).",
             _job_dir),
    Variable("ANTMAN_STATS_INTERVAL_MS", "int", "50", "1..60000",
             "Least time between two statistics writes (control acknowledgements are written at once).",
             _int_range(1, 60000)),
    Variable("ANTMAN_CONTROL_FALLBACK_MS", "int", "1000", "10..600000",
             "How long a coordinator control waits for a training step boundary before it is applied "
             "anyway from the job agent's thread (docs/steps.md).",
             _int_range(10, 600000)),
    Variable("ANTMAN_DEVICE_PRIORITY", "string", "normal", "normal or low",
             "Priority of the job's work on its device. low (the paper's low-priority "
             "opportunistic job; scheduler_lite sets it for opportunistic jobs on emulated "
             "devices): on the emulated device every thread of the job runs under Linux's "
             "SCHED_IDLE, so it gets the cores only when other jobs leave them idle; not applied "
             "on cuda (logged). An unprivileged process cannot return to normal (docs/op-manager.md).",
             _choice("normal", "low")),
)
_BY_NAME = {v.name: v for v in VARIABLES}


def requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment asks for tf-antman (any ANTMAN_* set, unless ANTMAN_ENABLE=0)."""
    env = os.environ if environ is None else environ
    keys = [k for k in env if k.startswith(PREFIX)]
    if not keys:
        return False
    if "ANTMAN_ENABLE" in env:
        try:
            return _bool(env["ANTMAN_ENABLE"])
        except ValueError:
            return True  # let load() report the bad value loudly
    return True


# enable(**options) of either front-end (tf_antman, tf_antman.torch): option -> the variable it
# sets; every variable but ANTMAN_ENABLE, in lower case without the prefix.
ENABLE_OPTIONS: dict[str, str] = {
    v.name.removeprefix(PREFIX).lower(): v.name for v in VARIABLES if v.name != "ANTMAN_ENABLE"
}


def enable_environment(options: Mapping[str, object], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What enable(**options) activates with: the ANTMAN_* variables of the environment, each
    option overriding its variable, and ANTMAN_ENABLE=1. TypeError for an unknown option (load()
    validates the values)."""
    env = {k: v for k, v in (os.environ if environ is None else environ).items() if k.startswith(PREFIX)}
    for key, value in options.items():
        if key not in ENABLE_OPTIONS:
            raise TypeError(f"enable() got an unknown option {key!r}; known: {sorted(ENABLE_OPTIONS)}")
        env[ENABLE_OPTIONS[key]] = str(value)
    env["ANTMAN_ENABLE"] = "1"
    return env


def _get(env: Mapping[str, str], name: str, default: Any) -> Any:
    var = _BY_NAME[name]
    if name not in env:
        return default
    try:
        return var.parse(env[name])
    except (ValueError, OverflowError):
        raise ConfigError(name, env[name], var.accepted) from None


def check_limit(limit: int, device_memory: int, env: Mapping[str, str]) -> None:
    """ANTMAN_MEMORY_LIMIT within the device's memory (ConfigError naming both otherwise)."""
    if limit > device_memory:
        raise ConfigError("ANTMAN_MEMORY_LIMIT", env.get("ANTMAN_MEMORY_LIMIT", format_bytes(limit)),
                          f"1MiB..ANTMAN_DEVICE_MEMORY ({format_bytes(device_memory)})")


# What load() returns when tf-antman is off: the defaults, nothing read.
_DISABLED = Settings(enabled=False, device="auto", device_id=0, device_memory=4 * GiB, memory_limit=4 * GiB,
                     host_memory=8 * GiB, compute_share=1.0, job_dir=None, stats_interval_ms=50)


def load(environ: Mapping[str, str] | None = None) -> Settings:
    """Reads and validates every ANTMAN_* variable. Unknown ANTMAN_* names are errors too:
    a typo would otherwise silently run with defaults."""
    env = os.environ if environ is None else environ
    # ANTMAN_ENABLE first: 0 keeps tf-antman off whatever the other variables say, so nothing
    # else is validated (its own value still is).
    if not _get(env, "ANTMAN_ENABLE", requested(env)):
        return _DISABLED
    for key in env:
        if key.startswith(PREFIX) and key not in _BY_NAME:
            known = ", ".join(sorted(_BY_NAME))
            raise ConfigError(key, env[key], f"no such variable; known: {known}")
    device_memory = _get(env, "ANTMAN_DEVICE_MEMORY", 4 * GiB)
    limit = _get(env, "ANTMAN_MEMORY_LIMIT", device_memory)
    # On a GPU (cuda, or auto that may become cuda) an unset ANTMAN_DEVICE_MEMORY means the GPU's
    # free memory, unknown here: the 4GiB default is the emulated device's budget and says
    # nothing about an 80 GiB GPU, so the limit is only held to its own range here. Auto that
    # becomes emulated is checked against the budget by check_limit once resolved (device_select).
    if "ANTMAN_DEVICE_MEMORY" in env or _get(env, "ANTMAN_DEVICE", "auto") == "emulated":
        check_limit(limit, device_memory, env)
    return Settings(
        enabled=True,
        device=_get(env, "ANTMAN_DEVICE", "auto"),
        device_id=_get(env, "ANTMAN_DEVICE_ID", 0),
        device_memory=device_memory,
        memory_limit=limit,
        host_memory=_get(env, "ANTMAN_HOST_MEMORY", 8 * GiB),
        compute_share=_get(env, "ANTMAN_COMPUTE_SHARE", 1.0),
        job_dir=_get(env, "ANTMAN_JOB_DIR", None),
        stats_interval_ms=_get(env, "ANTMAN_STATS_INTERVAL_MS", 50),
        control_fallback_ms=_get(env, "ANTMAN_CONTROL_FALLBACK_MS", 1000),
        device_priority=_get(env, "ANTMAN_DEVICE_PRIORITY", "normal"),
    )
