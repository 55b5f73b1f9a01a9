"""What makes ``pretrain --resume`` continue one run rather than start a second: the same W&B
run (by id) and CSV log (by version), recorded in the output dir, and a progress bar that
counts the whole run."""

from __future__ import annotations

import csv
import json
import secrets
from pathlib import Path

from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only

from swiglu_train.files import atomic_write, write_json_atomic
from swiglu_train.integrations.lightning.config import PretrainConfig
from swiglu_train.memory.wandb_run import wandb_mode

RUN_FILE = "run.json"  # in the output dir: the W&B run id and CSV version its resumes continue


def run_loggers(
    cfg: PretrainConfig, out: Path, resume_step: int | None
) -> tuple[WandbLogger, CSVLogger]:
    """The W&B and CSV loggers of a run in ``out``.

    A resume (``resume_step``: the checkpoint's step) continues the W&B run and CSV version that
    ``out/run.json`` names: W&B resumes the run by id (offline, each resume adds a run directory
    of the same id, which ``wandb sync`` and compare-memory join), and the CSV keeps its rows
    before ``resume_step`` (those from there on are logged again). A fresh run, or a resume
    into a dir that records no run, starts new ones and records them for its own resumes.
    """
    record = out / RUN_FILE
    ids = _read_record(record) if resume_step is not None and record.is_file() else {}
    if resume_step is not None and not ids:
        rank_zero_info(f"--resume: {out} records no run ({RUN_FILE}); this run logs to a new "
                       "W&B run and CSV version")  # fmt: skip
    wandb_logger = WandbLogger(
        project=cfg.wandb.project,
        group=cfg.wandb.group,
        name=cfg.wandb.name or cfg.model.mlp_impl,
        save_dir=str(out),
        mode=wandb_mode(),
        config=cfg.to_dict(),
        id=ids.get("wandb_run_id") or secrets.token_hex(4),  # W&B ids: letters and digits
    )
    # Lightning passes anonymous=None to wandb.init, where any value is a deprecated setting that
    # prints "The anonymous setting has no effect" at every run: leave it unset.
    wandb_logger._wandb_init.pop("anonymous", None)
    csv_logger = ContinuedCSVLogger(
        out, name="csv", version=ids.get("csv_version"), resume_step=resume_step
    )
    if rank_zero_only.rank == 0:  # the other ranks neither log nor record
        ids = {"wandb_run_id": wandb_logger.version, "csv_version": csv_logger.version}
        write_json_atomic(record, ids)
    return wandb_logger, csv_logger


def _read_record(path: Path) -> dict:
    try:
        ids = json.loads(path.read_text())
        if isinstance(ids["wandb_run_id"], str) and isinstance(ids["csv_version"], int):
            return ids
    except (ValueError, KeyError, TypeError):
        pass
    raise ValueError(
        f"--resume: {path} is not a run record (wandb_run_id, csv_version); delete it to log "
        "the resumed run to a new W&B run and CSV version"
    )


class ContinuedCSVLogger(CSVLogger):
    """Lightning's CSVLogger, which on resume keeps the rows its version already holds before
    ``resume_step`` (Lightning's deletes the file of a version that exists)."""

    def __init__(self, *args, resume_step: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._resume_step = resume_step

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _ContinuedWriter(self.log_dir, self._resume_step)
        return self._experiment


class _ContinuedWriter(ExperimentWriter):
    def __init__(self, log_dir: str, resume_step: int | None) -> None:
        self._resume_step = resume_step
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:
        """Called once, at construction, where Lightning's deletes an existing metrics.csv."""
        path = Path(self.metrics_file_path)
        if self._resume_step is None or not path.is_file():
            super()._check_log_dir_exists()
            return
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            kept = [r for r in reader if int(float(r["step"])) < self._resume_step]
            columns = list(reader.fieldnames or [])
        with atomic_write(path, newline="") as f:
            writer = csv.DictWriter(f, columns)
            writer.writeheader()
            writer.writerows(kept)
        self.metrics_keys = columns  # the header that later rows append under (or extend)


class StepProgressBar(RichProgressBar):
    """Lightning's rich bar for a run of ``max_steps`` in one endless epoch. Its count is the
    micro-batches of the whole run, which continues across a resume, so its total is the whole
    run's too (Lightning's is the steps left: '160/9' on resume); and it names no epoch count
    (Lightning's reads 'Epoch 0/-2' with max_epochs=-1)."""

    @property
    def total_train_batches(self) -> int:
        return self.trainer.max_steps * self.trainer.accumulate_grad_batches

    def _get_train_description(self, current_epoch: int) -> str:
        return f"{'Training':{len(self.validation_description)}}"
