"""Submit and cancel, written into the store: by the daemon's socket server for the CLI's
requests (scheduler_lite.server) and by `Daemon.submit` for the library's; the daemon picks the
rows up at its next tick. `make_job_spec` validates a submission against the config; every
refusal is a `SubmitError` of one line naming the option and what it accepts.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Final

from scheduler_lite.config import MAX_BYTES, Config
from scheduler_lite.model import JobKind
from scheduler_lite.storage import JobRecord, JobSpec, Storage
from scheduler_lite.storage.base import check_request_id
from scheduler_lite.wire import short
from tf_antman.config import VARIABLES as ANTMAN_VARIABLES
from tf_antman.units import format_bytes

# ANTMAN_* variables a submission may set; the others are the scheduler's to set.
USER_ANTMAN_VARIABLES: Final = frozenset({"ANTMAN_ENABLE", "ANTMAN_HOST_MEMORY", "ANTMAN_STATS_INTERVAL_MS"})
_ANTMAN_BY_NAME: Final = {v.name: v for v in ANTMAN_VARIABLES}
RESERVED_ENV: Final = frozenset({"CUDA_VISIBLE_DEVICES"})
MAX_EXPECTED_STEPS: Final = 2**53 - 1
MAX_EXPECTED_DURATION_S: Final = 1e9
# A job's command and environment together, as the JSON the daemon stores and answers with (every
# `list` and `show` carries them): one user's submissions must not make those answers huge.
MAX_SUBMISSION_BYTES: Final = 64 * 1024
_ENV_NAME: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SubmitError(ValueError):
    """A submission that is refused; the message is one line naming what to fix."""


def _fits(value: object, high: float, whole: bool = False) -> bool:
    """A number in (0, high], an int when `whole`; never a bool (NaN and infinities fail the range)."""
    return not isinstance(value, bool) and isinstance(value, int if whole else int | float) and 0 < value <= high


def make_job_spec(
    config: Config,
    command: Sequence[str],
    *,
    tenant: str | None = None,
    gpus: int = 1,
    kind: JobKind | str = JobKind.AUTO,
    workdir: str | Path | None = None,
    workdir_resolved: bool = False,
    env: Mapping[str, str] | Iterable[tuple[str, str]] | None = None,
    memory_bytes: int | None = None,
    name: str = "",
    expected_steps: int | None = None,
    expected_duration_s: float | None = None,
    requested_share: float | None = None,
    restartable: bool = False,
    now: float | None = None,
    request_id: str | None = None,
) -> JobSpec:
    """Validate a submission against the config; SubmitError (one line) when it cannot run here.

    `workdir` is checked (`is_dir`) and resolved here, as the calling process, unless
    `workdir_resolved`: then it is the physical path the submitter's own probe printed (the
    daemon's socket server, scheduler_lite.server.resolve_workdir) and is stored as it is, since
    the daemon (root) must not look at a path a user gave."""
    # Arguments may be empty (`--suffix ""`); the program may not.
    if not command or not all(isinstance(c, str) for c in command) or not command[0]:
        raise SubmitError("the command is empty: give it after '--', e.g. submit -- python train.py")
    if tenant is None:
        if len(config.tenants) != 1:
            raise SubmitError("--tenant is required; tenants: " + ", ".join(t.name for t in config.tenants))
        tenant = config.tenants[0].name
    found = config.tenant(tenant)
    if found is None:
        raise SubmitError(f"unknown tenant {tenant!r}; tenants: " + ", ".join(t.name for t in config.tenants))
    try:
        job_kind = JobKind(kind)
    except ValueError:
        raise SubmitError(f"--type {kind!r} is invalid: accepted " + ", ".join(k.value for k in JobKind)) from None
    # With nvml devices only the daemon's devices know how many GPUs and how large the largest.
    emulated = config.devices.emulated if config.devices.kind == "emulated" else ()
    nodes = 1 if config.cluster is None else len(config.cluster.nodes)  # every node has these devices
    limit = len(emulated) * nodes or 1024
    if not _fits(gpus, limit, whole=True):
        raise SubmitError(f"--gpus {gpus!r} is invalid: accepted an integer in [1, {limit}]")
    if job_kind is JobKind.GUARANTEE and gpus > found.gpu_quota:
        raise SubmitError(f"a guarantee job of {gpus} GPU(s) can never run: tenant {tenant!r} has a quota "
                          f"of {found.gpu_quota}; use --type opportunistic or auto")
    if workdir_resolved:
        if workdir is None or not os.path.isabs(workdir):
            raise SubmitError(f"--workdir {workdir!r} is invalid: accepted an absolute path")
        stored_workdir = str(workdir)
    else:
        path = Path(workdir) if workdir is not None else Path.cwd()
        if not path.is_dir():
            raise SubmitError(f"--workdir {str(path)!r} is not a directory")
        stored_workdir = str(path.resolve())
    pairs = list(env.items()) if isinstance(env, Mapping) else list(env or ())
    size = submission_bytes(command, pairs)
    if size > MAX_SUBMISSION_BYTES:
        raise SubmitError(f"the command and --env take {size} bytes: accepted at most {MAX_SUBMISSION_BYTES} bytes "
                          "together (as JSON: a non-ASCII or control character counts up to 6 bytes); pass large "
                          "inputs in a file")
    for key, value in pairs:
        if not _ENV_NAME.match(key):
            raise SubmitError(f"--env {key!r}: not a variable name (letters, digits, '_')")
        owned = key in RESERVED_ENV or key.startswith("SCHEDULER_LITE_") or (
            key.startswith("ANTMAN_") and key not in USER_ANTMAN_VARIABLES
        )
        if owned:
            allowed = ", ".join(sorted(USER_ANTMAN_VARIABLES))
            raise SubmitError(f"--env {key}: set by the scheduler for each placement; a job may set {allowed}")
        if not key.startswith("ANTMAN_"):
            continue
        variable = _ANTMAN_BY_NAME.get(key)
        if variable is None:
            raise SubmitError(f"--env {key}: not a tf-antman variable (docs/configuration.md)")
        try:  # tf-antman would refuse it at the job's start, with a traceback in its log
            variable.parse(value)
        except (ValueError, OverflowError):
            raise SubmitError(f"--env {key}={value!r} is invalid: accepted {variable.accepted} "
                              "(docs/configuration.md)") from None
    if memory_bytes is not None:
        top = max((d.memory_bytes for d in emulated), default=MAX_BYTES)
        if not _fits(memory_bytes, top, whole=True):
            where = "the largest GPU" if top != MAX_BYTES else "the largest size"
            asked = f" (asked: {format_bytes(memory_bytes)})" if isinstance(memory_bytes, int) and memory_bytes > 0 else ""
            raise SubmitError(f"--memory {memory_bytes!r} is invalid: accepted a size in [1, {top}] bytes "
                              f"({format_bytes(top)}, {where}); leave it out for the whole GPU{asked}")
    if expected_steps is not None and not _fits(expected_steps, MAX_EXPECTED_STEPS, whole=True):
        raise SubmitError(f"--steps {expected_steps!r} is invalid: accepted an integer in [1, {MAX_EXPECTED_STEPS}]")
    if expected_duration_s is not None and not _fits(expected_duration_s, MAX_EXPECTED_DURATION_S):
        raise SubmitError(f"--duration {short(expected_duration_s)} is invalid: accepted seconds in "
                          f"(0, {MAX_EXPECTED_DURATION_S:g}]")
    if requested_share is not None and not _fits(requested_share, 1):
        raise SubmitError(f"--share {short(requested_share)} is invalid: accepted a fraction of one GPU in (0, 1], "
                          "e.g. 0.5; leave it out to state none")
    if not isinstance(restartable, bool):
        raise SubmitError(f"--restartable {short(restartable)} is invalid: accepted true or false")
    check_request_id(request_id, "--request-id", SubmitError)
    return JobSpec(
        tenant=tenant, kind=job_kind, num_gpus=gpus, command=tuple(command), workdir=stored_workdir,
        submit_time=time.time() if now is None else now, env=tuple(pairs), memory_bytes=memory_bytes, name=name,
        expected_steps=expected_steps,
        expected_duration_s=None if expected_duration_s is None else float(expected_duration_s),
        requested_share=None if requested_share is None else float(requested_share), restartable=restartable,
        request_id=request_id,
    )


def submission_bytes(command: Sequence[str], env: Iterable[tuple[str, str]]) -> int:
    """The size of a job's command and environment as the daemon stores and sends them (JSON)."""
    return len(json.dumps(list(command))) + len(json.dumps([list(p) for p in env]))


