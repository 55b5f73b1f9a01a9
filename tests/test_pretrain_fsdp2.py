"""pretrain --strategy fsdp2 on CPU (gloo): two ranks through the CLI against one process at the
same global batch, a resume of their sharded checkpoint at another world size, and what reads
one (consolidate, export-hf, convert) or refuses it."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from swiglu_train.cli import app
from swiglu_train.integrations.lightning.config import PretrainConfig, load_config
from swiglu_train.integrations.lightning.fsdp2 import device_count, mixed_precision, shard
from swiglu_train.integrations.lightning.model import LlamaDecoder, ModelConfig
from swiglu_train.integrations.lightning.pretrain import run_pretrain
from swiglu_train.integrations.lightning.sharded_checkpoint import TRUST, consolidate
from swiglu_train.ops import use_backend

runner = CliRunner()
STEPS, EVERY = 4, 2  # a sharded checkpoint at step 2 to resume from, and the last at step 4
# The smallest model the recipe trains; validation at the last step, so that the final save
# follows an eval forward (after which FSDP2's root keeps its parameters unsharded).
CONFIG = f"""\
model: {{hidden_size: 64, ffn_hidden_size: 160, num_heads: 2}}
data: {{seq_length: 32, val_fraction: 0.34}}
train: {{max_steps: {STEPS}, checkpoint_every: {EVERY}, val_check_interval: {STEPS}}}
optim: {{warmup_steps: 2}}
"""
# The same with 4 routed experts of F = 64 per block, top-2: FSDP2 shards each [E, 2F, D]
# expert weight as any other. No load-balancing loss, which each rank takes over its own
# tokens: with it, two ranks of 2 sequences are not one process of 4.
MOE_CONFIG = CONFIG.replace(
    "ffn_hidden_size: 160, num_heads: 2}",
    "ffn_hidden_size: 64, num_heads: 2, num_experts: 4, moe_top_k: 2, moe_aux_loss_coef: 0.0}",
)


pytestmark = pytest.mark.usefixtures("offline_wandb_torch_math")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Three standard-library modules as text: one held out for validation."""
    import json as json_module
    import textwrap

    root = tmp_path_factory.mktemp("corpus")
    for module in (json_module, shutil, textwrap):
        (root / Path(module.__file__).name).write_bytes(Path(module.__file__).read_bytes())
    return root


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("config") / "small.yaml"
    path.write_text(CONFIG)
    return path


@pytest.fixture(scope="module")
def moe_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("config") / "small_moe.yaml"
    path.write_text(MOE_CONFIG)
    return path


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, config, moe_config, corpus):
    """(impl, micro-batch, moe) -> the summary of the reference: one process, no sharding, its
    first block checkpointed; each runs once per module."""
    runs: dict[tuple[str, int, bool], dict] = {}

    def run(impl: str, micro: int, moe: bool = False) -> dict:
        if (impl, micro, moe) not in runs:
            cfg = load_config(str(moe_config if moe else config))
            cfg.model.mlp_impl, cfg.model.checkpoint_layers = impl, 1
            cfg.data.data, cfg.data.micro_batch_size = [str(corpus / "*.py")], micro
            cfg.output_dir = str(tmp_path_factory.mktemp(f"one_{impl}_{micro}") / "run")
            runs[impl, micro, moe] = run_pretrain(cfg)
        return runs[impl, micro, moe]

    return run


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, config, moe_config, corpus):
    """(impl, moe) -> (summary, output dir) of a 2-rank fsdp2 CLI run, 2 sequences per rank,
    its first block checkpointed; each runs once per module."""
    runs: dict[tuple[str, bool], tuple[dict, Path]] = {}

    def run(impl: str, moe: bool = False) -> tuple[dict, Path]:
        if (impl, moe) not in runs:
            root = tmp_path_factory.mktemp(f"fsdp2_{impl}")
            out, summary = root / "run", root / "summary.json"
            path = moe_config if moe else config
            args = ["pretrain", "--config", str(path), "--data", str(corpus / "*.py")]
            args += ["--strategy", "fsdp2", "--devices", "2", "--accelerator", "cpu"]
            args += ["--mlp-impl", impl, "--micro-batch-size", "2", "--checkpoint-layers", "1"]
            args += ["--output-dir", str(out), "--summary-json", str(summary)]
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            env.update(WANDB_MODE="offline", WANDB_SILENT="true")
            done = subprocess.run([sys.executable, "-m", "swiglu_train", *args], env=env,
                                  capture_output=True, text=True, timeout=600)  # fmt: skip
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
            assert done.stdout.count("pretrain summary") == 1  # rank 1 prints no table
            runs[impl, moe] = json.loads(summary.read_text()), out
        return runs[impl, moe]

    return run


