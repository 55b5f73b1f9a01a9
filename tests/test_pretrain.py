"""The Lightning pretraining recipe on CPU: smoke runs, exact resume, data formats, bad input."""

import csv
import json
import os
import re
import subprocess
import sys
import tomllib
from copy import deepcopy
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import auto_model, pretend_gpu
from lightning.fabric.utilities.types import _Stateful
from typer.testing import CliRunner

from swiglu_train.cli import app
from swiglu_train.extras import explain
from swiglu_train.integrations.lightning.config import CONFIG_DIR, PretrainConfig, load_config
from swiglu_train.integrations.lightning.data import (
    ByteTokenizer,
    PackedTextData,
    Rows,
    StepLoader,
    StepSampler,
    load_documents,
)
from swiglu_train.integrations.lightning.model import ModelConfig
from swiglu_train.integrations.lightning.pretrain import run_pretrain
from swiglu_train.integrations.lightning.resume import StepProgressBar
from swiglu_train.memory.runs import load_runs
from swiglu_train.ops import use_backend
from swiglu_train.packing import convert_checkpoint

runner = CliRunner()


pytestmark = pytest.mark.usefixtures("offline_wandb_torch_math")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A few standard-library modules as plain text files (small, fast, real)."""
    import json as json_module
    import shutil
    import textwrap

    root = tmp_path_factory.mktemp("corpus")
    for module in (json_module, shutil, textwrap):
        Path(root / Path(module.__file__).name).write_bytes(Path(module.__file__).read_bytes())
    return root


def small_config(tmp_path: Path, data: list[str] | None, impl: str, steps: int) -> PretrainConfig:
    cfg = PretrainConfig()
    cfg.model.hidden_size, cfg.model.ffn_hidden_size, cfg.model.num_heads = 64, 160, 2
    cfg.model.mlp_impl = impl
    cfg.data.data, cfg.data.seq_length, cfg.data.micro_batch_size = data, 64, 4
    cfg.data.val_fraction = 0.34  # one of the three corpus files
    cfg.train.max_steps, cfg.train.val_check_interval, cfg.train.checkpoint_every = steps, 10, 5
    cfg.optim.warmup_steps = 3
    cfg.output_dir = str(tmp_path / impl)
    return cfg


def test_tiny_yaml_is_the_builtin_default():
    assert load_config("tiny") == PretrainConfig()


def test_named_configs_ship_in_the_wheel():
    """They live in the package and pyproject.toml lists them as package data, so
    `pretrain --config 125m` works from an installed wheel, not only from a checkout."""
    root = Path(__file__).resolve().parents[1]
    package = root / "swiglu_train" / "integrations" / "lightning"
    named = sorted(CONFIG_DIR.glob("*.yaml"))
    assert [p.stem for p in named] == ["125m", "1b", "3b", "moe_1b", "tiny", "tiny_moe"]
    assert all(p.is_relative_to(package) for p in named)
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = setuptools["package-data"]["swiglu_train.integrations.lightning"]
    assert all(any(p.relative_to(package).match(g) for g in patterns) for p in named)


def test_smoke_every_impl_same_initial_loss_and_loss_falls(tmp_path, corpus):
    summaries = {
        impl: run_pretrain(small_config(tmp_path, [str(corpus / "*.py")], impl, 20))
        for impl in ("normal", "drop_h", "save_factors")
    }
    for s in summaries.values():
        assert s["steps"] == 20
        assert s["final_loss"] < s["initial_loss"] - 0.5
        assert s["tokens_per_s"] > 0 and s["saved_MiB"] > 0 and s["val_loss"] is not None
        assert Path(s["memory_csv"]).is_file()
    # Same seed, same function (save_factors is initialised canonical, then packed), same
    # batches: the first step agrees to fp32 rounding (save_factors' GEMM sums in another order)
    assert summaries["normal"]["initial_loss"] == summaries["drop_h"]["initial_loss"]
    assert summaries["save_factors"]["initial_loss"] == pytest.approx(
        summaries["normal"]["initial_loss"], rel=1e-6
    )
    for impl in ("drop_h", "save_factors"):
        np.testing.assert_allclose(
            list(summaries["normal"]["losses"].values()),
            list(summaries[impl]["losses"].values()),
            rtol=1e-4,
        )


class Crash(Exception):
    pass


@pytest.fixture
def bars(monkeypatch) -> list[StepProgressBar]:
    """Each run's progress bar, kept to read what it computed (its rich task's values)."""
    kept = []
    setup = StepProgressBar.setup

    def keep(self, *args, **kwargs):
        kept.append(self)
        return setup(self, *args, **kwargs)

    monkeypatch.setattr(StepProgressBar, "setup", keep)
    return kept


def train_task(bar: StepProgressBar):
    """The rich task of the bar's training progress: total, completed, description."""
    return next(t for t in bar.progress.tasks if t.id == bar.train_progress_bar_id)


def read_rows(path: Path, column: str) -> dict[int, str]:
    """step -> ``column`` of a CSV's rows that have it."""
    with open(path) as f:
        return {int(r["step"]): r[column] for r in csv.DictReader(f) if r[column]}


