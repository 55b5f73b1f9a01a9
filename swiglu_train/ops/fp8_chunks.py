"""How the FP8-saved drop_h (``ops.fp8_saved``) splits its passes so that its peak stays
within drop_h's: the live bytes of each loop, and the rules that size the chunks.

Forward runs in chunks of rows: each chunk's bf16 preactivation goes into one reused
[rows, 2F] buffer, and the kernel writes that chunk's h, copy and scales rows.

Backward splits the rows of M or the columns of F, whichever moves fewer extra bytes
(``backward_split``). Each split leaves one gradient to accumulate over its chunks with
beta = 1, and each accumulation after the first reads and writes that gradient once more:
- rows: grad_W1 [2F, D], one GEMM a chunk; x, the copy, grad_h (becoming h), grad_x and
  grad_W1 live through the loop, and grad_W2 comes after it, once the copy is freed;
- columns: grad_x [M, D], two GEMMs a chunk (gate's and up's rows of W1 are F apart; one
  chunk is one GEMM); grad_h exists a chunk at a time, since each chunk's h goes straight into
  its columns of grad_W2, so x, the copy, grad_x, grad_W1 and grad_W2 live through the loop.
At the seed shape [11136, 3584, 14336, 3584] bf16, rows take 6 chunks and 5 x 411 MB of extra
grad_W1 traffic (about 0.1 ms each on an H200); columns take 3 chunks and 5 x 160 MB on
grad_x. Rows win where M is large against F, or where the columns' fixed set leaves no room.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from swiglu_train.kernels.fp8_format import BLOCK, FP8_DTYPE, SCALE_DTYPE, saved_shapes

# Rows per chunk: a multiple of ROW_ALIGN (whole GEMM tiles), and at least
# MIN_CHUNK_ROWS unless M is smaller, so the per-chunk GEMMs keep enough rows to fill the GPU.
ROW_ALIGN = 128
MIN_CHUNK_ROWS = 1024
# Columns per chunk: whole scale blocks (BLOCK), at least MIN_CHUNK_COLS unless F is smaller,
# for the same reason (a chunk's grad_W1 GEMMs are [C, D] outputs).
MIN_CHUNK_COLS = 1024


class BackwardSplit(NamedTuple):
    """The FP8 backward's chunks: ``size`` rows of M, or columns of F, per chunk."""

    axis: Literal["rows", "columns"]
    size: int


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
    return copy_bytes(m, ffn) + itemsize * (m * d + m * ffn + min(rows, m) * 2 * ffn)


def fp8_backward_peak(m: int, d: int, ffn: int, itemsize: int, rows: int) -> int:
    """Bytes the row-split FP8 backward holds at its peak, in its chunk loop, parameters and
    grad_y aside: x, the FP8 copy and its scales, grad_h (becoming h), grad_x, grad_W1 and one
    [rows, 2F] grad_preact buffer. grad_W2 comes after the loop, once the copy is freed."""
    held = 2 * m * d + m * ffn + 2 * ffn * d + min(rows, m) * 2 * ffn
    return copy_bytes(m, ffn) + itemsize * held


def fp8_backward_peak_columns(m: int, d: int, ffn: int, out: int, itemsize: int, cols: int) -> int:
    """Bytes the column-split FP8 backward holds at its peak, parameters and grad_y aside: x,
    the FP8 copy and its scales, grad_x, grad_W1, grad_W2, and one chunk's grad_h (becoming h)
    [M, C] and grad_preact [M, 2C] buffers."""
    held = 2 * m * d + 2 * ffn * d + out * ffn + 3 * m * min(cols, ffn)
    return copy_bytes(m, ffn) + itemsize * held


def copy_bytes(m: int, ffn: int) -> int:
    """Bytes of the FP8 copy of a [m, 2F] preactivation and its scales."""
    values, scales = saved_shapes(m, ffn)
    return values[0] * values[1] * FP8_DTYPE.itemsize + scales[0] * scales[1] * SCALE_DTYPE.itemsize


def rows_per_chunk(m: int, d: int, ffn: int, out: int, itemsize: int, *, forward: bool) -> int:
    """Rows per chunk of the FP8 forward or row-split backward, for x [m, d], F = ffn and
    O = out: the most that keep its peak (``fp8_forward_peak``, ``fp8_backward_peak``) within
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
    return _even(m, max(fits // ROW_ALIGN * ROW_ALIGN, MIN_CHUNK_ROWS), ROW_ALIGN, MIN_CHUNK_ROWS)


def cols_per_chunk(m: int, d: int, ffn: int, out: int, itemsize: int) -> int | None:
    """Columns of F per chunk of the column-split backward: the most whole scale blocks that
    keep ``fp8_backward_peak_columns`` within drop_h's peak, evened out over the chunks; None
    where fewer than MIN_CHUNK_COLS (or F, if smaller) fit."""
    limit = drop_h_backward_peak(m, d, ffn, out, itemsize)
    spare = limit - fp8_backward_peak_columns(m, d, ffn, out, itemsize, 0)
    fits = spare // max(3 * m * itemsize, 1) // BLOCK * BLOCK
    if fits < min(MIN_CHUNK_COLS, ffn):
        return None
    return _even(ffn, fits, BLOCK, MIN_CHUNK_COLS)


def _even(total: int, size: int, align: int, least: int) -> int:
    """``size`` per chunk, lowered to the fewest aligned units that keep the same chunk count."""
    if size >= total:
        return total
    chunks = -(-total // size)
    even = -(-total // (chunks * align)) * align  # ceil(total / chunks), up to align
    return max(even, min(least, size))


def backward_split(m: int, d: int, ffn: int, out: int, itemsize: int) -> BackwardSplit:
    """Rows or columns for the FP8 backward, whichever re-reads and re-writes fewer bytes of
    the gradient its chunks accumulate (module docstring); rows where they tie or columns do
    not fit within drop_h's peak."""
    rows = rows_per_chunk(m, d, ffn, out, itemsize, forward=False)
    cols = cols_per_chunk(m, d, ffn, out, itemsize)
    row_chunks = -(-max(m, 1) // rows)
    rows_extra = (row_chunks - 1) * 2 * (2 * ffn * d)
    if cols is None:
        return BackwardSplit("rows", rows)
    col_chunks = -(-ffn // cols)
    cols_extra = 0 if col_chunks == 1 else (2 * col_chunks - 1) * 2 * (m * d)
    return (
        BackwardSplit("columns", cols) if cols_extra < rows_extra else BackwardSplit("rows", rows)
    )


def row_chunks(m: int, rows: int) -> list[slice]:
    """Row ranges of ``rows`` rows, the last one shorter; for m = 0 one empty range, so the
    loop still writes grad_W1's zeros."""
    return [slice(start, min(start + rows, m)) for start in range(0, max(m, 1), rows)]


def column_chunks(ffn: int, cols: int) -> list[slice]:
    """Column ranges of each half, ``cols`` wide (whole scale blocks), the last one narrower."""
    return [slice(start, min(start + cols, ffn)) for start in range(0, ffn, cols)]
