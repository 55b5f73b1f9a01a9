"""Autograd Functions and torch.library ops for each impl, plus the plain-torch reference."""

from swiglu_train.ops.activation import BACKENDS, use_backend
from swiglu_train.ops.mlp import (
    DOUBLE_BACKWARD_ERROR,
    SECOND_BACKWARD_ERROR,
    SECOND_BACKWARD_FREED_ERROR,
    drop_h_mlp,
    normal_mlp,
    swiglu_activation,
)
from swiglu_train.ops.save_factors import (
    SECOND_BACKWARD_ERROR_FACTORS,
    SECOND_BACKWARD_FREED_ERROR_FACTORS,
    save_factors_mlp,
)

__all__ = [
    "BACKENDS",
    "DOUBLE_BACKWARD_ERROR",
    "SECOND_BACKWARD_ERROR",
    "SECOND_BACKWARD_ERROR_FACTORS",
    "SECOND_BACKWARD_FREED_ERROR",
    "SECOND_BACKWARD_FREED_ERROR_FACTORS",
    "drop_h_mlp",
    "normal_mlp",
    "save_factors_mlp",
    "swiglu_activation",
    "use_backend",
]
