"""The memory profiler counts routed experts' saved bytes exactly, per block and per impl."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from swiglu_train.layers.experts import ParExperts
from swiglu_train.memory import MemoryProfiler
from swiglu_train.ops.activation import use_backend
from swiglu_train.ops.experts import saved_activation_bytes

T, D, F, E, K, BLOCKS = 19, 16, 24, 4, 2, 3


class MoEBlock(nn.Module):
    """A router (softmax over experts, top-k) in front of the experts, with a residual."""

    def __init__(self, impl: str, saved_fp8: bool) -> None:
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.experts = ParExperts(E, D, F, impl=impl, saved_fp8=saved_fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, indices = self.router(x).softmax(-1).topk(K, dim=-1)
        return x + self.experts(x, indices, weights)


def profile(impl: str, saved_fp8: bool):
    model = nn.ModuleList(MoEBlock(impl, saved_fp8) for _ in range(BLOCKS))
    profiler = MemoryProfiler(model)
    x = torch.randn(T, D, requires_grad=True)
    with use_backend("torch"), profiler.step(0) as p:
        h = x
        for block in model:
            h = block(h)
        loss = h.sum()
        p.forward_done()
        loss.backward()
    return profiler.records[-1]


@pytest.mark.parametrize(("impl", "saved_fp8"), [("drop_h", False), ("drop_h", True)])
def test_experts_bytes_per_block_are_x_routing_and_the_claim(impl, saved_fp8):
    record = profile(impl, saved_fp8)
    label = "experts/drop_h+fp8" if saved_fp8 else "experts/drop_h"
    claim = saved_activation_bytes(impl, saved_fp8, "output", T, D, F, K, E, torch.float32)
    per_block = T * D * 4 + T * K * (8 + 4) + claim  # x, the top-k indices and weights, preact
    assert [layer.mlp_saved_bytes for layer in record.layers] == [per_block] * BLOCKS
    assert record.impl_saved_bytes == {label: per_block * BLOCKS}


def test_normal_keeps_what_drop_h_drops():
    normal, drop_h = profile("normal", False), profile("drop_h", False)
    claims = [
        saved_activation_bytes(impl, False, "output", T, D, F, K, E, torch.float32)
        for impl in ("normal", "drop_h")
    ]
    dropped = normal.impl_saved_bytes["experts/normal"] - drop_h.impl_saved_bytes["experts/drop_h"]
    # normal's extra index vectors are small: at most 64 bytes a slot on top of the claims
    assert BLOCKS * (claims[0] - claims[1]) <= dropped + BLOCKS * T * D * 4
    assert dropped <= BLOCKS * (claims[0] - claims[1] + 64 * T * K)
