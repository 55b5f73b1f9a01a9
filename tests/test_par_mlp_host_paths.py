"""ParMLP.forward's short host path (benchmarks/host_time.py) reads what a model holds now.

forward reads fc1's and fc2's weight and bias from their parameter dicts, skips the reshape
for an [M, D] input and passes over its inputs once; these tests change what it reads between
steps (parameters replaced, cast, parametrized; input shapes and dtypes) and check each step
against the float64 eager MLP on the values the module holds at that step.
"""

import pytest
import torch
from conftest import device_backends
from helpers import TOLERANCE, reference_outputs, rel_err

from swiglu_train.layers import ParMLP
from swiglu_train.ops import use_backend

IMPLS = ("normal", "drop_h", "save_factors")


def assert_step_matches(mlp: ParMLP, x: torch.Tensor) -> None:
    """One forward and backward against the float64 reference on mlp's current parameters."""
    x = x.detach().requires_grad_()
    grad_y = torch.randn(*x.shape[:-1], mlp.fc2.out_features, dtype=x.dtype, device=x.device)
    expected = reference_outputs(mlp, x, grad_y)
    mlp.zero_grad(set_to_none=True)
    y = mlp(x)
    y.backward(grad_y)
    assert y.shape == (*x.shape[:-1], mlp.fc2.out_features)
    tol = TOLERANCE[x.dtype]
    assert rel_err(y, expected["y"]) < tol
    assert rel_err(x.grad, expected["x"]) < tol
    for name, p in mlp.named_parameters():
        assert rel_err(p.grad, expected[name]) < tol, name


@pytest.mark.parametrize(("device", "backend"), device_backends())
@pytest.mark.parametrize("impl", IMPLS)
def test_shapes_dtypes_and_replaced_parameters_are_read_each_step(device, backend, impl):
    mlp = ParMLP(16, 24, bias=True, impl=impl, device=device)
    with use_backend(backend):
        assert_step_matches(mlp, torch.randn(8, 16, device=device))
        assert_step_matches(mlp, torch.randn(3, 5, 16, device=device))  # more rows; [B, S, D]
        assert_step_matches(mlp, torch.randn(1, 16, device=device))
        mlp.fc1.weight = torch.nn.Parameter(torch.randn_like(mlp.fc1.weight))
        mlp.fc2.bias = torch.nn.Parameter(torch.randn_like(mlp.fc2.bias))
        assert_step_matches(mlp, torch.randn(8, 16, device=device))
        mlp.to(torch.bfloat16)
        assert_step_matches(mlp, torch.randn(8, 16, device=device, dtype=torch.bfloat16))
        mlp.fc2.float()  # a module cast in part is named, whatever was read before
        with pytest.raises(TypeError, match=r"fc2\.weight is torch\.float32"):
            mlp(torch.randn(8, 16, device=device, dtype=torch.bfloat16))


class _Scaled(torch.nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return 2 * w


@pytest.mark.parametrize(("device", "backend"), device_backends())
@pytest.mark.parametrize("impl", ["normal", "drop_h"])
def test_a_parametrized_weight_is_read_as_computed(device, backend, impl):
    """A parametrization makes fc.weight a property (not in the parameter dict): forward
    must use the computed weight, and grads reach the original through it."""
    from torch.nn.utils import parametrize

    mlp = ParMLP(16, 24, impl=impl, device=device)
    for fc in (mlp.fc1, mlp.fc2):
        parametrize.register_parametrization(fc, "weight", _Scaled())
    x = torch.randn(8, 16, device=device, requires_grad=True)
    with use_backend(backend):
        y = mlp(x)
    w1, w2 = mlp.fc1.weight.detach().cpu(), mlp.fc2.weight.detach().cpu()  # twice the originals
    x64 = x.detach().cpu().double().requires_grad_()
    w1_64, w2_64 = w1.double().requires_grad_(), w2.double().requires_grad_()
    expected = torch.nn.functional.silu(x64 @ w1_64[:24].t()) * (x64 @ w1_64[24:].t()) @ w2_64.t()
    assert rel_err(y, expected) < TOLERANCE[torch.float32]
    grad_y = torch.randn_like(y)
    with use_backend(backend):
        y.backward(grad_y)
    expected.backward(grad_y.cpu().double())
    original = mlp.fc1.parametrizations.weight.original
    assert rel_err(original.grad, 2 * w1_64.grad) < TOLERANCE[torch.float32]
    assert rel_err(x.grad, x64.grad) < TOLERANCE[torch.float32]
