"""saved_fp8 through the Megatron spec: a GPTModel whose MLPs keep their saved preactivation in
FP8 computes drop_h's loss, gradients within e4m3's rounding, and the same checkpoints."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import rel_err
from megatron_support import megatron_parallel, spawn, swiglu_config
from test_megatron_mlp import VOCAB, build_gpt, gpt_loss, stock_submodules

from swiglu_train.integrations.megatron import (
    ParMLPMegatron,
    get_gpt_layer_spec,
    get_mlp_layer_spec,
    mlp_spec,
)
from swiglu_train.layers import registry
from swiglu_train.layers.registry import check_saved_fp8
from swiglu_train.ops import use_backend
from swiglu_train.ops.quack_mlp import quack_available

QUACK_INSTALLED = importlib.util.find_spec("quack") is not None


def _gpt_with_fp8_saved(rank: int, world_size: int, rendezvous: str) -> None:
    with megatron_parallel(rank, world_size, rendezvous), use_backend("torch"):
        config = swiglu_config(ffn_hidden_size=200)  # a partial 128-column block per half
        plain = build_gpt(config, get_gpt_layer_spec("drop_h"), seed=0)
        fp8 = build_gpt(config, get_gpt_layer_spec("drop_h", saved_fp8=True), seed=1)
        mlps = [layer.mlp for layer in fp8.decoder.layers]
        assert all(isinstance(m, ParMLPMegatron) and m.saved_fp8 for m in mlps)
        assert "saved_fp8=True" in repr(mlps[0])
        fp8.load_state_dict(plain.state_dict())  # strict: the same keys, both ways
        plain.load_state_dict(fp8.state_dict())
        tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
        losses = {}
        for name, model in (("plain", plain), ("fp8", fp8)):
            losses[name] = gpt_loss(model, tokens)
            losses[name].backward()
        assert torch.equal(losses["fp8"], losses["plain"])  # forward reads bf16 preact
        for (name, p), q in zip(fp8.named_parameters(), plain.parameters(), strict=True):
            err = rel_err(p.grad, q.grad)
            assert err < 0.06, (name, err)  # e4m3's rounding (tests/test_fp8_saved.py)
            if ".mlp.linear_fc" in name:
                assert err > 1e-2, (name, err)  # computed from the FP8 copy


def test_gpt_spec_builds_fp8_saving_mlps_with_drop_h_s_checkpoints():
    spawn(_gpt_with_fp8_saved, 1)


def spec_params(spec) -> dict:
    """The keyword arguments a spec builds its MLP with (a ModuleSpec's or a builder's)."""
    return spec.keywords if hasattr(spec, "keywords") else spec.params


def test_specs_carry_the_option_and_refuse_it_for_other_impls():
    layer = get_mlp_layer_spec(saved_fp8=True)
    for spec in (mlp_spec("drop_h", saved_fp8=True), layer.submodules.mlp):
        assert spec_params(spec)["saved_fp8"] is True
    with pytest.raises(ValueError, match="not 'normal': it saves h"):
        get_gpt_layer_spec("normal", saved_fp8=True)
    with pytest.raises(
        ValueError, match="not 'save_factors': it is not implemented for the saved SwiGLU"
    ):
        get_gpt_layer_spec("save_factors", saved_fp8=True)
    with pytest.raises(ValueError, match="not 'normal': it saves h"):  # TE installed or not
        get_gpt_layer_spec("normal", backend="te", saved_fp8=True)
    with pytest.raises(ValueError, match="not 'normal': it saves h"):  # before any weight
        ParMLPMegatron(swiglu_config(), stock_submodules(), impl="normal", saved_fp8=True)


@pytest.mark.skipif(QUACK_INSTALLED, reason="quack is installed here: the spec builds for real")
def test_drop_h_quack_with_the_option_needs_only_quack_itself(monkeypatch):
    """saved_fp8 is accepted for drop_h_quack: without quack the spec fails on quack's absence
    alone (an ImportError, not the saved_fp8 refusal), and with quack's check passed it builds
    an MLP spec that carries the option."""
    check_saved_fp8("drop_h_quack")
    with pytest.raises(ImportError, match="need the quack-kernels package"):
        get_gpt_layer_spec("drop_h_quack", saved_fp8=True)
    monkeypatch.setattr(registry, "require_quack", lambda: None)  # as if quack were installed
    params = spec_params(get_gpt_layer_spec("drop_h_quack", saved_fp8=True).submodules.mlp)
    assert params["impl"] == "drop_h_quack" and params["saved_fp8"] is True
    assert spec_params(mlp_spec("drop_h_quack", saved_fp8=True))["saved_fp8"] is True
    assert spec_params(mlp_spec("drop_h_quack"))["saved_fp8"] is False


@pytest.mark.gpu
@pytest.mark.skipif(not quack_available(), reason="needs quack-kernels and an sm_90+ GPU")
def test_drop_h_quack_spec_carries_the_option():
    params = spec_params(get_gpt_layer_spec("drop_h_quack", saved_fp8=True).submodules.mlp)
    assert params["impl"] == "drop_h_quack" and params["saved_fp8"] is True
