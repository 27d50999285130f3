"""Ray actors placed by Algorithm 1 and protected by the coordinator (docs/cluster.md, "Ray users").

The actor's half of scheduler_lite.cluster.tasks: the same booking (`request_placement`), the
same node pin and environment, but the booking lives as long as the actor:

    placement = request_placement(config, num_gpus=0.5, kind="opportunistic", tenant="research")
    trainer = placement.actor(Trainer).remote(width=64)   # one actor, pinned, under tf-antman
    ray.get(trainer.train.remote(steps=100))
    ray.kill(trainer)                                     # its worker exits: the booking ends

The actor's constructor claims the booking (`booking.claim`, exclusive: one instance per
booking) before the class's own `__init__`; the node host then watches the actor's worker process
as a task's, and the booking ends with it (an actor's worker is its own: Ray never reuses it).
How it ended is recorded here: a graceful exit 0, a constructor that raises 1, a `ray.kill` or a
crash nothing (docs/cluster.md, "Ray actors under a booking").
"""

from __future__ import annotations

import atexit
import contextlib
from pathlib import Path
from typing import Any

from scheduler_lite.cluster.booking import RELEASED_FILE, claim, write_number
from scheduler_lite.launcher import EXIT_STATUS_FILE


def booked_class(job_id: str, cls: type) -> type:
    """A subclass of `cls` whose constructor claims the booking `job_id` before `cls.__init__`
    (pure Python: the Ray decorator is applied by `RayPlacement.actor`). TypeError for a class that Ray
    wrapped already (`@ray.remote`): its constructor cannot be wrapped any more."""
    if not isinstance(cls, type) or hasattr(cls, "__ray_metadata__"):
        raise TypeError(f"cls={cls!r} is invalid: accepted a plain class (not one decorated with @ray.remote)")

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        job_dir = claim(job_id, "actor", exclusive=True)
        try:
            cls.__init__(self, *args, **kwargs)
        except BaseException:
            with contextlib.suppress(OSError):
                write_number(job_dir / EXIT_STATUS_FILE, 1)  # the actor dies: a failure, not "gone"
            raise
        atexit.register(_ended_gracefully, job_dir)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__qualname__": cls.__qualname__,
                                       "__module__": cls.__module__, "__doc__": cls.__doc__})


def _ended_gracefully(job_dir: Path) -> None:
    """At the exit of the actor's process, when Python gets to run it: a graceful end (the handle
    out of scope, `__ray_terminate__`, `exit_actor`), recorded as exit status 0. Not for a
    `ray.kill` or a crash (no Python runs), nor after a release (cancel, node loss: not a success)."""
    if not (job_dir / RELEASED_FILE).exists():
        with contextlib.suppress(OSError):
            write_number(job_dir / EXIT_STATUS_FILE, 0)


__all__ = ["booked_class"]
