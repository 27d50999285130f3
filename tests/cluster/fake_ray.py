"""Ray's calling convention without Ray, for the global scheduler's fault handling.

`FakeRay` stands in for the `ray` module where `Nodes` uses it (scheduler_lite.cluster.nodes:
named detached actors, `.remote()` calls, `wait`, `get`, `kill`, `nodes()`). Each actor is a real
`NodeHost` in this process (no fencing thread: a test fences an agent with `FakeActor.fence`) and
its jobs are real processes, so what a fault leaves running is real. A test can:

- freeze an agent (`freeze`, as SIGSTOP): its calls queue up and time out; `resume` (SIGCONT)
  runs them in order, after `silent_for` seconds of silence if given (the time it was stopped);
- kill it (`kill`, as kill -9 or `ray.kill`): its calls fail with RayActorError, its jobs run on
  (they are in their own sessions); `unkillable` makes `ray.kill` miss a frozen agent;
- take its Ray node away (`FakeRay.alive`), or offer other node resources (`FakeRay.extra`).

Calls run at once, in the caller's thread: a call not done at once is a frozen agent's, so `wait`
then waits its whole timeout, as Ray would.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

from scheduler_lite.cluster.node_host import NodeHost
from scheduler_lite.cluster.nodes import actor_name
from scheduler_lite.config import Config

_pids = itertools.count(900_000)  # each agent its own "pid": a new agent is told by it


class RayActorError(Exception):
    pass


class GetTimeoutError(Exception):
    pass


class FakeRef:
    def __init__(self, call: Callable[[], Any]) -> None:
        self._call = call
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self._call()
        except Exception as e:  # noqa: BLE001 - what ray.get would raise
            self.error = e
        self.done = True

    def fail(self, error: BaseException) -> None:
        self.error, self.done = error, True


class FakeActor:
    """A node host behind Ray's calling convention."""

    def __init__(self, agent: NodeHost) -> None:
        self.agent = agent
        self.pid = next(_pids)
        self.frozen = False
        self.dead = False
        self.unkillable = False
        self.queue: list[FakeRef] = []

    def __getattr__(self, method: str) -> Any:  # agent.report.remote()
        if method.startswith("_"):
            raise AttributeError(method)
        return SimpleNamespace(remote=lambda *args: self._call(method, args))

    def _call(self, method: str, args: Sequence[object]) -> FakeRef:
        ref = FakeRef(lambda: self._answer(method, getattr(self.agent, method)(*args)))
        if self.dead:
            ref.fail(RayActorError(f"the actor died ({self.agent.node})"))
        elif self.frozen:
            self.queue.append(ref)
        else:
            ref.run()
        return ref

    def _answer(self, method: str, value: Any) -> Any:
        if method == "info":
            return {**value, "pid": self.pid}
        if method == "report":
            return replace(value, host_pid=self.pid)
        return value

    def freeze(self) -> None:
        self.frozen = True

    def resume(self, silent_for: float = 0.0) -> None:
        """SIGCONT: the calls queued while it was stopped run in order (the fence check first)."""
        self.agent._contact -= silent_for
        self.frozen = False
        queue, self.queue = self.queue, []
        for ref in queue:
            ref.run()

    def fence(self) -> None:
        """What the agent's fencing thread does once the global scheduler has been silent for its fence."""
        with self.agent._lock:
            self.agent._contact -= self.agent.fence_s
            self.agent._fence_if_silent()

    def kill(self) -> None:
        self.dead = True
        queue, self.queue = self.queue, []
        for ref in queue:
            ref.fail(RayActorError(f"the actor died ({self.agent.node})"))


class _ActorClass:
    def __init__(self, ray: FakeRay, cls: type[NodeHost]) -> None:
        self.ray, self.cls = ray, cls

    def options(self, *, name: str, get_if_exists: bool = False, **_: object) -> Any:
        def create(node: str, config: Config) -> FakeActor:
            actor = self.ray.actors.get(name)
            if actor is None or actor.dead or not get_if_exists:
                actor = FakeActor(self.cls(node, config, fence=False))
                self.ray.actors[name] = actor
            return actor

        return SimpleNamespace(remote=create)


class FakeRay:
    """The few functions of the `ray` module that `Nodes` calls."""

    exceptions = SimpleNamespace(RayActorError=RayActorError, GetTimeoutError=GetTimeoutError)

    def __init__(self, nodes: Iterable[str]) -> None:
        self.alive = set(nodes)  # nodes whose Ray node is up and offers antman_node_<name>
        self.extra: set[str] = set()  # other resources offered (a node name spelt otherwise)
        self.actors: dict[str, FakeActor] = {}

    def agent(self, node: str) -> FakeActor:
        return self.actors[actor_name(node)]

    def is_initialized(self) -> bool:
        return True

    def nodes(self) -> list[dict[str, Any]]:
        offered = [f"antman_node_{n}" for n in sorted(self.alive)] + sorted(self.extra)
        return [{"Alive": True, "Resources": {r: 1.0}} for r in offered]

    def remote(self, **_: object) -> Callable[[type[NodeHost]], _ActorClass]:
        return lambda cls: _ActorClass(self, cls)

    def get_actor(self, name: str, namespace: str | None = None) -> FakeActor:
        actor = self.actors.get(name)
        if actor is None or actor.dead:
            raise ValueError(f"Failed to look up actor with name '{name}'")
        return actor

    def wait(self, refs: Sequence[FakeRef], num_returns: int = 1,
             timeout: float | None = None) -> tuple[list[FakeRef], list[FakeRef]]:
        ready = [r for r in refs if r.done]
        if len(ready) < num_returns and timeout:
            time.sleep(timeout)  # what is not done now is frozen: Ray waits the whole timeout
        return ready, [r for r in refs if not r.done]

    def get(self, ref: FakeRef, timeout: float | None = None) -> Any:
        if not ref.done:
            raise GetTimeoutError("Get timed out: some object(s) not ready")
        if ref.error is not None:
            raise ref.error
        return ref.value

    def kill(self, actor: FakeActor) -> None:
        if not (actor.unkillable and actor.frozen):
            actor.kill()
