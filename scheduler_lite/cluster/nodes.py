"""The node agents (scheduler_lite.cluster.agent), seen from the global scheduler.

`Nodes` connects to the agents (creating them where missing) and collects their reports once per
tick; `RayLauncher` and `ClusterDevices` are the daemon's `Launcher` and device backend carried
out through them (a job's processes: a `ClusterHandle`, one part per node). The global scheduler
(scheduler_lite.cluster.scheduler) gives them to the daemon's loop. Ray is imported when `Nodes`
is created, not at import time.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from scheduler_lite.cluster.agent import NodeReport, actor_class
from scheduler_lite.cluster.config import NODE_RESOURCE_PREFIX, REPORT_WAIT_S, ClusterConfig
from scheduler_lite.cluster.parts import job_nodes
from scheduler_lite.config import Config
from scheduler_lite.devices import EmulatedDevices, JobLoad
from scheduler_lite.launcher import ExitInfo, Launcher, ProcessHandle
from scheduler_lite.model import Gpu
from scheduler_lite.policy.validation import ConfigError
from scheduler_lite.storage import JobRecord

log = logging.getLogger("scheduler_lite.cluster")

CALL_TIMEOUT_S: Final = 10.0  # one agent call (start, stop, adopt...) must answer within this


def agent_name(node: str) -> str:
    return f"scheduler-lite-agent-{node}"


class Nodes:
    """Connects to the node agents (creating them where missing) and collects their reports."""

    def __init__(self, config: Config, ray_module: Any = None) -> None:
        if ray_module is None:  # tests pass a stand-in (tests/cluster/fake_ray.py)
            import ray as ray_module

        assert config.cluster is not None
        ray = ray_module
        self.ray = ray
        self.config = config
        self.cc: ClusterConfig = config.cluster
        if not ray.is_initialized():
            try:
                ray.init(address=self.cc.address, namespace=self.cc.namespace, log_to_driver=False)
            except (ValueError, ConnectionError) as e:  # a malformed address, no cluster there
                raise ConfigError("cluster.address", self.cc.address,
                                  f"the address of a running Ray cluster ({cause(e)})") from None
        self.agents: dict[str, Any] = {}
        self.gpus: dict[str, tuple[Gpu, ...]] = {}  # node -> its GPUs, global ids
        self.hostnames: dict[str, str] = {}
        self.agent_pids: dict[str, int] = {}
        self.reports: dict[str, NodeReport] = {}  # this tick's, from the nodes that answered
        # node -> the parts its agent fenced (job id -> part token), as it said when it connected
        self.fenced: dict[str, dict[str, str]] = {}
        self.busy: dict[str, bool] = {}  # node -> its agent ran job parts when it connected
        self._answered: dict[str, float] = {}
        # node -> (agent, its info() not answered yet, since when it is asked)
        self._pending: dict[str, tuple[Any, Any, float]] = {}
        self._actor = actor_class(ray)

    def alive_with_resource(self) -> set[str]:
        """Configured nodes whose Ray node is alive and offers its `antman_node_<name>` resource."""
        offered = self._offered()
        return {node for node in self.cc.nodes if self.cc.resource(node) in offered}

    def unknown_resources(self) -> list[str]:
        """`antman_node_*` resources of alive Ray nodes that name no configured node (a misspelt
        cluster.nodes entry shows here)."""
        known = {self.cc.resource(node) for node in self.cc.nodes}
        return sorted(r for r in self._offered() if r.startswith(NODE_RESOURCE_PREFIX) and r not in known)

    def _offered(self) -> set[str]:
        return {r for n in self.ray.nodes() if n.get("Alive") for r in (n.get("Resources") or {})}

    def connect(self, node: str, now: float, wait_s: float = 0.0) -> bool:
        """The node's agent (found by name, else created on the node); False if it has not
        answered within `wait_s`. Never blocks the loop longer: an agent still being created (its
        node not up yet) is asked again at the next call, so the other nodes keep their reports
        coming (a stalled loop would make their agents fence their jobs). An agent asked for
        `node_timeout_s` without an answer (frozen) is killed, so that the next call makes a new
        one, whose sweep stops what the old one left running."""
        ray = self.ray
        if node not in self._pending:
            try:
                agent = ray.get_actor(agent_name(node), namespace=self.cc.namespace)
            except ValueError:
                agent = self._actor.options(  # type: ignore[attr-defined]
                    name=agent_name(node), namespace=self.cc.namespace, lifetime="detached", get_if_exists=True,
                    resources={self.cc.resource(node): 0.001},
                ).remote(node, self.config)
            self._pending[node] = (agent, agent.info.remote(), now)
        agent, ref, asked = self._pending[node]
        ready, _ = ray.wait([ref], timeout=wait_s)
        if not ready:
            if now - asked >= self.cc.node_timeout_s:
                log.error("node %s: its agent has not answered for %.0f s: killed, a new one is made",
                          node, now - asked)
                self._forget_pending(node)
            return False
        del self._pending[node]
        try:
            info = ray.get(ref)
        except Exception as e:  # noqa: BLE001 - dead or broken: not connected this time
            # The agent's own error (e.g. it cannot create cluster.jobs_dir on its node), not just its type.
            log.warning("node %s: agent not available: %s", node, cause(e))
            return False
        self.agents[node] = agent
        self.hostnames[node] = str(info["hostname"])
        self.agent_pids[node] = int(info["pid"])
        self.gpus[node] = tuple(
            Gpu(self.cc.global_gpu(node, g.id), node, g.memory_bytes, f"{node}/{g.nvlink_group}")
            for g in info["gpus"]  # type: ignore[attr-defined]
        )
        self.fenced[node] = dict(info.get("fenced") or {})  # type: ignore[call-overload]
        self.busy[node] = bool(info.get("parts"))
        self._answered[node] = now
        log.info("node %s (%s): agent pid %s, %d GPU(s)", node, info["hostname"], info["pid"], len(self.gpus[node]))
        return True

    def connect_all(self, nodes: Sequence[str], now: float, wait_s: float, busy_wait_s: float) -> list[str]:
        """Ask every node's agent at once; wait until all have answered, for `wait_s` at most,
        and for `busy_wait_s` at most once an agent running jobs has answered (it fences them
        if the sweep and reports that follow come too late). The nodes connected."""
        ray = self.ray
        left = list(nodes)
        done: list[str] = []
        end = time.monotonic() + wait_s
        while left:
            for node in list(left):
                if self.connect(node, now):
                    done.append(node)
                    if self.busy[node]:
                        end = min(end, time.monotonic() + busy_wait_s)
                if node not in self._pending:  # answered, or failed (retried by the loop later)
                    left.remove(node)
            remaining = end - time.monotonic()
            if not left or remaining <= 0:
                break
            ray.wait([self._pending[n][1] for n in left], num_returns=1, timeout=min(remaining, 0.5))
        return done

    def last_answer(self, node: str, default: float) -> float:
        """When the node's agent last answered (connect or report)."""
        return self._answered.get(node, default)

    def drop(self, node: str) -> None:
        agent = self.agents.pop(node, None)
        self.gpus.pop(node, None)
        self.reports.pop(node, None)
        self._answered.pop(node, None)
        if agent is not None:
            with contextlib.suppress(Exception):
                self.ray.kill(agent)  # a silent agent must not come back with its jobs (it fences too)
        self._forget_pending(node)

    def _forget_pending(self, node: str) -> None:
        """An agent asked and never heard from is killed: a frozen one must not resume with the
        jobs it ran, and its name must be free for a new agent (which sweeps the node)."""
        pending = self._pending.pop(node, None)
        if pending is not None:
            with contextlib.suppress(Exception):
                self.ray.kill(pending[0])

    def poll(self, now: float) -> list[str]:
        """Collect every connected node's report; the nodes found lost."""
        ray = self.ray
        refs = {node: agent.report.remote() for node, agent in self.agents.items()}
        if not refs:
            self.reports = {}
            return []
        by_ref = {ref: node for node, ref in refs.items()}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=REPORT_WAIT_S)
        self.reports = {}
        lost = []
        for ref in ready:
            node = by_ref[ref]
            try:
                report = ray.get(ref)
            except ray.exceptions.RayActorError:
                lost.append(node)
                continue
            except Exception as e:  # noqa: BLE001 - a broken report counts as silence, not as a crash
                log.warning("node %s: report failed: %s", node, cause(e))
                continue
            if report.agent_pid != self.agent_pids.get(node):  # a new agent: the old one's jobs are gone
                lost.append(node)
                continue
            self.reports[node] = report
            self._answered[node] = now
        for node in refs:
            if node not in self.reports and node not in lost and now - self._answered[node] > self.cc.node_timeout_s:
                lost.append(node)
        return lost

    def stop_later(self, node: str, job_id: str) -> None:
        """Queue a stop of the job's part on the node's agent, without waiting for it."""
        agent = self.agents.get(node)
        if agent is not None:
            with contextlib.suppress(Exception):
                agent.stop.remote(job_id, 0.0)

    def call(self, node: str, method: str, *args: object, timeout: float = CALL_TIMEOUT_S) -> Any:
        return self.ray.get(getattr(self.agents[node], method).remote(*args), timeout=timeout)

