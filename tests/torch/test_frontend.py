"""tf_antman.torch without a GPU and without torch: settings, the optimizer step hook, the
runtime behind the job agent, and activation of an unchanged script at `import torch`
(against the stand-in in stand_in.py). Real-torch checks are in test_real_torch.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import REPO, clean_env, run_py
from tests.torch import stand_in
from tf_antman import config
from tf_antman.agent import ShareNotEnforced
from tf_antman.device_select import CudaProbe, DeviceUnavailable
from tf_antman.holds import HoldClock
from tf_antman.native import NativeError
from tf_antman.protocol import read_stats, write_control
from tf_antman.protocol.schema import Control, MemoryLimit
from tf_antman.torch import _shim, settings, steps_hook
from tf_antman.torch.runtime import TorchRuntime

MiB = 1 << 20
needs_shim = pytest.mark.skipif(not _shim.shim_path().exists(), reason="libantman_torch.so not built")


# ---- settings ------------------------------------------------------------------------------

def one_gpu() -> CudaProbe:
    return CudaProbe(gpus=1, problem="")


def no_driver() -> CudaProbe:
    return CudaProbe(gpus=0, problem="no CUDA driver (libcuda.so.1 cannot be loaded)")


def test_cuda_defaults_take_the_free_memory_and_no_limit() -> None:
    ts = settings.load({"ANTMAN_ENABLE": "1"}, probe=one_gpu)
    assert ts.base.device == "cuda" and ts.device_capacity == 0 and ts.memory_limit == 0
    ts = settings.load({"ANTMAN_MEMORY_LIMIT": "20GiB"}, probe=one_gpu)  # above the TF default capacity: fine here
    assert ts.memory_limit == 20 << 30 and ts.device_capacity == 0
    ts = settings.load({"ANTMAN_DEVICE_MEMORY": "40GiB", "ANTMAN_MEMORY_LIMIT": "8GiB"}, probe=one_gpu)
    assert (ts.device_capacity, ts.memory_limit) == (40 << 30, 8 << 30)


def test_auto_is_resolved_as_for_tensorflow() -> None:
    # auto used to reach the memory core unresolved: _shim.BACKENDS["auto"] raised KeyError.
    ts = settings.load({"ANTMAN_DEVICE": "auto"}, probe=one_gpu)
    assert ts.base.device == "cuda" and ts.device_capacity == 0  # cuda's defaults: the free memory
    ts = settings.load({"ANTMAN_DEVICE": "auto", "ANTMAN_DEVICE_MEMORY": "64MiB"}, probe=no_driver)
    assert ts.base.device == "emulated" and ts.device_capacity == ts.memory_limit == 64 * MiB
    assert ts.base.device in _shim.BACKENDS


def test_cuda_without_a_gpu_is_refused_naming_antman_device() -> None:
    with pytest.raises(DeviceUnavailable, match=r"^ANTMAN_DEVICE=cuda refused: no CUDA driver.*ANTMAN_DEVICE=emulated"):
        settings.load({"ANTMAN_ENABLE": "1"}, probe=no_driver)  # cuda: the PyTorch default
    with pytest.raises(DeviceUnavailable, match="ANTMAN_DEVICE=cuda refused: the CUDA driver reports no GPU"):
        settings.load({"ANTMAN_DEVICE": "cuda"}, probe=lambda: CudaProbe(gpus=0, problem=""))
    # Not enabled: nothing runs, so nothing is probed or refused (no_driver would be refused),
    # and no other variable is read (config.load: ANTMAN_ENABLE=0 wins).
    assert not settings.load({"ANTMAN_ENABLE": "0", "ANTMAN_DEVICE": "cuda"}, probe=no_driver).base.enabled


def test_emulated_and_bad_values_are_refused_like_for_tensorflow() -> None:
    ts = settings.load({"ANTMAN_DEVICE": "emulated"})
    assert ts.device_capacity == 4 << 30 and ts.memory_limit == 4 << 30
    with pytest.raises(config.ConfigError, match="ANTMAN_MEMORY_LIMIT"):
        settings.load({"ANTMAN_MEMORY_LIMIT": "2PiB"})
    with pytest.raises(config.ConfigError, match="ANTMAN_DEVICE="):
        settings.load({"ANTMAN_DEVICE": "rocm"})
    with pytest.raises(config.ConfigError, match="ANTMAN_MEMORY_LIMIT"):
        settings.load({"ANTMAN_DEVICE_MEMORY": "1GiB", "ANTMAN_MEMORY_LIMIT": "2GiB"})


# ---- optimizer step hook -------------------------------------------------------------------

class Steps:
    def __init__(self) -> None:
        self.ends: list[tuple[float | None, bool]] = []

    def step_end(self, seconds: float | None = None, training: bool = True) -> None:
        self.ends.append((seconds, training))


class Optim:  # what the hook sees of an optimizer: its identity
    pass


def test_first_optimizer_to_step_marks_steps() -> None:
    steps = Steps()
    hook = steps_hook.OptimizerStepHook(steps)
    gen, disc = Optim(), Optim()
    for _ in range(3):  # a GAN iteration: two optimizers, one step
        hook(gen, (), {})
        hook(disc, (), {})
    assert steps.ends == [(None, True)] * 3


def test_next_optimizer_takes_over_when_the_lead_is_gone() -> None:
    steps = Steps()
    hook = steps_hook.OptimizerStepHook(steps)
    first, second = Optim(), Optim()
    hook(first)
    hook(second)
    del first  # e.g. a second training phase with a new optimizer
    hook(second)
    hook(second)
    assert len(steps.ends) == 3


def test_install_registers_a_global_post_hook() -> None:
    registered = []

    class Module:
        @staticmethod
        def register_optimizer_step_post_hook(hook: object) -> str:
            registered.append(hook)
            return "handle"

    steps = Steps()
    assert steps_hook.install(steps, Module) == "handle"
    registered[0](Optim(), (), {})
    assert steps.ends == [(None, True)]


# ---- runtime behind the agent --------------------------------------------------------------

@needs_shim
def test_share_below_one_is_refused_without_compute_scaling() -> None:
    lib = _shim.load()
    lib.antman_torch_reset_for_tests()
    try:
        mem = _shim.create(lib, _shim.shim_path(), "emulated", 0, 64 * MiB, 0, 0)
        rt = TorchRuntime(mem, None, "libantman_core.so is missing")
        rt.set_share(1.0)
        with pytest.raises(NativeError, match="compute scaling is unavailable.*libantman_core.so") as refused:
            rt.set_share(0.5)
        # ...as a share the agent reports not in force while applying the rest of a control.
        assert isinstance(refused.value, ShareNotEnforced)
        with pytest.raises(NativeError, match=r"accepted 0.0..1.0"):
            rt.set_share(float("nan"))
        assert rt.op_stats().share == 1.0
    finally:
        lib.antman_torch_reset_for_tests()


class ShareOnly:
    """Compute's share calls, without an op manager or hook (the runtime's hold clock only)."""

    def __init__(self, share: float) -> None:
        self.share = share

    def set_share(self, share: float) -> None:
        self.share = share

    def stats(self) -> SimpleNamespace:
        return SimpleNamespace(share=self.share)


def test_time_at_share_zero_is_counted_on_the_runtime_hold_clock() -> None:
    now = [10.0]
    rt = TorchRuntime(None, ShareOnly(1.0), holds=HoldClock(clock=lambda: now[0]))  # type: ignore[arg-type]
    rt.set_share(0.0)
    now[0] = 12.5
    assert rt.holds.seconds == 2.5  # in force: counts up to now (the exit report may come first)
    rt.set_share(0.5)
    now[0] = 20.0
    assert rt.holds.seconds == 2.5  # throttled is not held (the op manager counts that)
    rt.set_share(0.0)
    now[0] = 21.0
    rt.set_share(1.0)
    now[0] = 30.0
    assert rt.holds.seconds == 3.5


def test_a_start_up_share_of_zero_is_held_from_the_runtime_start() -> None:
    now = [10.0]
    rt = TorchRuntime(None, ShareOnly(0.0), holds=HoldClock(clock=lambda: now[0]))  # type: ignore[arg-type]
    now[0] = 14.0
    rt.set_share(0.25)
    now[0] = 20.0
    assert rt.holds.seconds == 4.0
    # Without compute scaling the share is 1 and can be nothing else: never held.
    assert TorchRuntime(None, None, "no core").holds.seconds == 0.0  # type: ignore[arg-type]


# ---- an unchanged script, activated at `import torch` --------------------------------------

SCRIPT = """
import torch                       # the stand-in; the .pth hook activates tf-antman here
import tf_antman
shim = tf_antman._state().native.memory
big = [shim.malloc(6 << 20) for _ in range(4)]   # what PyTorch would allocate: 24 MiB > 16 MiB
gen, disc = torch.optim.optimizer.Optimizer(), torch.optim.optimizer.Optimizer()
for i in range(5):
    gen.step(); disc.step()
