"""Run a pretraining job from a :class:`PretrainConfig`: Trainer, loggers, checkpoints, summary."""

from __future__ import annotations

import dataclasses
import os
import time
import zipfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn

from swiglu_train.extras import require
from swiglu_train.integrations.lightning.checkpoint_record import LAYOUT_KEY
from swiglu_train.integrations.lightning.config import PretrainConfig, check_ranges
from swiglu_train.integrations.lightning.data import PackedTextData
from swiglu_train.integrations.lightning.float8 import check_float8, check_float8_run
from swiglu_train.integrations.lightning.fsdp2 import FSDP2, check_fsdp2, trainer_strategy
from swiglu_train.integrations.lightning.host_model import STOCK, stock_note
from swiglu_train.integrations.lightning.memory_callback import MemoryProfilerCallback
from swiglu_train.integrations.lightning.model import (
    check_checkpoint_layers,
    check_impl,
    check_mlp_chunk,
    check_model_saved_fp8,
    check_moe,
)
from swiglu_train.integrations.lightning.module import PretrainModule, mlp_impl, swiglu_mlps
from swiglu_train.integrations.lightning.moe import experts_impl
from swiglu_train.integrations.lightning.planner import check_plan_settings, plan_run
from swiglu_train.integrations.lightning.precision import resolve_precision
from swiglu_train.integrations.lightning.pretune_hint import log_pretune_hints
from swiglu_train.integrations.lightning.quiet import quiet_lightning
from swiglu_train.integrations.lightning.resume import StepProgressBar, run_loggers
from swiglu_train.integrations.lightning.sharded_checkpoint import (
    INDEX,
    consolidate,
    is_sharded,
    read_meta,
)
from swiglu_train.layers.registry import AUTO
from swiglu_train.memory.wandb_run import CSV_NAME


class LossAndThroughput(pl.Callback):
    """Per-optimizer-step mean loss over every rank, and tokens/s measured after the first
    (warm-up) step. Step 0's loss is kept in the run's checkpoints, so that a resumed run's
    summary reports the run's initial loss, not its own first step's."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}
        self.initial_loss: float | None = None  # None: resumed from a checkpoint that lacks it
        self._micro: list[float] = []
        self._tokens = 0
        self._start: float | None = None
        self.tokens_per_s: float | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        # Each rank's loss is its own rows'; the step's is their mean (equal row counts), so a
        # run on N devices reads as one device at the same global batch. The next-token loss
        # (training_step's lm_loss), not the objective backward took (with an MoE model's
        # load-balancing loss, and divided by the accumulation).
        loss = trainer.strategy.reduce(outputs["lm_loss"], reduce_op="mean")
        self._micro.append(float(loss))
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        step = trainer.global_step - 1
        self.losses[step] = sum(self._micro) / len(self._micro)
        self._micro.clear()
        if step == 0:
            self.initial_loss = self.losses[step]
        if self._start is None:  # timing starts once compilation and autotuning are done
            self._start = time.perf_counter()
            return
        self._tokens += batch[:, :-1].numel() * trainer.accumulate_grad_batches * trainer.world_size
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()
        self.tokens_per_s = self._tokens / (time.perf_counter() - self._start)

    def state_dict(self) -> dict[str, Any]:
        return {"initial_loss": self.initial_loss}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.initial_loss = state_dict.get("initial_loss")


class StepCheckpoint(ModelCheckpoint):
    """Every ``every_n_train_steps`` steps, and ``last.ckpt`` also when training ends between
    two of them: else the final steps' weights are lost, and ``--resume last`` of a finished
    run trains those steps again instead of being refused."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


