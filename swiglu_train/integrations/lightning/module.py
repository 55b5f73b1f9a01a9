"""The pretraining LightningModule: next-token loss, AdamW, warmup then cosine decay."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from swiglu_train.integrations.lightning.model import LlamaDecoder, ModelConfig

LAYOUT_KEY = "swiglu_train"


@dataclass
class OptimConfig:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to ``min_ratio`` at ``total`` steps."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class PretrainModule(pl.LightningModule):
    def __init__(self, model: ModelConfig, optim: OptimConfig, max_steps: int) -> None:
        super().__init__()
        self.save_hyperparameters({"model": asdict(model), "optim": asdict(optim)})
        self.model_cfg, self.optim_cfg, self.max_steps = model, optim, max_steps
        self.model = LlamaDecoder(model)

    def loss(self, rows: torch.Tensor) -> torch.Tensor:
        logits = self.model(rows[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten())

    def training_step(self, rows: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.loss(rows)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/lr", self.lr_schedulers().get_last_lr()[0])
        return loss

    def validation_step(self, rows: torch.Tensor, batch_idx: int) -> None:
        self.log("val/loss", self.loss(rows), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        cfg = self.optim_cfg
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay}],
            lr=cfg.lr,
            betas=cfg.betas,
            weight_decay=0.0,
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: lr_factor(step, cfg.warmup_steps, self.max_steps, cfg.min_lr_ratio),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Stamp the fc1 layout so a checkpoint is never read in the wrong one."""
        checkpoint[LAYOUT_KEY] = {"fc1_layout": "canonical", "mlp_impl": self.model_cfg.mlp_impl}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        stamp = checkpoint.get(LAYOUT_KEY)
        if stamp is None:  # a checkpoint from elsewhere: canonical is the ecosystem's layout
            return
        if stamp.get("fc1_layout") != "canonical":
            raise ValueError(
                f"checkpoint fc1 layout is {stamp.get('fc1_layout')!r}; this version reads only "
                "'canonical' checkpoints (convert it first)"
            )