@dataclass(slots=True)
class ClusterHandle(ProcessHandle):
    """A job's processes: one part per node, rank order (pid/job_dir are rank 0's)."""

    job_id: str = ""
    nodes: tuple[str, ...] = ()
    stop_sent: bool = False
    ended: dict[str, ExitInfo] = field(default_factory=dict)  # node -> how its part ended
    # The failure that ended the job: the first part to fail; the parts stopped because of it
    # end by our SIGTERM, which says nothing about the job.
    failure: ExitInfo | None = None


class RayLauncher(Launcher):
    """The daemon's Launcher, carried out by the node agents (reports come from `Nodes.poll`)."""

    def __init__(self, nodes: Nodes) -> None:
        self.nodes = nodes
        self.jobs: dict[str, JobRecord] = {}  # running jobs' records, for adopt after a restart

    def poll(self, handle: ProcessHandle) -> ExitInfo | None:
        """The job's end once every part has ended (the first failure, else success); a part
        that fails gets the others stopped (SIGTERM)."""
        assert isinstance(handle, ClusterHandle)
        for node in handle.nodes:
            report = self.nodes.reports.get(node)
            if node in handle.ended or report is None:
                continue  # ended already, or no word from that node this tick (lost nodes are handled before)
            part = report.parts.get(handle.job_id)
            ended = ExitInfo(None) if part is None else part.exit  # unknown to its agent: gone
            if ended is not None:
                handle.ended[node] = ended
                if handle.failure is None and ended.exit_code != 0:
                    handle.failure = ended  # parts failing in the same tick: the lowest rank
        if len(handle.ended) == len(handle.nodes):
            return handle.failure or ExitInfo(0)
        if handle.failure is not None and not handle.stop_sent:
            handle.stop_sent = True  # one part failed: the whole job fails
            self.signal(handle, signal.SIGTERM)
        return None

    def signal(self, handle: ProcessHandle, sig: int) -> bool:
        assert isinstance(handle, ClusterHandle)
        sent = False
        for node in handle.nodes:
            if node in handle.ended:
                continue
            with contextlib.suppress(Exception):
                sent = bool(self.nodes.call(node, "signal", handle.job_id, sig)) or sent
        return sent

    def stop(self, handle: ProcessHandle, grace_s: float, poll_s: float = 0.02) -> ExitInfo:
        assert isinstance(handle, ClusterHandle)
        for node in handle.nodes:
            if node in handle.ended:
                continue
            ended = None
            with contextlib.suppress(Exception):
                ended = self.nodes.call(node, "stop", handle.job_id, grace_s, timeout=grace_s + CALL_TIMEOUT_S)
            handle.ended[node] = ended if isinstance(ended, ExitInfo) else ExitInfo(None)
            if handle.failure is None and handle.ended[node].exit_code != 0:
                handle.failure = handle.ended[node]
        return handle.failure or ExitInfo(0)

    def cleanup(self, handle: ProcessHandle) -> None:  # type: ignore[override]
        assert isinstance(handle, ClusterHandle)
        for node in handle.nodes:
            if node in self.nodes.agents:
                with contextlib.suppress(Exception):
                    self.nodes.call(node, "cleanup", handle.job_id)

    def adopt(self, pid: int, start_ticks: int | None, job_dir: Path, token: str | None = None,
              job_id: str = "") -> ProcessHandle | ExitInfo:
        """Every part taken back by its node's agent. A part that ended with success leaves
        the others running (the job ends when every part has); one that failed ends the job:
        the others are stopped, and the job's exit is the earliest failure, not our SIGTERM."""
        record = self.jobs[job_id]
        assert token is not None
        nodes = job_nodes(self.nodes.cc, record.placement)
        handle = ClusterHandle(pid, start_ticks, job_dir, None, job_id, nodes)
        running: list[tuple[int, int | None]] = []
        for rank, node in enumerate(nodes):
            first = rank == 0
            found = self.nodes.call(node, "adopt", job_id, token, rank, record.uid,
                                    pid if first else None, start_ticks if first else None)
            if isinstance(found, ExitInfo):
                handle.ended[node] = found
            else:
                running.append(found)
        failures = [e for e in handle.ended.values() if e.exit_code != 0]
        if failures:
            handle.failure = min(failures, key=lambda e: math.inf if e.ended_at is None else e.ended_at)
        if not running or handle.failure is not None:
            if running:  # a failed part ended the job while no scheduler watched: the rest must not run on
                self.stop(handle, 0.0)
            return handle.failure or _last_success(handle.ended.values())
        if nodes[0] not in handle.ended:
            handle.pid, handle.start_ticks = running[0]
        return handle


