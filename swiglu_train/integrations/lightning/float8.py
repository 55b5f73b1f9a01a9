"""``pretrain --float8 tensorwise|rowwise``: torchao's ``convert_to_float8_training`` over the
model's linears, its lm head left in bf16 (as torchtitan's Llama configs leave theirs).

The MLPs' fc1 and fc2 are converted too: impl ``drop_h`` runs their recipes in FP8 GEMMs of its
own (h not saved), ``normal`` runs them through the converted forward (``ParMLP``); the other
impls' FP8 GEMMs are not implemented yet, so they are refused here rather than trained in bf16
unannounced.
"""

from __future__ import annotations

from torch import nn

from swiglu_train.kernels.fp8_format import MIN_CAPABILITY
from swiglu_train.kernels.runtime import device_capability
from swiglu_train.layers.par_mlp import FLOAT8_IMPLS

RECIPES = ("tensorwise", "rowwise")  # torchao's Float8LinearConfig.from_recipe_name names
# The output projection of our decoder, and of Hugging Face's and LitGPT's models.
HEADS = frozenset({"head", "lm_head"})
FP8_GEMM_MULTIPLE = 16  # torch._scaled_mm needs both dims of every FP8 operand divisible by it


def check_float8(recipe: str | None, mlp_impl: str, num_experts: int) -> None:
    """model.float8 against the recipes torchao names, the impl and routed experts, in the
    config's words (ParMLP says the same later, at its first forward)."""
    if recipe is None:
        return
    where = f"model.float8={recipe!r} (--float8)"
    if recipe not in RECIPES:
        raise ValueError(f"{where} must be one of {', '.join(RECIPES)}")
    if num_experts:
        raise ValueError(
            f"{where}: this model's MLPs are {num_experts} routed experts, whose FP8 GEMMs "
            "are not implemented yet; train them without --float8"
        )
    if mlp_impl not in FLOAT8_IMPLS:
        raise ValueError(
            f"{where}: mlp_impl {mlp_impl!r} runs GEMMs of its own, whose FP8 versions are "
            f"not implemented yet; use --mlp-impl {' or '.join(FLOAT8_IMPLS)}, which run "
            "torchao's Float8Linear recipes"
        )


def check_float8_run(recipe: str | None, activation_checkpointing: str, gpu: int | None) -> None:
    """What of the run --float8 needs: a CUDA device ``gpu`` with FP8 (None: the run trains on
    the CPU), and no planner, which measures bf16 runs only."""
    if recipe is None:
        return
    where = f"model.float8={recipe!r} (--float8)"
    if activation_checkpointing == "auto":
        raise ValueError(
            f"{where}: the planner (--activation-checkpointing auto) measures bf16 runs only; "
            "use --activation-checkpointing manual with --checkpoint-layers"
        )
    need = f"a CUDA GPU with FP8, compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+"
    if gpu is None:
        raise ValueError(f"{where} needs {need} (Ada, Hopper or newer); this run trains on the CPU")
    major, minor = device_capability(gpu)
    if (major, minor) < MIN_CAPABILITY:
        raise ValueError(
            f"{where} needs {need} (Ada, Hopper or newer); cuda:{gpu} is {major}.{minor}"
        )


def float8_linears(model: nn.Module) -> list[str]:
    """The names of the linears --float8 converts: every ``nn.Linear`` but the lm head. One
    whose dims FP8 GEMMs cannot take is refused, not left in bf16 unannounced."""
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or name.rpartition(".")[2] in HEADS:
            continue
        if module.in_features % FP8_GEMM_MULTIPLE or module.out_features % FP8_GEMM_MULTIPLE:
            raise ValueError(
                f"--float8: {name} is [{module.out_features}, {module.in_features}], but FP8 "
                f"GEMMs need both dims divisible by {FP8_GEMM_MULTIPLE}; pick sizes that are"
            )
        names.append(name)
    return names


def convert_float8(model: nn.Module, recipe: str) -> list[str]:
    """Swap :func:`float8_linears` for torchao's Float8Linear with ``recipe``'s scaling, in
    place; returns their names. Parameters and state_dict keys stay as they were, so a
    checkpoint resumes with or without --float8."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    names = float8_linears(model)
    chosen = set(names)
    convert_to_float8_training(
        model,
        module_filter_fn=lambda _, fqn: fqn in chosen,
        config=Float8LinearConfig.from_recipe_name(recipe),
    )
    return names
