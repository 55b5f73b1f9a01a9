"""How the FP8-saved drop_h (``ops.fp8_saved``) splits its passes so that its peak stays
within drop_h's: the live bytes of each loop, and the rules that size the chunks.

Forward runs in chunks of rows: each chunk's bf16 preactivation goes into one reused
[rows, 2F] buffer, and the kernel writes that chunk's h, copy and scales rows.

Backward runs in chunks of rows too (``backward_row_chunks``): grad_W1 [2F, D] accumulates
over them, one GEMM a chunk with beta = 1 (each accumulation after the first reads and writes
it once more); x, grad_h (becoming h), grad_x and grad_W1 live through the loop, and grad_W2
comes after it. The copy is saved as one allocation per chunk (forward writes it so), and each
chunk's copy is freed once its kernel has read it: every chunk has the bytes of the copies
before it to spare, and the first allocates grad_W1 only once its copy is gone. At the seed
shape [11136, 3584, 14336, 3584] bf16 that is 3 chunks, of 3840, 3840 and 3456 rows; one
whole copy held through the loop allows 6 of about 1900, whose grad_x GEMMs ([1920, 2F] @
[2F, D]) fill few waves of output tiles (0.3 ms more on the H200). A split of F's columns,
tried in session 16, fit 3 chunks there too but cost 0.3 ms: 6 GEMMs a chunk against a row
chunk's 2 (docs/fp8.md).
"""

from __future__ import annotations

import functools

from swiglu_train.kernels.fp8_format import copy_bytes

# Rows per chunk: a multiple of ROW_ALIGN (whole GEMM tiles), and at least
# MIN_CHUNK_ROWS unless M is smaller, so the per-chunk GEMMs keep enough rows to fill the GPU.
ROW_ALIGN = 128
MIN_CHUNK_ROWS = 1024
# Backward chunks in whole 2-CTA clusters of 128-row tiles (quack_mlp's TILE_M x
# DEFAULT_CLUSTER_M; drop_h_quack's FP8 fc1 and grad_h GEMMs run once per backward chunk): an
# odd count of M tiles leaves half of a cluster idle along a row of output tiles. On the H200
# (probe_quack_fp8_align_h200.json, probe_quack_fp8_rule_h200.json) the step ran 1.4-1.8
# points of the floor faster for drop_h_quack+fp8 and 0.7-0.9 for drop_h+fp8 (cuBLAS) at
# [11136, 3584, 14336] and [8000, 4096, 14336]; shapes whose 128-row chunks were whole
# clusters already are unchanged.
BACKWARD_ROW_ALIGN = 256


def spans(lengths: tuple[int, ...]) -> list[slice]:
    """Consecutive row ranges of the given lengths."""
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + n)
    return [slice(a, a + n) for a, n in zip(starts, lengths, strict=True)]


def uniform_rows(m: int, rows: int) -> tuple[int, ...]:
    """Chunks of ``rows``, the last one shorter; one empty chunk for m = 0, so the loop still
    writes its gradients' zeros."""
    full, rest = divmod(m, rows)
    return (rows,) * full + ((rest,) if rest or not full else ())


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


def fp8_backward_peak(
    m: int, d: int, ffn: int, itemsize: int, rows: tuple[int, ...], *, freed: bool = True
) -> int:
    """Bytes the row-split FP8 backward holds at its peak, parameters and grad_y aside, for
    chunks of ``rows`` rows: x, grad_h (becoming h) and grad_x, the copy's chunks not yet read
    (all of them unless ``freed``), grad_W1 once the first chunk made it, and the chunk's
    [rows, 2F] grad_preact; after the loop, grad_W2 beside h."""
    peak, left = 0, m
    for k, n in enumerate(rows):
        peak = max(peak, _row_chunk_peak(m, d, ffn, itemsize, left, n, k == 0, freed))
        left -= n
    kept = copy_bytes(0 if freed else m, ffn)
    return max(peak, kept + itemsize * (2 * m * d + m * ffn + 2 * ffn * d + d * ffn))


def _row_chunk_peak(
    m: int, d: int, ffn: int, itemsize: int, left: int, rows: int, first: bool, freed: bool
) -> int:
    """The row-split backward's live bytes at a chunk's kernel, and at its grad_W1 GEMM (the
    first chunk allocates grad_W1, just after its copy rows were freed)."""
    held = itemsize * (2 * m * d + m * ffn + rows * 2 * ffn)  # x, grad_x, h, grad_preact
    grad_w1 = itemsize * 2 * ffn * d
    before, after = (left, left - rows) if freed else (m, m)
    at_kernel = copy_bytes(before, ffn) + held + (0 if first else grad_w1)
    return max(at_kernel, copy_bytes(after, ffn) + held + grad_w1)


