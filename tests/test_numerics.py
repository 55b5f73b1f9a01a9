"""Every impl's output and grads against a float64 eager reference."""

import pytest
import torch
from conftest import device_backends
from helpers import TOLERANCE, reference_outputs, rel_err, run_outputs

from swiglu_train import PORTABLE_IMPLS, ParMLP
from swiglu_train.ops import use_backend

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (leading dims of x, D, F, O): M not a multiple of any block, F not a power of two, F = 1.
SHAPES = [((37,), 24, 40, 16), ((3, 43), 32, 70, 20), ((5,), 8, 1, 8), ((1,), 16, 24, 16)]


@pytest.mark.parametrize(("device", "backend"), device_backends())
@pytest.mark.parametrize("impl", PORTABLE_IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, (*s[0], *s[1:]))))
def test_matches_float64_reference(device, backend, impl, dtype, bias, shape):
    lead, d, f, o = shape
    mlp = ParMLP(d, f, o, bias=bias, impl=impl, device=device, dtype=dtype)
    x = torch.randn(*lead, d, device=device, dtype=dtype)
    grad_y = torch.randn(*lead, o, device=device, dtype=dtype)
    expected = reference_outputs(mlp, x, grad_y)
    with use_backend(backend):
        actual = run_outputs(mlp, x, grad_y)
    assert actual.keys() == expected.keys()
    for name in expected:
        assert actual[name].shape == expected[name].shape, name
        assert actual[name].dtype == dtype, name
        assert rel_err(actual[name], expected[name]) < TOLERANCE[dtype], name


@pytest.mark.parametrize(("device", "backend"), device_backends())
@pytest.mark.parametrize("impl", PORTABLE_IMPLS)
def test_non_contiguous_input(device, backend, impl):
    mlp = ParMLP(24, 40, impl=impl, bias=True, device=device)
    base = torch.randn(24, 2 * 29, device=device)
    x = base.t()[::2]  # [29, 24] with strides (2, 58): neither row- nor column-major
    assert not x.is_contiguous()
    grad_y = torch.randn(29, 24, device=device)
    expected = reference_outputs(mlp, x, grad_y)
    with use_backend(backend):
        actual = run_outputs(mlp, x, grad_y)
    for name in expected:
        assert rel_err(actual[name], expected[name]) < TOLERANCE[torch.float32], name


@pytest.mark.parametrize(("device", "backend"), device_backends())
def test_impls_agree_bitwise_in_fp32(device, backend):
    """drop_h recomputes exactly the h that normal saved, so both produce identical grads."""
    mlp = ParMLP(32, 48, impl="normal", bias=True, device=device)
    x = torch.randn(4, 19, 32, device=device)
    grad_y = torch.randn(4, 19, 32, device=device)
    with use_backend(backend):
        normal = run_outputs(mlp, x, grad_y)
        mlp.impl = "drop_h"
        drop_h = run_outputs(mlp, x, grad_y)
    for name in normal:
        torch.testing.assert_close(drop_h[name], normal[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(("device", "backend"), device_backends())
def test_not_inplace_allows_second_backward(device, backend):
    mlp = ParMLP(16, 24, impl="drop_h", inplace=False, device=device)
    x = torch.randn(11, 16, device=device, requires_grad=True)
    with use_backend(backend):
        y = mlp(x)
        y.sum().backward(retain_graph=True)
        first = x.grad.clone()
        y.sum().backward()
    torch.testing.assert_close(x.grad, 2 * first)