def run_pretrain(
    cfg: PretrainConfig, resume: str | None = None, init_from: str | None = None
) -> dict[str, Any] | None:
    """Train, and return the summary (losses, throughput and the profiler's memory figures);
    None on DDP ranks other than 0, whose losses and memory are their shard's, not the run's
    (the profiler and W&B run live on rank 0).

    ``resume`` continues a run from its checkpoint (weights, optimizer, loop and loader
    state); ``init_from`` starts a new run from a checkpoint's weights alone (one that
    import-hf wrote, say), with the model shape they fix."""
    if resume is not None and init_from is not None:
        raise ValueError("--resume continues a run and --init-from starts a new one from a "
                         "checkpoint's weights; pass one of them")  # fmt: skip
    weights = None if init_from is None else _initial_weights(Path(init_from), cfg)
    check_impl(cfg.model)  # an unknown impl fails here, listing the valid ones; stock's needs
    check_moe(cfg.model)  # again: command-line flags are set after the config is built
    check_mlp_chunk(cfg.model)
    on_gpu = torch.cuda.is_available() and cfg.train.accelerator != "cpu"
    gpu = torch.cuda.current_device() if on_gpu else None
    check_model_saved_fp8(cfg.model, gpu=gpu)
    check_float8(cfg.model.float8, cfg.model.mlp_impl, cfg.model.num_experts)
    check_float8_run(cfg.model.float8, cfg.train.activation_checkpointing, gpu)
    check_ranges(cfg)
    check_checkpoint_layers(cfg.model)
    precision = resolve_precision(cfg.train.precision, cfg.train.accelerator)
    if cfg.train.strategy == FSDP2:
        check_fsdp2(precision)
    check_plan_settings(cfg, resuming=resume is not None)
    require("wandb")  # the logger's: before the planner's minutes, as the CLI does
    if cfg.model.mlp_impl == AUTO and cfg.model.mlp_tokens_hint is None:  # one micro-batch
        cfg.model.mlp_tokens_hint = cfg.data.micro_batch_size * cfg.data.seq_length
    out = Path(cfg.output_dir)
    # Before W&B and the output dir: a refused resume leaves no run and writes nothing. Its fc1
    # layout is checked once the model is built, the data settings it recorded once the corpus
    # is loaded and the world size known.
    ckpt_path, resumed = _checkpoint(resume, out, cfg)
    plan = None  # --activation-checkpointing auto: measured now, set on cfg.model
    if cfg.train.activation_checkpointing == "auto":
        plan = plan_run(cfg, log=rank_zero_info)
        rank_zero_info(f"plan: {plan['why']}")
    pl.seed_everything(cfg.train.seed, workers=True)
    stock = cfg.model.mlp_impl == STOCK
    module = PretrainModule(cfg.model, cfg.optim, cfg.train.max_steps)
    experts_note = (
        stock_note(module.model)
        if stock
        else experts_impl(cfg.model.mlp_impl, cfg.model.hidden_size, cfg.model.ffn_hidden_size)[1]
    )
    if cfg.model.num_experts and experts_note:
        rank_zero_info(f"routed experts: {experts_note}")
    if cfg.train.accelerator != "cpu":
        log_pretune_hints(module, cfg.data.micro_batch_size * cfg.data.seq_length, precision)
    if weights is not None:  # ParMLP's load hook packs or unpacks fc1 for its impl
        module.load_state_dict(weights)
    if resumed is not None:
        # The module's own check (Lightning runs it again on load), against the model as built:
        # "auto" resolves in each ParMLP from the table, this machine's GPU and the tokens hint,
        # so the layout it picks is known here, not from the config. A DDP rank Lightning
        # launches later runs this too: the error carries the process's rank (0 prints it).
        module.check_layout(resumed, rank=rank_zero_only.rank)
    data = PackedTextData(cfg.data, cfg.model.vocab_size)
    data.setup("fit")  # here, so a corpus too small to validate on turns validation off
    if data.has_validation and cfg.train.val_check_interval > cfg.train.max_steps:
        rank_zero_warn(  # Lightning validates on the interval only, never at the end of fit
            f"train.val_check_interval={cfg.train.val_check_interval} is more than "
            f"max_steps={cfg.train.max_steps}: this run never validates and its summary's "
            "val_loss is None; lower val_check_interval to validate"
        )
    out.mkdir(parents=True, exist_ok=True)
    # In the output dir, not the W&B run's: each resume adds a W&B run directory (offline),
    # while this one file holds the whole run (MemoryCsv keeps the rows before a resume).
    memory = MemoryProfilerCallback(per_layer=True, csv_path=out / CSV_NAME)
    history = LossAndThroughput()
    resume_step = None if resumed is None else resumed["global_step"]
    wandb_logger, csv_logger = run_loggers(cfg, out, resume_step)
    if plan is not None:  # its choice is in the config already; this adds what it measured
        wandb_logger.experiment.config.update({"plan": plan}, allow_val_change=True)
    checkpoints = StepCheckpoint(
        dirpath=out / "checkpoints",
        every_n_train_steps=cfg.train.checkpoint_every,
        save_last=True,
        save_top_k=-1,
    )
    with quiet_lightning():  # Lightning's tip and deprecation warning, not the user's
        trainer = pl.Trainer(
            max_steps=cfg.train.max_steps,
            precision=precision,
            accelerator=cfg.train.accelerator,
            devices=cfg.train.devices,
            strategy=trainer_strategy(cfg.train.strategy, cfg.train.devices),
            accumulate_grad_batches=cfg.train.accumulate_grad_batches,
            gradient_clip_val=cfg.train.gradient_clip_val,
            # Lightning counts micro-batches; the config, like max_steps, counts optimizer steps.
            val_check_interval=cfg.train.val_check_interval * cfg.train.accumulate_grad_batches,
            limit_val_batches=None if data.has_validation else 0,
            check_val_every_n_epoch=None,
            log_every_n_steps=cfg.train.log_every_n_steps,
            logger=[wandb_logger, csv_logger],
            callbacks=[memory, history, checkpoints, StepProgressBar()],
            use_distributed_sampler=False,  # the step sampler shards by rank itself
            default_root_dir=out,
            num_sanity_val_steps=0,
        )
        module.data_record = data_record(cfg, data, trainer.world_size)
        if ckpt_path is not None:
            _check_data(Path(ckpt_path), resumed[LAYOUT_KEY].get("data"), module.data_record)
        try:
            trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
        finally:  # a crashed run must not stay the process's active W&B run
            wandb_logger.experiment.finish()
    if not trainer.is_global_zero:
        return None
    losses = [history.losses[k] for k in sorted(history.losses)]
    val = trainer.callback_metrics.get("val/loss")
    mem = memory.max_metrics
    mlps = swiglu_mlps(module.model)  # an MoE model's first: its routed experts
    run = wandb_logger.experiment  # finished, and still naming where it went
    return {
        "mlp_impl": mlp_impl(module.model),  # what ran: "auto" as resolved; stock: the host's
        "mlp_auto_reason": getattr(mlps[0], "auto_reason", None) if mlps else None,
        "num_experts": cfg.model.num_experts,  # 0: dense MLPs
        # transformers' own experts' code in a stock HF MoE model (else None: ours, or none)
        "experts_implementation": getattr(module.model, "experts_implementation", None),
        "saved_fp8": bool(mlps) and mlps[0].saved_fp8,  # mlp_impl's saved preactivation in FP8
        "float8": cfg.model.float8,  # the linears' FP8 recipe (torchao), None for bf16
        "seed": cfg.train.seed,
        "steps": trainer.global_step,
        "initial_loss": history.initial_loss,  # step 0's, across a resume
        "final_loss": losses[-1] if losses else None,
        "val_loss": float(val) if val is not None else None,
        "losses": {str(k): v for k, v in sorted(history.losses.items())},
        "tokens_per_s": history.tokens_per_s,
        "saved_MiB": mem.get("memory/saved_MiB"),
        "after_forward_MiB": mem.get("memory/after_forward_MiB"),
        "peak_MiB": mem.get("memory/peak_MiB"),
        "memory_csv": str(memory.csv.path) if memory.csv else None,
        "output_dir": str(out),
        "checkpoint_dir": str(out / "checkpoints"),  # as given (Lightning resolves dirpath)
        "wandb_run_dir": run.settings.sync_dir,  # this segment's, offline or online
        "wandb_url": None if run.offline else run.url,  # offline, wandb warns that it has none
        "checkpoint_layers": cfg.model.checkpoint_layers,
        "micro_batch_size": cfg.data.micro_batch_size,  # as ran: the plan's with auto
        "accumulate_grad_batches": cfg.train.accumulate_grad_batches,
        "plan": plan,
    }


