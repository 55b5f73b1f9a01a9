"""Plain-torch SwiGLU math: the test oracle, and the path where Triton cannot run.

The formulas are Megatron-core's: ``torch.chunk(preact, 2, -1)`` then ``F.silu(gate) * up``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(preact: torch.Tensor) -> torch.Tensor:
    """h = silu(gate) * up on a canonical [gate | up] preactivation."""
    gate, up = torch.chunk(preact, 2, dim=-1)
    return F.silu(gate) * up


def swiglu_grad(preact: torch.Tensor, grad_h: torch.Tensor) -> torch.Tensor:
    """grad_preact = [grad_h * up * silu'(gate) | grad_h * silu(gate)], computed in fp32."""
    gate, up = torch.chunk(preact.float(), 2, dim=-1)
    grad_h = grad_h.float()
    sig = torch.sigmoid(gate)
    grad_gate = grad_h * up * sig * (1 + gate * (1 - sig))
    grad_up = grad_h * gate * sig
    return torch.cat([grad_gate, grad_up], dim=-1).to(preact.dtype)


def mlp(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None,
    fc2_weight: torch.Tensor,
    fc2_bias: torch.Tensor | None,
) -> torch.Tensor:
    """The eager SwiGLU MLP, differentiable by autograd: the reference every impl must match."""
    return F.linear(swiglu(F.linear(x, fc1_weight, fc1_bias)), fc2_weight, fc2_bias)


def experts(
    x: torch.Tensor,
    expert_indices: torch.Tensor,
    expert_weights: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    weights_on: str = "output",
) -> torch.Tensor:
    """Routed SwiGLU experts as a loop over experts in x's dtype, differentiable by autograd:
    the oracle of ``ops.experts`` (in float64) and the eager baseline its bf16 error is judged
    against. fc1 [E, 2F, D], fc2 [E, D, F]; an index of -1 drops the slot."""
    y = torch.zeros_like(x)
    weights = expert_weights.to(x.dtype)
    for e in range(fc1_weight.shape[0]):
        token, choice = torch.nonzero(expert_indices == e, as_tuple=True)
        w = weights[token, choice][:, None]
        xe = x[token] * w if weights_on == "input" else x[token]
        out = F.linear(swiglu(F.linear(xe, fc1_weight[e])), fc2_weight[e])
        y = y.index_add(0, token, out * w if weights_on == "output" else out)
    return y
