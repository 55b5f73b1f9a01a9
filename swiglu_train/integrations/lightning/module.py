"""The pretraining LightningModule: next-token loss, AdamW, warmup then cosine decay."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from swiglu_train.integrations.lightning.checkpoint_record import LAYOUT_KEY
from swiglu_train.integrations.lightning.float8 import convert_float8
from swiglu_train.integrations.lightning.fsdp2 import is_fully_sharded, shard
from swiglu_train.integrations.lightning.host_model import STOCK
from swiglu_train.integrations.lightning.model import LlamaDecoder, ModelConfig, compiles_blocks
from swiglu_train.layers import ParMLP
from swiglu_train.layers.experts import ParExperts
from swiglu_train.layers.layout import CANONICAL


class LayoutMismatchError(ValueError):
    """A checkpoint's fc1 layout unlike the model's, with optimizer state. Every rank of a
    distributed run raises it alike, so it carries ``rank``: the CLI prints rank 0's alone."""

    def __init__(self, message: str, rank: int = 0) -> None:
        super().__init__(message)
        self.rank = rank


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
    def __init__(
        self, model: ModelConfig | dict, optim: OptimConfig | dict, max_steps: int
    ) -> None:
        """``model`` and ``optim`` may be dicts: ``load_from_checkpoint`` passes the saved
        hyper-parameters back in as they were saved, and they include ``max_steps`` so that it
        needs no argument (an older checkpoint lacks it: pass ``max_steps=``)."""
        super().__init__()
        if isinstance(model, dict):
            model = ModelConfig(**model)
        if isinstance(optim, dict):  # betas may come back as a list
            optim = OptimConfig(**{**optim, "betas": tuple(optim.get("betas", OptimConfig.betas))})
        self.save_hyperparameters(
            {"model": asdict(model), "optim": asdict(optim), "max_steps": max_steps}
        )
        self.model_cfg, self.optim_cfg, self.max_steps = model, optim, max_steps
        self.model = LlamaDecoder(model) if model.source is None else _host_model(model)
        if model.float8 is not None:  # after init: the conversion keeps the parameters
            convert_float8(self.model, model.float8)
        if compiles_blocks(model):  # after float8: the compiled blocks trace its linears
            for block in self.model.layers:
                block.compile()
        # What fixes the batches (corpus, batch shape, world size), stamped into checkpoints so
        # that a resume on other data can say so; run_pretrain sets it once the data is loaded.
        self.data_record: dict | None = None

    def configure_model(self) -> None:
        """Under --strategy fsdp2, shard the model (each block, then the root) over the device
        mesh that Lightning's ModelParallelStrategy makes; other strategies make none. Lightning
        calls this hook again on each fit, validate or test: a sharded model is left as is."""
        if self.device_mesh is not None and not is_fully_sharded(self.model):
            shard(self.model, self.device_mesh["data_parallel"], self.trainer.precision)

    def losses(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(next-token cross-entropy, the MoE load-balancing loss; None for dense MLPs)."""
        logits, aux = self.model(rows[:, :-1], with_aux_loss=True)
        return F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten()), aux

    def loss(self, rows: torch.Tensor) -> torch.Tensor:
        """What backward takes: the cross-entropy, plus moe_aux_loss_coef times the
        load-balancing loss in an MoE model."""
        return self._objective(*self.losses(rows))

    def _objective(self, lm_loss: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        return lm_loss if aux is None else lm_loss + self.model_cfg.moe_aux_loss_coef * aux

    def training_step(self, rows: torch.Tensor, batch_idx: int) -> dict[str, torch.Tensor]:
        """The objective for backward, and the next-token loss alone (``lm_loss``) for the
        summary: train/loss and val/loss are next-token losses, comparable across models."""
        lm_loss, aux = self.losses(rows)
        self.log("train/loss", lm_loss, prog_bar=True, sync_dist=True)  # all ranks' rows
        if aux is not None:
            self.log("train/aux_loss", aux, sync_dist=True)
        self.log("train/lr", self.lr_schedulers().get_last_lr()[0])
        return {"loss": self._objective(lm_loss, aux), "lm_loss": lm_loss.detach()}

    def validation_step(self, rows: torch.Tensor, batch_idx: int) -> None:
        self.log("val/loss", self.losses(rows)[0], prog_bar=True, sync_dist=True)

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

    def fc1_layout(self) -> dict:
        """The dense fc1s' layout; canonical where every MLP is routed experts, whose fc1
        every impl keeps canonical."""
        dense = [m for m in swiglu_mlps(self.model) if isinstance(m, ParMLP)]
        return (dense[0].fc1_layout if dense else CANONICAL).to_dict()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Stamp the fc1 layout and the optimizer's parameter names, so that neither the
        weights nor the per-element optimizer state are ever read in the wrong layout; and the
        data record, so that a resume on other data or batches is named."""
        names = {p: n for n, p in self.named_parameters()}
        groups = self.trainer.optimizers[0].param_groups if self._trainer else []
        checkpoint[LAYOUT_KEY] = {
            "fc1_layout": self.fc1_layout(),
            "mlp_impl": mlp_impl(self.model),  # "auto" as resolved
            "optimizer_param_names": [[names[p] for p in g["params"]] for g in groups],
        }
        if self.data_record is not None:
            checkpoint[LAYOUT_KEY]["data"] = self.data_record

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Weights convert on load (ParMLP's own hook); optimizer moments cannot, so a
        layout change with optimizer state is refused rather than silently misread."""
        self.check_layout(checkpoint)

    def check_layout(self, checkpoint: dict, rank: int | None = None) -> None:
        """Raise LayoutMismatchError, naming the flags, config keys and convert command that
        fit, where ``checkpoint`` (a Lightning checkpoint, or any dict with its
        ``swiglu_train`` record and ``optimizer_states``) holds fc1 in another layout than this
        model and optimizer state that would be misread. on_load_checkpoint calls it, and
        run_pretrain before W&B and the Trainer start; ``rank`` defaults to the trainer's."""
        # A checkpoint from elsewhere carries no stamp: canonical is the ecosystem's layout.
        saved = checkpoint.get(LAYOUT_KEY, {}).get("fc1_layout", CANONICAL.to_dict())
        if saved != self.fc1_layout() and checkpoint.get("optimizer_states"):
            layout = self.fc1_layout()
            to = f"packed --chunk {layout['chunk']}" if layout["kind"] == "packed" else "canonical"
            raise LayoutMismatchError(
                f"checkpoint fc1 layout is {saved} but the model's is {layout}; its optimizer "
                f"state would be misread. Resume with a model of the file's layout "
                f"({_settings_for(saved)}), or first convert the checkpoint to this model's "
                f"layout (swiglu-train convert --to {to} CKPT OUT); this model runs "
                f"{mlp_impl(self.model)!r} (mlp_chunk {self.model_cfg.mlp_chunk})",
                rank=self.global_rank if rank is None else rank,
            )


def swiglu_mlps(model: nn.Module) -> list[ParMLP | ParExperts]:
    """The decoder's ParMLPs and routed experts, block by block: the first one's impl is the
    run's (a dense model's ParMLP, or an MoE model's experts); none in a stock host model."""
    return [m for m in model.layers.modules() if isinstance(m, ParMLP | ParExperts)]


def mlp_impl(model: nn.Module) -> str:
    """The impl the model's MLPs run ("auto" as resolved), or "stock" where a host model keeps
    its own."""
    mlps = swiglu_mlps(model)
    return mlps[0].impl if mlps else STOCK


def _host_model(cfg: ModelConfig):
    """A Hugging Face or LitGPT model (``--model``), its MLPs patched to ``cfg.mlp_impl`` (or its
    own, with stock), its first ``cfg.checkpoint_layers`` blocks checkpointed."""
    from swiglu_train.integrations.lightning.host_model import build_host_model

    host = build_host_model(cfg.source, cfg.mlp_impl, cfg.mlp_chunk, cfg.mlp_tokens_hint,
                            cfg.saved_fp8, cfg.experts_implementation)  # fmt: skip
    host.checkpoint_layers = cfg.checkpoint_layers
    return host


def _settings_for(layout: dict) -> str:
    """The pretrain flags (and config keys) that build fc1 in ``layout``, for the error."""
    if layout.get("kind") != "packed":
        return (
            "canonical: --mlp-impl drop_h (or normal, drop_h_quack) and no --mlp-chunk, "
            "in a config model: {mlp_impl: drop_h, mlp_chunk: null}"
        )
    chunk = layout.get("chunk")
    quack = " (or save_factors_quack, whose chunk is 1)" if chunk == 1 else ""
    return (
        f"packed by {chunk}: --mlp-impl save_factors --mlp-chunk {chunk}{quack}, in a config "
        f"model: {{mlp_impl: save_factors, mlp_chunk: {chunk}}}"
    )
