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
within 2**-8 of 448 and is stored nearly exactly; where a few features dominate, their error
is most of the gradients', and that is what a scale buys. fp32 scales (the format before)
store the max exactly, for 9.5 MiB a layer at the seed shape instead of 4.8; power-of-two
scales (OCP MX's E8M0, 2.4 MiB) round the max like any value and so lose most of that gain.
Measured on CPU (``scripts/measure_fp8_saved.py``, docs/fp8.md): relative (Frobenius) error
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

Both passes run in chunks of rows (``rows_per_chunk``), so that the step's peak stays within
drop_h's: the bf16 preactivation and grad_preact never exist whole next to the copy. Forward:
each chunk's preactivation goes into one [rows, 2F] buffer reused across chunks (fc1's GEMM,
out=), and the kernel writes that chunk's h, copy and scales rows. Backward: grad_preact cannot
go in place over the 1-byte copy, so each chunk's kernel writes it into one reused buffer, and
h over grad_h's rows; the chunk's grad_x rows (out=) and its share of grad_W1 (accumulated by
the GEMM, beta = 1) and grad_b1 (in fp32) follow. grad_W2 comes after the loop.

The rows are the most that keep each loop's live set within drop_h's backward peak, x + the
preact + grad_h + grad_W2 (``drop_h_backward_peak``): forward holds x, h,
the copy and scales and the buffer (``fp8_forward_peak``); backward x, the copy and scales,
grad_h, grad_x, grad_W1 and the buffer (``fp8_backward_peak``). At the seed shape
[11136, 3584, 14336, 3584] bf16: forward 2 chunks of 5632 rows, 997.9 MiB, backward 6 of 1920,
1067.0 MiB, against drop_h's 1087.6. Before chunking both were 1303.6 (the whole bf16
preactivation, or grad_preact, beside the copy and h or grad_h). Rows are multiples of 128 and
at least 1024, so that a chunk's GEMMs keep rows enough to fill the GPU; that floor wins over
the bound at small D and O against F. ``scripts/probe_fp8_chunks.py`` times the chunked step.

grad_W1 accumulates in the parameters' dtype: an fp32 accumulator would hold 2F*D*4 bytes, 196
MiB more than bf16's at the seed shape, above the whole 121 MiB the backward's buffer may take,
so the peak could not stay within drop_h's. The bf16 rounding per chunk raises grad_W1's error
against float64 by 0.4 % of itself at six chunks (2.917 % -> 2.930 % on CPU, [6144, 256, 704],
with fp32 scales; tests/test_fp8_saved_chunked.py bounds it at 2 %). With ``inplace`` (the
default) the copy and its scales are freed after the loop, before grad_W2 is allocated, so
the graph cannot be backpropagated twice (``inplace=False`` keeps them).
"""

from __future__ import annotations

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
from swiglu_train.ops.activation import triton_enabled
from swiglu_train.ops.eager import eager_op
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
    into the given buffers (``saved_buffers``) in one pass over it."""
    if not triton_enabled(preact):
        h.copy_(reference.swiglu(preact))
        for buffer, value in zip((q, scales), quantize(preact), strict=True):
            buffer.copy_(value)
        return
    kernels.swiglu_forward_fp8(preact, h, q, scales)


