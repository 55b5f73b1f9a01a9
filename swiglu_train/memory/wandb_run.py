"""Weights & Biases plumbing shared by the plain-loop logger and the Lightning callback."""

from __future__ import annotations

import netrc
import os
from pathlib import Path
from typing import Any

from swiglu_train.memory.csv_log import MemoryCsv
from swiglu_train.memory.profiler import StepMemory

CSV_NAME = "memory.csv"


def wandb_mode() -> str:
    """WANDB_MODE if set; else online when an API key is configured, offline otherwise."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        host = netrc.netrc().authenticators("api.wandb.ai")
    except (FileNotFoundError, netrc.NetrcParseError):
        host = None
    return "online" if host else "offline"


def init_run(
    project: str,
    group: str | None = None,
    name: str | None = None,
    config: dict[str, Any] | None = None,
    directory: str | Path | None = None,
):
    """Start a W&B run (offline without a key) and print where it lives."""
    import wandb

    mode = wandb_mode()
    run = wandb.init(
        project=project, group=group, name=name, config=config, dir=directory, mode=mode
    )
    print(f"wandb: {mode} run in {run_dir(run)}")
    return run


def run_dir(run) -> Path:
    """The run's own directory (``run.dir`` is its ``files/`` subfolder)."""
    return Path(run.dir).parent


def define_memory_metrics(run, step_metric: str) -> None:
    """Plot memory keys against ``step_metric`` and keep their maxima in the run summary."""
    run.define_metric(step_metric)
    run.define_metric("memory/*", step_metric=step_metric, summary="max")


class WandbMemoryLogger:
    """Logs each :class:`StepMemory` to a W&B run and to ``memory.csv`` in the run directory.

    For plain loops and Megatron; Lightning users get the same through the callback.
    """

    STEP_KEY = "memory/step"

    def __init__(self, run) -> None:
        self.run = run
        self.csv = MemoryCsv(run_dir(run) / CSV_NAME)
        define_memory_metrics(run, self.STEP_KEY)

    def log(self, record: StepMemory, extra: dict[str, float] | None = None) -> None:
        """Log one step; ``extra`` (loss, throughput) goes to W&B in the same row."""
        metrics = record.metrics()
        self.run.log({**metrics, **(extra or {}), self.STEP_KEY: record.step})
        self.csv.write(record.step, metrics)
