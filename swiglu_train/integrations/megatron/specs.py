"""ModuleSpecs that put ParMLPMegatron into Megatron models: the one line a user changes.

Only the MLP submodule differs from Megatron's own local spec, so attention, norms and every
other layer follow whatever the installed megatron-core version builds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from swiglu_train.integrations.megatron.mlp import ParMLPMegatron, check_impl

BACKENDS = ("local",)
# megatron-core >= 0.19 fills a TransformerLayer's mlp slot by calling a builder.
BUILDER_API: bool = hasattr(MLP, "as_mlp_submodule")


def _check_backend(backend: str) -> None:
    if backend == "te":
        raise ValueError(
            "backend='te' is not supported yet: ParMLPMegatron runs on Megatron's local "
            "ColumnParallelLinear/RowParallelLinear; use backend='local'"
        )
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid backends: {', '.join(BACKENDS)}")


def mlp_spec(
    mlp_impl: str = "drop_h",
    inplace: bool = True,
    backend: str = "local",
    chunk: int | None = None,
) -> ModuleSpec | Callable[..., ParMLPMegatron]:
    """The MLP submodule alone, for any TransformerLayer-like spec (``submodules.mlp``).

    ``chunk``: the packed layout's chunk under ``save_factors`` (see ParMLPMegatron).

    megatron-core < 0.19 builds that slot from a ModuleSpec; 0.19 calls a builder
    (``MLP.as_mlp_submodule`` bound to its submodules) and would drop a ModuleSpec's params.
    """
    check_impl(mlp_impl)
    _check_backend(backend)
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    if BUILDER_API:
        return partial(
            ParMLPMegatron.as_mlp_submodule,
            submodules=submodules,
            impl=mlp_impl,
            inplace=inplace,
            chunk=chunk,
        )
    return ModuleSpec(
        module=ParMLPMegatron,
        params={"impl": mlp_impl, "inplace": inplace, "chunk": chunk},
        submodules=submodules,
    )


def get_gpt_layer_spec(
    mlp_impl: str = "drop_h",
    backend: str = "local",
    normalization: str = "RMSNorm",
    qk_layernorm: bool = False,
    inplace: bool = True,
    chunk: int | None = None,
) -> ModuleSpec:
    """Megatron's local GPT TransformerLayer spec with our MLP, for ``GPTModel(..., spec)``."""
    mlp = mlp_spec(mlp_impl, inplace, backend, chunk)
    layer = get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=qk_layernorm)
    return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, mlp=mlp))


def get_mlp_layer_spec(
    mlp_impl: str = "drop_h", backend: str = "local", inplace: bool = True, chunk: int | None = None
) -> ModuleSpec:
    """A HybridModel/Mamba-stack ``mlp_layer`` (``MLPLayer``) with a pre-MLP RMSNorm and our MLP.

    Raises ImportError on megatron-core versions without ``megatron.core.ssm.mlp_layer``.
    """
    from megatron.core.ssm.mlp_layer import MLPLayer

    mlp = mlp_spec(mlp_impl, inplace, backend, chunk)
    norm = LocalSpecProvider().layer_norm(rms_norm=True)
    return ModuleSpec(
        module=MLPLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=norm, mlp=mlp, mlp_bda=get_bias_dropout_add
        ),
    )
