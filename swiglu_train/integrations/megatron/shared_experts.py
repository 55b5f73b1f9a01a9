"""ParSharedExpertMLP: Megatron's ``SharedExpertMLP`` (the always-on experts of DeepSeek-style MoE
layers) with its SwiGLU MLP run by :class:`~.mlp.ParMLPMegatron`.

The class inherits both: ``SharedExpertMLP`` keeps what is its own (the config copy with
``moe_shared_expert_intermediate_size`` as the FFN size, the optional sigmoid gate and its
checkpoint entry) and calls ``super()`` for the MLP, which the method order makes ours, so its
keys, TP sharding and dist-ckpt format stay the stock shared experts'. Only canonical impls run
here (no packed fc1), and ``moe_shared_expert_overlap`` is refused: it splits the MLP into
separately scheduled halves on a side stream, which our fused impls have no place for.
"""

from __future__ import annotations

import inspect
from typing import Any

from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.transformer_config import TransformerConfig

from swiglu_train.integrations.megatron.experts import check_experts_impl
from swiglu_train.integrations.megatron.mlp import ParMLPMegatron

_TAKES_NAME = "name" in inspect.signature(SharedExpertMLP.__init__).parameters  # 0.18+


class ParSharedExpertMLP(SharedExpertMLP, ParMLPMegatron):
    """Drop-in for ``SharedExpertMLP`` running ``impl`` ("drop_h", "normal", "drop_h_quack"),
    built as Megatron builds its shared experts (``config``, ``pg_collection`` and ``gate`` by
    keyword; ``name`` from megatron-core 0.18)."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MLPSubmodules,
        gate: bool,
        pg_collection: Any | None = None,
        name: str | None = None,
        impl: str = "drop_h",
        inplace: bool = True,
        saved_fp8: bool = False,
    ) -> None:
        check_experts_impl(impl, saved_fp8)  # the impls with a canonical fc1
        if config.moe_shared_expert_overlap:
            raise ValueError(
                "ParSharedExpertMLP cannot run moe_shared_expert_overlap (it schedules fc1 and "
                "fc2 apart on a side stream); set it False"
            )
        if pg_collection is None:
            raise ValueError("ParSharedExpertMLP needs the MoELayer's pg_collection (its tp)")
        named = {"name": name} if _TAKES_NAME else {}
        super().__init__(config, submodules, gate, pg_collection=pg_collection, **named)
        self.inplace, self.saved_fp8 = inplace, saved_fp8
        self.impl = impl  # after saved_fp8: the setter picks the impl's function for it