@pytest.mark.parametrize(("impl", "moe"), [("normal", False), ("drop_h", False), ("drop_h", True)])
@pytest.mark.slow
def test_two_fsdp2_ranks_match_one_process_at_the_same_global_batch(
    two_ranks, one_process, impl, moe
):
    """Each rank's 2 sequences, its parameters sharded over both ranks (fc1 and the experts'
    weights included), give the losses of one unsharded process on all 4, to fp32 summation
    order; and the checkpoints are sharded directories, each written whole."""
    summary, out = two_ranks(impl, moe)
    one = one_process(impl, 4, moe)
    assert summary["num_experts"] == (4 if moe else 0)
    assert summary["mlp_impl"] == impl and summary["steps"] == STEPS
    assert summary["losses"].keys() == one["losses"].keys() == {str(s) for s in range(STEPS)}
    for step, loss in one["losses"].items():
        assert summary["losses"][step] == pytest.approx(loss, rel=1e-5), step
    # Each rank validates the same first val_batches x micro-batch rows, so a run's val set
    # depends on the micro-batch (as under ddp): only that it ran is compared here.
    assert summary["val_loss"] is not None and one["val_loss"] is not None

    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]  # no partial
    last = out / "checkpoints" / "last.ckpt"
    assert sorted(p.name for p in last.iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"
    ]  # fmt: skip


def test_the_memory_profiler_counts_activations_not_gathered_weights(two_ranks, one_process):
    """A rank saves for backward what one process with its micro-batch saves: FSDP2's gathered
    parameters (no parameter at the step's start) were counted as activations."""
    summary, _ = two_ranks("drop_h")
    one = one_process("drop_h", micro=2)
    assert summary["saved_MiB"] == one["saved_MiB"] > 0


def fsdp2_config(config: Path, corpus: Path, out: Path) -> PretrainConfig:
    """One fsdp2 process on the references' global batch (4 sequences)."""
    cfg = load_config(str(config))
    cfg.model.checkpoint_layers, cfg.train.strategy = 1, "fsdp2"
    cfg.data.data, cfg.data.micro_batch_size = [str(corpus / "*.py")], 4
    cfg.output_dir = str(out)
    return cfg


@pytest.fixture
def restored_environ():
    """An fsdp2 run in this process sets Lightning's launcher variables (LOCAL_RANK makes a
    later CLI run take itself for a child rank) and a process group: both undone."""
    saved = dict(os.environ)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


def test_a_sharded_checkpoint_resumes_at_another_world_size(
    two_ranks, config, corpus, tmp_path, restored_environ
):
    """The 2-rank run's step-2 checkpoint, resumed by one fsdp2 process on the same global
    batch (4 sequences): the shards are re-split for one rank and steps 2-3 repeat the
    uninterrupted losses."""
    summary, out = two_ranks("drop_h")
    ckpt = out / "checkpoints" / f"epoch=0-step={EVERY}.ckpt"
    resumed = run_pretrain(fsdp2_config(config, corpus, tmp_path / "resumed"), resume=str(ckpt))
    assert list(resumed["losses"]) == [str(s) for s in range(EVERY, STEPS)]
    for step, loss in resumed["losses"].items():
        assert loss == pytest.approx(summary["losses"][step], rel=1e-5), step


def test_a_one_file_checkpoint_resumes_under_fsdp2(
    one_process, config, corpus, tmp_path, restored_environ
):
    """A single-device run's step-2 .ckpt continues under fsdp2 with its losses: the weights
    load through the model's hooks, and the Adam moments by the parameter names the
    checkpoint records (Lightning's own load numbered them in the model's parameter order,
    not the param groups': qkv's moments went to a norm's, refused there only by shape)."""
    one = one_process("drop_h", micro=4)
    ckpt = Path(one["output_dir"]) / "checkpoints" / f"epoch=0-step={EVERY}.ckpt"
    resumed = run_pretrain(fsdp2_config(config, corpus, tmp_path / "resumed"), resume=str(ckpt))
    assert list(resumed["losses"]) == [str(s) for s in range(EVERY, STEPS)]
    for step, loss in resumed["losses"].items():
        assert loss == pytest.approx(one["losses"][step], rel=1e-6), step


