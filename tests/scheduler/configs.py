"""One builder for the scheduler configs the tests write (the format: docs/scheduler.md, parsed by
scheduler_lite/config.py).

    data = scheduler_config(["1GiB", "1GiB"], {"A": 1, "B": 0}, daemon={"tick_interval_s": 0.1})
    path.write_text(to_toml(data))      # for `scheduler-lite --config` and `serve` subprocesses
    parse_config(data, base_dir=...)    # or in-process, without a file
    merge_tables(data, daemon={"schedule_interval_s": 1.0})  # a test's change to a shared base

The tests describe only what differs between them (GPUs, tenants, the tables they tune); the
document's fixed parts (version, [paths], [devices]) live here once.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping, Sequence
from typing import Any

from scheduler_lite.config import VERSION

Scalar = str | int | float | bool
Value = Scalar | Sequence[Scalar]
Table = Mapping[str, Value]


def scheduler_config(gpus: Sequence[str], tenants: Mapping[str, int], *,
                     users: Mapping[str, Sequence[str]] | None = None, nvlink_group: str | None = None,
                     state_dir: str = "state", **tables: Table) -> dict[str, Any]:
    """The config document as TOML would load it.

    gpus: the memory of each emulated GPU (a size such as "1GiB"), ids 0, 1, ... in this order.
    tenants: name -> gpu_quota, in this order; users: name -> the Unix users of that tenant.
    nvlink_group: every GPU's group (None: the loader's default, "local").
    tables: the optional top-level tables ([jobs], [daemon], [coordinator], [access], [cluster], ...).
    """
    unknown = set(users or {}) - set(tenants)
    if unknown:
        raise ValueError(f"users given for tenants not in the config: {sorted(unknown)}")
    emulated: list[dict[str, Any]] = []
    for i, memory in enumerate(gpus):
        emulated.append({"id": i, "memory": memory} | ({"nvlink_group": nvlink_group} if nvlink_group else {}))
    tenant_tables: list[dict[str, Any]] = []
    for name, quota in tenants.items():
        members = (users or {}).get(name)
        tenant_tables.append({"name": name, "gpu_quota": quota} | ({"users": list(members)} if members else {}))
    return {"version": VERSION, "paths": {"state_dir": state_dir},
            "devices": {"kind": "emulated", "emulated": emulated}, "tenants": tenant_tables,
            **{name: dict(table) for name, table in tables.items()}}


def merge_tables(data: Mapping[str, Any], **tables: Table) -> dict[str, Any]:
    """`data` with each given table's keys set (the table's other keys kept): a test's changes
    to a shared base config."""
    merged = dict(data)
    for name, table in tables.items():
        merged[name] = {**merged.get(name, {}), **table}
    return merged


def to_toml(data: Mapping[str, Any]) -> str:
    """The document as TOML text: top-level keys, then tables, then arrays of tables (one level of
    nesting below them, as the config has). Checked by loading it back, so a value this writer
    cannot express fails here rather than as a puzzling config error in a daemon subprocess."""
    lines = [f"{key} = {_value(v)}" for key, v in data.items() if not _is_table(v) and not _is_tables(v)]
    for key, v in data.items():
        if _is_table(v):
            lines += _table(f"[{key}]", key, v)
        elif _is_tables(v):
            for entry in v:
                lines += _table(f"[[{key}]]", key, entry)
    text = "\n".join(lines) + "\n"
    if tomllib.loads(text) != _plain(data):
        raise ValueError(f"cannot write this document as TOML: {data!r}")
    return text


def _table(header: str, key: str, table: Mapping[str, Any]) -> list[str]:
    lines = [header] + [f"{k} = {_value(v)}" for k, v in table.items() if not _is_tables(v)]
    for k, v in table.items():
        if _is_tables(v):
            for entry in v:
                lines += _table(f"[[{key}.{k}]]", f"{key}.{k}", entry)
    return lines


def _is_table(v: object) -> bool:
    return isinstance(v, Mapping)


def _is_tables(v: object) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(e, Mapping) for e in v)


def _value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # a TOML basic string for everything tests write
    if isinstance(v, Sequence):
        return "[" + ", ".join(_value(e) for e in v) + "]"
    raise TypeError(f"no TOML value for {v!r}")


def _plain(v: object) -> object:
    """`v` as tomllib returns it (tuples become lists, mappings dicts), for the round-trip check."""
    if isinstance(v, Mapping):
        return {k: _plain(e) for k, e in v.items()}
    if isinstance(v, list | tuple):
        return [_plain(e) for e in v]
    return v
