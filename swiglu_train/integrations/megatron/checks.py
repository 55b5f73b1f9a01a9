"""What ParMLPMegatron refuses, with the reason: configs, impls, chunks and linears before any
weight exists, and inputs its kernels cannot take at forward time."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from swiglu_train.kernels.runtime import SUPPORTED_DTYPES
from swiglu_train.layers.registry import AUTO, MLP_IMPLS, PACKED_IMPLS, get_impl

SUPPORTED_IMPLS: tuple[str, ...] = MLP_IMPLS


def config_problems(config: TransformerConfig, own_gemms: bool = True) -> list[str]:
    """What in ``config`` a SwiGLU module of ours cannot run, one reason each (the dense MLPs'
    and the routed experts' common ground).

    ``own_gemms=False`` (SwiGLUActivationMLP: Megatron's linears run the GEMMs, ours only the
    activation) skips the checks that concern only our GEMMs: FP8/FP4 among them, which TE's
    linears quantize themselves (the activation between them runs in bf16, as Megatron's does).
    """
    problems = []
    if not config.gated_linear_unit or config.activation_func is not F.silu:
        problems.append(
            "it computes SwiGLU only: set gated_linear_unit=True, activation_func=F.silu"
        )
    low_precision = _low_precision(config) if own_gemms else None
    if low_precision:
        problems.append(
            f"FP8/FP4 runs on Transformer Engine GEMMs, which this module replaces "
            f"({low_precision}: its own GEMMs' FP8 versions are not implemented yet, so it "
            "would run them in bf16); unset config.fp8/fp4"
        )
    if getattr(config, "use_te_activation_func", False):
        problems.append("use_te_activation_func would bypass our activation; set it False")
    if getattr(config, "activation_func_clamp_value", None) is not None:
        problems.append("activation_func_clamp_value (clamped SwiGLU) is not implemented")
    if getattr(config, "glu_linear_offset", 0.0):
        problems.append("glu_linear_offset != 0 is not implemented")
    if own_gemms and config.gradient_accumulation_fusion:
        problems.append(
            "gradient_accumulation_fusion is not supported: our backward writes weight grads "
            "to param.grad; set gradient_accumulation_fusion=False"
        )
    if getattr(config, "use_kitchen", False):
        problems.append("use_kitchen changes the fc1 layout (stride 1); not supported")
    return problems


def _low_precision(config: TransformerConfig) -> str | None:
    """What of ``config`` asks Transformer Engine for FP8 or FP4 GEMMs (its format and recipe,
    read without TE), or None."""
    for kind in ("fp8", "fp4"):
        fmt = getattr(config, kind, None)
        if fmt:
            recipe = getattr(config, f"{kind}_recipe", None)
            recipe = getattr(recipe, "value", recipe)  # an Fp8Recipe/Fp4Recipe enum, or its str
            return f"config.{kind}={fmt!r}" + (f" with {kind}_recipe={recipe!r}" if recipe else "")
    return None


def check_config(
    config: TransformerConfig, is_expert: bool = False, own_gemms: bool = True
) -> None:
    """Refuse, with the reason, configs whose MLP math or kernels this dense MLP cannot run
    (:func:`config_problems`, and what only a dense MLP refuses)."""
    problems = config_problems(config, own_gemms)
    if own_gemms and _low_precision(config):
        problems.append("for FP8, use get_gpt_layer_spec('normal', backend='te')")
    if own_gemms and getattr(config, "gtp_weight_remat_size", 1) > 1:
        problems.append(
            "generalized tensor parallelism (gtp_weight_remat_size > 1, megatron-core 0.19) "
            "shards fc1/fc2 further and regathers them inside the linears, whose GEMMs this MLP "
            "replaces; set tensor_parallel_num_weight_shards = tensor_model_parallel_size"
        )
    if is_expert:
        problems.append(
            "MoE experts use expert-parallel comms; use it for dense MLPs only (routed experts: "
            "ParExpertsMegatron, through get_gpt_layer_spec(num_experts=...))"
        )
    if problems:
        raise ValueError("ParMLPMegatron cannot run this config: " + "; ".join(problems))


def check_chunk(impl: str, chunk: int | None) -> None:
    """``chunk`` belongs to the packed layout: refuse it for a canonical impl before any weight
    exists (whether it divides F/tp is known only once the TP size is)."""
    if chunk is not None and impl not in PACKED_IMPLS:
        raise ValueError(f"chunk applies to packed impls only, not {impl!r}")


def check_impl(name: str) -> None:
    """Fail early, before any weight exists, on a name that is no impl (listing the valid).

    ``auto`` is refused: it picks a layout from a tokens hint per layer, while a Megatron model
    must have one layout known before its checkpoint factories and optimizer are built.
    """
    if name == AUTO:
        raise ValueError(
            "impl 'auto' is not supported by the Megatron integration; name one of "
            f"{', '.join(SUPPORTED_IMPLS)}"
        )
    get_impl(name)


def check_local_linears(submodules: MLPSubmodules) -> None:
    """Our forward replaces the linears' own GEMMs, which only the local ones allow."""
    for label, kind in (
        ("linear_fc1", ColumnParallelLinear),
        ("linear_fc2", RowParallelLinear),
    ):
        spec = getattr(submodules, label)
        module = spec.module if isinstance(spec, ModuleSpec) else spec
        if not (isinstance(module, type) and issubclass(module, kind)):
            raise ValueError(
                f"ParMLPMegatron needs {label} to be a local {kind.__name__}, got "
                f"{getattr(module, '__name__', module)}; with Transformer Engine linears use "
                "get_gpt_layer_spec(..., backend='te') (impl 'normal' only)"
            )


def check_input(x: torch.Tensor, weight: torch.Tensor) -> None:
    """An input our kernels take against fc1's ``weight``: a supported dtype, the weights'
    dtype, and their input width."""
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"ParMLPMegatron supports {SUPPORTED_DTYPES}, got {x.dtype}")
    if x.dtype != weight.dtype:
        raise TypeError(
            f"ParMLPMegatron input is {x.dtype} but its weights are {weight.dtype}; "
            "wrap the model in Float16Module or cast the input"
        )
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"ParMLPMegatron expects a last dim of {weight.shape[1]}, got {tuple(x.shape)}"
        )
