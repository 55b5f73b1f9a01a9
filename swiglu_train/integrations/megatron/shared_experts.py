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
from megatron.core.utils import get_pg_size

from swiglu_train.integrations.megatron.experts import check_experts_impl
from swiglu_train.integrations.megatron.mlp import ParMLPMegatron
from swiglu_train.layers.registry import AUTO
from swiglu_train.ops.experts_quack import experts_quack_unavailable_reason

_TAKES_NAME = "name" in inspect.signature(SharedExpertMLP.__init__).parameters  # 0.18+
QUACK_MIN_HIDDEN = 2048  # below it the dense grid had drop_h faster (small GEMMs, host-bound)


def shared_auto(hidden_size: int, ffn_hidden_size: int) -> tuple[str, str]:
    """(auto's impl for a shared-experts MLP shard, why): drop_h_quack where quack runs at
    these sizes and D >= 2048, else drop_h. Both keep the stock canonical fc1, so the choice
    never changes a checkpoint. Evidence, the dense grid (grid_h100.md, grid_h200.md):
    drop_h_quack ran at or below drop_h at 31 of 36 points on the H100 and 30 of 36 on the
    H200; on each GPU every miss but one (8192 x 28672, by 1.5-3 %) was at D < 2048 or
    M = 4096."""
    reason = experts_quack_unavailable_reason(hidden_size, ffn_hidden_size)
    if reason is None and hidden_size < QUACK_MIN_HIDDEN:
        reason = f"hidden_size {hidden_size} < {QUACK_MIN_HIDDEN}, where drop_h was faster"
    if reason is not None:
        return "drop_h", f"drop_h: drop_h_quack not chosen ({reason})"
    return "drop_h_quack", (
        "drop_h_quack: at or below drop_h at 61 of 72 dense grid points (H100, H200), the "
        "misses at small D or M"
    )


class ParSharedExpertMLP(SharedExpertMLP, ParMLPMegatron):
    """Drop-in for ``SharedExpertMLP`` running ``impl`` ("drop_h", "normal", "drop_h_quack", or
    "auto": :func:`shared_auto` on this rank's shard, why in ``auto_reason``), built as
    Megatron builds its shared experts (``config``, ``pg_collection`` and ``gate`` by keyword;
    ``name`` from megatron-core 0.18)."""

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
        self.auto_reason = None  # why auto chose the impl; None when it was named
        if impl == AUTO:  # self.config is the stock copy with the shared experts' FFN size
            local_ffn = self.config.ffn_hidden_size // get_pg_size(pg_collection.tp)
            impl, self.auto_reason = shared_auto(self.config.hidden_size, local_ffn)
        self.impl = impl  # after saved_fp8: the setter picks the impl's function for it
