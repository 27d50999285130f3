"""The PyTorch job's runtime: memory cores (libantman_torch.so) and compute scaling behind the
same calls as tf_antman.native.Native, so StepTracker, the job agent (jobside) and the public
tf_antman API serve PyTorch jobs unchanged."""

from __future__ import annotations

import dataclasses
import threading

from tf_antman.agent import ShareNotEnforced
from tf_antman.holds import SHARE_ZERO, HoldClock
from tf_antman.native import MemStats, NativeError
from tf_antman.torch._shim import TorchMemory
from tf_antman.torch.compute import Compute


@dataclasses.dataclass
class FixedShareStats:
    """op_stats() without compute scaling: the job runs at share 1, nothing is measured."""

    share: float = 1.0
    achieved_share_window: float = 1.0
    idle_inserted_ns: int = 0  # nothing held back (tf_antman.exit_report reads it)

    def as_dict(self) -> dict[str, float | int | bool]:
        return {"share": self.share, "achieved_share_window": self.achieved_share_window,
                "paused": False, "compute_scaling": False}


class ComputeScalingUnavailable(NativeError, ShareNotEnforced):
    """A share below 1 asked of a job without compute scaling."""


class TorchRuntime:
    def __init__(self, memory: TorchMemory, compute: Compute | None,
                 compute_unavailable: str = "", holds: HoldClock | None = None) -> None:
        self.memory = memory
        self.compute = compute
        self.compute_unavailable = compute_unavailable  # why there is no compute scaling
        # Time at compute share 0, whoever set it (exit report), as Native.holds; the agent adds
        # its step pauses. Compute holds ops from its creation (the hook is installed and enabled
        # below 1), so a start-up share of 0 (ANTMAN_COMPUTE_SHARE=0) holds from here.
        self.holds = HoldClock() if holds is None else holds
        self._share_lock = threading.Lock()  # share and hold clock change together (Native's)
        self.holds.set(SHARE_ZERO, float(self.op_stats().share) == 0.0)

    def mem_stats(self) -> MemStats:
        return self.memory.mem_stats()

    def op_stats(self) -> object:
        return self.compute.stats() if self.compute is not None else FixedShareStats()

    def request_limit(self, limit: int) -> None:
        self.memory.request_limit(limit)

    def set_limit_now(self, limit: int) -> tuple[int, int]:
        return self.memory.set_limit_now(limit)

    def release_cached(self) -> int:
        return self.memory.release_cached()

    def step_boundary(self) -> None:
        self.memory.step_boundary()

    def set_share(self, share: float) -> None:
        if not 0.0 <= share <= 1.0:  # also NaN
            raise NativeError(f"compute share {share!r} refused: accepted 0.0..1.0")
        if self.compute is None:
            if share < 1.0:
                # Refused, not ignored: the user gets the error, and a control's share is reported
                # not in force (stats keep share 1) while its memory limit is applied (agent.py).
                raise ComputeScalingUnavailable(f"compute scaling is unavailable in this job: {self.compute_unavailable}")
            return
        with self._share_lock:
            self.compute.set_share(share)
            self.holds.set(SHARE_ZERO, share == 0.0)

    def check_invariants(self) -> str:
        return self.memory.check_invariants()
