"""Seed 004's fully fused SwiGLU MLP for small M (decode, short prompts): h never reaches HBM.

    y = (silu(x W_gateᵀ) ⊙ (x W_upᵀ)) W2ᵀ + b2,   fc1 [2F, D] = [W_gate; W_up],  fc2 [O, F]

At small M the MLP is bound by reading its weights, so the work is split along F, which fc2
reduces over: program (f, o, m) computes gate and up for a [BLOCK_M, BLOCK_F] slice over all of
D, turns them into h in registers and multiplies h by its W2[o-range, f-slice]ᵀ, giving a
partial y that other F-slices add to. When the F-slices alone are fewer than the SMs, O is split
too (those programs recompute the same h slice; its W1 rows then come from L2). Row blocks are
the fastest grid axis, so when M needs several, they read each weight tile while it is in L2.

h is rounded to the storage dtype exactly as eager ``F.silu(gate) * up`` rounds it (gate and up
as the fc1 GEMM's output, then silu, then the product), so y matches eager closely.

Reduction of the F-split partials:
- default: fp32 atomics into a zeroed [M, O] workspace, which stays in L2 (M*O*4 bytes), then a
  small kernel adds b2 and casts. The order of the fp32 additions varies from run to run, so an
  element may differ by one ulp of the output dtype between runs; nothing larger.
- under ``torch.use_deterministic_algorithms(True)``: each F-slice stores its own [M, O] partial
  and the finishing kernel sums them in a fixed order, bitwise reproducible, for splits*M*O*4
  bytes through HBM (121 MB at Qwen-2.5-72B, M=16, against 1.45 GB of weights).

Status: correct under the interpreter; written for SM90, to be tuned on the H200.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from swiglu_train.kernels.runtime import INTERPRET, SUPPORTED_DTYPES, m_bucket, triton_runs_on
from swiglu_train.kernels.swiglu import _silu_times_up

MAX_BLOCK_M = 64  # beyond this M the weights are re-read per row block: not this kernel's regime
FINISH_BLOCK = 256 if INTERPRET else 1024
INTERPRET_PROGRAMS = 8  # the "SM count" under the interpreter: small, so tests split O as well


def _configs() -> list[triton.Config]:
    if INTERPRET:  # no CUDA events to time candidates; small tiles so tests cross tile edges
        return [triton.Config({"BLOCK_F": 16, "BLOCK_D": 16, "BLOCK_O": 16})]
    shapes = [  # (BLOCK_F, BLOCK_D, BLOCK_O, num_warps, num_stages); smem stays under 100 KB
        (32, 128, 64, 4, 4),  # many programs for small F (Qwen-0.5B: 152 slices)
        (64, 128, 64, 4, 3),
        (64, 64, 128, 4, 4),
        (128, 64, 64, 4, 3),  # 148-231 slices at Qwen-7B..72B
        (128, 64, 128, 8, 3),
    ]
    return [
        triton.Config({"BLOCK_F": f, "BLOCK_D": d, "BLOCK_O": o}, num_warps=w, num_stages=s)
        for f, d, o, w, s in shapes
    ]


def prune_configs(configs: list[triton.Config], named_args: dict, **_) -> list[triton.Config]:
    """Drop tiles larger than the problem along F, D or O: masked lanes and compile time only."""
    caps = {
        "BLOCK_F": triton.next_power_of_2(named_args["F"]),
        "BLOCK_D": triton.next_power_of_2(named_args["D"]),
        "BLOCK_O": triton.next_power_of_2(named_args["N_OUT"]),
    }
    kept = [c for c in configs if all(c.kwargs[k] <= max(cap, 16) for k, cap in caps.items())]
    return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_F"] * c.kwargs["BLOCK_D"])]


@triton.jit
def _dot_t(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ bᵀ; fp32 operands take the exact (IEEE) path, as eager fp32 matmul does."""
    if IEEE:  # an explicit else: code after a constexpr-if return is still compiled on GPU
        acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, tl.trans(b), acc)
    return acc


