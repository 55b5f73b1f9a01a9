"""drop_h with its saved preactivation stored in FP8: ``ParMLP(impl="drop_h", saved_fp8=True)``.

What is saved for backward: x, and the [M, 2F] preactivation as float8_e4m3fn values with one
bf16 scale per row per 128 columns of each half (``kernels.fp8_format``): M*2F bytes plus
M*2*ceil(F/128)*2, about half of drop_h's M*2F*2 for bf16. Forward's h (for fc2, so y) comes
from the bf16 preactivation, as in drop_h; backward recomputes h (for grad_W2) and grad_preact
from the dequantized copy.

Why this format. e4m3 keeps 3 mantissa bits (relative rounding error <= 2**-4, about 2.4 %
rms for spread-out mantissas); e5m2's extra range is not needed once each block is scaled to
its own absolute max, and it would double that error. A scale per 128 columns (DeepSeek-V3's
activation tiles) keeps an outlier from costing more than its own block: with one scale per
row and half, it pushes the whole row's small values toward e4m3's subnormals, where the
rounding is coarser. The scale is amax / 448 rounded up to bf16, so a block's max lands
within 2**-7 of 448 and is stored nearly exactly; where a few features dominate, their error
is most of the gradients', and that is what a scale buys. fp32 scales (the format before)
store the max exactly, for 9.5 MiB a layer at the seed shape instead of 4.8; power-of-two
scales (OCP MX's E8M0, 2.4 MiB) round the max like any value and so lose most of that gain.
Measured on CPU (``benchmarks/measure_fp8_saved.py``, docs/fp8.md): relative (Frobenius) error
of the gradients against float64 on the same bf16 inputs, over three shapes up to
[1024, 512, 1408]:

    input             saved as                     grad_x     grad_W1    grad_W2
    random            bf16 (drop_h)                0.34 %     0.34 %     0.39 %
                      e4m3, 1x128, bf16 scales     2.94 %     2.94 %     4.04 %
                      e4m3, 1x128, fp32 scales     2.94 %     2.94 %     4.05 %
                      e4m3, 1x128, power of two    3.05 %     3.04 %     4.20 %
                      e4m3, 1 per row, bf16        3.02 %     3.02 %     4.15 %
                      e5m2, 1x128, bf16            5.84 %     5.84 %     8.04 %
    8 features x50    bf16                         0.35 %     0.35 %     0.37 %
                      e4m3, 1x128, bf16 scales     2.25 %     1.29 %     3.05 %
                      e4m3, 1x128, fp32 scales     2.25 %     1.25 %     2.97 %
                      e4m3, 1x128, power of two    2.87 %     2.99 %     3.96 %
                      e4m3, 1 per row, bf16        2.49 %     2.00 %     3.41 %

(worst shape shown). The FP8 errors are e4m3's rounding itself, 3.4-10x the bf16 path's: the
issue's "within 2x of bf16" is not met, and cannot be with 3 mantissa bits. y is drop_h's, to
the fc1 GEMM's rounding on a chunk's rows (below; exactly, in one chunk).

Both passes run in chunks of rows (``ops.fp8_chunks``), so that the step's peak stays within
drop_h's: the bf16 preactivation and grad_preact never exist whole next to the copy.
grad_preact cannot go in place over the 1-byte copy, so each backward chunk's kernel writes it
into a buffer of its own. The copy is saved as one allocation per backward chunk, and each is
freed once its kernel read it, so later chunks have its bytes to spare. At the seed shape
[11136, 3584, 14336, 3584] bf16: forward 2 chunks of 5632 rows, 997.9 MiB, backward 3 chunks
of 3840, 3840 and 3456 rows, 1065.4 MiB, against drop_h's 1087.6. Before chunking both were
1303.6 (the whole bf16 preactivation, or grad_preact, beside the copy and h or grad_h).

The accumulated gradient stays in the parameters' dtype: an fp32 grad_W1 would hold 2F*D*4
bytes, 196 MiB more than bf16's at the seed shape, more than the backward's buffers may take.
The bf16 rounding per chunk raises grad_W1's error against float64 by 0.4 % of itself at six
row chunks (2.917 % -> 2.930 % on CPU, [6144, 256, 704], with fp32 scales;
tests/test_fp8_saved_chunked.py bounds it at 2 %).
With ``inplace`` (the default) the copy and its scales are freed as the loop reads them, so
the graph cannot be backpropagated twice (``inplace=False`` keeps them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from swiglu_train.kernels.fp8_format import (
    BLOCK,
    E4M3_MAX,
    FP8_DTYPE,
    MIN_AMAX,
    SCALE_DTYPE,
    capability_error,
    n_blocks,
    restore,
    round_up_bf16,
    saved_shapes,
)
from swiglu_train.kernels.runtime import device_capability
from swiglu_train.ops import reference
from swiglu_train.ops.activation import torch_amaxes, triton_enabled
from swiglu_train.ops.eager import eager_op
from swiglu_train.ops.fc2_node import Fc2Handoff, fc2_grad_y, fc2_or_h, with_fc2_node
from swiglu_train.ops.fp8_chunks import (
    backward_row_chunks,
    row_chunks,
    rows_per_chunk,
    spans,
    uniform_rows,
)
from swiglu_train.ops.mlp import claim_inplace_backward, refuse_double_backward

try:
    from swiglu_train.kernels import swiglu_fp8 as kernels
except ImportError:  # no Triton on this platform: the torch path serves everything
    kernels = None

SECOND_BACKWARD_ERROR_FP8 = (
    "ParMLP(impl='drop_h', saved_fp8=True) freed its saved FP8 preactivation once its backward "
    "had read it, so a second backward through this graph (retain_graph=True) has nothing to "
    "read. Build the layer with inplace=False to keep it and backpropagate more than once."
)
SECOND_BACKWARD_FREED_ERROR_FP8 = (
    "ParMLP(impl='drop_h', saved_fp8=True): a second backward through the same graph, whose "
    "saved tensors the first backward freed (it ran without retain_graph=True). To "
    "backpropagate more than once, build the layer with inplace=False and pass "
    "retain_graph=True to every backward but the last."
)


def check_fp8_gpu(device_index: int) -> None:
    """A ValueError naming the reason when CUDA device ``device_index`` cannot run the FP8
    kernels (``fp8_format.MIN_CAPABILITY``)."""
    reason = capability_error(device_capability(device_index), f"cuda:{device_index}")
    if reason is not None:
        raise ValueError(reason)


def quantize(preact: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values [M, 2F], bf16 scales [M, 2*ceil(F/128)]) of a [M, 2F] preactivation, in
    torch: the bytes the Triton forward writes (same operations, same order)."""
    m, ffn = preact.shape[0], preact.shape[1] // 2
    nb = n_blocks(ffn)
    halves = F.pad(preact.float().view(m, 2, ffn), (0, nb * BLOCK - ffn))
    blocks = halves.view(m, 2, nb, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True).clamp_min(MIN_AMAX)  # NaN stays NaN
    # Two tensors divide exactly, as the kernel's div_rn; with a Python number torch computes
    # ``1 / t`` (and on CUDA ``t / 448``) through a reciprocal, one rounding more.
    scale = round_up_bf16(amax / torch.full_like(amax, E4M3_MAX))
    q = (blocks * (torch.ones_like(scale) / scale)).clamp(-E4M3_MAX, E4M3_MAX)
    q = q.view(m, 2, nb * BLOCK)[..., :ffn].reshape(m, 2 * ffn).to(FP8_DTYPE)
    return q, scale.view(m, 2 * nb).to(SCALE_DTYPE)  # exact: its low 16 bits are 0


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 [M, 2F] preactivation an FP8 copy stands for."""
    m, ffn = q.shape[0], q.shape[1] // 2
    per_column = scales.view(m, 2, n_blocks(ffn)).repeat_interleave(BLOCK, dim=-1)[..., :ffn]
    return restore(q.float().view(m, 2, ffn), per_column.float()).view(m, 2 * ffn)


def recompute(
    q: torch.Tensor, scales: torch.Tensor, grad_h: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, grad_preact) in grad_h's dtype from the FP8 copy, in torch."""
    return recompute_from(dequantize(q, scales), grad_h)


