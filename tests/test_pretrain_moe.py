"""`swiglu-train pretrain` on MoE models, on CPU: the packaged tiny_moe through the CLI, and an
HF MoE config.json through --model hf:, each trained a few steps with its load-balancing loss
logged, the experts' impl and saved_fp8 as asked, and the profiler's experts columns."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from swiglu_train.cli import app
from swiglu_train.integrations.lightning.config import PretrainConfig
from swiglu_train.integrations.lightning.host_model import host_shape
from swiglu_train.integrations.lightning.model import ModelConfig
from swiglu_train.integrations.lightning.moe import experts_impl
from swiglu_train.integrations.lightning.pretrain import run_pretrain

transformers = pytest.importorskip("transformers")
runner = CliRunner()
SHORT = ["--max-steps", "2", "--micro-batch-size", "2"]


pytestmark = pytest.mark.usefixtures("offline_wandb_torch_math")


def metrics(out: Path) -> list[dict[str, str]]:
    with next(out.glob("csv/version_*/metrics.csv")).open(newline="") as f:
        return list(csv.DictReader(f))


def test_tiny_moe_trains_its_experts_as_asked_and_logs_the_load_balancing_loss(tmp_path, caplog):
    out, summary = tmp_path / "run", tmp_path / "summary.json"
    result = runner.invoke(app, [
        "pretrain", "--config", "tiny_moe", *SHORT, "--mlp-impl", "save_factors", "--saved-fp8",
        "--output-dir", str(out), "--summary-json", str(summary),
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    run = json.loads(summary.read_text())
    assert (run["mlp_impl"], run["saved_fp8"], run["num_experts"]) == ("drop_h", True, 4)
    assert "routed experts: save_factors has no routed-experts form, so drop_h" in caplog.text
    header = Path(run["memory_csv"]).read_text().splitlines()[0]
    assert "memory/impl/experts/drop_h+fp8/saved_MiB" in header
    aux = [float(r["train/aux_loss"]) for r in metrics(out) if r.get("train/aux_loss")]
    assert len(aux) == 2 and all(1.0 < a < 4.0 for a in aux)  # k=2 when balanced, at most E
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)
    record = ckpt["swiglu_train"]
    assert record["fc1_layout"]["kind"] == "canonical" and record["mlp_impl"] == "drop_h"
    assert ckpt["state_dict"]["model.layers.1.mlp.experts.fc1_weight"].shape == (4, 256, 64)


def test_an_fc1_chunk_is_refused_for_routed_experts_in_one_line(tmp_path):
    result = runner.invoke(app, [
        "pretrain", "--config", "tiny_moe", "--mlp-impl", "save_factors", "--mlp-chunk", "16",
        "--output-dir", str(tmp_path / "run"),
    ])  # fmt: skip
    assert isinstance(result.exception, ValueError)  # the CLI prints it in one line, exit 2
    assert "4 routed experts, whose fc1 every impl keeps canonical" in str(result.exception)
    assert not (tmp_path / "run").exists()


@pytest.fixture
def mixtral_json(tmp_path) -> Path:
    config = transformers.MixtralConfig(
        vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    config.save_pretrained(tmp_path / "mixtral")
    return tmp_path / "mixtral" / "config.json"


def test_an_hf_moe_config_trains_patched_with_saved_fp8_reaching_its_experts(
    tmp_path, mixtral_json
):
    cfg = PretrainConfig(model=ModelConfig(source=f"hf:{mixtral_json}", saved_fp8=True,
                                           checkpoint_layers=1))  # fmt: skip
    assert (cfg.model.ffn_hidden_size, cfg.model.num_experts, cfg.model.moe_top_k) == (48, 4, 2)
    cfg.data.seq_length, cfg.data.micro_batch_size = 32, 2
    cfg.train.max_steps, cfg.train.val_check_interval, cfg.train.checkpoint_every = 2, 2, 2
    cfg.output_dir = str(tmp_path / "run")
    run = run_pretrain(cfg)
    assert (run["mlp_impl"], run["saved_fp8"], run["steps"]) == ("drop_h", True, 2)
    header = Path(run["memory_csv"]).read_text().splitlines()[0]
    assert "memory/impl/experts/drop_h+fp8/saved_MiB" in header
    aux = [float(r["train/aux_loss"]) for r in metrics(tmp_path / "run") if r.get("train/aux_loss")]
    assert len(aux) == 2 and all(a > 0 for a in aux)  # transformers' own aux_loss, in the objective
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    keys = state["state_dict"]
    assert "model.host.model.layers.0.mlp.experts.gate_up_proj" in keys  # the host's own keys
    assert not any("fc1_weight" in k for k in keys)


def test_an_hf_moe_config_s_sizes_are_its_experts(tmp_path):
    config = transformers.Qwen3MoeConfig(
        vocab_size=320, hidden_size=32, intermediate_size=96, moe_intermediate_size=24,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
        num_experts_per_tok=2,
    )  # fmt: skip
    config.save_pretrained(tmp_path / "qwen3")
    shape = host_shape(f"hf:{tmp_path / 'qwen3' / 'config.json'}")
    assert (shape.ffn_hidden_size, shape.num_experts, shape.moe_top_k) == (24, 8, 2)


@pytest.mark.parametrize(
    ("mlp_impl", "chosen", "why"),
    [
        ("drop_h_quack", "drop_h_quack", None),
        ("save_factors_quack", "drop_h_quack", "save_factors_quack has no routed-experts form"),
        ("auto", "drop_h", "drop_h: drop_h_quack cannot run here (no CUDA GPU)"),
    ],
)
def test_each_mlp_impl_names_an_experts_impl_and_says_why_when_another(mlp_impl, chosen, why):
    got, reason = experts_impl(mlp_impl, 64, 32)
    assert got == chosen
    if why is None:
        assert reason is None
    elif mlp_impl == "auto":  # ParExperts' own auto, on this machine's device
        assert reason == why
    else:
        assert why in reason
        assert reason.endswith(f", so {chosen}; experts_impl= names one")
