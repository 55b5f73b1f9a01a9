"""The ParMLP and ParExperts modules and the impl registry."""

from swiglu_train.layers.experts import ParExperts
from swiglu_train.layers.par_mlp import ParMLP
from swiglu_train.layers.registry import (
    IMPL_CHOICES,
    MLP_IMPLS,
    PORTABLE_IMPLS,
    check_impl_name,
    get_impl,
)

__all__ = [
    "IMPL_CHOICES",
    "MLP_IMPLS",
    "PORTABLE_IMPLS",
    "ParExperts",
    "ParMLP",
    "check_impl_name",
    "get_impl",
]
