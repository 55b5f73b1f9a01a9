"""The FP8-saved drop_h's backward split over columns of F (``ops.fp8_chunks``): its grads
against one chunk's, the column kernel's window of the copy, the rule that picks rows or
columns, and the peak of live bytes against drop_h's.

What splitting columns may change (the inputs of test_fp8_saved_chunked.py: forward exact in
any order). y and the saved copy are the forward's: equal exactly. Each chunk writes its rows
of grad_W1 and columns of grad_W2 with one GEMM, and its entries of grad_b1 with one fp32 sum:
equal to one rounding of the output. grad_x is accumulated over two GEMMs a chunk (gate's and
up's rows of W1) in the parameters' dtype: in bf16 each adds at most half an ulp of the running
sum, bounded as grad_W1's row chunks are, by sqrt(GEMMs) * 2**-8.
"""

import pytest
import torch
from conftest import device_backends
from helpers import rel_err
from test_fp8_saved_chunked import (
    FFN,
    NAMES,
    NOT_INTERPRETED,
    assert_chunked_matches,
    fp8_run,
    make_inputs,
    random_inputs,
    step_bytes,
)

from swiglu_train.kernels.fp8_format import BLOCK
from swiglu_train.ops import reference
from swiglu_train.ops.fp8_chunks import (
    MIN_CHUNK_COLS,
    BackwardSplit,
    backward_split,
    cols_per_chunk,
    drop_h_backward_peak,
    fp8_backward_peak_columns,
    fp8_forward_peak,
    rows_per_chunk,
)
from swiglu_train.ops.fp8_saved import drop_h_fp8_mlp, quantize
from swiglu_train.ops.mlp import drop_h_mlp

SEED_SHAPE = (11136, 3584, 14336, 3584)  # M, D, F, O: issue 19's
MiB = 2**20


def assert_columns_match(columns: dict, one: dict, gemms: int, dtype) -> None:
    """The module docstring's terms: grad_W2 is a GEMM per chunk here, grad_x accumulated."""
    assert_chunked_matches(columns, one, gemms, dtype, ("y", "q", "scales", "b2"), "x")


@pytest.mark.parametrize(("device", "backend"), NOT_INTERPRETED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 37])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_column_chunks_match_one_chunk(device, backend, dtype, m, bias):
    """F = 200: a whole 128-column chunk and a partial one, whose scale block is partial too."""
    inputs = make_inputs(m, dtype, device, bias)
    columns = fp8_run(inputs, None, backend, chunk_cols=BLOCK)
    assert_columns_match(columns, fp8_run(inputs, m, backend), 4, dtype)


def test_one_column_chunk_matches_one_row_chunk():
    """A chunk as wide as F is one GEMM per gradient, as one row chunk is."""
    inputs = make_inputs(37, torch.float32, "cpu")
    one_column = fp8_run(inputs, None, "torch", chunk_cols=2 * BLOCK)
    assert_columns_match(one_column, fp8_run(inputs, 37, "torch"), 1, torch.float32)


def test_column_chunks_on_the_triton_kernels():
    """The column kernel reads a window of the whole copy (gate's and up's blocks F apart)
    under the interpreter; skipped where Triton does not run on CPU."""
    if not any(p.id == "cpu-triton" for p in device_backends()):
        pytest.skip("needs TRITON_INTERPRET=1")
    inputs = make_inputs(37, torch.bfloat16, "cpu")
    columns = fp8_run(inputs, None, "triton", chunk_cols=BLOCK)
    assert_columns_match(columns, fp8_run(inputs, 37, "triton"), 4, torch.bfloat16)


def test_the_column_kernel_refuses_a_window_off_the_scale_blocks():
    from swiglu_train.kernels.swiglu_fp8 import swiglu_backward_fp8_columns

    m = 4
    q, scales = quantize(torch.randn(m, 2 * FFN))
    for start, width in ((64, 64), (128, 128)):  # off a block start; past F = 200
        grad_h, grad_preact = torch.randn(m, width), torch.empty(m, 2 * width)
        with pytest.raises(ValueError, match=rf"columns \[{start}, {start + width}\) must start"):
            swiglu_backward_fp8_columns(q, scales, start, grad_h, grad_preact)


def test_x_without_grad_and_no_weight_grads_in_columns():
    inputs = make_inputs(37, torch.float32, "cpu")
    without = fp8_run(inputs, None, "torch", x_grad=False, chunk_cols=BLOCK)
    with_x = fp8_run(inputs, None, "torch", chunk_cols=BLOCK)
    assert without["x"] is None
    for name in NAMES[1:]:
        assert torch.equal(without[name], with_x[name]), name


def test_no_rows_give_zero_weight_grads_in_columns():
    got = fp8_run(make_inputs(0, torch.float32, "cpu"), None, "torch", chunk_cols=BLOCK)
    for name, shape in (("w1", (2 * FFN, 24)), ("b1", (2 * FFN,)), ("w2", (16, FFN))):
        assert got[name].shape == shape and not got[name].any(), name


def test_bf16_accumulation_of_grad_x_stays_near_the_one_chunk_error():
    """grad_x's error against float64 over 2 column chunks (4 GEMMs) against one chunk's."""
    m = 1536
    inputs = random_inputs(m, torch.bfloat16)
    *tensors, grad_y = inputs
    exact = [None if t is None else t.double().requires_grad_() for t in tensors]
    reference.mlp(*exact).backward(grad_y.double())
    one, two = fp8_run(inputs, m, "torch"), fp8_run(inputs, None, "torch", chunk_cols=BLOCK)
    one_err, two_err = rel_err(one["x"], exact[0].grad), rel_err(two["x"], exact[0].grad)
    assert 1e-2 < one_err < 0.06  # e4m3's rounding
    assert two_err <= 1.02 * one_err, (two_err, one_err)


