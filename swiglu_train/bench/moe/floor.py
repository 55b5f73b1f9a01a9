"""The grouped-GEMM floor of a routed-experts step: its six grouped GEMMs and nothing else.

Every variant must run, in some form, fc1 and fc2 forward and, in backward, grad_h, grad_W2,
grad_x (per slot, before the k slots of a token are summed) and grad_W1, each as one GEMM per
expert over that expert's rows. The floor runs them as ``torch._grouped_mm`` on operands
already gathered and sorted by expert, with the point's own group sizes: no routing, gather,
activation or scatter. A variant's ``full_over_floor`` is its step time over the floor's in
the same sample, as for the dense MLP's six-GEMM floor.
"""

from __future__ import annotations

import torch

from swiglu_train.bench.moe.routing import group_sizes
from swiglu_train.bench.timing import Case

grouped_mm = torch._grouped_mm


def floor_case(
    x: torch.Tensor,
    indices: torch.Tensor,
    fc1: torch.Tensor,
    fc2: torch.Tensor,
    grad_y: torch.Tensor,
    seed: int = 0,
) -> Case:
    """The six GEMMs with the operand layouts autograd gives ``torch._grouped_mm``'s inputs."""
    order = indices.reshape(-1).argsort(stable=True)
    tokens = order // indices.shape[1]
    offsets = group_sizes(indices, fc1.shape[0]).cumsum(0).to(torch.int32)
    xg, grad_yg = x.detach()[tokens], grad_y[tokens]
    w1, w2 = fc1.detach(), fc2.detach()
    gen = torch.Generator(x.device).manual_seed(seed)
    h = torch.randn(len(order), w2.shape[2], generator=gen, device=x.device, dtype=x.dtype)
    grad_preact = torch.randn(
        len(order), w1.shape[1], generator=gen, device=x.device, dtype=x.dtype
    )

    def forward() -> tuple:
        return (
            grouped_mm(xg, w1.transpose(1, 2), offs=offsets),
            grouped_mm(h, w2.transpose(1, 2), offs=offsets),
        )

    def backward(_: object) -> None:
        grouped_mm(grad_yg, w2, offs=offsets)  # grad_h
        grouped_mm(grad_yg.t(), h, offs=offsets)  # grad_W2 [E, D, F]
        grouped_mm(grad_preact, w1, offs=offsets)  # grad_x per slot
        grouped_mm(grad_preact.t(), xg, offs=offsets)  # grad_W1 [E, 2F, D]

    return Case("floor", forward, backward, lambda: None)