with tf_antman.step():             # a custom loop's step
    pass
emit({"active": tf_antman.is_active(), "steps": tf_antman._state().steps.steps,
      "host": [shim.is_host(p) for p in big], "mem": tf_antman.memory_stats()})
"""


@needs_shim
def test_unchanged_script_is_activated_at_import_torch(tmp_path: Path) -> None:
    site = stand_in.write(tmp_path / "site")
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    # The coordinator's first control: a 16 MiB limit, applied by the agent at start.
    write_control(job_dir, Control(seq=1, memory_limits=(MemoryLimit(0, 16 * MiB),)))
    job = run_py(SCRIPT, timeout=120, PYTHONPATH=f"{site}{os.pathsep}{REPO}",
                 ANTMAN_DEVICE="emulated", ANTMAN_DEVICE_MEMORY="64MiB",
                 ANTMAN_HOST_MEMORY="64MiB", ANTMAN_JOB_DIR=str(job_dir))
    out = job.result
    assert job.rc == 0, job.stderr
    assert out["active"] and out["steps"] == 6  # 5 optimizer iterations + 1 marked step
    assert sorted(out["host"]) == [0, 0, 1, 1]  # over the limit: host fallback, no failure
    assert "at exit: peak device memory" in job.stderr and "served from host memory" in job.stderr
    assert out["mem"]["limit"] == 16 * MiB
    stats = read_stats(job_dir)
    assert stats is not None
    assert stats.state == "finished" and stats.step == 6 and stats.control_seq_applied == 1
    assert stats.devices[0].limit_bytes == 16 * MiB and stats.devices[0].host_fallbacks == 2
    assert stats.compute_share == 1.0 and stats.achieved_share is None


@needs_shim
def test_a_launcher_leaves_the_job_agent_to_the_process_that_trains(tmp_path: Path) -> None:
    """torchrun imports torch, then starts the trainer: the first process of a job directory keeps
    its agent for good, so the trainer ran unmanaged (no controls, stats of a launcher at step 0)."""
    site = stand_in.write(tmp_path / "site")
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    trainer = tmp_path / "train.py"
    trainer.write_text("import os, torch\n"
                       "opt = torch.optim.optimizer.Optimizer()\n"
                       "for _ in range(4):\n    opt.step()\n"
                       "print('trainer', os.getpid())\n")
    launcher = tmp_path / "torchrun"  # what the console script is called: sys.argv[0]
    launcher.write_text("import subprocess, sys, torch\n"
                        f"subprocess.run([sys.executable, {str(trainer)!r}], check=True)\n")
    env = clean_env(PYTHONPATH=f"{site}{os.pathsep}{REPO}", ANTMAN_DEVICE="emulated", ANTMAN_DEVICE_MEMORY="64MiB",
                    ANTMAN_HOST_MEMORY="64MiB", ANTMAN_JOB_DIR=str(job_dir))
    done = subprocess.run([sys.executable, str(launcher)], env=env, capture_output=True, text=True, timeout=120,
                          cwd=str(REPO))
    assert done.returncode == 0, done.stderr
    assert "runs without one" not in done.stderr, done.stderr
    trainer_pid = int(done.stdout.split()[-1])
    stats = read_stats(job_dir)
    assert stats is not None and stats.pid == trainer_pid and stats.step == 4 and stats.state == "finished"


@needs_shim
def test_an_unchanged_script_with_device_auto_runs_on_the_emulated_device_here(tmp_path: Path) -> None:
    # No GPU on this machine: auto is the emulated device (it raised KeyError at `import torch`).
    site = stand_in.write(tmp_path / "site")
    job = run_py("""
        import torch, tf_antman
        torch.optim.optimizer.Optimizer().step()
        emit({"device": tf_antman.settings().device, "steps": tf_antman._state().steps.steps})
    """, timeout=120, PYTHONPATH=f"{site}{os.pathsep}{REPO}", ANTMAN_DEVICE="auto",
                 ANTMAN_DEVICE_MEMORY="64MiB", ANTMAN_HOST_MEMORY="64MiB")
    assert job.rc == 0, job.stderr
    assert job.result == {"device": "emulated", "steps": 1}


@needs_shim
def test_enable_from_code_before_torch(tmp_path: Path) -> None:
    site = stand_in.write(tmp_path / "site")
    job = run_py("""
        import tf_antman, tf_antman.torch
        try:
            tf_antman.torch.enable(memroy_limit="16MiB")
        except TypeError as e:
            typo = str(e)
        s = tf_antman.torch.enable(device="emulated", device_memory="64MiB", memory_limit="16MiB")
        import torch
        emit({"typo": typo, "active": tf_antman.torch.is_active(), "device": s.device,
              "limit": s.memory_limit, "in_force": tf_antman.memory_stats()["limit"]})
    """, timeout=120, PYTHONPATH=f"{site}{os.pathsep}{REPO}")
    assert job.rc == 0, job.stderr
    out = job.result
    assert out["typo"].startswith("enable() got an unknown option 'memroy_limit'")
    assert out["active"] and out["device"] == "emulated"
    assert out["limit"] == out["in_force"] == 16 * MiB


@needs_shim
def test_a_share_below_one_without_compute_scaling_fails_loudly_at_start(tmp_path: Path) -> None:
    site = stand_in.write(tmp_path / "site")
    libs = tmp_path / "libs"  # the allocator library without libantman_core.so beside it
    libs.mkdir()
    (libs / _shim.LIB_NAME).symlink_to(_shim.shim_path())
    job = run_py("import torch\nemit({'reached': True})\n", timeout=120,
                 PYTHONPATH=f"{site}{os.pathsep}{REPO}", ANTMAN_DEVICE="emulated",
                 ANTMAN_COMPUTE_SHARE="0.5", TF_ANTMAN_LIB_DIR=str(libs))
    assert job.rc != 0
    assert "ANTMAN_COMPUTE_SHARE=0.5 needs compute scaling, which is unavailable" in job.stderr
    assert "libantman_core.so is missing" in job.stderr
    assert "reached" not in job.stdout


# ---- compute scaling with the real op manager (libantman_core.so) and a recording hook -------

def _core_or_skip() -> object:
    from tf_antman import core as antman_core

    try:
        return antman_core.load()
    except antman_core.CoreError as err:
        pytest.skip(str(err))


class RecordingHook:
    """Stands in for the compiled op hook: records what Compute asks of it, and the manager's
    share at that moment (the order of the two matters)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.compute: object = None

    def install(self, mode: str, opm: int, gate: int, admit: int, finish: int, begin: int, end: int) -> None:
        self.calls.append(("install", (mode, bool(opm), gate, bool(admit), bool(finish), bool(begin), bool(end))))

    def set_enabled(self, enabled: bool) -> None:
        share = self.compute.opm.stats()["share"] if self.compute is not None else None
        self.calls.append(("enabled", (enabled, share)))

    def stats(self) -> dict[str, int]:
        return {"gated": 0}