def test_resume_after_a_crash_repeats_the_uninterrupted_losses(
    tmp_path, corpus, monkeypatch, recwarn, bars
):
    """The resumed run continues one run: the same losses bitwise, its loader's position
    restored through Lightning's stateful-loader protocol (so Lightning does not warn of an
    unresumable loader), a progress bar over the whole run, one W&B run id (offline, one run
    directory per segment, which compare-memory joins into one series) and one CSV log."""
    data = [str(corpus / "*.py")]
    full = run_pretrain(small_config(tmp_path / "full", data, "drop_h", 12))

    from swiglu_train.integrations.lightning import pretrain as pretrain_module

    original = pretrain_module.LossAndThroughput.on_train_batch_end

    def crash_at_step_8(self, trainer, *args):
        original(self, trainer, *args)
        if trainer.global_step == 8:
            raise Crash("simulated kill after step 8; the last checkpoint is at step 5")

    monkeypatch.setattr(pretrain_module.LossAndThroughput, "on_train_batch_end", crash_at_step_8)
    cfg = small_config(tmp_path / "crashed", data, "drop_h", 12)
    with pytest.raises(Crash):
        run_pretrain(cfg)
    monkeypatch.setattr(pretrain_module.LossAndThroughput, "on_train_batch_end", original)
    out = Path(cfg.output_dir)
    loader_state = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)["loops"]
    assert loader_state["fit_loop"]["state_dict"]["combined_loader"] == [{"next_batch": 5}]
    recwarn.clear()
    resumed = run_pretrain(cfg, resume="last")
    assert not [w for w in recwarn if "not resumable" in str(w.message)]
    assert resumed["steps"] == 12
    assert resumed["initial_loss"] == full["initial_loss"]  # the run's step 0, kept across
    assert list(resumed["losses"]) == [str(s) for s in range(5, 12)]
    for step, loss in resumed["losses"].items():
        assert loss == full["losses"][step], step  # bitwise: same batches, same state

    for bar in bars:  # the uninterrupted run, the crashed one (at 8 of 12), the resumed one
        assert train_task(bar).total == 12 and bar.total_train_batches == 12
        assert train_task(bar).description.strip() == "Training"
    # The crash comes in the 8th batch's end, before the bar (a later callback) counts it.
    assert [train_task(bar).completed for bar in bars] == [12, 7, 12]

    run_id = json.loads((out / "run.json").read_text())["wandb_run_id"]
    segments = sorted((out / "wandb").glob("offline-run-*"))
    # W&B names a segment offline-run-<time>-<id>, with -1 added when two start in one second
    named = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(run_id)}(-\d+)?")
    assert len(segments) == 2 and all(named.fullmatch(p.name) for p in segments), segments
    [run] = load_runs(segments)  # in either order
    assert load_runs(segments[::-1])[0].series == run.series
    assert run.label == "drop_h" and run.run_id == run_id and run.steps == list(range(12))
    [whole] = load_runs([next((tmp_path / "full" / "drop_h" / "wandb").glob("offline-run-*"))])
    assert run.series == whole.series
    assert [p.name for p in (out / "csv").iterdir()] == ["version_0"]
    for name, column in (("csv/version_0/metrics.csv", "train/loss"),
                         ("memory.csv", "memory/saved_MiB")):  # fmt: skip
        rows = read_rows(out / name, column)
        assert rows == read_rows(tmp_path / "full" / "drop_h" / name, column)
        assert sorted(rows) == list(range(12)), name  # each step once, none lost or doubled


def test_the_training_loader_restores_its_position_from_its_state():
    """StepLoader is what Lightning calls stateful: it saves the trainer's position, not the
    sampler's (which runs ahead by the prefetched batch), and a loaded state moves it there."""
    rows = Rows(torch.arange(80).view(40, 2))
    uninterrupted = StepLoader(rows, StepSampler(40, 4, seed=7), done=lambda: 6)
    assert isinstance(uninterrupted, _Stateful)
    assert uninterrupted.state_dict() == {"next_batch": 6}
    batches = iter(uninterrupted)
    expected = [next(batches) for _ in range(13)][6:]  # past one epoch of 10 batches
    resumed = StepLoader(rows, StepSampler(40, 4, seed=7), done=lambda: 0)
    resumed.load_state_dict({"next_batch": 6})
    batches = iter(resumed)
    for want in expected:
        assert torch.equal(next(batches), want)


