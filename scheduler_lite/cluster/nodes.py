"""The node hosts (scheduler_lite.cluster.node_host), seen from the global scheduler.

`Nodes` connects to the node actors (creating them where missing) and collects their reports
once per tick; the cluster's job host (scheduler_lite.cluster.host) carries the daemon's verbs
out through it (a job's processes: a `ClusterHandle`, one part per node). Ray is imported when
`Nodes` is created, not at import time.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from scheduler_lite.cluster.config import FENCE_FRACTION, NODE_RESOURCE_PREFIX, REPORT_WAIT_S, ClusterConfig
from scheduler_lite.cluster.node_host import NodeHost, NodeReport
from scheduler_lite.config import Config
from scheduler_lite.launcher import ExitInfo, ProcessHandle
from scheduler_lite.model import Gpu
from scheduler_lite.policy.validation import ConfigError

log = logging.getLogger("scheduler_lite.cluster")

CALL_TIMEOUT_S: Final = 10.0  # one actor call (start, stop, adopt...) must answer within this


def actor_name(node: str) -> str:
    """The node actor's registered name (as 0.1.0 named it: a global scheduler finds the node
    actors an older one made, with the jobs they run)."""
    return f"scheduler-lite-agent-{node}"


class Nodes:
    """Connects to the node hosts (creating them where missing) and collects their reports."""

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
        self.actors: dict[str, Any] = {}
        self.gpus: dict[str, tuple[Gpu, ...]] = {}  # node -> its GPUs, global ids
        self.hostnames: dict[str, str] = {}
        self.actor_pids: dict[str, int] = {}
        self.reports: dict[str, NodeReport] = {}  # this tick's, from the nodes that answered
        # node -> the parts its actor fenced (job id -> part token), as it said when it connected
        self.fenced: dict[str, dict[str, str]] = {}
        self.busy: dict[str, bool] = {}  # node -> its actor ran job parts when it connected
        self._answered: dict[str, float] = {}
        # node -> (actor, its info() not answered yet, since when it is asked)
        self._pending: dict[str, tuple[Any, Any, float]] = {}
        self._actor = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=1)(NodeHost)  # it mostly waits

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

    def connect(self, node: str, now: float) -> bool:
        """The node's actor (found by name, else created on the node); False if it has not
        answered yet. Never blocks the loop: a node actor still being created (its node not up
        yet) is asked again at the next call, so the other nodes keep their reports
        coming (a stalled loop would make their actors fence their jobs). A node actor asked for
        `node_timeout_s` without an answer (frozen) is killed, so that the next call makes a new
        one, whose sweep stops what the old one left running."""
        ray = self.ray
        if node not in self._pending:
            try:
                actor = ray.get_actor(actor_name(node), namespace=self.cc.namespace)
            except ValueError:
                actor = self._actor.options(  # type: ignore[attr-defined]
                    name=actor_name(node), namespace=self.cc.namespace, lifetime="detached", get_if_exists=True,
                    resources={self.cc.resource(node): 0.001},
                ).remote(node, self.config)
            self._pending[node] = (actor, actor.info.remote(), now)
        actor, ref, asked = self._pending[node]
        ready, _ = ray.wait([ref], timeout=0)
        if not ready:
            if now - asked >= self.cc.node_timeout_s:
                log.error("node %s: its actor has not answered for %.0f s: killed, a new one is made",
                          node, now - asked)
                self._forget_pending(node)
            return False
        del self._pending[node]
        try:
            info = ray.get(ref)
        except Exception as e:  # noqa: BLE001 - dead or broken: not connected this time
            # The actor's own error (e.g. it cannot create cluster.jobs_dir on its node), not just its type.
            log.warning("node %s: actor not available: %s", node, cause(e))
            return False
        self.actors[node] = actor
        self.hostnames[node] = str(info["hostname"])
        self.actor_pids[node] = int(info["pid"])
        self.gpus[node] = tuple(
            Gpu(self.cc.global_gpu(node, g.id), node, g.memory_bytes, f"{node}/{g.nvlink_group}")
            for g in info["gpus"]  # type: ignore[attr-defined]
        )
        self.fenced[node] = dict(info.get("fenced") or {})  # type: ignore[call-overload]
        self.busy[node] = bool(info.get("parts"))
        self._answered[node] = now
        log.info("node %s (%s): actor pid %s, %d GPU(s)", node, info["hostname"], info["pid"], len(self.gpus[node]))
        return True

    def connect_all(self, nodes: Sequence[str], now: float) -> None:
        """Ask every node's actor at once; wait until all have answered, for CALL_TIMEOUT_S at
        most, and for half of its fence at most once a node actor running jobs has answered (it
        fences them if the sweep and reports that follow come too late)."""
        left = list(nodes)
        end = time.monotonic() + CALL_TIMEOUT_S
        while left:
            for node in list(left):
                if self.connect(node, now) and self.busy[node]:
                    end = min(end, time.monotonic() + self.cc.node_timeout_s * FENCE_FRACTION / 2)
                if node not in self._pending:  # answered, or failed (retried by the loop later)
                    left.remove(node)
            remaining = end - time.monotonic()
            if not left or remaining <= 0:
                break
            self.ray.wait([self._pending[n][1] for n in left], num_returns=1, timeout=min(remaining, 0.5))

    def last_answer(self, node: str, default: float) -> float:
        """When the node's actor last answered (connect or report)."""
        return self._answered.get(node, default)

    def drop(self, node: str) -> None:
        actor = self.actors.pop(node, None)
        self.gpus.pop(node, None)
        self.reports.pop(node, None)
        self._answered.pop(node, None)
        if actor is not None:
            with contextlib.suppress(Exception):
                self.ray.kill(actor)  # a silent actor must not come back with its jobs (it fences too)
        self._forget_pending(node)

    def _forget_pending(self, node: str) -> None:
        """A node actor asked and never heard from is killed: a frozen one must not resume with the
        jobs it ran, and its name must be free for a new actor (which sweeps the node)."""
        pending = self._pending.pop(node, None)
        if pending is not None:
            with contextlib.suppress(Exception):
                self.ray.kill(pending[0])

    def poll(self, now: float) -> list[str]:
        """Collect every connected node's report; the nodes found lost."""
        ray = self.ray
        refs = {node: actor.report.remote() for node, actor in self.actors.items()}
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
            if report.host_pid != self.actor_pids.get(node):  # a new actor: the old one's jobs are gone
                lost.append(node)
                continue
            self.reports[node] = report
            self._answered[node] = now
        for node in refs:
            if node not in self.reports and node not in lost and now - self._answered[node] > self.cc.node_timeout_s:
                lost.append(node)
        return lost

    def stop_later(self, node: str, job_id: str) -> None:
        """Queue a stop of the job's part on the node's actor, without waiting for it."""
        actor = self.actors.get(node)
        if actor is not None:
            with contextlib.suppress(Exception):
                actor.stop.remote(job_id, 0.0)

    def call(self, node: str, method: str, *args: object, timeout: float = CALL_TIMEOUT_S) -> Any:
        return self.ray.get(getattr(self.actors[node], method).remote(*args), timeout=timeout)

    def ask(self, node: str, method: str, *args: object) -> Any:
        """`call`, any failure (node gone, timeout, the actor's own error) one OSError naming the node."""
        try:
            return self.call(node, method, *args)
        except Exception as e:  # noqa: BLE001 - one line for the daemon's log or the client
            raise OSError(f"node {node}: {cause(e)}") from None

    def try_call(self, node: str, method: str, *args: object, timeout: float = CALL_TIMEOUT_S) -> Any:
        """`call`; None if it fails (node gone, timeout, the actor's own error): the caller
        cannot tell, and asks again later or takes the part as gone."""
        try:
            return self.call(node, method, *args, timeout=timeout)
        except Exception:  # noqa: BLE001 - see above
            return None

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

    def running(self) -> list[str]:
        """The nodes whose part has not ended."""
        return [n for n in self.nodes if n not in self.ended]

    def part_ended(self, node: str, ended: ExitInfo) -> None:
        self.ended[node] = ended
        if self.failure is None and ended.exit_code != 0:
            self.failure = ended  # parts failing in the same tick: the lowest rank


def cause(e: BaseException) -> str:
    """The last line of an error (a RayTaskError's text ends with the remote exception)."""
    text = str(e).strip()
    return text.splitlines()[-1] if text else type(e).__name__
