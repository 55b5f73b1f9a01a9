"""Triton backward for the paired FP8 format (``fp8_format.PAIRED_GROUP``): drop_h_quack's copy.

The copy keeps quack's column order, [g0, u0, g1, u1, ...], with one bf16 scale per 128 of
those columns (64 features' gate and up values), as quack's fc1 epilogue writes it
(``kernels.quack_fp8_epilogues``). A program loads whole groups of the copy as
[BLOCK_M, S, 128] bytes, dequantizes them against their scales in registers, splits each group
into its 64 gate and 64 up values, and writes grad_preact in the canonical [gate | up] order,
so the rest of backward is drop_h's FP8 backward (``ops.fp8_saved``) unchanged, and h over
grad_h. Dequantization is ``swiglu_fp8``'s (NaN codes read by hand under the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swiglu_train.kernels.fp8_format import (
    PAIRED_GROUP,
    paired_saved_shapes,
)
from swiglu_train.kernels.runtime import INTERPRET, SUPPORTED_DTYPES
from swiglu_train.kernels.swiglu import BWD_TILE, _check_like
from swiglu_train.kernels.swiglu_fp8 import _dequantize, check_saved, fp8_tile, recompute_store

_GROUP: tl.constexpr = tl.constexpr(PAIRED_GROUP)
_HALF: tl.constexpr = tl.constexpr(PAIRED_GROUP // 2)


@triton.jit
def _swiglu_bwd_fp8_paired_kernel(
    q_ptr,
    scale_ptr,
    grad_h_ptr,
    grad_preact_ptr,
    M,
    F,
    stride_q,
    stride_scale,
    stride_grad_h,
    stride_grad_preact,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """BLOCK_M rows and BLOCK_N features: grad_preact [gate | up] and h over grad_h."""
    GROUPS: tl.constexpr = BLOCK_N // _HALF
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(F, BLOCK_N)
    pid_m, pid_n = pid // tiles_n, pid % tiles_n
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None, None]
    groups = (pid_n * GROUPS + tl.arange(0, GROUPS))[None, :, None]
    n_groups = F // _HALF
    group_mask = (rows < M) & (groups < n_groups)
    q_ptrs = q_ptr + rows * stride_q + groups * _GROUP + tl.arange(0, _GROUP)[None, None, :]
    scale_ptrs = scale_ptr + rows * stride_scale + groups
    mask = tl.broadcast_to(group_mask, (BLOCK_M, GROUPS, _GROUP))
    pairs = _dequantize(q_ptrs, scale_ptrs, mask, group_mask, INTERPRET)
    gate, up = tl.split(tl.reshape(pairs, (BLOCK_M, GROUPS, _HALF, 2)))

    cols = groups * _HALF + tl.arange(0, _HALF)[None, None, :]
    col_mask = group_mask & (cols < F)
    grad_h_ptrs = grad_h_ptr + rows * stride_grad_h + cols
    out_ptrs = grad_preact_ptr + rows * stride_grad_preact + cols
    recompute_store(gate, up, grad_h_ptrs, out_ptrs, F, col_mask)


def swiglu_backward_fp8_paired(
    q: torch.Tensor, scales: torch.Tensor, grad_h: torch.Tensor, grad_preact: torch.Tensor
) -> None:
    """Write grad_preact [M, 2F] ([gate | up], grad_h's dtype) and h over grad_h [M, F] from
    a paired copy."""
    if grad_h.dim() != 2 or grad_h.stride(1) != 1:
        raise ValueError(f"grad_h must be row-major [M, F], got {tuple(grad_h.shape)}")
    if grad_h.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"grad_h dtype must be one of {SUPPORTED_DTYPES}, got {grad_h.dtype}")
    m, ffn = grad_h.shape
    _check_like("grad_preact", grad_preact, grad_h, (m, 2 * ffn))
    check_saved(q, scales, grad_h, m, ffn, paired_saved_shapes, " (the paired FP8 format)")
    if m == 0:
        return
    block_m, block_n, warps = fp8_tile(m, ffn, BWD_TILE)
    grid = (-(-m // block_m) * -(-ffn // block_n),)
    code, scale_bits = q.view(torch.uint8), scales.view(torch.int16)
    _swiglu_bwd_fp8_paired_kernel[grid](
        code, scale_bits, grad_h, grad_preact, m, ffn, code.stride(0), scale_bits.stride(0),
        grad_h.stride(0), grad_preact.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
        INTERPRET=INTERPRET, num_warps=warps,
    )  # fmt: skip
