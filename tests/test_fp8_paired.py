"""drop_h_quack's paired FP8 format on CPU: the column order, the torch quantization the fc1
epilogue is held to, the paired Triton backward kernel (under the interpreter) against the
torch path, the backward op, drop_h_quack_fp8_mlp's autograd around a torch stand-in for
quack's epilogue, and the registry's acceptance of saved_fp8 for drop_h_quack.

The paired format (``kernels.fp8_format.PAIRED_GROUP``): the copy keeps quack's column order,
[g0, u0, g1, u1, ...], and one bf16 scale covers 128 of those columns (64 features' gate and
up values). The CUDA epilogue itself is tests/test_gpu_quack_fp8_saved.py's.

Tolerances. One stored e4m3 value is off by at most 2**-4 of itself, or by half the subnormal
spacing, 2**-10 of its group's scale (tests/test_fp8_saved.py). A group's max over its scale
is in (448 / (1 + 2**-7), 448]: the scale is rounded up to bf16, whose spacing is 2**-7 of
it, so the max comes back within 2**-7 of itself (not 2**-8: an amax just above a bf16
times 448 is stored as 448 times the next bf16, ``test_a_group_max_comes_back_within_...``).
"""

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from conftest import HAS_CUDA, device_backends
from helpers import rel_err

from swiglu_train import ParMLP
from swiglu_train.kernels.fp8_format import (
    E4M3_MAX,
    FP8_DTYPE,
    MIN_AMAX,
    PAIRED_GROUP,
    SCALE_DTYPE,
    n_blocks,
    paired_saved_shapes,
)
from swiglu_train.kernels.runtime import triton_runs_on
from swiglu_train.kernels.swiglu_fp8_paired import swiglu_backward_fp8_paired
from swiglu_train.layers import registry
from swiglu_train.layers.registry import SAVED_FP8_IMPLS, check_saved_fp8, get_impl
from swiglu_train.ops import quack_fp8_saved, reference, use_backend
from swiglu_train.ops.fp8_paired import (
    deinterleave,
    dequantize_paired,
    interleave,
    quantize_paired,
    swiglu_bwd_fp8_paired_,
)
from swiglu_train.ops.fp8_saved import copy_buffers, recompute_from
from swiglu_train.ops.quack_fp8_saved import (
    SECOND_BACKWARD_ERROR,
    SECOND_BACKWARD_FREED_ERROR,
    drop_h_quack_fp8_mlp,
    fp8_fc1_tile,
)
from swiglu_train.ops.quack_mlp import drop_h_quack_mlp, wave_fill

KERNEL_DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            not triton_runs_on(torch.device("cpu")), reason="needs TRITON_INTERPRET=1"
        ),
    ),
    pytest.param(
        "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]
    ),
]
# The kernel's shapes: ragged M (the interpreter's tile is 4 rows), F under one 256-feature
# column tile (a partial tile of whole groups), exactly one group, and two column tiles.
KERNEL_SHAPES = [(37, 192), (5, 64), (6, 320)]
# tests/test_fp8_saved.py's for its canonical kernel (the interpreter's bf16 rounding, toward
# zero: two ulps); fp32 as asked of this kernel
KERNEL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-6}
CPU_BACKENDS = [p for p in device_backends() if p.values[0] == "cpu"]
QUACK_INSTALLED = importlib.util.find_spec("quack") is not None


def per_column(scales: torch.Tensor) -> torch.Tensor:
    """Each column's group scale, as fp32 [M, 2F]."""
    return scales.float().repeat_interleave(PAIRED_GROUP, dim=-1)


