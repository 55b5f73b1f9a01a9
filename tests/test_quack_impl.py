"""The quack impls on CUDA: numerics, in-place backward, errors, memory (CPU: test_errors)."""

import pytest
import torch
from helpers import TOLERANCE, dispatch_table, reference_outputs, rel_err, run_outputs

from swiglu_train import ParMLP
from swiglu_train.layers.registry import QUACK_IMPLS
from swiglu_train.ops import (
    DOUBLE_BACKWARD_ERROR,
    SECOND_BACKWARD_ERROR,
    SECOND_BACKWARD_ERROR_FACTORS,
    SECOND_BACKWARD_FREED_ERROR,
    SECOND_BACKWARD_FREED_ERROR_FACTORS,
    dispatch,
    inference,
    reference,
)
from swiglu_train.ops.quack_mlp import (
    ONE_M_TILE_N,
    SMALL_M_TILES_N,
    quack_available,
    quack_swiglu_projection,
    require_quack,
    small_m_tile_n,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not quack_available(), reason="needs quack-kernels and an sm_90+ GPU"),
]
QUACK = sorted(QUACK_IMPLS)
# each quack impl saves what its portable twin saves, and raises its twin's second-backward error
TWIN = {"drop_h_quack": "drop_h", "save_factors_quack": "save_factors"}
SECOND_BACKWARD = {
    "drop_h_quack": SECOND_BACKWARD_ERROR,
    "save_factors_quack": SECOND_BACKWARD_ERROR_FACTORS,
}
SECOND_BACKWARD_FREED = {  # the first backward ran without retain_graph=True
    "drop_h_quack": SECOND_BACKWARD_FREED_ERROR,
    "save_factors_quack": SECOND_BACKWARD_FREED_ERROR_FACTORS,
}


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m", [1, 777, 4096])
@pytest.mark.parametrize("impl", QUACK)
def test_matches_float64_reference(impl, m, dtype, bias):
    mlp = ParMLP(512, 1408, 384, bias=bias, impl=impl, device="cuda", dtype=dtype)
    x = torch.randn(m, 512, device="cuda", dtype=dtype)
    grad_y = torch.randn(m, 384, device="cuda", dtype=dtype)
    expected = reference_outputs(mlp, x, grad_y)
    actual = run_outputs(mlp, x, grad_y)
    assert actual.keys() == expected.keys()
    for name in expected:
        assert actual[name].shape == expected[name].shape, name
        assert rel_err(actual[name], expected[name]) < TOLERANCE[dtype], name


@pytest.mark.parametrize("impl", QUACK)
def test_inplace_and_copy_backward_agree_bitwise(impl):
    mlp = ParMLP(1024, 2816, bias=True, impl=impl, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 1000, 1024, device="cuda", dtype=torch.bfloat16)
    grad_y = torch.randn_like(x)
    inplace = run_outputs(mlp, x, grad_y)
    mlp.inplace = False
    copied = run_outputs(mlp, x, grad_y)
    for name in inplace:
        assert torch.equal(inplace[name], copied[name]), name


@pytest.mark.parametrize("schedule", [(False, True), (True, True)], ids=["grad_h", "both"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("impl", QUACK)
def test_fused_gemms_on_the_dynamic_schedule_compute_the_same_mlp(impl, bias, schedule):
    """The grid's *_dynamic_* diagnostics: the fused GEMMs on quack's dynamic tile schedule
    (each tile's sum is the same; only which SM takes it changes) give the static run's
    outputs bit for bit, in place and not."""
    from swiglu_train.layers.registry import get_impl
    from swiglu_train.ops.quack_mlp import FusedSchedule

    mlp = ParMLP(1024, 2816, bias=bias, impl=impl, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(3000, 1024, device="cuda", dtype=torch.bfloat16)
    grad_y = torch.randn_like(x)
    static = run_outputs(mlp, x, grad_y)
    function, dynamic = get_impl(impl), FusedSchedule(*schedule)
    b1, b2 = (mlp.fc1.bias, mlp.fc2.bias) if bias else (None, None)
    for inplace in (True, False):
        mlp.forward = lambda t, inplace=inplace: function(
            t, mlp.fc1.weight, b1, mlp.fc2.weight, b2, inplace=inplace, dynamic=dynamic
        )
        moved = run_outputs(mlp, x, grad_y)
        for name in static:
            assert torch.equal(moved[name], static[name]), (name, inplace)


@pytest.mark.parametrize("impl", QUACK)
def test_second_backward_raises(impl):
    mlp = ParMLP(256, 512, impl=impl, device="cuda", dtype=torch.bfloat16)
    y = mlp(torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True))
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError) as info:
        y.sum().backward()
    assert str(info.value) == SECOND_BACKWARD[impl]
    y = mlp(torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True))
    y.sum().backward()
    with pytest.raises(RuntimeError) as info:
        y.sum().backward()
    assert str(info.value) == SECOND_BACKWARD_FREED[impl]


