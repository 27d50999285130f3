"""Starting and observing one PyTorch job (bench/_torch_job.py) of bench/gpu_colocate.py: where
the jobs run and how long each phase lasts (Profile), the device and its free memory, a job's
environment (with the sitecustomize that activates tf-antman in it as the installed wheel
would), its start, its end (JCT, state, JSON line), and its step log (--log): the wait for its
first step, the steps in a window, steps/s.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

from _procs import forget, kill_group, start_child  # bench/_procs.py, beside this module

REPO = Path(__file__).resolve().parent.parent
JOB = [sys.executable, str(REPO / "bench" / "_torch_job.py")]
NO_GPU_EXIT = 77
GiB = 1 << 30
CPU_CAPACITY = 4 * GiB  # the emulated GPU of a CPU dry run (ANTMAN_DEVICE_MEMORY's default)
# NVML numbers GPUs by PCI bus, CUDA (unless told) fastest first: the bench reads NVML's GPU 0
# (memory, name) for the jobs' CUDA device 0, so both must mean the same GPU on a host of mixed
# GPUs. Set in this process before anything initialises CUDA (gpu_or_exit) and in every job's
# environment (env_for); ours wins over an inherited value.
CUDA_DEVICE_ORDER = "PCI_BUS_ID"


@dataclasses.dataclass(frozen=True)
class Profile:
    """Where the jobs run and how long each phase lasts."""

    device: str  # "cuda": a real GPU; "cpu": the dry run
    # part 1 (s): each solo run, the opportunistic jobs alone under the daemon, the RG's settling
    # time next to them, the co-located window measured
    windows: tuple[float, float, float, float]
    warmup_s: float  # steps dropped at the start of an opportunistic job's solo run
    round_s: float  # coordinator round
    table2: tuple[float, float, float, float]  # part 2: target JCT of A, of B, B's arrival, deadline (s)
    job_args: tuple[str, ...] = ()  # extra arguments of every bench/_torch_job.py run
    # part 2: the longest A may take from its start to its first completed step (PyTorch import,
    # op hook load, CUDA/cuDNN init, first step); B's arrival delay counts from that step
    first_step_s: float = 180.0

    @property
    def dry_run(self) -> bool:
        return self.device == "cpu"

    @property
    def antman_device(self) -> str:
        return "cuda" if self.device == "cuda" else "emulated"

    def antman_env(self) -> dict[str, str]:
        return {"ANTMAN_ENABLE": "1", "ANTMAN_DEVICE": self.antman_device}


BRIEF_BELOW_S = 300.0  # a --quick GPU run with a --budget below this uses the brief windows


def make_profile(device: str, quick: bool, budget_s: float | None = None) -> Profile:
    """`budget_s`: the run's hard budget (--budget); a --quick GPU run under BRIEF_BELOW_S gets
    halved windows (part 1 about 3 minutes on an H100 by estimate, not measured), so that the one
    GPU check's last step can finish a repeat in the time it has left."""
    if device == "cpu":
        # One thread per job: three jobs and the daemon share a small CPU. --quick: the test's.
        return Profile("cpu", (4, 3, 5, 6) if quick else (6, 4, 8, 10), 1 if quick else 2, 2,
                       (4.0, 3.0, 2.0, 60.0) if quick else (8.0, 6.0, 3.0, 60.0),
                       ("--device", "cpu", "--tiny", "--image", "32", "--threads", "1"), 120.0)
    if quick and budget_s is not None and budget_s < BRIEF_BELOW_S:
        return Profile("cuda", (10, 5, 10, 20), 5, 2, (30.0, 20.0, 10.0, 90.0))
    if quick:
        return Profile("cuda", (20, 10, 30, 40), 10, 2, (30.0, 20.0, 10.0, 90.0))
    return Profile("cuda", (40, 20, 60, 90), 10, 5, (120.0, 80.0, 40.0, 900.0))


def gpu_or_exit(device: str) -> tuple[int, str]:
    """Total memory of GPU 0 in bytes and its name; exits 77 with one line when there is no GPU
    (or, for the CPU dry run, no PyTorch)."""
    import importlib.util

    os.environ["CUDA_DEVICE_ORDER"] = CUDA_DEVICE_ORDER
    why = ""
    if importlib.util.find_spec("torch") is None:
        why = "PyTorch is not installed"
    elif device == "cpu":
        return CPU_CAPACITY, "cpu"
    else:
        try:
            import pynvml

            pynvml.nvmlInit()
            if pynvml.nvmlDeviceGetCount() > 0:
                handle = pynvml.nvmlDeviceGetHandleByIndex(0)
                name = pynvml.nvmlDeviceGetName(handle)
                name = name.decode() if isinstance(name, bytes) else str(name)
                return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total), name
            why = "NVML reports no GPU"
        except Exception as err:  # noqa: BLE001 - no driver, no pynvml: no GPU to measure on
            why = f"no NVIDIA GPU ({type(err).__name__}: {err})"
    print(f"gpu_colocate: skipped, {why}: nothing measured", flush=True)
    sys.exit(NO_GPU_EXIT)


