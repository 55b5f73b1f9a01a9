"""The ParMLP module and the impl registry."""

from swiglu_train.layers.par_mlp import ParMLP
from swiglu_train.layers.registry import MLP_IMPLS, get_impl

__all__ = ["MLP_IMPLS", "ParMLP", "get_impl"]
