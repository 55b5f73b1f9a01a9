"""Autograd Functions and torch.library ops for each impl, plus the plain-torch reference."""

from swiglu_train.ops.activation import BACKENDS, use_backend
from swiglu_train.ops.mlp import SECOND_BACKWARD_ERROR, drop_h_mlp, normal_mlp

__all__ = ["BACKENDS", "SECOND_BACKWARD_ERROR", "drop_h_mlp", "normal_mlp", "use_backend"]
