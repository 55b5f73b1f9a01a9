"""Megatron-core integration (``pip install swiglu-train[megatron]``): a drop-in MLP and layer
specs, e.g. ``GPTModel(config, get_gpt_layer_spec(mlp_impl="drop_h"), ...)``."""

from swiglu_train.integrations.megatron.activation_mlp import SwiGLUActivationMLP
from swiglu_train.integrations.megatron.checks import SUPPORTED_IMPLS, check_config, check_impl
from swiglu_train.integrations.megatron.mlp import ParMLPMegatron
from swiglu_train.integrations.megatron.specs import (
    get_gpt_layer_spec,
    get_mlp_layer_spec,
    mlp_spec,
)

__all__ = [
    "SUPPORTED_IMPLS",
    "ParMLPMegatron",
    "SwiGLUActivationMLP",
    "check_config",
    "check_impl",
    "get_gpt_layer_spec",
    "get_mlp_layer_spec",
    "mlp_spec",
]
