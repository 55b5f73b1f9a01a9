"""Megatron-core integration (``pip install swiglu-train[megatron]``): a drop-in MLP, MoE experts
and layer specs, e.g. ``GPTModel(config, get_gpt_layer_spec(mlp_impl="drop_h"), ...)``, or with
``num_experts=`` for MoE layers."""

from swiglu_train.integrations.megatron.activation_mlp import SwiGLUActivationMLP
from swiglu_train.integrations.megatron.checks import SUPPORTED_IMPLS, check_config, check_impl
from swiglu_train.integrations.megatron.experts import ParExpertsMegatron
from swiglu_train.integrations.megatron.mlp import ParMLPMegatron
from swiglu_train.integrations.megatron.shared_experts import ParSharedExpertMLP
from swiglu_train.integrations.megatron.specs import (
    get_gpt_layer_spec,
    get_mlp_layer_spec,
    mlp_spec,
    moe_spec,
)

__all__ = [
    "SUPPORTED_IMPLS",
    "ParExpertsMegatron",
    "ParMLPMegatron",
    "ParSharedExpertMLP",
    "SwiGLUActivationMLP",
    "check_config",
    "check_impl",
    "get_gpt_layer_spec",
    "get_mlp_layer_spec",
    "mlp_spec",
    "moe_spec",
]
