"""The cluster's job host: the daemon's jobs run on the nodes of a Ray cluster.

The daemon (scheduler_lite.daemon) is the same one as on a single machine (same store, same
Driver, same Algorithm 1 and coordinator rounds, same recovery); given a `ClusterJobHost`, it
is the global scheduler (`scheduler-lite serve` with a [cluster] table). Each job-host verb is
carried out by the node actors (scheduler_lite.cluster.node_host: a LocalJobHost on each node):

  =======================  ===================================  ===============================
  the daemon asks          one machine (LocalJobHost)           cluster (ClusterJobHost)
  =======================  ===================================  ===============================
  GPUs                     devices.inventory()                  every connected node's, global
                                                                ids (index in cluster.nodes) * 100
                                                                + local id, NVLink group "<node>/<group>"
  stats.json, exits        read in the job dir                  one `report` per node per tick
  start a job              Launcher.start                       `start` on each node of it
  control.json             write_control                        `write_control`, split per node
  restart: pid, exit, seq  pid file, token, exit_status         the same, asked of the node
  =======================  ===================================  ===============================

Topology: a node is the level above the NVLink group; gangs that may not span nodes are kept on
one by `node_aware` (scheduler_lite.cluster.placement), the host's `policy`. Faults: a lost
node's jobs, fencing, and nodes that come (back) are `NodeLoss` (scheduler_lite.cluster.node_loss),
a component of this host that hands the jobs it loses back to the daemon. A restart of the
global scheduler recovers from the store as the daemon does (the node actors are detached named
actors that outlive it; jobs of nodes not here yet: `NodeLoss.recover`).

The node actors seen from here (the connection, their reports): scheduler_lite.cluster.nodes; a
job's parts on its nodes (which nodes, their control.json and stats.json):
scheduler_lite.cluster.parts.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from scheduler_lite.cluster.booking import is_ray_task
from scheduler_lite.cluster.config import ClusterConfig
from scheduler_lite.cluster.node_loss import NodeLoss
from scheduler_lite.cluster.nodes import CALL_TIMEOUT_S, ClusterHandle, Nodes, cause
from scheduler_lite.cluster.parts import job_nodes, merge_stats, split_control
from scheduler_lite.cluster.placement import node_aware
from scheduler_lite.config import Config
from scheduler_lite.daemon import Daemon
from scheduler_lite.devices import JobLoad, emulated_utilisation
from scheduler_lite.driver import Launch, SchedulePolicy
from scheduler_lite.jobenv import process_control
from scheduler_lite.jobhost import HostedJobs
from scheduler_lite.launcher import ExitInfo, Launcher, LaunchError, ProcessHandle
from scheduler_lite.model import Gpu
from scheduler_lite.storage import JobRecord, Storage
from scheduler_lite.tick import JobTableView, LiveJob
from tf_antman.protocol import Control, Stats

log = logging.getLogger("scheduler_lite.cluster")


class ClusterDevices:
    """The global inventory (`gpus`: the connected nodes', set by the host); utilisation derived
    from the jobs' stats (emulated) or as read by each node's NVML (in its report)."""

    def __init__(self, kind: str, nodes: Nodes) -> None:
        self.kind = kind
        self.nodes = nodes
        self.gpus: tuple[Gpu, ...] = ()

    def inventory(self) -> tuple[Gpu, ...]:
        return self.gpus

    def utilisation(self, loads: Mapping[int, Sequence[JobLoad]]) -> dict[int, float]:
        if self.kind == "emulated":
            return emulated_utilisation(self.gpus, loads)
        out = {}
        cc = self.nodes.cc
        for node, report in self.nodes.reports.items():
            for local, value in (report.utilisation or {}).items():
                out[cc.global_gpu(node, local)] = value
        return out


class ClusterJobHost:
    """The daemon's jobs on Ray nodes, one node actor per node (`Nodes`)."""

    # Not in cluster mode (yet): a move to another node would need the job's checkpoints on
    # storage both nodes share. Restartable jobs stay where they were placed.
    migrates = False

    def __init__(self, config: Config, storage: Storage, clock: Callable[[], float] = time.time,
                 nodes: Nodes | None = None) -> None:
        if config.cluster is None:
            raise ValueError("a cluster job host needs a [cluster] table in the config")
        self.config = config
        self.cc: ClusterConfig = config.cluster
        self.storage = storage
        self.clock = clock
        self.nodes = nodes if nodes is not None else Nodes(config)
        self._wait_noted: dict[str, str] = {}  # job id -> the last reason node_aware gave (one event each)
        self._jobs: HostedJobs | None = None
        self._table: JobTableView | None = None
        now = clock()
        self._connect_at_start(now)
        self.devices = ClusterDevices(config.devices.kind, self.nodes)
        self.devices.gpus = self._all_gpus()
        self.loss = NodeLoss(self.cc, self.nodes, storage, clock, self, now)

    # -- the nodes --------------------------------------------------------------------------------

    def _connect_at_start(self, now: float) -> None:
        """Every node's actor asked at once (`Nodes.connect_all` says how long it waits). A node
        not here joins later (`NodeLoss.look_for_nodes`); why it is not here is logged."""
        alive = self.nodes.alive_with_resource()
        self.nodes.connect_all(sorted(alive), now)
        unknown = self.nodes.unknown_resources()
        for i, node in enumerate(self.cc.nodes):
            if node not in alive:
                hint = f" (Ray offers {', '.join(unknown)}, which no cluster.nodes entry names)" if unknown else ""
                log.warning("cluster.nodes[%d] %r: no Ray node has resource %s; its GPUs are not served until it "
                            "joins%s", i, node, self.cc.resource(node), hint)
            elif node not in self.nodes.actors:
                log.warning("cluster.nodes[%d] %r: its node actor has not answered yet; its GPUs join when it does, "
                            "its jobs wait for it up to cluster.node_timeout_s", i, node)

    def _all_gpus(self) -> tuple[Gpu, ...]:
        return tuple(g for node in self.cc.nodes for g in self.nodes.gpus.get(node, ()))

    @property
    def jobs(self) -> HostedJobs:
        assert self._jobs is not None, "attach() first: the daemon does in its constructor"
        return self._jobs

    @property
    def table(self) -> JobTableView:
        assert self._table is not None, "attach() first: the daemon does in its constructor"
        return self._table

    def attach(self, jobs: HostedJobs, table: JobTableView) -> None:
        self._jobs = jobs
        self._table = table

    def gpus_changed(self, now: float) -> None:
        """Nodes left or joined: the daemon's GPUs are the connected nodes' now."""
        gpus = self._all_gpus()
        self.devices.gpus = gpus
        self.jobs.gpus_changed(gpus, now, size_known=self.size_known())

    def recover(self, running: Sequence[JobRecord], now: float) -> set[str]:
        return self.loss.recover(running, now)

    def refresh(self, now: float) -> None:
        """Every node's report collected; lost nodes, fenced parts, joining nodes and the lost
        jobs nothing of which runs any more handled, before the daemon's tick."""
        for node in self.nodes.poll(now):
            self.loss.node_lost(node, now)
        self.loss.fenced_parts(now)
        self.loss.look_for_nodes(now)
        self.loss.release(now)

    def policy(self, base: SchedulePolicy) -> SchedulePolicy:
        return node_aware(base, self.cc.span_tenants, self.cc.node_of, self._note_wait)

    def _note_wait(self, job_id: str, why: str) -> None:
        """node_aware keeps a gang waiting: said once per reason (an event and the log)."""
        if self._wait_noted.get(job_id) == why:
            return
        self._wait_noted[job_id] = why
        log.info("%s %s", job_id, why)
        self.storage.add_event(self.clock(), "waiting", job_id, reason=why)

    def cannot_run(self, record: JobRecord) -> str | None:
        if is_ray_task(record.command) and record.num_gpus != 1:
            return f"a Ray task's booking is one GPU, not {record.num_gpus} (docs/cluster.md, \"Ray users\")"
        if not self.size_known():
            return None  # the daemon's own checks say which wait (a requeued gang must not fail for it)
        largest = max((len(gs) for gs in self.nodes.gpus.values()), default=0)
        if record.tenant not in self.cc.span_tenants and record.num_gpus > largest:
            return (f"needs {record.num_gpus} GPUs; the largest node has {largest} and tenant "
                    f"{record.tenant!r} may not span nodes (cluster.span_tenants)")
        return None

    def size_known(self) -> bool:
        """Every node is here. While one is away (lost, restarting, not up yet) the cluster's
        size is not known: a job too big for the nodes here waits for it."""
        return set(self.cc.nodes) <= set(self.nodes.actors)

    def absent(self) -> tuple[str, ...]:
        return tuple(n for n in self.cc.nodes if n not in self.nodes.actors)

    def taken_bytes(self, gpu: int) -> int:
        return 0  # the nodes do not run the NVML per-process check (yet)

    containment = None  # the nodes' jobs are not contained, nor checked (yet)

    def findings(self) -> None:
        return None

    # -- the jobs ---------------------------------------------------------------------------------

    def prepare(self, launch: Launch, uid: int | None) -> Path:
        """On the job's first node; its node actor makes it ready when it starts the job. Each
        node of the launch drops what an earlier launch left there now (NodeHost.prepare)."""
        nodes = job_nodes(self.cc, launch.gpus)
        for node in nodes:
            self.nodes.ask(node, "prepare", launch.job_id)  # OSError: as a start that fails, the launch fails
        return self.cc.node_jobs_dir(self.config.state_dir, nodes[0]) / launch.job_id

    def start(self, launch: Launch, record: JobRecord, job_dir: Path, gpus: Sequence[Gpu]) -> ProcessHandle:
        assert record.launch_token is not None
        nodes = job_nodes(self.cc, launch.gpus)
        by_id = {g.id: g for g in gpus}
        common = {
            "SCHEDULER_LITE_GPUS": ",".join(str(g) for g in launch.gpus),
            "SCHEDULER_LITE_NUM_NODES": str(len(nodes)),
            "SCHEDULER_LITE_NODES": ",".join(self.nodes.hostnames.get(n, n) for n in nodes),
        }
        handle = ClusterHandle(0, None, job_dir, None, launch.job_id, nodes)
        for rank, node in enumerate(nodes):
            mine = [g for g in launch.gpus if self.cc.node_of(g) == node]
            local = [replace(by_id[g], id=self._device_id(g, i)) for i, g in enumerate(mine)]
            limit = min(launch.settings.limits[g] for g in mine)
            share = min(launch.settings.shares[g] for g in mine)
            env = {**common, "SCHEDULER_LITE_NODE_RANK": str(rank)}
            # A Ray task is started by Ray: its node only books it (scheduler_lite.cluster.tasks).
            try:
                pid, start, _ = self.nodes.call(node, "start", record, rank, local, limit, share, env)
            except Exception as e:  # noqa: BLE001 - node gone, bad workdir...: the job did not start
                if rank:  # the nodes before this one started their parts
                    self.stop(replace(handle, nodes=nodes[:rank]), 0.0)
                # A call that timed out may still run on its actor (a frozen one resumes): a stop
                # queued behind it on the same actor (calls run in order) ends it there, unwaited.
                self.nodes.stop_later(node, launch.job_id)
                raise LaunchError(f"cannot start {launch.job_id} on node {node}: {cause(e)}") from None
            if rank == 0:
                handle.pid, handle.start_ticks = pid, start
        return handle

    def _device_id(self, gpu: int, index: int) -> int:
        """The id a part's job sees for its `index`-th GPU on the node.

        NVML: the node's GPU index (CUDA_VISIBLE_DEVICES, renumbered from 0 by CUDA). Emulated:
        the index itself, as CUDA would renumber: tf-antman reports and accepts memory limits for
        device ANTMAN_DEVICE_ID, and the protocol numbers devices within the job from 0.
        """
        return self.cc.local_gpu(gpu) if self.config.devices.kind == "nvml" else index

    def find(self, record: JobRecord, job_dir: Path | None = None) -> int | None:
        """The pid of rank 0's part, as its node finds it in its own job directory (pid file,
        else its launch token)."""
        if not record.launch_token or not record.placement:
            return None
        node = job_nodes(self.cc, record.placement)[0]
        # No answer: cannot tell; the daemon looks again until the grace period ends.
        pid = self.nodes.try_call(node, "find", record.id, record.launch_token, 0, record.uid)
        return None if pid is None else int(pid)

    def adopt(self, record: JobRecord, pid: int, start_ticks: int | None, job_dir: Path) -> ProcessHandle | ExitInfo:
        """Every part taken back by its node. A part that ended with success leaves the others
        running (the job ends when every part has); one that failed ends the job: the others
        are stopped, and the job's exit is the earliest failure, not our SIGTERM."""
        token = record.launch_token
        assert token is not None
        nodes = job_nodes(self.cc, record.placement)
        handle = ClusterHandle(pid, start_ticks, job_dir, None, record.id, nodes)
        for rank, node in enumerate(nodes):
            known = (pid, start_ticks) if rank == 0 else (None, None)
            found = self.nodes.call(node, "adopt", record.id, token, rank, record.uid, *known)
            if isinstance(found, ExitInfo):
                handle.ended[node] = found
            elif rank == 0:
                handle.pid, handle.start_ticks = found
        failures = [e for e in handle.ended.values() if e.exit_code != 0]
        if failures:
            handle.failure = min(failures, key=lambda e: math.inf if e.ended_at is None else e.ended_at)
            if handle.running():  # a failed part ended the job while no scheduler watched: the rest must not run on
                self.stop(handle, 0.0)
            return handle.failure
        if not handle.running():
            times = [e.ended_at for e in handle.ended.values() if e.ended_at is not None]
            return ExitInfo(0, max(times) if times else None)  # every part succeeded: when the last did
        return handle

    def poll(self, handle: ProcessHandle) -> ExitInfo | None:
        """The job's end once every part has ended (the first failure, else success); a part
        that fails gets the others stopped (SIGTERM). From this tick's reports (`refresh`)."""
        assert isinstance(handle, ClusterHandle)
        for node in handle.running():
            report = self.nodes.reports.get(node)
            if report is None:
                continue  # no word from that node this tick (lost nodes are handled before)
            part = report.parts.get(handle.job_id)
            ended = ExitInfo(None) if part is None else part.exit  # unknown to its node: gone
            if ended is not None:
                handle.part_ended(node, ended)
        if len(handle.ended) == len(handle.nodes):
            return handle.failure or ExitInfo(0)
        if handle.failure is not None and not handle.stop_sent:
            handle.stop_sent = True  # one part failed: the whole job fails
            self.signal(handle, signal.SIGTERM)
        return None

    def signal(self, handle: ProcessHandle, sig: int) -> bool:
        assert isinstance(handle, ClusterHandle)
        return any([self.nodes.try_call(node, "signal", handle.job_id, sig) for node in handle.running()])

    def stop(self, handle: ProcessHandle, grace_s: float) -> ExitInfo:
        assert isinstance(handle, ClusterHandle)
        for node in handle.running():
            ended = self.nodes.try_call(node, "stop", handle.job_id, grace_s, timeout=grace_s + CALL_TIMEOUT_S)
            handle.part_ended(node, ended if isinstance(ended, ExitInfo) else ExitInfo(None))
        return handle.failure or ExitInfo(0)

    def cleanup(self, handle: ProcessHandle) -> None:
        assert isinstance(handle, ClusterHandle)
        for node in handle.nodes:
            if node in self.nodes.actors:
                self.nodes.try_call(node, "cleanup", handle.job_id)

    def kill_leftovers(self, record: JobRecord, job_dir: Path, pid: int | None, start: int | None) -> list[int]:
        # As the launcher does on this machine; the nodes' sweeps (NodeLoss) stop what runs there.
        return Launcher.kill_leftovers(job_dir, pid, start)

    def stats(self, job_id: str, live: LiveJob) -> Stats | None:
        """The job's stats, merged from its parts' in this tick's reports."""
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

    def write_control(self, job_id: str, live: LiveJob, control: Control) -> None:
        for node, part in split_control(control, live.record.placement, self.cc.node_of).items():
            # OSError: the daemon logs and retries at the next change.
            self.nodes.ask(node, "write_control", job_id, process_control(part))

    def recorded_exit(self, record: JobRecord, job_dir: Path) -> ExitInfo | None:
        for node in self.nodes.actors:
            if job_dir.parent == self.cc.node_jobs_dir(self.config.state_dir, node):
                found = self.nodes.try_call(node, "recorded_exit", record.id)
                return found if isinstance(found, ExitInfo) else None
        return None

    def control_seq(self, record: JobRecord, job_dir: Path) -> int:
        if not record.placement:
            return 0
        return int(self.nodes.try_call(job_nodes(self.cc, record.placement)[0], "control_seq", record.id) or 0)

    def read_log(self, record: JobRecord, stderr: bool, offset: int, limit: int) -> tuple[bytes, int]:
        """Rank 0's log, read by the node actor of its node (where its job directory is)."""
        nodes = job_nodes(self.cc, record.placement)
        if not nodes or nodes[0] not in self.nodes.actors:
            raise OSError(f"the log of {record.id} is on node {nodes[0] if nodes else '?'}, which is not connected")
        data, end = self.nodes.ask(nodes[0], "read_log", record.id, stderr, offset, limit)
        return bytes(data), int(end)


def cluster_daemon(config: Config, storage: Storage, clock: Callable[[], float] = time.time,
                   nodes: Nodes | None = None) -> Daemon:
    """The global scheduler: the daemon with its jobs on the cluster's nodes."""
    return Daemon(config, storage, clock, host=ClusterJobHost(config, storage, clock, nodes))