def element_bound(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """e4m3's rounding of each value: half a spacing, normal or subnormal."""
    return 2.0**-4 * values.abs() + 2.0**-10 * per_column(scales)


def group_amax(paired: torch.Tensor) -> torch.Tensor:
    """|max| per (row, 128-column group), NaN skipped, as fp32 [M, 2F / 128]."""
    m = paired.shape[0]
    magnitude = paired.float().abs().view(m, -1, PAIRED_GROUP)
    return magnitude.masked_fill(magnitude.isnan(), 0).amax(-1)


def awkward_paired(m: int, ffn: int, device="cpu") -> torch.Tensor:
    """An fp32 preactivation in quack's order (the epilogue's accumulator): random, with an
    outlier, a zero row and a row of tiny values."""
    paired = torch.randn(m, 2 * ffn, device=device) * 3
    paired[0, min(5, 2 * ffn - 1)] = 1e30
    if m > 2:
        paired[1] = 0.0
        paired[2] *= 1e-30
    paired[-1, -1] = -0.0
    return paired


# -- the column order ---------------------------------------------------------------------


def test_interleave_puts_gate_j_at_2j_and_up_j_at_2j_plus_1():
    canonical = torch.arange(6.0)[None]  # F = 3: gate [0, 1, 2], up [3, 4, 5]
    assert interleave(canonical).tolist() == [[0.0, 3.0, 1.0, 4.0, 2.0, 5.0]]
    ffn = 70
    canonical = torch.randn(3, 2 * ffn)
    paired = interleave(canonical)
    j = torch.arange(ffn)
    assert paired.shape == canonical.shape
    assert torch.equal(paired[:, 2 * j], canonical[:, :ffn])
    assert torch.equal(paired[:, 2 * j + 1], canonical[:, ffn:])


def test_deinterleave_undoes_interleave():
    for shape in [(3, 2 * 70), (2, 5, 2 * 64), (1, 2)]:
        canonical = torch.randn(shape)
        assert torch.equal(deinterleave(interleave(canonical)), canonical)
        assert torch.equal(interleave(deinterleave(canonical)), canonical)
    canonical = torch.randn(2, 8)
    assert not torch.equal(interleave(canonical), canonical)


# -- quantize_paired ----------------------------------------------------------------------


@pytest.mark.parametrize(("m", "ffn"), [(1, 64), (7, 192), (4, 1408)])
def test_shapes_and_dtypes(m, ffn):
    q, scales = quantize_paired(torch.randn(m, 2 * ffn))
    assert q.shape == (m, 2 * ffn) and q.dtype == torch.float8_e4m3fn == FP8_DTYPE
    assert scales.shape == (m, 2 * ffn // 128) and scales.dtype == torch.bfloat16 == SCALE_DTYPE
    assert paired_saved_shapes(m, ffn) == (tuple(q.shape), tuple(scales.shape))
    empty_q, empty_scales = copy_buffers(m, ffn, torch.empty(0), paired_saved_shapes)
    assert (empty_q.shape, empty_q.dtype) == (q.shape, q.dtype)
    assert (empty_scales.shape, empty_scales.dtype) == (scales.shape, scales.dtype)
    # the same bytes as the canonical format where F is a multiple of 128
    if ffn % 128 == 0:
        assert scales.shape[1] == 2 * n_blocks(ffn)


def test_scales_are_the_group_max_over_448_rounded_up_to_bf16():
    paired = torch.randn(16, 2 * 320) * torch.logspace(-20, 20, 16)[:, None]
    _, scales = quantize_paired(paired)
    as_fp32 = scales.float()
    assert (as_fp32.view(torch.int32) & 0xFFFF == 0).all()  # bf16-exact
    amax = group_amax(paired).clamp_min(MIN_AMAX)
    quotient = amax / torch.full_like(amax, E4M3_MAX)
    assert (as_fp32 >= quotient).all()
    below = (as_fp32.view(torch.int32) - 2**16).view(torch.float32)  # the bf16 under it
    assert (below < quotient).all()  # the smallest bf16 at or above amax / 448


def test_a_group_max_comes_back_within_2_to_the_minus_7_of_itself():
    paired = torch.randn(16, 2 * 320) * torch.logspace(-20, 20, 16)[:, None]
    paired[0, 0] = 448 * (1 + 2**-20)  # scale 1 + 2**-20 rounds up to 1 + 2**-7
    q, scales = quantize_paired(paired)
    restored = dequantize_paired(q, scales)
    groups = paired.view(16, -1, PAIRED_GROUP)
    at = groups.abs().argmax(-1, keepdim=True)
    top = groups.gather(-1, at)
    back = restored.view(16, -1, PAIRED_GROUP).gather(-1, at)
    error = ((back - top) / top).abs()
    assert (error <= 2.0**-7).all()
    assert error[0, 0] > 2.0**-8  # this one cannot be closer: 448 x (1 + 2**-7) vs 448
    amax = top.abs().squeeze(-1)
    assert ((amax / scales.float() > E4M3_MAX / (1 + 2**-7)) & (amax / scales.float() <= 448)).all()


def test_round_trip_error_is_e4m3_rounding():
    """Every value within half an e4m3 spacing of its group's grid, over 40 binades, and a
    group with an outlier costs its own group only."""
    m, ffn = 16, 320
    paired = torch.randn(m, 2 * ffn) * torch.logspace(-20, 20, m)[:, None]
    paired[3, 130] *= 1000  # group 1 of row 3
    q, scales = quantize_paired(paired)
    restored = dequantize_paired(q, scales)
    bound = element_bound(paired, scales)
    assert ((restored - paired).abs() <= bound * (1 + 2**-20)).all()
    assert rel_err(restored, paired) > 1e-2  # it is 8-bit, not a copy
    row = scales[3].float()
    assert row[1] > 100 * row[[0, 2, 3, 4]].max()  # the outlier's group only
    assert torch.equal(restored.isfinite(), paired.isfinite())


def test_a_zero_group_gets_a_safe_scale_and_comes_back_zero():
    paired = torch.randn(2, 2 * 192)
    paired[:, 128:256] = 0.0  # group 1 of each row
    q, scales = quantize_paired(paired)
    assert (scales[:, 1] == 2.0**-126).all() and (scales[:, [0, 2]] > 2.0**-126).all()
    restored = dequantize_paired(q, scales)
    assert (restored[:, 128:256] == 0).all()
    q, scales = quantize_paired(torch.zeros(3, 2 * 64))
    assert (scales == 2.0**-126).all() and (dequantize_paired(q, scales) == 0).all()


def test_nan_stays_alone_and_inf_makes_its_whole_group_nan():
    paired = torch.randn(3, 2 * 192)
    paired[0, 5] = float("nan")  # row 0, group 0
    paired[1, 130] = float("inf")  # row 1, group 1
    paired[2, 300] = -float("inf")  # row 2, group 2
    q, scales = quantize_paired(paired)
    restored = dequantize_paired(q, scales)
    expected_nan = torch.zeros(3, 2 * 192, dtype=torch.bool)
    expected_nan[0, 5] = expected_nan[1, 128:256] = expected_nan[2, 256:384] = True
    assert torch.equal(restored.isnan(), expected_nan)
    assert scales[0].isfinite().all() and scales[1, 1].isinf() and scales[2, 2].isinf()
    finite = ~expected_nan
    bound = element_bound(paired, scales)
    assert ((restored - paired).abs()[finite] <= bound[finite] * (1 + 2**-20)).all()


@pytest.mark.parametrize("ffn", [32, 96, 100, 200])
def test_f_not_a_multiple_of_64_is_refused(ffn):
    with pytest.raises(ValueError, match=f"multiple of 64, got F={ffn}"):
        quantize_paired(torch.randn(2, 2 * ffn))
    with pytest.raises(ValueError, match="multiple of 64"):
        copy_buffers(2, ffn, torch.empty(0), paired_saved_shapes)
    with pytest.raises(ValueError, match="multiple of 64"):
        paired_saved_shapes(2, ffn)


# -- the paired backward kernel and op ----------------------------------------------------


def torch_backward(q, scales, grad_h):
    """(h, canonical grad_preact) from a paired copy, through the canonical torch path."""
    return recompute_from(deinterleave(dequantize_paired(q, scales)), grad_h)


def kernel_backward(q, scales, grad_h):
    h, grad_preact = grad_h.clone(), grad_h.new_empty(grad_h.shape[0], 2 * grad_h.shape[1])
    swiglu_backward_fp8_paired(q, scales, h, grad_preact)
    return h, grad_preact


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("m", "ffn"), KERNEL_SHAPES)
def test_backward_kernel_matches_the_torch_path(device, dtype, m, ffn):
    """The same paired bytes give the same h and grad_preact, in [gate | up] order."""
    q, scales = quantize_paired(awkward_paired(m, ffn, device))
    grad_h = torch.randn(m, ffn, device=device).to(dtype)
    expected_h, expected_grad = torch_backward(q, scales, grad_h)
    h, grad_preact = kernel_backward(q, scales, grad_h)
    tol = KERNEL_TOL[dtype]
    torch.testing.assert_close(h, expected_h, rtol=tol, atol=tol)
    torch.testing.assert_close(grad_preact, expected_grad, rtol=tol, atol=tol)
    # read in quack's order, written in the canonical one: the other reading is far off
    # (row 0 left out: its 1e30 outlier would make any difference look total)
    wrong_h, _ = recompute_from(dequantize_paired(q, scales), grad_h)
    assert rel_err(h[1:], wrong_h[1:]) > 0.5


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's NaN
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backward_kernel_puts_nan_where_the_torch_path_does(device, dtype):
    m, ffn = 7, 192
    paired = torch.randn(m, 2 * ffn, device=device)
    paired[0, 10] = float("nan")  # gate 5 of row 0
    paired[0, 21] = float("nan")  # up 10 of row 0: h and grad_gate NaN, grad_up not
    paired[3, 130] = float("inf")  # row 3, group 1: features 64-127 all NaN
    q, scales = quantize_paired(paired)
    grad_h = torch.randn(m, ffn, device=device).to(dtype)
    expected_h, expected_grad = torch_backward(q, scales, grad_h)
    h, grad_preact = kernel_backward(q, scales, grad_h)
    assert torch.equal(h.isnan(), expected_h.isnan())
    assert torch.equal(grad_preact.isnan(), expected_grad.isnan())
    assert h[0].isnan().sum() == 2 and h[3, 64:128].isnan().all() and h[3].isnan().sum() == 64
    assert grad_preact[0, [5, 10, ffn + 5]].isnan().all() and not grad_preact[0, ffn + 10].isnan()
    assert not h[[1, 2, 4, 5, 6]].isnan().any()
    tol = KERNEL_TOL[dtype]
    torch.testing.assert_close(h, expected_h, rtol=tol, atol=tol, equal_nan=True)
    torch.testing.assert_close(grad_preact, expected_grad, rtol=tol, atol=tol, equal_nan=True)


def test_backward_kernel_refuses_what_is_no_paired_copy():
    m, ffn = 5, 192
    q, scales = quantize_paired(torch.randn(m, 2 * ffn))
    grad_h, grad_preact = torch.randn(m, ffn), torch.empty(m, 2 * ffn)
    with pytest.raises(ValueError, match=r"^q must be a row-major torch.float8_e4m3fn"):
        swiglu_backward_fp8_paired(q.view(torch.uint8), scales, grad_h, grad_preact)
    with pytest.raises(ValueError, match=r"^q must be .* got torch.float8_e4m3fn \(5, 192\)"):
        swiglu_backward_fp8_paired(q[:, :ffn], scales, grad_h, grad_preact)
    canonical_scales = torch.ones(m, 2 * n_blocks(ffn), dtype=torch.bfloat16)  # 4, not 3
    with pytest.raises(ValueError, match=r"^scales must be a row-major torch.bfloat16 \(5, 3\)"):
        swiglu_backward_fp8_paired(q, canonical_scales, grad_h, grad_preact)
    with pytest.raises(ValueError, match=r"^scales must be .* got torch.float32"):
        swiglu_backward_fp8_paired(q, scales.float(), grad_h, grad_preact)
    with pytest.raises(ValueError, match="F a multiple of 64, got F=96"):
        swiglu_backward_fp8_paired(
            q[:, :192], scales[:, :1], torch.randn(m, 96), torch.empty(m, 192)
        )
    with pytest.raises(ValueError, match="grad_preact"):
        swiglu_backward_fp8_paired(q, scales, grad_h, torch.empty(m, ffn))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_op_s_torch_path_gives_the_triton_path_s_values(device, dtype):
    m, ffn = 37, 192
    q, scales = quantize_paired(awkward_paired(m, ffn, device))
    grad_h = torch.randn(m, ffn, device=device).to(dtype)
    out = {}
    for backend in ("torch", "triton"):
        h, grad_preact = grad_h.clone(), grad_h.new_empty(m, 2 * ffn)
        with use_backend(backend):
            swiglu_bwd_fp8_paired_(q, scales, h, grad_preact)
        out[backend] = h, grad_preact
    expected_h, expected_grad = torch_backward(q, scales, grad_h)
    assert torch.equal(out["torch"][0], expected_h)
    assert torch.equal(out["torch"][1], expected_grad)
    tol = KERNEL_TOL[dtype]
    for got, expected in zip(out["triton"], out["torch"], strict=True):
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


def test_the_op_passes_opcheck():
    """Schema, fake kernel and mutation, as torch.compile relies on (the schema test left out,
    as tests/test_fp8_saved.py does: torch lacks float8 arithmetic on CPU)."""
    q, scales = quantize_paired(torch.randn(5, 2 * 128))
    no_schema = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    with use_backend("torch"):
        torch.library.opcheck(
            swiglu_bwd_fp8_paired_.op,
            (q, scales, torch.randn(5, 128), torch.empty(5, 256)),
            test_utils=no_schema,
        )


# -- drop_h_quack_fp8_mlp's autograd, quack's GEMMs stood in for by torch -----------------


@pytest.fixture
def torch_quack(monkeypatch):
    """drop_h_quack_fp8_mlp on CPU: quack's epilogues and fc2 replaced by torch that writes
    what they write (fc1's: h from the fp32 preactivation and its paired copy; grad_h's: h
    and grad_preact from the copy and an fp32 grad_h), the CUDA checks off; its own chunking,
    saves, backward loop and freeing run as they are, and the unfused backward's paired op
    (``UNFUSED_STEP``) itself. ``rows`` sets the backward's row chunks (None: its own rule)."""
    chunks = {"rows": None}

    def fc1(x, fc1_weight, fc1_bias, h, q, scales):
        preact = F.linear(x.float(), fc1_weight.float(), fc1_bias)
        h.copy_(reference.swiglu(preact))
        for buffer, value in zip((q, scales), quantize_paired(interleave(preact)), strict=True):
            buffer.copy_(value)

    def dswiglu(q, scales, grad_y, fc2_weight, h, grad_preact):
        grad_h = grad_y.float() @ fc2_weight.float()
        for buffer, value in zip((h, grad_preact), torch_backward(q, scales, grad_h), strict=True):
            buffer.copy_(value)

    real_chunks = quack_fp8_saved.backward_row_chunks
    monkeypatch.setattr(quack_fp8_saved, "quack_swiglu_fp8_", fc1)
    fused = quack_fp8_saved.FUSED_STEP._replace(run=dswiglu)
    monkeypatch.setattr(quack_fp8_saved, "FUSED_STEP", fused)
    monkeypatch.setattr(quack_fp8_saved, "quack_fc2", F.linear)
    monkeypatch.setattr(quack_fp8_saved, "check_quack_inputs", lambda *args: None)
    monkeypatch.setattr(quack_fp8_saved, "check_fp8_gpu", lambda index: None)
    monkeypatch.setattr(
        quack_fp8_saved,
        "backward_row_chunks",
        lambda *args, **kw: chunks["rows"] or real_chunks(*args, **kw),
    )
    return chunks


def expected_from_the_copy(x, w1, b1, w2, b2, grad_y) -> dict:
    """y and the gradients drop_h_quack+fp8 computes, in fp32 torch, one chunk."""
    preact = F.linear(x, w1, b1)
    y = F.linear(reference.swiglu(preact), w2, b2)
    restored = deinterleave(dequantize_paired(*quantize_paired(interleave(preact))))
    h, grad_preact = recompute_from(restored, grad_y @ w2)
    return {
        "y": y, "x": grad_preact @ w1, "w1": grad_preact.t() @ x, "b1": grad_preact.sum(0),
        "w2": grad_y.t() @ h, "b2": grad_y.sum(0),
    }  # fmt: skip


def leaves(m, d, ffn, out):
    x = torch.randn(m, d, requires_grad=True)
    w1 = (torch.randn(2 * ffn, d) * d**-0.5).requires_grad_()
    b1 = (torch.randn(2 * ffn) * 0.1).requires_grad_()
    w2 = (torch.randn(out, ffn) * ffn**-0.5).requires_grad_()
    b2 = (torch.randn(out) * 0.1).requires_grad_()
    return x, w1, b1, w2, b2


FUSED = pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])