@swiglu_fwd_fp8_.register_fake
def _(preact: torch.Tensor, h: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
    return None


def saved_buffers(m: int, ffn: int, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Empty (h [m, F] in ``like``'s dtype, e4m3 values [m, 2F], bf16 scales) on its device."""
    q_shape, scale_shape = saved_shapes(m, ffn)
    h = like.new_empty(m, ffn)
    return (
        h,
        like.new_empty(q_shape, dtype=FP8_DTYPE),
        like.new_empty(scale_shape, dtype=SCALE_DTYPE),
    )


# Rows per chunk: a multiple of ROW_ALIGN (whole GEMM tiles), and at least
# MIN_CHUNK_ROWS unless M is smaller, so the per-chunk GEMMs keep enough rows to fill the GPU.
ROW_ALIGN = 128
MIN_CHUNK_ROWS = 1024


def drop_h_backward_peak(m: int, d: int, ffn: int, out: int, itemsize: int) -> int:
    """Bytes drop_h's in-place backward holds at its peak, parameters and grad_y aside: x and
    the preact with grad_h and grad_W2 (h's last use), or with grad_W2, grad_x and grad_W1 (the
    preact's buffer then holds grad_preact)."""
    x, preact, grad_w2 = m * d, 2 * m * ffn, out * ffn
    first = x + preact + m * ffn + grad_w2
    return itemsize * max(first, x + preact + grad_w2 + m * d + 2 * ffn * d)


def fp8_forward_peak(m: int, d: int, ffn: int, itemsize: int, rows: int) -> int:
    """Bytes the FP8 forward holds at its peak, in its chunk loop, parameters aside: x, h, the
    FP8 copy and its scales, and one [rows, 2F] preact buffer (freed before fc2's y)."""
    return _copy_bytes(m, ffn) + itemsize * (m * d + m * ffn + min(rows, m) * 2 * ffn)


def fp8_backward_peak(m: int, d: int, ffn: int, itemsize: int, rows: int) -> int:
    """Bytes the FP8 backward holds at its peak, in its chunk loop, parameters and grad_y
    aside: x, the FP8 copy and its scales, grad_h (becoming h), grad_x, grad_W1 and one
    [rows, 2F] grad_preact buffer. grad_W2 comes after the loop, once the copy is freed."""
    held = 2 * m * d + m * ffn + 2 * ffn * d + min(rows, m) * 2 * ffn
    return _copy_bytes(m, ffn) + itemsize * held


def _copy_bytes(m: int, ffn: int) -> int:
    values, scales = saved_shapes(m, ffn)
    return values[0] * values[1] * FP8_DTYPE.itemsize + scales[0] * scales[1] * SCALE_DTYPE.itemsize


def rows_per_chunk(m: int, d: int, ffn: int, out: int, itemsize: int, *, forward: bool) -> int:
    """Rows per chunk of the FP8 forward or backward, for x [m, d], F = ffn and O = out: the
    most that keep its peak (``fp8_forward_peak``, ``fp8_backward_peak``) within
    ``drop_h_backward_peak``, drop_h's peak over the step, rounded down to ROW_ALIGN, then
    evened out over the chunks that takes (a short last chunk wastes a GEMM launch).

    MIN_CHUNK_ROWS wins over the bound where the two disagree (the backward at small O and D
    against F, as at [4096, 1024, 2816, 1024]): the peak is then above drop_h's by the
    difference, which smaller chunks would buy back in GEMM time.
    """
    if m <= MIN_CHUNK_ROWS:
        return max(m, 1)
    peak = fp8_forward_peak if forward else fp8_backward_peak
    spare = drop_h_backward_peak(m, d, ffn, out, itemsize) - peak(m, d, ffn, itemsize, 0)
    fits = spare // max(2 * ffn * itemsize, 1)
    rows = max(fits // ROW_ALIGN * ROW_ALIGN, MIN_CHUNK_ROWS)
    if rows >= m:
        return m
    chunks = -(-m // rows)
    even = -(-m // (chunks * ROW_ALIGN)) * ROW_ALIGN  # ceil(m / chunks), up to ROW_ALIGN
    return max(even, MIN_CHUNK_ROWS)


def row_chunks(m: int, rows: int) -> list[slice]:
    """Row ranges of ``rows`` rows, the last one shorter; for m = 0 one empty range, so the
    loop still writes grad_W1's zeros."""
    return [slice(start, min(start + rows, m)) for start in range(0, max(m, 1), rows)]


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


class _DropHFP8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, inplace: bool, rows):
        (m, d), ffn = x.shape, fc1_weight.shape[0] // 2
        chunk = rows or rows_per_chunk(
            m, d, ffn, fc2_weight.shape[0], x.element_size(), forward=True
        )
        h, q, scales = saved_buffers(m, ffn, x)
        buffer = x.new_empty(min(chunk, m), 2 * ffn)  # one chunk's preact, reused
        for part in row_chunks(m, chunk):
            preact = buffer[: part.stop - part.start]
            if fc1_bias is None:
                torch.mm(x[part], fc1_weight.t(), out=preact)
            else:
                torch.addmm(fc1_bias, x[part], fc1_weight.t(), out=preact)
            swiglu_fwd_fp8_(preact, h[part], q[part], scales[part])
        del buffer, preact  # freed before fc2's output is allocated: only the FP8 copy is kept
        ctx.save_for_backward(x, fc1_weight, fc2_weight, q, scales)
        ctx.inplace = inplace
        ctx.has_bias = (fc1_bias is not None, fc2_bias is not None)
        ctx.backward_ran = False
        ctx.rows = rows
        return F.linear(h, fc2_weight, fc2_bias)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        refuse_double_backward()
        consume = claim_inplace_backward(
            ctx, SECOND_BACKWARD_ERROR_FP8, SECOND_BACKWARD_FREED_ERROR_FP8
        )
        x, fc1_weight, fc2_weight, q, scales = ctx.saved_tensors
        need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:5]
        need_b1, need_b2 = need_b1 and ctx.has_bias[0], need_b2 and ctx.has_bias[1]
        grad_y = grad_y.contiguous()
        h = grad_y @ fc2_weight  # grad_h; each chunk's kernel writes h over its rows
        (m, ffn), d = h.shape, x.shape[1]
        rows = ctx.rows or rows_per_chunk(
            m, d, ffn, grad_y.shape[1], h.element_size(), forward=False
        )
        grad_x = h.new_empty(m, d) if need_x else None
        grad_w1 = grad_b1 = None
        buffer = h.new_empty(min(rows, m), 2 * ffn)  # one chunk's grad_preact, reused
        for part in row_chunks(m, rows):
            grad_preact = buffer[: part.stop - part.start]
            swiglu_bwd_fp8_(q[part], scales[part], h[part], grad_preact)
            if need_x:
                torch.mm(grad_preact, fc1_weight, out=grad_x[part])
            if need_w1:  # accumulated by the GEMM in the parameters' dtype (module docstring)
                if grad_w1 is None:
                    grad_w1 = grad_preact.t() @ x[part]
                else:
                    grad_w1.addmm_(grad_preact.t(), x[part])
            if need_b1:  # in fp32, rounded once, like the unchunked sum
                column_sums = grad_preact.sum(0, dtype=torch.float32)
                grad_b1 = column_sums if grad_b1 is None else grad_b1.add_(column_sums)
        del buffer, grad_preact
        if consume:  # read for the last time: free it before grad_W2 is allocated
            q.untyped_storage().resize_(0)
            scales.untyped_storage().resize_(0)
        del q, scales
        grad_w2 = grad_y.t() @ h if need_w2 else None
        del h
        grad_b1 = grad_b1.to(grad_y.dtype) if need_b1 else None
        grad_b2 = grad_y.sum(0) if need_b2 else None
        return grad_x, grad_w1, grad_b1, grad_w2, grad_b2, None, None


def drop_h_fp8_mlp(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None,
    fc2_weight: torch.Tensor,
    fc2_bias: torch.Tensor | None,
    inplace: bool = True,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """drop_h saving its preactivation in FP8; ``inplace`` frees it once backward read it.
    ``chunk_rows`` sets the rows per chunk of forward and backward (None: ``rows_per_chunk``'s
    rule for each; benchmarks and tests set it)."""
    if chunk_rows is not None and (type(chunk_rows) is not int or chunk_rows < 1):
        raise ValueError(f"chunk_rows must be a positive int or None, got {chunk_rows!r}")
    # Before any GEMM: the kernels would fail to compile. Not while torch.compile traces this
    # (it would trace torch's capability query into the graph); pretrain checks before the run.
    if x.is_cuda and not torch.compiler.is_compiling() and triton_enabled(x):
        check_fp8_gpu(x.get_device())
    return _DropHFP8.apply(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, inplace, chunk_rows)
