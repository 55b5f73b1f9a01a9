"""Tiled Triton kernels for the SwiGLU activation on a canonical [gate | up] preactivation.

preact is [M, 2F] with gate = preact[:, :F] and up = preact[:, F:]; h = silu(gate) * up.
The factors kernel (save_factors after a cuBLAS fc1) also reads the packed layout.
All arithmetic is fp32 after the loads. silu is rounded to the storage dtype before the
product, exactly as eager ``F.silu(gate) * up`` rounds, so h matches Megatron's formula and
the h recomputed in backward is bit-identical to the forward's.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from swiglu_train.kernels.runtime import INTERPRET, SUPPORTED_DTYPES

# The tile is a bandwidth rule, not an autotuner's pick. These kernels are memory-bound; what
# sets their speed is the bytes each thread keeps in flight: 8 elements per thread, one 16-byte
# bf16 vector per operand. 1024-element programs of 4 warps (forward) and 2048-element programs
# of 8 warps (backward and factors) came within 2.2 % of the best of 15 tiles at each of six
# [M, F] training shapes on the H200
# (benchmarks/results/activation/activation_bandwidth_h200.json), where
# Triton's autotuner, timing each candidate once, lost up to 35 %
# (activation_bandwidth_autotuned_h200.json). 16 elements per thread is as fast out of place
# but not in place: drop_h's in-place backward ran 1.33x slower at 4096 elements on 8 warps and
# at 2048 on 4, and at copy speed at 2048 on 8 (probe_inplace_backward_h200.json, 3 shapes).
ABS_BITS: tl.constexpr = tl.constexpr(0x7FFFFFFF)  # an fp32's bits without the sign: |v|
FWD_TILE = (1024, 4)  # (elements per program, warps)
BWD_TILE = (2048, 8)
INTERPRET_TILE = (16, 32)  # (BLOCK_M, BLOCK_N): small, so CPU tests cross tile edges


# Memoized: triton.next_power_of_2 and triton.cdiv are constexpr functions in Triton 3.6, 1.5-3 us
# of host time a call, so a launch spent ~12 us on its tile and grid (benchmarks/host_time.py)
# while the kernels of a small layer take about that long on the H200.
@functools.lru_cache(maxsize=4096)
def tile(
    M: int, F: int, rule: tuple[int, int], interpret: bool = INTERPRET
) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): as many columns of a row as the rule's element budget
    allows (a power of two, at most F's next one, so narrow F wastes few lanes), then rows."""
    if interpret:
        return (*INTERPRET_TILE, 1)
    elements, warps = rule
    block_n = min(elements, triton.next_power_of_2(F))
    block_m = min(elements // block_n, triton.next_power_of_2(max(M, 1)))
    return block_m, block_n, warps


@triton.jit
def _tile(pid, M, F, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Map a flat program id to (rows, cols, mask); a 1D grid avoids the 65535 limit of axis 1."""
    n_col_blocks = tl.cdiv(F, BLOCK_N)
    pid_m = pid // n_col_blocks
    pid_n = pid % n_col_blocks
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < F)
    return rows[:, None], cols[None, :], mask


@triton.jit
def _silu_times_up(gate, up, DTYPE: tl.constexpr):
    """h = silu(gate) * up with silu rounded to DTYPE first; shared by forward and recompute."""
    silu = gate / (1.0 + tl.exp(-gate))
    return silu.to(DTYPE).to(tl.float32) * up


@triton.jit
def _swiglu_fwd_kernel(
    preact_ptr,
    h_ptr,
    M,
    F,
    stride_preact,
    stride_h,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows, cols, mask = _tile(tl.program_id(0), M, F, BLOCK_M, BLOCK_N)
    gate_ptrs = preact_ptr + rows * stride_preact + cols
    gate = tl.load(gate_ptrs, mask=mask).to(tl.float32)
    up = tl.load(gate_ptrs + F, mask=mask).to(tl.float32)
    h = _silu_times_up(gate, up, h_ptr.dtype.element_ty)
    tl.store(h_ptr + rows * stride_h + cols, h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _abs_bits(v, mask):
    """|v|'s fp32 bits as int32 (0 where masked): they order as the values do, and NaN's sort
    above inf's, so a max over them is torch.amax's, NaN included (``kernels.float8_cast``)."""
    return tl.where(mask, v.to(tl.float32).to(tl.int32, bitcast=True) & ABS_BITS, 0)


@triton.jit
def _swiglu_bwd_kernel(
    preact_ptr,
    grad_h_ptr,
    grad_preact_ptr,
    h_ptr,
    tensor_amax_ptr,
    row_amax_ptr,
    M,
    F,
    stride_preact,
    stride_grad_h,
    stride_grad_preact,
    stride_h,
    WRITE_H: tl.constexpr,
    INPLACE: tl.constexpr,
    H_OVER_GRAD_H: tl.constexpr,
    TENSOR_AMAX: tl.constexpr,
    ROW_AMAX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """grad_preact = [grad_h*up*silu'(gate) | grad_h*silu(gate)], and h when WRITE_H.

    INPLACE (grad_preact over preact) and H_OVER_GRAD_H store through the load pointers
    themselves, so the compiler sees one address per element and keeps each load before its
    store.
    TENSOR_AMAX (with WRITE_H) writes this program's max |grad_preact| and max |h| as stored, as
    fp32 bits, to slots pid and programs + pid; ROW_AMAX each row's max |grad_preact| over this
    program's columns to [row, column tile]: plain stores, which the caller reduces, where
    atomics from every program would queue on a few addresses.
    """
    pid = tl.program_id(0)
    rows, cols, mask = _tile(pid, M, F, BLOCK_M, BLOCK_N)
    gate_ptrs = preact_ptr + rows * stride_preact + cols
    grad_h_ptrs = grad_h_ptr + rows * stride_grad_h + cols
    gate = tl.load(gate_ptrs, mask=mask).to(tl.float32)
    up = tl.load(gate_ptrs + F, mask=mask).to(tl.float32)
    grad_h = tl.load(grad_h_ptrs, mask=mask).to(tl.float32)

    sig = 1.0 / (1.0 + tl.exp(-gate))
    grad_up = grad_h * gate * sig
    grad_gate = grad_h * up * sig * (1.0 + gate * (1.0 - sig))

    out_ptrs = gate_ptrs if INPLACE else grad_preact_ptr + rows * stride_grad_preact + cols
    h_ptrs = grad_h_ptrs if H_OVER_GRAD_H else h_ptr + rows * stride_h + cols
    out_dtype = grad_preact_ptr.dtype.element_ty
    if WRITE_H:
        h = _silu_times_up(gate, up, h_ptr.dtype.element_ty).to(h_ptr.dtype.element_ty)
        tl.store(h_ptrs, h, mask=mask)
        if TENSOR_AMAX:
            store_h_amax(h, mask, tensor_amax_ptr)
    grad_gate = grad_gate.to(out_dtype)
    grad_up = grad_up.to(out_dtype)
    tl.store(out_ptrs, grad_gate, mask=mask)
    tl.store(out_ptrs + F, grad_up, mask=mask)
    store_grad_amaxes(
        grad_gate, grad_up, mask, rows, M, tl.cdiv(F, BLOCK_N), tensor_amax_ptr, row_amax_ptr,
        TENSOR_AMAX, ROW_AMAX,
    )  # fmt: skip


@triton.jit
def store_h_amax(h, mask, tensor_amax_ptr):
    """This program's max |h| (as stored) to slot programs + pid of the per-program maxima."""
    h_bits = tl.max(tl.max(_abs_bits(h, mask), axis=1), axis=0)
    tl.store(tensor_amax_ptr + tl.num_programs(0) + tl.program_id(0), h_bits)


@triton.jit
def store_grad_amaxes(
    grad_gate, grad_up, mask, rows, M, tiles_n, tensor_amax_ptr, row_amax_ptr,
    TENSOR_AMAX: tl.constexpr, ROW_AMAX: tl.constexpr,
):  # fmt: skip
    """This program's max |grad_preact| (both halves, as stored) to slot pid (TENSOR_AMAX), and
    each of its rows' to [row, pid's column tile] (ROW_AMAX), for the caller to reduce."""
    if TENSOR_AMAX or ROW_AMAX:
        pid = tl.program_id(0)
        grad_bits = tl.maximum(_abs_bits(grad_gate, mask), _abs_bits(grad_up, mask))
        if TENSOR_AMAX:
            tl.store(tensor_amax_ptr + pid, tl.max(tl.max(grad_bits, axis=1), axis=0))
        if ROW_AMAX:
            row_bits = tl.max(grad_bits, axis=1, keep_dims=True)
            tl.store(row_amax_ptr + rows * tiles_n + pid % tiles_n, row_bits, mask=rows < M)


@triton.jit
def _swiglu_factors_kernel(
    preact_ptr,
    h_ptr,
    M,
    F,
    stride_preact,
    stride_h,
    CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """h = silu(gate) * up, and the preact overwritten by the factors save_factors' backward
    needs: the gate slot by up*silu'(gate), the up slot by silu(gate). Column j of h reads the
    packed layout: gate at (j // CHUNK) * 2 * CHUNK + j % CHUNK, up CHUNK after it (canonical
    is CHUNK = F). Each element is stored through the pointer it was loaded from."""
    rows, cols, mask = _tile(tl.program_id(0), M, F, BLOCK_M, BLOCK_N)
    gate_ptrs = preact_ptr + rows * stride_preact + (cols // CHUNK) * (2 * CHUNK) + cols % CHUNK
    gate = tl.load(gate_ptrs, mask=mask).to(tl.float32)
    up = tl.load(gate_ptrs + CHUNK, mask=mask).to(tl.float32)
    dtype = h_ptr.dtype.element_ty
    sig = 1.0 / (1.0 + tl.exp(-gate))
    h = _silu_times_up(gate, up, dtype)
    tl.store(h_ptr + rows * stride_h + cols, h.to(dtype), mask=mask)
    tl.store(gate_ptrs, (up * sig * (1.0 + gate * (1.0 - sig))).to(dtype), mask=mask)
    tl.store(gate_ptrs + CHUNK, (gate * sig).to(dtype), mask=mask)


def _check_preact(preact: torch.Tensor) -> tuple[int, int]:
    if preact.dim() != 2 or preact.shape[1] % 2:
        raise ValueError(f"preact must be [M, 2F] with an even last dim, got {tuple(preact.shape)}")
    if preact.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"preact dtype must be one of {SUPPORTED_DTYPES}, got {preact.dtype}")
    if preact.stride(1) != 1:
        raise ValueError("preact must be row-major (stride 1 along the last dim)")
    return preact.shape[0], preact.shape[1] // 2


def _check_like(name: str, t: torch.Tensor, ref: torch.Tensor, shape: tuple[int, int]) -> None:
    if t.shape != shape or t.stride(1) != 1:
        raise ValueError(f"{name} must be row-major {shape}, got {tuple(t.shape)} {t.stride()}")
    if t.dtype != ref.dtype or t.device != ref.device:
        raise TypeError(f"{name} is {t.dtype} on {t.device}, expected {ref.dtype} on {ref.device}")


@functools.lru_cache(maxsize=4096)
def launch_config(
    M: int, F: int, rule: tuple[int, int], interpret: bool = INTERPRET
) -> tuple[tuple[int], int, int, int]:
    """(grid, BLOCK_M, BLOCK_N, num_warps) of a launch over the [M, F] output (memoized, as
    ``tile``: M changes from step to step only with the token count)."""
    block_m, block_n, warps = tile(M, F, rule, interpret)
    return (-(-M // block_m) * -(-F // block_n),), block_m, block_n, warps


def _launch(kernel, M: int, F: int, rule: tuple[int, int], *args, **constexprs) -> None:
    """One launch over a 1D grid of [BLOCK_M, BLOCK_N] tiles of the [M, F] output."""
    grid, block_m, block_n, warps = launch_config(M, F, rule)
    kernel[grid](*args, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, **constexprs)


def swiglu_forward(preact: torch.Tensor, h: torch.Tensor) -> None:
    """Write h = silu(gate) * up for a [M, 2F] preact into the given [M, F] buffer."""
    M, F = _check_preact(preact)
    _check_like("h", h, preact, (M, F))
    if M == 0:
        return
    _launch(_swiglu_fwd_kernel, M, F, FWD_TILE, preact, h, M, F, preact.stride(0), h.stride(0))


def swiglu_backward(
    preact: torch.Tensor,
    grad_h: torch.Tensor,
    grad_preact: torch.Tensor,
    h: torch.Tensor | None,
    tensor_amax: bool = False,
    row_amax: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Write grad_preact and, when h is given, the recomputed h.

    Passing grad_preact=preact and h=grad_h runs in place: each element is read before it is
    overwritten, through the same pointer. h=grad_h alone writes h over grad_h and grad_preact
    into its own buffer (backward out of place, or under torch.compile: no new [M, F] buffer).

    Returns the fp32 amaxes of what it wrote that an FP8 recipe scales its casts by, found in
    the same pass instead of a read of each after: with ``tensor_amax`` (h given) [2], max
    |grad_preact| and max |h|; with ``row_amax`` [M, 1], each row's max |grad_preact|.
    """
    M, F = _check_preact(preact)
    _check_like("grad_h", grad_h, preact, (M, F))
    _check_like("grad_preact", grad_preact, preact, (M, 2 * F))
    if h is not None:
        _check_like("h", h, preact, (M, F))
    if tensor_amax and h is None:
        raise ValueError("tensor_amax finds max |h| too: pass the h buffer")
    if M == 0:  # before the aliasing checks: empty tensors all have data_ptr 0
        return None, None
    inplace = grad_preact.data_ptr() == preact.data_ptr()
    h_over_grad_h = h is not None and h.data_ptr() == grad_h.data_ptr()
    if h is None and inplace:
        raise ValueError("in-place backward is only defined together with h over grad_h")
    if inplace and not h_over_grad_h:
        raise ValueError("in-place backward must overwrite both preact and grad_h")
    write_h = h is not None
    h_arg = h if write_h else grad_h  # unused pointer when WRITE_H is False
    grid, block_m, block_n, warps = launch_config(M, F, BWD_TILE)
    partials = AmaxPartials.for_launch(
        grad_preact, grid[0], -(-F // block_n), tensor_amax, row_amax
    )
    _swiglu_bwd_kernel[grid](
        preact, grad_h, grad_preact, h_arg, *partials.pointers(preact),
        M, F, preact.stride(0), grad_h.stride(0), grad_preact.stride(0), h_arg.stride(0),
        WRITE_H=write_h, INPLACE=inplace, H_OVER_GRAD_H=h_over_grad_h,
        TENSOR_AMAX=tensor_amax, ROW_AMAX=row_amax,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
    )  # fmt: skip
    return partials.reduced()


class AmaxPartials(NamedTuple):
    """The per-program maxima a backward kernel stores (``store_h_amax``,
    ``store_grad_amaxes``), as int32 bits: [2, programs] (grad_preact's, h's) and [M, column
    tiles] (grad_preact's per row); None where not asked for."""

    per_program: torch.Tensor | None
    per_row: torch.Tensor | None

    @classmethod
    def for_launch(
        cls, like: torch.Tensor, programs: int, tiles_n: int, tensor_amax: bool, row_amax: bool
    ) -> AmaxPartials:
        bits = functools.partial(torch.empty, device=like.device, dtype=torch.int32)
        return cls(
            bits(2, programs) if tensor_amax else None,
            bits(like.shape[0], tiles_n) if row_amax else None,
        )

    def pointers(self, unused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The two buffers for the kernel, ``unused`` where one is not asked for."""
        return tuple(unused if t is None else t for t in self)

    def reduced(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """([2] fp32: max |grad_preact|, max |h|; [M, 1] fp32: per row), or None each."""
        pair = None if self.per_program is None else self.per_program.amax(1)
        rows = None if self.per_row is None else self.per_row.amax(1, keepdim=True)
        return tuple(None if t is None else t.view(torch.float32) for t in (pair, rows))


def swiglu_factors_(preact: torch.Tensor, h: torch.Tensor, chunk: int) -> None:
    """Write h into the given [M, F] buffer and overwrite the packed (chunk C) [M, 2F] preact
    with the backward factors, [up·silu'(gate) | silu(gate)] per chunk."""
    M, F = _check_preact(preact)
    _check_like("h", h, preact, (M, F))
    if chunk < 1 or F % chunk:
        raise ValueError(f"chunk must divide F = {F}, got {chunk}")
    if M == 0:
        return
    _launch(
        _swiglu_factors_kernel, M, F, BWD_TILE, preact, h, M, F, preact.stride(0), h.stride(0),
        CHUNK=chunk,
    )  # fmt: skip
