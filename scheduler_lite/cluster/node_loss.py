"""Lost nodes and the jobs they held, for the global scheduler of cluster mode.

A node whose agent is dead (ActorDiedError, its Ray node gone) or silent for
`cluster.node_timeout_s` is lost: a gang's parts on other nodes are stopped, quotas and settings
are released by the driver, and its GPUs leave the book. Its jobs are failed at once
(`on_node_loss = "fail"`) or requeued (`"requeue"`), but not before nothing of them can run there
any more: until then they wait (running in the store, with a `lost` event; `_Waiting`). A node
that comes (back) is swept first (scheduler_lite.cluster.agent: processes of jobs the store does
not count as running there are killed), then its GPUs join; a node whose Ray node is gone counts
as swept `node_timeout_s` after its last answer. Parts an agent fenced (stopped because the global
scheduler was silent) are lost as with their node.

`NodeLoss` is a part of `ClusterDaemon` (a mixin, as scheduler_lite.job_controls is of the
daemon: it works on the global scheduler's state declared below, set in ClusterDaemon.__init__
and Daemon.__init__).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from scheduler_lite.cluster.nodes import ClusterHandle, Nodes, RayLauncher, cause
from scheduler_lite.cluster.parts import job_nodes, part_token
from scheduler_lite.storage import JobRecord, JobStatus, Storage
from scheduler_lite.tick import LiveJob

if TYPE_CHECKING:
    from collections.abc import Callable

    from scheduler_lite.cluster.config import ClusterConfig
    from scheduler_lite.driver import Launch

log = logging.getLogger("scheduler_lite.cluster")

JOIN_EVERY_S: Final = 5.0  # how often nodes not connected are looked for
WAITED_EVERY_S: Final = 1.0  # how often nodes that jobs wait for are looked for
_ORPHAN: Final = "<its nodes have not answered yet>"  # _why_not_adopted: wait for them


@dataclass
class _Waiting:
    """A job the store says runs, neither adopted nor in the book: its nodes are not all here.

    `reason` None: a job of a node that had not answered when the global scheduler started (an
    orphan), adopted if its nodes come within `node_timeout_s`. Otherwise the job is lost (why),
    and requeued or failed (cluster.on_node_loss) once `unsafe` is empty: the nodes where a part
    of it may still run (not swept since, not cleared), so that it never runs twice."""

    record: JobRecord
    nodes: tuple[str, ...]
    reason: str | None
    unsafe: set[str]


class NodeLoss:
    # The global scheduler's state these methods read and fill (ClusterDaemon.__init__, Daemon.__init__).
    cc: ClusterConfig
    nodes: Nodes
    storage: Storage
    ray_launcher: RayLauncher
    clock: Callable[[], float]
    _live: dict[str, LiveJob]
    _booked: list[Launch]
    _waiting: dict[str, _Waiting]
    _away: dict[str, float]
    _orphans_until: float | None
    _last_join: float
    _last_look: float
    _dirty: bool

    if TYPE_CHECKING:  # steps of ClusterDaemon these methods call (no stub may shadow them)
        def _set_gpus(self, now: float) -> None: ...
        def _driver_loss(self, job_id: str, now: float) -> None: ...
        def _why_not_adopted(self, record: JobRecord) -> str | None: ...
        def _readopt(self, record: JobRecord, now: float, launched_pid: int | None = None) -> None: ...
        def _find_pid(self, record: JobRecord) -> int | None: ...

    def _sweep(self, node: str, running: Sequence[JobRecord]) -> bool:
        """The node's agent keeps only the parts of jobs the store says run, with every node of
        the job connected and the job neither lost nor waiting for a node (a gang whose other
        node is gone is lost: its part here must not run on); it kills the rest. False (and the
        node dropped) if it cannot."""
        keep = []
        for r in running:
            nodes = job_nodes(self.cc, r.placement)
            waiting = self._waiting.get(r.id)
            if (node in nodes and r.launch_token and (waiting is None or waiting.reason is None)
                    and all(n in self.nodes.agents for n in nodes)):
                keep.append((r.id, part_token(r.launch_token, nodes.index(node))))
        try:
            stopped, self.nodes.fenced[node] = self.nodes.call(node, "sweep", keep)
        except Exception as e:  # noqa: BLE001 - an agent that cannot sweep is not trusted with jobs
            log.error("node %s: sweep failed (%s): not joining", node, e)
            self._away.setdefault(node, self.clock())
            self.nodes.drop(node)
            return False
        if stopped:
            log.warning("node %s: stopped leftover processes of %s", node, ", ".join(stopped))
        self._cleared(node)
        return True

    def _cleared(self, node: str) -> None:
        """Nothing of the jobs waiting for the node runs there any more (swept, or gone long enough)."""
        self._away.pop(node, None)
        for w in self._waiting.values():
            w.unsafe.discard(node)

    def _fenced_parts(self, now: float) -> None:
        """Parts the nodes' agents stopped because the global scheduler was silent (fencing):
        their jobs are lost as with their node. A report about another launch of the job, or
        about a node the job no longer runs on (a frozen agent that resumed), is stale: ignored."""
        lost = False
        for node, report in list(self.nodes.reports.items()):
            for job_id, token in report.fenced:
                live = self._live.get(job_id)
                if live is None or not _is_part(live, node, token):
                    log.info("node %s fenced a part of %s that does not run there now (launch %s): ignored",
                             node, job_id, token)
                    continue
                log.error("node %s fenced %s (the global scheduler was silent too long): it is %s", node,
                          job_id, "requeued" if self.cc.on_node_loss == "requeue" else "failed")
                self._lose_job(job_id, node, now, reason=_fencing(node))
                lost = True
        if lost:
            self._set_gpus(now)

    def _look_for_nodes(self, now: float) -> None:
        """Every JOIN_EVERY_S, and every WAITED_EVERY_S for nodes that jobs wait for: nodes not
        connected are joined (connected, swept), a node whose Ray node is gone is cleared
        `node_timeout_s` after its last answer, and the jobs of nodes that did not come within
        `node_timeout_s` of the start are lost."""
        if self._orphans_until is not None and now >= self._orphans_until:
            self._orphans_until = None
            self._give_up_orphans(now)
        waited = {n for w in self._waiting.values() for n in (w.unsafe if w.reason else w.nodes)}
        due = now - self._last_join >= JOIN_EVERY_S
        if not due and not (waited and now - self._last_look >= WAITED_EVERY_S):
            return
        self._last_look = now
        if due:
            self._last_join = now
        alive = self.nodes.alive_with_resource()
        for node, since in list(self._away.items()):
            if node not in alive and now - since >= self.cc.node_timeout_s:
                if any(node in w.unsafe for w in self._waiting.values()):
                    log.warning("node %s: no Ray node for it, %.0f s since its last answer: its jobs are taken as "
                                "stopped there", node, now - since)
                self._cleared(node)
        missing = sorted(alive - set(self.nodes.agents))
        joined = [n for n in missing if (due or n in waited) and self.nodes.connect(n, now)]
        if joined:
            self._joined(joined, now)

    def _joined(self, joined: Sequence[str], now: float) -> None:
        """Nodes just connected: jobs waiting for them adopted (every node of theirs here, none
        fenced) or lost, the nodes swept, their GPUs in the book."""
        adopt = []
        for job_id, w in list(self._waiting.items()):
            if w.reason is not None or not set(w.nodes) & set(joined):
                continue
            del self._waiting[job_id]
            why = self._why_not_adopted(w.record)
            if why is None:
                adopt.append(w.record)
            else:
                self._give_up(w.record, why, now)
        running = self.storage.list_jobs([JobStatus.RUNNING])
        for node in joined:
            self._sweep(node, running)
        self._set_gpus(now)
        for record in adopt:
            self._adopt_late(record, now)

    def _adopt_late(self, record: JobRecord, now: float) -> None:
        """A job of nodes that answered after the start: taken over as the start does."""
        why = self._why_not_adopted(record)
        if why is not None:  # a sweep failed, or fenced its part: lost after all
            self._give_up(record, why if why != _ORPHAN else f"node {job_nodes(self.cc, record.placement)[0]} lost",
                          now)
            return
        self.ray_launcher.jobs[record.id] = record
        try:
            self._readopt(record, now, record.pid if record.pid is not None else self._find_pid(record))
        except Exception as e:  # noqa: BLE001 - a node that does not answer now: lost with it
            log.error("%s: cannot take it over from its nodes (%s): lost", record.id, cause(e))
            self._give_up(record, f"its nodes did not answer: {cause(e)}", now)
        self._dirty = True

    def _give_up_orphans(self, now: float) -> None:
        """The jobs of nodes that have not answered within node_timeout_s of the start are lost."""
        for job_id, w in list(self._waiting.items()):
            if w.reason is None:
                del self._waiting[job_id]
                away = [n for n in w.nodes if n not in self.nodes.agents]
                log.error("%s: its node %s has not answered since the start: lost", job_id, away[0])
                self._give_up(w.record, f"node {away[0]} lost", now)

    def _node_lost(self, node: str, now: float) -> None:
        """Its jobs lost (gang parts elsewhere stopped first), its GPUs out of the book. Its own
        parts may run on (a frozen agent, one killed on a live node) until it is swept or cleared."""
        log.error("node %s lost: its jobs are %s", node, "requeued" if self.cc.on_node_loss == "requeue" else "failed")
        self._away[node] = self.nodes.last_answer(node, now)
        self.nodes.drop(node)
        self.storage.add_event(now, "node_lost", None, node=node)
        for job_id, live in list(self._live.items()):
            assert isinstance(live.handle, ClusterHandle)
            if node in live.handle.nodes:
                self._lose_job(job_id, node, now)
        for launch in list(self._booked):  # booked this tick, not started: never ran
            if node in job_nodes(self.cc, launch.gpus):
                self._booked.remove(launch)
                self._record_loss(launch.job_id, node, now)
                self._driver_loss(launch.job_id, now)
        self._set_gpus(now)

    def _lose_job(self, job_id: str, node: str, now: float, reason: str | None = None) -> None:
        """A running job's part on `node` is gone (lost node, fencing): its other parts stopped,
        its GPUs and quota released; requeued or failed once nothing of it can run anywhere."""
        live = self._live.pop(job_id)
        assert isinstance(live.handle, ClusterHandle)
        self._driver_loss(job_id, now)
        self._give_up(live.record, reason or f"node {node} lost", now)

    def _give_up(self, record: JobRecord, reason: str, now: float) -> None:
        """The job is lost: its parts on connected nodes stopped; it waits (`_Waiting`) until
        none can run anywhere, then `_release` requeues or fails it."""
        nodes = job_nodes(self.cc, record.placement)
        unsafe = {n for n in nodes if n in self._away}
        for node in nodes:
            if node in self.nodes.agents and not self._stop_part(node, record.id):
                unsafe.add(node)  # until its report no longer shows the part, or it is lost and swept
        self._waiting[record.id] = _Waiting(record, nodes, reason, unsafe)
        if unsafe and self.cc.on_node_loss == "requeue":
            log.warning("%s lost (%s): requeued once nothing of it can run on %s", record.id, reason,
                        ", ".join(sorted(unsafe)))
            self.storage.add_event(now, "lost", record.id, reason=reason, waits_for=sorted(unsafe))

    def _stop_part(self, node: str, job_id: str) -> bool:
        """Stop the job's part on a connected node; False if the agent did not answer (a stop
        queued behind the call ends it there if it resumes)."""
        try:
            self.nodes.call(node, "stop", job_id, 0.0)
        except Exception as e:  # noqa: BLE001 - the node may be lost next: its sweep stops the part then
            log.error("node %s: cannot stop %s (%s)", node, job_id, cause(e))
            self.nodes.stop_later(node, job_id)
            return False
        return True

    def _release(self, now: float) -> None:
        """Lost jobs nothing of which can run any more are requeued or failed (failed at once: a
        failed job never runs again); a part whose stop went unanswered counts as stopped once
        its node's report no longer shows it running."""
        for job_id, w in list(self._waiting.items()):
            if w.reason is None:
                continue
            for node in list(w.unsafe):
                report = self.nodes.reports.get(node) if node in self.nodes.agents else None
                part = None if report is None else report.parts.get(job_id)
                if report is not None and (part is None or part.exit is not None):
                    w.unsafe.discard(node)
            if w.unsafe and self.cc.on_node_loss == "requeue":
                continue
            del self._waiting[job_id]
            self._record_loss(job_id, w.nodes[0], now, w.reason)
            self._dirty = True

    def _record_loss(self, job_id: str, node: str, now: float, reason: str | None = None) -> None:
        """In the store: the job back in its queue (no placement, no token: it never ran) or failed."""
        reason = reason or f"node {node} lost"
        with self.storage.transaction():
            if self.cc.on_node_loss == "requeue":
                self.storage.update_job(job_id, state=JobStatus.QUEUED, role=None, placement=(), job_dir=None,
                                        started_at=None, launch_token=None, pid=None, pid_start=None,
                                        control_seq=0)
                self.storage.add_event(now, "requeued", job_id, reason=reason)
            else:
                self.storage.update_job(job_id, state=JobStatus.FAILED, ended_at=now, reason=reason)
                self.storage.add_event(now, "exited", job_id, state=str(JobStatus.FAILED), exit_code=None,
                                       reason=reason)
            self.storage.clear_placements(job_id)


def _is_part(live: LiveJob, node: str, token: str) -> bool:
    """`token` is the launch token of the job's running part on `node`."""
    assert isinstance(live.handle, ClusterHandle)
    nodes = live.handle.nodes
    launch = live.record.launch_token
    return node in nodes and launch is not None and token == part_token(launch, nodes.index(node))


def _fencing(node: str) -> str:
    return f"node {node} stopped it: no word from the global scheduler for half of cluster.node_timeout_s (fencing)"