def recompute_from(preact: torch.Tensor, grad_h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, grad_preact) in grad_h's dtype from a dequantized fp32 preactivation: the Triton
    backward's math (fp32, silu rounded to the dtype before the product)."""
    gate, up = torch.chunk(preact, 2, dim=-1)
    h = (F.silu(gate).to(grad_h.dtype).float() * up).to(grad_h.dtype)
    return h, reference.swiglu_grad(preact, grad_h).to(grad_h.dtype)


@eager_op("swiglu_train::swiglu_fwd_fp8_", mutates_args=("h", "q", "scales"))
def swiglu_fwd_fp8_(
    preact: torch.Tensor, h: torch.Tensor, q: torch.Tensor, scales: torch.Tensor
) -> None:
    """h, the e4m3 copy and its scales of a [M, 2F] canonical preact (a chunk's rows), written
    into the given buffers (the copy's from ``copy_buffers``) in one pass over it."""
    if not triton_enabled(preact):
        h.copy_(reference.swiglu(preact))
        for buffer, value in zip((q, scales), quantize(preact), strict=True):
            buffer.copy_(value)
        return
    kernels.swiglu_forward_fp8(preact, h, q, scales)


@swiglu_fwd_fp8_.register_fake
def _(preact: torch.Tensor, h: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
    return None


def copy_buffers(
    m: int, ffn: int, like: torch.Tensor, shapes=saved_shapes
) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (e4m3 values [m, 2F], bf16 scales) for m rows' copy, on ``like``'s device; the
    shapes of the canonical format, or of the format ``shapes`` gives."""
    q_shape, scale_shape = shapes(m, ffn)
    return like.new_empty(q_shape, dtype=FP8_DTYPE), like.new_empty(scale_shape, dtype=SCALE_DTYPE)


@eager_op("swiglu_train::swiglu_bwd_fp8_", mutates_args=("grad_h", "grad_preact"))
def swiglu_bwd_fp8_(
    q: torch.Tensor, scales: torch.Tensor, grad_h: torch.Tensor, grad_preact: torch.Tensor
) -> None:
    """grad_preact [M, 2F] into the given buffer, and h over grad_h [M, F] (a chunk's rows)."""
    if not triton_enabled(grad_h):
        h, grad = recompute(q, scales, grad_h)
        grad_h.copy_(h)
        grad_preact.copy_(grad)
        return
    kernels.swiglu_backward_fp8(q, scales, grad_h, grad_preact)


@swiglu_bwd_fp8_.register_fake
def _(q: torch.Tensor, scales: torch.Tensor, grad_h: torch.Tensor, grad_preact: torch.Tensor):
    return None


@eager_op("swiglu_train::swiglu_bwd_fp8_amax_", mutates_args=("grad_h", "grad_preact"))
def swiglu_bwd_fp8_amax_(
    q: torch.Tensor,
    scales: torch.Tensor,
    grad_h: torch.Tensor,
    grad_preact: torch.Tensor,
    rowwise: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``swiglu_bwd_fp8_`` and the amaxes an FP8 recipe scales grad_preact and h by, found as
    they are written (``activation.swiglu_bwd_recompute_amax_``'s: [2] and [M, 1] or [0, 1])."""
    if not triton_enabled(grad_h):
        swiglu_bwd_fp8_(q, scales, grad_h, grad_preact)
        return torch_amaxes(grad_preact, grad_h, rowwise)
    pair, rows = kernels.swiglu_backward_fp8(q, scales, grad_h, grad_preact, True, rowwise)
    return pair, rows if rowwise else grad_h.new_empty(0, 1, dtype=torch.float32)


@swiglu_bwd_fp8_amax_.register_fake
def _(q, scales, grad_h, grad_preact, rowwise: bool):
    rows = grad_h.shape[0] if rowwise else 0
    return grad_h.new_empty(2, dtype=torch.float32), grad_h.new_empty(rows, 1, dtype=torch.float32)


class _DropHFP8(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, inplace: bool, rows, lengths,
        handoff: Fc2Handoff | None,
    ):  # fmt: skip
        (m, d), ffn, out = x.shape, fc1_weight.shape[0] // 2, fc2_weight.shape[0]
        freed = inplace and not torch.compiler.is_compiling()  # claim_inplace_backward's
        lengths = lengths or backward_row_chunks(m, d, ffn, out, x.element_size(), freed=freed)
        # The copy in one allocation per row chunk of backward, which frees each once read
        pieces = spans(lengths)
        copies = [copy_buffers(p.stop - p.start, ffn, x) for p in pieces]
        h = x.new_empty(m, ffn)
        chunk = rows or rows_per_chunk(m, d, ffn, out, x.element_size())
        buffer = x.new_empty(min(chunk, m), 2 * ffn)  # one chunk's preact, reused
        for part in row_chunks(m, chunk):
            preact = buffer[: part.stop - part.start]
            if fc1_bias is None:
                torch.mm(x[part], fc1_weight.t(), out=preact)
            else:
                torch.addmm(fc1_bias, x[part], fc1_weight.t(), out=preact)
            for piece, (q, scales) in zip(pieces, copies, strict=True):  # the kernel per piece
                lo, hi = max(part.start, piece.start), min(part.stop, piece.stop)
                if lo < hi or m == 0:
                    rows_in = slice(lo - piece.start, hi - piece.start)
                    at = slice(lo - part.start, hi - part.start)
                    swiglu_fwd_fp8_(preact[at], h[lo:hi], q[rows_in], scales[rows_in])
        del buffer, preact  # freed before fc2's output is allocated: only the FP8 copy is kept
        ctx.save_for_backward(x, fc1_weight, fc2_weight, *(t for c in copies for t in c))
        ctx.inplace = inplace
        ctx.has_bias = (fc1_bias is not None, fc2_bias is not None)
        ctx.backward_ran = False
        ctx.pieces = pieces
        return fc2_or_h(ctx, handoff, h, fc2_weight, fc2_bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        errors = (SECOND_BACKWARD_ERROR_FP8, SECOND_BACKWARD_FREED_ERROR_FP8)
        step = grad_h_then(swiglu_bwd_fp8_)
        return (*backward_from_copies(ctx, grad_out, step, errors), None, None)


def backward_from_copies(ctx, grad_out: torch.Tensor, step, errors: tuple[str, str]) -> tuple:
    """The FP8-saved backward of a Function whose forward saved x, fc1's and fc2's weights and
    one (values, scales) copy per row chunk (``ctx.pieces``): the gradients of x, W1, b1, W2,
    b2, then None for the inplace flag and the fc2 handoff. ``step`` reads a chunk's copy (its
    format) and writes h and grad_preact (``_backward_rows``); ``errors`` are the
    second-backward messages."""
    refuse_double_backward()
    consume = claim_inplace_backward(ctx, *errors)
    x, fc1_weight, fc2_weight, *flat = ctx.saved_tensors
    copies = list(zip(flat[::2], flat[1::2], strict=True))
    needs = list(ctx.needs_input_grad[:5])
    needs[2], needs[4] = needs[2] and ctx.has_bias[0], needs[4] and ctx.has_bias[1]
    grad_y = fc2_grad_y(ctx, grad_out)
    grad_x, grad_w1, grad_b1, grad_w2 = _backward_rows(
        grad_y, x, fc1_weight, fc2_weight, copies, ctx.pieces, consume, needs, step
    )
    grad_b1 = grad_b1.to(grad_y.dtype) if needs[2] else None
    grad_b2 = grad_y.sum(0) if needs[4] else None
    return grad_x, grad_w1, grad_b1, grad_w2, grad_b2, None, None


def free_copy(consume: bool, *saved: torch.Tensor) -> None:
    """With ``consume``, a copy and its scales, read for the last time: their memory goes back
    now, whatever else still references them (autograd's saved-tensor slots)."""
    if consume:
        for t in saved:
            t.untyped_storage().resize_(0)


class ChunkStep(NamedTuple):
    """How a backward chunk makes its h and grad_preact from its copy:
    ``run(q, scales, grad_y, fc2_weight, h, grad_preact)`` on the chunk's rows. With
    ``needs_grad_h`` the loop first puts grad_h in h (one GEMM over all rows) for run to read
    there; without, run makes grad_h itself (a GEMM whose epilogue reads the copy)."""

    run: Callable[..., None]
    needs_grad_h: bool


def grad_h_then(kernel: Callable[..., None]) -> ChunkStep:
    """The step of a kernel(q, scales, h, grad_preact) that reads grad_h from h's rows and
    writes h over it, and grad_preact."""
    return ChunkStep(lambda q, s, grad_y, w2, h, grad_preact: kernel(q, s, h, grad_preact), True)


def _backward_rows(grad_y, x, fc1_weight, fc2_weight, copies, pieces, consume, needs, step):
    """(grad_x, grad_W1, grad_b1 in fp32, grad_W2) over chunks of rows of M (``pieces``), one
    saved copy each, freed once ``step`` read it; ``step`` writes a chunk's h and its
    grad_preact (from grad_h the loop computed first, if it ``needs_grad_h``, or from
    grad_y and W2 itself). grad_W1 is accumulated by the GEMM (beta = 1), grad_W2 comes after
    the loop."""
    need_x, need_w1, need_b1, need_w2, _ = needs
    if step.needs_grad_h:
        h = grad_y @ fc2_weight  # grad_h; each chunk's kernel writes h over its rows
    else:
        h = grad_y.new_empty(grad_y.shape[0], fc2_weight.shape[1])
    (m, ffn), d = h.shape, x.shape[1]
    grad_x = h.new_empty(m, d) if need_x else None
    grad_w1 = grad_b1 = None
    for part, (q, scales) in zip(pieces, copies, strict=True):
        grad_preact = h.new_empty(part.stop - part.start, 2 * ffn)  # this chunk's only
        step.run(q, scales, grad_y[part], fc2_weight, h[part], grad_preact)
        free_copy(consume, q, scales)
        if need_x:
            torch.mm(grad_preact, fc1_weight, out=grad_x[part])
        if need_w1:  # accumulated in the parameters' dtype (module docstring)
            if grad_w1 is None:
                grad_w1 = grad_preact.t() @ x[part]
            else:
                grad_w1.addmm_(grad_preact.t(), x[part])
        if need_b1:  # in fp32, rounded once, like the unchunked sum
            column_sums = grad_preact.sum(0, dtype=torch.float32)
            grad_b1 = column_sums if grad_b1 is None else grad_b1.add_(column_sums)
        del grad_preact  # before the next chunk's is allocated
    grad_w2 = grad_y.t() @ h if need_w2 else None
    return grad_x, grad_w1, grad_b1, grad_w2


def drop_h_fp8_mlp(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None,
    fc2_weight: torch.Tensor,
    fc2_bias: torch.Tensor | None,
    inplace: bool = True,
    chunk_rows: int | None = None,
    backward_rows: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """drop_h saving its preactivation in FP8; ``inplace`` frees it once backward read it.
    ``chunk_rows`` sets the rows per chunk of forward, and of backward unless
    ``backward_rows`` gives each backward chunk's rows. Unset, ``ops.fp8_chunks``' rules
    choose (benchmarks and tests set them)."""
    if chunk_rows is not None and (type(chunk_rows) is not int or chunk_rows < 1):
        raise ValueError(f"chunk_rows must be a positive int or None, got {chunk_rows!r}")
    m = x.shape[0]
    if backward_rows is None and chunk_rows is not None:
        backward_rows = uniform_rows(m, chunk_rows)
    if backward_rows is not None and (
        not backward_rows or sum(backward_rows) != m or min(backward_rows) < (1 if m else 0)
    ):
        raise ValueError(
            f"backward_rows {backward_rows} must cover x's {m} rows once, in chunks of at "
            "least 1 row"
        )
    # Before any GEMM: the kernels would fail to compile. Not while torch.compile traces this
    # (it would trace torch's capability query into the graph); pretrain checks before the run.
    if x.is_cuda and not torch.compiler.is_compiling() and triton_enabled(x):
        check_fp8_gpu(x.get_device())
    return with_fc2_node(
        _DropHFP8, x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, inplace, chunk_rows, backward_rows
    )
