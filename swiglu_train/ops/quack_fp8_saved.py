"""drop_h_quack with its saved preactivation in FP8: ``ParMLP(impl="drop_h_quack", saved_fp8=True)``

Forward is one quack GEMM per backward row chunk whose epilogue (``kernels.quack_fp8_epilogues``)
writes h for fc2 and the e4m3 copy with its scales, from the fp32 accumulator: the bf16
preactivation is never stored, so forward moves 3 bytes per preactivation pair where
``drop_h``'s FP8 path moves 9 (the bf16 preact written and read back, then the copy and h).
The copy is in the paired format (``ops.fp8_paired``: quack's column order, a scale per 64
features' gate and up values), since quack's epilogue groups adjacent accumulator columns.

Backward runs in drop_h's FP8 row chunks (``ops.fp8_saved``, ``ops.fp8_chunks``: the peak
stays within drop_h's). Each chunk is one GEMM, grad_y @ W2 on its rows, whose epilogue reads
the chunk's copy and scales and writes h (for grad_W2) and the canonical grad_preact, so grad_h
never reaches memory and no kernel passes over [M, 2F] besides the GEMMs; then the chunk's
copy is freed and its grad_x and grad_W1 GEMMs run on cuBLAS. ``fused_backward=False`` keeps
the grad_h GEMM apart and reads the copy in a Triton kernel (``kernels.swiglu_fp8_paired``),
as drop_h's FP8 path does: the benchmarks' comparison.

The epilogue's groups must divide the GEMM's N tile, which quack's default SM90 gated config
(192 wide) does not: ``fp8_fc1_tile`` picks a 256- or 128-wide one. F must be a
multiple of 64 (whole groups); otherwise the call runs drop_h's FP8 path, whose format has
partial blocks.
"""

from __future__ import annotations

import functools

import torch

from swiglu_train.kernels.fp8_format import PAIRED_GROUP, paired_saved_shapes
from swiglu_train.ops.eager import eager_op
from swiglu_train.ops.fc2_node import Fc2Handoff, fc2_or_h, with_fc2_node
from swiglu_train.ops.fp8_chunks import backward_row_chunks, spans
from swiglu_train.ops.fp8_paired import swiglu_bwd_fp8_paired_
from swiglu_train.ops.fp8_saved import (
    ChunkStep,
    backward_from_copies,
    check_fp8_gpu,
    copy_buffers,
    drop_h_fp8_mlp,
    grad_h_then,
)
from swiglu_train.ops.quack_mlp import (
    CLUSTER_N,
    DEFAULT_CLUSTER_M,
    FILL_MARGIN,
    SMALL_M,
    TILE_M,
    check_quack_inputs,
    quack_fc2,
    require_quack,
    wave_fill,
)

IMPL = "drop_h_quack"
SECOND_BACKWARD_ERROR = (
    "ParMLP(impl='drop_h_quack', saved_fp8=True) freed its saved FP8 preactivation once its "
    "backward had read it, so a second backward through this graph (retain_graph=True) has "
    "nothing to read. Build the layer with inplace=False to keep it and backpropagate more "
    "than once."
)
SECOND_BACKWARD_FREED_ERROR = (
    "ParMLP(impl='drop_h_quack', saved_fp8=True): a second backward through the same graph, "
    "whose saved tensors the first backward freed (it ran without retain_graph=True). To "
    "backpropagate more than once, build the layer with inplace=False and pass "
    "retain_graph=True to every backward but the last."
)


@functools.cache
def _epilogues():
    """The CuTe-DSL epilogues, imported once quack is known to load."""
    require_quack()
    from swiglu_train.kernels import quack_fp8_epilogues

    return quack_fp8_epilogues


FP8_FC1_TILES_N = (256, 128)  # the multiples of the 128-column groups in quack's SM90 space


