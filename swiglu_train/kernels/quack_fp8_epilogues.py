"""drop_h_quack's FP8-saved fc1 epilogue, on quack's ``@gemm_epilogue`` (CuTe DSL, sm_90).

One GEMM, x @ W1ᵀ, writes h (fc2's input) and the preactivation as e4m3 with its scales
(``fp8_format``'s paired format), and never stores the bf16 preactivation. A prepass over the
fp32 accumulator folds |acc| into a per-(row, 128-column group) max (quack's
``GroupedColStatsBase``, ``combine="max"``), which becomes the group's scale: amax / 448
rounded up to bf16. The main pass stores acc x (1 / scale) as e4m3 (the conversion saturates
to ±448 and keeps NaN) and writes each scale once (the stats op's ``out`` companion).

quack pairs adjacent accumulator columns (gate and up of one feature side by side), and its
statistics group adjacent columns, so a group holds 64 features' gate and up values: the
paired format, not the canonical one of the Triton path (a group per half). The groups must
divide the GEMM's N tile: the default SM90 gated tile, 192 columns, does not take 128-column
groups, so the caller pins a 128- or 256-wide tile.

Module globals, as ``quack_epilogues``: quack keys compiled kernels by the function's source
and re-imports them by name in its compile workers.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32
from cutlass._mlir.extras import types as T
from cutlass._mlir_helpers.arith import bitcast
from quack.activation import swiglu
from quack.epilogue import gemm_epilogue, unpack
from quack.epilogue.ops import GroupedColStatsBase, GroupedColStatsOut, RowVecLoad
from quack.layout_utils import convert_layout_zero_stride

from swiglu_train.kernels.fp8_format import E4M3_MAX, MIN_AMAX


class PairedBlockScale(GroupedColStatsBase):
    """Per-(row, group) absolute max -> the group's bf16 scale; the fn receives 1 / scale.

    ``stat_value`` is what the ``out`` companion writes: amax / 448 (IEEE division) raised to
    MIN_AMAX / 448 and rounded up to bf16 on its bits, as ``fp8_format.round_up_bf16``. The
    value port hands the main fn the reciprocal, computed once per (row, group) of a subtile
    rather than once per element. NaN is dropped by the max (``fmax``), so a NaN element stays
    NaN alone; an inf makes its group's scale inf, so every value of the group restores as
    NaN (0 x inf): non-finite either way, never silently finite.
    """

    combine = "max"

    @cute.jit
    def stat_value(self, total, group_cols):
        amax = cute.arch.fmax(total, Float32(MIN_AMAX))
        scale = amax / Float32(E4M3_MAX)
        bits = Int32(bitcast(Float32(scale).ir_value(), T.i32()))
        bits = (bits + Int32(0xFFFF)) & Int32(-65536)
        return Float32(bitcast(bits.ir_value(), T.f32()))

    @cute.jit
    def fn_prepare(self, gemm, state, paired):
        stats = state[0]
        c_cur, ref_layout = stats[1], stats[2]
        out = cute.make_rmem_tensor(c_cur.layout.shape, Float32)
        out_mn = convert_layout_zero_stride(out, ref_layout)
        rStats, row_base, ord_n = stats[5], stats[6], stats[7]
        for r in cutlass.range_constexpr(cute.size(out_mn, mode=[0])):
            inv = Float32(1.0) / rStats[row_base + r, ord_n]
            for c in cutlass.range(cute.size(out_mn, mode=[1]), unroll_full=True):
                out_mn[r, c] = inv
        return out


class StoredScale(PairedBlockScale):
    """The scale as the bf16 the scales buffer holds (exact: its low 16 bits are 0), for the
    ``out`` companion, whose store does not convert. It shares the value port's name, and so
    reads that op's statistics."""

    @cute.jit
    def stat_value(self, total, group_cols):
        return PairedBlockScale.stat_value(self, total, group_cols).to(BFloat16)


_SCALE = PairedBlockScale("inv_scale")
_SCALE_BIAS = PairedBlockScale("inv_scale")
_SCALES_OUT = GroupedColStatsOut("scales", StoredScale("inv_scale"))


def _abs_acc(acc):
    return {"inv_scale": cute.math.absf(acc)}


def _abs_acc_bias(acc, bias):
    return {"inv_scale": cute.math.absf(acc + bias)}


@gemm_epilogue(
    outputs=("h",),
    mode="acc_pair",
    ops={"inv_scale": _SCALE},
    prepass=_abs_acc,
    prepass_outs=("inv_scale",),
    extra_ops=(_SCALES_OUT,),
)
def swiglu_fp8_saved_epilogue(acc, inv_scale):
    """D <- the e4m3 preactivation (pairs interleaved), h <- SwiGLU; no bf16 preact stored."""
    gate, up = unpack(acc)
    return {"D": acc * inv_scale, "h": swiglu(gate, up)}


@gemm_epilogue(
    outputs=("h",),
    mode="acc_pair",
    ops={"inv_scale": _SCALE_BIAS, "bias": RowVecLoad("bias")},
    prepass=_abs_acc_bias,
    prepass_outs=("inv_scale",),
    extra_ops=(_SCALES_OUT,),
)
def swiglu_fp8_saved_bias_epilogue(acc, inv_scale, bias):
    """As swiglu_fp8_saved_epilogue, with fc1's bias (interleaved by concat_layout) added."""
    pre = acc + bias
    gate, up = unpack(pre)
    return {"D": pre * inv_scale, "h": swiglu(gate, up)}
