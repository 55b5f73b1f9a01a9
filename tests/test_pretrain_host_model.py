"""pretrain --model hf:PATH / litgpt:NAME: a Hugging Face or LitGPT architecture trained by the
same recipe (data, checkpoints, W&B offline, memory profiler), its MLPs patched to --mlp-impl."""

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from swiglu_train.cli import app
from swiglu_train.integrations.lightning.config import PretrainConfig
from swiglu_train.integrations.lightning.model import ModelConfig
from swiglu_train.integrations.lightning.pretrain import run_pretrain

transformers = pytest.importorskip("transformers")
runner = CliRunner()
HF_KEY = "model.host.model.layers.0.mlp.{}.weight"  # PretrainModule.model.host is the HF model


pytestmark = pytest.mark.usefixtures("offline_wandb_torch_math")


@pytest.fixture
def hf_config_json(tmp_path) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    config.save_pretrained(tmp_path / "llama")
    return tmp_path / "llama" / "config.json"


def host_config(tmp_path: Path, source: str, impl: str, steps: int = 2) -> PretrainConfig:
    cfg = PretrainConfig(model=ModelConfig(source=source, mlp_impl=impl))
    cfg.data.seq_length, cfg.data.micro_batch_size = 32, 2
    cfg.train.max_steps, cfg.train.val_check_interval, cfg.train.checkpoint_every = steps, 2, 2
    cfg.output_dir = str(tmp_path / "run")
    return cfg


def test_hf_model_trains_checkpoints_in_its_own_keys_and_resumes(tmp_path, hf_config_json):
    cfg = host_config(tmp_path, f"hf:{hf_config_json}", "save_factors")
    assert (cfg.model.hidden_size, cfg.model.ffn_hidden_size, cfg.model.num_layers) == (32, 64, 2)
    summary = run_pretrain(cfg)
    assert summary["mlp_impl"] == "save_factors" and summary["steps"] == 2
    assert summary["final_loss"] < summary["initial_loss"]
    assert summary["saved_MiB"] > 0 and Path(summary["memory_csv"]).is_file()
    header = Path(summary["memory_csv"]).read_text().splitlines()[0]
    assert "memory/impl/save_factors/saved_MiB" in header  # the profiler sees the patched MLPs
    ckpt = torch.load(Path(cfg.output_dir) / "checkpoints" / "last.ckpt", weights_only=False)
    state = ckpt["state_dict"]
    assert {HF_KEY.format(n) for n in ("gate_proj", "up_proj", "down_proj")} <= set(state)
    assert not any(".fc1." in key or "_extra_state" in key for key in state)
    assert ckpt["swiglu_train"]["fc1_layout"]["kind"] == "packed"  # optimizer state's layout

    longer = host_config(tmp_path, f"hf:{hf_config_json}", "save_factors", steps=3)
    resumed = run_pretrain(longer, resume="last")  # the host's keys load into the packed fc1
    assert resumed["steps"] == 3


def test_the_planner_checkpoints_a_host_model_s_blocks_to_fit_the_budget(tmp_path, hf_config_json):
    """--activation-checkpointing auto on an HF host: the CPU peak is an estimate, the same at
    every step, so a budget between drop_h's peaks with both blocks checkpointed and with none
    makes the planner checkpoint blocks of the host's own, and the run trains so."""
    from swiglu_train.integrations.lightning.planner import Steps, measurer

    cfg = host_config(tmp_path, f"hf:{hf_config_json}", "drop_h")
    measure = measurer(cfg, Steps(warmup=0, measured=1))
    none, every = measure("drop_h", 0).peak_MiB, measure("drop_h", 2).peak_MiB
    assert every < none
    cfg.train.activation_checkpointing, cfg.train.plan_impls = "auto", ["drop_h"]
    cfg.train.memory_budget_gb = (none + every) / 2 / 1024
    summary = run_pretrain(cfg)
    plan = summary["plan"]
    assert plan["impl"] == "drop_h" and 1 <= plan["checkpoint_layers"] <= 2
    assert plan["peak_MiB"] <= plan["budget_MiB"]
    assert summary["checkpoint_layers"] == plan["checkpoint_layers"]
    n = plan["checkpoint_layers"]
    chosen = next(p for p in plan["profiles"] if p["checkpoint_layers"] == n)
    assert summary["saved_MiB"] == pytest.approx(chosen["after_forward_MiB"], rel=1e-12)  # as run
    assert summary["final_loss"] < summary["initial_loss"]


def test_cli_trains_a_litgpt_config(tmp_path):
    config = tmp_path / "model_config.yaml"
    config.write_text(yaml.safe_dump({
        "block_size": 128, "vocab_size": 320, "padded_vocab_size": 320, "n_layer": 2,
        "n_head": 4, "n_query_groups": 2, "n_embd": 32, "intermediate_size": 64,
        "bias": False, "norm_class_name": "RMSNorm", "mlp_class_name": "LLaMAMLP",
    }))  # fmt: skip
    out = tmp_path / "run"
    args = ["pretrain", "--model", f"litgpt:{config}", "--mlp-impl", "drop_h", "--max-steps",
            "1", "--output-dir", str(out), "--summary-json", str(out / "s.json")]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "s.json").read_text())["mlp_impl"] == "drop_h"
    state = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    assert "model.host.transformer.h.1.mlp.fc_2.weight" in state


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("gpt:tiny", "use hf:PATH/config.json or litgpt:NAME"),
        ("hf:/no/such/config.json", "no config.json at /no/such/config.json"),
        ("litgpt:no-such-model", "no-such-model"),
        ("litgpt:pythia-14m", "--mlp-impl drop_h would not apply to every MLP"),
    ],
)
def test_cli_refuses_a_model_it_cannot_train_in_one_line(tmp_path, monkeypatch, capsys, model,
                                                         message):  # fmt: skip
    """Through the console-script entry point, which prints input errors in one line."""
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # Typer installs its own
    monkeypatch.delenv("SWIGLU_TRAIN_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_:
        app(args=["pretrain", "--model", model, "--output-dir", str(tmp_path / "run")],
            prog_name="swiglu-train")  # fmt: skip
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert message in " ".join(err.split()) and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # refused before any output
