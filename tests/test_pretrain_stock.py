"""pretrain --mlp-impl stock: a host model trained with its own MLPs and experts (transformers'
experts in --experts-implementation), the baseline our impls are measured against on the same
model; and the packaged HF twins of the MoE pretrain configs (--model hf:tiny_moe, hf:moe_1b)."""

from __future__ import annotations

import csv
import json
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from swiglu_train.cli import app
from swiglu_train.integrations.lightning.config import PretrainConfig, load_config
from swiglu_train.integrations.lightning.host_model import (
    HF_CONFIG_DIR,
    build_host_model,
    host_shape,
)
from swiglu_train.integrations.lightning.model import ModelConfig
from swiglu_train.integrations.lightning.pretrain import run_pretrain

transformers = pytest.importorskip("transformers")
runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]
SHORT = ["--max-steps", "2", "--micro-batch-size", "2"]
EXPERTS_KEY = "model.host.model.layers.0.mlp.experts.gate_up_proj"

pytestmark = pytest.mark.usefixtures("offline_wandb_torch_math")


def aux_losses(out: Path) -> list[float]:
    with next(out.glob("csv/version_*/metrics.csv")).open(newline="") as f:
        return [float(r["train/aux_loss"]) for r in csv.DictReader(f) if r.get("train/aux_loss")]


def test_stock_trains_an_hf_moe_model_with_its_own_experts_and_aux_loss(tmp_path, caplog):
    out, summary = tmp_path / "run", tmp_path / "summary.json"
    result = runner.invoke(app, [
        "pretrain", "--config", "tiny_moe", "--model", "hf:tiny_moe", "--mlp-impl", "stock",
        *SHORT, "--output-dir", str(out), "--summary-json", str(summary),
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    run = json.loads(summary.read_text())
    assert (run["mlp_impl"], run["experts_implementation"]) == ("stock", "grouped_mm")
    assert (run["num_experts"], run["saved_fp8"], run["steps"]) == (4, False, 2)
    assert "pretrain summary (stock, grouped_mm)" in result.output
    assert "routed experts: stock: transformers' own, experts_implementation grouped_mm" in (
        caplog.text
    )
    aux = aux_losses(out)  # transformers' own load-balancing loss, in the objective
    assert len(aux) == 2 and all(1.0 < a < 4.0 for a in aux)  # k=2 when balanced, at most E
    assert run["saved_MiB"] > 0 and Path(run["memory_csv"]).is_file()  # the profiler's blocks
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["swiglu_train"]["mlp_impl"] == "stock"
    assert ckpt["state_dict"][EXPERTS_KEY].shape == (4, 256, 64)  # HF's own keys and layout
    hf_dir = tmp_path / "hf"
    exported = runner.invoke(app, ["export-hf", str(out / "checkpoints" / "last.ckpt"),
                                   str(hf_dir)])  # fmt: skip
    assert exported.exit_code == 0, exported.output
    hf = transformers.MixtralForCausalLM.from_pretrained(hf_dir)
    assert torch.equal(hf.model.layers[0].mlp.experts.gate_up_proj, ckpt["state_dict"][EXPERTS_KEY])


def test_an_experts_implementation_is_the_one_transformers_runs(tmp_path):
    model = build_host_model("hf:tiny_moe", "stock", None, None, experts_implementation="eager")
    assert model.experts_implementation == "eager" and model.routed
    assert build_host_model("hf:tiny_moe", "drop_h", None, None).experts_implementation is None


def test_patched_drop_h_starts_from_stock_s_loss_with_hf_s_weights(tmp_path):
    """Patching adopts HF's gate_up_proj/down_proj as fc1/fc2, unchanged: seeded alike, the
    patched model is the stock one, so its first loss (before any update) is stock's, and so
    are its logits and its load-balancing loss on any tokens."""
    runs = {}
    for impl in ("stock", "drop_h"):
        cfg = PretrainConfig(model=ModelConfig(source="hf:tiny_moe", mlp_impl=impl))
        cfg.data.seq_length, cfg.data.micro_batch_size = 32, 2
        cfg.train.max_steps, cfg.train.val_check_interval = 2, 2
        cfg.output_dir = str(tmp_path / impl)
        runs[impl] = run_pretrain(cfg)
    stock, ours = runs["stock"], runs["drop_h"]
    assert ours["mlp_impl"] == "drop_h" and ours["experts_implementation"] is None
    assert ours["initial_loss"] == pytest.approx(stock["initial_loss"], rel=1e-5)
    assert ours["final_loss"] == pytest.approx(stock["final_loss"], rel=1e-3)  # same updates
    models = {}
    for impl in ("stock", "drop_h"):
        torch.manual_seed(0)
        models[impl] = build_host_model("hf:tiny_moe", impl, None, None)
    tokens = torch.randint(0, 320, (2, 24))
    (logits, aux), (ref, ref_aux) = (models[i](tokens, with_aux_loss=True) for i in models)
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aux, ref_aux)
    assert aux is not None and logits.std() > 0


def test_stock_trains_a_dense_host_with_no_experts_implementation(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    config.save_pretrained(tmp_path / "llama")
    cfg = PretrainConfig(model=ModelConfig(source=f"hf:{tmp_path / 'llama'}", mlp_impl="stock",
                                           checkpoint_layers=1))  # fmt: skip
    cfg.data.seq_length, cfg.data.micro_batch_size = 32, 2
    cfg.train.max_steps, cfg.train.val_check_interval = 2, 2
    cfg.output_dir = str(tmp_path / "run")
    run = run_pretrain(cfg)
    assert (run["mlp_impl"], run["experts_implementation"]) == ("stock", None)
    assert run["final_loss"] < run["initial_loss"] and run["saved_MiB"] > 0
    assert not aux_losses(tmp_path / "run")  # a dense model has no load-balancing loss


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--config", "tiny_moe", "--mlp-impl", "stock"],
         "model.mlp_impl 'stock' (--mlp-impl stock) keeps a --model hf:/litgpt: host's own MLPs"),
        (["--model", "hf:tiny_moe", "--mlp-impl", "drop_h", "--experts-implementation", "eager"],
         "picks transformers' own experts, which only --mlp-impl stock keeps; --mlp-impl drop_h "
         "replaces them"),
        (["--model", "hf:tiny_moe", "--mlp-impl", "stock", "--experts-implementation", "fast_mm"],
         "model.experts_implementation='fast_mm' (--experts-implementation) is not one of "
         "transformers': eager, grouped_mm, batched_mm"),
        (["--model", "litgpt:pythia-14m", "--mlp-impl", "stock", "--experts-implementation",
          "eager"], "applies to a transformers MoE model"),
        (["--model", "hf:tiny_moe", "--mlp-impl", "stock", "--saved-fp8"],
         "model.saved_fp8 (--saved-fp8) is an option of our impls"),
        (["--model", "hf:tiny_moe", "--mlp-impl", "stock", "--activation-checkpointing", "auto",
          "--memory-budget-gb", "1"], "--activation-checkpointing auto picks among our impls"),
        (["--model", "hf:no_such_model"],
         "nor a packaged HF config of that name (packaged: moe_1b, tiny_moe)"),
    ],
)  # fmt: skip
def test_cli_refuses_what_stock_cannot_do_in_one_line(tmp_path, monkeypatch, capsys, args,
                                                      message):  # fmt: skip
    """Through the console-script entry point, which prints input errors in one line."""
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # Typer installs its own
    monkeypatch.delenv("SWIGLU_TRAIN_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_:
        app(args=["pretrain", *args, "--output-dir", str(tmp_path / "run")],
            prog_name="swiglu-train")  # fmt: skip
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert message in " ".join(err.split()) and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # refused before any output


def test_a_dense_hf_model_refuses_an_experts_implementation(tmp_path):
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4)  # fmt: skip
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"applies to a transformers MoE model .* has none"):
        ModelConfig(source=f"hf:{tmp_path}", mlp_impl="stock", experts_implementation="eager")


