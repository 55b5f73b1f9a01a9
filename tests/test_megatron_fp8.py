"""Megatron's FP8 and FP4 (Transformer Engine's recipes, asked for by ``config.fp8``/``fp4``)
against our spec's MLPs, without TE installed: the MLP our spec builds refuses at build, in one
line naming the format and recipe, since its own GEMMs have no FP8 versions yet and would run
in bf16 where the user asked for FP8."""

from __future__ import annotations

import pytest
from megatron_support import swiglu_config

from megatron.core.transformer.spec_utils import ModuleSpec, build_module  # isort: skip

from swiglu_train.integrations.megatron import get_gpt_layer_spec, mlp_spec, moe_spec

RECIPES = ["delayed", "tensorwise", "mxfp8", "blockwise"]  # megatron-core's Fp8Recipe


def build_slot(slot, config):
    """The module a TransformerLayer builds from its ``mlp`` slot: a ModuleSpec (megatron-core
    0.16) or a builder it calls (0.18+)."""
    if isinstance(slot, ModuleSpec):
        return build_module(slot, config=config)
    return slot(config=config)


def low_precision_config(recipe: str, kind: str = "fp8", **overrides):
    config = swiglu_config(**overrides)
    # Set after construction: TransformerConfig's own validation wants TE for FP8.
    setattr(config, kind, "hybrid" if kind == "fp8" else "e2m1")
    setattr(config, f"{kind}_recipe", recipe)
    return config


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("impl", ["normal", "drop_h", "save_factors"])
def test_the_spec_s_mlp_refuses_fp8_at_build_in_one_line(impl, recipe):
    config = low_precision_config(recipe)
    with pytest.raises(ValueError) as info:
        build_slot(get_gpt_layer_spec(impl).submodules.mlp, config)
    message = str(info.value)
    assert "\n" not in message and message.startswith("ParMLPMegatron cannot run this config: ")
    assert (
        f"(config.fp8='hybrid' with fp8_recipe={recipe!r}: its own GEMMs' FP8 versions are not "
        "implemented yet, so it would run them in bf16)" in message
    )
    assert "get_gpt_layer_spec('normal', backend='te')" in message


def test_fp4_is_refused_the_same_way():
    with pytest.raises(ValueError, match=r"\(config\.fp4='e2m1' with fp4_recipe='nvfp4': its"):
        build_slot(mlp_spec("drop_h"), low_precision_config("nvfp4", kind="fp4"))


def test_the_moe_spec_s_experts_refuse_fp8_at_build():
    """The MoE layer's routed experts, built as its spec builds them."""
    config = low_precision_config("blockwise", num_moe_experts=4, moe_ffn_hidden_size=32)
    moe = moe_spec(4, "drop_h")
    submodules = moe.submodules if isinstance(moe, ModuleSpec) else moe.keywords["submodules"]
    routed = submodules.experts
    with pytest.raises(ValueError) as info:
        if isinstance(routed, ModuleSpec):
            build_module(routed, 4, config)
        else:
            routed(4, config)
    message = str(info.value)
    assert "\n" not in message and message.startswith("ParExpertsMegatron cannot run this config")
    assert "config.fp8='hybrid' with fp8_recipe='blockwise'" in message
