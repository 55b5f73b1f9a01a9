"""Lightning callback that profiles activation memory every optimizer step.

Hook points: ``on_train_batch_start`` begins a micro-batch, ``on_before_backward`` is the
after-forward point, ``on_after_backward`` ends it. Lightning frees the previous step's
gradients (``zero_grad``) after ``training_step`` and before ``on_before_backward``; the
profiler adds those freed bytes back so after-forward counts the forward's own allocations
only. Under gradient accumulation the micro-batches of one optimizer step are reduced to their
maxima (each micro-batch's graph is freed by its backward, so maxima, not sums, are what is
held at once). Under manual optimization each ``manual_backward`` closes a micro-batch and
the next one begins right after it, so several forward/backward pairs in one
``training_step`` are each measured; a backward that follows no forward of its own (two
losses of one forward, the first backward with ``retain_graph=True``) is folded into the
micro-batch of the forward whose graph it runs through, so there is one figure per forward
and no empty one. A micro-batch left open when its batch ends (a None loss skipped backward)
is dropped there, so no hook outlives the batch or the fit. Only global rank 0 logs, with its
own device's figures.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import WandbLogger

from swiglu_train.memory import MemoryCsv, MemoryProfiler, StepMemory, model_config
from swiglu_train.memory.wandb_run import CSV_NAME, define_memory_metrics, run_dir

STEP_KEY = "trainer/global_step"
_T = TypeVar("_T")


class MemoryProfilerCallback(pl.Callback):
    """Logs ``memory/...`` through the trainer's loggers and to ``memory.csv``.

    The CSV goes next to the W&B run when a ``WandbLogger`` is attached, else to
    ``trainer.log_dir`` (or ``csv_path`` if given). ``per_layer`` adds the depth curve and
    per-impl bytes at a small cost in Python hooks. Its hooks are the Trainer's to call: one
    called before the Trainer set the callback up raises a RuntimeError saying so.
    """

    def __init__(self, per_layer: bool = True, csv_path: str | Path | None = None) -> None:
        self.per_layer = per_layer
        self.csv_path = Path(csv_path) if csv_path is not None else None
        self.profiler: MemoryProfiler | None = None
        self.csv: MemoryCsv | None = None
        self._micro_batches: list[StepMemory] = []
        self._batch_start = 0  # index in _micro_batches of the current batch's first record
        self._wandb_loggers: list[WandbLogger] = []
        self.last_metrics: dict[str, float] = {}  # the latest step logged
        self.max_metrics: dict[str, float] = {}  # every key's maximum over the run

    @property
    def records(self) -> list[StepMemory]:
        """This rank's figures, one per micro-batch (per forward), oldest first; none before fit."""
        return self.profiler.records if self.profiler is not None else []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":  # trainer.validate/test after fit must not wipe the fit's records
            self.profiler = MemoryProfiler(pl_module, per_layer=self.per_layer)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        wandb_loggers = [lg for lg in trainer.loggers if isinstance(lg, WandbLogger)]
        config = {
            **model_config(pl_module),
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "world_size": trainer.world_size,
        }
        for logger in wandb_loggers:
            define_memory_metrics(logger.experiment, STEP_KEY)
            logger.experiment.config.update(config, allow_val_change=True)
        self._wandb_loggers = wandb_loggers
        path = self.csv_path
        if path is None and wandb_loggers:
            path = run_dir(wandb_loggers[0].experiment) / CSV_NAME
        if path is None:
            path = Path(trainer.log_dir or trainer.default_root_dir) / CSV_NAME
        self.csv = MemoryCsv(path)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self._wandb_loggers and trainer.global_step == 0 and batch_idx == 0:
            shape = _batch_shape(batch)
            for logger in self._wandb_loggers:
                logger.experiment.config.update({"micro_batch_shape": shape})
        profiler = self._set_up("on_train_batch_start", self.profiler, "setup")
        profiler.abort()  # a micro-batch that skipped backward (None loss) leaves no hooks
        self._batch_start = len(self._micro_batches)
        profiler.begin(trainer.global_step)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._set_up("on_before_backward", self.profiler, "setup").forward_done()

    def on_after_backward(self, trainer, pl_module) -> None:
        profiler = self._set_up("on_after_backward", self.profiler, "setup")
        record = profiler.backward_done()
        if record.saved_tensors == 0 and len(self._micro_batches) > self._batch_start:
            # No forward since the last backward of this batch: its graph was retained and run
            # again. An empty record would claim a forward that saved nothing.
            profiler.records.pop()  # backward_done appended it last
            _fold_backward(self._micro_batches[-1], record)
        else:
            self._micro_batches.append(record)
        if not pl_module.automatic_optimization:  # training_step may run another forward
            profiler.begin(trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self._set_up("on_train_batch_end", self.profiler, "setup").abort()
        step_done = (batch_idx + 1) % trainer.accumulate_grad_batches == 0 or trainer.is_last_batch
        if not step_done or not self._micro_batches:
            return
        metrics = _max_over([r.metrics() for r in self._micro_batches])
        step = self._micro_batches[0].step
        self._micro_batches.clear()
        if not trainer.is_global_zero:
            return
        csv = self._set_up("on_train_batch_end", self.csv, "on_fit_start")
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        csv.write(step, metrics)
        self.last_metrics = metrics
        self.max_metrics = _max_over([self.max_metrics, metrics])

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if self.profiler is not None:
            self.profiler.abort()

    def _set_up(self, hook: str, part: _T | None, made_by: str) -> _T:
        """``part`` of the callback that the Trainer's ``made_by`` hook makes, or an error
        that says the callback is being driven outside a Trainer (instead of an AttributeError
        on None)."""
        if part is None:
            raise RuntimeError(
                f"MemoryProfilerCallback.{hook} called before {made_by}: the callback profiles "
                "inside a Trainer; pass it as pl.Trainer(callbacks=[...]) and call trainer.fit"
            )
        return part


def _fold_backward(into: StepMemory, again: StepMemory) -> None:
    """Add a second backward through ``into``'s graph to ``into``: its peak, which ``again``
    measured over its own start, is moved onto ``into``'s start (both are absolute there)."""
    if None in (again.backward_peak_MiB, again.allocated_MiB, into.allocated_MiB):
        return  # off CUDA: no allocator figures to fold
    peak = again.allocated_MiB + again.backward_peak_MiB - into.allocated_MiB
    into.backward_peak_MiB = max(into.backward_peak_MiB or 0.0, peak)


def _max_over(metrics: list[dict[str, float]]) -> dict[str, float]:
    merged: dict[str, float] = {}
    for values in metrics:
        for key, value in values.items():
            merged[key] = max(value, merged.get(key, value))
    return merged


def _batch_shape(batch) -> list[int] | None:
    """Shape of the first tensor in a batch (a tensor, a sequence or a mapping of them)."""
    if isinstance(batch, torch.Tensor):
        return list(batch.shape)
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, list | tuple):
        return next((s for s in map(_batch_shape, batch) if s is not None), None)
    return None
