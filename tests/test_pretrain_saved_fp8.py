"""saved_fp8 through `swiglu-train pretrain`: the YAML key model.saved_fp8 and --saved-fp8."""

import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from swiglu_train.cli import app
from swiglu_train.integrations.lightning.config import load_config
from swiglu_train.integrations.lightning.model import ModelConfig
from swiglu_train.integrations.lightning.module import OptimConfig, PretrainModule
from swiglu_train.integrations.lightning.pretrain import run_pretrain
from swiglu_train.layers import ParMLP

runner = CliRunner()
SMALL = (
    "model: {hidden_size: 64, ffn_hidden_size: 160, num_heads: 2, saved_fp8: SAVED}\n"
    "data: {seq_length: 64, micro_batch_size: 4, val_fraction: 0.0}\n"
    "train: {max_steps: 2, checkpoint_every: 2}\n"
)


pytestmark = pytest.mark.usefixtures("offline_wandb_torch_math")


def small_yaml(tmp_path: Path, saved: str) -> Path:
    path = tmp_path / f"{saved}.yaml"
    path.write_text(SMALL.replace("SAVED", saved))
    return path


def test_the_yaml_key_is_read_and_checked(tmp_path):
    assert load_config(str(small_yaml(tmp_path, "true"))).model.saved_fp8 is True
    assert load_config(None).model.saved_fp8 is False
    with pytest.raises(ValueError, match="saved_fp8 must be bool, got 1"):  # YAML's yes is true
        load_config(str(small_yaml(tmp_path, "1")))
    with pytest.raises(ValueError) as e:
        ModelConfig(mlp_impl="save_factors", saved_fp8=True)
    assert str(e.value) == (
        "model.saved_fp8 (--saved-fp8): saved_fp8=True is for impls 'drop_h' and "
        "'drop_h_quack' only, not 'save_factors': it is not implemented for the saved SwiGLU "
        "factors: they survive FP8 as well as the preactivation does (docs/fp8.md), but h "
        "stays bf16 beside them, so x + h + FP8 factors would hold what bf16 drop_h holds (4 "
        "bytes per M·F element), twice drop_h's with saved_fp8 (2)"
    )


def test_the_flag_is_refused_with_another_impl_before_the_run(tmp_path):
    out = tmp_path / "run"
    args = ["pretrain", "--saved-fp8", "--mlp-impl", "normal", "--output-dir", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code != 0
    assert "not 'normal': it saves h (fc2's input)" in str(result.exception)
    assert not out.exists()


def test_a_run_with_the_flag_resumes_without_it(tmp_path):
    """--saved-fp8 builds every ParMLP with it and the checkpoint records it; the same
    checkpoint resumes in a model without it (weights and optimizer state are the same)."""
    data = Path(json.__file__)  # a small text that no one edits while the test runs
    args = ["pretrain", "--config", small_yaml(tmp_path, "false"), "--saved-fp8"]
    args += ["--data", data, "--output-dir", tmp_path / "run"]
    result = runner.invoke(app, list(map(str, args)))
    assert result.exit_code == 0, result.output
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=False)["hyper_parameters"]["model"]["saved_fp8"]
    module = PretrainModule.load_from_checkpoint(last, map_location="cpu")
    assert all(layer.mlp.saved_fp8 for layer in module.model.layers)

    cfg = load_config(str(small_yaml(tmp_path, "false")))
    cfg.data.data, cfg.train.max_steps = [str(data)], 3
    cfg.output_dir = str(tmp_path / "run")
    summary = run_pretrain(cfg, resume="last")
    assert summary["steps"] == 3 and math.isfinite(summary["final_loss"])


def test_a_host_model_s_patched_mlps_get_it(tmp_path):
    """--model hf:PATH: the MLPs patch puts in the host model save their preactivation in FP8."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    config.save_pretrained(tmp_path / "llama")
    model = ModelConfig(source=f"hf:{tmp_path / 'llama' / 'config.json'}", saved_fp8=True)
    mlps = [m for m in PretrainModule(model, OptimConfig(), 2).modules() if isinstance(m, ParMLP)]
    assert len(mlps) == 2 and all(m.saved_fp8 for m in mlps)
