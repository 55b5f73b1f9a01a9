"""Small models for the memory tests: blocks in a ModuleList, each with a ParMLP."""

from __future__ import annotations

import torch
from torch import nn

from swiglu_train import ParMLP


class Block(nn.Module):
    """Pre-norm residual MLP block: saves the norm's input/stats plus what ParMLP saves."""

    def __init__(self, d: int, f: int, impl: str) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = ParMLP(d, f, impl=impl)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Stack(nn.Module):
    def __init__(self, layers: int, d: int, f: int, impl: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(d, f, impl) for _ in range(layers))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).square().mean()