# What a retried submission must repeat to be the same one (JobSpec's fields but the time).
_SAME_SUBMISSION: Final = ("tenant", "kind", "num_gpus", "command", "workdir", "env", "memory_bytes", "name",
                           "expected_steps", "expected_duration_s", "requested_share", "restartable")


def submit_once(storage: Storage, spec: JobSpec) -> tuple[JobRecord, bool]:
    """Record the submission, or find it: with a request id that its submitter already used, the
    job recorded then (and False: nothing new was written). A retry that asks for something else
    under the same id is refused, naming the first differing field: the id stands for one
    submission, and silently answering the first job would hide the change."""
    with storage.transaction():
        if spec.request_id is not None:
            first = storage.job_by_request(spec.uid, spec.request_id)
            if first is not None:
                for name in _SAME_SUBMISSION:
                    if getattr(first, name) != getattr(spec, name):
                        raise SubmitError(f"--request-id {spec.request_id!r} was used for {first.id}, whose {name} "
                                          "differs from this submission's: accepted the same submission again, "
                                          "or a new request id")
                return first, False
        record = storage.add_job(spec)
        storage.add_event(spec.submit_time, "submitted", record.id, tenant=spec.tenant, kind=str(spec.kind),
                          gpus=spec.num_gpus, command=list(spec.command),
                          **({} if spec.request_id is None else {"request_id": spec.request_id}))
    return record, True


def request_cancel(storage: Storage, job_id: str, now: float) -> JobRecord:
    """Mark a job for cancellation (the daemon acts on it); a finished job is returned unchanged."""
    record = storage.get_job(job_id)
    if record is None:
        raise SubmitError(f"no job {job_id!r}")
    if record.state.done or record.cancel_requested:
        return record
    with storage.transaction():
        record = storage.update_job(job_id, cancel_requested=True)
        storage.add_event(now, "cancel_requested", job_id)
    return record


def quota_warning(quotas: Iterable[int], gpu_count: int) -> str | None:
    """One line when the tenants' quotas sum above the GPUs: then a quota is not a guarantee."""
    total = sum(quotas)
    if total <= gpu_count:
        return None
    return (f"tenant quotas sum to {total} GPUs but {gpu_count} GPU(s) are configured: a tenant within its "
            "quota may still wait for another tenant's guarantee jobs")


__all__ = ["MAX_SUBMISSION_BYTES", "RESERVED_ENV", "USER_ANTMAN_VARIABLES", "SubmitError",
           "make_job_spec", "quota_warning", "request_cancel", "submission_bytes", "submit_once"]