@triton.autotune(
    configs=_configs(),
    key=["D", "F", "N_OUT", "M_BUCKET", "HAS_B1", "DETERMINISTIC"],
    prune_configs_by={"early_config_prune": prune_configs},
    reset_to_zero=["ws_ptr"],  # tuning reruns the kernel; atomics must start from zero each time
)
@triton.jit
def _fused_mlp_kernel(
    x_ptr,
    w1_ptr,
    b1_ptr,
    w2_ptr,
    ws_ptr,
    M,
    D,
    F,
    N_OUT,
    stride_x,
    stride_w1,
    stride_w2,
    M_BUCKET,
    HAS_B1: tl.constexpr,
    DETERMINISTIC: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_O: tl.constexpr,
):
    pid_m, pid_f, pid_o = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < M
    fcols = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    f_mask = fcols < F
    ds = tl.arange(0, BLOCK_D)
    gate_ptrs = w1_ptr + fcols.to(tl.int64)[:, None] * stride_w1 + ds[None, :]
    up_ptrs = w1_ptr + (fcols + F).to(tl.int64)[:, None] * stride_w1 + ds[None, :]
    x_ptrs = x_ptr + rows[:, None] * stride_x + ds[None, :]

    # fc1: gate and up for this F-slice over all of D
    gate = tl.zeros((BLOCK_M, BLOCK_F), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_F), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d_mask = (d0 + ds) < D
        a = tl.load(x_ptrs + d0, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        w_mask = f_mask[:, None] & d_mask[None, :]
        wg = tl.load(gate_ptrs + d0, mask=w_mask, other=0.0)
        wu = tl.load(up_ptrs + d0, mask=w_mask, other=0.0)
        if UPCAST:  # the interpreter's bf16 dot is wrong; fp32 operands are exact there
            a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        gate = _dot_t(a, wg, gate, IEEE)
        up = _dot_t(a, wu, up, IEEE)
    if HAS_B1:
        gate += tl.load(b1_ptr + fcols, mask=f_mask, other=0.0).to(tl.float32)[None, :]
        up += tl.load(b1_ptr + F + fcols, mask=f_mask, other=0.0).to(tl.float32)[None, :]

    # h in registers, rounded as eager rounds it; masked F columns are silu(0) * 0 = 0
    dtype = x_ptr.dtype.element_ty
    gate, up = gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32)
    h = _silu_times_up(gate, up, dtype).to(dtype)
    if UPCAST:
        h = h.to(tl.float32)

    # fc2: this slice's partial y over this program's share of the O (= N_OUT) columns
    o_blocks_each = tl.cdiv(tl.cdiv(N_OUT, BLOCK_O), tl.num_programs(2))
    o_start = pid_o * o_blocks_each * BLOCK_O
    o_end = tl.minimum(N_OUT, o_start + o_blocks_each * BLOCK_O)
    os = tl.arange(0, BLOCK_O)
    ws_rows = ws_ptr + rows[:, None] * N_OUT
    if DETERMINISTIC:  # one [M, O] partial per F-slice, summed in order by the finishing kernel
        ws_rows += pid_f.to(tl.int64) * M * N_OUT
    for o0 in range(o_start, o_end, BLOCK_O):
        ocols = o0 + os
        o_mask = ocols < N_OUT
        w2 = tl.load(
            w2_ptr + ocols.to(tl.int64)[:, None] * stride_w2 + fcols[None, :],
            mask=o_mask[:, None] & f_mask[None, :],
            other=0.0,
        )
        if UPCAST:
            w2 = w2.to(tl.float32)
        part = _dot_t(h, w2, tl.zeros((BLOCK_M, BLOCK_O), dtype=tl.float32), IEEE)
        mask = row_mask[:, None] & o_mask[None, :]
        if DETERMINISTIC:
            tl.store(ws_rows + ocols[None, :], part, mask=mask)
        else:
            tl.atomic_add(ws_rows + ocols[None, :], part, mask=mask, sem="relaxed")