def _last_success(exits: Iterable[ExitInfo]) -> ExitInfo:
    """Every part ended with success: the job ended when the last one did."""
    times = [e.ended_at for e in exits if e.ended_at is not None]
    return ExitInfo(0, max(times) if times else None)


class ClusterDevices(EmulatedDevices):
    """The global inventory; utilisation derived from the jobs' stats (emulated) or as read by
    each node's NVML (reported by its agent)."""

    def __init__(self, kind: str, nodes: Nodes) -> None:
        self.kind = kind
        self.nodes = nodes
        self._gpus = ()

    def set_inventory(self, gpus: Iterable[Gpu]) -> None:
        self._gpus = tuple(gpus)

    def utilisation(self, loads: Mapping[int, Sequence[JobLoad]]) -> dict[int, float]:
        if self.kind == "emulated":
            return super().utilisation(loads)
        out = {}
        cc = self.nodes.cc
        for node, report in self.nodes.reports.items():
            for local, value in (report.utilisation or {}).items():
                out[cc.global_gpu(node, local)] = value
        return out


def cause(e: BaseException) -> str:
    """The last line of an error (a RayTaskError's text ends with the remote exception)."""
    text = str(e).strip()
    return text.splitlines()[-1] if text else type(e).__name__


__all__ = ["CALL_TIMEOUT_S", "ClusterDevices", "ClusterHandle", "Nodes", "RayLauncher", "agent_name", "cause"]
