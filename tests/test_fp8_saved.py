"""drop_h with an FP8-saved preactivation: the format, the kernels against the torch path, the
gradients against float64, the bytes saved and ParMLP's saved_fp8 option.

Tolerances. e4m3 keeps 3 mantissa bits, so one stored value is off by at most 2**-4 of itself
(half a spacing), or by half the subnormal spacing, 2**-10 of its block's scale. A gradient
sums many such products: measured norm-relative errors are 1-4 % (docs/fp8.md), so 0.06
(about the per-element bound) is asserted, and more than 1e-2, well above the bf16 path's
~4e-3, so that a test cannot pass with the FP8 copy unused.
"""

import pytest
import torch
from conftest import HAS_CUDA, device_backends
from helpers import fp8_buffers, rel_err

from swiglu_train import ParMLP
from swiglu_train.kernels.fp8_format import BLOCK, E4M3_MAX, n_blocks, round_up_bf16
from swiglu_train.kernels.runtime import triton_runs_on
from swiglu_train.kernels.swiglu import tile
from swiglu_train.kernels.swiglu_fp8 import fp8_tile
from swiglu_train.layers.layout import CANONICAL
from swiglu_train.memory import SavedTensorCounter
from swiglu_train.ops import reference, use_backend
from swiglu_train.ops.activation import swiglu_fwd
from swiglu_train.ops.fp8_saved import (
    SECOND_BACKWARD_ERROR_FP8,
    SECOND_BACKWARD_FREED_ERROR_FP8,
    dequantize,
    quantize,
    recompute,
    swiglu_bwd_fp8_,
    swiglu_fwd_fp8_,
)

FP8_GRAD_MAX, FP8_GRAD_MIN = 0.06, 1e-2
M, D, FFN, OUT = 53, 24, 200, 16  # FFN 200: one whole and one partial block per half
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
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The autograd side does not depend on which kernels run; the interpreter is slow, so it runs
# there once per test (bf16), torch and CUDA in every dtype.
NOT_INTERPRETED = [p for p in device_backends() if p.id != "cpu-triton"]


def with_dtypes(dtypes: list[torch.dtype]) -> list:
    return [
        pytest.param(*p.values, dtype, marks=p.marks, id=f"{p.id}-{str(dtype)[6:]}")
        for p in device_backends()
        for dtype in dtypes
        if p.id != "cpu-triton" or dtype == torch.bfloat16
    ]


