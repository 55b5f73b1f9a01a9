"""The canonical fc1 layout is Megatron-core's [W_gate; W_up], silu on the first half."""

import torch
import torch.nn.functional as F

from swiglu_train import ParMLP
from swiglu_train.ops.activation import swiglu_fwd


def test_activation_is_megatrons_literal_formula():
    """Megatron-core's glu: x1, x2 = torch.chunk(x, 2, -1); F.silu(x1) * x2."""
    preact = torch.randn(29, 2 * 37)
    x1, x2 = torch.chunk(preact, 2, -1)
    torch.testing.assert_close(swiglu_fwd(preact), F.silu(x1) * x2, rtol=2**-21, atol=2**-21)


def test_fc1_rows_are_gate_then_up_like_hf_llama():
    """Splitting fc1.weight in halves gives HF Llama's gate_proj and up_proj unchanged."""
    mlp = ParMLP(16, 24, output_size=12, impl="drop_h")
    x = torch.randn(7, 16)
    gate_proj, up_proj = mlp.fc1.weight[:24], mlp.fc1.weight[24:]
    expected = F.linear(F.silu(x @ gate_proj.t()) * (x @ up_proj.t()), mlp.fc2.weight)
    torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-6)
    assert mlp.fc1.weight.shape == (48, 16) and mlp.fc2.weight.shape == (12, 24)


def test_swapping_halves_changes_the_function():
    """The layout matters: reading [up; gate] as [gate; up] is a different MLP."""
    mlp = ParMLP(16, 24)
    x = torch.randn(7, 16)
    y = mlp(x)
    with torch.no_grad():
        mlp.fc1.weight.copy_(torch.cat(mlp.fc1.weight.chunk(2)[::-1]))
    assert (mlp(x) - y).abs().max() > 1e-3


def test_state_dict_names_are_stable_across_impls():
    a, b = ParMLP(8, 12, bias=True, impl="normal"), ParMLP(8, 12, bias=True, impl="drop_h")
    assert a.state_dict().keys() == b.state_dict().keys()
    assert list(a.state_dict()) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    b.load_state_dict(a.state_dict())
    x = torch.randn(5, 8)
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)
