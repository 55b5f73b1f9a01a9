"""swiglu_train.patch on real LitGPT models (tiny configs, CPU), and their checkpoint files."""

import copy

import pytest
import torch
from helpers import rel_err
from patch_models import (
    CHUNK,
    PARITY,
    assert_close_all,
    assert_state_equal,
    host_grads,
    litgpt_model,
    run_step,
)

import swiglu_train
from swiglu_train import PORTABLE_IMPLS

litgpt = pytest.importorskip("litgpt")  # a test dependency: fails loudly if absent


def patched_pair(impl: str, bias: bool = False):
    reference = litgpt_model(bias=bias)
    patched = copy.deepcopy(reference)
    report = swiglu_train.patch(patched, impl, chunk=CHUNK if impl == "save_factors" else None)
    return reference, patched, report


@pytest.mark.parametrize("impl", PORTABLE_IMPLS)
def test_patched_llama_mlp_computes_and_saves_as_the_original(impl):
    reference, patched, report = patched_pair(impl, bias=impl == "normal")
    assert [(r.name, r.library, r.host_class, r.impl) for r in report.replaced] == [
        (f"transformer.h.{i}.mlp", "litgpt", "LLaMAMLP", impl) for i in range(2)
    ]
    assert_state_equal(patched.state_dict(), reference.state_dict())
    ids = torch.randint(0, 64, (2, 8))
    logits, embed_grad = run_step(patched, patched.transformer.wte, ids)
    ref_logits, ref_embed_grad = run_step(reference, reference.transformer.wte, ids)
    assert rel_err(logits, ref_logits) < PARITY
    assert rel_err(embed_grad, ref_embed_grad) < PARITY
    assert_close_all(host_grads(patched), host_grads(reference))


def test_litgpt_checkpoint_files_round_trip(tmp_path):
    """lit_model.pth as LitGPT's scripts write it (fabric.save of {"model": model}) and read it
    (litgpt.utils.load_checkpoint), from patched to plain and back."""
    from lightning.fabric import Fabric
    from litgpt.utils import load_checkpoint

    fabric = Fabric(accelerator="cpu", devices=1)
    reference, patched, _ = patched_pair("save_factors")
    fabric.save(tmp_path / "lit_model.pth", {"model": patched})
    plain = litgpt_model()
    with torch.no_grad():
        for p in plain.parameters():
            p.zero_()
    load_checkpoint(fabric, plain, tmp_path / "lit_model.pth")
    assert_state_equal(plain.state_dict(), reference.state_dict())

    other = litgpt_model()
    with torch.no_grad():
        other.transformer.h[0].mlp.fc_2.weight.mul_(2)  # weights the patched model lacks
    fabric.save(tmp_path / "other.pth", {"model": other})
    load_checkpoint(fabric, patched, tmp_path / "other.pth")
    assert_state_equal(patched.state_dict(), other.state_dict())
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(patched.eval()(ids), other.eval()(ids))


@pytest.mark.parametrize(
    ("mlp_class_name", "extra", "where", "reason"),
    [
        ("GemmaMLP", {}, "transformer.h.0.mlp", "is not litgpt's SwiGLU forward"),
        ("GptNeoxMLP", {}, "transformer.h.0.mlp", "not a SwiGLU layout"),
        ("LLaMAMoE", {"n_expert": 2, "n_expert_per_token": 1, "moe_intermediate_size": 32},
         "transformer.h.0.mlp.experts.0", "an MoE expert"),
    ],
)  # fmt: skip
def test_other_litgpt_mlps_are_left_and_reported(mlp_class_name, extra, where, reason):
    model = litgpt_model(mlp_class_name, **extra)
    before = copy.deepcopy(model.state_dict())
    report = swiglu_train.patch(model)
    assert report.replaced == []
    left = {entry.name: entry.reason for entry in report.left}
    assert reason in left[where]
    assert reason in report.summary()
    assert_state_equal(model.state_dict(), before)
