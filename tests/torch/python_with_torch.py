"""The Python that runs PyTorch jobs in tests: $TF_ANTMAN_TORCH_PYTHON, else this interpreter if
it imports torch. CI installs no torch (docs/pytorch.md), so tests that need one skip there with
the reason; on the development machine TF_ANTMAN_TORCH_PYTHON=/work/torchvenv/bin/python."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

TORCH_PYTHON_VAR = "TF_ANTMAN_TORCH_PYTHON"


@functools.cache
def torch_python() -> tuple[str | None, str]:
    """A Python that can run a tf-antman PyTorch job, or None and why not."""
    candidate = os.environ.get(TORCH_PYTHON_VAR) or sys.executable
    if shutil.which(candidate) is None and not Path(candidate).is_file():
        return None, f"{TORCH_PYTHON_VAR}={candidate} is not an executable"
    probe = subprocess.run([candidate, "-c", "import torch, absl, watchdog; print(torch.__version__)"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        how = "" if os.environ.get(TORCH_PYTHON_VAR) else f" (set {TORCH_PYTHON_VAR} to a Python with torch)"
        return None, f"{candidate} cannot run a PyTorch job: {last}{how}"
    return candidate, probe.stdout.strip()
