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

Topology: a node is the level above the NVLink group; gangs that may not span nodes are kept on
one by `node_aware` (scheduler_lite.cluster.placement). Faults: a lost node's jobs, fencing, and
nodes that come (back) are `NodeLoss` (scheduler_lite.cluster.node_loss). A restart of the global
scheduler recovers from the store as the daemon does (its node agents are detached named actors
that outlive it); a job whose node does not answer at the restart waits for it up to
`node_timeout_s`, and is adopted if it comes, lost otherwise.

The node agents seen from here (the connection, the daemon's Launcher and devices carried out
through them): scheduler_lite.cluster.nodes; a job's parts on its nodes (which nodes, their
control.json and stats.json): scheduler_lite.cluster.parts.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from scheduler_lite.cluster.config import FENCE_FRACTION, ClusterConfig
from scheduler_lite.cluster.node_loss import _ORPHAN, NodeLoss, _fencing, _Waiting
from scheduler_lite.cluster.nodes import CALL_TIMEOUT_S, ClusterDevices, ClusterHandle, Nodes, RayLauncher, cause
from scheduler_lite.cluster.parts import job_nodes, merge_stats, part_token, split_control
from scheduler_lite.cluster.placement import node_aware
from scheduler_lite.cluster.tasks import is_ray_task
from scheduler_lite.config import Config
from scheduler_lite.daemon import Daemon
from scheduler_lite.driver import Driver, Launch
from scheduler_lite.jobenv import process_control
from scheduler_lite.launcher import ExitInfo, LaunchError, ProcessHandle
from scheduler_lite.model import Gpu, JobState, Place
from scheduler_lite.policy.global_scheduler import schedule
from scheduler_lite.status import ClusterStatus
from scheduler_lite.storage import JobRecord, JobStatus, Storage
from scheduler_lite.tick import LiveJob, TickLog, TickReport
from tf_antman.protocol import Control, Stats

log = logging.getLogger("scheduler_lite.cluster")


class ClusterDaemon(NodeLoss, Daemon):
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

    def status(self) -> ClusterStatus:
        absent = tuple(n for n in self.cc.nodes if n not in self.nodes.agents)
        return replace(super().status(), absent_nodes=absent)

    def _all_gpus(self) -> list[Gpu]:
        return [g for node in self.cc.nodes for g in self.nodes.gpus.get(node, ())]


    def tick(self, now: float | None = None) -> TickReport:
        now = self.clock() if now is None else now
        for node in self.nodes.poll(now):
            self._node_lost(node, now)
        self._fenced_parts(now)
        self._look_for_nodes(now)
        self._release(now)
        return super().tick(now)


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


__all__ = ["ClusterDaemon", "node_aware"]