@pytest.mark.parametrize("cols", [0, 64, 200, True, 2.0])
def test_bad_chunk_cols_are_refused(cols):
    x, w1, b1, w2, b2, _ = make_inputs(4, torch.float32, "cpu")
    with pytest.raises(ValueError, match=f"chunk_cols must be a positive multiple of {BLOCK}"):
        drop_h_fp8_mlp(x, w1, b1, w2, b2, chunk_cols=cols)


def test_the_column_chunks_at_the_seed_shape():
    """Columns: x, the copy and scales, grad_x, grad_W1 and grad_W2 hold 755.5 MiB of
    drop_h's 1087.6, leaving room for 5212 columns of [M] grad_h and [M, 2] grad_preact; 5120
    in whole blocks, 3 chunks, evened to 4864. The rule takes rows there: 3 chunks too."""
    m, d, ffn, out = SEED_SHAPE
    assert round(fp8_backward_peak_columns(m, d, ffn, out, 2, 0) / MiB, 1) == 755.5
    assert cols_per_chunk(*SEED_SHAPE, 2) == 4864
    peak = fp8_backward_peak_columns(*SEED_SHAPE, 2, 4864)
    assert peak <= drop_h_backward_peak(*SEED_SHAPE, 2)
    assert round(peak / MiB, 1) == 1065.4
    assert backward_split(*SEED_SHAPE, 2) == BackwardSplit("rows", (3712, 3712, 3712))


SWEEP = [
    (m, d, ffn, d)
    for m in (1024, 4096, 8000, 16384, 65536)
    for d in (256, 1024, 2048, 4096, 8192)
    for ffn in (1024, 2816, 4864, 14336, 28672, 53248)
]


def test_row_chunks_beat_column_chunks():
    """Why the rule splits rows: freeing each chunk's copy as they go, rows need no more
    chunks than columns within drop_h's peak, or, where columns need fewer (large M against
    F), the rows' accumulations re-read and re-write fewer bytes (grad_W1 [2F, D] once per
    chunk after the first, against grad_x [M, D] twice per column chunk but once)."""
    fewer_columns = 0
    for m, d, ffn, out in SWEEP:
        split, cols = backward_split(m, d, ffn, out, 2), cols_per_chunk(m, d, ffn, out, 2)
        assert split.axis == "rows" and sum(split.lengths) == m
        if cols is None or len(split.lengths) <= -(-ffn // cols):
            continue
        fewer_columns += 1
        rows_extra = (len(split.lengths) - 1) * 2 * ffn * d
        cols_extra = (2 * -(-ffn // cols) - 1) * m * d
        assert rows_extra <= cols_extra, (m, d, ffn)
    assert fewer_columns >= 3  # the second reason is exercised


@pytest.mark.parametrize(
    "shape",
    [SEED_SHAPE, (8192, 4096, 11008, 4096), (12345, 2048, 5000, 2048), (8000, 4096, 14336, 4096)],
)
def test_cols_per_chunk_keeps_the_peak_within_drop_h_s(shape):
    ffn = shape[2]
    limit = drop_h_backward_peak(*shape, 2)
    cols = cols_per_chunk(*shape, 2)
    assert cols % BLOCK == 0 and MIN_CHUNK_COLS <= cols < ffn
    assert fp8_backward_peak_columns(*shape, 2, cols) <= limit
    chunks = -(-ffn // cols)  # no fewer chunks would fit
    fewer = ffn if chunks == 2 else -(-ffn // (chunks - 1) // BLOCK) * BLOCK
    assert fp8_backward_peak_columns(*shape, 2, fewer) > limit


def test_cols_per_chunk_is_none_where_no_chunk_fits():
    """Its spare, 4MF - 2MD - 4FD bytes in bf16, never holds a whole F (6MF): at least two
    chunks, and none where D is large against F."""
    assert cols_per_chunk(2560, 16, 128, 16, 2) is None
    assert cols_per_chunk(4096, 1024, 512, 1024, 2) is None


def test_column_peaks_are_within_drop_h_s():
    """Counted op by op on CPU, at a shape where the rule splits columns in 2 chunks: the
    forward's and backward's peaks are their models', and at most drop_h's."""
    m, d, ffn, out = 2560, 256, 2560, 256
    assert cols_per_chunk(m, d, ffn, out, 2) == 1280
    g = torch.Generator().manual_seed(0)
    x, w1, w2, grad_y = (
        torch.randn(*s, generator=g, dtype=torch.bfloat16)
        for s in ((m, d), (2 * ffn, d), (out, ffn), (m, out))
    )
    inputs = (x.requires_grad_(), w1.requires_grad_(), None, w2.requires_grad_(), None, grad_y)
    not_counted = m * d * 2 - m * out * 2  # x is an input; y is held through backward here
    drop_h = step_bytes(drop_h_mlp, inputs)
    fp8 = step_bytes(lambda *t: drop_h_fp8_mlp(*t, chunk_cols=1280), inputs)
    rows = rows_per_chunk(m, d, ffn, out, 2)
    assert fp8[0] == fp8_forward_peak(m, d, ffn, 2, rows) - m * d * 2
    assert fp8[2] == fp8_backward_peak_columns(m, d, ffn, out, 2, 1280) - not_counted
    assert max(fp8) <= max(drop_h) == drop_h_backward_peak(m, d, ffn, out, 2) - not_counted
