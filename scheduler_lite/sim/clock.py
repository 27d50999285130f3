"""The simulator's clock: the time now and the heap of events to come.

Events: job arrival, job progress (finish, memory surge, or the start or end of a CPU-bound
phase), coordinator round on one GPU, utilisation refresh. A job's progress event and a GPU's
round carry a version: one planned again (the job's speed changed, the coordinator asked for
another time) leaves the old entry in the heap, skipped when it comes up.

The simulator's parts (sim/lifecycle.py, sim/speeds.py, sim/rounds.py) share one `Clock`, handed
to each at construction; it points at none of them (a part that pointed back at the simulator
would make a reference cycle: engine.simulate says why the run must leave none).
"""

from __future__ import annotations

import heapq
import math

from scheduler_lite.sim.simjob import SimJob

ARRIVE, PROGRESS, ROUND, REFRESH = 0, 1, 2, 3
UTILISATION_REFRESH_S = 10.0  # the global policy's utilisation is a 10 s average (paper §3.3)
WORK_TOLERANCE_S = 1e-6  # solo-seconds of work left that count as done (float round-off)


def work_tolerance(now: float, speed: float) -> float:
    """Solo-seconds of work within which a target (finish, surge, phase edge) counts as reached.

    WORK_TOLERANCE_S, or the work the job does in one step of the clock if that is more. Above
    ~8.6e9 s the spacing of the float clock exceeds 1e-6 s: a gap smaller than one step's work
    cannot be reached by a later event (now + gap / speed rounds to now), so an event planned
    for it would fire at the same time for ever. With this bound, a gap left after a progress
    event is planned at least one clock step later, and every run ends whatever its times.
    """
    step = speed * math.ulp(now)
    return step if step > WORK_TOLERANCE_S else WORK_TOLERANCE_S


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.heap: list[tuple[float, int, int, object, int]] = []
        self.seq = 0
        self.round_version: dict[int, int] = {}
        self.round_at: dict[int, float | None] = {}
        # GPUs whose utilisation changed since the last refresh, and the time of the next one.
        self.util_stale: set[int] = set()
        self.refresh_at: float | None = None

    def push(self, t: float, kind: int, key: object, ver: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, key, ver))

    def set_round(self, gpu: int, at: float | None) -> None:
        """The GPU's next coordinator round at `at` (None: none planned); replaces the one planned."""
        ver = self.round_version.get(gpu, 0) + 1
        self.round_version[gpu] = ver
        self.round_at[gpu] = at
        if at is not None:
            self.push(at, ROUND, gpu, ver)

    def stale(self, gpu: int) -> None:
        """The GPU's utilisation changed: the next refresh hands it to the book."""
        self.util_stale.add(gpu)
        if self.refresh_at is None:
            self.refresh_at = (math.floor(self.now / UTILISATION_REFRESH_S) + 1) * UTILISATION_REFRESH_S
            self.push(self.refresh_at, REFRESH, None, 0)

    def reschedule(self, sj: SimJob) -> None:
        """Plan the job's next progress event (finish or surge) at its current speed.

        A job that slowed down keeps its earlier event: it fires early and is planned again
        then. Speeds change at every coordinator round that moves a share, so this saves most
        of the events that would otherwise be pushed only to be discarded.
        """
        if sj.speed <= 0:
            sj.version += 1
            sj.due = None
            return
        target = sj.remaining
        tj = sj.trace
        if not sj.surged and tj.surge_at_fraction is not None:
            target = sj.remaining - tj.runtime_s * (1 - tj.surge_at_fraction)
        if sj.edge_at != math.inf:
            # Up to its next phase edge, or now if it reached one on the way to another event
            # (a surge at the same point came first).
            gap = sj.edge_at - (tj.runtime_s - sj.remaining)
            target = 0.0 if gap <= work_tolerance(self.now, sj.speed) else min(target, gap)
        at = self.now + max(0.0, target) / sj.speed
        if sj.due is not None and sj.due <= at:
            return
        sj.version += 1
        sj.due = at
        self.push(at, PROGRESS, sj.book_id, sj.version)
