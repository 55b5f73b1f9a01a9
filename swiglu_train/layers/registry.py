"""The impl registry: one name per way of trading activation memory against recompute."""

from __future__ import annotations

from collections.abc import Callable

import torch

from swiglu_train.ops import drop_h_mlp, normal_mlp, save_factors_mlp
from swiglu_train.ops.quack_mlp import drop_h_quack_mlp, require_quack

MLPFunction = Callable[..., torch.Tensor]

_IMPLS: dict[str, MLPFunction] = {
    "normal": normal_mlp,
    "drop_h": drop_h_mlp,
    "save_factors": save_factors_mlp,
    "drop_h_quack": drop_h_quack_mlp,
}
MLP_IMPLS: tuple[str, ...] = tuple(_IMPLS)
PACKED_IMPLS: frozenset[str] = frozenset({"save_factors"})  # these read fc1 in packed layout
# quack's CuTe-DSL kernels: CUDA sm_90+ with quack-kernels installed; the others run anywhere
QUACK_IMPLS: frozenset[str] = frozenset({"drop_h_quack"})
PORTABLE_IMPLS: tuple[str, ...] = tuple(n for n in MLP_IMPLS if n not in QUACK_IMPLS)
AUTO = "auto"  # not a function: ParMLP resolves it to one of MLP_IMPLS when built (layers/auto)
IMPL_CHOICES: tuple[str, ...] = (*MLP_IMPLS, AUTO)  # what a user may ask a ParMLP for


def check_impl_name(name: str) -> None:
    """A ValueError listing every name a user may choose (``auto`` included) for an unknown one."""
    if name not in IMPL_CHOICES:
        raise ValueError(f"unknown MLP impl {name!r}; valid impls: {', '.join(IMPL_CHOICES)}")


def get_impl(name: str) -> MLPFunction:
    """The MLP function for a concrete impl name, or a ValueError that lists the valid names.

    A quack impl also needs quack itself: an ImportError says so here, when a model is built,
    rather than at its first forward.
    """
    if name in QUACK_IMPLS:
        require_quack()
    try:
        return _IMPLS[name]
    except KeyError:
        valid = ", ".join(MLP_IMPLS)
        if name == AUTO:
            raise ValueError(
                f"impl {AUTO!r} is resolved once, when a ParMLP is built "
                f"(ParMLP(..., impl='auto', tokens_hint=...)); here give one of: {valid}"
            ) from None
        raise ValueError(f"unknown MLP impl {name!r}; valid impls: {valid}") from None
