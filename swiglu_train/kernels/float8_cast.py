"""torchao's dynamic float8 cast of a GEMM operand in two Triton passes, for FP8 GEMMs that run
outside torch.compile.

torchao casts an operand as: amax = max |t| (over the whole tensor, or per row or column along
the GEMM's contraction dim), scale = ``amax_to_scale(amax)``, bytes = ``fp32(t) · scale``
clamped to the format's max and rounded to nearest-even. Eager, that is six full-size kernels
(abs, amax, upcast, multiply, clamp, convert), and then ``torch._scaled_mm``'s layout (the
contraction dim contiguous in both operands) costs a copy for three of the six operands of an
MLP's step. Here one pass writes the amax and one writes the bytes, already in that layout; the
scale between them is torchao's own (``ops.float8_mlp``). The bytes are torchao's, bit for bit.

**amax.** A fixed number of programs (a few waves of the GPU's SMs) walk the row tiles, split
the contraction dim when the rows are too few to fill them, and combine with an atomic max on
the fp32 bits: |v|'s bits order as int32 for non-negative
floats, and NaN's (sign cleared) sort above inf's, so a NaN anywhere makes the amax NaN, as
``torch.amax`` does.

**Scale.** torchao's ``amax_to_scale`` is five eager kernels (to fp64, clamp, reciprocal,
multiply, to fp32) a cast, about sixty tiny launches an FP8 step; ``amax_to_scale`` here is one,
in the same order and precision, so the scale is torchao's bit for bit (its power-of-two rounding
goes through log2, which only torch's own kernel reproduces: that recipe keeps torchao's).

**Bytes.** ``swiglu_fp8.fp8_code``: on CUDA the hardware's conversion (round to nearest-even,
saturating), by hand under the interpreter, whose own conversion is exact on the grid only.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from swiglu_train.kernels.runtime import INTERPRET
from swiglu_train.kernels.swiglu_fp8 import fp8_code

ABS_BITS: tl.constexpr = tl.constexpr(0x7FFFFFFF)  # an fp32's bits without the sign: |v|
TILE_ELEMENTS = 4096  # per program: a tile of [BLOCK_O, BLOCK_K]
TRANSPOSE_TILE = 64  # square tiles where the input's contiguous dim is not the contraction dim
PROGRAMS_PER_SM = 8  # amax programs to aim for: several waves, so no SM idles at the tail
INTERPRET_TILE = 16
FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
AMAX_FLOOR = 1e-12  # torchao's float8_utils.EPS: amax_to_scale clamps the amax to it
SCALE_BLOCK = 1024


@triton.jit
def _amax_kernel(
    t_ptr, amax_ptr, OUTER, K, stride_o, stride_k, k_per_program,
    ROWWISE: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """amax[o] (ROWWISE) or amax[0] = max |t[o, k]| as int32 bits: a program walks row tiles
    pid, pid + programs, ... over its share of K, and combines with the other programs by an
    atomic max (one per row tile, or one in all where tensorwise: few on one address)."""
    k_lo = tl.program_id(1) * k_per_program
    k_hi = tl.minimum(k_lo + k_per_program, K)
    overall = tl.zeros((BLOCK_O,), tl.int32)
    for tile_o in range(tl.program_id(0), tl.cdiv(OUTER, BLOCK_O), tl.num_programs(0)):
        o = (tile_o * BLOCK_O + tl.arange(0, BLOCK_O)).to(tl.int64)
        best = tl.zeros((BLOCK_O,), tl.int32)
        for start in range(k_lo, k_hi, BLOCK_K):
            k = (start + tl.arange(0, BLOCK_K)).to(tl.int64)
            mask = (o[:, None] < OUTER) & (k[None, :] < k_hi)
            ptrs = t_ptr + o[:, None] * stride_o + k[None, :] * stride_k
            v = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            best = tl.maximum(best, tl.max(v.to(tl.int32, bitcast=True) & ABS_BITS, axis=1))
        if ROWWISE:
            tl.atomic_max(amax_ptr + o, best, mask=o < OUTER)
        else:
            overall = tl.maximum(overall, best)
    if not ROWWISE:
        tl.atomic_max(amax_ptr, tl.max(overall, axis=0))


@triton.jit
def _amax_both_kernel(
    t_ptr, rows_ptr, cols_ptr, R, C, stride_r, stride_c, rows_per_program, col_tiles,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """A program takes column tile pid % col_tiles over its group of rows (pid // col_tiles):
    each row tile's maxima go to rows[r, column tile], and its columns' maxima over all its
    rows to cols[group, c], as int32 bits; plain stores (each slot has one writer), which the
    caller reduces."""
    pid = tl.program_id(0)
    tile_c, group = pid % col_tiles, pid // col_tiles
    c = (tile_c * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    r_lo = group * rows_per_program
    r_hi = tl.minimum(r_lo + rows_per_program, R)
    col_best = tl.zeros((BLOCK_C,), tl.int32)
    for start in range(r_lo, r_hi, BLOCK_R):
        r = (start + tl.arange(0, BLOCK_R)).to(tl.int64)
        mask = (r[:, None] < r_hi) & (c[None, :] < C)
        ptrs = t_ptr + r[:, None] * stride_r + c[None, :] * stride_c
        v = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        bits = v.to(tl.int32, bitcast=True) & ABS_BITS
        tl.store(rows_ptr + r * col_tiles + tile_c, tl.max(bits, axis=1), mask=r < r_hi)
        col_best = tl.maximum(col_best, tl.max(bits, axis=0))
    tl.store(cols_ptr + group * C + c, col_best, mask=c < C)


@triton.jit
def _cast_kernel(
    t_ptr, scale_ptr, out_ptr, OUTER, K, stride_o, stride_k,
    ROWWISE: tl.constexpr, E5M2: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[o, k] (k contiguous) = fp8(fp32(t[o, k]) · scale[o or 0])."""
    tiles_k = tl.cdiv(K, BLOCK_K)
    o = ((tl.program_id(0) // tiles_k) * BLOCK_O + tl.arange(0, BLOCK_O)).to(tl.int64)[:, None]
    k = ((tl.program_id(0) % tiles_k) * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)[None, :]
    mask = (o < OUTER) & (k < K)
    v = tl.load(t_ptr + o * stride_o + k * stride_k, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + o, mask=o < OUTER, other=1.0) if ROWWISE else tl.load(scale_ptr)
    tl.store(out_ptr + o * K + k, fp8_code(v * scale, E5M2, INTERPRET), mask=mask)


@triton.jit
def _scale_kernel(
    amax_ptr, scale_ptr, N, FLOAT8_MAX: tl.constexpr, FLOOR: tl.constexpr, BLOCK: tl.constexpr
):
    """scale[i] = fp32(FLOAT8_MAX · (1 / max(fp64(amax[i]), FLOOR))), as torchao computes it: in
    fp64, a clamp that keeps NaN, reciprocal then product (``float / tensor`` in torch), one
    rounding to fp32. Constants are built as fp64: a Python float literal would be fp32."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(amax_ptr + i, mask=i < N, other=1.0).to(tl.float64)
    floor = tl.full((BLOCK,), FLOOR, tl.float64)
    a = tl.where(a < floor, floor, a)
    reciprocal = tl.full((BLOCK,), 1.0, tl.float64) / a  # fp64 division rounds correctly
    scale = reciprocal * tl.full((BLOCK,), FLOAT8_MAX, tl.float64)
    tl.store(scale_ptr + i, scale.to(tl.float32), mask=i < N)


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torchao's ``amax_to_scale(amax, dtype)`` (no power-of-two rounding) in one launch: fp32
    scales shaped as the fp32 ``amax`` (0-dim, or one per row or column)."""
    amax = amax.contiguous()
    scale = torch.empty(amax.shape, device=amax.device, dtype=torch.float32)
    n = amax.numel()
    block = min(SCALE_BLOCK, triton.next_power_of_2(max(n, 1)))
    _scale_kernel[(triton.cdiv(n, block),)](
        amax, scale, n, FLOAT8_MAX=torch.finfo(dtype).max, FLOOR=AMAX_FLOOR, BLOCK=block
    )
    return scale


@functools.lru_cache(maxsize=1024)
def _tile(outer: int, k: int, k_contiguous: bool, interpret: bool = INTERPRET) -> tuple[int, int]:
    """(BLOCK_O, BLOCK_K): long along the input's contiguous dim, so loads coalesce; square
    where the bytes are written across it (a transpose through shared memory)."""
    if interpret:
        return INTERPRET_TILE, INTERPRET_TILE
    if not k_contiguous:
        return TRANSPOSE_TILE, TRANSPOSE_TILE
    block_k = min(triton.next_power_of_2(k), 1024)
    return max(1, TILE_ELEMENTS // block_k), block_k


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    return (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 4
    )


def _as_outer_k(t: torch.Tensor, dim: int) -> tuple[int, int, int, int]:
    """(OUTER, K, stride_o, stride_k) of a 2D ``t`` contracted over ``dim``."""
    dim = dim % 2
    return t.shape[1 - dim], t.shape[dim], t.stride(1 - dim), t.stride(dim)


def amax(t: torch.Tensor, dim: int, rowwise: bool) -> torch.Tensor:
    """fp32 max |t| of a non-empty 2D ``t``: along ``dim`` (keepdim, as ``torch.amax``) when
    ``rowwise``, else over all of it (0-dim, as ``torch.max``)."""
    outer, k, stride_o, stride_k = _as_outer_k(t, dim)
    block_o, block_k = _tile(outer, k, stride_k == 1)
    tiles_o, tiles_k = triton.cdiv(outer, block_o), triton.cdiv(k, block_k)
    programs = PROGRAMS_PER_SM * _sm_count(t.device)
    splits = max(1, min(tiles_k, triton.cdiv(programs, tiles_o)))  # K split where rows are few
    k_per_program = triton.cdiv(tiles_k, splits) * block_k
    bits = torch.zeros(outer if rowwise else 1, device=t.device, dtype=torch.int32)
    grid = (min(tiles_o, programs), triton.cdiv(k, k_per_program))
    _amax_kernel[grid](
        t, bits, outer, k, stride_o, stride_k, k_per_program,
        ROWWISE=rowwise, BLOCK_O=block_o, BLOCK_K=block_k,
    )  # fmt: skip
    found = bits.view(torch.float32)
    return found.unsqueeze(dim % 2) if rowwise else found.reshape(())


def amax_both(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 max |t| per row [R, 1], per column [1, C]) of a non-empty 2D ``t`` in one read: the
    amaxes of its two rowwise casts, contracting its columns and its rows, as ``amax`` gives
    each. The tile runs along the contiguous dim; a program walks a group of rows, so its
    column maxima are one store per group, not per row tile."""
    if t.stride(0) == 1 and t.stride(1) != 1:  # column-major: the rows of its transpose
        per_column, per_row = _amax_both(t.t())
        return per_row.t(), per_column.t()
    return _amax_both(t)


def _amax_both(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = t.shape
    block_r, block_c = (INTERPRET_TILE, INTERPRET_TILE) if INTERPRET else _both_tile(cols)
    col_tiles = triton.cdiv(cols, block_c)
    programs = PROGRAMS_PER_SM * _sm_count(t.device)
    groups = max(1, min(triton.cdiv(rows, block_r), triton.cdiv(programs, col_tiles)))
    rows_per_program = triton.cdiv(triton.cdiv(rows, groups), block_r) * block_r
    groups = triton.cdiv(rows, rows_per_program)
    row_bits = torch.empty(rows, col_tiles, device=t.device, dtype=torch.int32)
    col_bits = torch.empty(groups, cols, device=t.device, dtype=torch.int32)
    _amax_both_kernel[(groups * col_tiles,)](
        t, row_bits, col_bits, rows, cols, t.stride(0), t.stride(1), rows_per_program, col_tiles,
        BLOCK_R=block_r, BLOCK_C=block_c,
    )  # fmt: skip
    per_row = row_bits.amax(1, keepdim=True).view(torch.float32)
    return per_row, col_bits.amax(0, keepdim=True).view(torch.float32)


@functools.lru_cache(maxsize=1024)
def _both_tile(cols: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C): up to 256 columns a row (coalesced loads), TILE_ELEMENTS a tile."""
    block_c = min(triton.next_power_of_2(cols), 256)
    return max(1, TILE_ELEMENTS // block_c), block_c


def cast(t: torch.Tensor, scale: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """``t`` (2D) scaled and cast to ``dtype`` as torchao casts it, shaped as ``t`` with ``dim``
    contiguous: ``scale`` is fp32, 0-dim (tensorwise) or one per index of the other dim."""
    outer, k, stride_o, stride_k = _as_outer_k(t, dim)
    data = torch.empty(outer, k, device=t.device, dtype=dtype)
    block_o, block_k = _tile(outer, k, stride_k == 1)
    grid = (triton.cdiv(outer, block_o) * triton.cdiv(k, block_k),)
    _cast_kernel[grid](
        t, scale.contiguous(), data.view(torch.uint8), outer, k, stride_o, stride_k,
        ROWWISE=scale.numel() != 1, E5M2=dtype == torch.float8_e5m2, INTERPRET=INTERPRET,
        BLOCK_O=block_o, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return data if dim % 2 == 1 else data.t()