@FUSED
@pytest.mark.parametrize(("device", "backend"), CPU_BACKENDS)
@pytest.mark.parametrize("rows", [None, (5, 7, 9)], ids=["one-chunk", "three-chunks"])
def test_backward_reads_the_paired_copy_chunk_by_chunk(torch_quack, device, backend, rows, fused):
    """The gradients are the torch path's on the same copy; with ``backend`` triton the
    unfused step runs the paired kernel (the interpreter)."""
    torch_quack["rows"] = rows
    m, d, ffn, out = 21, 16, 128, 12
    tensors = leaves(m, d, ffn, out)
    grad_y = torch.randn(m, out)
    expected = expected_from_the_copy(*(t.detach() for t in tensors), grad_y)
    with use_backend(backend):
        y = drop_h_quack_fp8_mlp(*tensors, fused_backward=fused)
        y.backward(grad_y)
    torch.testing.assert_close(y, expected["y"], rtol=1e-6, atol=1e-6)
    tol = 1e-5 if backend == "torch" else 1e-4
    for name, t in zip(("x", "w1", "b1", "w2", "b2"), tensors, strict=True):
        torch.testing.assert_close(t.grad, expected[name], rtol=tol, atol=tol, msg=name)
    exact = [t.detach().double().requires_grad_() for t in tensors]
    reference.mlp(*exact).backward(grad_y.double())
    for name, t, e in zip(("x", "w1", "b1", "w2"), tensors[:4], exact[:4], strict=True):
        assert 1e-2 < rel_err(t.grad, e.grad) < 0.06, name  # from the copy, not the preact