def rows_per_chunk(m: int, d: int, ffn: int, out: int, itemsize: int) -> int:
    """Rows per chunk of the FP8 forward, for x [m, d], F = ffn and O = out: the most that keep
    its peak (``fp8_forward_peak``) within ``drop_h_backward_peak``, drop_h's peak over the
    step, rounded down to ROW_ALIGN, then evened out over the chunks that takes (a short last
    chunk wastes a GEMM launch); at least MIN_CHUNK_ROWS."""
    if m <= MIN_CHUNK_ROWS:
        return max(m, 1)
    spare = drop_h_backward_peak(m, d, ffn, out, itemsize) - fp8_forward_peak(
        m, d, ffn, itemsize, 0
    )
    fits = spare // max(2 * ffn * itemsize, 1)
    return _even(m, max(fits // ROW_ALIGN * ROW_ALIGN, MIN_CHUNK_ROWS), ROW_ALIGN, MIN_CHUNK_ROWS)


@functools.lru_cache(maxsize=256)  # ~150 us of bisection a shape, once per shape, not per step
def backward_row_chunks(
    m: int,
    d: int,
    ffn: int,
    out: int,
    itemsize: int,
    *,
    freed: bool = True,
    align: int = BACKWARD_ROW_ALIGN,
) -> tuple[int, ...]:
    """Rows of each chunk of the row-split backward: each the most (in ``align`` rows) that
    keep ``fp8_backward_peak`` within drop_h's peak, given the copy's rows the chunks before
    it freed (none unless ``freed``). Where the last chunk would be short, the chunks after
    the ones the bound holds down take even shares instead (as many chunks, better filled).

    MIN_CHUNK_ROWS wins over the bound where the two disagree (small O and D against F, as at
    [4096, 1024, 2816, 1024]): the peak is then above drop_h's by the difference, which
    smaller chunks would buy back in GEMM time.
    """
    if m <= MIN_CHUNK_ROWS:
        return (m,)
    limit = drop_h_backward_peak(m, d, ffn, out, itemsize)
    greedy = _grow(m, d, ffn, itemsize, limit, freed, None, align)
    return _grow(m, d, ffn, itemsize, limit, freed, len(greedy), align)


def _grow(m, d, ffn, itemsize, limit, freed, chunks: int | None, align) -> tuple[int, ...]:
    """Chunk rows, each the most that fits (``chunks`` None) or at most an even share of the
    rows left over the ``chunks`` planned."""
    lengths: list[int] = []
    left = m
    while left > 0:
        n = min(left, _most_rows(m, d, ffn, itemsize, limit, left, not lengths, freed, align))
        if chunks is not None and len(lengths) < chunks - 1:
            share = -(-left // ((chunks - len(lengths)) * align)) * align
            n = min(n, max(share, align))
        n = min(left, max(n, MIN_CHUNK_ROWS))
        lengths.append(n)
        left -= n
    return tuple(lengths)


def _most_rows(m, d, ffn, itemsize, limit, left, first, freed, align) -> int:
    """The most rows, in whole ``align``, that a chunk starting with ``left`` rows unread may
    take within ``limit`` (0 if none)."""
    low, high = 0, left // align + 1  # _row_chunk_peak grows with the rows: bisect
    while high - low > 1:
        mid = (low + high) // 2
        if _row_chunk_peak(m, d, ffn, itemsize, left, mid * align, first, freed) <= limit:
            low = mid
        else:
            high = mid
    fits = low * align
    if fits < left and _row_chunk_peak(m, d, ffn, itemsize, left, left, first, freed) <= limit:
        fits = left  # the rest fits whole, unaligned
    return fits


def _even(total: int, size: int, align: int, least: int) -> int:
    """``size`` per chunk, lowered to the fewest aligned units that keep the same chunk count."""
    if size >= total:
        return total
    chunks = -(-total // size)
    even = -(-total // (chunks * align)) * align  # ceil(total / chunks), up to align
    return max(even, min(least, size))


def row_chunks(m: int, rows: int) -> list[slice]:
    """Row ranges of ``rows`` rows, the last one shorter; for m = 0 one empty range."""
    return spans(uniform_rows(m, rows))