def test_init_from_a_sharded_checkpoint_takes_its_weights(
    two_ranks, one_process, config, corpus, tmp_path
):
    """--init-from reads a sharded checkpoint whole: a run started from the 2-rank run's last
    weights begins at the loss of one started from the reference's, which match to fp32."""
    _, out = two_ranks("drop_h")
    one = one_process("drop_h", micro=4)
    starts = []
    for name, source in (("sharded", out), ("file", Path(one["output_dir"]))):
        cfg = load_config(str(config))
        cfg.data.data, cfg.data.micro_batch_size = [str(corpus / "*.py")], 4
        cfg.train.max_steps, cfg.output_dir = 1, str(tmp_path / name)
        run = run_pretrain(cfg, init_from=str(source / "checkpoints" / "last.ckpt"))
        starts.append(run["initial_loss"])
    assert starts[0] == pytest.approx(starts[1], rel=1e-5)
    assert starts[0] < one["losses"]["0"] - 0.5  # trained weights, not a fresh init


def test_a_patched_hf_model_shards_block_by_block_and_saves_in_its_own_keys(
    corpus, tmp_path, restored_environ
):
    """--model hf:...: the host's decoder layers are the FSDP2 units; its patched, packed
    (save_factors) MLPs train as unsharded, and the sharded checkpoint holds HF's gate/up/down
    keys with the unsharded run's values."""
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    ).save_pretrained(tmp_path / "llama")  # fmt: skip
    source, runs = f"hf:{tmp_path / 'llama' / 'config.json'}", []
    for strategy in ("auto", "fsdp2"):
        cfg = PretrainConfig(model=ModelConfig(source=source, mlp_impl="save_factors"))
        cfg.data.data, cfg.data.seq_length = [str(corpus / "*.py")], 32
        cfg.data.micro_batch_size, cfg.train.max_steps, cfg.train.strategy = 2, 3, strategy
        cfg.output_dir = str(tmp_path / strategy)
        runs.append(run_pretrain(cfg))
    for step, loss in runs[0]["losses"].items():
        assert runs[1]["losses"][step] == pytest.approx(loss, rel=1e-5), step
    reference = torch.load(tmp_path / "auto" / "checkpoints" / "last.ckpt", weights_only=False)
    whole = consolidate(tmp_path / "fsdp2" / "checkpoints" / "last.ckpt", "test")
    mlp = "model.host.model.layers.0.mlp."
    assert {mlp + n for n in ("gate_proj.weight", "up_proj.weight")} <= whole["state_dict"].keys()
    assert whole["state_dict"].keys() == reference["state_dict"].keys()
    for key, value in reference["state_dict"].items():
        torch.testing.assert_close(whole["state_dict"][key], value, rtol=1e-4, atol=1e-6)


def test_consolidate_gives_the_single_device_format(two_ranks, one_process, tmp_path):
    """The sharded last.ckpt read whole is what one process writes after the same steps: the
    same keys, weights and Adam moments to fp32 summation order, optimizer state keyed by
    parameter index; `consolidate` writes it as a file, and refuses to unpickle without
    --trust."""
    _, out = two_ranks("drop_h")
    one = one_process("drop_h", micro=4)
    reference = torch.load(Path(one["output_dir"]) / "checkpoints" / "last.ckpt",
                           weights_only=False)  # fmt: skip
    last = out / "checkpoints" / "last.ckpt"
    whole = consolidate(last, "test")
    assert whole["global_step"] == reference["global_step"] == STEPS
    assert whole["state_dict"].keys() == reference["state_dict"].keys()
    for key, value in reference["state_dict"].items():
        torch.testing.assert_close(whole["state_dict"][key], value, rtol=1e-4, atol=1e-6)
    [optimizer], [expected] = whole["optimizer_states"], reference["optimizer_states"]
    assert [g["params"] for g in optimizer["param_groups"]] == [
        g["params"] for g in expected["param_groups"]
    ]
    assert optimizer["state"].keys() == expected["state"].keys()
    for index, state in expected["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(optimizer["state"][index][key], state[key],
                                       rtol=1e-4, atol=1e-8, msg=f"{index} {key}")  # fmt: skip

    file = tmp_path / "whole.ckpt"
    refused = runner.invoke(app, ["consolidate", str(last), str(file)])
    assert refused.exit_code == 2 and TRUST in " ".join(refused.output.split())
    done = runner.invoke(app, ["consolidate", str(last), str(file), "--trust"])
    assert done.exit_code == 0, done.output
    written = torch.load(file, weights_only=False)
    assert written["state_dict"].keys() == whole["state_dict"].keys()
    assert all(torch.equal(written["state_dict"][k], v) for k, v in whole["state_dict"].items())


