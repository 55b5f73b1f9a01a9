"""Bad input gets an error that names the problem."""

import sys

import pytest
import torch
from conftest import device_backends

from swiglu_train import MLP_IMPLS, ParMLP
from swiglu_train.extras import MissingExtra
from swiglu_train.layers import PORTABLE_IMPLS
from swiglu_train.ops import (
    DOUBLE_BACKWARD_ERROR,
    SECOND_BACKWARD_ERROR,
    SECOND_BACKWARD_ERROR_FACTORS,
    SECOND_BACKWARD_FREED_ERROR,
    use_backend,
)
from swiglu_train.ops.quack_mlp import check_quack_inputs, require_quack

HAS_CUDA = torch.cuda.is_available()


def test_unknown_impl_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown MLP impl 'fast'.*normal, drop_h"):
        ParMLP(8, 16, impl="fast")
    mlp = ParMLP(8, 16)
    with pytest.raises(ValueError, match="valid impls"):
        mlp.impl = "nope"
    assert mlp.impl == "drop_h"  # a failed switch leaves the layer as it was
    assert set(MLP_IMPLS) == {
        "normal",
        "drop_h",
        "save_factors",
        "drop_h_quack",
        "save_factors_quack",
    }


@pytest.mark.parametrize(("device", "backend"), device_backends())
def test_second_backward_through_inplace_graph_raises(device, backend):
    mlp = ParMLP(8, 16, impl="drop_h", device=device)
    x = torch.randn(5, 8, device=device, requires_grad=True)
    with use_backend(backend):
        y = mlp(x)
        y.sum().backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="inplace=False") as info:
            y.sum().backward()
    assert str(info.value) == SECOND_BACKWARD_ERROR


SECOND_BACKWARD = {  # impl: (graph freed by the first backward, graph retained)
    "drop_h": (SECOND_BACKWARD_FREED_ERROR, SECOND_BACKWARD_ERROR),
    # fc2 runs outside save_factors' Function here, so its freed node raises torch's error
    # first; save_factors_quack, which holds fc2, names this case (tests/test_quack_impl.py)
    "save_factors": (None, SECOND_BACKWARD_ERROR_FACTORS),
}


def _grads(mlp: ParMLP, x: torch.Tensor) -> list[torch.Tensor]:
    return [t.grad.clone() for t in (x, *mlp.parameters())]


@pytest.mark.parametrize("impl", sorted(SECOND_BACKWARD))
@pytest.mark.parametrize(("device", "backend"), device_backends())
def test_second_backward_without_retain_graph_says_so(device, backend, impl):
    """A plain second backward is torch's "backward through the graph a second time", but
    torch's advice (retain_graph=True) cannot help an in-place backward: the error says that,
    and what does help; no gradient is touched."""
    mlp = ParMLP(8, 16, bias=True, impl=impl, device=device)
    x = torch.randn(5, 8, device=device, requires_grad=True)
    with use_backend(backend):
        y = mlp(x)
        y.sum().backward()
        first = _grads(mlp, x)
        with pytest.raises(RuntimeError) as info:
            y.sum().backward()
    expected = SECOND_BACKWARD[impl][0]
    if expected is None:
        assert "backward through the graph a second time" in str(info.value)
    else:
        assert str(info.value) == expected
        for phrase in ("second backward through the same graph", "without retain_graph=True",
                       "retain_graph=True alone would not help", "inplace=False"):  # fmt: skip
            assert phrase in str(info.value)
    for before, after in zip(first, _grads(mlp, x), strict=True):
        assert torch.equal(before, after)


@pytest.mark.parametrize("impl", sorted(SECOND_BACKWARD))
@pytest.mark.parametrize(("device", "backend"), device_backends())
def test_retain_graph_helps_only_an_out_of_place_backward(device, backend, impl):
    """retain_graph=True keeps the saved tensors, but an in-place backward has overwritten
    them: still refused. inplace=False is what lets it backpropagate twice, exactly; without
    retain_graph=True it then gets torch's own error, whose advice is right there."""
    x = torch.randn(5, 8, device=device, requires_grad=True)
    with use_backend(backend):
        y = ParMLP(8, 16, impl=impl, device=device)(x)
        y.sum().backward(retain_graph=True)
        with pytest.raises(RuntimeError) as info:
            y.sum().backward()
        assert str(info.value) == SECOND_BACKWARD[impl][1]

        mlp = ParMLP(8, 16, bias=True, impl=impl, inplace=False, device=device)
        x.grad = None
        y = mlp(x)
        y.sum().backward(retain_graph=True)
        first = _grads(mlp, x)
        y.sum().backward()
        for once, twice in zip(first, _grads(mlp, x), strict=True):
            torch.testing.assert_close(twice, 2 * once)
        with pytest.raises(RuntimeError, match="backward through the graph a second time") as info:
            y.sum().backward()
    assert "ParMLP" not in str(info.value) and "retain_graph=True" in str(info.value)