@pytest.mark.parametrize("impl", QUACK)
def test_double_backward_is_refused(impl):
    mlp = ParMLP(256, 512, impl=impl, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(RuntimeError) as info:
        torch.autograd.grad(mlp(x).sum(), x, create_graph=True)
    assert str(info.value) == DOUBLE_BACKWARD_ERROR


@pytest.mark.parametrize("impl", QUACK)
def test_bad_inputs_on_cuda(impl):
    mlp = ParMLP(256, 500, impl=impl, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=rf"{impl}' needs sizes .*multiples of 8.*'ffn': 500"):
        mlp(torch.randn(8, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True))
    mlp = ParMLP(256, 512, impl=impl, device="cuda")
    with pytest.raises(TypeError, match=r"bf16 or fp16 tensors, got torch\.float32"):
        mlp(torch.randn(8, 256, device="cuda", requires_grad=True))


def _memory(impl: str, m: int, d: int, f: int) -> tuple[int, int]:
    """(bytes held after forward, peak bytes of fwd+bwd above the pre-forward baseline), the
    smaller of two steps: a library's lazy one-off allocation (a GPU run under xdist once saw
    512 KiB appear in one step after the warm-up, depending on the tests before) lands in the
    next step's baseline, while what the graph holds appears in every step."""
    mlp = ParMLP(d, f, impl=impl, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad_y = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):  # warm-up: compiles, workspaces, the grads' first allocation
        mlp(x).backward(grad_y)
    steps = []
    for _ in range(2):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        y = mlp(x)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base
        y.backward(grad_y)
        del y
        torch.cuda.synchronize()
        steps.append((held, torch.cuda.max_memory_allocated() - base))
    return min(s[0] for s in steps), min(s[1] for s in steps)


@pytest.mark.parametrize("impl", QUACK)
def test_memory_is_the_portable_twin_s_or_less(impl):
    """The same saved tensors as the portable twin, and backward writes grad_preact over the
    saved [M, 2F] tensor."""
    m, d, f = 4096, 1024, 2816
    quack_held, quack_peak = _memory(impl, m, d, f)
    twin_held, twin_peak = _memory(TWIN[impl], m, d, f)
    assert quack_held == twin_held
    assert quack_peak <= twin_peak


@pytest.mark.parametrize("m", [1, 100, 512])  # the small-M rule pins a config at 1 and 100
def test_no_grad_quack_path_where_the_table_names_it(m):
    """The dispatch's "quack" path: quack's gated GEMM for h, then cuBLAS fc2."""
    table = dispatch_table({"1024x2816": {"gated": {m: "quack"}, "mlp": {m: "quack"}}})
    for kind in ("gated", "mlp"):
        table["shapes"]["1024x2816"][kind][str(m)]["fallback"] = "cublas"
    mlp = ParMLP(1024, 2816, bias=True, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    params = (mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias)
    expected = reference.mlp(x.double(), *(p.double() for p in params))
    with dispatch.use_table(table), torch.no_grad():
        assert inference.inference_path(x, mlp.fc1.weight, mlp.fc2.weight, None) == "quack"
        assert inference.projection_path(x, mlp.fc1.weight, None) == "quack"
        y = mlp(x)
    assert rel_err(y, expected) < TOLERANCE[torch.bfloat16]


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="the small-M rule pins SM90 configs only",
)
@pytest.mark.parametrize("interleaved", [False, True], ids=["canonical", "interleaved"])
@pytest.mark.parametrize("tile_n", SMALL_M_TILES_N + ONE_M_TILE_N)  # 100 rows: one M tile
def test_small_m_projection_at_every_n_tile(tile_n, interleaved, monkeypatch):
    """Each N tile the small-M rule can pin (pingpong up to 192, cooperative above) computes
    h with a bias: F is the narrowest that makes this GPU's SM count pick it at 100 rows."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    f = next(f for f in range(256, 1 << 16, 64) if small_m_tile_n(100, 2 * f, sms) == tile_n)
    x = torch.randn(100, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * f, 512, device="cuda", dtype=torch.bfloat16) / 512**0.5
    b = torch.randn(2 * f, device="cuda", dtype=torch.bfloat16)

    def to_canonical(t: torch.Tensor) -> torch.Tensor:  # [g0, u0, g1, u1, ...] -> [gate; up]
        return t.view(f, 2, -1).transpose(0, 1).reshape(2 * f, -1) if interleaved else t

    preact = x.double() @ to_canonical(w).double().t() + to_canonical(b[:, None]).double().t()
    expected = reference.swiglu(preact)
    pinned, gemm_gated = [], require_quack().gemm_gated

    def spy(*args, **kwargs):
        pinned.append(kwargs.get("config"))
        return gemm_gated(*args, **kwargs)

    monkeypatch.setattr(require_quack(), "gemm_gated", spy)
    h = quack_swiglu_projection(x, w, b, interleaved=interleaved)
    assert [c.tile_n for c in pinned if c is not None] == [tile_n]
    assert rel_err(h, expected) < TOLERANCE[torch.bfloat16]


def test_an_empty_no_grad_batch_on_the_chunk_1_layout():
    """save_factors_quack's no-grad path goes to quack at any M; an empty batch returns empty."""
    mlp = ParMLP(1024, 2816, impl="save_factors_quack", device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        y = mlp(torch.randn(0, 1024, device="cuda", dtype=torch.bfloat16))
    assert y.shape == (0, 1024)


def test_a_column_major_fc1_gives_the_row_major_answer():
    """quack's concat_layout reads [W_gate; W_up] along fc1's rows: a column-major fc1 (a
    transposed view) is made row-major first, not read with gate and up interleaved wrongly."""
    from swiglu_train.ops.quack_mlp import drop_h_quack_mlp

    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(1408, 512, device="cuda", dtype=torch.bfloat16) / 512**0.5
    w2 = torch.randn(512, 704, device="cuda", dtype=torch.bfloat16) / 704**0.5
    column_major = w1.t().contiguous().t()
    assert column_major.stride(1) != 1 and torch.equal(column_major, w1)
    with torch.no_grad():
        expected = drop_h_quack_mlp(x, w1, None, w2, None)
        actual = drop_h_quack_mlp(x, column_major, None, w2, None)
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("impl", QUACK)
def test_autocast_with_fp32_master_weights(impl):
    """Mixed precision as trainers run it: fp32 parameters, bf16 compute, fp32 grads."""
    mlp = ParMLP(512, 1408, impl=impl, device="cuda")
    x = torch.randn(300, 512, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = mlp(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert mlp.fc1.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    expected = reference_outputs(mlp, x, torch.ones(300, 512))
    assert rel_err(y, expected["y"]) < TOLERANCE[torch.bfloat16]
    assert rel_err(mlp.fc1.weight.grad, expected["fc1.weight"]) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("impl", QUACK)
def test_activation_checkpointing(impl, reentrant):
    """The recompute of a checkpointed forward runs under grad (non-reentrant) or no-grad then
    grad (reentrant); either way the grads are the reference's."""
    mlp = ParMLP(512, 1408, impl=impl, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16)
    grad_y = torch.randn_like(x)
    expected = reference_outputs(mlp, x, grad_y)

    class Checkpointed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = mlp

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.utils.checkpoint.checkpoint(self.mlp, x, use_reentrant=reentrant)

    actual = run_outputs(Checkpointed(), x, grad_y)
    for name, value in expected.items():
        key = name if name in ("y", "x") else f"mlp.{name}"
        assert rel_err(actual[key], value) < TOLERANCE[torch.bfloat16], name


@pytest.mark.parametrize("impl", QUACK)
def test_torch_compile_matches_eager(impl):
    """torch.compile (graph breaks allowed: quack's kernels are opaque to it) computes what
    eager does."""
    torch._dynamo.reset()
    mlp = ParMLP(512, 1408, impl=impl, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y_eager = mlp(x)
    (gx_eager,) = torch.autograd.grad(y_eager.float().square().sum(), x)
    y = torch.compile(mlp)(x)
    (gx,) = torch.autograd.grad(y.float().square().sum(), x)
    torch.testing.assert_close(y, y_eager, rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(gx, gx_eager, rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_no_grad_reads_the_chunk_1_layout_with_quack(bias):
    """save_factors_quack's fc1 (packed, chunk 1) is quack's own pair order: with no grad it
    takes quack's gated GEMM directly, and computes the reference's y."""
    kwargs = {"bias": bias, "device": "cuda", "dtype": torch.bfloat16}
    mlp = ParMLP(1024, 2816, impl="save_factors_quack", **kwargs)
    canonical = ParMLP(1024, 2816, impl="normal", **kwargs)
    canonical.load_state_dict(mlp.state_dict())  # unpacked on load, by the layout stamp
    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        assert inference.inference_path(x, mlp.fc1.weight, mlp.fc2.weight, 1) == "quack"
        assert inference.projection_path(x, mlp.fc1.weight, 1) == "quack"
        y = mlp(x)
        c = canonical
        params = (c.fc1.weight, c.fc1.bias, c.fc2.weight, c.fc2.bias)
        expected = reference.mlp(x.double(), *(None if p is None else p.double() for p in params))
    assert rel_err(y, expected) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("impl", QUACK)
def test_an_empty_batch_takes_the_portable_twin(impl):
    mlp = ParMLP(256, 512, 128, bias=True, impl=impl, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(0, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = mlp(x)
    y.sum().backward()
    assert y.shape == (0, 128) and x.grad.shape == (0, 256)
    assert all(p.grad is not None and not p.grad.any() for p in mlp.parameters())


def test_quack_s_missing_optional_heuristics_are_not_searched_for_on_every_gemm():
    """quack asks for nvMatmulHeuristics on every concat GEMM; once quack is loaded a copy
    that is not installed is a negative sys.modules entry, so those imports fail at once."""
    import sys

    from swiglu_train.ops.quack_mlp import QUACK_OPTIONAL_HEURISTICS

    require_quack()
    entry = sys.modules.get(QUACK_OPTIONAL_HEURISTICS, "absent")
    installed = entry is not None and entry != "absent"
    assert installed or entry is None, "the missing module was not remembered"
