"""Triton kernels for drop_h with an FP8-saved preactivation (format: ``kernels.fp8_format``).

Forward reads the [M, 2F] preactivation once and writes h, the e4m3 copy and its per-block
scales in that pass. Backward reads the e4m3 copy (dequantized in registers) with grad_h and
writes grad_preact into a fresh buffer, and h over grad_h. grad_preact cannot go in place: it
is 2 bytes (bf16/fp16) or 4 (fp32) per element, the FP8 copy 1.

A program covers BLOCK_M rows and BLOCK_N columns (a power-of-two multiple of the 128-column
scale block) of each half, held as [BLOCK_M, BLOCK_N / 128, 128] so that each block's absolute
max is one reduction over the last axis in registers. The tile follows the swiglu kernels' rule
(``fp8_tile``): as many columns of a row as the element budget allows, then rows.

Arithmetic is fp32 after the loads. The scale is amax / 448 (an IEEE division, ``div_rn``)
rounded up to bf16 on its bits; quantization multiplies by 1 / scale (one more ``div_rn`` per
row block) and saturates at ±448 keeping NaN (the conversion's ``satfinite`` on CUDA, a clamp
under the interpreter), so ``ops.fp8_saved.quantize`` computes the same bytes in torch.
Scales travel as their int16 bits (the interpreter's bf16 conversions are inexact). Restored
values saturate at fp32's max. A NaN or inf anywhere in a block makes the whole block NaN
(amax is NaN or inf, so the scale is NaN or inf, and 1 / scale 0): a non-finite
preactivation gives non-finite gradients.

The interpreter (``TRITON_INTERPRET=1``) converts fp32 -> fp8 by truncating with a half-up
carry, and NaN to and from finite codes; under it (only: constexpr ``INTERPRET``) values are
rounded to nearest-even on the e4m3 grid first, where its conversion is exact, and NaN's code
is set and read by hand. On CUDA the conversion is the hardware's (``cvt.rn.satfinite``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from swiglu_train.kernels.fp8_format import (
    BLOCK,
    E4M3_MAX,
    FP8_DTYPE,
    FP32_MAX,
    MIN_AMAX,
    SCALE_DTYPE,
    saved_shapes,
)
from swiglu_train.kernels.runtime import INTERPRET, SUPPORTED_DTYPES
from swiglu_train.kernels.swiglu import (
    BWD_TILE,
    AmaxPartials,
    _check_like,
    _check_preact,
    _silu_times_up,
    store_grad_amaxes,
    store_h_amax,
    tile,
)

_BLOCK: tl.constexpr = tl.constexpr(BLOCK)
_MAX: tl.constexpr = tl.constexpr(E4M3_MAX)
_MIN_AMAX: tl.constexpr = tl.constexpr(MIN_AMAX)
_FP32_MAX: tl.constexpr = tl.constexpr(FP32_MAX)
_NAN_CODE: tl.constexpr = tl.constexpr(0x7F)  # e4m3fn's and e5m2's NaN, either sign bit
_E5M2_MAX: tl.constexpr = tl.constexpr(57344.0)


@triton.jit
def _max_keep_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def round_to_fp8_grid(v, LOW_BITS: tl.constexpr, SUB_MAGIC: tl.constexpr, MIN_NORMAL: tl.constexpr):
    """v (within the format's max, or NaN) rounded to nearest-even on an fp8 grid, in fp32:
    fp32's low LOW_BITS mantissa bits cleared for |v| >= MIN_NORMAL; below, multiples of the
    subnormal step, which is fp32's ulp at SUB_MAGIC (1.5 · 2**k), so adding and subtracting it
    rounds there."""
    bits = v.to(tl.int32, bitcast=True)
    half: tl.constexpr = (1 << (LOW_BITS - 1)) - 1
    normal = (bits + half + ((bits >> LOW_BITS) & 1)) & -(1 << LOW_BITS)
    mag = tl.abs(v)
    sub = ((mag + SUB_MAGIC) - SUB_MAGIC).to(tl.int32, bitcast=True)
    sub = sub | (bits & -2147483648)  # the sign bit, for -0 too
    rounded = tl.where(mag < MIN_NORMAL, sub, normal).to(tl.float32, bitcast=True)
    return tl.where(v != v, v, rounded)


@triton.jit
def _round_e4m3(v):
    """e4m3: 3 mantissa bits for |v| >= 2**-6, multiples of 2**-9 below (its subnormals)."""
    return round_to_fp8_grid(v, 20, 24576.0, 0.015625)


@triton.jit
def _block_tile(pid, M, F, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A flat program id's rows [BLOCK_M, 1, 1], columns [1, S, 128] (S = BLOCK_N / 128 scale
    blocks), their mask, the scale columns [1, S, 1] with theirs, and the scale blocks per row
    of each half (where up's scales start)."""
    SCALES: tl.constexpr = BLOCK_N // _BLOCK
    tiles_n = tl.cdiv(F, BLOCK_N)
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None, None]
    blocks = (pid_n * SCALES + tl.arange(0, SCALES))[None, :, None]
    cols = blocks * _BLOCK + tl.arange(0, _BLOCK)[None, None, :]
    nb = tl.cdiv(F, _BLOCK)
    return rows, cols, (rows < M) & (cols < F), blocks, (rows < M) & (blocks < nb), nb


