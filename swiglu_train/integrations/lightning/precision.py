"""The run's precision as Lightning takes it: pretrain, the planner and the e2e bench resolve
``auto`` the same way, and each imports it from here, below all of them."""

from __future__ import annotations

import torch


def resolve_precision(precision: str, accelerator: str = "auto") -> str:
    """``auto``: bf16-mixed where the run trains on a GPU, 32-true on the CPU."""
    if precision != "auto":
        return precision
    gpu = torch.cuda.is_available() and accelerator != "cpu"
    return "bf16-mixed" if gpu else "32-true"