def test_hook_is_enabled_only_below_one_and_after_the_share_is_set() -> None:
    from tf_antman.torch.compute import Compute

    core = _core_or_skip()
    hook = RecordingHook()
    compute = Compute(core, 1.0, 0, on_cuda=False, hook_module=hook)
    hook.compute = compute
    assert hook.calls == [("install", ("host", True, 0, True, True, True, True)), ("enabled", (False, None))]
    compute.set_share(0.25)
    compute.set_share(1.0)
    assert hook.calls[2:] == [("enabled", (True, 0.25)), ("enabled", (False, 0.25))]
    assert compute.stats().share == 1.0


@needs_shim
def test_agent_applies_a_compute_share_through_the_runtime(tmp_path: Path) -> None:
    from tf_antman.agent import JobAgent
    from tf_antman.jobside import NativeActuator, NativeStatsSource
    from tf_antman.torch.compute import Compute

    core = _core_or_skip()
    lib = _shim.load()
    lib.antman_torch_reset_for_tests()
    try:
        mem = _shim.create(lib, _shim.shim_path(), "emulated", 0, 64 * MiB, 0, 0)
        hook = RecordingHook()
        rt = TorchRuntime(mem, Compute(core, 1.0, 0, on_cuda=False, hook_module=hook))
        hook.compute = rt.compute
        job_dir = tmp_path / "job"
        job_dir.mkdir()
        write_control(job_dir, Control(seq=1, compute_share=0.5))
        try:
            actuator = NativeActuator(rt, 0)  # type: ignore[arg-type]
        except TypeError:  # the steps branch's signature: (native, device, limits, received_at)
            from tf_antman.steps import MemoryLimits

            actuator = NativeActuator(rt, 0, MemoryLimits(rt), lambda: None)  # type: ignore[arg-type,call-arg]
        agent = JobAgent(job_dir, actuator, NativeStatsSource(rt, 0))  # type: ignore[arg-type]
        agent.start()
        agent.close()
        stats = read_stats(job_dir)
        assert stats is not None and stats.control_seq_applied == 1
        assert stats.compute_share == 0.5 and stats.achieved_share is not None
        assert ("enabled", (True, 0.5)) in hook.calls
    finally:
        lib.antman_torch_reset_for_tests()


