"""What the planners of both integrations share besides the decision (``memory.plan``): the
default memory budget, the candidate names, and how a peak was read."""

from __future__ import annotations

import torch

from swiglu_train.layers.registry import FP8_LABEL
from swiglu_train.memory.profiler import MiB

MARGIN = 0.05  # the default budget: the device's memory less 5 % (fragmentation, context)
ALLOCATOR = "cuda allocator peak"
ESTIMATE = "model state + saved-for-backward bytes (CPU estimate, no transients)"
LEAK_MiB = 512  # more than lazily made buffers (cuBLAS workspaces) explain; a model is GBs


def split_candidate(name: str) -> tuple[str, bool]:
    """('drop_h', True) for 'drop_h+fp8'; (name, False) otherwise."""
    return (name.removesuffix(FP8_LABEL), True) if name.endswith(FP8_LABEL) else (name, False)


def default_budget_MiB(device: torch.device, budget_gb: float | None) -> float:
    """``budget_gb`` in MiB, else the CUDA device's memory less MARGIN; a CPU plan needs one."""
    if budget_gb is not None:
        return budget_gb * 1024
    if device.type != "cuda":
        raise ValueError("a CPU plan needs an explicit memory budget (--memory-budget-gb)")
    return torch.cuda.get_device_properties(device).total_memory * (1 - MARGIN) / MiB


def check_freed(before: int, what: str) -> None:
    """Raise if CUDA memory did not come back to ``before`` bytes (within LEAK_MiB) once
    ``what`` (a measured model) was freed: peaks are absolute, so whatever it left behind
    would count in every later peak, and the plan would be wrong."""
    held = (torch.cuda.memory_allocated() - before) / MiB
    if held > LEAK_MiB:
        raise RuntimeError(f"the planner's {what} left {held:,.0f} MiB allocated after it was "
                           "freed: every later peak would count it, so the plan would be "
                           "wrong")  # fmt: skip