@pytest.mark.parametrize("name", ["tiny_moe", "moe_1b"])
def test_the_packaged_hf_configs_are_the_moe_pretrain_configs_as_mixtral(name):
    """Each is what export-hf writes for that pretrain config (hf.hf_config), in fp32 as the
    recipe's own weights are, and ships as package data."""
    from swiglu_train.integrations.lightning.hf import hf_config

    ours = load_config(name).model
    twin = json.loads(hf_config(ours, torch.float32).to_json_string(use_diff=True))
    twin.pop("transformers_version")
    assert json.loads((HF_CONFIG_DIR / f"{name}.json").read_text()) == twin
    shape = host_shape(f"hf:{name}")
    assert (shape.vocab_size, shape.hidden_size, shape.ffn_hidden_size, shape.num_layers,
            shape.num_heads, shape.max_seq_length, shape.num_experts, shape.moe_top_k) == (
        ours.vocab_size, ours.hidden_size, ours.ffn_hidden_size, ours.num_layers,
        ours.num_heads, ours.max_seq_length, ours.num_experts, ours.moe_top_k)  # fmt: skip
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = globs["package-data"]["swiglu_train.integrations.lightning"]
    base = ROOT / "swiglu_train/integrations/lightning"
    assert any(HF_CONFIG_DIR / f"{name}.json" in base.glob(p) for p in patterns)