# The model's shape, which a checkpoint's weights fix; mlp_impl, mlp_chunk and the tokens hint may
# change (a layout change with optimizer state is refused before start and on load, naming the
# fix).
SHAPE_KEYS = ("vocab_size", "hidden_size", "ffn_hidden_size", "num_layers", "num_heads",
              "num_experts")  # fmt: skip
# What else of the model's config a checkpoint's weights were trained with: --init-from takes
# these with the shape.
ARCH_KEYS = (*SHAPE_KEYS, "max_seq_length", "rope_theta", "norm_eps", "moe_top_k",
             "moe_renormalize")  # fmt: skip
# Restored from the optimizer state on resume, whatever the config says now.
OPTIMIZER_STATE_KEYS = ("lr", "weight_decay", "betas")


def data_record(cfg: PretrainConfig, data: PackedTextData, world_size: int) -> dict[str, Any]:
    """What fixes the batches a run draws, for its checkpoints (a resume may change it, with a
    warning): the corpus (its sources as absolute paths, and its token count, which an edited
    or regenerated file changes), the batch shape and what places each batch (accumulation,
    ranks, held-out split, sampler seed)."""
    sources = cfg.data.data
    return {
        "corpus": [os.path.abspath(s) for s in sources] if sources else "stdlib",
        "corpus_tokens": data.corpus_tokens,
        "seq_length": cfg.data.seq_length,
        "micro_batch_size": cfg.data.micro_batch_size,
        "accumulate_grad_batches": cfg.train.accumulate_grad_batches,
        "world_size": world_size,
        "val_fraction": cfg.data.val_fraction,
        "data_seed": cfg.data.seed,
    }


