"""The global scheduler of cluster mode: the daemon's loop over every node's GPUs, on Ray.

`ClusterDaemon` is the single-machine `Daemon` (same store, same Driver, same Algorithm 1 and
coordinator rounds, same recovery) with its job-facing hooks pointed at node agents
(scheduler_lite.cluster.agent) instead of the local file system:

  =======================  ===================================  ===============================
  the daemon's step        one machine (Daemon)                 cluster (ClusterDaemon)
  =======================  ===================================  ===============================
  GPUs                     devices.inventory()                  every connected node's, global
                                                                ids node_index * 100 + local id,
                                                                NVLink group "<node>/<group>"
  stats.json, exits        read in the job dir                  one `report` per node per tick
  start a job              Launcher.start                       agent.start on each node of it
  control.json             write_control                        agent.write_control
  restart: pid, exit, seq  pid file, token, exit_status         the same, asked of the node
  =======================  ===================================  ===============================

Topology: a node is the level above the NVLink group. Algorithm 1 places a gang inside one group
when it fits, else over whole groups; `node_aware` then refuses a gang that would span nodes unless
its tenant is in `cluster.span_tenants`: a guarantee gang holds (Reserve) the GPUs it found on its
best node and waits there, an opportunistic one waits in its queue.

Faults. A node whose agent is dead (ActorDiedError, its Ray node gone) or silent for
`cluster.node_timeout_s` is lost: a gang's parts on other nodes are stopped, quotas and settings
are released by the driver, and its GPUs leave the book (the driver is rebuilt over the remaining
GPUs). Its jobs are failed at once (`on_node_loss = "fail"`) or requeued (`"requeue"`), but not
before nothing of them can run there any more: until then they wait (running in the store, with a
`lost` event; `_Waiting`). A node that comes (back) is swept first (scheduler_lite.cluster.agent:
processes of jobs the store does not count as running there are killed), then its GPUs join; a
node whose Ray node is gone counts as swept `node_timeout_s` after its last answer (its agent, if
it still runs cut off, has fenced its jobs by then). A restart of the global scheduler recovers
from the store as the daemon does (its node agents are detached named actors that outlive it);
a job whose node does not answer at the restart waits for it up to `node_timeout_s`, and is
adopted if it comes, lost otherwise.

The node agents seen from here (the connection, the daemon's Launcher and devices carried out
through them): scheduler_lite.cluster.nodes; a job's parts on its nodes (which nodes, their
control.json and stats.json): scheduler_lite.cluster.parts.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

from scheduler_lite.cluster.config import FENCE_FRACTION, ClusterConfig
from scheduler_lite.cluster.nodes import CALL_TIMEOUT_S, ClusterDevices, ClusterHandle, Nodes, RayLauncher, cause
from scheduler_lite.cluster.parts import job_nodes, merge_stats, part_token, split_control
from scheduler_lite.cluster.tasks import is_ray_task
from scheduler_lite.config import Config
from scheduler_lite.daemon import Daemon
from scheduler_lite.driver import Driver, Launch, SchedulePolicy
from scheduler_lite.jobenv import process_control
from scheduler_lite.launcher import ExitInfo, LaunchError, ProcessHandle
from scheduler_lite.model import ClusterState, GlobalDecision, Gpu, JobState, Place, Reserve, Role, Unreserve
from scheduler_lite.policy.global_scheduler import schedule
from scheduler_lite.storage import JobRecord, JobStatus, Storage
from scheduler_lite.tick import LiveJob, TickLog, TickReport
from tf_antman.protocol import Control, Stats

log = logging.getLogger("scheduler_lite.cluster")

JOIN_EVERY_S: Final = 5.0  # how often nodes not connected are looked for
WAITED_EVERY_S: Final = 1.0  # how often nodes that jobs wait for are looked for


# ----------------------------------------------------------------------------------------------
# Placement across nodes.


def node_aware(policy: SchedulePolicy, span_tenants: Iterable[str], node_of: Callable[[int], str],
               on_wait: Callable[[str, str], None] | None = None) -> SchedulePolicy:
    """Algorithm 1 with the node level: a multi-node Place only for tenants allowed to span nodes.

    A guarantee gang that may not span holds (Reserve) what it found on its best node that can
    hold it, and waits there. A gang that may not span and is larger than every node here (a
    node is away) is kept out of the pass: it would take GPUs of the pass (for a placement then
    dropped) and hold a node it can never run on, blocking every guarantee job behind it. It
    waits, holding nothing; `on_wait(job id, why)` is told each pass."""
    span = frozenset(span_tenants)

    def run(state: ClusterState, config: object) -> list[GlobalDecision]:
        sizes = Counter(node_of(g) for g in state.gpus)
        largest = max(sizes.values(), default=0)
        too_big = {j.id for j in state.jobs.values()
                   if j.state is JobState.PENDING and j.tenant not in span and j.num_gpus > largest}
        out: list[GlobalDecision] = [Unreserve(j) for j in sorted(too_big) if j in state.reservations]
        for job_id in sorted(too_big):
            if on_wait is not None:
                on_wait(job_id, f"needs {state.jobs[job_id].num_gpus} GPUs on one node (tenant "
                                f"{state.jobs[job_id].tenant!r} may not span nodes) and the largest node here has "
                                f"{largest}: it waits, holding nothing, for a larger node to join")
        if too_big:
            state = replace(state, index=_Without(state.index, too_big))
        for d in policy(state, config):
            if isinstance(d, Place | Reserve) and state.jobs[d.job_id].tenant not in span:
                d = _on_one_node(d, state.jobs[d.job_id].num_gpus, sizes, node_of)
                if d is None:
                    continue
            out.append(d)
        return out

    return run


def _on_one_node(d: Place | Reserve, num_gpus: int, sizes: Counter[str],
                 node_of: Callable[[int], str]) -> Place | Reserve | None:
    """A decision for a gang that may not span nodes: a Place within one node as it is; over
    several, a guarantee gang holds the GPUs found on its best node that can hold it (most
    found there, then the name), an opportunistic one waits. A hold likewise."""
    per_node = Counter(node_of(g) for g in d.gpus)
    if isinstance(d, Place) and len(per_node) <= 1:
        return d
    if isinstance(d, Place) and d.role is not Role.GUARANTEE:
        return None
    fits = [n for n in per_node if sizes[n] >= num_gpus]
    if not fits:
        return None
    best = min(fits, key=lambda n: (-per_node[n], n))
    return Reserve(d.job_id, tuple(g for g in d.gpus if node_of(g) == best))


class _Without:
    """The book's queries with some pending jobs left out of the queues (node_aware)."""

    def __init__(self, index: Any, hidden: set[str]) -> None:
        self._index = index
        self._hidden = hidden

    def pending_guarantee_queue(self, tenant: str) -> Sequence[str]:
        return [j for j in self._index.pending_guarantee_queue(tenant) if j not in self._hidden]

    def pending_opportunistic_queue(self) -> Sequence[str]:
        return [j for j in self._index.pending_opportunistic_queue() if j not in self._hidden]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._index, name)


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