def codes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def awkward_preact(m: int, ffn: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Random values with an outlier, a zero row, a row of tiny values, and a -0.0. Tiny, not
    subnormal in bf16: the interpreter converts bf16 subnormals to fp32 wrongly."""
    preact = torch.randn(m, 2 * ffn, device=device) * 3
    preact[0, min(5, 2 * ffn - 1)] = 3e4 if dtype == torch.float16 else 1e30
    if m > 2:
        preact[1] = 0.0
        preact[2] *= 1e-6 if dtype == torch.float16 else 1e-30
    preact[-1, -1] = -0.0
    return preact.to(dtype)


def fp8_pass(preact: torch.Tensor, backend: str, device=None):
    """(h, values, scales) of the forward op on ``device`` (None: preact's), back on preact's."""
    on_device = preact.to(device)
    buffers = fp8_buffers(preact.shape[0], preact.shape[1] // 2, on_device)
    with use_backend(backend):
        swiglu_fwd_fp8_(on_device, *buffers)
    return tuple(t.to(preact.device) for t in buffers)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("m", "ffn"), [(1, 1), (19, 200), (5, 300)])
def test_kernel_writes_the_torch_path_s_bytes_and_drop_h_s_h(device, dtype, m, ffn):
    preact = awkward_preact(m, ffn, dtype, device)
    h, q, scales = fp8_pass(preact, "triton")
    expected_q, expected_scales = quantize(preact)
    assert torch.equal(codes(q), codes(expected_q))
    assert torch.equal(scales, expected_scales)
    with use_backend("triton"):  # drop_h's own forward kernel: y is unchanged by the option
        assert torch.equal(h, swiglu_fwd(preact))


@pytest.mark.parametrize(("m", "ffn"), [(11136, 14336), (8000, 11008), (3, 64), (1, 130), (7, 200)])
@pytest.mark.parametrize("rule", [(1024, 4), (2048, 8), (4096, 8)])
def test_gpu_tiles_cover_whole_scale_blocks_within_the_element_budget(m, ffn, rule):
    block_m, block_n, warps = fp8_tile(m, ffn, rule, interpret=False)
    assert block_n % BLOCK == 0 and block_n & (block_n - 1) == 0 and block_m & (block_m - 1) == 0
    assert warps == rule[1] and block_m * block_n <= max(rule[0], block_n)
    assert block_n == max(BLOCK, tile(m, ffn, rule, interpret=False)[1])  # drop_h's columns
    assert block_m <= max(m, 1) * 2  # no more rows than the next power of two of M


def test_round_trip_error_is_e4m3_rounding():
    """Every value comes back within half an e4m3 spacing of its block's grid, over 60 binades."""
    preact = torch.randn(64, 2 * 300) * torch.logspace(-30, 30, 64)[:, None]
    q, scales = quantize(preact)
    per_column = scales.view(64, 2, -1).repeat_interleave(BLOCK, -1)[..., :300].reshape(64, 600)
    error = (dequantize(q, scales) - preact).abs()
    bound = 2.0**-4 * preact.abs() + 2.0**-10 * per_column
    assert (error <= bound * (1 + 2**-20)).all()
    assert rel_err(dequantize(q, scales), preact) > 1e-2  # it is 8-bit, not a copy


@pytest.mark.parametrize(("device", "backend"), device_backends())
def test_ties_round_to_nearest_even_and_nothing_passes_448(device, backend):
    """One row whose block max is 448, so values are stored unscaled: midpoints go to the even
    neighbour, normal (116 -> 112, 124 -> 128) and subnormal (2**-10 -> 0, 3 * 2**-10 ->
    2**-8); and a block whose scaled max rounds past 448 in fp32 is stored as 448, not NaN."""
    row = torch.zeros(1, 2 * BLOCK)
    row[0, :5] = torch.tensor([448.0, 116.0, 124.0, 2.0**-10, 3 * 2.0**-10])
    row[0, BLOCK] = 3.102123260498047  # * (448 / itself) = 448.00003 in fp32
    _, q, scales = fp8_pass(row, backend, device)
    values = q.float()[0]
    assert values[:5].tolist() == [448.0, 112.0, 128.0, 0.0, 2.0**-8]
    assert scales[0, 0] == 1.0
    assert values[BLOCK] == E4M3_MAX


def test_scales_round_up_to_bf16_and_keep_nan_and_inf():
    """Up to the next bf16 (so the block max over its scale is at most 448) unless already
    one; NaN and inf as they are; and no carry turns a scale into another kind of value."""
    one_up = torch.tensor(1.0).nextafter(torch.tensor(2.0))
    top = torch.tensor(torch.finfo(torch.bfloat16).max)
    scales = torch.tensor([1.0, one_up, 2.0**-126, float("inf"), float("nan"), top, 0.3])
    rounded = round_up_bf16(scales)
    assert rounded[:4].tolist() == [1.0, 1.0078125, 2.0**-126, float("inf")]
    assert rounded[4].isnan() and rounded[5] == top
    assert rounded[6] >= 0.3 and rounded[6] == rounded[6].bfloat16().float()
    below = (rounded[6:].view(torch.int32) - 2**16).view(torch.float32)  # the bf16 under it
    assert below < scales[6]


@pytest.mark.parametrize(("device", "backend"), device_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_values_at_the_dtype_s_limits_stay_finite(device, backend, dtype):
    top = torch.finfo(dtype).max
    preact = torch.tensor([[top, -top, 1.0, -1.0], [top, 1e-30, -top, 0.5]], dtype=dtype)
    _, q, scales = fp8_pass(preact, backend, device)
    assert torch.isfinite(q.float()).all() and torch.isfinite(scales).all()
    restored = dequantize(q, scales)
    assert torch.isfinite(restored).all()
    big = preact.float().abs() > 1e30  # the others share a block with them: flushed to 0
    assert ((restored - preact.float()).abs()[big] <= 2.0**-4 * preact.float().abs()[big]).all()


def test_the_largest_fp32_values_come_back_finite():
    """448 * (amax / 448) may round above amax: not past fp32's max for its top 2**17 values."""
    top = torch.tensor(torch.finfo(torch.float32).max).view(torch.int32)
    values = (top - torch.arange(2**17, dtype=torch.int32)).view(torch.float32)
    q, scales = quantize(values[:, None].expand(-1, 2))
    assert torch.isfinite(dequantize(q, scales)).all()


@pytest.mark.parametrize(("device", "backend"), device_backends())
def test_blocks_are_per_half_with_a_partial_last_block(device, backend):
    ffn = 200
    preact = torch.randn(3, 2 * ffn)
    preact[:, 150] = 1000.0  # in the gate's partial block only
    _, q, scales = fp8_pass(preact, backend, device)
    assert scales.shape == (3, 2 * n_blocks(ffn)) == (3, 4)
    scales = scales.float()
    for b, (lo, hi) in enumerate([(0, 128), (128, 200), (200, 328), (328, 400)]):
        amax = preact[:, lo:hi].abs().amax(1)  # its block max over its scale: in (444.5, 448]
        assert ((amax / scales[:, b] <= E4M3_MAX) & (amax / scales[:, b] > 448 / 1.0079)).all()
    assert (scales[:, 1] == round_up_bf16(torch.tensor(1000.0) / E4M3_MAX)).all()
    assert (scales[:, [0, 2, 3]] < 10 / E4M3_MAX).all()  # the outlier's block only
    assert rel_err(dequantize(q, scales)[:, 200:], preact[:, 200:]) < 2**-4


@pytest.mark.parametrize(("device", "backend"), device_backends())
def test_a_zero_block_gets_a_safe_scale_and_comes_back_zero(device, backend):
    _, q, scales = fp8_pass(torch.zeros(2, 2 * 130), backend, device)
    assert (scales == 2.0**-126).all()
    assert (dequantize(q, scales) == 0).all()


@pytest.mark.parametrize(("device", "backend"), device_backends())
def test_a_non_finite_value_makes_its_block_nan_and_no_other(device, backend):
    preact = torch.randn(3, 2 * 130)
    preact[0, 3], preact[2, 200] = float("nan"), float("inf")  # gate block 0; up block 0
    _, q, scales = fp8_pass(preact, backend, device)
    restored = dequantize(q, scales)
    expected_nan = torch.zeros(3, 260, dtype=torch.bool)
    expected_nan[0, :128] = expected_nan[2, 130:258] = True
    assert torch.equal(restored.isnan(), expected_nan)
    grad_h, grad_preact = torch.ones(3, 130, device=device), torch.empty(3, 260, device=device)
    with use_backend(backend):
        swiglu_bwd_fp8_(q.to(device), scales.to(device), grad_h, grad_preact)
    grad_preact = grad_preact.cpu()
    assert not grad_preact[0].isfinite().all() and not grad_preact[2].isfinite().all()
    assert grad_preact[1].isfinite().all()


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_kernel_matches_the_torch_path(device, dtype):
    """The same saved bytes give the same h and grad_preact (to the interpreter's bf16 rounding,
    toward zero: two ulps)."""
    preact = awkward_preact(19, 200, dtype, device)
    _, q, scales = fp8_pass(preact, "triton")
    grad_h = torch.randn(19, 200, device=device).to(dtype)
    expected_h, expected_grad = recompute(q, scales, grad_h)
    h, grad_preact = grad_h.clone(), grad_h.new_empty(19, 400)
    with use_backend("triton"):
        swiglu_bwd_fp8_(q, scales, h, grad_preact)
    tol = {torch.float32: 2**-20, torch.float16: 2**-9, torch.bfloat16: 2**-6}[dtype]
    torch.testing.assert_close(h, expected_h, rtol=tol, atol=tol)
    torch.testing.assert_close(grad_preact, expected_grad, rtol=tol, atol=tol)


@pytest.mark.parametrize(("device", "backend"), device_backends())
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_backward_from_the_copy_finds_the_amaxes_of_what_it_writes(device, backend, rowwise):
    """swiglu_bwd_fp8_amax_, FP8 training's backward from the copy: the h and grad_preact of
    swiglu_bwd_fp8_, and torch.amax's of them, bit for bit (over row tiles and scale blocks
    past their edges, a non-finite value spoiling its row alone); [0, 1] rows if not rowwise."""
    from swiglu_train.ops.fp8_saved import swiglu_bwd_fp8_amax_

    preact = awkward_preact(19, 200, torch.bfloat16, device)
    _, q, scales = fp8_pass(preact, "triton" if backend == "triton" else "torch")
    grad_h = torch.randn(19, 200, device=device).to(torch.bfloat16)
    grad_h[4, 9] = float("inf")
    h, grad_preact = grad_h.clone(), grad_h.new_empty(19, 400)
    found_h, found_grad = grad_h.clone(), grad_h.new_empty(19, 400)
    with use_backend(backend):
        swiglu_bwd_fp8_(q, scales, h, grad_preact)
        pair, rows = swiglu_bwd_fp8_amax_(q, scales, found_h, found_grad, rowwise)
    assert torch.equal(found_h.nan_to_num(), h.nan_to_num())
    assert torch.equal(found_grad.nan_to_num(), grad_preact.nan_to_num())
    expected = torch.stack([grad_preact.abs().amax(), h.abs().amax()]).float()
    assert torch.equal(pair.nan_to_num(-1.0), expected.nan_to_num(-1.0))
    if not rowwise:
        assert rows.shape == (0, 1)
        return
    per_row = grad_preact.abs().amax(1, keepdim=True).float()
    assert torch.equal(rows.nan_to_num(-1.0), per_row.nan_to_num(-1.0))
    assert not rows[4].isfinite().all() and rows[5].isfinite().all()


def test_custom_ops_pass_opcheck():
    """Schema, fake kernels and mutation, as torch.compile relies on. The schema test is left
    out: it compares inputs by arithmetic torch lacks for float8 on CPU."""
    preact = torch.randn(5, 2 * 130)
    q, scales = quantize(preact)
    no_schema = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    with use_backend("torch"):
        torch.library.opcheck(
            swiglu_fwd_fp8_.op, (preact, *fp8_buffers(5, 130, preact)), test_utils=no_schema
        )
        torch.library.opcheck(
            swiglu_bwd_fp8_.op,
            (q, scales, torch.randn(5, 130), torch.empty(5, 260)),
            test_utils=no_schema,
        )


def float64_grads(mlp: ParMLP, x: torch.Tensor, grad_y: torch.Tensor) -> dict:
    params = [p.detach().double().cpu().requires_grad_() for p in mlp.parameters()]
    x64 = x.detach().double().cpu().requires_grad_()
    w1, b1, w2, b2 = params
    y = reference.mlp(x64, w1, b1, w2, b2)
    y.backward(grad_y.double().cpu())
    return {"y": y, "x": x64.grad, "w1": w1.grad, "b1": b1.grad, "w2": w2.grad}


def run(mlp: ParMLP, x: torch.Tensor, grad_y: torch.Tensor, backend: str) -> dict:
    x = x.detach().clone().requires_grad_()
    mlp.zero_grad()
    with use_backend(backend):
        y = mlp(x)
        y.backward(grad_y)
    return {"y": y.detach(), "x": x.grad, "w1": mlp.fc1.weight.grad, "b1": mlp.fc1.bias.grad,
            "w2": mlp.fc2.weight.grad}  # fmt: skip


@pytest.mark.parametrize(("device", "backend", "dtype"), with_dtypes(DTYPES))
def test_grads_against_float64_within_e4m3_rounding(device, backend, dtype):
    fp8 = ParMLP(D, FFN, OUT, bias=True, saved_fp8=True, device=device, dtype=dtype)
    bf16 = ParMLP(D, FFN, OUT, bias=True, device=device, dtype=dtype)
    bf16.load_state_dict(fp8.state_dict())
    x = torch.randn(M, D, device=device, dtype=dtype)
    grad_y = torch.randn(M, OUT, device=device, dtype=dtype)
    expected = float64_grads(fp8, x, grad_y)
    got, plain = run(fp8, x, grad_y, backend), run(bf16, x, grad_y, backend)
    assert torch.equal(got["y"], plain["y"])  # forward reads the preactivation itself
    for name in ("x", "w1", "b1", "w2"):
        err = rel_err(got[name], expected[name])
        assert FP8_GRAD_MIN < err < FP8_GRAD_MAX, (name, err)


@pytest.mark.parametrize(("device", "backend"), NOT_INTERPRETED)  # the kernels' own: equal bytes
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_saved_bytes_are_x_the_fp8_copy_and_its_scales(device, backend, dtype):
    x = torch.randn(M, D, device=device, dtype=dtype, requires_grad=True)
    item = x.element_size()
    saved = {}
    for fp8 in (False, True):
        mlp = ParMLP(D, FFN, OUT, saved_fp8=fp8, device=device, dtype=dtype)
        with use_backend(backend), SavedTensorCounter(exclude=mlp.parameters()) as counter:
            y = mlp(x)
        with use_backend(backend):
            y.sum().backward()
        saved[fp8] = (counter.bytes, counter.count)
    scales = M * 2 * n_blocks(FFN) * 2  # bf16
    assert saved[True] == (M * D * item + M * 2 * FFN + scales, 3)
    assert saved[False] == (M * D * item + M * 2 * FFN * item, 2)


def saved_by(mlp: ParMLP, x: torch.Tensor, backend: str):
    """(y, every tensor the graph saved)."""
    kept = []

    def pack(t):
        kept.append(t)
        return t

    with use_backend(backend), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = mlp(x)
    return y, kept


@pytest.mark.parametrize(("device", "backend"), NOT_INTERPRETED)
def test_backward_frees_the_fp8_copy_and_refuses_a_second_one(device, backend):
    mlp = ParMLP(D, FFN, saved_fp8=True, device=device)
    x = torch.randn(M, D, device=device, requires_grad=True)
    y, kept = saved_by(mlp, x, backend)
    fp8_copy = [t for t in kept if t.dtype == torch.float8_e4m3fn]
    assert len(fp8_copy) == 1 and fp8_copy[0].untyped_storage().nbytes() == M * 2 * FFN
    with use_backend(backend):
        y.sum().backward(retain_graph=True)
        assert fp8_copy[0].untyped_storage().nbytes() == 0
        with pytest.raises(RuntimeError) as e:
            y.sum().backward()
    assert str(e.value) == SECOND_BACKWARD_ERROR_FP8
    y, _ = saved_by(mlp, x, backend)
    with use_backend(backend):
        y.sum().backward()
        with pytest.raises(RuntimeError) as e:
            y.sum().backward()
    assert str(e.value) == SECOND_BACKWARD_FREED_ERROR_FP8


@pytest.mark.parametrize(("device", "backend"), NOT_INTERPRETED)
def test_inplace_false_keeps_the_copy_for_a_second_backward(device, backend):
    mlp = ParMLP(D, FFN, saved_fp8=True, inplace=False, device=device)
    x = torch.randn(M, D, device=device, requires_grad=True)
    with use_backend(backend):
        y = mlp(x)
        y.sum().backward(retain_graph=True)
        first = mlp.fc1.weight.grad.clone()
        y.sum().backward()
    torch.testing.assert_close(mlp.fc1.weight.grad, 2 * first)


@pytest.mark.parametrize(("device", "backend"), device_backends()[:1])
def test_torch_compile_fullgraph(device, backend):
    torch._dynamo.reset()
    mlp = ParMLP(16, 40, bias=True, saved_fp8=True, device=device)
    x = torch.randn(33, 16, device=device, requires_grad=True)
    with use_backend(backend):
        y_eager = mlp(x)
        (gx_eager,) = torch.autograd.grad(y_eager.square().sum(), x)
        y = torch.compile(mlp, fullgraph=True, backend="aot_eager")(x)
        (gx,) = torch.autograd.grad(y.square().sum(), x)
    torch.testing.assert_close(y, y_eager, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gx, gx_eager, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_gives_the_same_grads(reentrant):
    """Recomputed in backward, the FP8 copy is the forward's, and freeing it is harmless."""
    mlp = ParMLP(D, FFN, saved_fp8=True)
    x = torch.randn(M, D, requires_grad=True)
    with use_backend("torch"):
        mlp(x).square().sum().backward()
        expected, x.grad = x.grad, None
        torch.utils.checkpoint.checkpoint(mlp, x, use_reentrant=reentrant).square().sum().backward()
    assert torch.equal(x.grad, expected)


def test_the_option_is_off_by_default_and_changes_no_parameter():
    torch.manual_seed(1)
    plain = ParMLP(D, FFN, OUT, bias=True)
    torch.manual_seed(1)
    fp8 = ParMLP(D, FFN, OUT, bias=True, saved_fp8=True)
    assert not plain.saved_fp8 and fp8.saved_fp8 and "saved_fp8=True" in repr(fp8)
    a, b = plain.state_dict(), fp8.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_model_trained_with_it_loads_into_one_without_it():
    fp8 = ParMLP(D, FFN, OUT, saved_fp8=True)
    optimizer = torch.optim.SGD(fp8.parameters(), lr=0.1)
    with use_backend("torch"):
        fp8(torch.randn(M, D)).square().sum().backward()
        optimizer.step()
        plain = ParMLP(D, FFN, OUT)
        plain.load_state_dict(fp8.state_dict())  # strict
        x = torch.randn(M, D)
        assert torch.equal(plain(x), fp8(x))


@pytest.mark.parametrize(
    ("impl", "reason"),
    [
        ("normal", "it saves h .fc2's input. as well as the preactivation"),
        ("save_factors", "it is not implemented for the saved SwiGLU factors: they survive FP8"),
        ("save_factors_quack", "it is not implemented for the saved SwiGLU factors: .*quack epi"),
        ("auto", "auto may pick an impl that cannot store it; name impl 'drop_h'"),
    ],
)
def test_impls_without_an_fp8_copy_are_refused_with_the_reason(impl, reason):
    impls = "impls 'drop_h' and 'drop_h_quack'"
    message = f"saved_fp8=True is for {impls} only, not '{impl}': {reason}"
    with pytest.raises(ValueError, match=message):
        ParMLP(D, FFN, impl=impl, saved_fp8=True, tokens_hint=M)


def test_switching_an_fp8_layer_to_another_impl_is_refused_and_changes_nothing():
    mlp = ParMLP(D, FFN, saved_fp8=True)
    with pytest.raises(ValueError, match="not 'normal'"):
        mlp.impl = "normal"
    with pytest.raises(ValueError, match="not 'save_factors'"):
        mlp.set_impl("save_factors")
    assert mlp.impl == "drop_h" and mlp.fc1_layout == CANONICAL
    plain = ParMLP(D, FFN, impl="normal")
    with pytest.raises(ValueError, match="not 'normal'"):
        plain.saved_fp8 = True
    assert not plain.saved_fp8
    with pytest.raises(TypeError, match="saved_fp8 must be True or False, got 'yes'"):
        ParMLP(D, FFN, saved_fp8="yes")
