"""The one set of expert weights every variant of a point runs on, and what a variant is.

All variants read the same canonical tensors (fc1 [E, 2F, D] = [gate; up] per expert, fc2
[E, D, F]), as views where their layout allows, so their outputs and gradients can be
compared, and a point holds one copy of the weights, not one per peer (22.5 GB at DeepSeek-V3's
shape). A peer whose layout differs keeps its own copy and maps its gradients back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class ExpertWeights:
    fc1: torch.nn.Parameter  # [E, 2F, D]
    fc2: torch.nn.Parameter  # [E, D, F]

    @classmethod
    def random(
        cls, e: int, d: int, f: int, dtype: torch.dtype, device: torch.device | str, seed: int
    ) -> ExpertWeights:
        """Unit-variance outputs per GEMM (scaled by 1/sqrt(fan-in)), drawn from ``seed``."""
        gen = torch.Generator(device).manual_seed(seed)

        def param(*shape: int) -> torch.nn.Parameter:
            w = torch.randn(*shape, generator=gen, device=device, dtype=dtype)
            return torch.nn.Parameter(w.mul_(shape[-1] ** -0.5))

        return cls(param(e, 2 * f, d), param(e, d, f))

    @property
    def ffn(self) -> int:
        return self.fc2.shape[2]


@dataclass
class Variant:
    """``run(x, indices, weights) -> y``; ``params``: tensors of its own whose grads a step
    fills (besides x, the router weights and the shared fc1/fc2); ``weight_grads()``: its
    gradient of the canonical fc1 and fc2 after a step."""

    run: Experts
    weight_grads: Callable[[], tuple[torch.Tensor | None, torch.Tensor | None]]
    params: list[torch.Tensor] = field(default_factory=list)


def shared(run: Experts, w: ExpertWeights) -> Variant:
    """A variant that steps on the shared fc1 and fc2 themselves."""
    return Variant(run, lambda: (w.fc1.grad, w.fc2.grad))


Builder = Callable[[ExpertWeights, int], Variant]  # (weights, top-k) -> variant


class NotOffered(ValueError):
    """A variant that does not compute this run's function (its router weight on the other
    side of the experts): recorded as not offered, not as failed."""
