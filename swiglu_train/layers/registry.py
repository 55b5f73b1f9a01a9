"""The impl registry: one name per way of trading activation memory against recompute."""

from __future__ import annotations

from collections.abc import Callable

import torch

from swiglu_train.ops import drop_h_mlp, normal_mlp, save_factors_mlp

MLPFunction = Callable[..., torch.Tensor]

_IMPLS: dict[str, MLPFunction] = {
    "normal": normal_mlp,
    "drop_h": drop_h_mlp,
    "save_factors": save_factors_mlp,
}
MLP_IMPLS: tuple[str, ...] = tuple(_IMPLS)
PACKED_IMPLS: frozenset[str] = frozenset({"save_factors"})  # these read fc1 in packed layout


def get_impl(name: str) -> MLPFunction:
    """The MLP function for an impl name, or a ValueError that lists the valid names."""
    try:
        return _IMPLS[name]
    except KeyError:
        valid = ", ".join(MLP_IMPLS)
        raise ValueError(f"unknown MLP impl {name!r}; valid impls: {valid}") from None