# ----------------------------------------------------------------------------------------------


class ClusterDaemon(Daemon):
    """The global scheduler: `tick(now)` polls the nodes, then runs the daemon's tick."""

    def __init__(self, config: Config, storage: Storage, clock: Callable[[], float] = time.time,
                 nodes: Nodes | None = None) -> None:
        if config.cluster is None:
            raise ValueError("ClusterDaemon needs a [cluster] table in the config")
        self.cc: ClusterConfig = config.cluster
        self.nodes = nodes if nodes is not None else Nodes(config)
        now = clock()
        self._waiting: dict[str, _Waiting] = {}
        self._wait_noted: dict[str, str] = {}  # job id -> the last reason node_aware gave (one event each)
        self._connect_at_start(now)
        # Nodes not here may still run parts of jobs (a frozen agent, an agent killed on a live
        # node): from when (the start) until swept or cleared (_look_for_nodes).
        self._away: dict[str, float] = {n: now for n in self.cc.nodes if n not in self.nodes.agents}
        self._orphans_until: float | None = now + self.cc.node_timeout_s
        self._last_join = self._last_look = now
        self.cluster_devices = ClusterDevices(config.devices.kind, self.nodes)
        self.cluster_devices.set_inventory(self._all_gpus())
        self.ray_launcher = RayLauncher(self.nodes)
        super().__init__(config, storage, clock, devices=self.cluster_devices, launcher=self.ray_launcher)
        self.driver.policy = node_aware(schedule, self.cc.span_tenants, self.cc.node_of, self._note_wait)

    # -- nodes ------------------------------------------------------------------------------------

    def _connect_at_start(self, now: float) -> None:
        """Every node's agent asked at once. The wait for the slow ones is short once an agent
        with jobs has answered: it fences them unless its sweep and reports follow within half
        of its fence (a frozen agent must not cost the healthy nodes their jobs). A node not
        here joins later (`_look_for_nodes`); why it is not here is logged."""
        alive = self.nodes.alive_with_resource()
        fence_s = self.cc.node_timeout_s * FENCE_FRACTION
        self.nodes.connect_all(sorted(alive), now, wait_s=CALL_TIMEOUT_S, busy_wait_s=fence_s / 2)
        unknown = self.nodes.unknown_resources()
        for i, node in enumerate(self.cc.nodes):
            if node not in alive:
                hint = f" (Ray offers {', '.join(unknown)}, which no cluster.nodes entry names)" if unknown else ""
                log.warning("cluster.nodes[%d] %r: no Ray node has resource %s; its GPUs are not served until it "
                            "joins%s", i, node, self.cc.resource(node), hint)
            elif node not in self.nodes.agents:
                log.warning("cluster.nodes[%d] %r: its agent has not answered yet; its GPUs join when it does, its "
                            "jobs wait for it up to cluster.node_timeout_s", i, node)

    def _all_gpus(self) -> list[Gpu]:
        return [g for node in self.cc.nodes for g in self.nodes.gpus.get(node, ())]

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

    def tick(self, now: float | None = None) -> TickReport:
        now = self.clock() if now is None else now
        for node in self.nodes.poll(now):
            self._node_lost(node, now)
        self._fenced_parts(now)
        self._look_for_nodes(now)
        self._release(now)
        return super().tick(now)

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

    def _note_wait(self, job_id: str, why: str) -> None:
        """node_aware keeps a gang waiting: said once per reason (an event and the log)."""
        if self._wait_noted.get(job_id) == why:
            return
        self._wait_noted[job_id] = why
        log.info("%s %s", job_id, why)
        self.storage.add_event(self.clock(), "waiting", job_id, reason=why)

    def _driver_loss(self, job_id: str, now: float) -> None:
        """In the book: its GPUs, quota and settings released. The rebuild that follows
        (`_set_gpus`) keeps only running and queued jobs, so a requeued job (queued in the store)
        is picked up again by the next ingest, as the daemon does after a restart."""
        self.driver.finish(job_id, now, failed=True)
        self._dirty = True

    def _set_gpus(self, now: float) -> None:
        """Rebuild the driver over the GPUs of the connected nodes, keeping jobs and settings.

        The book has no GPU removal: a new one is filled with the running jobs (their settings
        kept) and the queued ones. Measured solo step times and coordinator memos start afresh;
        reservations are recomputed by the next pass.
        """
        gpus = self._all_gpus()
        old = self.driver
        new = Driver(gpus, old.book.tenants.values(), policy=old.policy, scheduler_config=old.scheduler_config,
                     coordinator_config=old.ccfg)
        ids = {g.id for g in gpus}
        for job in old.book.jobs.values():
            if job.state is JobState.RUNNING and job.role is not None and set(job.placement) <= ids:
                new.restore(job, Place(job.id, job.placement, job.role), old.settings[job.id], now)
            elif job.state is JobState.PENDING:
                new.submit(job)
        self.driver, self.book = new, new.book
        self.cluster_devices.set_inventory(gpus)
        self.gpus = {g.id: g for g in gpus}
        self._util_samples = {g: self._util_samples.get(g, deque()) for g in self.gpus}
        self._round_sig = {}
        self._dirty = True
        if set(self.cc.nodes) <= set(self.nodes.agents):
            self._reject_what_cannot_run(now)

    def _reject_what_cannot_run(self, now: float) -> None:
        """Every node is here: queued jobs that waited for the cluster's size (_cannot_run lets
        them wait while a node is away) and can never run on it fail now, with the reason."""
        for job in [j for j in self.book.jobs.values() if j.state is JobState.PENDING]:
            record = self.storage.get_job(job.id)
            problem = self._cannot_run(record) if record is not None else None
            if problem is not None:
                self._reject(job.id, problem, now, None)
                self.driver.finish(job.id, now, failed=True)

    # -- hooks of the daemon ----------------------------------------------------------------------

    def _recover(self, now: float) -> None:
        """The daemon's recovery, for the jobs whose nodes are all here and none of whose parts
        was fenced; first every connected node is swept of the rest. A job of nodes that have not
        answered waits for them (`_Waiting`); a job with a part fenced, on a node lost before a
        crash of the global scheduler, or with a part on a node not here is lost: requeued or
        failed (`_release`) once nothing of it can run."""
        running = self.storage.list_jobs([JobStatus.RUNNING])
        for record in running:
            nodes = job_nodes(self.cc, record.placement)
            why = self._lost_before(record) or self._why_not_adopted(record)
            if why is None:
                self.ray_launcher.jobs[record.id] = record
            elif why == _ORPHAN:
                self._waiting[record.id] = _Waiting(record, nodes, None, set(nodes))
            else:
                self._waiting[record.id] = _Waiting(record, nodes, why, {n for n in nodes if n in self._away})
        for node in list(self.nodes.agents):
            self._sweep(node, running)
        for record in running:  # a node whose sweep failed, a part fenced since `info`: lost
            why = self._why_not_adopted(record) if record.id not in self._waiting else None
            if why is not None:
                self._give_up(record, why if why != _ORPHAN else f"node {job_nodes(self.cc, record.placement)[0]} lost",
                              now)
        if not any(w.reason is None for w in self._waiting.values()):
            self._orphans_until = None
        self._release(now)  # the requeued ones are enqueued by the daemon's recovery
        super()._recover(now)

    def _why_not_adopted(self, record: JobRecord) -> str | None:
        """None if the job can be taken over now; _ORPHAN if none of its nodes is here; else why
        it is lost (a part fenced by its agent, a node of it not here)."""
        nodes = job_nodes(self.cc, record.placement)
        for rank, node in enumerate(nodes):
            fenced = self.nodes.fenced.get(node, {}).get(record.id)
            if node in self.nodes.agents and record.launch_token and fenced == part_token(record.launch_token, rank):
                return _fencing(node)
        away = [n for n in nodes if n not in self.nodes.agents]
        if not away:
            return None
        return _ORPHAN if len(away) == len(nodes) else f"node {away[0]} lost"

    def _lost_before(self, record: JobRecord) -> str | None:
        """Why the job was lost, if a global scheduler lost it and died before it was requeued."""
        reason = None
        for event in self.storage.events(record.id):
            if event.kind == "launched":
                reason = None
            elif event.kind == "lost":
                reason = str(event.detail.get("reason") or "lost")
        return reason

    def _readopt(self, record: JobRecord, now: float, launched_pid: int | None = None) -> None:
        if record.id not in self._waiting:  # waiting: taken over when its nodes come (_joined)
            super()._readopt(record, now, launched_pid)

    def _find_launched(self, records: Sequence[JobRecord], now: float) -> dict[str, int]:
        return super()._find_launched([r for r in records if r.id not in self._waiting], now)

    def _cannot_run(self, record: JobRecord) -> str | None:
        largest = max((len(gs) for gs in self.nodes.gpus.values()), default=0)
        if is_ray_task(record.command) and record.num_gpus != 1:
            return f"a Ray task's booking is one GPU, not {record.num_gpus} (docs/cluster.md, \"Ray users\")"
        if not set(self.cc.nodes) <= set(self.nodes.agents):
            # A node is away (lost, restarting, not up yet): the cluster's size is not known, so a
            # job too big for the nodes here waits for it (a requeued gang must not fail for it).
            # The config, not the book (which keeps a dropped tenant while a job of theirs runs).
            if self.config.tenant(record.tenant) is None:
                return f"tenant {record.tenant!r} is not configured"
            return None
        if record.tenant not in self.cc.span_tenants and record.num_gpus > largest:
            return (f"needs {record.num_gpus} GPUs; the largest node has {largest} and tenant "
                    f"{record.tenant!r} may not span nodes (cluster.span_tenants)")
        return super()._cannot_run(record)

    def _prepare_job_dir(self, launch: Launch, uid: int | None) -> Path:
        """On the job's first node; its agent makes it ready when it starts the job. Before the
        booking, each node of the launch drops what an earlier launch left there (pid, exit
        status): a restart between the booking and the start must find no process of this
        launch (requeued: never started), not the old one's end."""
        nodes = job_nodes(self.cc, launch.gpus)
        for node in nodes:
            try:
                self.nodes.call(node, "prepare", launch.job_id)
            except Exception as e:  # noqa: BLE001 - as a start that fails: the launch fails
                raise OSError(f"node {node}: {cause(e)}") from None
        return self.cc.node_jobs_dir(self.config.state_dir, nodes[0]) / launch.job_id

    def _launch(self, launch: Launch, record: JobRecord, job_dir: Path) -> ProcessHandle:
        assert record.launch_token is not None
        nodes = job_nodes(self.cc, launch.gpus)
        common = {
            "SCHEDULER_LITE_GPUS": ",".join(str(g) for g in launch.gpus),
            "SCHEDULER_LITE_NUM_NODES": str(len(nodes)),
            "SCHEDULER_LITE_NODES": ",".join(self.nodes.hostnames.get(n, n) for n in nodes),
        }
        started: list[str] = []
        handle = ClusterHandle(0, None, job_dir, None, launch.job_id, nodes)
        for rank, node in enumerate(nodes):
            mine = [g for g in launch.gpus if self.cc.node_of(g) == node]
            local = [replace(self.gpus[g], id=self._device_id(g, i)) for i, g in enumerate(mine)]
            limit = min(launch.settings.limits[g] for g in mine)
            share = min(launch.settings.shares[g] for g in mine)
            env = {**common, "SCHEDULER_LITE_NODE_RANK": str(rank)}
            # A Ray task is started by Ray: its node's agent only books it (scheduler_lite.cluster.tasks).
            how = "expect" if is_ray_task(record.command) else "start"
            try:
                pid, start, _ = self.nodes.call(node, how, record, rank, local, limit, share, env)
            except Exception as e:  # noqa: BLE001 - node gone, bad workdir...: the job did not start
                if started:
                    self.ray_launcher.stop(replace(handle, nodes=tuple(started)), 0.0)
                # A call that timed out may still run on its agent (a frozen agent resumes): a stop
                # queued behind it on the same actor (calls run in order) ends it there, unwaited.
                self.nodes.stop_later(node, launch.job_id)
                raise LaunchError(f"cannot start {launch.job_id} on node {node}: {cause(e)}") from None
            started.append(node)
            if rank == 0:
                handle.pid, handle.start_ticks = pid, start
        self.ray_launcher.jobs[launch.job_id] = record
        return handle

    def _device_id(self, gpu: int, index: int) -> int:
        """The id a part's job sees for its `index`-th GPU on the node.

        NVML: the node's GPU index (CUDA_VISIBLE_DEVICES, renumbered from 0 by CUDA). Emulated:
        the index itself, as CUDA would renumber: tf-antman reports and accepts memory limits for
        device ANTMAN_DEVICE_ID, and the protocol numbers devices within the job from 0.
        """
        return self.cc.local_gpu(gpu) if self.config.devices.kind == "nvml" else index

    def _migrate(self, now: float, out: TickLog) -> None:
        """Not in cluster mode (yet): the daemon's migration clears the old launch's files in the
        job directory on this machine, and a move to another node would need the job's
        checkpoints on storage both nodes share. Restartable jobs stay where they were placed."""

    def _load_stats(self, job_id: str, live: LiveJob) -> Stats | None:
        assert isinstance(live.handle, ClusterHandle)
        parts: dict[str, Stats] = {}
        for node in live.handle.nodes:
            report = self.nodes.reports.get(node)
            part = None if report is None else report.parts.get(job_id)
            if part is None:
                return live.stats  # no fresh word from every node: keep the last
            if part.stats_error is not None:
                raise OSError(f"node {node}: {part.stats_error}")
            if part.stats is None:
                return None
            parts[node] = part.stats
        return merge_stats(parts, live.record.placement, self.cc.node_of)

    def _send_control(self, job_id: str, live: LiveJob, control: Control) -> None:
        for node, part in split_control(control, live.record.placement, self.cc.node_of).items():
            try:
                self.nodes.call(node, "write_control", job_id, process_control(part))
            except Exception as e:  # noqa: BLE001 - the daemon logs and retries at the next change
                raise OSError(f"node {node}: {cause(e)}") from None

    def read_log(self, record: JobRecord, stderr: bool, offset: int, limit: int) -> tuple[bytes, int]:
        """Rank 0's log, read by the agent of its node (where its job directory is)."""
        nodes = job_nodes(self.cc, record.placement)
        if not nodes or nodes[0] not in self.nodes.agents:
            raise OSError(f"the log of {record.id} is on node {nodes[0] if nodes else '?'}, which is not connected")
        try:
            data, end = self.nodes.call(nodes[0], "read_log", record.id, stderr, offset, limit)
        except Exception as e:  # noqa: BLE001 - one line for the client
            raise OSError(f"node {nodes[0]}: {cause(e)}") from None
        return bytes(data), int(end)

    def _find_pid(self, record: JobRecord) -> int | None:
        if not record.launch_token or not record.placement:
            return None
        node = job_nodes(self.cc, record.placement)[0]
        try:
            pid = self.nodes.call(node, "find", record.id, record.launch_token, 0, record.uid)
        except Exception:  # noqa: BLE001 - cannot tell: look again until the grace period ends
            return None
        return None if pid is None else int(pid)

    def _recorded_exit(self, job_dir: Path) -> ExitInfo | None:
        job_id = job_dir.name
        for node in self.nodes.agents:
            if job_dir.parent == self.cc.node_jobs_dir(self.config.state_dir, node):
                with contextlib.suppress(Exception):
                    found = self.nodes.call(node, "recorded_exit", job_id)
                    return found if isinstance(found, ExitInfo) else None
        return None

    def _control_seq_on_disk(self, job_id: str, job_dir: Path) -> int:
        record = self.ray_launcher.jobs.get(job_id)
        if record is None or not record.placement:
            return 0
        with contextlib.suppress(Exception):
            return int(self.nodes.call(job_nodes(self.cc, record.placement)[0], "control_seq", job_id))
        return 0


def _is_part(live: LiveJob, node: str, token: str) -> bool:
    """`token` is the launch token of the job's running part on `node`."""
    assert isinstance(live.handle, ClusterHandle)
    nodes = live.handle.nodes
    launch = live.record.launch_token
    return node in nodes and launch is not None and token == part_token(launch, nodes.index(node))


def _fencing(node: str) -> str:
    return f"node {node} stopped it: no word from the global scheduler for half of cluster.node_timeout_s (fencing)"


_ORPHAN: Final = "<its nodes have not answered yet>"  # _why_not_adopted: wait for them

__all__ = ["ClusterDaemon", "node_aware"]