def saved_by(fn):
    kept = []

    def pack(t):
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn()
    return y, kept


@FUSED
def test_backward_frees_the_copy_and_refuses_a_second_one(torch_quack, fused):
    torch_quack["rows"] = (8, 13)
    tensors = leaves(21, 16, 128, 12)
    with use_backend("torch"):
        y, kept = saved_by(lambda: drop_h_quack_fp8_mlp(*tensors, fused_backward=fused))
        copies = [t for t in kept if t.dtype in (FP8_DTYPE, SCALE_DTYPE)]
        assert [tuple(t.shape) for t in copies] == [(8, 256), (8, 2), (13, 256), (13, 2)]
        y.sum().backward(retain_graph=True)
        assert all(t.untyped_storage().nbytes() == 0 for t in copies)
        with pytest.raises(RuntimeError) as e:
            y.sum().backward()
        assert str(e.value) == SECOND_BACKWARD_ERROR
        y = drop_h_quack_fp8_mlp(*tensors, fused_backward=fused)
        y.sum().backward()
        with pytest.raises(RuntimeError) as e:
            y.sum().backward()
        assert str(e.value) == SECOND_BACKWARD_FREED_ERROR


@FUSED
def test_inplace_false_keeps_the_copy_for_a_second_backward(torch_quack, fused):
    torch_quack["rows"] = (8, 13)
    tensors = leaves(21, 16, 128, 12)
    with use_backend("torch"):
        y = drop_h_quack_fp8_mlp(*tensors, inplace=False, fused_backward=fused)
        y.sum().backward(retain_graph=True)
        first = [t.grad.clone() for t in tensors]
        for t in tensors:
            t.grad = None
        y.sum().backward()
    for t, g in zip(tensors, first, strict=True):
        assert torch.equal(t.grad, g)


