"""Ray tasks placed by Algorithm 1 and protected by the coordinator (docs/cluster.md, "Ray users").

`ray_options` (scheduler_lite.cluster.options) only enforces a fraction inside a Ray task; where
Ray puts the task and what else runs on that GPU stay Ray's business. `request_placement` makes
the task a job of the running global scheduler (`scheduler-lite serve` in cluster mode):

    placement = request_placement(config, num_gpus=0.5, kind="opportunistic", tenant="research")
    ref = placement.remote(train).remote(steps=1000)     # pinned to the booked node, under tf-antman

The client submits a one-GPU job whose command is the marker `TASK_COMMAND` through the
scheduler's socket (the CLI's `submit`, with its checks), waits until Algorithm 1 places it, and
reads the environment the node host booked for it (`task_options`); the task's wrapper
(`_run_booked`, in the Ray worker) claims the booking (`booking.claim`), runs the function and
records its exit status. Ray actors get the same booking through `RayPlacement.actor`
(scheduler_lite.cluster.actors). The steps, their ends and why the socket: docs/cluster.md.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from scheduler_lite.cluster.booking import TASK_COMMAND, PlacementError, claim, write_number
from scheduler_lite.cluster.options import KINDS, parse_size
from scheduler_lite.launcher import EXIT_STATUS_FILE
from scheduler_lite.policy.validation import check_choice

if TYPE_CHECKING:
    from scheduler_lite.config import Config

NODE_SHARE: Final = 0.001  # of the node's `antman_node_<node>` resource a pinned task takes


@dataclass(frozen=True, slots=True)
class RayPlacement:
    """A booked GPU for one Ray task: where, with what environment."""

    job_id: str
    node: str
    gpu: int  # global GPU id (docs/cluster.md)
    role: str  # guarantee | opportunistic
    job_dir: str
    env: dict[str, str]  # ANTMAN_* (limit, share, job dir, device id 0, device) and SCHEDULER_LITE_*

    def options(self, runtime_env: Mapping[str, Any] | None = None, actor: bool = False) -> dict[str, Any]:
        """Options for `.options(**...)`: pinned to the node, with this environment. A task: one
        call per worker (the worker exits after the task: its GPU memory goes with the booking),
        no retry (a retry would run outside the booking, which ends with the first attempt). An
        actor (Ray rejects those two for actors): no restart or task retry, for the same reason."""
        merged = dict(runtime_env or {})
        merged["env_vars"] = {**dict(merged.get("env_vars") or {}), **self.env}
        once = {"max_restarts": 0, "max_task_retries": 0} if actor else {"max_retries": 0, "max_calls": 1}
        return {"resources": {f"antman_node_{self.node}": NODE_SHARE}, "runtime_env": merged, **once}

    def remote(self, fn: Callable[..., Any], **ray_options: Any) -> Any:
        """`fn` as a Ray remote function running under this booking (extra Ray options, such as
        num_cpus, are passed on; `resources`, `runtime_env` env vars and retries are the booking's)."""
        job_id = self.job_id

        def task(*args: Any, **kwargs: Any) -> Any:
            return _run_booked(job_id, fn, *args, **kwargs)

        task.__name__ = task.__qualname__ = getattr(fn, "__name__", "task")
        return self._ray_remote(task, ray_options, actor=False)

    def actor(self, cls: type, **ray_options: Any) -> Any:
        """`cls` as a Ray actor class whose one instance runs under this booking
        (scheduler_lite.cluster.actors): `placement.actor(Trainer).remote(...)` gives the handle.
        Extra Ray options (num_cpus, max_concurrency) are passed on; `resources`, `runtime_env`
        env vars and restarts are the booking's."""
        from scheduler_lite.cluster.actors import booked_class

        return self._ray_remote(booked_class(self.job_id, cls), ray_options, actor=True)

    def _ray_remote(self, target: Any, ray_options: dict[str, Any], actor: bool) -> Any:
        import ray

        runtime_env = ray_options.pop("runtime_env", None)
        return ray.remote(**{**ray_options, **self.options(runtime_env, actor)})(target)


def _run_booked(job_id: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """In the Ray worker: claim the booking (pid file), run `fn`, record how it ended."""
    job_dir = claim(job_id)
    code = 1
    try:
        result = fn(*args, **kwargs)
        code = 0
        return result
    finally:
        with contextlib.suppress(OSError):
            write_number(job_dir / EXIT_STATUS_FILE, code)


def request_placement(
    config: Config,
    *,
    num_gpus: float = 1.0,
    memory: int | str | None = None,
    kind: str = "opportunistic",
    tenant: str | None = None,
    name: str = "",
    timeout_s: float = 600.0,
    poll_s: float = 0.2,
) -> RayPlacement:
    """Book one GPU (or a fraction of its memory) for a Ray task with the running global scheduler;
    blocks until Algorithm 1 places it (`timeout_s`, else cancelled and PlacementError).

    `num_gpus` in (0, 1] is the task's memory demand as a fraction of the GPU (`memory` overrides
    it; needed with NVML devices, whose size the client does not know); the compute share is the
    booking's (opportunistic: what the coordinator leaves it, guarantee: 1.0). ValueError names a
    bad argument.
    """
    from scheduler_lite.client import ClientError, call

    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int | float) or not 0.0 < num_gpus <= 1.0:
        raise ValueError(f"num_gpus={num_gpus!r} is invalid: accepted a fraction of one GPU in (0, 1]")
    check_choice("kind", kind, KINDS)  # a ConfigError is a ValueError
    if not 0 < timeout_s <= 86400:
        raise ValueError(f"timeout_s={timeout_s!r} is invalid: accepted (0, 86400] seconds")
    if config.cluster is None:
        raise ValueError("config has no [cluster] table: request_placement needs the cluster's global scheduler")
    demand = parse_size("memory", memory)
    if demand is None:
        sizes = [d.memory_bytes for d in config.devices.emulated]
        if config.devices.kind != "emulated" or not sizes:
            raise ValueError("memory=None is invalid: accepted a size (the device memory is known to the "
                             "client only for emulated devices)")
        demand = int(max(sizes) * num_gpus)
    try:
        job_id = str(call(config, "submit", command=[TASK_COMMAND], tenant=tenant, gpus=1, kind=kind,
                          workdir=os.getcwd(), memory_bytes=demand, name=name)["id"])
    except ClientError as e:
        raise PlacementError(str(e)) from None
    try:
        return _wait_placed(config, job_id, time.monotonic() + timeout_s, poll_s)
    except BaseException:
        with contextlib.suppress(ClientError):
            call(config, "cancel", jobs=[job_id])  # never leave a booking nobody will use
        raise


def _wait_placed(config: Config, job_id: str, deadline: float, poll_s: float) -> RayPlacement:
    import ray

    from scheduler_lite.client import ClientError, call
    from scheduler_lite.cluster.nodes import actor_name

    cc = config.cluster
    assert cc is not None
    while True:
        try:
            job = call(config, "show", job=job_id)["job"]
        except ClientError:  # the scheduler restarting: the booking is in its store, wait for it
            if time.monotonic() >= deadline:
                raise
            time.sleep(poll_s)
            continue
        if job["state"] in ("failed", "cancelled", "finished"):
            raise PlacementError(f"{job_id} {job['state']}: {job.get('reason') or 'no reason given'}")
        if job["state"] == "running" and job.get("placement"):
            gpu = int(job["placement"][0])
            node = cc.node_of(gpu)
            actor = ray.get_actor(actor_name(node), namespace=cc.namespace)
            env = ray.get(actor.task_options.remote(job_id), timeout=30)
            if env is not None:
                return RayPlacement(job_id, node, gpu, str(job["role"]), env["ANTMAN_JOB_DIR"], dict(env))
        if time.monotonic() >= deadline:
            raise PlacementError(f"{job_id} not placed in time (state {job['state']}); cancelled")
        time.sleep(poll_s)


__all__ = ["TASK_COMMAND", "PlacementError", "RayPlacement", "request_placement"]