def test_export_hf_and_convert_read_a_sharded_checkpoint(two_ranks, tmp_path):
    _, out = two_ranks("drop_h")
    last = out / "checkpoints" / "last.ckpt"
    whole = consolidate(last, "test")
    hf = runner.invoke(app, ["export-hf", str(last), str(tmp_path / "hf"), "--trust"])
    assert hf.exit_code == 0, hf.output
    from safetensors.torch import load_file

    exported = load_file(tmp_path / "hf" / "model.safetensors")
    torch.testing.assert_close(
        exported["model.embed_tokens.weight"], whole["state_dict"]["model.embed.weight"]
    )
    packed = tmp_path / "packed.ckpt"
    done = runner.invoke(app, ["convert", "--to", "packed", "--chunk", "16", str(last),
                               str(packed), "--trust"])  # fmt: skip
    assert done.exit_code == 0, done.output
    converted = torch.load(packed, weights_only=False)
    assert converted["swiglu_train"]["fc1_layout"]["kind"] == "packed"
    assert converted["hyper_parameters"]["model"]["mlp_impl"] == "save_factors"
    refused = runner.invoke(app, ["export-hf", str(last), str(tmp_path / "hf2")])
    assert refused.exit_code == 2 and TRUST in " ".join(refused.output.split())


def test_a_sharded_checkpoint_under_another_strategy_or_incomplete_is_refused(
    two_ranks, config, tmp_path
):
    _, out = two_ranks("drop_h")
    last = out / "checkpoints" / "last.ckpt"
    cfg = load_config(str(config))
    cfg.train.max_steps, cfg.output_dir = STEPS + 2, str(tmp_path / "ddp")
    for strategy in ("auto", "ddp"):
        cfg.train.strategy = strategy
        with pytest.raises(ValueError, match=r"is a sharded checkpoint .*--strategy fsdp2 .*"
                           r"swiglu-train consolidate"):  # fmt: skip
            run_pretrain(cfg, resume=str(last))
    whole = tmp_path / "whole.ckpt"  # resumable under ddp, but not into the fsdp2 run's dir
    torch.save(consolidate(last, "test"), whole)
    cfg.output_dir = str(out)
    refused = r"holds sharded checkpoints \(epoch=0-step=2\.ckpt, \.\.\.\), which the one-file"
    with pytest.raises(ValueError, match=refused + " saves of --strategy ddp cannot replace"):
        run_pretrain(cfg, resume=str(whole))
    cfg.train.strategy, cfg.model.mlp_impl = "fsdp2", "save_factors"  # another fc1 layout
    with pytest.raises(ValueError, match=r"checkpoint fc1 layout is \{'kind': 'canonical'"):
        run_pretrain(cfg, resume="last")
    cfg.model.mlp_impl, cfg.output_dir = "drop_h", str(tmp_path / "ddp")
    incomplete = tmp_path / "incomplete.ckpt"
    shutil.copytree(last, incomplete, ignore=shutil.ignore_patterns("meta.pt"))
    with pytest.raises(ValueError, match=r"holds shards but no meta\.pt .*incomplete save"):
        run_pretrain(cfg, resume=str(incomplete))
    cut = tmp_path / "cut.ckpt"  # a shard cut short: named, not read as garbage
    shutil.copytree(last, cut)
    (cut / "__1_0.distcp").write_bytes((last / "__1_0.distcp").read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"cut\.ckpt is a sharded checkpoint that cannot be "
                       r"read whole \(EOFError\)"):  # fmt: skip
        run_pretrain(cfg, init_from=str(cut))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"is a directory but no sharded checkpoint"):
        run_pretrain(cfg, resume=str(tmp_path / "empty"))
    assert not (tmp_path / "ddp").exists()  # refused before the run wrote anything