def test_accumulation_counts_steps_and_the_final_step_is_checkpointed(tmp_path, corpus, bars):
    """With accumulate_grad_batches 2: validation every val_check_interval optimizer steps (as
    checkpoint_every and max_steps count), not micro-batches, so never mid-accumulation;
    last.ckpt holds the final step even when max_steps is no multiple of checkpoint_every,
    so a finished run is refused; resuming a step checkpoint repeats the losses bitwise."""
    cfg = small_config(tmp_path, [str(corpus / "*.py")], "drop_h", 7)
    cfg.train.accumulate_grad_batches = 2
    cfg.train.val_check_interval = cfg.train.checkpoint_every = 3
    full = run_pretrain(cfg)
    with open(Path(cfg.output_dir) / "csv" / "version_0" / "metrics.csv") as f:
        validated = [int(r["step"]) for r in csv.DictReader(f) if r["val/loss"]]
    assert validated == [2, 5]  # after steps 3 and 6, the losses' step numbering
    checkpoints = Path(cfg.output_dir) / "checkpoints"
    assert torch.load(checkpoints / "last.ckpt", weights_only=False)["global_step"] == 7
    with pytest.raises(ValueError, match="is at step 7 and max_steps is 7"):
        run_pretrain(cfg, resume="last")
    resumed = run_pretrain(cfg, resume=str(checkpoints / "epoch=0-step=3.ckpt"))
    assert resumed["losses"] == {str(s): full["losses"][str(s)] for s in range(3, 7)}
    # The bar counts micro-batches, the resumed one on from the 6 of step 3.
    assert [(train_task(b).completed, train_task(b).total) for b in bars] == [(14, 14)] * 2


def test_an_accumulated_step_s_loss_is_the_mean_over_its_rows(tmp_path, corpus):
    """Two micro-batches of 2 sequences are one step of 4: the summary read the loss Lightning
    hands on_train_batch_end, which is divided by the accumulation (half the loss at 2)."""
    data = [str(corpus / "*.py")]
    runs = []
    for micro, accumulate in ((4, 1), (2, 2)):
        cfg = small_config(tmp_path / f"{micro}x{accumulate}", data, "drop_h", 3)
        cfg.data.micro_batch_size, cfg.train.accumulate_grad_batches = micro, accumulate
        runs.append(run_pretrain(cfg)["losses"])
    assert runs[1].keys() == runs[0].keys() == {"0", "1", "2"}
    for step, loss in runs[0].items():
        assert runs[1][step] == pytest.approx(loss, rel=1e-5), step


def test_resume_with_the_other_impl_continues_the_same_function(tmp_path, corpus):
    data = [str(corpus / "*.py")]
    cfg = small_config(tmp_path, data, "normal", 5)
    run_pretrain(cfg)
    checkpoint = torch.load(Path(cfg.output_dir) / "checkpoints" / "last.ckpt", weights_only=False)
    stamp = checkpoint["swiglu_train"]
    assert stamp["fc1_layout"] == {"kind": "canonical", "chunk": None, "tp": 1}
    assert stamp["mlp_impl"] == "normal"
    assert "model.layers.0.mlp.fc1.weight" in stamp["optimizer_param_names"][0]
    cfg.model.mlp_impl, cfg.train.max_steps = "drop_h", 8
    resumed = run_pretrain(cfg, resume="last")
    assert resumed["steps"] == 8 and resumed["mlp_impl"] == "drop_h"


