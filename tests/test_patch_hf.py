"""swiglu_train.patch on real Hugging Face transformers models (tiny configs, CPU)."""

import copy

import pytest
import torch
from helpers import rel_err
from patch_models import (
    CHUNK,
    PARITY,
    TOKENS,
    assert_close_all,
    assert_state_equal,
    hf_model,
    host_grads,
    run_step,
)

import swiglu_train
from swiglu_train import PORTABLE_IMPLS
from swiglu_train.integrations.patch import PatchedSwiGLU

transformers = pytest.importorskip("transformers")  # a test dependency: fails loudly if absent
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3"]
MLP_CLASS = {"llama": "LlamaMLP", "mistral": "MistralMLP", "qwen2": "Qwen2MLP",
             "qwen3": "Qwen3MLP", "phi3": "Phi3MLP"}  # fmt: skip


def patched_pair(family: str, impl: str):
    reference = hf_model(family)
    patched = copy.deepcopy(reference)
    report = swiglu_train.patch(patched, impl, chunk=CHUNK if impl == "save_factors" else None)
    return reference, patched, report


@pytest.mark.parametrize("impl", PORTABLE_IMPLS)
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_model_computes_and_saves_as_the_original(family, impl):
    reference, patched, report = patched_pair(family, impl)
    assert [(r.name, r.host_class, r.impl) for r in report.replaced] == [
        (f"model.layers.{i}.mlp", MLP_CLASS[family], impl) for i in range(2)
    ]
    assert report.left == []
    assert isinstance(patched.model.layers[1].mlp, PatchedSwiGLU)
    # checkpoints: the same keys, order, shapes and values, packed rows unpacked
    assert_state_equal(patched.state_dict(), reference.state_dict())
    host, mlp = reference.model.layers[0].mlp, patched.model.layers[0].mlp
    for name, linear in host.named_children():  # mlp.gate_proj.weight reads as before
        if isinstance(linear, torch.nn.Linear):
            assert torch.equal(getattr(mlp, name).weight, linear.weight), name

    ids = torch.randint(0, 64, TOKENS)
    logits, embed_grad = run_step(patched, patched.get_input_embeddings(), ids)
    ref_logits, ref_embed_grad = run_step(reference, reference.get_input_embeddings(), ids)
    assert rel_err(logits, ref_logits) < PARITY
    assert rel_err(embed_grad, ref_embed_grad) < PARITY
    assert_close_all(host_grads(patched), host_grads(reference))  # every parameter's grad


@pytest.mark.parametrize("slip", ["two gate rows swapped", "one weight off by 1 %"])
def test_parity_tolerance_catches_a_small_slip(slip):
    """Negative control: what a layout or copy bug would do fails the parity tolerance."""
    reference, patched, _ = patched_pair("llama", "drop_h")
    with torch.no_grad():
        fc1 = patched.model.layers[0].mlp.fc1.weight
        if slip == "two gate rows swapped":
            fc1[[0, 1]] = fc1[[1, 0]]
        else:
            fc1[3, 5] *= 1.01
    ids = torch.randint(0, 64, TOKENS)
    logits, embed_grad = run_step(patched, patched.get_input_embeddings(), ids)
    ref_logits, ref_embed_grad = run_step(reference, reference.get_input_embeddings(), ids)
    assert rel_err(logits, ref_logits) > PARITY
    assert rel_err(embed_grad, ref_embed_grad) > PARITY
    with pytest.raises(AssertionError):
        assert_close_all(host_grads(patched), host_grads(reference))


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_state_dicts_load_both_ways(family):
    """An unpatched model's state loads into a packed patched one, and back."""
    reference, patched, _ = patched_pair(family, "save_factors")
    other = hf_model(family, seed=1)  # other weights, so a load that did nothing shows
    patched.load_state_dict(other.state_dict())
    assert patched.model.layers[0].mlp.fc1_layout.packed
    assert_state_equal(patched.state_dict(), other.state_dict())
    reference.load_state_dict(patched.state_dict())  # strict: no key missing or extra
    assert_state_equal(reference.state_dict(), other.state_dict())
    ids = torch.randint(0, 64, TOKENS)
    patched.eval(), other.eval()
    with torch.no_grad():
        torch.testing.assert_close(patched(ids).logits, other(ids).logits)


def test_load_names_a_half_missing_or_misshapen_fc1():
    _, patched, _ = patched_pair("llama", "drop_h")
    state = patched.state_dict()
    del state["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(RuntimeError, match=r"gate_proj\.weight is given without .*up_proj\.weight"):
        patched.load_state_dict(state)
    state = patched.state_dict()
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(65, 32)
    with pytest.raises(RuntimeError, match=r"size mismatch for model.layers.1.mlp.up_proj.weight"):
        patched.load_state_dict(state)


@pytest.mark.parametrize(("family", "impl"), [("llama", "save_factors"), ("phi3", "drop_h")])
def test_save_pretrained_loads_in_plain_transformers(tmp_path, family, impl):
    from safetensors.torch import load_file

    reference, patched, _ = patched_pair(family, impl)
    patched.save_pretrained(tmp_path / "patched")
    reference.save_pretrained(tmp_path / "plain")
    written = load_file(tmp_path / "patched" / "model.safetensors")
    assert_state_equal(
        dict(sorted(written.items())),
        dict(sorted(load_file(tmp_path / "plain" / "model.safetensors").items())),
    )
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "patched")
    assert not any(isinstance(m, PatchedSwiGLU) for m in loaded.modules())
    assert_state_equal(loaded.state_dict(), reference.state_dict())
    ids = torch.randint(0, 64, TOKENS)
    loaded.eval(), reference.eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)
