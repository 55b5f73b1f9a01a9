"""drop_h with the FP8-saved preactivation, run in row chunks: outputs and grads against one
chunk's, the chunk rule, and the peak of live bytes against drop_h's, forward and backward.

What chunking may change. preact's rows are x's rows times W1; h, the FP8 copy and grad_preact
are elementwise per row. A BLAS may reduce a chunk's rows in another order than the whole
matrix's (MKL does, for some row counts), and a last-bit change in the preactivation can move
an e4m3 code by a whole step; so the tests build x, W1 and b1 from small dyadic numbers, whose
products and sums fp32 holds exactly: the forward is then the same in any order, and y and the
saved copy are equal exactly. grad_W2 and grad_b2 come after the loop from the same h and
grad_y: equal exactly. grad_x is one GEMM per chunk: equal to fp32's rounding, and in bf16 to
one rounding of the output; grad_b1 sums in fp32 per chunk: the same. grad_W1 is accumulated
in the parameters' dtype by the GEMM, one rounding per chunk: in fp32 that is fp32's rounding;
in bf16 each chunk adds at most half an ulp (2**-9) of the running sum, and the roundings add
up like a random walk, measured at 0.31-0.39 of sqrt(chunks) * 2**-8 (norm-relative), which is
the bound asserted.
"""

import math
import sys
import weakref

import pytest
import torch
from conftest import device_backends
from helpers import rel_err
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from swiglu_train.kernels.fp8_format import SCALE_DTYPE, n_blocks
from swiglu_train.ops import reference, use_backend
from swiglu_train.ops.activation import swiglu_bwd_recompute_, swiglu_fwd
from swiglu_train.ops.fp8_chunks import (
    BACKWARD_ROW_ALIGN,
    MIN_CHUNK_ROWS,
    ROW_ALIGN,
    backward_row_chunks,
    drop_h_backward_peak,
    fp8_backward_peak,
    fp8_forward_peak,
    rows_per_chunk,
    uniform_rows,
)
from swiglu_train.ops.fp8_saved import (
    drop_h_fp8_mlp,
    swiglu_bwd_fp8_,
    swiglu_fwd_fp8_,
)
from swiglu_train.ops.mlp import drop_h_mlp

D, FFN, OUT = 24, 200, 16  # FFN 200: a partial 128-column scale block per half
NAMES = ("x", "w1", "b1", "w2", "b2")
NOT_INTERPRETED = [p for p in device_backends() if p.id != "cpu-triton"]


def make_inputs(m: int, dtype: torch.dtype, device, bias: bool = True, seed: int = 0):
    """(x, w1, b1, w2, b2, grad_y): x, w1 and b1 of quarters, sixteenths and 64ths below 2,
    so that preact is exact in fp32 (module docstring); w2 and grad_y random."""
    g = torch.Generator().manual_seed(seed)

    def dyadic(*shape, unit):
        return (torch.randint(-8, 9, shape, generator=g) * unit).to(device, dtype)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    x, w1, w2, grad_y = (
        dyadic(m, D, unit=0.25),
        dyadic(2 * FFN, D, unit=1 / 16),
        rand(OUT, FFN, scale=FFN**-0.5),
        rand(m, OUT),
    )
    b1, b2 = (dyadic(2 * FFN, unit=1 / 64), rand(OUT)) if bias else (None, None)
    return x, w1, b1, w2, b2, grad_y


def random_inputs(m: int, dtype: torch.dtype, seed: int = 0):
    """(x, w1, None, w2, None, grad_y) of random values at a trained layer's scale."""
    g = torch.Generator().manual_seed(seed)
    x, w1 = torch.randn(m, D, generator=g), torch.randn(2 * FFN, D, generator=g) * D**-0.5
    w2, grad_y = torch.randn(OUT, FFN, generator=g) * FFN**-0.5, torch.randn(m, OUT, generator=g)
    return x.to(dtype), w1.to(dtype), None, w2.to(dtype), None, grad_y.to(dtype)