def test_f_not_a_multiple_of_64_takes_drop_h_s_fp8_path(torch_quack):
    """F = 200: partial groups, so drop_h's FP8 path (its canonical format) runs instead."""
    tensors = leaves(9, 16, 200, 12)
    with use_backend("torch"):
        _, kept = saved_by(lambda: drop_h_quack_fp8_mlp(*tensors))
    scales = [t for t in kept if t.dtype == SCALE_DTYPE]
    assert len(scales) == 1 and scales[0].shape == (9, 2 * n_blocks(200))  # canonical: 4


# -- the registry -------------------------------------------------------------------------


def test_the_registry_accepts_saved_fp8_for_drop_h_quack():
    check_saved_fp8("drop_h_quack")
    check_saved_fp8("drop_h_quack", False)
    assert list(SAVED_FP8_IMPLS) == ["drop_h", "drop_h_quack"]
    assert SAVED_FP8_IMPLS["drop_h_quack"] is drop_h_quack_fp8_mlp


def test_get_impl_picks_the_fp8_variant_once_quack_loads(monkeypatch):
    monkeypatch.setattr(registry, "require_quack", lambda: None)  # as if quack were installed
    assert get_impl("drop_h_quack", True) is drop_h_quack_fp8_mlp
    assert get_impl("drop_h_quack", False) is drop_h_quack_mlp
    mlp = ParMLP(64, 128, impl="drop_h_quack", saved_fp8=True)
    assert mlp.saved_fp8 and mlp.impl == "drop_h_quack" and "saved_fp8=True" in repr(mlp)
    with pytest.raises(ValueError, match="impl 'drop_h_quack' runs on CUDA only"):
        mlp(torch.randn(4, 64, requires_grad=True))