def test_resume_across_layouts_with_optimizer_state_is_refused(tmp_path, corpus):
    cfg = small_config(tmp_path, [str(corpus / "*.py")], "save_factors", 5)
    first = run_pretrain(cfg)
    assert first["final_loss"] < first["initial_loss"]
    checkpoint = torch.load(Path(cfg.output_dir) / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["swiglu_train"]["fc1_layout"]["kind"] == "packed"
    cfg.model.mlp_impl, cfg.train.max_steps = "drop_h", 8
    with pytest.raises(ValueError, match=r"fc1 layout is \{'kind': 'packed'.*optimizer state") as e:
        run_pretrain(cfg, resume="last")
    assert "swiglu-train convert --to canonical CKPT OUT" in str(e.value)


def test_mlp_chunk_from_yaml_and_flag_packs_fc1_and_resumes_a_converted_file(tmp_path, corpus):
    """model.mlp_chunk (YAML) and --mlp-chunk (overriding it) pick save_factors' pack chunk;
    a file `convert` packed by another chunk resumes with a config of that chunk, and with
    another the layout error names the flag and config key that fit the file."""
    (tmp_path / "c.yaml").write_text(
        "model: {hidden_size: 64, ffn_hidden_size: 160, num_heads: 2, mlp_impl: save_factors,"
        " mlp_chunk: 16}\ndata: {seq_length: 64, micro_batch_size: 4, val_fraction: 0.0}\n"
        "train: {max_steps: 2, checkpoint_every: 2}\n"
    )
    assert load_config(str(tmp_path / "c.yaml")).model.mlp_chunk == 16
    args = ["pretrain", "--config", tmp_path / "c.yaml", "--mlp-chunk", 40]
    args += ["--data", corpus / "*.py", "--output-dir", tmp_path / "run"]
    result = runner.invoke(app, list(map(str, args)))
    assert result.exit_code == 0, result.output
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    ckpt = torch.load(last, weights_only=False)
    assert ckpt["swiglu_train"]["fc1_layout"] == {"kind": "packed", "chunk": 40, "tp": 1}
    assert ckpt["hyper_parameters"]["model"]["mlp_chunk"] == 40

    packed16 = tmp_path / "packed16.ckpt"
    result = runner.invoke(
        app, ["convert", "--to", "packed", "--chunk", "16", str(last), str(packed16)]
    )
    assert result.exit_code == 0, result.output
    cfg = load_config(str(tmp_path / "c.yaml"))
    cfg.data.data, cfg.train.max_steps = [str(corpus / "*.py")], 3
    resumed = run_pretrain(replace_output(cfg, tmp_path / "resumed"), resume=str(packed16))
    assert resumed["steps"] == 3 and resumed["mlp_impl"] == "save_factors"

    cfg.model.mlp_chunk = None  # save_factors' default: 32 for F = 160
    with pytest.raises(ValueError, match=r"fc1 layout is .*'chunk': 16.*optimizer state") as e:
        run_pretrain(replace_output(cfg, tmp_path / "refused"), resume=str(packed16))
    for fix in ("--mlp-impl save_factors --mlp-chunk 16", "mlp_chunk: 16}",
                "swiglu-train convert --to packed --chunk 32 CKPT OUT"):  # fmt: skip
        assert fix in str(e.value), (fix, str(e.value))


@pytest.mark.parametrize(
    ("impl", "chunk", "message"),
    [
        ("drop_h", 16, r"mlp_chunk=16 \(--mlp-chunk\) packs fc1, but mlp_impl 'drop_h' keeps"),
        ("normal", 1, r"mlp_impl 'normal' keeps fc1 canonical \(unpacked\): leave mlp_chunk"),
        ("save_factors_quack", 16, r"'save_factors_quack' always packs fc1 with chunk 1"),
        ("save_factors", 24, r"chunk=24 must be positive and divide ffn_hidden_size 160"),
        ("save_factors", 0, r"chunk=0 must be positive"),
        ("auto", 24, r"must be positive and divide ffn_hidden_size 160"),
    ],
)
def test_a_chunk_the_model_would_not_pack_by_is_refused(tmp_path, impl, chunk, message):
    """From the YAML, and from a flag set after the config was built, before any training:
    ParMLP would otherwise ignore it (canonical impls) or fail deep in the model build."""
    cfg = small_config(tmp_path, None, impl, 3)
    cfg.model.mlp_chunk = chunk  # as the CLI sets --mlp-chunk
    with pytest.raises(ValueError, match=message):
        run_pretrain(cfg)
    assert not (tmp_path / impl / "wandb").exists()
    (tmp_path / "c.yaml").write_text(
        f"model: {{ffn_hidden_size: 160, mlp_impl: {impl}, mlp_chunk: {chunk}}}\n"
    )
    with pytest.raises(ValueError, match=message):
        load_config(str(tmp_path / "c.yaml"))


def test_a_run_without_wandb_is_refused_before_any_work(tmp_path, monkeypatch):
    """Called from Python, not the CLI (which checks its extras first): the planner's
    measurements and the data would otherwise run before Lightning's logger failed."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    cfg = small_config(tmp_path, None, "drop_h", 3)
    cfg.train.activation_checkpointing, cfg.train.memory_budget_gb = "auto", 1.0
    with pytest.raises(ModuleNotFoundError) as refused:
        run_pretrain(cfg)
    assert refused.value.name == "wandb"  # the CLI's line names the extra from it
    assert explain(refused.value).startswith("wandb is not installed; the [wandb] extra brings it")
    assert not (tmp_path / "drop_h").exists()  # no plan measured, no output dir


@pytest.mark.parametrize(
    ("impl", "chunk"), [("save_factors_quack", 1), ("auto", 16), ("save_factors", 160)]
)
def test_a_chunk_the_impl_packs_by_is_taken(impl, chunk):
    """save_factors_quack's own chunk 1 is no conflict; auto takes save_factors' chunks."""
    ModelConfig(ffn_hidden_size=160, mlp_impl=impl, mlp_chunk=chunk)


def test_the_mlp_chunk_flag_is_checked_against_the_impl(tmp_path):
    result = runner.invoke(
        app, ["pretrain", "--mlp-chunk", "16", "--output-dir", str(tmp_path / "run")]
    )
    assert result.exit_code != 0
    assert "mlp_impl 'drop_h' keeps fc1 canonical" in str(result.exception)
    assert not (tmp_path / "run" / "wandb").exists()


@pytest.fixture(scope="module")
def finished(tmp_path_factory, corpus) -> tuple:
    """A 3-step drop_h run and its config: the checkpoint the resume checks are tried on."""
    cfg = small_config(tmp_path_factory.mktemp("finished"), [str(corpus / "*.py")], "drop_h", 3)
    with use_backend("torch"):
        run_pretrain(cfg)
    return cfg, Path(cfg.output_dir) / "checkpoints" / "last.ckpt"


def test_a_fresh_run_in_another_run_s_output_dir_is_refused(finished):
    """Its checkpoints would sit beside the earlier run's, and `--resume last` would continue
    whichever wrote last.ckpt (the earlier one, on another corpus)."""
    cfg, _ = finished
    with pytest.raises(ValueError, match=r"already holds another run's checkpoints"):
        run_pretrain(cfg)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", r"is not a readable checkpoint \(0 bytes, not a torch\.save zip"),
        (b"hello\n", r"is not a readable checkpoint \(6 bytes"),
        ("truncated", r"is not a readable checkpoint \(50000 bytes"),
        ("bare", r"is not a pretrain checkpoint \(a bare state_dict"),
    ],
)
def test_a_checkpoint_lightning_cannot_resume_is_named(finished, tmp_path, content, message):
    cfg, last = finished
    bad = tmp_path / "bad.ckpt"
    if content == "truncated":
        bad.write_bytes(last.read_bytes()[:50_000])
    elif content == "bare":
        torch.save(torch.load(last, weights_only=False)["state_dict"], bad)
    else:
        bad.write_bytes(content)
    resumed = replace_output(cfg, tmp_path / "run")
    with pytest.raises(ValueError, match=message):
        run_pretrain(resumed, resume=str(bad))
    assert not (tmp_path / "run" / "wandb").exists()  # refused before a W&B run was started


def test_resume_into_another_model_shape_or_past_max_steps_is_refused(finished, tmp_path):
    cfg, last = finished
    wider = replace_output(cfg, tmp_path / "wider")
    wider.model.hidden_size, wider.train.max_steps = 96, 6
    with pytest.raises(ValueError, match=r"another shape \(hidden_size 64 -> 96\)"):
        run_pretrain(wider, resume=str(last))
    done = replace_output(cfg, tmp_path / "done")
    with pytest.raises(ValueError, match=r"is at step 3 and max_steps is 3: nothing to train"):
        run_pretrain(done, resume=str(last))


@pytest.mark.parametrize(
    ("packed", "flags", "fits"),
    [  # the file's fc1 layout (None: canonical), the flags resumed with, the settings that fit
        (None, ["--mlp-impl", "save_factors"], "--mlp-impl drop_h (or normal, drop_h_quack)"),
        (16, ["--mlp-impl", "drop_h"], "--mlp-impl save_factors --mlp-chunk 16"),
        (16, ["--mlp-impl", "save_factors", "--mlp-chunk", "32"], "--mlp-chunk 16, in a config"),
        (None, ["--mlp-impl", "auto"], "and no --mlp-chunk"),  # auto picks save_factors here
    ],
)
def test_a_resume_into_another_fc1_layout_is_refused_before_anything_starts(
    finished, tmp_path, corpus, monkeypatch, capsys, packed, flags, fits
):
    """The layout error comes in one line, before W&B or the Trainer: the output dir is left
    exactly as it was (no W&B run, no CSV, no checkpoint), the exit code is the CLI's 1."""
    _, last = finished
    impls = {"drop_h": (1.10, 4.0), "save_factors": (1.0, 6.0)}  # auto: save_factors
    pretend_gpu(monkeypatch, auto_model(impls))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # Typer installs its own
    monkeypatch.delenv("SWIGLU_TRAIN_DEBUG", raising=False)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    ckpt = torch.load(last, weights_only=False)
    if packed is not None:
        ckpt = convert_checkpoint(ckpt, to="packed", chunk=packed)
    torch.save(ckpt, run / "checkpoints" / "last.ckpt")
    (tmp_path / "c.yaml").write_text(
        "model: {hidden_size: 64, ffn_hidden_size: 160, num_heads: 2}\n"
        "data: {seq_length: 64, micro_batch_size: 4, val_fraction: 0.34}\n"
    )
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    args = ["pretrain", "--config", str(tmp_path / "c.yaml"), *flags, "--max-steps", "6"]
    args += ["--data", str(corpus / "*.py"), "--output-dir", str(run), "--resume", "last"]
    with pytest.raises(SystemExit) as exit_:
        app(args=args, prog_name="swiglu-train")
    assert exit_.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: checkpoint fc1 layout is "), errors
    for fix in (fits, "model: {mlp_impl: ", "swiglu-train convert --to "):
        assert fix in errors[0], (fix, errors[0])
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before


def test_resume_says_an_optimizer_change_is_not_used(finished, tmp_path):
    cfg, last = finished
    changed = replace_output(cfg, tmp_path / "lr")
    changed.optim.lr, changed.train.max_steps = 1.0, 4
    with use_backend("torch"), pytest.warns(UserWarning, match=r"lr 0\.003 -> 1\.0"):
        run_pretrain(changed, resume=str(last))


def test_checkpoint_records_the_data_settings(finished, corpus):
    _, last = finished
    record = torch.load(last, weights_only=False)["swiglu_train"]["data"]
    tokens = sum(len(ids) for _, ids in load_documents([str(corpus / "*.py")]))
    assert record == {
        "corpus": [os.path.abspath(corpus / "*.py")],
        "corpus_tokens": tokens,
        "seq_length": 64,
        "micro_batch_size": 4,
        "accumulate_grad_batches": 1,
        "world_size": 1,
        "val_fraction": 0.34,
        "data_seed": 1234,
    }


def test_resume_on_other_data_names_each_change_in_one_warning(finished, tmp_path, corpus):
    """Another corpus, micro-batch and sequence length are legitimate mid-run, but not silent:
    one warning names each change, and the run goes on with the new settings."""
    cfg, last = finished
    other = tmp_path / "other"
    other.mkdir()
    for path in corpus.glob("*.py"):  # each file twice over: another corpus
        (other / path.name).write_bytes(path.read_bytes() * 2)
    changed = replace_output(cfg, tmp_path / "run")
    changed.data.data, changed.train.max_steps = [str(other / "*.py")], 4
    changed.data.micro_batch_size, changed.data.seq_length = 2, 32
    with use_backend("torch"), pytest.warns(UserWarning, match="other data settings") as record:
        summary = run_pretrain(changed, resume=str(last))
    assert summary["steps"] == 4
    [warning] = [str(w.message) for w in record if "other data settings" in str(w.message)]
    tokens = sum(len(ids) for _, ids in load_documents([str(corpus / "*.py")]))
    assert f"corpus ['{os.path.abspath(corpus / '*.py')}'] -> ['{other / '*.py'}']" in warning
    assert f"corpus_tokens {tokens} -> {2 * tokens}" in warning
    assert "micro_batch_size 4 -> 2" in warning and "seq_length 64 -> 32" in warning
    assert warning.count(" -> ") == 4  # nothing else changed


def test_resume_on_the_same_data_warns_nothing_about_it(finished, tmp_path, recwarn):
    cfg, last = finished
    same = replace_output(cfg, tmp_path / "run")
    same.train.max_steps = 4
    with use_backend("torch"):
        assert run_pretrain(same, resume=str(last))["steps"] == 4
    assert not [w for w in recwarn if "data settings" in str(w.message)]


def test_a_checkpoint_without_a_data_record_still_resumes(finished, tmp_path, recwarn, caplog):
    """Written before checkpoints recorded their data: resumed, with a note and no warning."""
    cfg, last = finished
    old = torch.load(last, weights_only=False)
    del old["swiglu_train"]["data"]
    torch.save(old, tmp_path / "old.ckpt")
    changed = replace_output(cfg, tmp_path / "run")
    changed.data.micro_batch_size, changed.train.max_steps = 2, 4
    with use_backend("torch"), caplog.at_level("INFO"):
        assert run_pretrain(changed, resume=str(tmp_path / "old.ckpt"))["steps"] == 4
    assert not [w for w in recwarn if "data settings" in str(w.message)]
    assert "old.ckpt records no data settings (an older checkpoint)" in caplog.text


def test_a_resume_into_another_output_dir_logs_to_a_run_of_its_own(finished, tmp_path, caplog):
    """The run a dir records (run.json) is the one its resumes continue; a checkpoint resumed
    into a new dir (a branch) gets its own W&B run and CSV log, and says so."""
    cfg, last = finished
    first = json.loads((Path(cfg.output_dir) / "run.json").read_text())
    branch = replace_output(cfg, tmp_path / "branch")
    branch.train.max_steps = 4
    with use_backend("torch"), caplog.at_level("INFO"):
        run_pretrain(branch, resume=str(last))
    assert "records no run (run.json); this run logs to a new W&B run and CSV version" in (
        caplog.text
    )
    own = json.loads((tmp_path / "branch" / "run.json").read_text())
    assert own["wandb_run_id"] != first["wandb_run_id"] and own["csv_version"] == 0
    [segment] = (tmp_path / "branch" / "wandb").glob("offline-run-*")
    assert segment.name.endswith(f"-{own['wandb_run_id']}")


def test_a_damaged_run_record_is_named_before_the_run(finished, tmp_path):
    cfg, last = finished
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(last.read_bytes())
    (run / "run.json").write_text('{"wandb_run_id": 5}')
    resumed = replace_output(cfg, run)
    resumed.train.max_steps = 4
    with pytest.raises(ValueError, match=r"run\.json is not a run record .*delete it to log"):
        run_pretrain(resumed, resume="last")
    assert not (run / "wandb").exists() and not (run / "csv").exists()


def replace_output(cfg: PretrainConfig, out: Path) -> PretrainConfig:
    """A deep copy of ``cfg`` writing to ``out``."""
    copy = deepcopy(cfg)
    copy.output_dir = str(out)
    return copy


def test_auto_resolves_from_one_micro_batch_and_stamps_its_choice(tmp_path, corpus, monkeypatch):
    # A micro-batch is 4 x 64 = 256 tokens; there the (pretend) H200 model picks save_factors,
    # which is packed: the checkpoint must record what auto resolved to.
    impls = {"drop_h": (1.10, 4.0), "save_factors": (1.0, 6.0)}
    pretend_gpu(monkeypatch, auto_model(impls))
    cfg = small_config(tmp_path, [str(corpus / "*.py")], "auto", 5)
    with pytest.warns(UserWarning, match="val_check_interval=10 is more than max_steps=5"):
        summary = run_pretrain(cfg)  # the interval is past the run: said, not silent
    assert summary["val_loss"] is None
    assert cfg.model.mlp_tokens_hint == 256
    assert summary["mlp_impl"] == "save_factors" and "M=256" in summary["mlp_auto_reason"]
    checkpoint = torch.load(Path(cfg.output_dir) / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["swiglu_train"]["mlp_impl"] == "save_factors"
    assert checkpoint["swiglu_train"]["fc1_layout"]["kind"] == "packed"


def test_data_formats_text_jsonl_and_megatron(tmp_path):
    text = "hello swiglu " * 50
    (tmp_path / "a.txt").write_text(text)
    (tmp_path / "b.jsonl").write_text(
        json.dumps({"text": text}) + "\n\n" + json.dumps({"text": "second doc"}) + "\n"
    )
    builder_mod = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    ids = ByteTokenizer().encode(text)
    builder = builder_mod.IndexedDatasetBuilder(str(tmp_path / "mega.bin"), dtype=np.int32)
    builder.add_document(torch.from_numpy(ids), [len(ids)])
    builder.finalize(str(tmp_path / "mega.idx"))

    docs = load_documents(
        [str(tmp_path / "*.txt"), str(tmp_path / "b.jsonl"), str(tmp_path / "mega")]
    )
    assert [name.rsplit("/", 1)[-1] for name, _ in docs] == [
        "a.txt",
        "b.jsonl:1",
        "b.jsonl:3",
        "mega#0",
    ]
    for name, tokens in docs:
        expected = "second doc" if name.endswith(":3") else text
        assert ByteTokenizer().decode(tokens) == expected, name


def test_bad_inputs_are_named(tmp_path):
    result = runner.invoke(app, ["pretrain", "--mlp-impl", "fast", "--output-dir", str(tmp_path)])
    assert "valid impls: normal, drop_h" in str(result.exception)
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match=r"nope\.txt"):
        load_documents([str(missing)])
    (tmp_path / "empty.txt").write_text("")
    data = PackedTextData(
        small_config(tmp_path, [str(tmp_path / "empty.txt")], "drop_h", 1).data, 320
    )
    with pytest.raises(ValueError, match=r"corpus .*empty.txt.* is too small"):
        data.setup("fit")
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: a jsonl record needs a 'text' field"):
        load_documents([str(tmp_path / "bad.jsonl")])
    shipped = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))  # 125m, 1b, 3b, tiny
    assert {"125m", "1b", "tiny"} <= set(shipped)
    with pytest.raises(
        FileNotFoundError, match=re.escape(f"config 'huge' not found; named configs: {shipped}")
    ):
        load_config("huge")
    (tmp_path / "typo.yaml").write_text("model: {hiden_size: 3}\n")
    with pytest.raises(ValueError, match=r"unknown keys \['hiden_size'\]"):
        load_config(str(tmp_path / "typo.yaml"))