@functools.cache
def fp8_fc1_config(tile_n: int, cluster_m: int, cluster_n: int):
    """quack's SM90 config for the FP8 fc1 epilogue: 128 x ``tile_n``, pingpong where quack's
    SM90 gated space has it (up to 192 columns), cooperative above."""
    from quack.gemm_config import GemmConfig

    return GemmConfig(
        tile_m=TILE_M, tile_n=tile_n, pingpong=tile_n <= 192, cluster_m=cluster_m,
        cluster_n=cluster_n, is_dynamic_persistent=False,
    )  # fmt: skip


# The deepest K (D) at which the 128-wide pingpong tile beats the 256-wide cooperative one:
# the epilogue's cost per tile is fixed while the mainloop's grows with K, and pingpong hides
# the epilogue under the other warpgroup's mainloop at a smaller tile's lower operand reuse.
# Measured on the H200 (probe_quack_fp8_oos_h200.json, the fc1 GEMM alone or in the step):
# 128 faster by 4.2 % at D = 1536 and 2.4 % at 2304; 256 faster by 1.2-2.4 % at D = 3584 and
# 4096, and from 5120 up; the two meet near D = 3150. In the step at D = 2560-3584, paired
# (probe_quack_fp8_krule_h200.md): 128 faster by 0.8-1.0 points below 3072, the two within
# 0.15 points from 3072 up, so a depth just past the bound loses nothing measurable.
PINGPONG_MAX_DEPTH = 3072


