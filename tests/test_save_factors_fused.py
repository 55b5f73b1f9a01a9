"""save_factors through the fused wide-GEMM kernels (CPU interpreter, or CUDA)."""

import functools

import pytest
import torch
from conftest import device_backends
from helpers import TOLERANCE, reference_outputs, rel_err, run_outputs

from swiglu_train import ParMLP
from swiglu_train.ops import save_factors_mlp, use_backend
from swiglu_train.ops.save_factors import swiglu_packed

kernels = pytest.importorskip("swiglu_train.kernels.gated_gemm")
TRITON = [p for p in device_backends() if p.values[1] == "triton"]


@pytest.mark.parametrize(("device", "backend"), TRITON)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize(("m", "d", "f", "chunk"), [(37, 40, 48, 16), (5, 24, 64, 32)])
@pytest.mark.parametrize("fused", [False, True], ids=["cublas_fc1", "gated_gemm"])
def test_triton_paths_match_float64_reference(device, backend, dtype, bias, m, d, f, chunk, fused):
    mlp = ParMLP(d, f, bias=bias, impl="save_factors", chunk=chunk, device=device, dtype=dtype)
    mlp._mlp_function = functools.partial(save_factors_mlp, fused_forward=fused)  # both forwards
    x = torch.randn(3, m, d, device=device, dtype=dtype)
    grad_y = torch.randn(3, m, d, device=device, dtype=dtype)
    expected = reference_outputs(mlp, x, grad_y)
    with use_backend(backend):
        actual = run_outputs(mlp, x, grad_y)
    # The interpreter rounds fp32 -> bf16 toward zero, a bias the four roundings of the fused
    # epilogue (gate, up, silu, h) add up; CUDA rounds to nearest.
    tol = TOLERANCE[dtype] * (2 if device == "cpu" and dtype == torch.bfloat16 else 1)
    for name, value in expected.items():
        assert rel_err(actual[name], value) < tol, name


@pytest.mark.parametrize(("device", "backend"), TRITON)
def test_kernel_writes_h_and_factors_of_the_torch_math(device, backend):
    x = torch.randn(19, 32, device=device)
    w = torch.randn(128, 32, device=device) / 32**0.5
    h, factors = kernels.gated_gemm(x, w, None, chunk=16, aux="factors")
    ref_h, ref_factors = swiglu_packed(torch.nn.functional.linear(x, w), 16)
    torch.testing.assert_close(h, ref_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(factors, ref_factors, rtol=1e-5, atol=1e-5)
    h_only, none = kernels.gated_gemm(x, w, None, chunk=16)
    assert none is None and torch.equal(h_only, h)
    grad_h = torch.randn(19, 64, device=device)
    expected = (factors.view(19, 4, 2, 16) * grad_h.view(19, 4, 1, 16)).view(19, 128)
    kernels.factors_to_grad_(factors, grad_h, 16)
    torch.testing.assert_close(factors, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("device", "backend"), TRITON)
def test_inference_path_saves_nothing_and_agrees(device, backend):
    """No-grad y is the gated GEMM's: bit for bit the fused training forward's, and within
    fp32 rounding of the default forward's (cuBLAS fc1)."""
    mlp = ParMLP(32, 64, impl="save_factors", chunk=16, device=device)
    x = torch.randn(7, 32, device=device)
    with use_backend(backend):
        with torch.no_grad():
            y = mlp(x)
        trained = mlp(x)
        mlp._mlp_function = functools.partial(save_factors_mlp, fused_forward=True)
        trained_fused = mlp(x)
    assert y.grad_fn is None
    torch.testing.assert_close(y, trained_fused.detach(), rtol=0, atol=0)
    torch.testing.assert_close(y, trained.detach(), rtol=1e-5, atol=1e-6)


def test_launcher_checks():
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="needs x"):
        kernels.gated_gemm(x, torch.randn(48, 31), None, chunk=24)
    with pytest.raises(ValueError, match="power of two >= 16 dividing F"):
        kernels.gated_gemm(x, torch.randn(64, 32), None, chunk=8)
    with pytest.raises(ValueError, match="aux must be one of"):
        kernels.gated_gemm(x, torch.randn(64, 32), None, chunk=32, aux="h")
    with pytest.raises(TypeError, match="one dtype"):
        kernels.gated_gemm(x, torch.randn(64, 32, dtype=torch.float64), None, chunk=32)
    with pytest.raises(ValueError, match="fc1 bias must be"):
        kernels.gated_gemm(x, torch.randn(64, 32), torch.randn(32), chunk=32)
    with pytest.raises(ValueError, match="does not match factors"):
        kernels.factors_to_grad_(torch.randn(4, 64), torch.randn(4, 16), 16)


@pytest.mark.parametrize(("device", "backend"), TRITON)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("m", "f", "chunk"), [(19, 64, 16), (7, 40, 40), (5, 48, 24)])
def test_factors_kernel_overwrites_preact_with_the_torch_factors(
    device, backend, dtype, m, f, chunk
):
    """cuBLAS fc1's packed (or canonical: chunk = F) preact becomes the factors, in place, and
    h comes out as the torch math rounds it; chunks need not be powers of two."""
    from swiglu_train.kernels.swiglu import swiglu_factors_

    preact = torch.randn(m, 2 * f, device=device, dtype=dtype)
    ref_h, ref_factors = swiglu_packed(preact, chunk)
    h, storage = torch.empty(m, f, device=device, dtype=dtype), preact.data_ptr()
    swiglu_factors_(preact, h, chunk)
    assert preact.data_ptr() == storage
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(h, ref_h, **tol)
    torch.testing.assert_close(preact, ref_factors, **tol)
    with pytest.raises(ValueError, match="chunk must divide F"):
        swiglu_factors_(preact, h, 7)


@pytest.mark.parametrize(("device", "backend"), TRITON)
@pytest.mark.parametrize("chunk", [16, 24], ids=["pow2", "chunk24"])
def test_cublas_forward_is_the_same_save_factors(device, backend, chunk):
    """fused_forward=False (cuBLAS fc1 + the in-place factors kernel) saves the same factors
    for the same backward: same y and grads as plain torch and, where the chunk allows it
    (a power of two), as the gated GEMM forward."""
    m, d, f = 13, 24, 48
    x = torch.randn(m, d, device=device, requires_grad=True)
    params = [torch.randn(2 * f, d, device=device) / d**0.5, torch.randn(2 * f, device=device)]
    params += [torch.randn(d, f, device=device) / f**0.5, torch.randn(d, device=device)]
    params = [p.requires_grad_() for p in params]
    grad_y = torch.randn(m, d, device=device)

    def run(fused_forward: bool) -> list[torch.Tensor]:
        y = save_factors_mlp(x, *params, chunk=chunk, fused_forward=fused_forward)
        return [y, *torch.autograd.grad(y, [x, *params], grad_y)]

    with use_backend("torch"):
        expected = run(True)
    candidates = [run(False)] + ([run(True)] if chunk == 16 else [])
    for actual in candidates:
        for value, reference in zip(actual, expected, strict=True):
            torch.testing.assert_close(value, reference, rtol=1e-5, atol=1e-5)
    y = save_factors_mlp(x, *params, chunk=chunk, fused_forward=False)
    y.backward(grad_y, retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        y.backward(grad_y)
