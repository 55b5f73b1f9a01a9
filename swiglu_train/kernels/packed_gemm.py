"""Seed 002's wide GEMM: x @ W1_packedᵀ with the SwiGLU epilogue, and the in-place backward.

W1_packed is [2F, K] in chunks of C rows, [gate_j | up_j]; one program computes a
[BLOCK_M, 2C] accumulator over one whole (gate, up) pair and writes, in one pass,
    h       [M, F]   = silu(gate) * up                       (always)
    aux     [M, 2F]  = [up * silu'(gate) | silu(gate)] per chunk  (AUX == 1, for training)
so the preactivation never reaches HBM. gate and up are rounded to the storage dtype before
the epilogue, as a cuBLAS GEMM's output would be, so h equals every other impl's h.

Status: correct under the interpreter and written for SM90 with a plain (non-TMA) mainloop;
tuning it on the H200 is the next step (see the issue notes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swiglu_train.kernels.runtime import INTERPRET, SUPPORTED_DTYPES
from swiglu_train.kernels.swiglu import _silu_times_up

AUX_NONE, AUX_FACTORS = 0, 1


def _gemm_configs() -> list[triton.Config]:
    if INTERPRET:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_K": 16})]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_K": bk}, num_stages=s, num_warps=w)
        for bm, bk, s, w in [(128, 64, 3, 8), (128, 64, 4, 8), (64, 64, 4, 4), (128, 32, 4, 8)]
    ]


@triton.autotune(configs=_gemm_configs(), key=["M", "K", "F", "CHUNK", "AUX"])
@triton.jit
def _packed_swiglu_gemm_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    h_ptr,
    aux_ptr,
    M,
    K,
    F,
    stride_x,
    stride_w,
    stride_h,
    stride_aux,
    HAS_BIAS: tl.constexpr,
    AUX: tl.constexpr,
    CHUNK: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_c = tl.program_id(1)  # which (gate, up) chunk pair
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    wrows = (pid_c * 2 * CHUNK + tl.arange(0, 2 * CHUNK)).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, 2 * CHUNK), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = (k0 + ks) < K
        a = tl.load(
            x_ptr + rows[:, None] * stride_x + (k0 + ks)[None, :],
            mask=(rows[:, None] < M) & kmask[None, :],
            other=0.0,
        )
        b = tl.load(w_ptr + wrows[:, None] * stride_w + (k0 + ks)[None, :], mask=kmask[None, :])
        if UPCAST:  # the interpreter's bf16 dot is wrong; fp32 operands are exact there
            a, b = a.to(tl.float32), b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + wrows).to(tl.float32)[None, :]
    dtype = h_ptr.dtype.element_ty
    gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, CHUNK)), (0, 2, 1)))
    gate, up = gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32)
    cols = pid_c * CHUNK + tl.arange(0, CHUNK)
    mask = rows[:, None] < M
    h = _silu_times_up(gate, up, dtype)
    tl.store(h_ptr + rows[:, None] * stride_h + cols[None, :], h.to(dtype), mask=mask)
    if AUX == 1:
        sig = 1.0 / (1.0 + tl.exp(-gate))
        d_gate = up * sig * (1.0 + gate * (1.0 - sig))
        aux = (
            aux_ptr
            + rows[:, None] * stride_aux
            + (pid_c * 2 * CHUNK + tl.arange(0, CHUNK))[None, :]
        )
        tl.store(aux, d_gate.to(dtype), mask=mask)
        tl.store(aux + CHUNK, (gate * sig).to(dtype), mask=mask)


@triton.jit
def _factors_to_grad_kernel(
    factors_ptr, grad_h_ptr, M, stride_f, stride_g, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr
):
    """In place: factors[:, pair j] *= grad_h[:, chunk j] -> grad_preact (packed)."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    pid_c = tl.program_id(1)
    t = tl.arange(0, CHUNK)
    mask = rows[:, None] < M
    g = tl.load(grad_h_ptr + rows[:, None] * stride_g + (pid_c * CHUNK + t)[None, :], mask=mask)
    g = g.to(tl.float32)
    f_ptrs = factors_ptr + rows[:, None] * stride_f + (pid_c * 2 * CHUNK + t)[None, :]
    d_gate = tl.load(f_ptrs, mask=mask).to(tl.float32) * g
    d_up = tl.load(f_ptrs + CHUNK, mask=mask).to(tl.float32) * g
    dtype = factors_ptr.dtype.element_ty
    tl.store(f_ptrs, d_gate.to(dtype), mask=mask)
    tl.store(f_ptrs + CHUNK, d_up.to(dtype), mask=mask)


def fused_supported(x: torch.Tensor, chunk: int) -> bool:
    """The fused kernels need a power-of-two chunk >= 16 (a tl.dot tile edge)."""
    return chunk >= 16 and chunk & (chunk - 1) == 0 and x.dtype in SUPPORTED_DTYPES


def packed_swiglu_forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, chunk: int, factors: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(h [M, F], factors [M, 2F] or None) from x [M, K] and a packed fc1 [2F, K]."""
    m, k = x.shape
    rows = weight.shape[0]
    if weight.shape[1] != k or rows % (2 * chunk):
        raise ValueError(
            f"packed fc1 {tuple(weight.shape)} does not fit x {tuple(x.shape)}, chunk {chunk}"
        )
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and the fc1 weight must be row-major")
    if not fused_supported(x, chunk) or weight.dtype != x.dtype or weight.device != x.device:
        raise TypeError(
            f"fused packed GEMM needs matching {SUPPORTED_DTYPES} tensors on one "
            f"device and a power-of-two chunk >= 16; got {x.dtype}/{weight.dtype} "
            f"chunk {chunk}"
        )
    f = rows // 2
    h = x.new_empty(m, f)
    aux = x.new_empty(m, rows) if factors else h
    if m == 0:
        return h, aux if factors else None
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), f // chunk)  # noqa: E731
    _packed_swiglu_gemm_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,
        h,
        aux,
        m,
        k,
        f,
        x.stride(0),
        weight.stride(0),
        h.stride(0),
        aux.stride(0),
        HAS_BIAS=bias is not None,
        AUX=AUX_FACTORS if factors else AUX_NONE,
        CHUNK=chunk,
        UPCAST=INTERPRET,
        IEEE=x.dtype == torch.float32,
    )
    return h, aux if factors else None


def factors_to_grad_(factors: torch.Tensor, grad_h: torch.Tensor, chunk: int) -> None:
    """Overwrite the saved factors with grad_preact = grad_h ⊙ factors (packed order)."""
    m, rows = factors.shape
    if grad_h.shape != (m, rows // 2) or grad_h.dtype != factors.dtype:
        raise ValueError(
            f"grad_h {tuple(grad_h.shape)} {grad_h.dtype} does not match factors "
            f"{tuple(factors.shape)} {factors.dtype}"
        )
    if m == 0:
        return
    block_m = 16 if INTERPRET else 32
    grid = (triton.cdiv(m, block_m), rows // (2 * chunk))
    _factors_to_grad_kernel[grid](
        factors, grad_h, m, factors.stride(0), grad_h.stride(0), CHUNK=chunk, BLOCK_M=block_m
    )