def test_a_corpus_too_small_to_hold_out_a_document_says_so(tmp_path):
    """One file, and one document in k held out: no validation rows. The run says why
    instead of Lightning's warning about a zero-length dataloader."""
    (tmp_path / "one.txt").write_text("a few words " * 2000)
    data = PackedTextData(
        small_config(tmp_path, [str(tmp_path / "one.txt")], "drop_h", 1).data, 320
    )
    with pytest.warns(UserWarning, match=r"no validation set: corpus .*one\.txt.* has fewer "):
        data.setup("fit")
    assert not data.has_validation and data.val_dataloader() == []


def test_a_run_without_validation_skips_it_quietly(tmp_path, corpus, recwarn):
    """Validation off (here on purpose) means no val loop at all: no val_loss, and none of
    Lightning's warnings about a zero-length val dataloader."""
    cfg = small_config(tmp_path, [str(corpus / "*.py")], "drop_h", 2)
    cfg.data.val_fraction, cfg.train.val_check_interval = 0.0, 1
    with use_backend("torch"):
        summary = run_pretrain(cfg)
    assert summary["steps"] == 2 and summary["val_loss"] is None
    assert not [w for w in recwarn if "length" in str(w.message).lower()]
    assert not [w for w in recwarn if "never validates" in str(w.message)]  # off on purpose


