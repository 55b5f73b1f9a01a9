"""An MoE pretrain checkpoint <-> a Hugging Face MixtralForCausalLM directory, with real
transformers on CPU at tiny_moe's shape: the same logits from ``AutoModelForCausalLM``,
identical weights back, a run started from them; what Mixtral cannot compute, and convert on
routed experts, refused in one line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import lightning
import pytest
import torch
from typer.testing import CliRunner

from swiglu_train.cli import app
from swiglu_train.integrations.lightning.config import load_config
from swiglu_train.integrations.lightning.module import OptimConfig, PretrainModule
from swiglu_train.integrations.lightning.pretrain import run_pretrain

transformers = pytest.importorskip("transformers")  # the hf extra
from swiglu_train.integrations.lightning.hf import import_hf  # noqa: E402

runner = CliRunner()
TOKENS = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(1))


pytestmark = pytest.mark.usefixtures("offline_wandb_torch_math")


def moe_checkpoint(path: Path, **changes) -> PretrainModule:
    """tiny_moe with weights far from their init (so a mapped weight wrong shows in the
    logits), saved at ``path`` as Lightning saves it."""
    cfg = dataclasses.replace(load_config("tiny_moe").model, rope_theta=5000.0, **changes)
    module = PretrainModule(cfg, OptimConfig(), max_steps=10)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * 0.2)
    ckpt = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams),
            "pytorch-lightning_version": lightning.__version__}  # fmt: skip
    module.on_save_checkpoint(ckpt)
    torch.save(ckpt, path)
    return module.eval()


def logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens)
    return out if isinstance(out, torch.Tensor) else out.logits


def test_export_is_a_mixtral_with_the_same_logits_and_import_gives_the_weights_back(tmp_path):
    module = moe_checkpoint(tmp_path / "moe.ckpt")
    result = runner.invoke(app, ["export-hf", str(tmp_path / "moe.ckpt"), str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    assert "MixtralForCausalLM (" in result.output and "num_local_experts 4" in result.output
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["architectures"] == ["MixtralForCausalLM"]
    assert (written["num_local_experts"], written["num_experts_per_tok"]) == (4, 2)
    assert (written["sliding_window"], written["router_jitter_noise"]) == (None, 0.0)
    assert written["router_aux_loss_coef"] == 0.01
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    ours = module.model.layers[1].mlp
    assert torch.equal(hf.model.layers[1].mlp.experts.gate_up_proj, ours.experts.fc1_weight)
    assert torch.equal(hf.model.layers[1].mlp.gate.weight, ours.router.weight)
    want = logits(module.model, TOKENS)
    assert want.abs().max() > 5
    torch.testing.assert_close(logits(hf, TOKENS), want, rtol=1e-5, atol=1e-4)

    result = runner.invoke(app, ["import-hf", str(tmp_path / "hf"), str(tmp_path / "in.ckpt")])
    assert result.exit_code == 0, result.output
    assert "num_experts 4, moe_top_k 2" in result.output
    imported = torch.load(tmp_path / "in.ckpt", weights_only=True)
    state = module.state_dict()
    assert imported["state_dict"].keys() == state.keys()
    assert all(torch.equal(imported["state_dict"][k], v) for k, v in state.items())
    normal = PretrainModule.load_from_checkpoint(
        tmp_path / "in.ckpt", model={**imported["hyper_parameters"]["model"], "mlp_impl": "normal"}
    ).eval()
    torch.testing.assert_close(logits(normal.model, TOKENS), want, rtol=1e-5, atol=1e-4)

    cfg = load_config("tiny")  # a dense config: --init-from gives it the MoE shape
    cfg.data.seq_length, cfg.data.micro_batch_size, cfg.train.max_steps = 32, 2, 1
    cfg.output_dir = str(tmp_path / "run")
    summary = run_pretrain(cfg, init_from=str(tmp_path / "in.ckpt"))
    assert (cfg.model.num_experts, cfg.model.moe_top_k, summary["num_experts"]) == (4, 2, 4)
    assert summary["steps"] == 1


def test_routing_mixtral_cannot_compute_is_refused_both_ways(tmp_path):
    moe_checkpoint(tmp_path / "plain.ckpt", moe_renormalize=False)
    result = runner.invoke(app, ["export-hf", str(tmp_path / "plain.ckpt"), str(tmp_path / "hf")])
    assert result.exit_code != 0 and "moe_renormalize false" in result.output
    assert not (tmp_path / "hf").exists()
    for kwargs, message in (
        ({"sliding_window": 16}, r"sliding-window attention \(sliding_window 16\)"),
        ({"router_jitter_noise": 0.1}, r"router jitter \(router_jitter_noise 0\.1\)"),
        ({"num_key_value_heads": 2}, r"grouped-query attention"),
    ):
        transformers.MixtralConfig(
            vocab_size=320, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=4, num_local_experts=4, **kwargs,
        ).save_pretrained(tmp_path / "mixtral")  # fmt: skip
        with pytest.raises(ValueError, match=rf"cannot be our decoder exactly: .*{message}"):
            import_hf(tmp_path / "mixtral")


def test_convert_refuses_an_moe_checkpoint_in_one_line(tmp_path):
    """Every impl keeps routed experts' fc1 canonical, so there is no layout to convert; the
    refusal names them rather than 'no ParMLP fc1 weights'."""
    moe_checkpoint(tmp_path / "moe.ckpt")
    for to in ("packed", "hf"):
        out = tmp_path / f"{to}.ckpt"
        result = runner.invoke(app, ["convert", str(tmp_path / "moe.ckpt"), str(out), "--to", to])
        assert result.exit_code != 0, result.output
        assert "only routed experts (model.layers.0.mlp.experts.fc1_weight" in result.output
        assert not out.exists()
