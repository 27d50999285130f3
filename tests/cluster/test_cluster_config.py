"""The [cluster] table and ray_options: validated, errors name the field and range; no Ray needed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from scheduler_lite.cluster import ray_options
from scheduler_lite.cluster.host import ClusterJobHost
from scheduler_lite.cluster.parts import merge_stats, split_control
from scheduler_lite.cluster.placement import node_aware
from scheduler_lite.config import parse_config
from scheduler_lite.jobenv import process_control
from scheduler_lite.model import Gpu, Job, JobKind, Place, Reserve, Role, Tenant
from scheduler_lite.policy.book import ClusterBook
from scheduler_lite.policy.validation import ConfigError
from tests.cluster.conftest import REPO, cluster_config
from tf_antman.protocol import Control, DeviceStats, MemoryLimit, Stats


def test_cluster_table_parsed(tmp_path: Path) -> None:
    config = cluster_config(tmp_path, "ns")
    cc = config.cluster
    assert cc is not None and cc.nodes == ("n0", "n1", "n2") and cc.on_node_loss == "requeue"
    assert cc.global_gpu("n2", 1) == 201 and cc.node_of(201) == "n2" and cc.local_gpu(201) == 1
    assert cc.node_jobs_dir(tmp_path, "n1") == tmp_path / "nodes" / "n1" / "jobs"
    assert cc.resource("n1") == "antman_node_n1"


@pytest.mark.parametrize(("change", "field", "accepted"), [
    ({"kind": "k8s"}, "cluster.kind", "one of ray"),
    ({"nodes": []}, "cluster.nodes", "a list of 1 to 64 node names"),
    ({"nodes": ["a", "a"]}, "cluster.nodes[1]", "a name not used by another node"),
    ({"nodes": ["a", "bad name"]}, "cluster.nodes[1]", "1-64 characters"),
    ({"span_tenants": ["Z"]}, "cluster.span_tenants[0]", "one of the configured tenants: A, B, C"),
    ({"on_node_loss": "retry"}, "cluster.on_node_loss", "one of requeue, fail"),
    ({"node_timeout_s": 0.1}, "cluster.node_timeout_s", "a number in [0.5, 3600.0]"),
    # The reviewer's case: an agent fenced its healthy jobs at every tick (tests: tick 0.1 s).
    ({"node_timeout_s": 0.5}, "cluster.node_timeout_s", "at least 4.2 s with daemon.tick_interval_s = 0.1"),
    ({"jobs_dir": "a\0b"}, "cluster.jobs_dir", "a directory path"),
    ({"address": ""}, "cluster.address", "a Ray address"),
    ({"colour": "red"}, "cluster.colour", "one of kind, address"),
])
def test_bad_cluster_values_name_field_and_range(tmp_path: Path, change: dict, field: str, accepted: str) -> None:
    with pytest.raises(ConfigError) as err:
        cluster_config(tmp_path, "ns", cluster=change)
    assert err.value.field == field and accepted in err.value.accepted


def test_node_gpu_ids_must_fit_the_stride(tmp_path: Path) -> None:
    data = {"version": 1, "paths": {"state_dir": str(tmp_path)},
            "devices": {"kind": "emulated", "emulated": [{"id": 100, "memory": "1GiB"}]},
            "tenants": [{"name": "A", "gpu_quota": 1}], "cluster": {"kind": "ray", "nodes": ["a"]}}
    with pytest.raises(ConfigError) as err:
        parse_config(data, base_dir=tmp_path)
    assert err.value.field == "devices.emulated[0].id" and "[0, 99]" in err.value.accepted


def test_ray_options_turn_a_fraction_into_antman_settings(tmp_path: Path) -> None:
    opts = ray_options(0.25, memory="2GiB", job_dir=tmp_path)
    env = opts["runtime_env"]["env_vars"]
    assert opts["num_gpus"] == 0.25
    assert env["ANTMAN_MEMORY_LIMIT"] == str(2 << 30) and env["ANTMAN_COMPUTE_SHARE"] == "0.25"
    assert env["ANTMAN_DEVICE"] == "cuda" and env["ANTMAN_JOB_DIR"] == str(tmp_path)
    guarantee = ray_options(0.5, device_memory="16GiB", kind="guarantee", runtime_env={"env_vars": {"X": "1"}})
    genv = guarantee["runtime_env"]["env_vars"]
    assert genv["ANTMAN_MEMORY_LIMIT"] == str(8 << 30) and genv["ANTMAN_COMPUTE_SHARE"] == "1.0" and genv["X"] == "1"
    # Low device priority: opportunistic tasks on the emulated device only (not applied on cuda).
    assert "ANTMAN_DEVICE_PRIORITY" not in env and "ANTMAN_DEVICE_PRIORITY" not in genv
    emulated = {k: ray_options(0.5, device="emulated", device_memory="1GiB", kind=k)["runtime_env"]["env_vars"]
                for k in ("opportunistic", "guarantee")}
    assert emulated["opportunistic"]["ANTMAN_DEVICE_PRIORITY"] == "low"
    assert "ANTMAN_DEVICE_PRIORITY" not in emulated["guarantee"]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_gpus": 1.5, "memory": "1GiB"}, "num_gpus=1.5 is invalid: accepted a fraction of one GPU in (0, 1]"),
    ({"num_gpus": 0.5, "memory": "1GiB", "kind": "best"}, "kind='best' is invalid"),
    ({"num_gpus": 0.5}, "memory=None is invalid"),
    ({"num_gpus": 0.5, "memory": "lots"}, "memory='lots' is invalid"),
    ({"num_gpus": 0.5, "memory": "2GiB", "device": "emulated", "device_memory": "1GiB"}, "accepted [1048576, 1073741824]"),
    ({"num_gpus": 0.5, "memory": "1GiB", "device": "emulated"}, "device_memory=None is invalid"),
])
def test_ray_options_refuse_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        ray_options(**kwargs)
    assert message in str(err.value)


def test_node_aware_holds_a_spanning_gang_on_its_best_node() -> None:
    gpus = [Gpu(i, f"n{i // 100}", 1 << 30, f"n{i // 100}/nv") for i in (0, 1, 100, 101)]
    book = ClusterBook(gpus, [Tenant("A", 2), Tenant("B", 2)])
    for name in ("A", "B"):
        book.submit(Job(name.lower(), name, 2, JobKind.GUARANTEE, 0.0))
    spread = [Place("a", (1, 100), Role.GUARANTEE), Place("b", (0, 101), Role.GUARANTEE)]
    policy = node_aware(lambda state, cfg: list(spread), ["A"], lambda g: f"n{g // 100}")
    # A may span nodes; B may not: it holds the GPU of the first best node (a tie: by name) and waits.
    assert policy(book.snapshot(0.0), None) == [spread[0], Reserve("b", (0,))]


def test_node_aware_keeps_a_gang_no_node_here_can_hold_out_of_the_pass(tmp_path: Path) -> None:
    """A node is away: B's 3-GPU gang (B may not span) is larger than every 2-GPU node here. It
    holds nothing and says why: held, it took a whole node it can never run on, and A's gang
    (which may span) waited behind it next to idle GPUs."""
    from scheduler_lite.driver import Driver
    from scheduler_lite.policy.global_scheduler import schedule

    config = cluster_config(tmp_path, "ns")
    gpus = [Gpu(i, f"n{i // 100}", 1 << 30, f"n{i // 100}/nv") for i in (0, 1, 100, 101)]
    waits: list[tuple[str, str]] = []
    policy = node_aware(schedule, ["A"], lambda g: f"n{g // 100}", lambda job, why: waits.append((job, why)))
    driver = Driver(gpus, [Tenant("A", 4), Tenant("B", 4)], policy=policy, scheduler_config=config.scheduler,
                    coordinator_config=config.coordinator)
    driver.book.submit(Job("solo", "B", 3, JobKind.GUARANTEE, 0.0))
    assert driver.schedule(1.0) == ([], []) and driver.book.reservations == {}
    assert waits == [("solo", "needs 3 GPUs on one node (tenant 'B' may not span nodes) and the largest node here "
                              "has 2: it waits, holding nothing, for a larger node to join")]
    driver.book.submit(Job("research", "A", 4, JobKind.GUARANTEE, 2.0))
    _, launches = driver.schedule(3.0)
    assert [(launch.job_id, launch.gpus) for launch in launches] == [("research", (0, 1, 100, 101))]


def test_node_aware_holds_a_gang_only_on_a_node_that_can_hold_it() -> None:
    """Algorithm 1 spreads B's 3-GPU gang over a 2-GPU node (2 found) and a 4-GPU one (1 found):
    the hold goes to the node that can hold it, not to where most were found."""
    gpus = [Gpu(i, f"n{i // 100}", 1 << 30, f"n{i // 100}/nv") for i in (0, 1, 100, 101, 102, 103)]
    book = ClusterBook(gpus, [Tenant("B", 4)])
    book.submit(Job("b", "B", 3, JobKind.GUARANTEE, 0.0))
    policy = node_aware(lambda state, cfg: [Place("b", (0, 1, 103), Role.GUARANTEE)], [], lambda g: f"n{g // 100}")
    assert policy(book.snapshot(0.0), None) == [Reserve("b", (103,))]


def test_single_machine_path_does_not_import_ray() -> None:
    code = ("import sys, scheduler_lite.cli, scheduler_lite.server, scheduler_lite.daemon, scheduler_lite.cluster; "
            "import scheduler_lite.cluster.host; assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def _node_of(g: int) -> str:
    return f"n{g // 100}"


def test_a_gang_control_is_split_per_node_in_job_device_order() -> None:
    # Placement interleaves nodes (groups n0/a, n1/a, n0/b): job devices 0, 2 on n0; 1 on n1.
    placement = (0, 100, 1)
    control = Control(seq=7, memory_limits=(MemoryLimit(0, 10), MemoryLimit(1, 11), MemoryLimit(2, 12)),
                      compute_share=0.5)
    parts = split_control(control, placement, _node_of)
    assert parts == {"n0": Control(seq=7, memory_limits=(MemoryLimit(0, 10), MemoryLimit(1, 12)), compute_share=0.5),
                     "n1": Control(seq=7, memory_limits=(MemoryLimit(0, 11),), compute_share=0.5)}


def test_each_part_process_gets_one_limit_the_tightest_of_its_gpus() -> None:
    """What ClusterJobHost.write_control writes: a part's process manages device 0 only (tf-antman
    refuses a control naming another), so n0's two GPUs' limits become one."""
    placement = (0, 100, 1)
    control = Control(seq=7, memory_limits=(MemoryLimit(0, 10), MemoryLimit(1, 11), MemoryLimit(2, 9)),
                      compute_share=0.5)
    sent: dict[str, Control] = {}
    # The host's own method, on just what it reads: the nodes' calls and the node of a GPU.
    daemon = SimpleNamespace(cc=SimpleNamespace(node_of=_node_of),
                             nodes=SimpleNamespace(ask=lambda node, method, job_id, part: sent.__setitem__(node, part)))
    live = SimpleNamespace(record=SimpleNamespace(placement=placement))
    ClusterJobHost.write_control(daemon, "job-1", live, control)  # type: ignore[arg-type]
    assert sent == {"n0": Control(seq=7, memory_limits=(MemoryLimit(0, 9),), compute_share=0.5),
                    "n1": Control(seq=7, memory_limits=(MemoryLimit(0, 11),), compute_share=0.5)}
    one = Control(seq=8, memory_limits=(MemoryLimit(0, 5),), compute_share=None)
    assert process_control(one) is one


def test_a_gang_stats_are_merged_in_job_device_order() -> None:
    def dev(i: int, limit: int) -> DeviceStats:
        return DeviceStats(i, limit, 1, 1, 1, 1, 0, 0, 0)

    placement = (0, 100, 1)
    n0 = Stats(seq=3, pid=1, state="running", step=9, devices=(dev(0, 10), dev(1, 12)), control_seq_applied=7)
    n1 = Stats(seq=5, pid=2, state="running", step=8, devices=(dev(0, 11),), control_seq_applied=6)
    merged = merge_stats({"n0": n0, "n1": n1}, placement, _node_of)
    assert [(d.device, d.limit_bytes) for d in merged.devices] == [(0, 10), (1, 11), (2, 12)]
    assert merged.step == 9 and merged.seq == 3 and merged.control_seq_applied == 6  # rank 0; all applied


def test_request_placement_names_a_bad_argument(tmp_path: Path) -> None:
    """Refused before anything is sent to the scheduler (no daemon runs here)."""
    import dataclasses

    from scheduler_lite.cluster.booking import is_ray_task, task_env
    from scheduler_lite.cluster.tasks import RayPlacement, request_placement

    config = cluster_config(tmp_path, "ns")
    for kwargs, message in (
        ({"num_gpus": 0}, r"num_gpus=0 is invalid: accepted a fraction of one GPU in \(0, 1\]"),
        ({"num_gpus": 1.5}, "num_gpus=1.5 is invalid"),
        ({"num_gpus": True}, "num_gpus=True is invalid"),
        ({"kind": "auto"}, "kind='auto' is invalid: accepted one of opportunistic, guarantee"),
        ({"memory": "lots"}, "memory='lots' is invalid"),
        ({"timeout_s": 0}, r"timeout_s=0 is invalid: accepted \(0, 86400\]"),
    ):
        with pytest.raises(ValueError, match=message):
            request_placement(config, **kwargs)
    with pytest.raises(ValueError, match=r"no \[cluster\] table"):
        request_placement(dataclasses.replace(config, cluster=None))
    nvml = dataclasses.replace(config, devices=dataclasses.replace(config.devices, kind="nvml"))
    with pytest.raises(ValueError, match="memory=None is invalid"):
        request_placement(nvml)
    assert is_ray_task(("scheduler-lite:ray-task",)) and not is_ray_task(("python", "scheduler-lite:ray-task"))
    env = task_env({"PATH": "/bin", "ANTMAN_JOB_DIR": "/j", "SCHEDULER_LITE_JOB_ID": "job-1",
                    "CUDA_VISIBLE_DEVICES": "3"})
    assert env == {"ANTMAN_JOB_DIR": "/j", "SCHEDULER_LITE_JOB_ID": "job-1", "CUDA_VISIBLE_DEVICES": "3",
                   "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
    ordered = task_env({"CUDA_VISIBLE_DEVICES": "3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert ordered["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # NVML's indices, counted NVML's way
    options = RayPlacement("job-1", "n2", 200, "opportunistic", "/j", env).options({"env_vars": {"X": "1"}})
    assert options["resources"] == {"antman_node_n2": 0.001} and options["max_retries"] == 0
    assert options["max_calls"] == 1 and options["runtime_env"]["env_vars"]["X"] == "1"
