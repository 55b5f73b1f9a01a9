"""ModuleSpecs that put ParMLPMegatron into Megatron models: the one line a user changes.

Only the MLP submodule differs from Megatron's own spec for the backend (``local``, or ``te``
for Transformer Engine), so attention, norms and every other layer follow whatever the
installed megatron-core version builds. ``te`` needs transformer-engine, which megatron.core
imports lazily; it is checked here, when the spec is built.

MoE layers (``num_experts``) keep Megatron's ``MoELayer`` (router, token dispatcher, aux
losses) with our routed experts (ParExpertsMegatron) and shared experts (ParSharedExpertMLP)
in its slots, which megatron-core 0.16 fills from ModuleSpecs and 0.17+ by calling builders:
the slots are rewritten in whichever form the installed version's own MoE spec has.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from swiglu_train.integrations.megatron.activation_mlp import SwiGLUActivationMLP
from swiglu_train.integrations.megatron.checks import check_chunk, check_impl
from swiglu_train.integrations.megatron.experts import ParExpertsMegatron, check_experts_impl
from swiglu_train.integrations.megatron.mlp import ParMLPMegatron
from swiglu_train.integrations.megatron.shared_experts import ParSharedExpertMLP
from swiglu_train.layers.registry import check_saved_fp8

if TYPE_CHECKING:
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

BACKENDS = ("local", "te")
# megatron-core >= 0.18 fills a TransformerLayer's mlp slot by calling a builder.
BUILDER_API: bool = hasattr(MLP, "as_mlp_submodule")


def _te_spec_provider() -> TESpecProvider:
    """Megatron's TE spec provider, or an ImportError saying what to install or use instead.

    megatron-core 0.16 imports its TE extension without TE (``HAVE_TE`` False, classes mocked).
    """
    try:
        from megatron.core.extensions import transformer_engine

        have_te = bool(getattr(transformer_engine, "HAVE_TE", False))
    except ImportError:
        have_te = False
    if not have_te:
        raise ImportError(
            "backend='te' needs transformer-engine (pip install transformer-engine[pytorch]), "
            "which megatron.core could not import; use backend='local' for Megatron's own linears"
        )
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

    return TESpecProvider()


def _mlp_module(mlp_impl: str, backend: str) -> tuple[type[ParMLPMegatron], MLPSubmodules]:
    """The MLP class and its linears for a backend; impl first, as it needs no install."""
    check_impl(mlp_impl)
    if backend == "local":
        return ParMLPMegatron, MLPSubmodules(
            linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear
        )
    if backend != "te":
        raise ValueError(f"unknown backend {backend!r}; valid backends: {', '.join(BACKENDS)}")
    SwiGLUActivationMLP.validate_impl(mlp_impl)
    te = _te_spec_provider()
    return SwiGLUActivationMLP, MLPSubmodules(
        linear_fc1=te.column_parallel_layer_norm_linear(), linear_fc2=te.row_parallel_linear()
    )


def mlp_spec(
    mlp_impl: str = "drop_h",
    inplace: bool = True,
    backend: str = "local",
    chunk: int | None = None,
    saved_fp8: bool = False,
) -> ModuleSpec | Callable[..., ParMLPMegatron]:
    """The MLP submodule alone, for any TransformerLayer-like spec (``submodules.mlp``).

    ``chunk``: the packed layout's chunk under ``save_factors`` (see ParMLPMegatron).
    ``saved_fp8``: ``drop_h``'s saved preactivation in FP8 (``swiglu_train.ops.fp8_saved``).
    megatron-core < 0.18 builds that slot from a ModuleSpec (which TransformerLayer passes the
    model's TP group to, as our class compares equal to ``MLP``); 0.18+ calls a builder
    (``MLP.as_mlp_submodule`` bound to its submodules) with the model's ``pg_collection``.
    With ``backend="te"`` fc1 is TE's LayerNorm+Linear: the layer spec must not norm again.
    """
    check_saved_fp8(mlp_impl, saved_fp8)  # the reason first, before any backend's checks
    module, submodules = _mlp_module(mlp_impl, backend)
    check_chunk(mlp_impl, chunk)
    params = {"impl": mlp_impl, "inplace": inplace, "chunk": chunk, "saved_fp8": saved_fp8}
    if BUILDER_API:
        return partial(module.as_mlp_submodule, submodules=submodules, **params)
    return ModuleSpec(module=module, params=params, submodules=submodules)


def get_gpt_layer_spec(
    mlp_impl: str = "drop_h",
    backend: str = "local",
    normalization: str = "RMSNorm",
    qk_layernorm: bool = False,
    inplace: bool = True,
    chunk: int | None = None,
    saved_fp8: bool = False,
    num_experts: int | None = None,
) -> ModuleSpec:
    """Megatron's GPT TransformerLayer spec for ``backend`` with our MLP, for
    ``GPTModel(..., spec)``.

    ``backend="te"`` (impl ``normal`` only) takes Megatron's TE spec, whose norms follow
    ``config.normalization``: ``normalization`` applies to the local spec only.
    ``num_experts``: an MoE layer (local backend; the config's ``num_moe_experts`` must match)
    whose routed and shared experts run ``mlp_impl`` (:func:`moe_spec`).
    """
    if num_experts is not None:
        if backend != "local" or chunk is not None:
            raise ValueError(
                "num_experts: our MoE layer spec is the local backend's (Megatron's experts "
                "there are SequentialMLP) and its experts keep a canonical fc1 (no chunk); "
                f"got backend={backend!r}, chunk={chunk!r}"
            )
        check_experts_impl(mlp_impl, saved_fp8)
        layer = get_gpt_layer_local_spec(
            num_experts=num_experts, normalization=normalization, qk_layernorm=qk_layernorm
        )
        mlp = _with_our_experts(layer.submodules.mlp, mlp_impl, inplace, saved_fp8)
    else:
        mlp = mlp_spec(mlp_impl, inplace, backend, chunk, saved_fp8)
        if backend == "te":
            layer = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
        else:
            layer = get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=qk_layernorm)
    return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, mlp=mlp))


def moe_spec(
    num_experts: int, mlp_impl: str = "drop_h", inplace: bool = True, saved_fp8: bool = False
) -> ModuleSpec | Callable[..., Any]:
    """The MoE ``mlp`` slot alone, for any TransformerLayer-like spec: Megatron's MoELayer (its
    local-backend spec for ``num_experts``) with our routed and shared experts running
    ``mlp_impl`` ("drop_h", "normal" or "drop_h_quack"; ``saved_fp8`` with drop_h)."""
    check_experts_impl(mlp_impl, saved_fp8)
    stock = get_moe_module_spec(use_te=False, num_experts=num_experts)
    return _with_our_experts(stock, mlp_impl, inplace, saved_fp8)


def _with_our_experts(
    moe: ModuleSpec | partial, impl: str, inplace: bool, saved_fp8: bool
) -> ModuleSpec | partial:
    """Megatron's MoE slot (a ModuleSpec of MoELayer on 0.16, ``partial(MoELayer,
    submodules=...)`` on 0.18+) with our experts in its ``experts`` and ``shared_experts``
    slots, each in the form the stock slot had (a ModuleSpec, or a builder to call)."""
    params = {"impl": impl, "inplace": inplace, "saved_fp8": saved_fp8}
    shared_linears = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    is_spec = isinstance(moe, ModuleSpec)
    submodules = moe.submodules if is_spec else moe.keywords["submodules"]
    if isinstance(submodules.experts, ModuleSpec):  # megatron-core 0.16
        experts = ModuleSpec(module=ParExpertsMegatron, params=params)
        shared = ModuleSpec(module=ParSharedExpertMLP, params=params, submodules=shared_linears)
    else:  # 0.17+: builders
        experts = partial(ParExpertsMegatron, **params)
        shared = partial(ParSharedExpertMLP, submodules=shared_linears, **params)
    submodules = dataclasses.replace(submodules, experts=experts, shared_experts=shared)
    if is_spec:
        return dataclasses.replace(moe, submodules=submodules)
    return partial(moe.func, *moe.args, **{**moe.keywords, "submodules": submodules})


def get_mlp_layer_spec(
    mlp_impl: str = "drop_h",
    backend: str = "local",
    inplace: bool = True,
    chunk: int | None = None,
    saved_fp8: bool = False,
) -> ModuleSpec:
    """A HybridModel/Mamba-stack ``mlp_layer`` (``MLPLayer``) with a pre-MLP RMSNorm and our MLP
    (with ``backend="te"`` the norm is fc1's own, as in Megatron's TE hybrid spec).

    Raises ImportError on megatron-core versions without ``megatron.core.ssm.mlp_layer``.
    """
    from megatron.core.ssm.mlp_layer import MLPLayer

    mlp = mlp_spec(mlp_impl, inplace, backend, chunk, saved_fp8)
    norm = {}
    if backend != "te":  # TE's fc1 norms its own input
        norm["pre_mlp_layernorm"] = LocalSpecProvider().layer_norm(rms_norm=True)
    return ModuleSpec(
        module=MLPLayer,
        submodules=TransformerLayerSubmodules(mlp=mlp, mlp_bda=get_bias_dropout_add, **norm),
    )