@pytest.mark.parametrize("impl", sorted(PORTABLE_IMPLS))
@pytest.mark.parametrize(("device", "backend"), device_backends())
def test_double_backward_is_refused_not_silently_wrong(device, backend, impl):
    """A gradient penalty differentiates the backward itself; ours are kernels without
    derivatives, so create_graph=True must fail rather than drop terms (drop_h and
    save_factors used to return wrong fc1 grads and no fc2 grad)."""
    mlp = ParMLP(8, 16, impl=impl, device=device)
    x = torch.randn(5, 8, device=device, requires_grad=True)
    with use_backend(backend), pytest.raises(RuntimeError) as info:
        torch.autograd.grad(mlp(x).sum(), x, create_graph=True)
    assert str(info.value) == DOUBLE_BACKWARD_ERROR
    with use_backend(backend):
        mlp(x).sum().backward()  # a plain backward is unaffected
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_wrong_dtype_names_both_dtypes():
    mlp = ParMLP(8, 16, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"input is torch\.float32.*fc1\.weight is torch\.bfloat16"):
        mlp(torch.randn(3, 8))


def test_integer_input():
    with pytest.raises(TypeError, match=r"floating-point input, got torch\.int64"):
        ParMLP(8, 16)(torch.ones(3, 8, dtype=torch.long))


def test_unsupported_float_dtype():
    with pytest.raises(TypeError, match=r"float64"):
        ParMLP(8, 16, dtype=torch.float64)(torch.randn(3, 8, dtype=torch.float64))


@pytest.mark.parametrize("shape", [(3, 9), (8,), (2, 3, 7)])
def test_wrong_last_dim(shape):
    x = torch.randn(*shape)
    if shape == (8,):  # a 1D input of the right width is a single token and is fine
        assert ParMLP(8, 16)(x).shape == (8,)
        return
    with pytest.raises(ValueError, match=r"last dim must be 8"):
        ParMLP(8, 16)(x)


def test_scalar_input():
    with pytest.raises(ValueError, match=r"last dim must be 8"):
        ParMLP(8, 16)(torch.tensor(1.0))


@pytest.mark.skipif(not HAS_CUDA, reason="needs a second device type")
@pytest.mark.gpu
def test_mismatched_devices():
    with pytest.raises(ValueError, match=r"input is on cpu but its fc1\.weight is on cuda"):
        ParMLP(8, 16, device="cuda")(torch.randn(3, 8))


def test_mismatched_devices_meta():
    """A device mismatch is caught before any kernel runs, without needing a GPU."""
    with pytest.raises(ValueError, match=r"input is on meta but its fc1\.weight is on cpu"):
        ParMLP(8, 16)(torch.randn(3, 8, device="meta"))


@pytest.mark.parametrize("impl", sorted(PORTABLE_IMPLS))
def test_a_partly_materialized_model_names_the_parameter_left_on_meta(impl):
    """fc2 left on meta after deferred init used to return uninitialised memory as y."""
    mlp = ParMLP(8, 16, bias=True, impl=impl)
    mlp.fc2.to("meta")
    with pytest.raises(ValueError, match=r"input is on cpu but its fc2\.weight is on meta"):
        mlp(torch.randn(3, 8))


@pytest.mark.parametrize("impl", sorted(PORTABLE_IMPLS))
def test_a_partly_cast_model_names_the_parameter_of_another_dtype(impl):
    mlp = ParMLP(8, 16, bias=True, impl=impl)
    mlp.fc2.bias.data = mlp.fc2.bias.data.half()
    for grad in (True, False):
        with (
            torch.set_grad_enabled(grad),
            pytest.raises(TypeError, match=r"fc2\.bias is torch\.float16"),
        ):
            mlp(torch.randn(3, 8))