@functools.lru_cache(maxsize=256)
def fp8_fc1_tile(m: int, fc1_rows: int, depth: int, sms: int) -> tuple[int, int, int]:
    """(tile_n, cluster_m, cluster_n) of the FP8 fc1 GEMM at m rows and K = ``depth``. quack's
    default tile, 192 wide, does not hold whole 128-column groups, so the tile is 256 or 128
    wide: 128 (pingpong) up to PINGPONG_MAX_DEPTH, where the epilogue is a large share of a
    tile's time; deeper, 256 (cooperative; 4.54 against 4.63 ms forward at the seed shape,
    probe_quack_fp8_h200.json) unless 128 fills the SMs' last wave FILL_MARGIN better.
    Clustered along M as quack's default, or along N up to SMALL_M rows, where one M tile
    would idle half of an M cluster (as ``small_m_tile_n``)."""
    cluster = (1, CLUSTER_N) if m <= SMALL_M else (DEFAULT_CLUSTER_M, 1)
    m_tiles = -(-m // TILE_M)
    fills = {n: wave_fill(m_tiles, -(-fc1_rows // n), *cluster, sms) for n in FP8_FC1_TILES_N}
    wide, narrow = FP8_FC1_TILES_N
    shallow = depth <= PINGPONG_MAX_DEPTH
    tile_n = narrow if shallow or fills[narrow] > FILL_MARGIN * fills[wide] else wide
    return (tile_n, *cluster)


def _fc1_tile(x: torch.Tensor, fc1_weight: torch.Tensor) -> tuple[int, int, int]:
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    return fp8_fc1_tile(x.shape[0], fc1_weight.shape[0], x.shape[1], sms)


@eager_op("swiglu_train::quack_swiglu_fp8_", mutates_args=("h", "q", "scales"))
def quack_swiglu_fp8_(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None,
    h: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
) -> None:
    """h [M, F], the paired e4m3 copy [M, 2F] and its scales from one GEMM x @ W1ᵀ on a
    canonical fc1 (read through quack's concat_layout); rows as given (a chunk's)."""
    epi = _epilogues()
    options = {
        "out": {"D": q, "h": h}, "scales": scales, "inv_scale": PAIRED_GROUP, "tuned": False,
        "concat_layout": ("B",), "config": fp8_fc1_config(*_fc1_tile(x, fc1_weight)),
    }  # fmt: skip
    if fc1_bias is None:
        epi.swiglu_fp8_saved_epilogue(x, fc1_weight.t(), **options)
    else:  # quack's order: gate and up of each feature side by side
        paired_bias = fc1_bias.view(2, -1).t().reshape(-1)
        epi.swiglu_fp8_saved_bias_epilogue(x, fc1_weight.t(), bias=paired_bias, **options)


@quack_swiglu_fp8_.register_fake
def _(x, fc1_weight, fc1_bias, h, q, scales) -> None:
    return None


@eager_op("swiglu_train::quack_dswiglu_fp8_", mutates_args=("h", "grad_preact"))
def quack_dswiglu_fp8_(
    q: torch.Tensor,
    scales: torch.Tensor,
    grad_y: torch.Tensor,
    fc2_weight: torch.Tensor,
    h: torch.Tensor,
    grad_preact: torch.Tensor,
) -> None:
    """h [M, F] and grad_preact [M, 2F] ([gate | up]) from one GEMM grad_y @ W2 whose epilogue
    reads the paired copy; grad_h never reaches memory (rows as given: a chunk's)."""
    ffn = h.shape[1]
    _epilogues().dswiglu_fp8_epilogue(
        grad_y, fc2_weight, code=q.view(torch.bfloat16), scale=scales, store_d=False,
        out={"h": h, "grad_gate": grad_preact[:, :ffn], "grad_up": grad_preact[:, ffn:]},
        tuned=False,
    )  # fmt: skip


@quack_dswiglu_fp8_.register_fake
def _(q, scales, grad_y, fc2_weight, h, grad_preact) -> None:
    return None


FUSED_STEP = ChunkStep(quack_dswiglu_fp8_, needs_grad_h=False)
UNFUSED_STEP = grad_h_then(swiglu_bwd_fp8_paired_)


class _DropHQuackFP8(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, inplace: bool, step: ChunkStep,
        handoff: Fc2Handoff | None,
    ):  # fmt: skip
        x = x.contiguous()
        fc1_weight = fc1_weight if fc1_weight.stride(1) == 1 else fc1_weight.contiguous()
        (m, d), ffn, out = x.shape, fc1_weight.shape[0] // 2, fc2_weight.shape[0]
        freed = inplace and not torch.compiler.is_compiling()  # claim_inplace_backward's
        pieces = spans(backward_row_chunks(m, d, ffn, out, x.element_size(), freed=freed))
        copies = [copy_buffers(p.stop - p.start, ffn, x, paired_saved_shapes) for p in pieces]
        h = x.new_empty(m, ffn)
        for piece, (q, scales) in zip(pieces, copies, strict=True):
            quack_swiglu_fp8_(x[piece], fc1_weight, fc1_bias, h[piece], q, scales)
        ctx.save_for_backward(x, fc1_weight, fc2_weight, *(t for c in copies for t in c))
        ctx.inplace = inplace
        ctx.has_bias = (fc1_bias is not None, fc2_bias is not None)
        ctx.backward_ran = False
        ctx.pieces, ctx.step = pieces, step
        return fc2_or_h(ctx, handoff, h, fc2_weight, fc2_bias, quack_fc2)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        errors = (SECOND_BACKWARD_ERROR, SECOND_BACKWARD_FREED_ERROR)
        return (*backward_from_copies(ctx, grad_out, ctx.step, errors), None)


def drop_h_quack_fp8_mlp(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None,
    fc2_weight: torch.Tensor,
    fc2_bias: torch.Tensor | None,
    inplace: bool = True,
    fused_backward: bool = True,
) -> torch.Tensor:
    """drop_h_quack saving its preactivation in FP8 (CUDA sm_90); ``inplace`` frees the copy
    once backward read it. F not a multiple of 64, or an empty batch, takes drop_h's FP8 path.
    ``fused_backward=False`` reads the copy in a Triton kernel after a grad_h GEMM instead of
    in the GEMM's epilogue (benchmarks compare the two)."""
    check_quack_inputs(x, fc1_weight, fc2_weight, IMPL)
    ffn = fc1_weight.shape[0] // 2
    if x.shape[0] == 0 or (2 * ffn) % PAIRED_GROUP:
        return drop_h_fp8_mlp(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, inplace)
    if not torch.compiler.is_compiling():
        check_fp8_gpu(x.get_device())
    return with_fc2_node(
        _DropHQuackFP8, x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, inplace,
        FUSED_STEP if fused_backward else UNFUSED_STEP, fc2=quack_fc2,
    )  # fmt: skip