def _checkpoint(
    resume: str | None, out: Path, cfg: PretrainConfig
) -> tuple[str | None, dict | None]:
    """The checkpoint to resume, checked before Lightning reads it, and what of it the checks
    after the model build read (see _check_resumable; None: no resume); for a fresh run, a
    refusal of an output dir that holds another run's checkpoints (its ``last`` would be
    ambiguous)."""
    if resume is None:
        earlier = sorted((out / "checkpoints").glob("*.ckpt"))
        if earlier:
            raise ValueError(
                f"{out} already holds another run's checkpoints ({earlier[-1].name}, ...): "
                "continue that run with --resume last, or give this one a new --output-dir"
            )
        return None, None
    path = out / "checkpoints" / "last.ckpt" if resume == "last" else Path(resume)
    resumed = _check_resumable(path, cfg)
    sharded = [p.name for p in sorted((out / "checkpoints").glob("*.ckpt")) if p.is_dir()]
    if sharded and cfg.train.strategy != FSDP2:  # Lightning's file save fails on a directory
        raise ValueError(
            f"--resume: {out / 'checkpoints'} holds sharded checkpoints ({sharded[0]}, ...), "
            f"which the one-file saves of --strategy {cfg.train.strategy} cannot replace: "
            "resume with --strategy fsdp2, or into another --output-dir"
        )
    return str(path), resumed


def _check_resumable(path: Path, cfg: PretrainConfig) -> dict:
    """Refuse, in one line, what Lightning would fail on deep inside (a damaged file, a bare
    state_dict, another model shape) or do silently (train no step, ignore optim changes).
    Returns its ``swiglu_train`` record (fc1 layout, data settings; empty in a checkpoint from
    elsewhere), whether it holds optimizer state and its step: all that
    PretrainModule.check_layout, _check_data and run_loggers read, so that the checkpoint
    itself is not kept open meanwhile."""
    sharded = is_sharded(path)
    if sharded and cfg.train.strategy != FSDP2:
        raise ValueError(
            f"--resume: {path} is a sharded checkpoint (a directory, as --strategy fsdp2 "
            f"writes): resume it with --strategy fsdp2 (any --devices), or write it as one "
            f"file first (swiglu-train consolidate {path} FILE.ckpt) and resume that"
        )
    # A sharded one's weights load shard by shard inside Lightning: here, its meta.pt alone
    ckpt = read_meta(path, "--resume") if sharded else _read_checkpoint(path, "--resume")
    if not isinstance(ckpt, dict) or "pytorch-lightning_version" not in ckpt:
        raise ValueError(
            f"--resume: {path} is not a pretrain checkpoint (a bare state_dict, as convert "
            "--to hf writes, holds no optimizer or loop state to resume)"
        )
    if "optimizer_states" not in ckpt:
        raise ValueError(
            f"--resume: {path} holds weights only (no optimizer or loop state, as import-hf "
            "writes); start a new run from them with --init-from"
        )
    hparams = ckpt.get("hyper_parameters", {})
    differ = _changed(hparams.get("model", {}), dataclasses.asdict(cfg.model), SHAPE_KEYS)
    if differ:
        raise ValueError(f"--resume: {path} holds a model of another shape ({', '.join(differ)})")
    step = ckpt.get("global_step", 0)
    if step >= cfg.train.max_steps:
        raise ValueError(f"--resume: {path} is at step {step} and max_steps is "
                         f"{cfg.train.max_steps}: nothing to train; raise --max-steps")  # fmt: skip
    optim = dataclasses.asdict(cfg.optim)
    ignored = _changed(hparams.get("optim", {}), optim, OPTIMIZER_STATE_KEYS)
    if ignored:
        rank_zero_warn(
            f"--resume restores lr, weight_decay and betas from {path.name}'s optimizer "
            f"state; the config's change is not used ({', '.join(ignored)})"
        )
    return {
        LAYOUT_KEY: ckpt.get(LAYOUT_KEY, {}),
        "optimizer_states": bool(ckpt.get("optimizer_states")),
        "global_step": step,
    }


