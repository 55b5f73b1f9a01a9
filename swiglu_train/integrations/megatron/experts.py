"""ParExpertsMegatron: the routed experts of Megatron-core's ``MoELayer`` on our grouped kernels,
a drop-in for its ``SequentialMLP`` (the experts Megatron builds without Transformer Engine).

Everything around the experts stays Megatron's: the router, the token dispatcher (``alltoall``,
``allgather``) with its expert-parallel exchange, its expert-TP all-gather before the experts
and its reduce-scatter after, the shared experts' slot and the aux losses. The dispatcher hands
the experts their rows already permuted and grouped by local expert::

    experts(rows [R, D], tokens_per_expert [E_local], probs [R])

so each row is one (token, expert) slot with its router weight: :func:`experts_mlp` runs it as
R tokens routed to k = 1 expert each (index = the row's local expert, weight = its prob), which
keeps drop_h's saved set (the rows and the preactivation [R, 2F/etp] alone). Padded rows
(``moe_router_padding_for_quantization``, capacity padding) come with probability 0 and are
counted in ``tokens_per_expert``, exactly as Megatron's experts see them. ``moe_apply_probs_on_
input`` scales the rows before fc1 (``weights_on="input"``), as SequentialMLP does.

Expert tensor parallelism (ETP) shards each expert as SequentialMLP's ``MLP(is_expert=True)``
does: fc1 column-parallel with Megatron's stride-2 split, so rank r holds [W_gate_r; W_up_r] per
expert (our canonical layout for the local shard), fc2 row-parallel; the dispatcher sums the
partial outputs over the ETP group. Parameters (the local experts stacked, one GEMM group each):

    fc1_weight [E_local, 2F/etp, D]     fc2_weight [E_local, D, F/etp]

initialized expert by expert in SequentialMLP's order and RNG, so a model built from the same
seed starts from the same weights. Checkpoints keep SequentialMLP's keys and format
(:mod:`.experts_checkpoint`).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel.layers import (
    _initialize_affine_weight_cpu,
    _initialize_affine_weight_gpu,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_pg_rank, get_pg_size

from swiglu_train.integrations.megatron.checks import check_local_linears, config_problems
from swiglu_train.integrations.megatron.experts_checkpoint import (
    experts_sharded_state_dict,
    sequential_keys_on_load,
    sequential_keys_on_save,
)
from swiglu_train.layers.experts import experts_auto
from swiglu_train.layers.registry import AUTO
from swiglu_train.ops.experts import IMPLS, experts_mlp
from swiglu_train.ops.experts_quack import check_experts_quack_runs


def check_experts_config(config: TransformerConfig) -> None:
    """Refuse, with the reason, MoE configs our experts cannot run, before any weight exists."""
    problems = config_problems(config)
    if config.add_bias_linear:
        problems.append(
            "expert biases are not implemented (nor in Megatron's grouped experts); set "
            "add_bias_linear=False"
        )
    if getattr(config, "moe_latent_size", None):
        problems.append("moe_latent_size (latent MoE projections) is not implemented")
    if getattr(config, "expert_gtp_weight_remat_size", 1) > 1:
        problems.append(
            "expert generalized tensor parallelism (expert_gtp_weight_remat_size > 1) regathers "
            "weights inside Megatron's linears, which these experts do not use"
        )
    if problems:
        raise ValueError("ParExpertsMegatron cannot run this config: " + "; ".join(problems))


def check_experts_impl(impl: str, saved_fp8: bool) -> None:
    """The impls routed experts run (no packed fc1: ``save_factors`` is dense-only), and
    ``auto``: unlike a dense MLP's, the experts' auto picks between impls of one layout
    (drop_h, drop_h_quack), so a checkpoint's format is known before the model is built."""
    if impl not in (*IMPLS, AUTO):
        raise ValueError(
            f"impl {impl!r} does not run routed experts; choose one of {', '.join((*IMPLS, AUTO))}"
        )
    if saved_fp8 and impl == "normal":
        raise ValueError("saved_fp8=True needs impl='drop_h' (normal saves h as well)")


