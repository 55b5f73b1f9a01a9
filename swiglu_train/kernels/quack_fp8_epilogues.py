"""drop_h_quack's FP8-saved epilogues, on quack's ``@gemm_epilogue`` (CuTe DSL, sm_90).

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

Backward is one GEMM per row chunk, grad_h = grad_y @ W2, whose epilogue reads the copy back
(``dswiglu_fp8_epilogue``): each feature's e4m3 gate and up bytes arrive as one 16-bit element
of a bf16 view of the copy (a TileLoad), PTX's ``cvt.rn.f16x2.e4m3x2`` decodes both, and
``LoadedGroupScale`` hands each element its group's scale; the epilogue writes h and the
canonical grad_preact halves, and grad_h never reaches memory.

Module globals, as ``quack_epilogues``: quack keys compiled kernels by the function's source
and re-imports them by name in its compile workers.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, const_expr
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass._mlir.extras import types as T
from cutlass._mlir_helpers.arith import bitcast
from cutlass.cutlass_dsl import dsl_user_op
from quack.activation import dswiglu, swiglu
from quack.compile_utils import make_fake_tensor
from quack.cute_dsl_utils import torch2cute_dtype_map
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


@dsl_user_op
def e4m3x2_from_bf16_bits(code: Float32, *, loc=None, ip=None) -> tuple[Float32, Float32]:
    """The two e4m3 values whose bytes a bf16 element held (low byte first), as fp32.

    ``code`` is that element widened to fp32, so its upper 16 bits are the two bytes: one
    ``cvt.rn.f16x2.e4m3x2`` (exact, subnormals and NaN included) and two f16 -> f32.
    """
    res = llvm.inline_asm(
        ir.Type.parse("!llvm.struct<(f32, f32)>"),
        [Float32(code).ir_value(loc=loc, ip=ip)],
        "{.reg .b16 lo, hi; .reg .b32 pair; .reg .f16 a, b;\n\t"
        "mov.b32 {lo, hi}, $2;\n\t"
        "cvt.rn.f16x2.e4m3x2 pair, hi;\n\t"
        "mov.b32 {a, b}, pair;\n\t"
        "cvt.f32.f16 $0, a;\n\t"
        "cvt.f32.f16 $1, b;}",
        "=f,=f,f",
        has_side_effects=False,
        loc=loc,
        ip=ip,
    )
    f32 = T.f32()
    return (
        Float32(llvm.extractvalue(f32, res, [0], loc=loc, ip=ip)),
        Float32(llvm.extractvalue(f32, res, [1], loc=loc, ip=ip)),
    )


class LoadedGroupScale(GroupedColStatsBase):
    """A per-(row, group of 64 columns) value loaded from a [M, N / 64] tensor, handed to the
    fn per element: the paired copy's scales in the grad_h GEMM, whose N is the features.

    It reuses the grouped statistics' register slots and value port, filled at the start of
    each tile by one load per slot a thread owns instead of by a prepass over the accumulator.
    Slots past M's rows or past N's groups (a last N tile that F does not fill, as 192-wide
    tiles at F = 8192) read 1, never the memory after the scales: reading there crashed the
    1B model with an illegal address. The GEMM's N tile must hold whole groups.
    """

    GROUP = 64

    def host_arg_key(self, value):
        return (torch2cute_dtype_map[value.dtype],)

    def host_fake_arg(self, key, fctx):
        return make_fake_tensor(key[0], (fctx.m, cute.sym_int()), leading_dim=1, divisibility=1)

    def host_validate(self, value, *, m, n, tile_N, **_):
        if tuple(value.shape) != (m, n // self.GROUP) or n % self.GROUP:
            raise ValueError(
                f"'{self.name}': expected scales of shape ({m}, {n} / {self.GROUP}), got "
                f"{tuple(value.shape)}"
            )
        if tile_N % self.GROUP:
            raise ValueError(f"'{self.name}': tile_N={tile_N} must hold whole {self.GROUP}s")

    def _group_cols(self, arg):
        return self.GROUP

    @cute.jit
    def begin(self, gemm, param, smem_tensor, ctx):
        state = self.stats_begin(gemm, smem_tensor, ctx, const_expr(self.GROUP))
        _, t_dcc, ref_layout, group_cols, _, r_stats, geom = state[:7]
        rows_sub, n_e, epi_m_cnt, n_ords = geom
        per_ord = const_expr(max(1, group_cols // n_e))
        row0 = ctx.tile_coord_mnkl[0] * ctx.tile_M
        col0 = ctx.tile_coord_mnkl[1] * ctx.tile_N
        for em in cutlass.range_constexpr(epi_m_cnt):
            for o in cutlass.range_constexpr(n_ords):
                c_mn = convert_layout_zero_stride(
                    t_dcc[None, None, None, (em, o * per_ord)], ref_layout
                )
                for r in cutlass.range_constexpr(rows_sub):
                    coord = c_mn[r, 0]
                    row = row0 + coord[0]
                    group = (col0 + coord[1]) // group_cols
                    value = Float32(1.0)
                    if row < param.shape[0] and group < param.shape[1]:
                        value = param[row, group].to(Float32)
                    r_stats[em * rows_sub + r, o] = value
        return (state,)


_GRAD_SCALE = LoadedGroupScale("scale")


@gemm_epilogue(outputs=("h", "grad_gate", "grad_up"), ops={"scale": _GRAD_SCALE})
def dswiglu_fp8_epilogue(acc, code, scale):
    """grad_h GEMM: acc = grad_h; code = a feature's e4m3 gate and up bytes (a bf16 view of
    the paired copy), scale = its group's; h and the canonical grad_preact halves out."""
    gate, up = e4m3x2_from_bf16_bits(code)
    grad_gate, grad_up, h = dswiglu(gate * scale, up * scale, acc)
    return {"h": h, "grad_gate": grad_gate, "grad_up": grad_up}
