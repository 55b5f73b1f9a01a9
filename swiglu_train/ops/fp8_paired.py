"""The paired FP8 format of drop_h_quack's saved preactivation, in torch, and its backward op.

quack's fc1 epilogue (``kernels.quack_fp8_epilogues``) writes the copy in quack's column
order, [g0, u0, g1, u1, ...], with one bf16 scale per ``PAIRED_GROUP`` (128) of those columns:
64 features' gate and up values share a scale, where the canonical format (``fp8_saved``)
gives each half its own per 128 columns. Same bytes per row (one e4m3 value per element, one
scale per 128), so the same memory; the scale is taken over a gate and an up block together.
Measured on the H200 at the model grid's 12 shapes, M = 8000 (benchmarks/measure_fp8_saved.py
--impl drop_h_quack, benchmarks/results/fp8/fp8_saved_errors_grid_quack_h200.json), relative error
against float64:

    input             saved as            grad_x         grad_W1        grad_W2
    random            bf16 (drop_h_quack) 0.30 %         0.30 %         0.35 %
                      paired e4m3         2.92 %         2.92-2.93 %    4.04 %
    8 features x50    paired e4m3         2.23-2.64 %    1.69-2.52 %    3.08-3.65 %
    8 tokens x30      paired e4m3         2.72-2.78 %    2.57-2.62 %    3.59-3.69 %

within 1.023x of the canonical format's errors on the same inputs: sharing a scale between a
gate and an up block costs little, since their magnitudes are alike. The torch functions here
are the reference the GPU tests hold the epilogue to, and the CPU path of the backward op.
"""

from __future__ import annotations

import torch

from swiglu_train.kernels.fp8_format import (
    E4M3_MAX,
    FP8_DTYPE,
    MIN_AMAX,
    PAIRED_GROUP,
    SCALE_DTYPE,
    paired_saved_shapes,
    restore,
    round_up_bf16,
)
from swiglu_train.ops.activation import triton_enabled
from swiglu_train.ops.eager import eager_op
from swiglu_train.ops.fp8_saved import recompute_from

try:
    from swiglu_train.kernels import swiglu_fp8_paired as kernels
except ImportError:  # no Triton on this platform: the torch path serves everything
    kernels = None


def interleave(canonical: torch.Tensor) -> torch.Tensor:
    """[..., 2F] in [gate | up] order -> quack's [g0, u0, g1, u1, ...] order."""
    ffn = canonical.shape[-1] // 2
    return canonical.unflatten(-1, (2, ffn)).transpose(-1, -2).flatten(-2)


def deinterleave(paired: torch.Tensor) -> torch.Tensor:
    """quack's [g0, u0, g1, u1, ...] order -> [gate | up]."""
    ffn = paired.shape[-1] // 2
    return paired.unflatten(-1, (ffn, 2)).transpose(-1, -2).flatten(-2)


def quantize_paired(paired: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values [M, 2F], bf16 scales [M, 2F / 128]) of a preactivation in quack's order:
    what the epilogue writes from its fp32 accumulator. Its max skips NaN (``fmax``), so a NaN
    stays a NaN of its own; an inf makes the group's scale inf."""
    m, n = paired.shape
    _, scale_shape = paired_saved_shapes(m, n // 2)  # refuses F not a multiple of 64
    groups = paired.float().view(m, n // PAIRED_GROUP, PAIRED_GROUP)
    magnitude = groups.abs()
    amax = magnitude.masked_fill(magnitude.isnan(), 0).amax(-1, keepdim=True).clamp_min(MIN_AMAX)
    scale = round_up_bf16(amax / torch.full_like(amax, E4M3_MAX))
    q = (groups * (torch.ones_like(scale) / scale)).clamp(-E4M3_MAX, E4M3_MAX)
    return q.view(m, n).to(FP8_DTYPE), scale.view(scale_shape).to(SCALE_DTYPE)


def dequantize_paired(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 [M, 2F] preactivation, in quack's order, that a paired copy stands for."""
    m, n = q.shape
    groups = q.float().view(m, n // PAIRED_GROUP, PAIRED_GROUP)
    return restore(groups, scales.float().unsqueeze(-1)).view(m, n)


@eager_op("swiglu_train::swiglu_bwd_fp8_paired_", mutates_args=("grad_h", "grad_preact"))
def swiglu_bwd_fp8_paired_(
    q: torch.Tensor, scales: torch.Tensor, grad_h: torch.Tensor, grad_preact: torch.Tensor
) -> None:
    """grad_preact [M, 2F] ([gate | up]) into the given buffer, and h over grad_h [M, F], from
    a paired copy (a chunk's rows)."""
    if not triton_enabled(grad_h):
        h, grad = recompute_from(deinterleave(dequantize_paired(q, scales)), grad_h)
        grad_h.copy_(h)
        grad_preact.copy_(grad)
        return
    kernels.swiglu_backward_fp8_paired(q, scales, grad_h, grad_preact)


@swiglu_bwd_fp8_paired_.register_fake
def _(q: torch.Tensor, scales: torch.Tensor, grad_h: torch.Tensor, grad_preact: torch.Tensor):
    return None