def gpu_free(prof: Profile) -> int:
    if prof.dry_run:
        # The emulated GPU does not hold the jobs' CPU tensors: half of it stands in for what A
        # left free (the limit given to B bounds nothing in a dry run).
        return CPU_CAPACITY // 2
    import pynvml

    return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).free)


def env_for(antman: dict[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANTMAN_")}
    env.update(PYTHONUNBUFFERED="1")  # PYTHONPATH: set up by autoload_like_the_wheel()
    env.update(antman or {})
    env["CUDA_DEVICE_ORDER"] = CUDA_DEVICE_ORDER
    return env


@dataclasses.dataclass
class Started:
    """A job the bench started itself. Its stdout and stderr go to files, not pipes: nothing has
    to drain them while the bench waits on something else (a full pipe would stall the job)."""

    proc: subprocess.Popen[bytes]
    out: IO[bytes]
    err: IO[bytes]

    def output(self) -> tuple[str, str]:
        texts = []
        for f in (self.out, self.err):
            f.seek(0)
            texts.append(f.read().decode(errors="replace"))
            f.close()
        return texts[0], texts[1]


def start(prof: Profile, args: list[str], antman: dict[str, str] | None) -> Started:
    """Starts a job in a session of its own, listed by bench/_procs.py: killed with its group at
    its deadline, and at any exit of the bench."""
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    return Started(start_child([*JOB, *args, *prof.job_args], env=env_for(antman), stdout=out, stderr=err),
                   out, err)


def kill(job: Started) -> None:
    """SIGKILL to the job's process group; reaped and unlisted."""
    kill_group(job.proc)
    job.proc.wait()
    forget(job.proc)


def finish(job: Started, t0: float, deadline_s: float = 3600.0) -> tuple[float, str, dict]:
    """JCT, final state and the job's JSON line. A job still running `deadline_s` after t0 is
    killed and reported as unfinished (its JCT is then only a lower bound)."""
    p = job.proc
    try:
        p.wait(timeout=max(1.0, deadline_s - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        kill(job)
        job.output()
        return time.monotonic() - t0, f"unfinished after {deadline_s:.0f} s (killed)", {}
    forget(p)
    jct = time.monotonic() - t0
    out, err = job.output()
    result = next((json.loads(x) for x in reversed(out.splitlines()) if x.startswith("{")), {})
    if p.returncode == 0:
        return jct, "finished", result
    oom = "out of memory" in err.lower() or "OutOfMemoryError" in err
    return jct, "failed (OOM)" if oom else f"failed (rc {p.returncode}: {err.strip().splitlines()[-1:] or ''})", result


def wait_first_step(job: Started, log: Path, t0: float, timeout_s: float, what: str) -> float:
    """Seconds from t0 (the job's start) to its first completed step, the first line of its
    --log. A job that ends first or makes no step within `timeout_s` ends the bench, loudly (the
    job is killed): B's arrival assumes A has reached its peak memory."""
    deadline = t0 + timeout_s
    while not read_log(log):
        if job.proc.poll() is not None:
            forget(job.proc)
            _, err = job.output()
            raise SystemExit(f"gpu_colocate: {what}: A ended (rc {job.proc.returncode}) before its first step: "
                             f"{err.strip()[-1500:]}")
        if time.monotonic() >= deadline:
            kill(job)
            _, err = job.output()
            raise SystemExit(f"gpu_colocate: {what}: A made no step within {timeout_s:.0f} s of its start "
                             f"(killed); its stderr: {err.strip()[-1500:]}")
        time.sleep(0.05)
    return time.monotonic() - t0


def read_log(path: Path) -> list[tuple[float, float]]:
    if not path.exists():
        return []
    rows = []
    # Complete lines only: what follows the last newline may still be being written.
    for line in path.read_text().split("\n")[:-1]:
        t, ms = line.split()
        rows.append((float(t), float(ms)))
    return rows


def in_window(rows: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [r for r in rows if lo <= r[0] < hi]


def rate(rows: list[tuple[float, float]], lo: float, hi: float) -> float:
    return len(in_window(rows, lo, hi)) / (hi - lo) if hi > lo else 0.0


CHAIN_SITECUSTOMIZE = """
def _chain():
    import importlib.machinery, importlib.util, os, sys
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
_chain()
del _chain
"""


def autoload_like_the_wheel(tmp: Path) -> None:
    """Jobs activate tf-antman at `import torch` as with the installed wheel, whose .pth line
    runs at interpreter start. Here the package runs from the checkout (the wheel pins
    tensorflow, which GPU machines need not have), so the same line goes into a sitecustomize
    module on PYTHONPATH, which every job (also those the daemon starts) inherits. It runs the
    interpreter's own sitecustomize too, if there is one, since it shadows it."""
    site = write_sitecustomize(tmp)
    old = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), str(REPO), old) if p)


def write_sitecustomize(tmp: Path) -> Path:
    """tmp/site/sitecustomize.py with the wheel's .pth line (and the chain to the interpreter's
    own sitecustomize); returns tmp/site, the folder to put first on PYTHONPATH."""
    from tf_antman.importhook import PTH_LINE

    site = tmp / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(PTH_LINE + CHAIN_SITECUSTOMIZE)
    return site