def test_validation_turned_off_on_purpose_warns_nothing(tmp_path, recwarn):
    cfg = small_config(tmp_path, [str(tmp_path / "*.txt")], "drop_h", 1)
    for i in range(3):
        (tmp_path / f"{i}.txt").write_text("a few words " * 2000)
    cfg.data.val_fraction = 0.0
    data = PackedTextData(cfg.data, 320)
    data.setup("fit")
    assert not data.has_validation
    assert not [w for w in recwarn if "validation" in str(w.message)]


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ('model: {hidden_size: "192"}', r":model:hidden_size must be int, got '192'"),
        ('optim: {lr: "3e-3"}', r":optim:lr must be float, got '3e-3'"),  # YAML 1.1 reads a str
        ("optim: {betas: 0.9}", r":optim:betas must be tuple\[float, float\], got 0\.9"),
        ("model: {hidden_size: true}", r"hidden_size must be int, got True"),
        ("output_dir: 5", r":output_dir must be str, got 5"),
        ("model: [1, 2]", r":model: expected a mapping for ModelConfig"),
        ("model: {", r": not valid YAML: "),
        ("model: {num_heads: 0}", r"num_heads must be at least 1, got 0"),
    ],
)
def test_a_config_value_of_the_wrong_type_is_named(tmp_path, yaml_text, message):
    (tmp_path / "c.yaml").write_text(yaml_text + "\n")
    with pytest.raises(ValueError, match=message):
        load_config(str(tmp_path / "c.yaml"))


