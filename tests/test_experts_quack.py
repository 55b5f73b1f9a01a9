"""drop_h_quack's refusals where quack cannot run (CPU): one line naming why, from ParExperts
when it is built and from experts_mlp when it is called. Its numerics are
tests/test_gpu_experts.py's."""

from __future__ import annotations

import re

import pytest
import torch

from swiglu_train.layers.experts import ParExperts
from swiglu_train.ops import experts_quack
from swiglu_train.ops.experts import IMPLS, experts_mlp


def test_drop_h_quack_is_an_experts_impl():
    assert "drop_h_quack" in IMPLS


def test_layer_refuses_where_quack_cannot_run(monkeypatch):
    monkeypatch.setattr(experts_quack, "quack_unavailable_reason", lambda: "no CUDA GPU")
    message = "ParExperts(impl='drop_h_quack') cannot run here: no CUDA GPU; use impl='drop_h'"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        ParExperts(4, 16, 8, impl="drop_h_quack")


def test_layer_refuses_sizes_whose_rows_tma_cannot_take(monkeypatch):
    monkeypatch.setattr(experts_quack, "quack_unavailable_reason", lambda: None)
    with pytest.raises(ValueError, match="hidden_size 100 and ffn_hidden_size 64 must be"):
        ParExperts(4, 100, 64, impl="drop_h_quack")
    ParExperts(4, 64, 24, impl="drop_h_quack")  # multiples of 8 are built


def test_experts_mlp_refuses_cpu_tensors():
    x, fc1, fc2 = torch.randn(3, 16), torch.randn(2, 16, 16), torch.randn(2, 16, 8)
    idx, w = torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
    with pytest.raises(ValueError, match=r"^impl 'drop_h_quack' runs on CUDA only"):
        experts_mlp(x, idx, w, fc1, fc2, impl="drop_h_quack")


@pytest.mark.parametrize(
    ("weights_on", "saved_fp8", "gated"),
    [("output", False, True), ("output", True, False), ("input", False, False)],
)
def test_swiglu_runs_in_fc1s_epilogue_unless_the_weight_or_the_copy_needs_the_kernel(
    weights_on, saved_fp8, gated
):
    """A weight on the input scales the preactivation before SwiGLU, which quack's gated
    epilogue cannot; the FP8 copy is drop_h's quantizing kernel's."""
    assert experts_quack.gated_forward(weights_on, saved_fp8) is gated
