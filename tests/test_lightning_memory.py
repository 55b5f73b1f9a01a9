"""MemoryProfilerCallback inside a real Lightning Trainer, logging to CSV and W&B offline."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from memory_models import Stack

from swiglu_train.integrations.lightning import MemoryProfilerCallback
from swiglu_train.integrations.lightning.memory_callback import _fold_backward
from swiglu_train.memory import MemoryProfiler, StepMemory

M, D, FFN, LAYERS, BATCHES = 12, 16, 24, 3, 8


class StackModule(pl.LightningModule):
    def __init__(self, impl: str) -> None:
        super().__init__()
        self.model = Stack(LAYERS, D, FFN, impl)

    def training_step(self, batch, batch_idx):
        return self.model(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        # Separate tensors: a view into one big batch tensor would count that whole storage.
        batches = [torch.randn(M, D) for _ in range(BATCHES)]
        return torch.utils.data.DataLoader(batches, batch_size=None)


def expected_saved_bytes(impl: str) -> int:
    torch.manual_seed(0)
    model = Stack(LAYERS, D, FFN, impl)
    profiler = MemoryProfiler(model)
    with profiler.step(0) as p:
        loss = model(torch.randn(M, D))
        p.forward_done()
        loss.backward()
    return profiler.records[0].saved_bytes


def fit(tmp_path: Path, impl: str, accumulate: int, loggers: list) -> MemoryProfilerCallback:
    torch.manual_seed(0)
    callback = MemoryProfilerCallback()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=3,
        accumulate_grad_batches=accumulate,
        logger=loggers,
        callbacks=[callback],
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(StackModule(impl))
    return callback


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_csv_rows_per_optimizer_step_with_exact_bytes(tmp_path, accumulate):
    callback = fit(tmp_path, "drop_h", accumulate, [CSVLogger(tmp_path)])
    rows = read_csv(callback.csv.path)
    assert [int(r["step"]) for r in rows] == [0, 1, 2]  # one row per optimizer step
    expected = expected_saved_bytes("drop_h") / 2**20
    for row in rows:
        assert float(row["memory/saved_MiB"]) == pytest.approx(expected, rel=1e-12)
        assert float(row["memory/impl/drop_h/saved_MiB"]) > 0
        assert {f"memory/layer/{i}/saved_MiB" for i in range(LAYERS)} <= row.keys()
    lightning_csv = read_csv(Path(callback.csv.path).parent / "metrics.csv")
    assert any(r.get("memory/saved_MiB") for r in lightning_csv)  # through trainer.loggers too


def test_wandb_offline_run_holds_memory_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    # offline=True besides the environment: wandb's settings singleton, set up by an earlier
    # test in the same worker, would otherwise keep its mode and ask for an API key
    logger = WandbLogger(
        project="swiglu-test", save_dir=tmp_path, offline=True, config={"mlp_impl": "normal"}
    )
    callback = fit(tmp_path, "normal", 1, [logger])
    run_path = Path(logger.experiment.dir).parent
    config = dict(logger.experiment.config)
    assert config["mlp_impl"] == "normal" and config["num_layers"] == LAYERS
    assert (config["hidden_size"], config["ffn_hidden_size"]) == (D, FFN)
    assert config["micro_batch_shape"] == [M, D]
    logger.experiment.finish()
    assert callback.csv.path == run_path / "memory.csv"  # the CSV sits in the W&B run dir
    wandb_cli = Path(sys.executable).with_name("wandb")
    out = subprocess.run(
        [str(wandb_cli), "leet", "inspect", "--json", str(run_path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    history = [
        json.loads(line)["history"]["item"] for line in out.splitlines() if '"history"' in line
    ]
    memory_rows = [h for h in history if "memory/saved_MiB" in h]
    assert [h["trainer/global_step"] for h in memory_rows] == [0, 1, 2]
    expected = expected_saved_bytes("normal") / 2**20
    assert all(h["memory/saved_MiB"] == pytest.approx(expected) for h in memory_rows)
    assert callback.max_metrics["memory/saved_MiB"] == pytest.approx(expected)


class DestroyGroupAtTeardown(pl.Callback):
    """ddp_spawn's workers leave through os._exit, which skips the atexit handler where
    Lightning destroys the process group; gloo's threads then abort the worker at interpreter
    teardown (SIGABRT, "terminate called without an active exception": pytorch issue 190489),
    seen once in CI. Destroy it while the interpreter is alive, after every rank is done."""

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def test_ddp_rank_zero_alone_writes_the_csv(tmp_path):
    """Two CPU ranks (gloo): one CSV row per optimizer step, none duplicated by rank 1."""
    callback = MemoryProfilerCallback(csv_path=tmp_path / "memory.csv")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_steps=2,
        logger=False,
        callbacks=[callback, DestroyGroupAtTeardown()],
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(StackModule("drop_h"))
    rows = read_csv(tmp_path / "memory.csv")
    assert [int(r["step"]) for r in rows] == [0, 1]
    expected = expected_saved_bytes("drop_h") / 2**20
    assert all(float(r["memory/saved_MiB"]) == pytest.approx(expected) for r in rows)


def test_outside_a_trainer_records_are_empty_and_hooks_say_why_they_cannot_run():
    callback = MemoryProfilerCallback()
    assert callback.records == [] and callback.max_metrics == {} and callback.csv is None
    with pytest.raises(RuntimeError, match=r"on_train_batch_start called before setup: .*"
                       r"pl\.Trainer\(callbacks=\[\.\.\.\]\)"):  # fmt: skip
        callback.on_train_batch_start(None, None, torch.zeros(2), 0)
    with pytest.raises(RuntimeError, match=r"on_before_backward called before setup"):
        callback.on_before_backward(None, None, torch.zeros(()))
    with pytest.raises(RuntimeError, match=r"on_after_backward called before setup"):
        callback.on_after_backward(None, None)


def test_records_hold_one_figure_per_micro_batch_after_fit(tmp_path):
    callback = fit(tmp_path, "drop_h", 2, [CSVLogger(tmp_path)])
    assert [r.step for r in callback.records] == [0, 0, 1, 1, 2, 2]
    assert callback.records[-1].saved_bytes == expected_saved_bytes("drop_h")


class SkippingModule(StackModule):
    """Returns None (Lightning skips backward) on the batches listed in ``skip``."""

    def __init__(self, skip: set[int]) -> None:
        super().__init__("drop_h")
        self.skip = skip

    def training_step(self, batch, batch_idx):
        loss = self.model(batch)
        return None if batch_idx in self.skip else loss


class TwoBackwardModule(StackModule):
    """Manual optimization with two forward/backward pairs per training_step."""

    def __init__(self) -> None:
        super().__init__("drop_h")
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        for _ in range(2):
            self.manual_backward(self.model(batch))
        optimizer.step()
        optimizer.zero_grad()


def fit_module(tmp_path: Path, module: pl.LightningModule) -> MemoryProfilerCallback:
    callback = MemoryProfilerCallback(csv_path=tmp_path / "memory.csv")
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        callbacks=[callback],
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module)
    return callback


def test_a_none_loss_on_the_last_batch_leaves_no_hooks_after_fit(tmp_path):
    module = SkippingModule(skip={BATCHES - 1})
    fit_module(tmp_path, module)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in module.modules())
    rows = read_csv(tmp_path / "memory.csv")
    assert [int(r["step"]) for r in rows] == list(range(BATCHES - 1))  # no row for the skipped


def test_manual_optimization_measures_each_backward(tmp_path):
    callback = fit_module(tmp_path, TwoBackwardModule())
    assert [r.step for r in callback.records] == [s for s in range(BATCHES) for _ in range(2)]
    assert all(r.saved_bytes == expected_saved_bytes("drop_h") for r in callback.records)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert [int(r["step"]) for r in read_csv(tmp_path / "memory.csv")] == list(range(BATCHES))


class TwoLossesOneForwardModule(StackModule):
    """Manual optimization: one forward, two losses, each through manual_backward."""

    def __init__(self) -> None:
        super().__init__("normal")  # drop_h backpropagates in place: no retain_graph
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = self.model(batch)
        self.manual_backward(loss, retain_graph=True)
        self.manual_backward(2 * loss)  # mul by a constant saves nothing: no forward of its own
        optimizer.step()
        optimizer.zero_grad()


def test_manual_optimization_two_losses_of_one_forward_make_one_figure(tmp_path):
    callback = fit_module(tmp_path, TwoLossesOneForwardModule())
    expected = expected_saved_bytes("normal")
    assert [(r.step, r.saved_bytes) for r in callback.records] == [
        (s, expected) for s in range(BATCHES)
    ]  # no empty record for the second backward
    assert all(len(r.layers) == LAYERS and r.saved_tensors > 0 for r in callback.records)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    rows = read_csv(tmp_path / "memory.csv")
    assert [int(r["step"]) for r in rows] == list(range(BATCHES))
    assert all(float(r["memory/saved_MiB"]) == pytest.approx(expected / 2**20) for r in rows)


def test_a_folded_backward_s_peak_is_moved_onto_the_forward_s_start():
    """CUDA figures are relative to each record's start; the fold re-bases the second peak."""
    forward = StepMemory(step=0, saved_bytes=100, allocated_MiB=10.0, backward_peak_MiB=5.0)
    forward.saved_tensors = 3
    # Began after the first backward, 4 MiB higher (grads, the retained graph); peaked 3 above.
    again = StepMemory(step=0, saved_bytes=0, allocated_MiB=14.0, backward_peak_MiB=3.0)
    _fold_backward(forward, again)
    assert forward.backward_peak_MiB == 7.0 and forward.saved_bytes == 100
    lower = StepMemory(step=0, saved_bytes=0, allocated_MiB=11.0, backward_peak_MiB=1.0)
    _fold_backward(forward, lower)
    assert forward.backward_peak_MiB == 7.0  # a lower second peak changes nothing
    on_cpu = StepMemory(step=0, saved_bytes=0)
    _fold_backward(forward, on_cpu)
    assert forward.backward_peak_MiB == 7.0


class ValidatedModule(StackModule):
    def validation_step(self, batch, batch_idx):
        return self.model(batch)

    def val_dataloader(self):
        return self.train_dataloader()


def test_validate_after_fit_keeps_the_fit_s_records(tmp_path):
    module = ValidatedModule("drop_h")
    callback = MemoryProfilerCallback(csv_path=tmp_path / "memory.csv")
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=2,
        limit_val_batches=1,
        logger=False,
        callbacks=[callback],
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module)
    trainer.validate(module, verbose=False)
    assert [r.step for r in callback.records] == [0, 1]
