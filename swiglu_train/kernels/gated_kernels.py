"""The gated GEMM's Triton kernels (seeds 002 and 003): x @ W1ᵀ with the SwiGLU epilogue in one
kernel, and the in-place factors -> grad_preact product of save_factors' backward.

W1 is [2F, K] in a packed layout of chunk C: rows [gate_j | up_j] per chunk of C. The canonical
[W_gate; W_up] is the same layout with C = F, so one kernel serves every impl. A program owns
a [BLOCK_M, BLOCK_N] tile of h and accumulates the matching gate and up tiles side by side
(the seed's [BM, 2·BN] accumulator); its epilogue writes, in one pass,
    h    [M, F]                                          (always)
    aux  [M, 2F] in W1's column order, either the factors
         [up·silu'(gate) | silu(gate)] for save_factors' backward, or the preactivation for
         drop_h's (AUX = "factors" | "preact" | "none")
so the preactivation is never read back. gate and up are rounded to the storage dtype before
the epilogue, as a cuBLAS GEMM's output would be, so h equals every other impl's h bit for bit.

Tiles are visited in grouped order for L2 reuse, and small-M shapes may take a persistent
grid; the autotuner picks (gated_autotune). Operands and outputs arrive as TMA tensor
descriptors or as plain pointers (USE_TMA; the launcher in gated_gemm chooses).
"""

from __future__ import annotations

import triton
import triton.language as tl

from swiglu_train.kernels.gated_autotune import autotune_configs, prune_configs
from swiglu_train.kernels.swiglu import _silu_times_up


@triton.jit
def _load_x(x, rows, k0, ks, M, K, stride_x, USE_TMA: tl.constexpr, m0):
    """The [BLOCK_M, BLOCK_K] tile of x at (m0, k0): by TMA, or masked pointer loads."""
    if USE_TMA:  # an explicit else: code after a constexpr-if return is still compiled
        tile = x.load([m0, k0])
    else:
        mask = (rows[:, None] < M) & ((k0 + ks) < K)[None, :]
        tile = tl.load(x + rows[:, None] * stride_x + (k0 + ks)[None, :], mask=mask, other=0.0)
    return tile


@triton.jit
def _mma(a, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """acc += a @ bᵀ; fp32 operands in the interpreter, whose bf16 dot is wrong."""
    if UPCAST:
        a, b = a.to(tl.float32), b.to(tl.float32)
    if IEEE:  # noqa: SIM108 (statements keep the two dots apart for the Triton compiler)
        acc = tl.dot(a, b.T, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b.T, acc)
    return acc


@triton.autotune(
    configs=autotune_configs(),
    key=["M_BUCKET", "K", "F", "CHUNK", "AUX", "HAS_BIAS", "USE_TMA"],
    prune_configs_by={"early_config_prune": prune_configs},
)
@triton.jit
def _gated_gemm_kernel(
    x,
    w,
    b_ptr,
    h_out,
    aux_out,
    aux_up_out,
    M,
    K,
    F,
    stride_x,
    stride_w,
    stride_h,
    stride_aux,
    M_BUCKET,
    HAS_BIAS: tl.constexpr,
    AUX: tl.constexpr,
    CHUNK: tl.constexpr,
    USE_TMA: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PERSISTENT: tl.constexpr,
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(F, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    dtype = b_ptr.dtype.element_ty  # b_ptr is the bias, or fc1 itself when there is none
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=PERSISTENT):
        # grouped order: GROUP_M row tiles sweep the columns together, sharing W1 in L2
        group = tile // (GROUP_M * num_pid_n)
        first_m = group * GROUP_M
        group_rows = min(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % (GROUP_M * num_pid_n)) % group_rows
        pid_n = (tile % (GROUP_M * num_pid_n)) // group_rows
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        gate_row = (n0 // CHUNK) * 2 * CHUNK + n0 % CHUNK  # W1 row (and aux column) of gate
        up_row = gate_row + CHUNK
        rows = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        ks = tl.arange(0, BLOCK_K)
        wn = tl.arange(0, BLOCK_N).to(tl.int64)
        if CHUNK == BLOCK_N:  # the seed's wide tile: gate and up rows adjacent, one [BM, 2BN] dot
            acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
            w2 = tl.arange(0, 2 * BLOCK_N).to(tl.int64)
            for k0 in range(0, K, BLOCK_K):
                a = _load_x(x, rows, k0, ks, M, K, stride_x, USE_TMA, m0)
                if USE_TMA:
                    b = w.load([gate_row, k0])
                else:
                    w_tile = w + (gate_row + w2)[:, None] * stride_w + (k0 + ks)[None, :]
                    b = tl.load(w_tile, mask=((k0 + ks) < K)[None, :], other=0.0)
                acc = _mma(a, b, acc, UPCAST, IEEE)
            pairs = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1))
            acc_gate, acc_up = tl.split(pairs)
        else:  # two [BM, BN] dots sharing the x tile (canonical layout, or tiles below chunk)
            acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                a = _load_x(x, rows, k0, ks, M, K, stride_x, USE_TMA, m0)
                if USE_TMA:
                    b_gate = w.load([gate_row, k0])
                    b_up = w.load([up_row, k0])
                else:
                    kmask = ((k0 + ks) < K)[None, :]
                    w_tile = w + (gate_row + wn)[:, None] * stride_w + (k0 + ks)[None, :]
                    gate_mask = ((gate_row + wn)[:, None] < 2 * F) & kmask
                    b_gate = tl.load(w_tile, mask=gate_mask, other=0.0)
                    up_mask = ((up_row + wn)[:, None] < 2 * F) & kmask
                    b_up = tl.load(w_tile + CHUNK * stride_w, mask=up_mask, other=0.0)
                acc_gate = _mma(a, b_gate, acc_gate, UPCAST, IEEE)
                acc_up = _mma(a, b_up, acc_up, UPCAST, IEEE)
        cols = n0 + tl.arange(0, BLOCK_N)
        if HAS_BIAS:
            bias_mask = cols < F
            acc_gate += tl.load(b_ptr + gate_row + wn, mask=bias_mask).to(tl.float32)[None, :]
            acc_up += tl.load(b_ptr + up_row + wn, mask=bias_mask).to(tl.float32)[None, :]
        gate = acc_gate.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        h = _silu_times_up(gate, up, dtype).to(dtype)
        if AUX == 1:  # the factors: d h / d gate and d h / d up
            sig = 1.0 / (1.0 + tl.exp(-gate))
            aux_gate, aux_up = up * sig * (1.0 + gate * (1.0 - sig)), gate * sig
        else:  # the preactivation, as the GEMM would have written it
            aux_gate, aux_up = gate, up
        if USE_TMA:  # the descriptors clip rows >= M and columns >= F
            h_out.store([m0, n0], h)
            if AUX != 0:  # canonical aux: two [M, F] halves, so a tile cannot cross into up
                gate_col = n0 if CHUNK == F else gate_row
                aux_out.store([m0, gate_col], aux_gate.to(dtype))
                aux_up_out.store([m0, gate_col if CHUNK == F else up_row], aux_up.to(dtype))
        else:
            mask = (rows[:, None] < M) & (cols[None, :] < F)
            tl.store(h_out + rows[:, None] * stride_h + cols[None, :], h, mask=mask)
            if AUX != 0:
                aux_ptrs = aux_out + rows[:, None] * stride_aux + (gate_row + wn)[None, :]
                tl.store(aux_ptrs, aux_gate.to(dtype), mask=mask)
                tl.store(aux_ptrs + CHUNK, aux_up.to(dtype), mask=mask)


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