@needs_shim
def test_a_find_spec_probe_before_import_does_not_use_up_the_hook(tmp_path: Path) -> None:
    # transformers and others call importlib.util.find_spec("torch") to see what is installed
    # before importing it; activation must still happen at the real import.
    site = stand_in.write(tmp_path / "site")
    job = run_py("import importlib.util\nassert importlib.util.find_spec('torch')\n"
                 "import tf_antman\nbefore = tf_antman.is_active()\n"
                 "import torch\nemit({'before': before, 'after': tf_antman.is_active()})\n",
                 timeout=120, PYTHONPATH=f"{site}{os.pathsep}{REPO}", ANTMAN_DEVICE="emulated")
    assert job.rc == 0, job.stderr
    assert job.result == {"before": False, "after": True}


@needs_shim
def test_a_torch_job_started_at_share_zero_reports_the_hold_at_exit(tmp_path: Path) -> None:
    # ANTMAN_COMPUTE_SHARE=0: the job's ops are held from the start until a larger share; the
    # agent counts on the runtime's clock and the exit report reads it. The real op manager with
    # a hook that gates nothing (no op runs here), through activate()'s compute_factory.
    _core_or_skip()
    site = stand_in.write(tmp_path / "site")
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    job = run_py(f"""
        import time
        import torch  # the stand-in; no ANTMAN_* variable is set: nothing is activated here
        import tf_antman
        from tf_antman import core
        from tf_antman.torch import activation
        from tf_antman.torch.compute import Compute

        class Hook:
            def install(self, *args): pass
            def set_enabled(self, enabled): pass

        env = {{"ANTMAN_DEVICE": "emulated", "ANTMAN_DEVICE_MEMORY": "64MiB", "ANTMAN_HOST_MEMORY": "64MiB",
               "ANTMAN_COMPUTE_SHARE": "0", "ANTMAN_JOB_DIR": {str(job_dir)!r}}}
        state = activation.activate(env, torch=torch, compute_factory=lambda ts: Compute(
            core.load(), ts.base.compute_share, 0, on_cuda=False, hook_module=Hook()))
        time.sleep(0.3)
        tf_antman.set_compute_share(1.0)
        emit({{"one_clock": state.steps.agent.hold_clock is state.native.holds,
              "held": state.native.holds.seconds}})
        time.sleep(0.3)  # running at share 1 until exit: not held
    """, timeout=120, PYTHONPATH=f"{site}{os.pathsep}{REPO}")
    assert job.rc == 0, job.stderr
    out = job.result
    assert out["one_clock"] and 0.3 <= out["held"] < 5.0
    paused = re.search(r"at exit: .*; paused (\d+\.\d) s;", job.stderr)
    assert paused is not None, job.stderr
    assert float(paused.group(1)) == round(out["held"], 1)  # the hold ended before exit: it stands


