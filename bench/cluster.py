"""Cluster mode latencies: submit -> start, and coordinator decision -> control applied by the job,
through the node agents on a Ray cluster vs the single-machine daemon, in the same run.

    .venv/bin/python bench/cluster.py --quick      (3 repeats of each mode, alternating)
    .venv/bin/python bench/cluster.py --repeats 10

The Ray cluster is `ray.cluster_utils.Cluster` on this machine: a head raylet (where this process,
the global scheduler, is a driver) and a second raylet `n1` holding the only configured node, so
every job of cluster mode runs behind n1's node agent. Both modes tick at the same interval.

Measured by the job itself, independently of the scheduler: a tiny Python process (no TF) writes
its wall-clock start time and, each time it sees a new control.json seq (it polls every 2 ms), the
time it saw it. Start latency = job start - the wall time just before `submit`. Control latency =
the opportunistic job's first sight of its cut share - the wall time just before the tick in
which a guarantee job arrives on its GPU (the coordinator's arrival step cuts it at once).
Both include the tick wait (submit) and the process start (start latency), the same in both modes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scheduler_lite.config import Config, parse_config  # noqa: E402
from scheduler_lite.daemon import Daemon  # noqa: E402
from scheduler_lite.storage import SqliteStorage  # noqa: E402
from scheduler_lite.testing import stop_all_jobs  # noqa: E402

TICK_S = 0.05
JOB = r"""
import os, sys, time
from pathlib import Path
from tf_antman.protocol import parse_control, read_text, control_path
out = Path(sys.argv[1])
out.with_suffix(".start").write_text(repr(time.time()))
job_dir = Path(os.environ["ANTMAN_JOB_DIR"])
seen = 0
while True:
    text = read_text(control_path(job_dir))
    if text:
        c = parse_control(text)
        if c.seq > seen and c.compute_share is not None and c.compute_share < 1.0:
            out.with_suffix(".control").write_text(repr(time.time()))
            seen = c.seq
    time.sleep(0.002)
"""


def config(state: Path, cluster: dict[str, Any] | None) -> Config:
    data: dict[str, Any] = {
        "version": 1,
        "paths": {"state_dir": str(state)},
        "devices": {"kind": "emulated", "emulated": [{"id": 0, "memory": "1GiB"}]},
        "tenants": [{"name": "A", "gpu_quota": 1}, {"name": "C", "gpu_quota": 0}],
        "jobs": {"cancel_grace_s": 1},
        "daemon": {"tick_interval_s": TICK_S, "schedule_interval_s": 0.2, "utilisation_window_s": 1.0},
        "coordinator": {"min_memory_bytes": "64MiB", "round_interval_s": 0.5},
    }
    if cluster is not None:
        data["cluster"] = cluster
    return parse_config(data, base_dir=state)


def wait_file(d: Daemon, path: Path, timeout: float = 60.0) -> float:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} never appeared")
        d.tick()
        time.sleep(TICK_S)
    return float(path.read_text())


def one_run(mode: str, work: Path, address: str, n: int) -> dict[str, float]:
    state = work / f"{mode}-{n}"
    cluster = None
    if mode == "cluster":
        cluster = {"kind": "ray", "address": address, "namespace": f"bench{os.getpid()}-{n}", "nodes": ["n1"],
                   "node_timeout_s": 30}
    cfg = config(state, cluster)
    if mode == "cluster":
        from scheduler_lite.cluster.host import cluster_daemon

        d: Daemon = cluster_daemon(cfg, SqliteStorage(cfg.db_path))
    else:
        d = Daemon(cfg, SqliteStorage(cfg.db_path))
    env = {"PYTHONPATH": str(REPO)}
    try:
        out = state / "opp"
        submitted = time.time()
        d.submit([sys.executable, "-c", JOB, str(out)], tenant="C", kind="opportunistic", env=env)
        started = wait_file(d, out.with_suffix(".start"))
        for _ in range(5):  # settle: the job runs, a few ticks pass
            d.tick()
            time.sleep(TICK_S)
        d.submit([sys.executable, "-c", JOB, str(state / "g")], tenant="A", kind="guarantee", env=env)
        before = time.time()
        d.tick()  # picks it up, places it next to the opportunistic job, cuts that one's share
        tick_s = time.time() - before
        applied = wait_file(d, out.with_suffix(".control"))
        return {"start_s": started - submitted, "control_s": applied - before, "tick_s": tick_s}
    finally:
        stop_all_jobs(d, grace_s=1)
        if mode == "cluster":
            import ray

            from scheduler_lite.cluster.nodes import actor_name
            ray.kill(ray.get_actor(actor_name("n1"), namespace=cfg.cluster.namespace))  # type: ignore[union-attr]


def restart_run(work: Path, address: str, n: int) -> float:
    """Seconds from `scheduler-lite serve` (cluster mode) being started to its socket answering,
    with the node agent and one running job already there (the re-adoption included): what
    must stay below half of cluster.node_timeout_s (agents fence after that)."""
    import subprocess

    from scheduler_lite.client import call_socket

    state = work / f"restart-{n}"
    namespace = f"benchr{os.getpid()}-{n}"
    state.mkdir(parents=True)
    cfg_path = state / "cluster.toml"
    cfg_path.write_text(f"""version = 1
