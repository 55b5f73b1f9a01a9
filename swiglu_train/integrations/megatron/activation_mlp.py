"""Megatron's MLP with its own linears and our SwiGLU activation between them.

This is the Transformer Engine backend's MLP (``get_gpt_layer_spec(..., backend="te")``):
``TELayerNormColumnParallelLinear`` does the pre-MLP norm, the fc1 GEMM and the TP input
collective, ``TERowParallelLinear`` the fc2 GEMM and the output collective, and only the
activation is ours. fc2 saves h whatever we do, so the one impl that fits is ``normal``
(drop_h and save_factors need their own GEMMs around the activation: ``backend="local"``).
Nothing here names TE, so the same module runs on Megatron's local linears, which is how it
is tested on machines without TE.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.mlp import MLPSubmodules

from swiglu_train.integrations.megatron.checks import check_impl
from swiglu_train.integrations.megatron.mlp import ParMLPMegatron
from swiglu_train.ops import swiglu_activation

ACTIVATION_IMPLS: tuple[str, ...] = ("normal",)


class SwiGLUActivationMLP(ParMLPMegatron):
    """``linear_fc1`` -> our SwiGLU activation (saves preact only) -> ``linear_fc2``."""

    DEFAULT_IMPL = "normal"
    OWN_GEMMS = False  # Megatron's linears: their gradient_accumulation_fusion, GTP and so on

    @classmethod
    def validate_impl(cls, name: str) -> None:
        check_impl(name)
        if name not in ACTIVATION_IMPLS:
            raise ValueError(
                f"impl {name!r} needs its own GEMMs, which Transformer Engine linears replace; "
                f"with backend='te' use impl {', '.join(ACTIVATION_IMPLS)}, or backend='local'"
            )

    def _check_linears(self, submodules: MLPSubmodules) -> None:
        """Any Megatron linear pair serves: each is called as ``output, bias = linear(x)``."""

    def forward(
        self, hidden_states: torch.Tensor, per_token_scale: torch.Tensor | None = None, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(output, fc2 bias), like the stock MLP; fc1's bias is added before the activation."""
        if per_token_scale is not None:
            raise ValueError("SwiGLUActivationMLP does not support per_token_scale (MoE experts)")
        preact, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            preact = preact + bias
        h = swiglu_activation(preact.reshape(-1, preact.shape[-1]))
        return self.linear_fc2(h.view(*preact.shape[:-1], h.shape[-1]))
