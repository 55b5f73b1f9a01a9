"""The routed experts' weight gradient with its input rows gathered inside the GEMM.

With the slots sorted by expert (``ops.experts_routing``), drop_h's fc1 weight gradient is

    grad_W1[e] = Σ over expert e's rows r of grad_preact[r]ᵀ · (s[r] ·) x[token[r]]

torch's grouped GEMM takes only written rows, so drop_h gathers x to the R = T·k slots first:
an [R, D] buffer live beside both weight gradients at the step's backward peak (256 MiB at
Qwen3-30B-A3B with 8192 tokens, where compiled torchtitan's peak was 98 MiB below drop_h's on
the H100, benchmarks/results/moe/moe_h100.md). Here each program reads its rows of x through
the token index, as quack's gather GEMMs do, so the gathered input is never written
(``ParExperts(gathered_wgrad=True)``). Opt-in: on the H100 it ran 1.52-1.80x torch's grouped
GEMM on pre-gathered rows, against 1.01-1.18x for gathering first (moe_wgrad_h100.md), so it
trades 4-9 % of the step for that buffer.
``s`` is the router weight when it scales the input (Llama-4), rounded as the forward rounded
w·x, so the gradient is of the product the forward used.

A program owns a [BLOCK_M, BLOCK_N] tile of one expert's gradient and walks that expert's rows
BLOCK_K at a time; the expert is the grid's slow axis, so one expert's tiles run together and
share its rows in L2. An expert with no rows writes zeros, as torch's grouped GEMM does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swiglu_train.kernels.runtime import INTERPRET, SUPPORTED_DTYPES, m_bucket


def _configs() -> list[triton.Config]:
    """Hopper's usual bf16 GEMM tiles (a warpgroup per 64 rows of the tile), timed once per
    shape class by the autotuner: these calls run 0.1 to 10 ms, where its timing ranks
    reliably. One small tile in the interpreter, which cannot time, so CPU tests cross tiles."""
    if INTERPRET:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}, num_warps=1)]
    tiles = [(128, 128, 64, 4, 8), (128, 256, 64, 3, 8), (256, 128, 64, 3, 8),
             (64, 128, 64, 4, 4), (128, 64, 64, 4, 4)]  # fmt: skip
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_stages=s, num_warps=w)
        for m, n, k, s, w in tiles
    ]


@triton.autotune(configs=_configs(), key=["N", "K", "ROWS_BUCKET", "SCALED"])
@triton.jit
def _gathered_wgrad_kernel(
    a_ptr,
    b_ptr,
    token_ptr,
    scale_ptr,
    offsets_ptr,
    out_ptr,
    N,
    K,
    stride_a_row,
    stride_a_col,
    stride_b_row,
    stride_b_col,
    ROWS_BUCKET,
    SCALED: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[e, m, n] = Σ_r a[r, m] · (s[r] ·) b[token[r], n] over expert e's rows."""
    expert = tl.program_id(1).to(tl.int64)
    tiles_n = tl.cdiv(K, BLOCK_N)
    ms = (tl.program_id(0) // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = (tl.program_id(0) % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = ms < N, ns < K
    start = tl.load(offsets_ptr + expert - 1, mask=expert > 0, other=0)
    end = tl.load(offsets_ptr + expert)
    dtype = b_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_K):
        rows = r0 + tl.arange(0, BLOCK_K).to(tl.int64)
        live = rows < end
        a_ptrs = a_ptr + rows[:, None] * stride_a_row + ms[None, :] * stride_a_col
        a = tl.load(a_ptrs, mask=live[:, None] & m_ok[None, :], other=0.0)
        token = tl.load(token_ptr + rows, mask=live, other=0).to(tl.int64)
        b_ptrs = b_ptr + token[:, None] * stride_b_row + ns[None, :] * stride_b_col
        b = tl.load(b_ptrs, mask=live[:, None] & n_ok[None, :], other=0.0)
        if SCALED:  # w·x rounded to x's dtype, as the forward computed it
            s = tl.load(scale_ptr + rows, mask=live, other=0.0).to(dtype).to(tl.float32)
            b = (b.to(tl.float32) * s[:, None]).to(dtype)
        if UPCAST:  # the interpreter's bf16 dot is wrong
            a, b = a.to(tl.float32), b.to(tl.float32)
        if IEEE:  # fp32 operands: no TF32, as the torch fallback computes
            acc = tl.dot(tl.trans(a), b, acc, input_precision="ieee")
        else:
            acc = tl.dot(tl.trans(a), b, acc)
    out_ptrs = out_ptr + expert * N * K + ms[:, None].to(tl.int64) * K + ns[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def gathered_weight_grad(
    a: torch.Tensor,
    b: torch.Tensor,
    token: torch.Tensor,
    offsets: torch.Tensor,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """[E, N, K] in a's dtype: Σ over expert e's rows r of a[r]ᵀ (scale[r] ·) b[token[r]], for
    a [R, N] sorted by expert, b [T, K], token [R] int32 or int64 into b's rows, offsets [E] int32
    (cumulative row ends) and scale [R] or None."""
    if a.dim() != 2 or b.dim() != 2 or a.dtype != b.dtype or a.device != b.device:
        raise ValueError(
            f"a must be [R, N] and b [T, K] of one dtype and device, got {a.dtype} "
            f"{tuple(a.shape)} on {a.device} and {b.dtype} {tuple(b.shape)} on {b.device}"
        )
    if a.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"a dtype must be one of {SUPPORTED_DTYPES}, got {a.dtype}")
    rows, experts = a.shape[0], offsets.shape[0]
    if tuple(token.shape) != (rows,) or token.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"token must be int32 or int64 [{rows}], got {token.dtype} {tuple(token.shape)}"
        )
    if offsets.dim() != 1 or offsets.dtype != torch.int32 or experts == 0:
        raise ValueError(f"offsets must be int32 [E >= 1], got {offsets.dtype} {offsets.shape}")
    if scale is not None and tuple(scale.shape) != (rows,):
        raise ValueError(f"scale must be [{rows}], got {tuple(scale.shape)}")
    n, k = a.shape[1], b.shape[1]
    out = a.new_empty(experts, n, k)
    if out.numel() == 0:
        return out

    def grid(meta: dict) -> tuple[int, int]:
        return triton.cdiv(n, meta["BLOCK_M"]) * triton.cdiv(k, meta["BLOCK_N"]), experts

    _gathered_wgrad_kernel[grid](
        a, b, token, scale if scale is not None else a, offsets.contiguous(), out, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), m_bucket(max(rows // experts, 1)),
        SCALED=scale is not None, UPCAST=INTERPRET, IEEE=a.dtype == torch.float32,
    )  # fmt: skip
    return out