def fp8_run(inputs, rows: int, backend: str, x_grad: bool = True, **kw) -> dict:
    """y, the saved copy (values as bytes, scales) and the grads of one step."""
    *tensors, grad_y = inputs
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in tensors]
    leaves[0].requires_grad_(x_grad)
    saved = []  # copies: the backward frees the FP8 copy

    def pack(t):
        saved.append(t.detach().clone())
        return t

    with use_backend(backend), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = drop_h_fp8_mlp(*leaves, chunk_rows=rows, **kw)
    with use_backend(backend):
        y.backward(grad_y)
    # the copy in saved order: one allocation per row chunk of the backward (or one in all)
    q = torch.cat([t for t in saved if t.dtype == torch.float8_e4m3fn])
    scales = torch.cat(
        [t for t in saved if t.dtype == SCALE_DTYPE and t.shape[1] == 2 * n_blocks(FFN)]
    )
    grads = {n: None if t is None else t.grad for n, t in zip(NAMES, leaves, strict=True)}
    return {"y": y.detach(), "q": q.view(torch.uint8), "scales": scales, **grads}


def assert_chunked_matches(
    chunked: dict,
    one: dict,
    gemms: int,
    dtype,
    exact: tuple[str, ...] = ("y", "q", "scales", "w2", "b2"),
    accumulated: str = "w1",
) -> None:
    """The module docstring's terms: ``exact`` equal, the others within one rounding, and the
    gradient ``accumulated`` over ``gemms`` GEMMs in bf16 within sqrt(gemms) roundings."""
    fp32 = dtype == torch.float32
    for name in ("y", "q", "scales", *NAMES):
        a, b = chunked[name], one[name]
        assert (a is None) == (b is None), name
        if a is None:
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, name
        if name in exact:
            assert torch.equal(a, b), name
        elif a.numel():
            tol = 1e-6 if fp32 else 2.0**-8
            if name == accumulated and not fp32:
                tol *= math.sqrt(gemms)
            assert rel_err(a, b) <= tol, (name, rel_err(a, b), tol)


