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
`cluster.node_timeout_s` is lost: its jobs (a gang's parts on other nodes are stopped first) are
requeued (`on_node_loss = "requeue"`) or failed, quotas and settings are released by the driver,
and its GPUs leave the book (the driver is rebuilt over the remaining GPUs). A node that comes
(back) is swept first (scheduler_lite.cluster.agent: processes of jobs the store does not count
as running there are killed), then its GPUs join. A restart of the global scheduler recovers from
the store exactly as the daemon does: its node agents are detached named actors that outlive it.

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
from dataclasses import replace
from pathlib import Path
from typing import Final

from scheduler_lite.cluster.config import ClusterConfig
from scheduler_lite.cluster.nodes import CALL_TIMEOUT_S, ClusterDevices, ClusterHandle, Nodes, RayLauncher, cause
from scheduler_lite.cluster.parts import job_nodes, merge_stats, part_token, split_control
from scheduler_lite.cluster.tasks import is_ray_task
from scheduler_lite.config import Config
from scheduler_lite.daemon import Daemon
from scheduler_lite.driver import Driver, Launch, SchedulePolicy
from scheduler_lite.jobenv import process_control
from scheduler_lite.launcher import ExitInfo, LaunchError, ProcessHandle
from scheduler_lite.model import ClusterState, GlobalDecision, Gpu, JobState, Place, Reserve, Role
from scheduler_lite.policy.global_scheduler import schedule
from scheduler_lite.storage import JobRecord, JobStatus, Storage
from scheduler_lite.tick import LiveJob, TickLog, TickReport
from tf_antman.protocol import Control, Stats

log = logging.getLogger("scheduler_lite.cluster")

JOIN_EVERY_S: Final = 5.0  # how often nodes not connected are looked for


# ----------------------------------------------------------------------------------------------
# Placement across nodes.


def node_aware(policy: SchedulePolicy, span_tenants: Iterable[str], node_of: Callable[[int], str]) -> SchedulePolicy:
    """Algorithm 1 with the node level: a multi-node Place only for tenants allowed to span nodes."""
    span = frozenset(span_tenants)

    def run(state: ClusterState, config: object) -> list[GlobalDecision]:
        out: list[GlobalDecision] = []
        for d in policy(state, config):
            if isinstance(d, Place) and state.jobs[d.job_id].tenant not in span:
                per_node = Counter(node_of(g) for g in d.gpus)
                if len(per_node) > 1:
                    if d.role is Role.GUARANTEE:  # hold what its best node has; wait for the rest there
                        best = min(per_node, key=lambda n: (-per_node[n], n))
                        out.append(Reserve(d.job_id, tuple(g for g in d.gpus if node_of(g) == best)))
                    continue
            out.append(d)
        return out

    return run


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
        running = storage.list_jobs([JobStatus.RUNNING])
        for node in sorted(self.nodes.alive_with_resource()):  # all connected first, then swept
            self.nodes.connect(node, now, wait_s=CALL_TIMEOUT_S)
        for node in list(self.nodes.agents):
            self._sweep(node, running)
        self._last_join = now
        self.cluster_devices = ClusterDevices(config.devices.kind, self.nodes)
        self.cluster_devices.set_inventory(self._all_gpus())
        self.ray_launcher = RayLauncher(self.nodes)
        super().__init__(config, storage, clock, devices=self.cluster_devices, launcher=self.ray_launcher)
        self.driver.policy = node_aware(schedule, self.cc.span_tenants, self.cc.node_of)

    # -- nodes ------------------------------------------------------------------------------------

    def _all_gpus(self) -> list[Gpu]:
        return [g for node in self.cc.nodes for g in self.nodes.gpus.get(node, ())]

    def _join(self, node: str, running: Sequence[JobRecord], now: float, wait_s: float = 0.0) -> bool:
        """Connect the node's agent and sweep it (`_sweep`)."""
        return self.nodes.connect(node, now, wait_s) and self._sweep(node, running)

    def _sweep(self, node: str, running: Sequence[JobRecord]) -> bool:
        """The node's agent keeps only the parts of jobs the store says run, with every node of
        the job connected (a gang whose other node is gone is lost: its part here must not run on);
        it kills the rest. False (and the node dropped) if it cannot."""
        keep = []
        for r in running:
            nodes = job_nodes(self.cc, r.placement)
            if node in nodes and r.launch_token and all(n in self.nodes.agents for n in nodes):
                keep.append((r.id, part_token(r.launch_token, nodes.index(node))))
        try:
            stopped = self.nodes.call(node, "sweep", keep)
        except Exception as e:  # noqa: BLE001 - an agent that cannot sweep is not trusted with jobs
            log.error("node %s: sweep failed (%s): not joining", node, e)
            self.nodes.drop(node)
            return False
        if stopped:
            log.warning("node %s: stopped leftover processes of %s", node, ", ".join(stopped))
        return True

    def tick(self, now: float | None = None) -> TickReport:
        now = self.clock() if now is None else now
        for node in self.nodes.poll(now):
            self._node_lost(node, now)
        for node, report in list(self.nodes.reports.items()):
            for job_id in report.fenced:  # the agent stopped them: lost with the node, not ended
                if job_id in self._live:
                    log.error("node %s fenced %s (the global scheduler was silent too long): it is %s", node,
                              job_id, "requeued" if self.cc.on_node_loss == "requeue" else "failed")
                    self._lose_job(job_id, node, now, reason=f"node {node} stopped it: no word from the "
                                   "global scheduler for half of cluster.node_timeout_s (fencing)")
            if report.fenced:
                self._set_gpus(now)
        if now - self._last_join >= JOIN_EVERY_S:
            self._last_join = now
            missing = sorted(self.nodes.alive_with_resource() - set(self.nodes.agents))
            if missing:
                running = self.storage.list_jobs([JobStatus.RUNNING])
                if any([self._join(node, running, now) for node in missing]):
                    self._set_gpus(now)
        return super().tick(now)

    def _node_lost(self, node: str, now: float) -> None:
        """Its jobs requeued or failed (gang parts elsewhere stopped first), its GPUs out of the book."""
        log.error("node %s lost: its jobs are %s", node, "requeued" if self.cc.on_node_loss == "requeue" else "failed")
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
        """A running job's part on `node` is gone: its other parts stopped, then requeued or failed."""
        live = self._live.pop(job_id)
        assert isinstance(live.handle, ClusterHandle)
        others = [n for n in live.handle.nodes if n != node and n in self.nodes.agents]
        for other in others:  # a gang's surviving parts: stopped before the job runs anywhere else
            with contextlib.suppress(Exception):
                self.nodes.call(other, "stop", job_id, 0.0)
        self._record_loss(job_id, node, now, reason)
        self._driver_loss(job_id, now)

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
        """Jobs of nodes not connected are lost (requeued or failed); the others as the daemon does."""
        for record in self.storage.list_jobs([JobStatus.RUNNING]):
            nodes = job_nodes(self.cc, record.placement)
            gone = [n for n in nodes if n not in self.nodes.agents]
            if gone:  # its parts on connected nodes were killed by their sweep
                self._record_loss(record.id, gone[0], now)  # requeued ones are enqueued below
            else:
                self.ray_launcher.jobs[record.id] = record
        super()._recover(now)

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
        # On the job's first node; its agent makes it ready when it starts the job.
        first = job_nodes(self.cc, launch.gpus)[0]
        return self.cc.node_jobs_dir(self.config.state_dir, first) / launch.job_id

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
