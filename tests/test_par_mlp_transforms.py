"""ParMLP under forward-mode AD and ``torch.func`` transforms. Nothing requires grad under
``torch.func.jvp`` or ``forward_ad`` dual tensors, so the no-grad path serves them, whose kernels
have no forward derivative: the tangent must still come out right, never as zero. Under
``torch.func.grad`` (per-sample gradients with vmap) our autograd Functions cannot run: the
layer must still give eager's gradients."""

import types

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from conftest import device_backends
from helpers import dispatch_table

from swiglu_train import ParMLP
from swiglu_train.layers import PORTABLE_IMPLS
from swiglu_train.layers.layout import CANONICAL, relayout
from swiglu_train.ops import dispatch, inference, reference, use_backend

D, FFN = 32, 48
# M = 1: fused MLP; M = 20: gated GEMM (the default rules); M = 20 with this entry: cuBLAS
CUBLAS = {f"{D}x{FFN}": {"mlp": {1: "cublas"}, "gated": {1: "cublas"}}}


def _frozen(impl: str, device: str) -> ParMLP:
    """A layer whose parameters need no grad, so every forward takes the no-grad path."""
    return ParMLP(D, FFN, bias=True, impl=impl, chunk=16, device=device).requires_grad_(False)


def _reference(mlp: ParMLP):
    """The eager MLP on mlp's weights in the canonical layout, differentiable every way."""
    w1 = relayout(mlp.fc1.weight, mlp.fc1_layout, CANONICAL)
    b1 = relayout(mlp.fc1.bias, mlp.fc1_layout, CANONICAL)
    return lambda x: reference.mlp(x, w1, b1, mlp.fc2.weight, mlp.fc2.bias)


@pytest.mark.parametrize(("device", "backend"), device_backends())
@pytest.mark.parametrize("impl", PORTABLE_IMPLS)
@pytest.mark.parametrize(("m", "shapes"), [(1, None), (20, None), (20, CUBLAS)])
def test_jvp_through_par_mlp_matches_the_reference(device, backend, impl, m, shapes):
    mlp = _frozen(impl, device)
    x, t = torch.randn(2, m, D, device=device), torch.randn(2, m, D, device=device)
    with dispatch.use_table(dispatch_table(shapes)), use_backend(backend):
        y, tangent = torch.func.jvp(mlp, (x,), (t,))
        with fwAD.dual_level():
            dual = fwAD.unpack_dual(mlp(fwAD.make_dual(x, t)))
    y_ref, tangent_ref = torch.func.jvp(_reference(mlp), (x,), (t,))
    assert tangent_ref.abs().max() > 0.1
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tangent, tangent_ref, rtol=1e-5, atol=1e-5)
    assert dual.tangent is not None
    torch.testing.assert_close(dual.tangent, tangent_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("device", "backend"), device_backends())
