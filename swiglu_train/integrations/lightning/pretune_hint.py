"""A line at the start of a run whose quack impls run GEMMs that no ``swiglu-train pretune``
timed on this GPU: they run on their default library, which is the faster one at most shapes
measured but not at every one, and the line gives the command that times them once.

Training itself never times anything (``ops.gemm_choice``); this only says what was not timed.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from lightning.pytorch.utilities import rank_zero_info

from swiglu_train.layers import ParMLP
from swiglu_train.ops import gemm_choice

# Lightning precision -> the dtype the MLP's GEMMs run in; the quack impls take no other
PRECISION_DTYPES = {"bf16": torch.bfloat16, "16": torch.float16}


def hints(
    layers: Iterable[tuple[str, int, int, int]],
    tokens: int,
    dtype: torch.dtype,
    device_name: str,
) -> list[str]:
    """One line per distinct (impl, D, F, O) with untimed GEMMs at ``tokens`` per micro-batch."""
    lines = []
    for impl, d, f, o in sorted(set(layers)):
        missing = gemm_choice.untimed(impl, (tokens, d, f, o), dtype, device_name)
        if not missing:
            continue
        out = "" if o == d else f" --output-size {o}"
        dtype_flag = "" if dtype == torch.bfloat16 else " --dtype fp16"
        lines.append(
            f"{impl} at [M, D, F] = [{tokens}, {d}, {f}]: {', '.join(missing)} run on their "
            f"default library, not timed on {device_name}; `swiglu-train pretune "
            f"--hidden-size {d} --ffn-hidden-size {f} --tokens {tokens}{out} --impls {impl}"
            f"{dtype_flag}` times them once, before a run"
        )
    return lines


def log_pretune_hints(module: torch.nn.Module, tokens: int, precision: str) -> None:
    """The hints for a built model, on CUDA in bf16 or fp16 (rank 0 prints them)."""
    dtype = PRECISION_DTYPES.get(precision.split("-")[0])
    if dtype is None or not torch.cuda.is_available():
        return
    layers = [
        (m.impl, m.fc1.in_features, m.fc2.in_features, m.fc2.out_features)
        for m in module.modules()
        if isinstance(m, ParMLP) and m.impl in gemm_choice.IMPL_GEMMS
    ]
    for line in hints(layers, tokens, dtype, torch.cuda.get_device_name()):
        rank_zero_info(line)