@triton.jit
def fp8_code(q, E5M2: tl.constexpr, INTERPRET: tl.constexpr):
    """The e4m3 (or E5M2: e5m2) byte of each fp32 q: saturated to the format's max, NaN kept,
    rounded to nearest-even. On CUDA the conversion does all three for e4m3 (``satfinite``);
    e5m2 is clamped first. The interpreter's conversion is exact on the grid only, and maps NaN
    to a finite code, so there the rounding and NaN's code are done by hand."""
    if E5M2:
        q = tl.maximum(q, -_E5M2_MAX, propagate_nan=tl.PropagateNan.ALL)
        q = tl.minimum(q, _E5M2_MAX, propagate_nan=tl.PropagateNan.ALL)
        if INTERPRET:
            q = round_to_fp8_grid(q, 21, 192.0, 6.103515625e-05)  # 2**-16 steps below 2**-14
        code = q.to(tl.float8e5, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    else:
        if INTERPRET:
            q = tl.maximum(q, -_MAX, propagate_nan=tl.PropagateNan.ALL)
            q = tl.minimum(q, _MAX, propagate_nan=tl.PropagateNan.ALL)
            q = _round_e4m3(q)
        code = q.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    if INTERPRET:
        code = tl.where(q != q, _NAN_CODE, code).to(tl.uint8)
    return code


@triton.jit
def e4m3_code(q, INTERPRET: tl.constexpr):
    """The e4m3 byte of each fp32 q (``fp8_code``)."""
    return fp8_code(q, False, INTERPRET)


@triton.jit
def _quantize_store(v, q_ptrs, scale_ptrs, mask, scale_mask, INTERPRET: tl.constexpr):
    """Store v [BLOCK_M, S, 128] as e4m3 bytes and one bf16 scale per row and block (amax /
    448, rounded up)."""
    amax = tl.reduce(tl.abs(v), 2, _max_keep_nan, keep_dims=True)
    amax = tl.maximum(amax, _MIN_AMAX, propagate_nan=tl.PropagateNan.ALL)
    bits = tl.div_rn(amax, tl.full(amax.shape, _MAX, tl.float32)).to(tl.int32, bitcast=True)
    up = ((bits & 0xFFFF) != 0).to(tl.int32) << 16  # round up to bf16: block max <= 448
    scale = tl.where(amax != amax, amax, ((bits & -65536) + up).to(tl.float32, bitcast=True))
    q = v * tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    tl.store(q_ptrs, e4m3_code(q, INTERPRET), mask=mask)
    scale_bits = (scale.to(tl.int32, bitcast=True) >> 16).to(tl.int16)  # exact: low bits 0
    tl.store(scale_ptrs, scale_bits, mask=scale_mask)


@triton.jit
def _dequantize(q_ptrs, scale_ptrs, mask, scale_mask, INTERPRET: tl.constexpr):
    code = tl.load(q_ptrs, mask=mask, other=0)
    v = code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    if INTERPRET:
        v = tl.where((code & 0x7F) == _NAN_CODE, float("nan"), v)
    scale_bits = tl.load(scale_ptrs, mask=scale_mask, other=0x3F80).to(tl.int32)  # bf16 1.0
    v = v * (scale_bits << 16).to(tl.float32, bitcast=True)
    v = tl.minimum(v, _FP32_MAX, propagate_nan=tl.PropagateNan.ALL)
    return tl.maximum(v, -_FP32_MAX, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _swiglu_fwd_fp8_kernel(
    preact_ptr,
    h_ptr,
    q_ptr,
    scale_ptr,
    M,
    F,
    stride_preact,
    stride_h,
    stride_q,
    stride_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """h = silu(gate) * up, and the preact as e4m3 bytes with one scale per row per block."""
    rows, cols, mask, blocks, scale_mask, nb = _block_tile(tl.program_id(0), M, F, BLOCK_M, BLOCK_N)
    gate_ptrs = preact_ptr + rows * stride_preact + cols
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + F, mask=mask, other=0.0).to(tl.float32)
    h = _silu_times_up(gate, up, h_ptr.dtype.element_ty)
    tl.store(h_ptr + rows * stride_h + cols, h.to(h_ptr.dtype.element_ty), mask=mask)
    q_ptrs = q_ptr + rows * stride_q + cols
    scale_ptrs = scale_ptr + rows * stride_scale + blocks
    _quantize_store(gate, q_ptrs, scale_ptrs, mask, scale_mask, INTERPRET)
    _quantize_store(up, q_ptrs + F, scale_ptrs + nb, mask, scale_mask, INTERPRET)


@triton.jit
def _swiglu_bwd_fp8_kernel(
    q_ptr,
    scale_ptr,
    grad_h_ptr,
    grad_preact_ptr,
    tensor_amax_ptr,
    row_amax_ptr,
    M,
    F,
    stride_q,
    stride_scale,
    stride_grad_h,
    stride_grad_preact,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr,
    TENSOR_AMAX: tl.constexpr,
    ROW_AMAX: tl.constexpr,
):
    """grad_preact = [grad_h*up*silu'(gate) | grad_h*silu(gate)] from the dequantized preact,
    and h over grad_h, stored through the pointers grad_h was loaded from; and the amaxes of
    what it stored, as ``swiglu._swiglu_bwd_kernel`` finds them (TENSOR_AMAX, ROW_AMAX)."""
    rows, cols, mask, blocks, scale_mask, nb = _block_tile(tl.program_id(0), M, F, BLOCK_M, BLOCK_N)
    q_ptrs = q_ptr + rows * stride_q + cols
    scale_ptrs = scale_ptr + rows * stride_scale + blocks
    gate = _dequantize(q_ptrs, scale_ptrs, mask, scale_mask, INTERPRET)
    up = _dequantize(q_ptrs + F, scale_ptrs + nb, mask, scale_mask, INTERPRET)
    grad_h_ptrs = grad_h_ptr + rows * stride_grad_h + cols
    out_ptrs = grad_preact_ptr + rows * stride_grad_preact + cols
    grad_gate, grad_up, h = recompute_store(gate, up, grad_h_ptrs, out_ptrs, F, mask)
    if TENSOR_AMAX or ROW_AMAX:  # on [BLOCK_M, BLOCK_N] views of the [BLOCK_M, S, 128] tile
        mask2 = tl.reshape(mask, (BLOCK_M, BLOCK_N))
        if TENSOR_AMAX:
            store_h_amax(tl.reshape(h, (BLOCK_M, BLOCK_N)), mask2, tensor_amax_ptr)
        store_grad_amaxes(
            tl.reshape(grad_gate, (BLOCK_M, BLOCK_N)), tl.reshape(grad_up, (BLOCK_M, BLOCK_N)),
            mask2, tl.reshape(rows, (BLOCK_M, 1)), M, tl.cdiv(F, BLOCK_N), tensor_amax_ptr,
            row_amax_ptr, TENSOR_AMAX, ROW_AMAX,
        )  # fmt: skip


@triton.jit
def recompute_store(gate, up, grad_h_ptrs, out_ptrs, F, mask):
    """From the restored gate and up: grad_preact's gate half at out_ptrs and its up half F
    further, and h over grad_h (read from and stored through grad_h_ptrs); returns the three
    as stored (gate half, up half, h)."""
    grad_h = tl.load(grad_h_ptrs, mask=mask).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    grad_up = grad_h * gate * sig
    grad_gate = grad_h * up * sig * (1.0 + gate * (1.0 - sig))
    dtype = grad_h_ptrs.dtype.element_ty
    h = _silu_times_up(gate, up, dtype).to(dtype)
    tl.store(grad_h_ptrs, h, mask=mask)
    out_dtype = out_ptrs.dtype.element_ty
    grad_gate, grad_up = grad_gate.to(out_dtype), grad_up.to(out_dtype)
    tl.store(out_ptrs, grad_gate, mask=mask)
    tl.store(out_ptrs + F, grad_up, mask=mask)
    return grad_gate, grad_up, h


def check_saved(
    q: torch.Tensor,
    scales: torch.Tensor,
    ref: torch.Tensor,
    m: int,
    ffn: int,
    shapes=saved_shapes,
    fmt: str = "",
) -> None:
    """A ValueError naming the tensor unless q and scales are a copy of a [m, 2 * ffn]
    preactivation on ref's device, with the value and scale shapes ``shapes`` gives (``fmt``
    names a format other than the canonical one in the message)."""
    q_shape, scale_shape = shapes(m, ffn)
    for name, t, shape, dtype in (
        ("q", q, q_shape, FP8_DTYPE),
        ("scales", scales, scale_shape, SCALE_DTYPE),
    ):
        if tuple(t.shape) != shape or t.dtype != dtype or (t.numel() and t.stride(1) != 1):
            raise ValueError(
                f"{name} must be a row-major {dtype} {shape}{fmt}, got {t.dtype} "
                f"{tuple(t.shape)} {t.stride()}"
            )
        if t.device != ref.device:
            raise ValueError(f"{name} is on {t.device}, expected {ref.device}")


# (elements per program, warps) of the forward: 16 elements of each half per thread. On the H200
# 1 x 2048 over 4 warps ran at 0.96 and 0.89 of the copy bandwidth at [11136, 14336] and [8000,
# 11008], where drop_h's 1 x 1024 over 4 (8 a thread) ran at 0.83 and 0.80, and the 8 x 128
# tiles before at 0.82 and 0.79
# (benchmarks/results/activation/activation_bandwidth_fp8_tiles_h200): the
# quantization's block reductions and divisions hide the loads' latency only with more
# elements in flight a thread. 32 a thread spilled. The backward keeps BWD_TILE (1 x 2048 over
# 8 warps, 0.94 and 0.92; 16 a thread there ran at 0.86 and 0.80).
FP8_FWD_TILE = (2048, 4)
INTERPRET_TILE = (4, 2 * BLOCK)  # (BLOCK_M, BLOCK_N): CPU tests cross row, tile and block edges


@functools.lru_cache(maxsize=4096)
def fp8_tile(
    m: int, ffn: int, rule: tuple[int, int], interpret: bool = INTERPRET
) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): the swiglu kernels' tile for the rule's element budget,
    its columns widened to whole scale blocks (rows shrink to keep the budget)."""
    if interpret:
        return (*INTERPRET_TILE, 1)
    _, block_n, warps = tile(m, ffn, rule, interpret=False)
    block_n = max(block_n, BLOCK)
    return min(max(rule[0] // block_n, 1), triton.next_power_of_2(m)), block_n, warps


def _launch(kernel, m: int, ffn: int, rule: tuple[int, int], *args) -> None:
    """One launch over a 1D grid of ``fp8_tile``'s tiles."""
    block_m, block_n, warps = fp8_tile(m, ffn, rule)
    grid = (-(-m // block_m) * -(-ffn // block_n),)  # not triton.cdiv: ~3 us of host time
    kernel[grid](*args, BLOCK_M=block_m, BLOCK_N=block_n, INTERPRET=INTERPRET, num_warps=warps)


def swiglu_forward_fp8(
    preact: torch.Tensor, h: torch.Tensor, q: torch.Tensor, scales: torch.Tensor
) -> None:
    """Write h, the e4m3 copy of ``preact`` and its scales into the given buffers."""
    m, ffn = _check_preact(preact)
    _check_like("h", h, preact, (m, ffn))
    check_saved(q, scales, preact, m, ffn)
    if m == 0:
        return
    code = q.view(torch.uint8)  # bytes: the interpreter's own fp8 conversion is inexact
    scale_bits = scales.view(torch.int16)  # likewise its bf16 one
    _launch(
        _swiglu_fwd_fp8_kernel, m, ffn, FP8_FWD_TILE, preact, h, code, scale_bits, m, ffn,
        preact.stride(0), h.stride(0), code.stride(0), scale_bits.stride(0),
    )  # fmt: skip


def swiglu_backward_fp8(
    q: torch.Tensor,
    scales: torch.Tensor,
    grad_h: torch.Tensor,
    grad_preact: torch.Tensor,
    tensor_amax: bool = False,
    row_amax: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Write grad_preact [M, 2F] (a buffer of grad_h's dtype) and h over grad_h [M, F]; returns
    the amaxes of what it wrote, as ``swiglu.swiglu_backward`` does (None where not asked)."""
    if grad_h.dim() != 2 or grad_h.stride(1) != 1:
        raise ValueError(f"grad_h must be row-major [M, F], got {tuple(grad_h.shape)}")
    if grad_h.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"grad_h dtype must be one of {SUPPORTED_DTYPES}, got {grad_h.dtype}")
    m, ffn = grad_h.shape
    _check_like("grad_preact", grad_preact, grad_h, (m, 2 * ffn))
    check_saved(q, scales, grad_h, m, ffn)
    if m == 0:
        return None, None
    code, scale_bits = q.view(torch.uint8), scales.view(torch.int16)
    block_m, block_n, warps = fp8_tile(m, ffn, BWD_TILE)
    tiles_n = -(-ffn // block_n)
    programs = -(-m // block_m) * tiles_n
    partials = AmaxPartials.for_launch(grad_preact, programs, tiles_n, tensor_amax, row_amax)
    _swiglu_bwd_fp8_kernel[(programs,)](
        code, scale_bits, grad_h, grad_preact, *partials.pointers(grad_h), m, ffn,
        code.stride(0), scale_bits.stride(0), grad_h.stride(0), grad_preact.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, INTERPRET=INTERPRET, TENSOR_AMAX=tensor_amax,
        ROW_AMAX=row_amax, num_warps=warps,
    )  # fmt: skip
    return partials.reduced()