@triton.jit
def _finish_kernel(
    ws_ptr, b2_ptr, y_ptr, MO, N_OUT, SPLITS, HAS_B2: tl.constexpr, BLOCK: tl.constexpr
):
    """y = (sum of the SPLITS [M, O] partials, in order) + b2, cast once to y's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MO
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    partial = ws_ptr + offs
    for _ in range(SPLITS):
        acc += tl.load(partial, mask=mask, other=0.0)
        partial += MO
    if HAS_B2:
        acc += tl.load(b2_ptr + offs % N_OUT, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _programs_to_fill(device: torch.device) -> int:
    """How many programs fill the device once: its SM count (a small number when interpreted)."""
    if device.type != "cuda":
        return INTERPRET_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias) -> tuple[int, int, int, int]:
    """(M, D, F, O), or a clear error for any input the kernel cannot take."""
    named = {"x": x, "fc1_weight": fc1_weight, "fc2_weight": fc2_weight}
    for name, bias in (("fc1_bias", fc1_bias), ("fc2_bias", fc2_bias)):
        if bias is not None:
            named[name] = bias
    for name, t in named.items():
        if t.dtype != x.dtype or x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"fused_mlp needs every tensor in one dtype of {SUPPORTED_DTYPES}; "
                f"x is {x.dtype}, {name} is {t.dtype}"
            )
        if t.device != x.device:
            raise ValueError(f"fused_mlp: x is on {x.device} but {name} is on {t.device}")
    if not triton_runs_on(x.device):
        raise RuntimeError(
            f"fused_mlp cannot run on {x.device}: it needs CUDA, or TRITON_INTERPRET=1 "
            "set before import for CPU tensors"
        )
    if x.dim() != 2 or fc1_weight.dim() != 2 or fc2_weight.dim() != 2:
        raise ValueError("fused_mlp takes a 2D x [M, D] and 2D weights fc1 [2F, D], fc2 [O, F]")
    (m, d), (rows, f), o = x.shape, fc1_weight.shape, fc2_weight.shape[0]
    if f != d or rows % 2 or fc2_weight.shape[1] != rows // 2:
        raise ValueError(
            f"fused_mlp shapes do not chain: x {tuple(x.shape)}, fc1_weight "
            f"{tuple(fc1_weight.shape)} (want [2F, {d}]), fc2_weight {tuple(fc2_weight.shape)} "
            f"(want [O, {rows // 2}])"
        )
    for name, bias, size in (("fc1_bias", fc1_bias, rows), ("fc2_bias", fc2_bias, o)):
        if bias is not None and (tuple(bias.shape) != (size,) or bias.stride(0) != 1):
            raise ValueError(f"{name} must be a contiguous [{size}], got {tuple(bias.shape)}")
    for name in ("x", "fc1_weight", "fc2_weight"):
        if named[name].stride(1) != 1:
            raise ValueError(f"fused_mlp: {name} must be row-major (stride 1 along its last dim)")
    return m, d, rows // 2, o


def fused_mlp(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None,
    fc2_weight: torch.Tensor,
    fc2_bias: torch.Tensor | None,
    deterministic: bool | None = None,
) -> torch.Tensor:
    """y [M, O] of the SwiGLU MLP with canonical fc1, in one pass over the weights.

    ``deterministic`` defaults to ``torch.are_deterministic_algorithms_enabled()``.
    """
    m, d, f, o = _check(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias)
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    y = x.new_empty(m, o)
    if m == 0:
        return y
    block_m = min(MAX_BLOCK_M, max(16, triton.next_power_of_2(m)))
    m_blocks, programs = triton.cdiv(m, block_m), _programs_to_fill(x.device)
    if deterministic:  # room for the most F-slices any config makes
        slices = triton.cdiv(f, min(c.kwargs["BLOCK_F"] for c in _fused_mlp_kernel.configs))
        ws = torch.empty(slices, m, o, device=x.device, dtype=torch.float32)
    else:
        ws = torch.zeros(1, m, o, device=x.device, dtype=torch.float32)

    def grid(meta: dict) -> tuple[int, int, int]:  # (row blocks, F-slices, O-splits)
        f_blocks = triton.cdiv(f, meta["BLOCK_F"])
        o_splits = min(triton.cdiv(o, meta["BLOCK_O"]), triton.cdiv(programs, f_blocks * m_blocks))
        return m_blocks, f_blocks, o_splits

    _fused_mlp_kernel[grid](
        x,
        fc1_weight,
        fc1_bias if fc1_bias is not None else fc1_weight,  # unused pointer without a bias
        fc2_weight,
        ws,
        m,
        d,
        f,
        o,
        x.stride(0),
        fc1_weight.stride(0),
        fc2_weight.stride(0),
        m_bucket(m),
        HAS_B1=fc1_bias is not None,
        DETERMINISTIC=deterministic,
        UPCAST=INTERPRET,
        IEEE=x.dtype == torch.float32,
        BLOCK_M=block_m,
    )
    splits = triton.cdiv(f, _fused_mlp_kernel.best_config.kwargs["BLOCK_F"]) if deterministic else 1
    _finish_kernel[(triton.cdiv(m * o, FINISH_BLOCK),)](
        ws,
        fc2_bias if fc2_bias is not None else y,
        y,
        m * o,
        o,
        splits,
        HAS_B2=fc2_bias is not None,
        BLOCK=FINISH_BLOCK,
    )
    return y