@pytest.mark.parametrize(("device", "backend"), NOT_INTERPRETED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 37, 48])  # 37: a short last chunk; 48: three whole ones
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_chunks_match_one_chunk(device, backend, dtype, m, bias):
    inputs = make_inputs(m, dtype, device, bias)
    assert_chunked_matches(
        fp8_run(inputs, 16, backend), fp8_run(inputs, m, backend), -(-m // 16), dtype
    )


@pytest.mark.parametrize(("device", "backend"), NOT_INTERPRETED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_growing_backward_chunks_match_one_chunk(device, backend, dtype):
    """Backward chunks of their own lengths (as the rule's grow), across forward chunks of 16
    rows: each saved copy is written by the forward chunks it straddles (10 + 6 rows, then 16
    and 5), and read and freed by its backward chunk."""
    inputs = make_inputs(37, dtype, device)
    chunked = fp8_run(inputs, 16, backend, backward_rows=(10, 27))
    assert_chunked_matches(chunked, fp8_run(inputs, 37, backend), 2, dtype)


def test_chunks_match_one_chunk_on_the_triton_kernels():
    """The Triton kernels on a chunk's rows (views into h or grad_h, the FP8 copies and their
    scales) under the interpreter; skipped where Triton does not run on CPU."""
    if not any(p.id == "cpu-triton" for p in device_backends()):
        pytest.skip("needs TRITON_INTERPRET=1")
    inputs = make_inputs(37, torch.bfloat16, "cpu")
    assert_chunked_matches(
        fp8_run(inputs, 16, "triton"), fp8_run(inputs, 37, "triton"), 3, torch.bfloat16
    )
    growing = fp8_run(inputs, 16, "triton", backward_rows=(10, 27))
    assert_chunked_matches(growing, fp8_run(inputs, 37, "triton"), 2, torch.bfloat16)


@pytest.mark.parametrize(("device", "backend"), NOT_INTERPRETED)
def test_x_without_grad_gets_none_and_the_weights_the_same_grads(device, backend):
    inputs = make_inputs(37, torch.float32, device)
    without, with_x = fp8_run(inputs, 16, backend, x_grad=False), fp8_run(inputs, 16, backend)
    assert without["x"] is None
    for name in NAMES[1:]:
        assert torch.equal(without[name], with_x[name]), name


@pytest.mark.parametrize("rows", [1, 16])
def test_no_rows_gives_zero_weight_grads(rows):
    got = fp8_run(make_inputs(0, torch.float32, "cpu"), rows, "torch")
    assert got["y"].shape == (0, OUT) and got["x"].shape == (0, D)
    for name, shape in (("w1", (2 * FFN, D)), ("b1", (2 * FFN,)), ("w2", (OUT, FFN))):
        assert got[name].shape == shape and not got[name].any(), name


def test_bf16_accumulation_over_chunks_stays_near_the_one_chunk_error():
    """grad_W1's error against float64 with the seed shape's six backward chunks against one
    chunk's: the per-chunk bf16 roundings add in quadrature to e4m3's ~3 %."""
    m = 6 * 256
    inputs = random_inputs(m, torch.bfloat16)
    *tensors, grad_y = inputs
    exact = [None if t is None else t.double().requires_grad_() for t in tensors]
    reference.mlp(*exact).backward(grad_y.double())
    one, six = fp8_run(inputs, m, "torch"), fp8_run(inputs, 256, "torch")
    one_err, six_err = rel_err(one["w1"], exact[1].grad), rel_err(six["w1"], exact[1].grad)
    assert 1e-2 < one_err < 0.06  # e4m3's rounding, tests/test_fp8_saved.py
    assert six_err <= 1.02 * one_err, (six_err, one_err)


@pytest.mark.parametrize(("device", "backend"), NOT_INTERPRETED)
def test_inplace_false_keeps_the_copy_for_a_chunked_second_backward(device, backend):
    x, w1, b1, w2, b2, grad_y = make_inputs(37, torch.float32, device)
    w1.requires_grad_()
    with use_backend(backend):
        y = drop_h_fp8_mlp(x, w1, b1, w2, b2, inplace=False, chunk_rows=16)
        y.backward(grad_y, retain_graph=True)
        first = w1.grad.clone()
        y.backward(grad_y)
    torch.testing.assert_close(w1.grad, 2 * first)


@pytest.mark.parametrize("rows", [0, -3, True, 2.5])
def test_bad_chunk_rows_are_refused(rows):
    x, w1, b1, w2, b2, _ = make_inputs(4, torch.float32, "cpu")
    with pytest.raises(ValueError, match=f"chunk_rows must be a positive int or None, got {rows}"):
        drop_h_fp8_mlp(x, w1, b1, w2, b2, chunk_rows=rows)


@pytest.mark.parametrize("lengths", [(), (3,), (2, 3), (4, 0), (5, -1)])
def test_backward_rows_that_miss_rows_are_refused(lengths):
    x, w1, b1, w2, b2, _ = make_inputs(4, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"must cover x's 4 rows once, in chunks of at least 1"):
        drop_h_fp8_mlp(x, w1, b1, w2, b2, backward_rows=lengths)


@pytest.mark.parametrize(
    "chunks", [{"chunk_rows": 16}, {"backward_rows": (10, 27)}], ids=["even", "uneven"]
)
def test_torch_compile_fullgraph_with_several_chunks(chunks):
    """The chunk loops, one saved copy per backward chunk, trace whole."""
    torch._dynamo.reset()
    x, w1, b1, w2, b2, grad_y = make_inputs(37, torch.float32, "cpu")
    x.requires_grad_()
    w2.requires_grad_()

    def step(x):
        return drop_h_fp8_mlp(x, w1, b1, w2, b2, **chunks)

    with use_backend("torch"):
        y_eager = step(x)
        expected = torch.autograd.grad(y_eager, (x, w2), grad_y)
        y = torch.compile(step, fullgraph=True, backend="aot_eager")(x)
        got = torch.autograd.grad(y, (x, w2), grad_y)
    torch.testing.assert_close(y, y_eager, rtol=1e-6, atol=1e-6)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


SEED_SHAPE = (11136, 3584, 14336, 3584)  # M, D, F, O: issue 19's
MiB = 2**20


def test_chunks_at_the_seed_shape():
    """drop_h's backward peaks at x + preact + grad_h + grad_W2 = 1087.6 MiB, above its
    forward's x + preact + h. Through the forward's loop x, h and the copy hold 689.9 MiB,
    leaving 397.7: 7273 rows, 7168 aligned, 2 chunks, 5568 evened, 5632. The row-split
    backward frees each chunk's copy once read, so its chunks grow; 3 chunks fit, evened in
    whole 256 rows (2-CTA clusters of 128-row tiles): 3840, 3840, 3456. Held whole through the
    loop, the copy would allow 6 chunks."""
    m, d, ffn, out = SEED_SHAPE
    limit = drop_h_backward_peak(m, d, ffn, out, 2)
    assert round(limit / MiB, 1) == 1087.6
    backward = backward_row_chunks(m, d, ffn, out, 2)
    assert backward == (3840, 3840, 3456)
    assert round(fp8_backward_peak(m, d, ffn, 2, backward) / MiB, 1) == 1065.4
    kept = backward_row_chunks(m, d, ffn, out, 2, freed=False)
    assert kept == (2048, 2048, 1792, 1792, 1792, 1664)
    assert fp8_backward_peak(m, d, ffn, 2, backward, freed=False) > limit  # needs the freeing
    forward = rows_per_chunk(m, d, ffn, out, 2)
    assert forward == 5632 and -(-m // forward) == 2
    assert round(fp8_forward_peak(m, d, ffn, 2, forward) / MiB, 1) == 997.9


SHAPES = [
    (SEED_SHAPE, 4),
    ((8192, 4096, 11008, 4096), 2),
    ((16384, 2048, 5632, 2048), 2),
    ((65536, 4096, 14336, 4096), 2),
    ((12345, 2048, 5000, 2048), 2),  # M and F not multiples of 128
    ((8192, 2048, 5632, 2048), 2),
]


@pytest.mark.parametrize(("shape", "itemsize"), SHAPES)
def test_forward_rows_keep_the_peak_within_drop_h_s(shape, itemsize):
    m, d, ffn, _ = shape
    limit = drop_h_backward_peak(*shape, itemsize)
    rows = rows_per_chunk(*shape, itemsize)
    assert rows % ROW_ALIGN == 0 and MIN_CHUNK_ROWS <= rows < m
    assert fp8_forward_peak(m, d, ffn, itemsize, rows) <= limit
    chunks = -(-m // rows)  # no fewer chunks would fit, and they are even to within ROW_ALIGN
    fewer = m if chunks == 2 else ceil_to(-(-m // (chunks - 1)), ROW_ALIGN)
    assert fp8_forward_peak(m, d, ffn, itemsize, fewer) > limit
    assert rows - chunks * ROW_ALIGN <= m - (chunks - 1) * rows <= rows


@pytest.mark.parametrize(("shape", "itemsize"), SHAPES)
@pytest.mark.parametrize("freed", [True, False], ids=["freed", "kept"])
@pytest.mark.parametrize("align", [ROW_ALIGN, BACKWARD_ROW_ALIGN], ids=["tiles", "clusters"])
def test_backward_row_chunks_keep_the_peak_within_drop_h_s(shape, itemsize, freed, align):
    """Covering M in aligned chunks, and one chunk fewer, evenly, does not fit. Freeing each
    chunk's copy (inplace, the default) keeps the whole step within drop_h's peak and never
    needs more chunks than holding the copy whole; a kept copy (inplace=False) is beside
    grad_W2 after the loop, above drop_h's peak at some shapes whatever the chunks; its chunks
    are even. The same in whole 128-row tiles and in the default 2-CTA clusters of them."""
    m, d, ffn, _ = shape
    limit = drop_h_backward_peak(*shape, itemsize)
    lengths = backward_row_chunks(*shape, itemsize, freed=freed, align=align)
    assert sum(lengths) == m and all(n % align == 0 for n in lengths[:-1])
    assert min(lengths) >= MIN_CHUNK_ROWS
    if freed:
        assert fp8_backward_peak(m, d, ffn, itemsize, lengths) <= limit
        kept = backward_row_chunks(*shape, itemsize, freed=False, align=align)
        assert len(lengths) <= len(kept)
    else:
        assert max(lengths) - min(lengths) <= 2 * align  # the last takes what is left
    fewer = len(lengths) - 1
    if fewer >= 1:
        even = uniform_rows(m, ceil_to(-(-m // fewer), align))
        assert fp8_backward_peak(m, d, ffn, itemsize, even, freed=freed) > limit


def ceil_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def test_chunks_at_small_or_tight_shapes():
    assert rows_per_chunk(0, 64, 256, 64, 2) == 1  # one empty chunk
    assert backward_row_chunks(0, 64, 256, 64, 2) == (0,)
    assert rows_per_chunk(1000, 64, 256, 64, 2) == 1000  # one chunk
    assert backward_row_chunks(1000, 64, 256, 64, 2) == (1000,)
    # small D and O against F: the backward's bound allows fewer rows, MIN_CHUNK_ROWS wins
    tight = (4096, 1024, 2816, 1024)
    lengths = backward_row_chunks(*tight, 2, freed=False)
    assert lengths == (MIN_CHUNK_ROWS,) * 4
    assert fp8_backward_peak(*tight[:3], 2, lengths, freed=False) > drop_h_backward_peak(*tight, 2)
    # freeing each chunk's copy makes room: 3 chunks, within drop_h's peak
    lengths = backward_row_chunks(*tight, 2)
    assert lengths == (1536, 1280, 1280)  # in whole 256 rows
    assert fp8_backward_peak(*tight[:3], 2, lengths) <= drop_h_backward_peak(*tight, 2)


# The torch bodies of the activation ops: the Triton kernels they stand for allocate nothing
# but their outputs (drop_h's swiglu_fwd returns h; the others write into given buffers).
KERNEL_BODIES = {
    op._fn.__code__
    for op in (
        swiglu_fwd,
        swiglu_bwd_recompute_,
        swiglu_fwd_fp8_,
        swiglu_bwd_fp8_,
    )
}


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that ops create, alive, after each op; and their peak.

    Storages an op's output shares with its inputs (views, in-place and out= ops) are not new.
    What the activation ops' torch bodies (``KERNEL_BODIES``) allocate stands for registers of
    the Triton kernels: left out while the body runs; what is still alive after it (an output)
    counts from the next op on, before that op's own output.
    """

    def __init__(self) -> None:
        super().__init__()
        self.storages: weakref.WeakSet = weakref.WeakSet()
        self.in_kernel: weakref.WeakSet = weakref.WeakSet()
        self.peak = 0

    def live(self) -> int:
        return sum(s.nbytes() for s in self.storages)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        known = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if _is_tensor(t)}
        out = func(*args, **(kwargs or {}))
        inside = _in_kernel_body()
        if not inside:
            self.storages |= self.in_kernel
            self.in_kernel = weakref.WeakSet()
        for t in tree_leaves(out):
            if _is_tensor(t) and id(t.untyped_storage()) not in known:
                (self.in_kernel if inside else self.storages).add(t.untyped_storage())
        self.peak = max(self.peak, self.live())
        return out


def _is_tensor(t) -> bool:
    return isinstance(t, torch.Tensor)


def _in_kernel_body() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code in KERNEL_BODIES:
            return True
        frame = frame.f_back
    return False


def step_bytes(mlp, inputs) -> tuple[int, int, int]:
    """(forward's peak, bytes alive after forward, backward's peak) of what the step's ops
    allocate; the inputs, weights and grad_y exist before and are not counted."""
    *tensors, grad_y = inputs
    with use_backend("torch"), LiveBytes() as live:
        y = mlp(*tensors)
        forward_peak, after_forward, live.peak = live.peak, live.live(), 0
        y.backward(grad_y)
    return forward_peak, after_forward, live.peak


def test_peaks_are_within_drop_h_s():
    """Counted op by op on CPU, the FP8 forward's and backward's peaks are their models' (the
    chunk rule's), and at most drop_h's in-place backward's, itself its model's."""
    m, d, ffn, out = 2560, 16, 128, 16
    forward_rows, backward_rows = rows_per_chunk(m, d, ffn, out, 2), (1024, 1536)
    assert forward_rows == 1024 and backward_row_chunks(m, d, ffn, out, 2) == backward_rows
    g = torch.Generator().manual_seed(0)
    x, w1, w2, grad_y = (
        torch.randn(*s, generator=g, dtype=torch.bfloat16)
        for s in ((m, d), (2 * ffn, d), (out, ffn), (m, out))
    )
    inputs = (x.requires_grad_(), w1.requires_grad_(), None, w2.requires_grad_(), None, grad_y)
    x_bytes, y_bytes, h, preact = m * d * 2, m * out * 2, m * ffn * 2, m * 2 * ffn * 2
    copy = m * 2 * ffn + m * 2 * n_blocks(ffn) * 2  # e4m3 values and bf16 scales
    not_counted = x_bytes - y_bytes  # x is an input; y is held through backward here
    drop_h = step_bytes(drop_h_mlp, inputs)
    fp8 = step_bytes(drop_h_fp8_mlp, inputs)
    limit = drop_h_backward_peak(m, d, ffn, out, 2) - not_counted
    assert drop_h == (preact + h + y_bytes, preact + y_bytes, limit)
    assert fp8 == (
        fp8_forward_peak(m, d, ffn, 2, forward_rows) - x_bytes,
        copy + y_bytes,
        fp8_backward_peak(m, d, ffn, 2, backward_rows) - not_counted,
    )
    assert max(fp8) <= max(drop_h)
    # one chunk, as before chunking: both passes above drop_h's peak
    forward_peak, _, backward_peak = step_bytes(lambda *t: drop_h_fp8_mlp(*t, chunk_rows=m), inputs)
    assert forward_peak > limit and backward_peak > limit