def test_launchers_are_recognised_by_script_or_module(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from tf_antman import jobside

    main = SimpleNamespace(__spec__=None)
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "orig_argv", ["python", "train.py"])
    for argv0, expected in (("/venv/bin/torchrun", "torchrun"), ("accelerate", "accelerate"),
                            ("train.py", None), ("/venv/bin/torchrun.py", None), ("", None)):
        monkeypatch.setattr(sys, "argv", [argv0])
        assert jobside.launcher_name() == expected, argv0
    main.__spec__ = SimpleNamespace(name="torch.distributed.run")  # python -m torch.distributed.run
    assert jobside.launcher_name() == "python -m torch.distributed.run"
    main.__spec__ = SimpleNamespace(name="train")
    assert jobside.launcher_name() is None


def test_python_m_launchers_are_recognised_while_their_parent_package_imports(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # `python -m torch.distributed.run` imports torch (and activates tf-antman) before __main__
    # and sys.argv say what runs: argv is ['-m'] then, so the interpreter's own line is read.
    from types import SimpleNamespace

    from tf_antman import jobside

    monkeypatch.setitem(sys.modules, "__main__", SimpleNamespace(__spec__=None))
    monkeypatch.setattr(sys, "argv", ["-m"])
    for orig_argv, expected in (
            (["python", "-m", "torch.distributed.run", "--nproc_per_node=2", "ddp.py"], "torch.distributed.run"),
            (["python3", "-u", "-W", "ignore", "-X", "dev", "-m", "torch.distributed.launch"], "torch.distributed.launch"),
            (["python", "-um", "torch.distributed.run"], "torch.distributed.run"),
            (["python", "-mtorch.distributed.run"], "torch.distributed.run"),
            (["python", "-Wignore", "-m", "deepspeed.launcher.runner"], "deepspeed.launcher.runner"),
            (["python", "-m", "train"], None),
            (["python", "ddp.py", "-m", "torch.distributed.run"], None),  # the script's own arguments
            (["python", "-c", "import torch", "-m", "torch.distributed.run"], None)):
        monkeypatch.setattr(sys, "orig_argv", orig_argv)
        name = jobside.launcher_name()
        assert name == (None if expected is None else f"python -m {expected}"), orig_argv