def test_a_precision_fsdp2_cannot_run_is_refused_before_the_run(config, tmp_path):
    cfg = load_config(str(config))
    cfg.train.strategy, cfg.train.precision = "fsdp2", "16-mixed"
    cfg.output_dir = str(tmp_path / "run")
    with pytest.raises(ValueError, match=r"fsdp2 .* does not run precision '16-mixed'; use one"):
        run_pretrain(cfg)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("accelerator", "message"),
    [("foo", r"train.accelerator must be one of auto, gpu, .*cpu.*; got 'foo'"),
     pytest.param("gpu", r"'gpu', but this machine has no CUDA GPU; use cpu",
                  marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has CUDA"))],
)  # fmt: skip
def test_an_accelerator_lightning_would_fail_on_is_refused_before_the_run(
    config, tmp_path, accelerator, message
):
    cfg = load_config(str(config))
    cfg.train.accelerator, cfg.output_dir = accelerator, str(tmp_path / "run")
    with pytest.raises(ValueError, match=message):
        run_pretrain(cfg)
    assert not (tmp_path / "run").exists()


def test_bf16_mixed_gathers_bf16_and_reduces_fp32():
    policy = mixed_precision("bf16-mixed")
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    policy = mixed_precision("32-true")
    assert (policy.param_dtype, policy.reduce_dtype) == (None, None)


@pytest.mark.parametrize(("precision", "gathered"), [("bf16-mixed", torch.bfloat16),
                                                     ("32-true", torch.float32)])  # fmt: skip
def test_shard_makes_each_block_and_the_root_a_unit_with_the_run_s_precision(
    one_rank_gloo, precision, gathered
):
    """Each block computes with its gathered parameters in the policy's dtype while the shards
    the optimizer steps stay fp32; the root (embedding, head) is a unit of its own."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    model = LlamaDecoder(ModelConfig(hidden_size=32, ffn_hidden_size=64, num_heads=2))
    shard(model, init_device_mesh("cpu", (1,)), precision)
    assert all(isinstance(m, FSDPModule) for m in (model, *model.layers))
    seen = []
    for block in model.layers:
        block.mlp.register_forward_pre_hook(lambda m, args: seen.append(m.fc1.weight.dtype))
    model(torch.randint(0, 320, (2, 8))).float().sum().backward()
    assert seen == [gathered, gathered]
    assert {type(p).__name__ for p in model.parameters()} == {"DTensor"}
    assert {p.dtype for p in model.parameters()} == {p.grad.dtype for p in model.parameters()}
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_device_count_as_lightning_counts_them():
    assert [device_count(d) for d in (3, "2", "0,1,3")] == [3, 2, 3]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 1
    assert device_count("auto") == gpus


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl", ["drop_h", "save_factors"])
def test_fsdp2_on_one_gpu_matches_the_unsharded_run_in_bf16(
    config, corpus, tmp_path, restored_environ, impl
):
    """On CUDA (NCCL, Triton kernels, bf16-mixed): one fsdp2 process, whose blocks compute
    with bf16 gathered weights, follows the unsharded autocast run to bf16 accuracy, and the
    allocator figures are measured."""
    pytest.importorskip("wandb", reason="pretrain logs to W&B (the wandb extra)")
    runs = []
    with use_backend("auto"):
        for strategy in ("auto", "fsdp2"):
            cfg = load_config(str(config))
            cfg.model.mlp_impl, cfg.train.strategy = impl, strategy
            cfg.train.precision, cfg.train.accelerator = "bf16-mixed", "gpu"
            cfg.data.data, cfg.data.micro_batch_size = [str(corpus / "*.py")], 4
            cfg.output_dir = str(tmp_path / strategy)
            runs.append(run_pretrain(cfg))
    unsharded, sharded = runs
    assert sharded["mlp_impl"] == impl and sharded["steps"] == STEPS
    for step, loss in unsharded["losses"].items():
        assert sharded["losses"][step] == pytest.approx(loss, rel=2e-2), step
    assert sharded["after_forward_MiB"] > 0 and sharded["peak_MiB"] > 0
    # The unsharded run also holds autocast's bf16 copies of the weights for backward; FSDP2
    # frees its gathered ones after each block's forward, so they are not counted.
    assert 0 < sharded["saved_MiB"] <= unsharded["saved_MiB"]