@pytest.mark.parametrize(
    ("part", "key", "value", "message"),
    [
        ("train", "max_steps", -1, r"train\.max_steps must be at least 1, got -1"),  # ran forever
        ("data", "micro_batch_size", 0, r"data\.micro_batch_size must be at least 1"),
        ("train", "accumulate_grad_batches", 0, r"accumulate_grad_batches must be at least 1"),
        ("model", "num_layers", 0, r"model\.num_layers must be at least 1"),
        ("data", "val_fraction", 2.0, r"data\.val_fraction < 1"),
    ],
)
def test_a_value_out_of_range_is_refused_before_training(tmp_path, part, key, value, message):
    """Checked on the final config, where command-line flags have overridden the YAML."""
    cfg = small_config(tmp_path, None, "drop_h", 3)
    setattr(getattr(cfg, part), key, value)
    with pytest.raises(ValueError, match=message):
        run_pretrain(cfg)
    assert not (tmp_path / "drop_h" / "wandb").exists()


def test_cli_default_corpus_summary_json(tmp_path):
    """The README command on the embedded defaults, shortened: stdlib corpus, summary JSON."""
    out = tmp_path / "summary.json"
    result = runner.invoke(
        app,
        [
            "pretrain",
            "--max-steps",
            "3",
            "--micro-batch-size",
            "2",
            "--output-dir",
            str(tmp_path / "run"),
            "--summary-json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(out.read_text())
    assert summary["mlp_impl"] == "drop_h" and summary["steps"] == 3
    assert {
        "initial_loss",
        "final_loss",
        "tokens_per_s",
        "after_forward_MiB",
        "peak_MiB",
    } <= summary.keys()
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))


