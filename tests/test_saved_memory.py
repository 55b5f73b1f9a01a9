"""Bytes saved for backward equal the analytic count, exactly, on every backend."""

import pytest
import torch
from conftest import device_backends

from swiglu_train import ParMLP
from swiglu_train.memory import SavedTensorCounter
from swiglu_train.ops import use_backend

M, D, FFN, OUT = 53, 24, 40, 16


def saved_activation_bytes(mlp: torch.nn.Module, x: torch.Tensor) -> int:
    with SavedTensorCounter(exclude=mlp.parameters()) as counter:
        y = mlp(x)
    y.sum().backward()  # the graph is valid end to end
    return counter.bytes


@pytest.mark.parametrize(("device", "backend"), device_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_saved_bytes_match_analytic_count(device, backend, dtype, bias):
    item = torch.empty((), dtype=dtype).element_size()
    x = torch.randn(M, D, device=device, dtype=dtype, requires_grad=True)
    expected = {
        "normal": (M * D + M * 2 * FFN + M * FFN) * item,  # x, preact, h
        "drop_h": (M * D + M * 2 * FFN) * item,  # x, preact
    }
    with use_backend(backend):
        got = {
            impl: saved_activation_bytes(
                ParMLP(D, FFN, OUT, bias=bias, impl=impl, device=device, dtype=dtype), x
            )
            for impl in expected
        }
    assert got == expected
    assert got["normal"] - got["drop_h"] == M * FFN * item


def test_weights_are_saved_once_and_excluded_by_storage():
    mlp = ParMLP(D, FFN, OUT, impl="drop_h")
    x = torch.randn(M, D, requires_grad=True)
    with SavedTensorCounter() as everything:
        mlp(x).sum().backward()
    weights = (2 * FFN * D + OUT * FFN) * 4
    assert everything.bytes == weights + (M * D + M * 2 * FFN) * 4
    assert everything.count == 4  # x, fc1.weight, fc2.weight, preact


def test_stack_saves_per_layer_preact_and_input():
    layers = torch.nn.Sequential(*[ParMLP(D, FFN, impl="drop_h") for _ in range(4)])
    x = torch.randn(M, D, requires_grad=True)
    with SavedTensorCounter(exclude=layers.parameters()) as counter:
        layers(x)
    assert counter.bytes == 4 * (M * D + M * 2 * FFN) * 4


class SquareSavingMkldnn(torch.autograd.Function):
    """Saves its input as an mkldnn tensor, as an extension keeping oneDNN buffers might."""

    @staticmethod
    def forward(ctx, a: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a.detach().to_mkldnn())
        return a.square()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (a,) = ctx.saved_tensors
        return 2 * a.to_dense() * grad


def test_an_mkldnn_tensor_saved_by_a_function_counts_numel_times_itemsize():
    x = torch.randn(M, D, requires_grad=True)
    with SavedTensorCounter() as counter:
        y = SquareSavingMkldnn.apply(x)
    y.sum().backward()
    assert counter.bytes == M * D * 4 and counter.count == 1
    torch.testing.assert_close(x.grad, 2 * x.detach())


class Unsizable(torch.Tensor):
    """A subclass that refuses both storage and numel: nothing says how big it is."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.untyped_storage, torch.Tensor.numel):
            raise NotImplementedError(f"{cls.__name__} has no {func.__name__}")
        return super().__torch_function__(func, types, args, kwargs or {})


class DoubleSavingUnsizable(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a.detach().as_subclass(Unsizable))
        return a * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        assert isinstance(ctx.saved_tensors[0], Unsizable)  # unpacked as packed
        return grad * 2


def test_a_saved_tensor_of_unknown_size_is_skipped_with_a_warning_naming_it():
    x = torch.randn(M, D, requires_grad=True)
    named = r"cannot size a saved Unsizable \(layout torch\.strided\)"
    with pytest.warns(RuntimeWarning, match=named), SavedTensorCounter() as counter:
        y = DoubleSavingUnsizable.apply(x) + x.exp()  # exp saves its M x D output
    y.sum().backward()
    assert counter.bytes == M * D * 4 and counter.count == 1
    torch.testing.assert_close(x.grad, 2 + x.detach().exp())
