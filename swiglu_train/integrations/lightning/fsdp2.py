"""``pretrain --strategy fsdp2``: FSDP2 (torch's ``fully_shard``) through Lightning's
``ModelParallelStrategy``, data parallel only (tensor parallel is Megatron's job here).

Each transformer block is one FSDP2 unit, so at most a block or two is gathered at a time, and
the root (embedding, final norm, head) is the last one. With ``bf16-mixed`` the gathered
parameters are bf16 and gradients are reduced in fp32 over fp32 shards (torchtitan's default):
the all-gathers move half the bytes of fp32, while the optimizer and the gradient sums keep
fp32. Lightning's bf16 autocast stays on, for the ops it keeps in fp32.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from swiglu_train.integrations.lightning.checkpoint_record import LAYOUT_KEY
from swiglu_train.integrations.lightning.sharded_checkpoint import by_name, is_sharded

FSDP2 = "fsdp2"
# Lightning's ModelParallelStrategy takes these precisions; it refuses the rest in its own words
# ("Fabric(..., precision=...)"), which name neither the flag nor the strategy.
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-true")


def check_fsdp2(precision: str) -> None:
    """Refuse, in one line, a precision --strategy fsdp2 cannot run (``precision`` as
    resolved). Any device count runs, one included; tensor parallel is not offered."""
    if precision not in PRECISIONS:
        raise ValueError(
            f"--strategy fsdp2 (Lightning's ModelParallelStrategy) does not run precision "
            f"{precision!r}; use one of {', '.join(PRECISIONS)}"
        )


def device_count(devices: int | str) -> int:
    """How many processes ``devices`` starts, as Lightning counts them: a count, ``auto`` (every
    GPU, or one CPU process), ``-1`` (every GPU) or GPU ids such as ``0,1``."""
    if isinstance(devices, int):
        return devices
    text = str(devices).strip()
    if text.isdigit():
        return int(text)
    if text in ("auto", "-1"):
        return torch.cuda.device_count() if torch.cuda.is_available() else 1
    return len([i for i in text.split(",") if i.strip()])


def trainer_strategy(strategy: str, devices: int | str):
    """What the Trainer takes for ``train.strategy``: Lightning's own names pass through; fsdp2
    is a ModelParallelStrategy whose data-parallel group is every device."""
    if strategy != FSDP2:
        return strategy
    return AtomicModelParallelStrategy(
        data_parallel_size=device_count(devices), tensor_parallel_size=1
    )


class AtomicModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ModelParallelStrategy, whose sharded checkpoint replaces the one at its path
    only once written whole. Lightning's writes the new shards over the old ones in place, so a
    run killed while saving ``last.ckpt`` would leave the old index over part-new shards: read
    back as wrong weights, or not at all. Here the shards and ``meta.pt`` go to a directory
    beside it, which rank 0 then renames into place."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        path = Path(self.broadcast(str(filepath)))  # every rank writes to rank 0's path
        partial = path.with_name(f".{path.name}.partial")
        if self.global_rank == 0:
            _remove(partial)  # left by a run killed while saving
        self.barrier()
        super().save_checkpoint(checkpoint, partial, storage_options)
        self.barrier()  # every shard, and rank 0's meta.pt (written last), are on disk
        if self.global_rank == 0:
            _replace(partial, path)
        self.barrier()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict:
        """A sharded checkpoint loads as Lightning loads it. A one-file checkpoint (a
        single-device or ddp run's, or a consolidated one) loads through the model's own
        load_state_dict, so that a patched host's keys (gate/up) and fc1's layout stamp are
        read by their hooks; Lightning's sets each parameter apart, missing both. Its
        optimizer state is keyed by parameter name from the names the checkpoint records:
        Lightning's keys the i-th state to the model's i-th parameter, but our param groups
        (decayed, then not) order them otherwise, which moves moments onto other parameters,
        silently where their shapes agree."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(self.broadcast(str(checkpoint_path)))
        if is_sharded(path):
            return super().load_checkpoint(path, weights_only)
        ckpt = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
        strict = self.lightning_module.strict_loading
        options = StateDictOptions(full_state_dict=True, strict=strict)
        set_model_state_dict(self.model, ckpt.pop("state_dict"), options=options)
        names = ckpt.get(LAYOUT_KEY, {}).get("optimizer_param_names")  # the first optimizer's
        states = ckpt.get("optimizer_states", [])
        for i, (optimizer, state) in enumerate(zip(self.optimizers, states, strict=True)):
            named = by_name(state, names if i == 0 else None, f"--resume: {path}")
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=named, options=options)
        return ckpt  # what Lightning restores next: loops, schedulers, callbacks, hooks


def _replace(new: Path, path: Path) -> None:
    """Put ``new`` at ``path``, a file or directory, and only then delete what was there. A
    crash between the two renames leaves no ``path`` (a resume says so) and both versions."""
    old = path.with_name(f".{path.name}.old")
    _remove(old)
    if path.exists():
        os.replace(path, old)
    os.replace(new, path)
    _remove(old)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def mixed_precision(precision: str):
    """The FSDP2 policy for Lightning's ``precision``: bf16 gathers with fp32 gradient
    reduction for bf16-mixed; none otherwise (32-true trains in fp32, and for bf16-true and
    16-true Lightning converts the sharded model itself, shards and optimizer included)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def is_fully_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def shard(model: nn.Module, mesh, precision: str) -> None:
    """``fully_shard`` each of ``model.layers`` (the recipe's blocks, or a --model host's), then
    the root, over ``mesh``: the data-parallel dimension of Lightning's device mesh."""
    from torch.distributed.fsdp import fully_shard

    policy = mixed_precision(precision)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
