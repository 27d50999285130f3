"""Lost nodes and the jobs they held, for the global scheduler of cluster mode.

A node is lost when its actor dies or is silent for `cluster.node_timeout_s`; parts its actor
fenced are lost as with their node; at the start of a global scheduler (`recover`), a job whose
nodes have not answered waits for them up to `node_timeout_s`. A lost job is requeued or failed
(`on_node_loss`) only once nothing of it can run any more (its nodes swept or cleared), so that
a job never runs next to its rerun. The whole story: docs/cluster.md, "Faults".

`NodeLoss` is a component of the cluster's job host (scheduler_lite.cluster.host): it keeps
the jobs that wait for nodes, asks the host to rebuild the GPUs when nodes come and go, and
hands the jobs it loses back to the daemon: out of its book at once (`HostedJobs.lose`), and,
once nothing of them can run anywhere, recorded as requeued or failed (`HostedJobs.record_lost`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol

from scheduler_lite.cluster.nodes import ClusterHandle, Nodes, cause
from scheduler_lite.cluster.parts import job_nodes, part_token
from scheduler_lite.storage import JobRecord, JobStatus, Storage
from scheduler_lite.tick import LiveJob

if TYPE_CHECKING:
    from collections.abc import Callable

    from scheduler_lite.cluster.config import ClusterConfig
    from scheduler_lite.jobhost import HostedJobs
    from scheduler_lite.tick import JobTableView

log = logging.getLogger("scheduler_lite.cluster")

JOIN_EVERY_S: Final = 5.0  # how often nodes not connected are looked for
WAITED_EVERY_S: Final = 1.0  # how often nodes that jobs wait for are looked for


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


class Host(Protocol):
    """What node loss asks of the cluster's job host (scheduler_lite.cluster.host, which imports
    this module: naming it here would make an import circle)."""

    @property
    def jobs(self) -> HostedJobs: ...

    @property
    def table(self) -> JobTableView: ...

    def gpus_changed(self, now: float) -> None: ...

    def find(self, record: JobRecord) -> int | None: ...


class NodeLoss:
    """The jobs of nodes lost, fenced, or not here yet; the nodes that (re)join."""

    def __init__(self, cc: ClusterConfig, nodes: Nodes, storage: Storage, clock: Callable[[], float],
                 host: Host, now: float) -> None:
        self.cc = cc
        self.nodes = nodes
        self.storage = storage
        self.clock = clock
        self.host = host
        self._requeue = cc.on_node_loss == "requeue"  # a lost job goes back to its queue, else fails
        self.waiting: dict[str, _Waiting] = {}
        # Nodes not here may still run parts of jobs (a frozen node actor, one killed on a live
        # node): from when (the start) until swept or cleared (look_for_nodes).
        self._away: dict[str, float] = {n: now for n in cc.nodes if n not in nodes.actors}
        self._orphans_until: float | None = now + cc.node_timeout_s
        self._last_join = self._last_look = now

    # -- at the start -----------------------------------------------------------------------------

    def recover(self, running: Sequence[JobRecord], now: float) -> set[str]:
        """Before the daemon's recovery: every connected node swept; the jobs whose nodes are
        not all here wait for them (`_Waiting`), those with a part fenced or lost before a crash
        are lost: requeued or failed (`release`) once nothing of them can run. The ids of the
        jobs the daemon must not adopt now."""
        for record in running:
            nodes = job_nodes(self.cc, record.placement)
            lost_before = self._lost_before(record)
            if lost_before is None and nodes and not set(nodes) & set(self.nodes.actors):  # none here: wait
                self.waiting[record.id] = _Waiting(record, nodes, None, set(nodes))
            elif (why := lost_before or self.why_not_adopted(record)) is not None:
                self.waiting[record.id] = _Waiting(record, nodes, why, {n for n in nodes if n in self._away})
        for node in list(self.nodes.actors):
            self._sweep(node, running)
        for record in running:  # a node whose sweep failed, a part fenced since `info`: lost
            why = self.why_not_adopted(record) if record.id not in self.waiting else None
            if why is not None:
                self._give_up(record, why, now)
        if not any(w.reason is None for w in self.waiting.values()):
            self._orphans_until = None
        self.release(now)  # the requeued ones are enqueued by the daemon's recovery
        return set(self.waiting)

    def why_not_adopted(self, record: JobRecord) -> str | None:
        """None if the job can be taken over now; else why it is lost (a part fenced by its node, a
        node of it not here)."""
        nodes = job_nodes(self.cc, record.placement)
        for rank, node in enumerate(nodes):
            fenced = self.nodes.fenced.get(node, {}).get(record.id)
            if node in self.nodes.actors and record.launch_token and fenced == part_token(record.launch_token, rank):
                return _fencing(node)
        away = [n for n in nodes if n not in self.nodes.actors]
        return f"node {away[0]} lost" if away else None

    def _lost_before(self, record: JobRecord) -> str | None:
        """Why the job was lost, if a global scheduler lost it and died before it was requeued."""
        reason = None
        for event in self.storage.events(record.id):
            if event.kind == "launched":
                reason = None
            elif event.kind == "lost":
                reason = str(event.detail.get("reason") or "lost")
        return reason

    # -- every tick -------------------------------------------------------------------------------

    def _sweep(self, node: str, running: Sequence[JobRecord]) -> bool:
        """The node's actor keeps only the parts of jobs the store says run, with every node of
        the job connected and the job neither lost nor waiting for a node (a gang whose other
        node is gone is lost: its part here must not run on); it kills the rest. False (and the
        node dropped) if it cannot."""
        keep = []
        for r in running:
            nodes = job_nodes(self.cc, r.placement)
            waiting = self.waiting.get(r.id)
            if (node in nodes and r.launch_token and (waiting is None or waiting.reason is None)
                    and all(n in self.nodes.actors for n in nodes)):
                keep.append((r.id, part_token(r.launch_token, nodes.index(node))))
        try:
            stopped, self.nodes.fenced[node] = self.nodes.call(node, "sweep", keep)
        except Exception as e:  # noqa: BLE001 - a node actor that cannot sweep is not trusted with jobs
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
        for w in self.waiting.values():
            w.unsafe.discard(node)

    def fenced_parts(self, now: float) -> None:
        """Parts the nodes' actors stopped because the global scheduler was silent (fencing):
        their jobs are lost as with their node. A report about another launch of the job, or
        about a node the job no longer runs on (a frozen actor that resumed), is stale: ignored."""
        lost = False
        for node, report in list(self.nodes.reports.items()):
            for job_id, token in report.fenced:
                live = self.host.table.live.get(job_id)
                if live is None or not _is_part(live, node, token):
                    log.info("node %s fenced a part of %s that does not run there now (launch %s): ignored",
                             node, job_id, token)
                    continue
                log.error("node %s fenced %s (the global scheduler was silent too long): it is %s", node,
                          job_id, "requeued" if self._requeue else "failed")
                self._lose_job(job_id, _fencing(node), now)
                lost = True
        if lost:
            self.host.gpus_changed(now)

    def look_for_nodes(self, now: float) -> None:
        """Every JOIN_EVERY_S, and every WAITED_EVERY_S for nodes that jobs wait for: nodes not
        connected are joined (connected, swept), a node whose Ray node is gone is cleared
        `node_timeout_s` after its last answer, and the jobs of nodes that did not come within
        `node_timeout_s` of the start are lost."""
        if self._orphans_until is not None and now >= self._orphans_until:
            self._orphans_until = None
            for job_id, w in list(self.waiting.items()):  # orphans: their nodes never answered
                if w.reason is None:
                    del self.waiting[job_id]
                    away = [n for n in w.nodes if n not in self.nodes.actors]
                    log.error("%s: its node %s has not answered since the start: lost", job_id, away[0])
                    self._give_up(w.record, f"node {away[0]} lost", now)
        waited = {n for w in self.waiting.values() for n in (w.unsafe if w.reason else w.nodes)}
        due = now - self._last_join >= JOIN_EVERY_S
        if not due and not (waited and now - self._last_look >= WAITED_EVERY_S):
            return
        self._last_look = now
        if due:
            self._last_join = now
        alive = self.nodes.alive_with_resource()
        for node, since in list(self._away.items()):
            if node not in alive and now - since >= self.cc.node_timeout_s:
                if any(node in w.unsafe for w in self.waiting.values()):
                    log.warning("node %s: no Ray node for it, %.0f s since its last answer: its jobs are taken as "
                                "stopped there", node, now - since)
                self._cleared(node)
        missing = sorted(alive - set(self.nodes.actors))
        joined = [n for n in missing if (due or n in waited) and self.nodes.connect(n, now)]
        if joined:
            self._joined(joined, now)

    def _joined(self, joined: Sequence[str], now: float) -> None:
        """Nodes just connected: jobs waiting for them adopted (every node of theirs here, none
        fenced) or lost, the nodes swept, their GPUs in the book."""
        adopt = []
        for job_id, w in list(self.waiting.items()):
            if w.reason is not None or not set(w.nodes) & set(joined):
                continue
            del self.waiting[job_id]
            why = self.why_not_adopted(w.record)
            if why is None:
                adopt.append(w.record)
            else:
                self._give_up(w.record, why, now)
        running = self.storage.list_jobs([JobStatus.RUNNING])
        for node in joined:
            self._sweep(node, running)
        self.host.gpus_changed(now)
        for record in adopt:
            self._adopt_late(record, now)

    def _adopt_late(self, record: JobRecord, now: float) -> None:
        """A job of nodes that answered after the start: taken over as the start does."""
        why = self.why_not_adopted(record)
        if why is not None:  # a sweep failed, or fenced its part: lost after all
            self._give_up(record, why, now)
            return
        try:
            self.host.jobs.adopt(record, now, record.pid if record.pid is not None else self.host.find(record))
        except Exception as e:  # noqa: BLE001 - a node that does not answer now: lost with it
            log.error("%s: cannot take it over from its nodes (%s): lost", record.id, cause(e))
            self._give_up(record, f"its nodes did not answer: {cause(e)}", now)
        self.host.jobs.changed()

    def node_lost(self, node: str, now: float) -> None:
        """Its jobs lost (gang parts elsewhere stopped first), its GPUs out of the book. Its own
        parts may run on (a frozen actor, one killed on a live node) until it is swept or cleared."""
        log.error("node %s lost: its jobs are %s", node, "requeued" if self._requeue else "failed")
        self._away[node] = self.nodes.last_answer(node, now)
        self.nodes.drop(node)
        self.storage.add_event(now, "node_lost", None, node=node)
        for job_id, live in list(self.host.table.live.items()):
            assert isinstance(live.handle, ClusterHandle)
            if node in live.handle.nodes:
                self._lose_job(job_id, f"node {node} lost", now)
        for launch in list(self.host.table.booked):  # booked this tick, not started: never ran
            if node in job_nodes(self.cc, launch.gpus):
                self.host.jobs.record_lost(launch.job_id, now, f"node {node} lost", self._requeue)
                self.host.jobs.lose(launch.job_id, now)
        self.host.gpus_changed(now)

    def _lose_job(self, job_id: str, reason: str, now: float) -> None:
        """A running job's part is gone (lost node, fencing): its other parts stopped, its GPUs
        and quota released; requeued or failed once nothing of it can run anywhere."""
        live = self.host.jobs.lose(job_id, now)
        assert live is not None
        self._give_up(live.record, reason, now)

    def _give_up(self, record: JobRecord, reason: str, now: float) -> None:
        """The job is lost: its parts on connected nodes stopped; it waits (`_Waiting`) until
        none can run anywhere, then `_release` requeues or fails it."""
        nodes = job_nodes(self.cc, record.placement)
        unsafe = {n for n in nodes if n in self._away}
        for node in (n for n in nodes if n in self.nodes.actors):
            try:
                self.nodes.call(node, "stop", record.id, 0.0)
            except Exception as e:  # noqa: BLE001 - the node may be lost next: its sweep stops the part then
                log.error("node %s: cannot stop %s (%s)", node, record.id, cause(e))
                self.nodes.stop_later(node, record.id)  # ends it there if the actor resumes
                unsafe.add(node)  # until its report no longer shows the part, or it is lost and swept
        self.waiting[record.id] = _Waiting(record, nodes, reason, unsafe)
        if unsafe and self._requeue:
            log.warning("%s lost (%s): requeued once nothing of it can run on %s", record.id, reason,
                        ", ".join(sorted(unsafe)))
            self.storage.add_event(now, "lost", record.id, reason=reason, waits_for=sorted(unsafe))

    def release(self, now: float) -> None:
        """Lost jobs nothing of which can run any more are requeued or failed (failed at once: a
        failed job never runs again); a part whose stop went unanswered counts as stopped once
        its node's report no longer shows it running."""
        for job_id, w in list(self.waiting.items()):
            if w.reason is None:
                continue
            for node in list(w.unsafe):
                report = self.nodes.reports.get(node) if node in self.nodes.actors else None
                part = None if report is None else report.parts.get(job_id)
                if report is not None and (part is None or part.exit is not None):
                    w.unsafe.discard(node)
            if w.unsafe and self._requeue:
                continue
            del self.waiting[job_id]
            self.host.jobs.record_lost(job_id, now, w.reason, self._requeue)
            self.host.jobs.changed()


def _is_part(live: LiveJob, node: str, token: str) -> bool:
    """`token` is the launch token of the job's running part on `node`."""
    assert isinstance(live.handle, ClusterHandle)
    nodes = live.handle.nodes
    launch = live.record.launch_token
    return node in nodes and launch is not None and token == part_token(launch, nodes.index(node))


def _fencing(node: str) -> str:
    return f"node {node} stopped it: no word from the global scheduler for half of cluster.node_timeout_s (fencing)"
