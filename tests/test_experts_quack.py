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
    ("weights_on", "saved_fp8", "fused"),
    [("output", False, True), ("output", True, False), ("input", False, False)],
)
def test_swiglu_runs_in_quack_epilogues_only_where_they_take_the_weight(
    weights_on, saved_fp8, fused
):
    """The dgated epilogue scales grad_preact and h by a per-row weight after the GEMM and
    reads a bf16 preactivation: a weight on the input, or an FP8 copy, keeps Triton's kernels."""
    assert experts_quack.fused_epilogues(weights_on, saved_fp8) is fused
