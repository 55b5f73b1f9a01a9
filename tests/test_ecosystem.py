"""ParMLP inside torch.compile, activation checkpointing, autocast and no-grad."""

import pytest
import torch
from conftest import device_backends
from helpers import TOLERANCE, reference_outputs, rel_err, run_outputs

from swiglu_train import PORTABLE_IMPLS, ParMLP
from swiglu_train.ops import use_backend


class Block(torch.nn.Module):
    """A residual block, so compile sees ParMLP between ordinary ops."""

    def __init__(self, impl: str, device: str) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(16, device=device)
        self.mlp = ParMLP(16, 40, impl=impl, bias=True, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


@pytest.mark.parametrize(("device", "backend"), device_backends())
@pytest.mark.parametrize("impl", PORTABLE_IMPLS)
def test_torch_compile_fullgraph(device, backend, impl):
    torch._dynamo.reset()
    block = Block(impl, device)
    x = torch.randn(3, 11, 16, device=device, requires_grad=True)
    with use_backend(backend):
        y_eager = block(x)
        (gx_eager,) = torch.autograd.grad(y_eager.square().sum(), x)
        backend_name = "inductor" if device == "cuda" else "aot_eager"
        compiled = torch.compile(block, fullgraph=True, backend=backend_name)
        y = compiled(x)
        (gx,) = torch.autograd.grad(y.square().sum(), x)
    torch.testing.assert_close(y, y_eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, gx_eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("device", "backend"), device_backends())
@pytest.mark.parametrize("impl", PORTABLE_IMPLS)
@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(device, backend, impl, reentrant):
    mlp = ParMLP(16, 40, impl=impl, device=device)
    x = torch.randn(13, 16, device=device)
    grad_y = torch.randn(13, 16, device=device)
    expected = reference_outputs(mlp, x, grad_y)

    class Checkpointed(torch.nn.Module):
        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(mlp, x, use_reentrant=reentrant)

    wrapper = Checkpointed()
    wrapper.register_module("mlp", mlp)
    with use_backend(backend):
        actual = run_outputs(wrapper, x, grad_y)
    for name, value in expected.items():
        key = name if name in ("y", "x") else f"mlp.{name}"
        assert rel_err(actual[key], value) < TOLERANCE[torch.float32], name


@pytest.mark.parametrize(("device", "backend"), device_backends())
def test_autocast_runs_in_the_autocast_dtype(device, backend):
    mlp = ParMLP(16, 40, impl="drop_h", device=device)  # fp32 master weights
    x = torch.randn(9, 16, device=device, requires_grad=True)
    with use_backend(backend), torch.autocast(device, dtype=torch.bfloat16):
        y = mlp(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert mlp.fc1.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    expected = reference_outputs(mlp, x, torch.ones(9, 16))
    assert rel_err(y, expected["y"]) < TOLERANCE[torch.bfloat16]
    assert rel_err(mlp.fc1.weight.grad, expected["fc1.weight"]) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("impl", PORTABLE_IMPLS)
def test_no_grad_saves_nothing_and_matches(impl):
    mlp = ParMLP(16, 40, impl=impl)
    x = torch.randn(9, 16)
    with torch.no_grad():
        y = mlp(x)
    assert y.grad_fn is None
    torch.testing.assert_close(y, mlp(x).detach())
