"""h cast to e4m3 for an FP8 GEMM straight from the preactivation, so h is never written in bf16.

fc2's FP8 GEMM takes h scaled and cast as torchao's dynamic recipes say: scale = 448 / amax(h),
over the whole tensor (tensorwise) or per row (rowwise), then ``clamp(h · scale, ±448)``
rounded to nearest-even e4m3. torch would write h [M, F] in bf16 and read it twice (its amax,
its cast). Here two passes read the preactivation instead: the first writes each row's amax of
h, the second recomputes h, scales and casts it, writing one byte an element. h is the forward
kernel's, bit for bit (``swiglu._silu_times_up``, rounded to the preactivation's dtype), so the
bytes are those torchao's cast of that h gives; the scale between the passes is torchao's own
``amax_to_scale`` (``ops.float8_mlp``).

The bytes are ``swiglu_fp8.e4m3_code``'s: on CUDA the hardware's conversion
(``cvt.rn.satfinite``, saturating to ±448 as torchao's clamp does), under the interpreter the
same by hand.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swiglu_train.kernels.runtime import INTERPRET
from swiglu_train.kernels.swiglu import FWD_TILE, _silu_times_up, _tile, launch_config
from swiglu_train.kernels.swiglu_fp8 import e4m3_code

AMAX_BLOCK_N = 1024  # columns a program reads at a time while it walks its rows' F


@triton.jit
def _h(preact_ptr, rows, cols, mask, stride, F, DTYPE: tl.constexpr):
    """h at (rows, cols), rounded to DTYPE as the forward kernel stores it, in fp32."""
    gate = tl.load(preact_ptr + rows * stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(preact_ptr + rows * stride + cols + F, mask=mask, other=0.0).to(tl.float32)
    return _silu_times_up(gate, up, DTYPE).to(DTYPE).to(tl.float32)


@triton.jit
def _row_amax_kernel(
    preact_ptr, amax_ptr, M, F, stride, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """amax[r] = max |h[r, :]| (NaN if any is), a program per BLOCK_M rows walking F."""
    row = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rows = row[:, None]
    amax = tl.zeros((BLOCK_M,), tl.float32)
    for start in range(0, F, BLOCK_N):
        cols = (start + tl.arange(0, BLOCK_N))[None, :]
        mask = (rows < M) & (cols < F)
        h = _h(preact_ptr, rows, cols, mask, stride, F, preact_ptr.dtype.element_ty)
        block = tl.max(tl.where(mask, tl.abs(h), 0.0), axis=1)
        nan = tl.max(tl.where(mask & (h != h), 1, 0), axis=1) > 0
        amax = tl.where(nan | (amax != amax), float("nan"), tl.maximum(amax, block))
    tl.store(amax_ptr + row, amax, mask=row < M)


@triton.jit
def _cast_kernel(
    preact_ptr,
    scale_ptr,
    out_ptr,
    M,
    F,
    stride,
    stride_out,
    ROWWISE: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """out = e4m3(clamp(h · scale, ±448)), scale per row (ROWWISE) or one for all, as bytes."""
    rows, cols, mask = _tile(tl.program_id(0), M, F, BLOCK_M, BLOCK_N)
    h = _h(preact_ptr, rows, cols, mask, stride, F, preact_ptr.dtype.element_ty)
    scale = tl.load(scale_ptr + rows, mask=rows < M) if ROWWISE else tl.load(scale_ptr)
    tl.store(out_ptr + rows * stride_out + cols, e4m3_code(h * scale, INTERPRET), mask=mask)


def swiglu_row_amax(preact: torch.Tensor) -> torch.Tensor:
    """[M] fp32: each row's max |h| of the [M, 2F] canonical preactivation, h not written."""
    m, f = preact.shape[0], preact.shape[1] // 2
    amax = torch.empty(m, device=preact.device, dtype=torch.float32)
    if m == 0:
        return amax
    block_n = 16 if INTERPRET else min(AMAX_BLOCK_N, triton.next_power_of_2(f))
    block_m = 16 if INTERPRET else max(1, FWD_TILE[0] // block_n)
    grid = (triton.cdiv(m, block_m),)
    _row_amax_kernel[grid](preact, amax, m, f, preact.stride(0), BLOCK_M=block_m, BLOCK_N=block_n)
    return amax


def swiglu_cast_e4m3(preact: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[M, F] float8_e4m3fn: h · scale saturated and rounded, h recomputed from ``preact``;
    ``scale`` is fp32, one element (tensorwise) or [M, 1] (rowwise)."""
    m, f = preact.shape[0], preact.shape[1] // 2
    out = torch.empty(m, f, device=preact.device, dtype=torch.float8_e4m3fn)
    if m == 0:
        return out
    rowwise = scale.numel() != 1
    grid, block_m, block_n, warps = launch_config(m, f, FWD_TILE)
    _cast_kernel[grid](
        preact, scale.contiguous(), out.view(torch.uint8), m, f, preact.stride(0), out.stride(0),
        ROWWISE=rowwise, INTERPRET=INTERPRET, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
    )  # fmt: skip
    return out
