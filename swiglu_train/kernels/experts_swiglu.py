"""Triton backward kernels of the routed experts' SwiGLU, with the router weight folded in.

The experts' rows are the token-expert slots sorted by expert: preact [R, 2F] canonical
[gate | up] per row, and g [R, F], the *unweighted* gradient of h (grad_y gathered to the
slots, times fc2). With w the slot's router weight applied to the expert output
(``y = Σ w · fc2(h)``), one pass over each row recomputes h and writes

    grad_preact = w · swiglu'(preact, g)     over preact (bf16) or into a buffer (FP8 copy)
    w · h                                    over g: grad_W2 = grad_yᵀ (w · h)
    grad_w = Σ_f g · h                       fp32, one value per row

so neither h nor the expert outputs are kept from forward, and the router weight's gradient
costs no extra pass over [R, F] or [R, D]. Without a weight (it scales the input instead, or
there is none) the kernel is drop_h's: grad_preact and h.

A program owns BLOCK_M whole rows and walks their F columns in BLOCK_N steps, so each row's
dot product is summed in one program, in a fixed order: grad_w is deterministic, which
atomics across column tiles would not be. The element budget per program is the swiglu
backward's (``BWD_TILE``: 2048 elements over 8 warps, measured there on the H200).
All arithmetic is fp32 after the loads; h is rounded as the forward's (``_silu_times_up``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from swiglu_train.kernels.fp8_format import BLOCK, saved_shapes
from swiglu_train.kernels.runtime import INTERPRET, SUPPORTED_DTYPES
from swiglu_train.kernels.swiglu import BWD_TILE, _silu_times_up
from swiglu_train.kernels.swiglu_fp8 import _dequantize, check_saved

_BLOCK: tl.constexpr = tl.constexpr(BLOCK)
# (BLOCK_M, BLOCK_N) under the interpreter: small, so CPU tests cross row and column tiles.
INTERPRET_TILE = (4, 16)
INTERPRET_TILE_FP8 = (4, BLOCK)


@triton.jit
def _grads(gate, up, g, w, dtype: tl.constexpr, WEIGHTED: tl.constexpr):
    """(grad_gate, grad_up, h to store, g·h) of one tile, weighted by w [rows, 1] if asked."""
    sig = 1.0 / (1.0 + tl.exp(-gate))
    grad_up = g * gate * sig
    grad_gate = g * up * sig * (1.0 + gate * (1.0 - sig))
    h = _silu_times_up(gate, up, dtype)
    gh = g * h
    if WEIGHTED:
        grad_up = grad_up * w
        grad_gate = grad_gate * w
        h = h * w
    return grad_gate, grad_up, h, gh


@triton.jit
def _experts_bwd_kernel(
    preact_ptr,
    g_ptr,
    w_ptr,
    grad_w_ptr,
    R,
    F,
    stride_preact,
    stride_g,
    WEIGHTED: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """In place: grad_preact over preact, (w ·) h over g, and grad_w when WEIGHTED. An
    INTERLEAVED preact holds feature f's gate and up at columns 2f and 2f + 1 (quack's gated
    epilogue writes it so): a tile is then [BLOCK_M, BLOCK_N, 2], one contiguous span per row."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rows < R
    w = tl.load(w_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None] if WEIGHTED else 1.0
    dot = tl.zeros([BLOCK_M], tl.float32)
    dtype = g_ptr.dtype.element_ty
    # Two assignments: a tuple of dtypes lowers in the interpreter but not for the GPU
    out_dtype = preact_ptr.dtype.element_ty
    pair = tl.arange(0, 2)[None, None, :]
    for start in range(0, F, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = row_ok[:, None] & (cols[None, :] < F)
        g_ptrs = g_ptr + rows[:, None] * stride_g + cols[None, :]
        if INTERLEAVED:
            pair_ptrs = preact_ptr + rows[:, None, None] * stride_preact + 2 * cols[None, :, None]
            pair_ptrs += pair
            pair_mask = mask[:, :, None] & (pair < 2)  # broadcast to the [.., .., 2] tile
            gate, up = tl.split(tl.load(pair_ptrs, mask=pair_mask, other=0.0).to(tl.float32))
        else:
            gate_ptrs = preact_ptr + rows[:, None] * stride_preact + cols[None, :]
            gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(gate_ptrs + F, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
        grad_gate, grad_up, h, gh = _grads(gate, up, g, w, dtype, WEIGHTED)
        dot += tl.sum(gh, axis=1)
        tl.store(g_ptrs, h.to(dtype), mask=mask)
        if INTERLEAVED:
            tl.store(pair_ptrs, tl.join(grad_gate, grad_up).to(out_dtype), mask=pair_mask)
        else:
            tl.store(gate_ptrs, grad_gate.to(out_dtype), mask=mask)
            tl.store(gate_ptrs + F, grad_up.to(out_dtype), mask=mask)
    if WEIGHTED:
        tl.store(grad_w_ptr + rows, dot, mask=row_ok)


@triton.jit
def _experts_bwd_fp8_kernel(
    q_ptr,
    scale_ptr,
    g_ptr,
    grad_preact_ptr,
    w_ptr,
    grad_w_ptr,
    R,
    F,
    stride_q,
    stride_scale,
    stride_g,
    stride_grad_preact,
    WEIGHTED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """From the e4m3 copy: grad_preact into its buffer, (w ·) h over g, grad_w if WEIGHTED.

    Tiles are [BLOCK_M, BLOCK_N / 128, 128], so each 128-column scale block is one slice.
    """
    SCALES: tl.constexpr = BLOCK_N // _BLOCK
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None, None]
    row_ok = rows < R
    w = tl.load(w_ptr + rows, mask=row_ok, other=0.0).to(tl.float32) if WEIGHTED else 1.0
    nb = tl.cdiv(F, _BLOCK)
    dot = tl.zeros([BLOCK_M, 1, 1], tl.float32)
    dtype = g_ptr.dtype.element_ty
    for start in range(0, nb, SCALES):
        blocks = (start + tl.arange(0, SCALES))[None, :, None]
        cols = blocks * _BLOCK + tl.arange(0, _BLOCK)[None, None, :]
        mask = row_ok & (cols < F)
        scale_mask = row_ok & (blocks < nb)
        q_ptrs = q_ptr + rows * stride_q + cols
        scale_ptrs = scale_ptr + rows * stride_scale + blocks
        gate = _dequantize(q_ptrs, scale_ptrs, mask, scale_mask, INTERPRET)
        up = _dequantize(q_ptrs + F, scale_ptrs + nb, mask, scale_mask, INTERPRET)
        g_ptrs = g_ptr + rows * stride_g + cols
        g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
        grad_gate, grad_up, h, gh = _grads(gate, up, g, w, dtype, WEIGHTED)
        dot += tl.sum(tl.sum(gh, axis=2, keep_dims=True), axis=1, keep_dims=True)
        tl.store(g_ptrs, h.to(dtype), mask=mask)
        out_ptrs = grad_preact_ptr + rows * stride_grad_preact + cols
        tl.store(out_ptrs, grad_gate.to(grad_preact_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptrs + F, grad_up.to(grad_preact_ptr.dtype.element_ty), mask=mask)
    if WEIGHTED:
        tl.store(grad_w_ptr + rows, dot, mask=row_ok)


@functools.lru_cache(maxsize=4096)
def rows_tile(
    rows: int, ffn: int, min_cols: int = 1, interpret: bool = INTERPRET
) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): BWD_TILE's element budget as whole rows' column steps
    (a power of two, at most F's next one, at least ``min_cols``), then rows."""
    if interpret:
        return (*(INTERPRET_TILE_FP8 if min_cols > 1 else INTERPRET_TILE), 1)
    elements, warps = BWD_TILE
    block_n = max(min(elements, triton.next_power_of_2(ffn)), min_cols)
    block_m = max(min(elements // block_n, triton.next_power_of_2(max(rows, 1))), 1)
    return block_m, block_n, warps


def _check(g: torch.Tensor, w: torch.Tensor | None, grad_w: torch.Tensor | None) -> tuple:
    """(R, F) of a row-major g [R, F]; w and grad_w, when given, fp32-or-float [R] vectors."""
    if g.dim() != 2 or (g.numel() and g.stride(1) != 1):
        raise ValueError(f"g must be row-major [R, F], got {tuple(g.shape)} {g.stride()}")
    if g.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"g dtype must be one of {SUPPORTED_DTYPES}, got {g.dtype}")
    r = g.shape[0]
    if (w is None) != (grad_w is None):
        raise ValueError("pass both w and grad_w (router weight on the output) or neither")
    for name, t in (("w", w), ("grad_w", grad_w)):
        if t is not None and (tuple(t.shape) != (r,) or t.device != g.device):
            raise ValueError(f"{name} must be [{r}] on {g.device}, got {tuple(t.shape)}")
    if grad_w is not None and (grad_w.dtype != torch.float32 or grad_w.stride(0) != 1):
        raise ValueError(f"grad_w must be a contiguous float32 vector, got {grad_w.dtype}")
    return g.shape


def experts_backward_(
    preact: torch.Tensor,
    g: torch.Tensor,
    w: torch.Tensor | None = None,
    grad_w: torch.Tensor | None = None,
    interleaved: bool = False,
) -> None:
    """In place: grad_preact over preact [R, 2F], (w ·) h over g [R, F]; grad_w [R] (fp32)
    gets Σ g·h per row when w (the router weight per row, [R]) is given. ``interleaved``:
    preact, and so grad_preact, hold gate and up of each feature side by side."""
    r, ffn = _check(g, w, grad_w)
    if preact.shape != (r, 2 * ffn) or preact.dtype != g.dtype or preact.device != g.device:
        raise ValueError(
            f"preact must be {g.dtype} [{r}, {2 * ffn}] on {g.device}, got {preact.dtype} "
            f"{tuple(preact.shape)} on {preact.device}"
        )
    if r == 0:
        return
    if preact.stride(1) != 1:
        raise ValueError(f"preact must be row-major, got strides {preact.stride()}")
    block_m, block_n, warps = rows_tile(r, ffn)
    weighted = w is not None
    _experts_bwd_kernel[(-(-r // block_m),)](
        preact, g, w if weighted else g, grad_w if weighted else g, r, ffn,
        preact.stride(0), g.stride(0),
        WEIGHTED=weighted, INTERLEAVED=interleaved, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=warps,
    )  # fmt: skip


def experts_backward_fp8(
    q: torch.Tensor,
    scales: torch.Tensor,
    g: torch.Tensor,
    grad_preact: torch.Tensor,
    w: torch.Tensor | None = None,
    grad_w: torch.Tensor | None = None,
) -> None:
    """From the e4m3 copy (q, scales: ``fp8_format``): grad_preact into its [R, 2F] buffer
    of g's dtype, (w ·) h over g [R, F], and grad_w as in ``experts_backward_``."""
    r, ffn = _check(g, w, grad_w)
    if grad_preact.shape != (r, 2 * ffn) or grad_preact.dtype != g.dtype:
        raise ValueError(f"grad_preact must be {g.dtype} [{r}, {2 * ffn}]")
    check_saved(q, scales, g, r, ffn, saved_shapes)
    if r == 0:
        return
    block_m, block_n, warps = rows_tile(r, ffn, min_cols=BLOCK)
    weighted = w is not None
    code, scale_bits = q.view(torch.uint8), scales.view(torch.int16)
    _experts_bwd_fp8_kernel[(-(-r // block_m),)](
        code, scale_bits, g, grad_preact, w if weighted else g, grad_w if weighted else g,
        r, ffn, code.stride(0), scale_bits.stride(0), g.stride(0), grad_preact.stride(0),
        WEIGHTED=weighted, BLOCK_M=block_m, BLOCK_N=block_n, INTERPRET=INTERPRET,
        num_warps=warps,
    )  # fmt: skip


@triton.jit
def _combine_kernel(
    rows_ptr,
    bags_ptr,
    w_ptr,
    out_ptr,
    D,
    K: tl.constexpr,
    K_POW2: tl.constexpr,
    stride_rows,
    stride_out,
    WEIGHTED: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out[t] = Σ_j w[t, j] · rows[bags[t, j]] over BLOCK_D columns, summed in fp32. The k
    row indices (and weights) load as one vector and the k rows as one [K_POW2, BLOCK_D]
    tile, so every row's load is in flight at once rather than one after another."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    slots = tl.arange(0, K_POW2)
    slot_ok = slots < K
    row = tl.load(bags_ptr + t * K + slots, mask=slot_ok, other=0).to(tl.int64)
    mask = slot_ok[:, None] & (cols[None, :] < D)
    v = tl.load(rows_ptr + row[:, None] * stride_rows + cols[None, :], mask=mask, other=0.0)
    v = v.to(tl.float32)
    if WEIGHTED:
        v = v * tl.load(w_ptr + t * K + slots, mask=slot_ok, other=0.0).to(tl.float32)[:, None]
    out = tl.sum(v, axis=0)
    tl.store(out_ptr + t * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=cols < D)


# Columns per program of the combine: the k rows' tile holds up to 8192 elements over 4
# warps (16 fp32 values a thread per row slot at k <= 8), the swiglu forward's budget.
COMBINE_ELEMENTS, COMBINE_WARPS = 8192, 4


def combine_rows(
    rows: torch.Tensor, bags: torch.Tensor, weights: torch.Tensor | None
) -> torch.Tensor:
    """[T, D]: Σ_j weights[t, j] · rows[bags[t, j]], in fp32 then rounded once to rows' dtype
    (fp32 router weights are not rounded to bf16 first, as ``embedding_bag`` would)."""
    if rows.dim() != 2 or (rows.numel() and rows.stride(1) != 1):
        raise ValueError(f"rows must be row-major [R, D], got {tuple(rows.shape)}")
    (t, k), d = bags.shape, rows.shape[1]
    if not bags.is_contiguous() or (weights is not None and tuple(weights.shape) != (t, k)):
        raise ValueError(
            f"bags must be contiguous [T, k] and weights [T, k], got {tuple(bags.shape)}"
        )
    out = rows.new_empty(t, d)
    if t == 0 or d == 0:
        return out
    k_pow2 = triton.next_power_of_2(k)
    if INTERPRET:
        block_d, warps = min(16, d), 1
    else:
        block_d, warps = max(COMBINE_ELEMENTS // k_pow2, 128), COMBINE_WARPS
    block_d = min(block_d, triton.next_power_of_2(d))
    w = weights.contiguous() if weights is not None else bags
    _combine_kernel[(t, -(-d // block_d))](
        rows, bags, w, out, d, k, k_pow2, rows.stride(0), out.stride(0),
        WEIGHTED=weights is not None, BLOCK_D=block_d, num_warps=warps,
    )  # fmt: skip
    return out