def router_runs_without_te() -> None:
    """megatron-core 0.16 names ``moe_utils.te_general_gemm`` only when Transformer Engine
    imports, yet its router reads that name on every forward: without TE every MoE layer raised
    NameError. Set it to None, the value the router's own test expects, where it is missing."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class ParExpertsMegatron(MegatronModule):
    """Drop-in for Megatron's ``SequentialMLP`` running routed-experts ``impl`` ("drop_h",
    "normal", "drop_h_quack", or "auto": ``experts_auto`` on this rank's expert shard, why in
    ``auto_reason``; see :class:`~swiglu_train.layers.experts.ParExperts`).

    Built as Megatron builds its experts: ``ModuleSpec(module=ParExpertsMegatron, params=...)``
    on megatron-core 0.16 (``build_module(spec, num_local_experts, config, pg_collection=...)``)
    and ``partial(ParExpertsMegatron, impl=...)`` on 0.17+ (called with ``name=`` from 0.18);
    :func:`~.specs.moe_spec` makes either. ``submodules``, if given (SequentialMLP's spec), must
    name Megatron's local linears, whose math these experts replace.
    """

    ROUTED_EXPERTS = True  # the memory profiler labels its bytes experts/<impl>

    def __init__(
        self,
        num_local_experts: int,
        config: TransformerConfig,
        submodules: MLPSubmodules | None = None,
        pg_collection: Any | None = None,
        name: str | None = None,
        impl: str = "drop_h",
        saved_fp8: bool = False,
        inplace: bool = True,
    ) -> None:
        check_experts_config(config)
        check_experts_impl(impl, saved_fp8)
        if submodules is not None:
            check_local_linears(submodules)
        if pg_collection is None:
            raise ValueError(
                "ParExpertsMegatron needs the MoELayer's pg_collection (ep, expt_tp, expt_dp)"
            )
        super().__init__(config=config)
        router_runs_without_te()
        self.ep_group, self.tp_group = pg_collection.ep, pg_collection.expt_tp
        self.dp_group = pg_collection.expt_dp  # the replicas of an expert, for checkpoints
        ffn, tp = config.moe_ffn_hidden_size, get_pg_size(self.tp_group)
        if ffn % tp:
            raise ValueError(
                f"moe_ffn_hidden_size {ffn} must divide by the expert tensor-parallel size {tp}"
            )
        self.weights_on = "input" if config.moe_apply_probs_on_input else "output"
        self.auto_reason = None  # why auto chose the impl; None when it was named
        if impl == AUTO:
            impl, self.auto_reason = experts_auto(config.hidden_size, ffn // tp, self.weights_on)
        if impl == "drop_h_quack":
            check_experts_quack_runs(config.hidden_size, ffn // tp)
        self.num_local_experts, self.ffn_hidden_size = num_local_experts, ffn
        self.impl, self.saved_fp8, self.inplace = impl, saved_fp8, inplace
        self.name = name
        self._make_weights(tp)
        self._register_state_dict_hook(sequential_keys_on_save)
        self.register_load_state_dict_pre_hook(sequential_keys_on_load)

    def _make_weights(self, tp: int) -> None:
        """fc1 [E, 2F/tp, D] and fc2 [E, D, F/tp], each expert initialized as SequentialMLP's
        ``MLP(is_expert=True)`` initializes its linears (CPU: the full master weight from the
        global RNG, then this rank's rows; GPU: the expert-parallel RNG), in its order, fc1
        then fc2 per expert; the parameters carry its TP and data-parallel attributes."""
        config, e, f = self.config, self.num_local_experts, self.ffn_hidden_size
        d = config.hidden_size
        factory = {"dtype": config.params_dtype}
        if not config.use_cpu_initialization:
            factory["device"] = torch.cuda.current_device()
        self.fc1_weight = torch.nn.Parameter(torch.empty(e, 2 * f // tp, d, **factory))
        self.fc2_weight = torch.nn.Parameter(torch.empty(e, d, f // tp, **factory))
        # (weight, init, master [out, in], split dim, stride): Megatron's column- and
        # row-parallel linears of one expert
        linears = (
            (self.fc1_weight, config.init_method, (2 * f, d), 0, 2),
            (self.fc2_weight, config.output_layer_init_method, (d, f), 1, 1),
        )
        if config.perform_initialization:
            rank = get_pg_rank(self.tp_group)
            for i in range(e):
                for weight, init, (out, inp), dim, stride in linears:
                    if config.use_cpu_initialization:
                        _initialize_affine_weight_cpu(
                            weight.data[i], out, inp, weight.shape[1 + dim], dim, init,
                            stride=stride, params_dtype=config.params_dtype, rank=rank,
                            world_size=tp,
                        )  # fmt: skip
                    else:
                        _initialize_affine_weight_gpu(
                            weight.data[i], init, partition_dim=dim, stride=stride, is_expert=True
                        )
        # Reduced over expert data parallelism, not the dense DP group, wherever the expert
        # groups differ from the dense ones (megatron-core 0.19's rule for its expert linears).
        expert_groups = config.expert_model_parallel_size > 1 or (
            config.expert_tensor_parallel_size != config.tensor_model_parallel_size
        )
        for weight, _, _, dim, stride in linears:
            set_tensor_model_parallel_attributes(weight, True, dim=1 + dim, stride=stride)
            weight.allreduce = not expert_groups

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ) -> tuple[torch.Tensor, None]:
        """(y [R, D] partial over the ETP group, None): the dispatcher's rows, grouped by local
        expert in ``tokens_per_expert`` counts, each through its expert times its prob."""
        x = permuted_local_hidden_states
        rows = x.shape[0]
        counts = tokens_per_expert.to(torch.long)
        if not counts.is_cuda and int(counts.sum()) != rows:  # on the host already: free
            raise ValueError(
                f"tokens_per_expert {counts.tolist()} counts {int(counts.sum())} rows, the "
                f"dispatcher passed {rows}"
            )
        experts = torch.arange(self.num_local_experts, device=x.device)
        index = torch.repeat_interleave(experts, counts.to(x.device), output_size=rows)
        y = experts_mlp(
            x,
            index[:, None],
            permuted_probs[:, None],
            self.fc1_weight,
            self.fc2_weight,
            impl=self.impl,
            saved_fp8=self.saved_fp8,
            weights_on=self.weights_on,
            inplace=self.inplace,
        )
        return y, None

    def backward_dw(self) -> None:
        """Weight grads are computed in backward (no delayed wgrad), as Megatron's GroupedMLP."""

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """SequentialMLP's dist-ckpt entries (:mod:`.experts_checkpoint`)."""
        return experts_sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def extra_repr(self) -> str:
        fp8 = ", saved_fp8=True" if self.saved_fp8 else ""
        auto = " (auto)" if self.auto_reason is not None else ""
        return (
            f"num_local_experts={self.num_local_experts}, impl={self.impl!r}{auto}{fp8}, "
            f"weights_on={self.weights_on!r}, inplace={self.inplace}"
        )
