"""The pretrain decoder <-> a Hugging Face LlamaForCausalLM directory, with real transformers on
CPU at a tiny size: the same logits both ways, every impl's fc1 layout, and what HF Llama can
be that our decoder cannot, refused by name."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import lightning
import pytest
import torch
from typer.testing import CliRunner

from swiglu_train.cli import app
from swiglu_train.files import atomic_directory
from swiglu_train.integrations.lightning.data import PackedTextData, StepSampler
from swiglu_train.integrations.lightning.model import ModelConfig
from swiglu_train.integrations.lightning.module import OptimConfig, PretrainModule
from swiglu_train.integrations.lightning.pretrain import run_pretrain
from swiglu_train.layers.layout import packed_order
from swiglu_train.packing import convert_checkpoint

transformers = pytest.importorskip("transformers")  # the hf extra; the GPU box lacks it
from swiglu_train.integrations.lightning.hf import export_hf, import_hf  # noqa: E402

runner = CliRunner()
SHAPE = {"hidden_size": 64, "ffn_hidden_size": 160, "num_heads": 4, "num_layers": 2,
         "max_seq_length": 32}  # fmt: skip


pytestmark = pytest.mark.usefixtures("offline_wandb_torch_math")


def random_module(impl: str, chunk: int | None = None) -> PretrainModule:
    """Our decoder with weights far from their init (norm weights too), so logits are large and
    every weight moves them."""
    cfg = ModelConfig(**SHAPE, mlp_impl=impl, mlp_chunk=chunk, rope_theta=5000.0, norm_eps=1e-6)
    module = PretrainModule(cfg, OptimConfig(), max_steps=10)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * 0.2)
    return module.eval()


def checkpoint(module: PretrainModule) -> dict:
    """What Lightning saves of the module (weights, init args, our layout record)."""
    ckpt = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams),
            "pytorch-lightning_version": lightning.__version__}  # fmt: skip
    module.on_save_checkpoint(ckpt)
    return ckpt


def logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens)
    return out if isinstance(out, torch.Tensor) else out.logits


TOKENS = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(("impl", "chunk"), [("drop_h", None), ("save_factors", 16)])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, impl, chunk):
    module = random_module(impl, chunk)
    config = export_hf(checkpoint(module), tmp_path / "hf", "ckpt")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors"]  # fmt: skip
    assert not list(tmp_path.glob(".hf.*"))  # the temporary directory was renamed, not left
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert all(written[k] == config[k] for k in ("vocab_size", "hidden_size", "dtype"))
    assert written["architectures"] == ["LlamaForCausalLM"]
    assert written["rope_parameters"] == {"rope_type": "default", "rope_theta": 5000.0}
    assert (written["rms_norm_eps"], written["num_key_value_heads"]) == (1e-6, 4)
    assert (written["tie_word_embeddings"], written["eos_token_id"]) == (False, 256)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    # fc1 as gate_proj/up_proj: a packed fc1 is unpacked by the layout it records
    fc1 = module.model.layers[1].mlp.fc1.weight.detach()
    if chunk is not None:
        canonical = torch.empty_like(fc1)
        canonical[packed_order(fc1.shape[0], chunk)] = fc1
        fc1 = canonical
    assert torch.equal(hf.model.layers[1].mlp.gate_proj.weight, fc1[:160])
    assert torch.equal(hf.model.layers[1].mlp.up_proj.weight, fc1[160:])
    ours = logits(module.model, TOKENS)
    assert ours.abs().max() > 5  # far from uniform: a mapped weight wrong would show
    torch.testing.assert_close(logits(hf, TOKENS), ours, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("tied", [False, True])
def test_import_gives_our_decoder_the_same_logits(tmp_path, tied):
    """An HF Llama (its own init, tied or not) imported, loaded by Lightning's own
    load_from_checkpoint into a save_factors model (fc1 packed on load): the same logits."""
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=32, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        initializer_range=0.2, tie_word_embeddings=tied,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    ckpt, notes = import_hf(tmp_path / "hf")
    assert bool(notes) == tied and (not tied or "tie_word_embeddings" in notes[0])
    torch.save(ckpt, tmp_path / "ours.ckpt")
    model = ckpt["hyper_parameters"]["model"]
    assert model["rope_theta"] == 500000.0 and model["norm_eps"] == 1e-6
    ours = PretrainModule.load_from_checkpoint(
        tmp_path / "ours.ckpt", model={**model, "mlp_impl": "save_factors", "mlp_chunk": 16}
    ).eval()
    assert ours.model.layers[0].mlp.fc1_layout.packed
    want = logits(hf, TOKENS[:, :24] % 300)
    assert want.abs().max() > 5
    torch.testing.assert_close(logits(ours.model, TOKENS[:, :24] % 300), want, rtol=1e-5,
                               atol=1e-4)  # fmt: skip
    head, embed = ours.model.head.weight, ours.model.embed.weight
    assert torch.equal(head, embed) == tied and head.data_ptr() != embed.data_ptr()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_key_value_heads": 1}, r"grouped-query attention \(num_key_value_heads 1 < "),
        ({"attention_bias": True}, r"attention biases"),
        ({"mlp_bias": True}, r"MLP biases"),
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu' \(SwiGLU needs silu\)"),
        ({"head_dim": 16}, r"head_dim 16 x 2 heads != hidden_size 64"),
        ({"attention_dropout": 0.1}, r"attention_dropout 0\.1"),
        ({"max_position_embeddings": 16384, "rope_parameters": {
            "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
         r"RoPE scaling 'llama3'"),
    ],
)  # fmt: skip
def test_an_hf_llama_our_decoder_cannot_compute_is_refused_by_name(tmp_path, kwargs, message):
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=2, **kwargs)  # fmt: skip
    config.save_pretrained(tmp_path / "hf")  # the config is refused before any weight is read
    with pytest.raises(ValueError, match=rf"cannot be our decoder exactly: .*{message}"):
        import_hf(tmp_path / "hf")


def test_another_architecture_or_no_model_is_refused(tmp_path):
    transformers.MistralConfig(hidden_size=64, num_attention_heads=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"holds a 'mistral' model; import-hf takes Llama"):
        import_hf(tmp_path)
    (tmp_path / "empty").mkdir()
    result = runner.invoke(app, ["import-hf", str(tmp_path / "empty"), str(tmp_path / "o.ckpt")])
    assert result.exit_code != 0 and "is not a Hugging Face model directory" in result.output
    assert not (tmp_path / "o.ckpt").exists()


def test_export_refuses_what_is_not_a_whole_pretrain_model(tmp_path):
    module = random_module("drop_h")
    with pytest.raises(ValueError, match=r"bare is not a pretrain checkpoint"):
        export_hf(module.state_dict(), tmp_path / "hf", "bare")
    torch.save(module.state_dict(), tmp_path / "bare.pt")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("kept")
    torch.save(checkpoint(module), tmp_path / "m.ckpt")
    for args, message in (
        (["bare.pt", "hf"], "bare.pt is not a pretrain checkpoint"),
        (["m.ckpt", "full"], "full exists and is not an empty directory"),
    ):
        result = runner.invoke(app, ["export-hf", *(str(tmp_path / a) for a in args)])
        assert result.exit_code != 0 and message in result.output, result.output
    assert not (tmp_path / "hf").exists() and (tmp_path / "full" / "x").read_text() == "kept"


def test_a_failed_directory_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError), atomic_directory(tmp_path / "out") as tmp:
        (tmp / "half.bin").write_bytes(b"x")
        raise RuntimeError("killed mid-write")
    assert list(tmp_path.iterdir()) == []


def test_cli_round_trip_and_a_run_started_from_the_imported_weights(tmp_path, caplog):
    """pretrain (save_factors) -> export-hf -> import-hf gives back the same weights (fc1
    canonical); `pretrain --init-from` starts a new run from them, in their shape, whose first
    loss is the imported model's on the first batch; --resume on them is refused, naming
    --init-from."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for module in (shutil, textwrap):
        (corpus / Path(module.__file__).name).write_bytes(Path(module.__file__).read_bytes())
    (tmp_path / "c.yaml").write_text(textwrap.dedent(f"""\
        model: {{hidden_size: 64, ffn_hidden_size: 160, num_heads: 2, mlp_impl: save_factors}}
        data: {{data: ['{corpus}/*.py'], seq_length: 32, micro_batch_size: 2, val_fraction: 0.0}}
        train: {{max_steps: 2, checkpoint_every: 2}}
        """))  # fmt: skip
    base = ["pretrain", "--config", str(tmp_path / "c.yaml")]
    assert runner.invoke(app, [*base, "--output-dir", str(tmp_path / "a")]).exit_code == 0
    last = tmp_path / "a" / "checkpoints" / "last.ckpt"
    result = runner.invoke(app, ["export-hf", str(last), str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    assert "LlamaForCausalLM.from_pretrained" in result.output
    result = runner.invoke(app, ["import-hf", str(tmp_path / "hf"), str(tmp_path / "in.ckpt")])
    assert result.exit_code == 0, result.output
    assert f"pretrain --init-from {tmp_path / 'in.ckpt'}" in result.output
    canonical = convert_checkpoint(torch.load(last, weights_only=False), to="canonical")
    imported = torch.load(tmp_path / "in.ckpt", weights_only=True)["state_dict"]
    assert imported.keys() == canonical["state_dict"].keys()
    for key, value in canonical["state_dict"].items():
        assert torch.equal(imported[key], value), key
    trained = PretrainModule.load_from_checkpoint(tmp_path / "in.ckpt")  # drop_h

    # A new run from them, with the tiny config's model shape replaced by theirs
    (tmp_path / "tiny.yaml").write_text(
        f"data: {{data: ['{corpus}/*.py'], seq_length: 32, micro_batch_size: 2, "
        "val_fraction: 0.0}\ntrain: {max_steps: 2, checkpoint_every: 2}\n"
    )
    from swiglu_train.integrations.lightning.config import load_config

    cfg = load_config(str(tmp_path / "tiny.yaml"))
    cfg.output_dir = str(tmp_path / "b")
    with caplog.at_level("INFO"):
        summary = run_pretrain(cfg, init_from=str(tmp_path / "in.ckpt"))
    assert "the model takes in.ckpt's shape (hidden_size 192 -> 64, ffn_hidden_size 512 -> " in (
        caplog.text
    )
    assert (cfg.model.hidden_size, cfg.model.num_heads, cfg.model.mlp_impl) == (64, 2, "drop_h")
    assert summary["steps"] == 2
    data = PackedTextData(cfg.data, cfg.model.vocab_size)
    data.setup("fit")
    first = next(iter(StepSampler(len(data.train_rows), 2, cfg.data.seed)))
    with torch.no_grad():
        expected = trained.loss(data.train_rows[first].long())
    assert summary["initial_loss"] == pytest.approx(float(expected), rel=1e-6)

    with pytest.raises(ValueError, match=r"holds weights only .*start a new run from them with "
                                         r"--init-from"):  # fmt: skip
        run_pretrain(cfg, resume=str(tmp_path / "in.ckpt"))
    with pytest.raises(ValueError, match=r"--resume continues a run and --init-from starts"):
        run_pretrain(cfg, resume="last", init_from=str(tmp_path / "in.ckpt"))
