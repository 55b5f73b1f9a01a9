"""Top-k routings the benchmark feeds every variant, drawn from a seed so all see the same.

``balanced``: each token's k experts drawn uniformly without replacement, so every expert
expects T·k/E rows. ``skewed``: expert 0 is the first choice of exactly half the tokens (the
other half's first choice uniform over the rest), the k-1 other choices as in balanced; expert
0's group is then about T/2 rows, the imbalance a router early in training produces. The
router weights are a softmax over k random logits, kept in fp32 as routers keep them.
"""

from __future__ import annotations

import torch

ROUTINGS = ("balanced", "skewed")
HOT_EXPERT = 0


def make_routing(
    kind: str, tokens: int, experts: int, k: int, seed: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices [T, k] int64, distinct per token; weights [T, k] fp32), drawn on the CPU so
    that every device gets the same routing."""
    if kind not in ROUTINGS:
        raise ValueError(f"unknown routing {kind!r}; choose from {ROUTINGS}")
    if not 1 <= k <= experts:
        raise ValueError(f"top-k must be in [1, E = {experts}], got {k}")
    if kind == "skewed" and experts < 2:
        raise ValueError("skewed routing needs at least 2 experts")
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=gen)
    if kind == "skewed":
        first = torch.randint(0, experts - 1, (tokens,), generator=gen)
        first += (first >= HOT_EXPERT).long()  # uniform over the experts other than the hot one
        first[torch.randperm(tokens, generator=gen)[: tokens // 2]] = HOT_EXPERT
        scores.scatter_(1, first[:, None], 2.0)  # above every uniform score: chosen first
    indices = scores.topk(k, dim=1).indices
    weights = torch.randn(tokens, k, generator=gen).softmax(dim=1)
    return indices.to(device), weights.to(device)


def group_sizes(indices: torch.Tensor, experts: int) -> torch.Tensor:
    """Rows per expert [E] int64, what every grouped GEMM of the step is split by."""
    return torch.bincount(indices.reshape(-1), minlength=experts)