@pytest.mark.parametrize("m", [1, 20])
def test_jvp_with_respect_to_the_weights(device, backend, m):
    """A tangent on fc1 alone (functional_call), as in a JVP over parameters."""
    mlp = _frozen("drop_h", device)
    x = torch.randn(m, D, device=device)
    params = dict(mlp.named_parameters())
    direction = torch.randn_like(params["fc1.weight"])

    def y_of(w1: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(mlp, {**params, "fc1.weight": w1}, (x,))

    def y_ref(w1: torch.Tensor) -> torch.Tensor:
        return reference.mlp(x, w1, params["fc1.bias"], params["fc2.weight"], params["fc2.bias"])

    with dispatch.use_table(dispatch_table()), use_backend(backend):
        _, tangent = torch.func.jvp(y_of, (params["fc1.weight"],), (direction,))
    _, tangent_ref = torch.func.jvp(y_ref, (params["fc1.weight"],), (direction,))
    torch.testing.assert_close(tangent, tangent_ref, rtol=1e-5, atol=1e-5)


def test_no_tangent_outside_forward_ad():
    x = torch.randn(3, 4)
    assert not inference.tangents_present(x, None)
    with fwAD.dual_level():
        assert not inference.tangents_present(x, None)
        assert inference.tangents_present(x, fwAD.make_dual(x, x))


@pytest.mark.parametrize(("device", "backend"), device_backends())
@pytest.mark.parametrize("impl", PORTABLE_IMPLS)
def test_per_sample_grads_with_vmap_and_grad(device, backend, impl):
    mlp = ParMLP(D, FFN, bias=True, impl=impl, chunk=16, device=device)
    params = {name: p.detach() for name, p in mlp.named_parameters()}
    x = torch.randn(5, 3, D, device=device)

    def loss(p: dict, sample: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(mlp, p, (sample,)).pow(2).sum()

    with use_backend(backend):
        grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    for i in range(x.shape[0]):  # each sample's grads from eager autograd on the same layer
        mlp.zero_grad()
        with use_backend(backend):
            mlp(x[i]).pow(2).sum().backward()
        for name, p in mlp.named_parameters():
            torch.testing.assert_close(grads[name][i], p.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("device", "backend"), device_backends())
def test_jacrev_and_forward_ad_with_trainable_weights(device, backend):
    """Weights that require grad put the call on the training path; a transform must not."""
    mlp = ParMLP(D, FFN, bias=True, impl="drop_h", device=device)
    x, t = torch.randn(2, D, device=device), torch.randn(2, D, device=device)
    ref = _reference(mlp)
    with use_backend(backend):
        jac = torch.func.jacrev(mlp)(x)
        with fwAD.dual_level():
            tangent = fwAD.unpack_dual(mlp(fwAD.make_dual(x, t))).tangent
    torch.testing.assert_close(jac, torch.func.jacrev(ref)(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tangent, torch.func.jvp(ref, (x,), (t,))[1], rtol=1e-5, atol=1e-5)


def test_without_torch_s_private_hooks_tangents_are_still_found(monkeypatch):
    """forward_ad's level and functorch's stack are private: without the level every tensor is
    looked at; without the stack no transform is assumed (the kernels then fail loudly)."""
    without_level = types.SimpleNamespace(unpack_dual=fwAD.unpack_dual)
    monkeypatch.setattr(inference, "fwAD", without_level)
    monkeypatch.setattr(inference, "_peek_interpreter_stack", None)
    x = torch.randn(3, 4)
    assert not inference.tangents_present(x, None)
    assert not inference.transforms_need_torch(x)
    with fwAD.dual_level():
        assert inference.tangents_present(x, fwAD.make_dual(x, x))


def test_inference_entry_points_carry_tangents():
    """The Megatron adapter calls these directly (no ParMLP in front): under forward-mode AD
    each must take plain torch ops, for h alone and for the whole MLP."""
    torch.manual_seed(0)
    x, t = torch.randn(5, 8), torch.randn(5, 8)
    w1, w2 = torch.randn(32, 8), torch.randn(8, 16)

    def h_ref(v):
        return reference.swiglu(torch.nn.functional.linear(v, w1))

    def y_ref(v):
        return torch.nn.functional.linear(h_ref(v), w2)

    h_tangent = torch.func.jvp(
        lambda v: inference.swiglu_gated_projection(v, w1, None, None), (x,), (t,)
    )[1]
    y_tangent = torch.func.jvp(
        lambda v: inference.swiglu_mlp_inference(v, w1, None, w2, None, None), (x,), (t,)
    )[1]
    torch.testing.assert_close(h_tangent, torch.func.jvp(h_ref, (x,), (t,))[1])
    torch.testing.assert_close(y_tangent, torch.func.jvp(y_ref, (x,), (t,))[1])


class _ConvertedLinear(torch.nn.Linear):
    """What an FP8 training converter leaves (torchao's Float8Linear subclasses nn.Linear and
    replaces its forward with FP8 GEMMs): here, a forward that scales its output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


@pytest.mark.parametrize("name", ["fc1", "fc2"])
def test_a_linear_whose_forward_was_converted_is_refused_not_skipped(name):
    mlp = ParMLP(16, 24, impl="drop_h")
    old = getattr(mlp, name)
    converted = _ConvertedLinear(old.in_features, old.out_features, bias=old.bias is not None)
    converted.load_state_dict(old.state_dict())
    setattr(mlp, name, converted)
    with pytest.raises(
        TypeError, match=rf"ParMLP\.{name} is a .*_ConvertedLinear, which replaces"
    ) as info:
        mlp(torch.randn(4, 16))
    assert "\n" not in str(info.value) and "module_filter_fn" in str(info.value)


def test_a_subclass_that_keeps_linear_s_forward_still_runs():
    class Kept(torch.nn.Linear):  # FSDP2's and parametrize's classes keep nn.Linear.forward
        pass

    mlp = ParMLP(16, 24, impl="drop_h")
    kept = Kept(16, 48, bias=False)
    kept.load_state_dict(mlp.fc1.state_dict())
    x = torch.randn(4, 16)
    expected = mlp(x)
    mlp.fc1 = kept
    assert torch.equal(mlp(x), expected)