@pytest.mark.parametrize("impl", sorted(PORTABLE_IMPLS))
def test_a_meta_model_gives_output_shapes(impl):
    """Deferred init and shape tracing run a model on the meta device, as nn.Linear allows."""
    mlp = ParMLP(8, 16, output_size=12, impl=impl, device="meta")
    x = torch.empty(2, 5, 8, device="meta", requires_grad=True)
    y = mlp(x)
    assert y.shape == (2, 5, 12) and y.device.type == "meta"


def test_non_positive_sizes():
    with pytest.raises(ValueError, match="positive"):
        ParMLP(8, 0)
    with pytest.raises(ValueError, match="output_size=0"):  # 0 is a size, not "unset"
        ParMLP(8, 16, output_size=0)


@pytest.mark.parametrize(
    ("impl", "chunk", "error", "message"),
    [
        ("drop_h", 5, ValueError, r"chunk=5 must be positive and divide the ffn size 32"),
        ("normal", 0, ValueError, r"chunk=0 must be positive"),
        ("save_factors", 2.0, TypeError, r"chunk must be a whole number of rows, got 2\.0"),
        ("save_factors", True, TypeError, r"got True"),
    ],
)
def test_a_bad_chunk_is_refused_when_the_layer_is_built(impl, chunk, error, message):
    """The chunk is save_factors': named with another impl it used to pass until a switch."""
    with pytest.raises(error, match=message):
        ParMLP(16, 32, impl=impl, chunk=chunk)


def test_missing_quack_is_named_when_the_layer_is_built(monkeypatch):
    monkeypatch.setitem(sys.modules, "quack", None)  # as if quack-kernels were not installed
    require_quack.cache_clear()
    try:
        for impl in ("drop_h_quack", "save_factors_quack"):
            with pytest.raises(MissingExtra, match=r"quack-kernels.*the \[quack\] extra"):
                ParMLP(16, 32, impl=impl)
    finally:
        require_quack.cache_clear()


def test_quack_input_checks_name_the_problem():
    w1, w2 = torch.empty(64, 16), torch.empty(16, 32)
    with pytest.raises(ValueError, match="runs on CUDA only; the input is on cpu"):
        check_quack_inputs(torch.empty(4, 16), w1, w2)


def test_save_factors_quack_errors_name_it_before_any_kernel():
    """Its own name and its portable twin in the input checks; its fixed chunk enforced."""
    from swiglu_train.ops.quack_save_factors import save_factors_quack_mlp

    x, w1, w2 = torch.empty(4, 16), torch.empty(64, 16), torch.empty(16, 32)
    with pytest.raises(ValueError, match="impl 'save_factors_quack' runs on CUDA only"):
        check_quack_inputs(x, w1, w2, "save_factors_quack")
    with pytest.raises(ValueError, match=r"reads fc1 packed with chunk 1 .*got chunk=16"):
        save_factors_quack_mlp(x, w1, None, w2, None, chunk=16)


@pytest.mark.parametrize("impl", PORTABLE_IMPLS)
@pytest.mark.parametrize(("device", "backend"), device_backends())
def test_an_empty_batch_gives_empty_outputs_and_zero_grads(device, backend, impl):
    """A rank with no tokens (ragged batches, idle experts) trains and infers, with or without
    grad: empty outputs and zero weight grads, not a reshape error."""
    mlp = ParMLP(16, 32, 24, bias=True, impl=impl, device=device)
    x = torch.randn(0, 16, device=device, requires_grad=True)
    with use_backend(backend):
        y = mlp(x)
        y.sum().backward()
        with torch.no_grad():
            assert mlp(x).shape == (0, 24)
    assert y.shape == (0, 24) and x.grad.shape == (0, 16)
    for name, p in mlp.named_parameters():
        assert p.grad is not None and not p.grad.any(), name


def test_freed_check_without_torch_s_private_attribute_reads_as_retained():
    """``_raw_saved_tensors`` is private: a ctx without it gets the retained-graph message."""
    from swiglu_train.ops.mlp import saved_tensors_freed

    assert saved_tensors_freed(object()) is False