@pytest.mark.slow
def test_cli_ddp_on_two_cpu_ranks_reports_once(tmp_path, corpus):
    """`--devices 2 --strategy ddp`: Lightning launches a second process (gloo on CPU); the W&B
    offline run, the memory CSV, the checkpoints and the summary come from rank 0 alone, and
    its losses, the mean over both ranks' rows, are those of one process at the same global
    batch (rank 0's own rows alone were reported before)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # plain torch math
    env.update(WANDB_MODE="offline", WANDB_SILENT="true")
    out, summary_path = tmp_path / "run", tmp_path / "summary.json"
    args = ["pretrain", "--devices", "2", "--strategy", "ddp", "--max-steps", "4"]
    args += ["--micro-batch-size", "2", "--data", str(corpus / "*.py"), "--output-dir", str(out)]
    args += ["--summary-json", str(summary_path)]
    done = subprocess.run(
        [sys.executable, "-m", "swiglu_train", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("pretrain summary") == 1  # rank 1 prints no table
    summary = json.loads(summary_path.read_text())
    assert summary["steps"] == 4 and summary["saved_MiB"] > 0  # CUDA-only figures are None
    assert len(list((out / "wandb").glob("offline-run-*"))) == 1
    with open(summary["memory_csv"]) as f:
        steps = [int(r["step"]) for r in csv.DictReader(f)]
    assert steps == [0, 1, 2, 3]  # one row per step, none from rank 1
    assert (out / "checkpoints" / "last.ckpt").is_file()

    cfg = PretrainConfig()  # the CLI's defaults, both ranks' rows in each micro-batch
    cfg.data.data, cfg.data.micro_batch_size = [str(corpus / "*.py")], 4
    cfg.train.max_steps, cfg.output_dir = 4, str(tmp_path / "one")
    one = run_pretrain(cfg)
    assert summary["losses"].keys() == one["losses"].keys()
    for step, loss in one["losses"].items():
        assert summary["losses"][step] == pytest.approx(loss, rel=1e-5), step


def test_cli_ddp_refuses_a_layout_once_before_launching_a_rank(tmp_path, corpus):
    """A save_factors checkpoint resumed by drop_h on two ranks: rank 0 refuses it before the
    Trainer launches rank 1, so the error is printed once and no W&B run is added."""
    data = [str(corpus / "*.py")]
    cfg = PretrainConfig()  # the CLI's model (tiny), so that only the layout differs
    cfg.model.mlp_impl, cfg.data.data, cfg.data.micro_batch_size = "save_factors", data, 2
    cfg.train.max_steps, cfg.output_dir = 1, str(tmp_path / "run")
    run_pretrain(cfg)
    runs = sorted((tmp_path / "run" / "wandb").glob("offline-run-*"))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # plain torch math
    env.update(WANDB_MODE="offline", WANDB_SILENT="true")
    args = ["pretrain", "--devices", "2", "--strategy", "ddp", "--max-steps", "2"]
    args += ["--mlp-impl", "drop_h", "--micro-batch-size", "2", "--data", data[0]]
    args += ["--output-dir", cfg.output_dir, "--resume", "last"]
    done = subprocess.run(
        [sys.executable, "-m", "swiglu_train", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert "GLOBAL_RANK: 1" not in done.stderr  # refused before the Trainer launched rank 1
    assert done.stderr.count("checkpoint fc1 layout is {'kind': 'packed'") == 1, done.stderr
    assert "pretrain summary" not in done.stdout
    assert sorted((tmp_path / "run" / "wandb").glob("offline-run-*")) == runs