@pytest.mark.skipif(QUACK_INSTALLED, reason="quack is installed here")
def test_without_quack_the_fp8_variant_is_refused_for_quack_alone():
    with pytest.raises(ImportError, match="need the quack-kernels package"):
        get_impl("drop_h_quack", True)
    with pytest.raises(ImportError, match="need the quack-kernels package"):
        ParMLP(64, 128, impl="drop_h_quack", saved_fp8=True)


@pytest.mark.parametrize("impl", ["normal", "save_factors", "save_factors_quack", "auto"])
def test_other_impls_are_refused_naming_both_fp8_impls(impl):
    with pytest.raises(ValueError) as e:
        ParMLP(64, 128, impl=impl, saved_fp8=True, tokens_hint=16)
    assert str(e.value).startswith(
        f"saved_fp8=True is for impls 'drop_h' and 'drop_h_quack' only, not '{impl}': "
    )


def test_the_fc1_tile_holds_whole_groups_and_is_256_wide_unless_shallow_or_128_fills_better():
    assert fp8_fc1_tile(11136, 2 * 14336, 3584, 132) == (256, 2, 1)  # the seed shape
    assert fp8_fc1_tile(12288, 2 * 9216, 2304, 132) == (128, 2, 1)  # shallow: pingpong
    for m in (1, 64, 512, 513, 4096, 11136):
        for rows in (2 * 704, 2 * 4864, 2 * 14336, 2 * 18944):
            for depth in (896, 3072, 3073, 8192):
                tile_n, cluster_m, cluster_n = fp8_fc1_tile(m, rows, depth, 132)
                assert tile_n % PAIRED_GROUP == 0
                assert (cluster_m, cluster_n) == ((1, 2) if m <= 512 else (2, 1)), m
                fill = {n: wave_fill(-(-m // 128), -(-rows // n), cluster_m, cluster_n, 132)
                        for n in (128, 256)}  # fmt: skip
                narrow = depth <= 3072 or fill[128] > 1.05 * fill[256]
                assert (tile_n == 128) == narrow, (m, rows, depth, fill)