def _read_checkpoint(path: Path, flag: str) -> object:
    """``torch.load`` of a file the user named (a sharded checkpoint: its consolidation),
    refused in one line if it is none."""
    if is_sharded(path):
        return consolidate(path, flag)
    if path.is_dir():
        raise ValueError(
            f"{flag}: {path} is a directory but no sharded checkpoint (it has no {INDEX} "
            "index): pass a .ckpt file or a sharded checkpoint directory"
        )
    if not path.is_file():
        raise FileNotFoundError(f"{flag}: no checkpoint at {path}")
    if not zipfile.is_zipfile(path):  # torch.save writes a zip; its index sits at the end
        size = path.stat().st_size
        raise ValueError(f"{flag}: {path} is not a readable checkpoint ({size} bytes, not a "
                         "torch.save zip: empty, truncated or another format)")  # fmt: skip
    try:  # mmap: the tensors stay on disk, so a large checkpoint is not read twice
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as e:  # torch raises EOFError, OSError, KeyError... for a damaged file
        raise ValueError(f"{flag}: {path} is not a readable checkpoint "
                         f"({type(e).__name__}: {e or 'empty file'})") from e  # fmt: skip


def _initial_weights(path: Path, cfg: PretrainConfig) -> dict:
    """A checkpoint's weights, for a new run; its model shape (ARCH_KEYS) replaces the
    config's, each change named."""
    ckpt = _read_checkpoint(path, "--init-from")
    saved = ckpt.get("hyper_parameters", {}).get("model") if isinstance(ckpt, dict) else None
    if not isinstance(saved, dict) or not isinstance(ckpt.get("state_dict"), dict):
        raise ValueError(
            f"--init-from: {path} is not a pretrain checkpoint (no state_dict with "
            "hyper_parameters.model): pass what pretrain or import-hf wrote"
        )
    changed = _changed(dataclasses.asdict(cfg.model), saved, ARCH_KEYS)
    for key in ARCH_KEYS:
        if key in saved:
            setattr(cfg.model, key, saved[key])
    if changed:
        rank_zero_info(f"--init-from: the model takes {path.name}'s shape ({', '.join(changed)})")
    return ckpt["state_dict"]


def _check_data(path: Path, saved: dict | None, now: dict) -> None:
    """Warn, in one line, of each data setting the resumed run changes: legitimate, but its
    batches from here on are not those the interrupted run would have drawn."""
    if saved is None:
        rank_zero_info(f"--resume: {path.name} records no data settings (an older checkpoint); "
                       "a change of corpus or batch size is not checked")  # fmt: skip
        return
    changed = _changed(saved, now, tuple(now))
    if changed:
        rank_zero_warn(
            f"--resume continues {path.name} on other data settings ({', '.join(changed)}); "
            "its batches from here on differ from those of an uninterrupted run"
        )


def _changed(saved: dict, now: dict, keys: tuple[str, ...]) -> list[str]:
    """'key old -> new' for each of ``keys`` the checkpoint recorded with another value."""

    def plain(v: object) -> object:  # a tuple comes back from some checkpoints as a list
        return list(v) if isinstance(v, tuple | list) else v

    return [f"{k} {saved[k]} -> {now[k]}" for k in keys
            if k in saved and plain(saved[k]) != plain(now[k])]  # fmt: skip