[paths]
state_dir = "state"
[devices]
kind = "emulated"
[[devices.emulated]]
id = 0
memory = "1GiB"
[[tenants]]
name = "C"
gpu_quota = 0
[daemon]
tick_interval_s = {TICK_S}
[cluster]
kind = "ray"
address = "{address}"
namespace = "{namespace}"
nodes = ["n1"]
node_timeout_s = 30
""")
    from scheduler_lite.config import load_config

    cfg = load_config(cfg_path)
    serve = [sys.executable, "-m", "scheduler_lite", "--config", str(cfg_path), "serve"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    sock = cfg.socket_path

    def up(p: subprocess.Popen[bytes]) -> float:
        started = time.monotonic()
        while True:
            try:
                call_socket(sock, "ping", {}, cfg.state_dir)
                return time.monotonic() - started
            except Exception:  # noqa: BLE001 - not up yet
                if p.poll() is not None or time.monotonic() - started > 120:
                    raise RuntimeError("serve did not come up") from None
                time.sleep(0.02)

    first = subprocess.Popen(serve, cwd=REPO, env=env, stderr=subprocess.DEVNULL)
    try:
        up(first)
        call_socket(sock, "submit", {"command": [sys.executable, "-c", JOB, str(state / "opp")], "tenant": "C",
                                     "kind": "opportunistic", "workdir": str(REPO), "env": [["PYTHONPATH", str(REPO)]]},
                    cfg.state_dir)
        deadline = time.monotonic() + 60
        while not (state / "opp.start").exists():
            if time.monotonic() > deadline:
                raise RuntimeError("the job did not start")
            time.sleep(0.05)
    finally:
        first.kill()
        first.wait()
    second = subprocess.Popen(serve, cwd=REPO, env=env, stderr=subprocess.DEVNULL)
    try:
        return up(second)
    finally:
        second.terminate()
        second.wait()
        d = __import__("scheduler_lite.cluster.host", fromlist=["cluster_daemon"]).cluster_daemon(
            cfg, SqliteStorage(cfg.db_path))
        stop_all_jobs(d, grace_s=1)
        import ray

        from scheduler_lite.cluster.nodes import actor_name
        ray.kill(ray.get_actor(actor_name("n1"), namespace=namespace))


def summary(xs: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="3 repeats of each mode (instead of --repeats)")
    p.add_argument("--repeats", type=int, default=10, help="alternated runs of each mode, 1-100 (default 10)")
    args = p.parse_args()
    if not 1 <= args.repeats <= 100:
        p.error(f"--repeats {args.repeats} is invalid: accepted an integer in [1, 100]")
    if args.quick and "--repeats" in sys.argv[1:]:
        p.error("--quick sets the repeats (3): give one of --quick and --repeats")
    repeats = 3 if args.quick else args.repeats
    os.environ["PYTHONPATH"] = str(REPO)
    import ray
    from ray.cluster_utils import Cluster

    common = {"num_cpus": 1, "object_store_memory": 80 << 20}
    c = Cluster(initialize_head=True, head_node_args={**common, "include_dashboard": False})
    c.add_node(**common, resources={"antman_node_n1": 1})
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    results: dict[str, list[dict[str, float]]] = {"local": [], "cluster": []}
    restarts: list[float] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for n in range(repeats):
                order = ("local", "cluster") if n % 2 == 0 else ("cluster", "local")  # alternate
                for mode in order:
                    results[mode].append(one_run(mode, Path(tmp), c.address, n))
                    print(mode, n, results[mode][-1], file=sys.stderr, flush=True)
            restarts = [restart_run(Path(tmp), c.address, n) for n in range(min(repeats, 3))]
            print("restart", restarts, file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
        c.shutdown()
    out: dict[str, Any] = {"repeats": repeats, "tick_interval_s": TICK_S,
                           "cluster_restart_s": summary(restarts)}
    for mode, runs in results.items():
        out[mode] = {k: summary([r[k] for r in runs]) for k in ("start_s", "control_s", "tick_s")}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
