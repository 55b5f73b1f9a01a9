"""The Triton kernels themselves, through their launchers (CPU interpreter or CUDA)."""

import re

import pytest
import torch
from helpers import rel_err

from swiglu_train.kernels.runtime import triton_runs_on
from swiglu_train.ops import reference

kernels = pytest.importorskip("swiglu_train.kernels.swiglu")

DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            not triton_runs_on(torch.device("cpu")), reason="needs TRITON_INTERPRET=1"
        ),
    ),
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")],
    ),
]
# One ulp of the dtype, relative (four for fp32, whose exp differs between libraries).
# The interpreter rounds fp32 -> bf16 toward zero and h is rounded twice (silu, then the
# product), so there bf16 may be off by two.
ULP = {torch.float32: 2**-21, torch.float16: 2**-10, torch.bfloat16: 2**-7}


def assert_within_ulp(actual, expected, dtype):
    ulps = 2 if actual.device.type == "cpu" and dtype == torch.bfloat16 else 1
    tol = ulps * ULP[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("m", "f"), [(1, 1), (17, 33), (70, 96), (33, 5)])
def test_forward_matches_megatron_formula(device, dtype, m, f):
    preact = torch.randn(m, 2 * f, device=device, dtype=dtype) * 3
    h = torch.full((m, f), float("nan"), device=device, dtype=dtype)
    kernels.swiglu_forward(preact, h)
    x1, x2 = torch.chunk(preact, 2, -1)
    assert_within_ulp(h, torch.nn.functional.silu(x1) * x2, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", ["grad_only", "with_h", "inplace"])
def test_backward_modes(device, dtype, mode):
    m, f = 45, 70
    preact = torch.randn(m, 2 * f, device=device, dtype=dtype) * 3
    grad_h = torch.randn(m, f, device=device, dtype=dtype)
    expected_grad = reference.swiglu_grad(preact.double(), grad_h.double())
    expected_h = torch.empty(m, f, device=device, dtype=dtype)
    kernels.swiglu_forward(preact, expected_h)
    if mode == "inplace":
        grad_preact, h = preact, grad_h
    else:
        grad_preact = torch.full_like(preact, float("nan"))
        h = torch.full_like(grad_h, float("nan")) if mode == "with_h" else None
    kernels.swiglu_backward(preact, grad_h, grad_preact, h)
    assert rel_err(grad_preact, expected_grad) < (1e-6 if dtype == torch.float32 else 8e-3)
    if h is not None:  # the recomputed h is bit-identical to the forward's
        assert torch.equal(h, expected_h)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.float().view(torch.int32), b.float().view(torch.int32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", ["out_of_place", "h_over_grad_h", "inplace"])
@pytest.mark.parametrize("value", [None, float("nan"), float("inf")], ids=["finite", "nan", "inf"])
def test_backward_finds_the_amaxes_of_what_it_writes(device, dtype, mode, value):
    """With tensor_amax and row_amax, the backward kernel's amaxes are torch.amax's of the
    grad_preact and h it wrote, bit for bit: over every tile (45 x 70: rows and columns past a
    tile's edge, masked lanes left out), with a non-finite value spoiling its row and the whole
    tensor as torch.amax's does; and the outputs are those of the plain launch, in place, out
    of place, and with h over grad_h alone (the preact left whole)."""
    m, f = 45, 70
    preact = torch.randn(m, 2 * f, device=device, dtype=dtype) * 3
    if value is not None:
        preact[7, f + 3] = value  # up: grad_gate and grad_up of row 7 become non-finite
    grad_h = torch.randn(m, f, device=device, dtype=dtype)
    plain_grad, plain_h = torch.empty_like(preact), torch.empty_like(grad_h)
    kernels.swiglu_backward(preact, grad_h, plain_grad, plain_h)
    if mode == "inplace":
        grad_preact, h = preact.clone(), grad_h.clone()
        pair, rows = kernels.swiglu_backward(grad_preact, h, grad_preact, h, True, True)
    elif mode == "h_over_grad_h":  # the preact kept whole, grad_preact in a buffer of its own
        kept, grad_preact, h = preact.clone(), torch.empty_like(preact), grad_h.clone()
        pair, rows = kernels.swiglu_backward(kept, h, grad_preact, h, True, True)
        assert torch.equal(kept.nan_to_num(), preact.nan_to_num())
    else:
        grad_preact, h = torch.empty_like(preact), torch.empty_like(grad_h)
        pair, rows = kernels.swiglu_backward(preact, grad_h, grad_preact, h, True, True)
    assert torch.equal(grad_preact.nan_to_num(), plain_grad.nan_to_num())
    assert torch.equal(h.nan_to_num(), plain_h.nan_to_num())
    assert pair.dtype == rows.dtype == torch.float32 and rows.shape == (m, 1)
    assert bits_equal(pair[0], grad_preact.abs().amax()) and bits_equal(pair[1], h.abs().amax())
    assert bits_equal(rows, grad_preact.abs().amax(1, keepdim=True))
    if value is not None:
        assert not rows[7].isfinite().all() and rows[8].isfinite().all()


@pytest.mark.parametrize("device", DEVICES)
def test_the_tensor_amax_needs_h_and_an_empty_batch_finds_none(device):
    preact, grad_h = torch.randn(4, 6, device=device), torch.randn(4, 3, device=device)
    with pytest.raises(ValueError, match=re.escape("tensor_amax finds max |h| too")):
        kernels.swiglu_backward(preact, grad_h, torch.empty_like(preact), None, True)
    empty, empty_h = torch.empty(0, 6, device=device), torch.empty(0, 3, device=device)
    assert kernels.swiglu_backward(empty, empty_h, empty, empty_h, True, True) == (None, None)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_rows(device):
    """Row strides larger than the width (views into wider buffers) are honoured."""
    preact = torch.randn(9, 40, device=device)[:, :24]  # [9, 24], row stride 40
    h = torch.empty(9, 20, device=device)[:, :12]
    kernels.swiglu_forward(preact, h)
    assert_within_ulp(h, reference.swiglu(preact), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_launcher_checks(device):
    preact = torch.randn(4, 6, device=device)
    with pytest.raises(ValueError, match="even last dim"):
        kernels.swiglu_forward(torch.randn(4, 5, device=device), torch.empty(4, 2, device=device))
    with pytest.raises(ValueError, match=r"h must be row-major \(4, 3\)"):
        kernels.swiglu_forward(preact, torch.empty(4, 4, device=device))
    with pytest.raises(ValueError, match="row-major"):
        kernels.swiglu_forward(preact.t().contiguous().t(), torch.empty(4, 3, device=device))
    with pytest.raises(TypeError, match="float64"):
        kernels.swiglu_forward(preact.double(), torch.empty(4, 3, device=device).double())
    with pytest.raises(TypeError, match=r"h is torch\.float16"):
        kernels.swiglu_forward(preact, torch.empty(4, 3, device=device, dtype=torch.float16))
    grad_h = torch.randn(4, 3, device=device)
    with pytest.raises(ValueError, match="both preact and grad_h"):
        kernels.swiglu_backward(preact, grad_h, preact, torch.empty_like(grad_h))
    with pytest.raises(ValueError, match="together with h"):
        kernels.swiglu_backward(preact, grad_h, preact, None)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(device):
    preact = torch.empty(0, 8, device=device)
    h = torch.empty(0, 4, device=device)
    kernels.swiglu_forward(preact, h)
    assert h.shape == (0, 4)


def test_tile_rule_fills_the_element_budget_without_overshooting_f():
    fwd, bwd = kernels.FWD_TILE, kernels.BWD_TILE
    assert kernels.tile(11136, 14336, fwd, interpret=False) == (1, 1024, 4)
    assert kernels.tile(11136, 14336, bwd, interpret=False) == (1, 2048, 8)
    # narrow F (Qwen2.5-0.5B's 4864 is wide; a 896-wide shard is not): rows fill the budget
    assert kernels.tile(8000, 896, bwd, interpret=False) == (2, 1024, 8)
    assert kernels.tile(8000, 300, fwd, interpret=False) == (2, 512, 4)
    assert kernels.tile(1, 300, bwd, interpret=False) == (1, 512, 8)  # no rows past M
    assert kernels.tile(0, 300, bwd, interpret=False) == (1, 512, 8)
    assert kernels.tile(11136, 14336, bwd, interpret=True) == (16, 32, 1)


def test_memoized_launch_config_follows_every_shape():
    """The tile and grid are cached per (M, F, rule): a new M, F or rule gets its own, and a
    repeated one the same (a cache keyed on less would launch a stale grid)."""
    fwd, bwd = kernels.FWD_TILE, kernels.BWD_TILE
    calls = [
        ((8000, 896, bwd), ((4000,), 2, 1024, 8)),
        ((8001, 896, bwd), ((4001,), 2, 1024, 8)),  # one more row: one more program
        ((8000, 1100, bwd), ((8000,), 1, 2048, 8)),  # F past 1024: wider tiles, one row each
        ((8000, 2100, bwd), ((16000,), 1, 2048, 8)),  # F past 2048: two tiles a row
        ((8000, 896, fwd), ((8000,), 1, 1024, 4)),  # the forward rule on the same shape
        ((8000, 896, bwd), ((4000,), 2, 1024, 8)),
    ]
    for (m, f, rule), expected in calls:
        assert kernels.launch_config(m, f, rule, interpret=False) == expected
        assert kernels.tile(m, f, rule, interpret=False) == expected[1:]


@pytest.mark.parametrize("device", DEVICES)
def test_a_new_shape_after_a_launch_is_covered_whole(device):
    """Launches at one shape, then at more rows and at more columns: every element of each
    output is written (NaN-filled buffers) and right, so no grid is reused for a new shape."""
    for m, f in [(20, 40), (50, 40), (50, 72), (20, 40)]:
        preact = torch.randn(m, 2 * f, device=device)
        grad_h = torch.randn(m, f, device=device)
        h = torch.full((m, f), float("nan"), device=device)
        grad_preact = torch.full((m, 2 * f), float("nan"), device=device)
        kernels.swiglu_forward(preact, h)
        assert_within_ulp(h, reference.swiglu(preact), torch.float32)
        kernels.swiglu_backward(preact, grad_h, grad_preact, None)
        assert_within_ulp(grad_preact, reference.swiglu_grad(preact, grad_h), torch.float32)
