"""The pretraining config: YAML files over defaults that need no file at all.

The named configs (``tiny``, ``125m``, ``1b``, ``3b``; Mixture-of-Experts ``tiny_moe`` and
``moe_1b``) ship inside the package, so an installed wheel has them too, not only a source
checkout.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from swiglu_train.integrations.lightning.data import DataConfig
from swiglu_train.integrations.lightning.model import ModelConfig
from swiglu_train.integrations.lightning.module import OptimConfig

CONFIG_DIR = Path(__file__).resolve().parent / "configs"  # package data (pyproject.toml)


@dataclass
class TrainConfig:
    max_steps: int = 150
    precision: str = "auto"  # bf16-mixed on CUDA, 32-true on CPU
    accelerator: str = "auto"  # Lightning's: auto (a GPU where there is one), cpu, gpu, cuda
    devices: int | str = 1
    strategy: str = "auto"  # Lightning's (auto, ddp, fsdp...), or fsdp2 (fsdp2.py)
    accumulate_grad_batches: int = 1
    gradient_clip_val: float = 1.0
    val_check_interval: int = 50
    checkpoint_every: int = 50
    log_every_n_steps: int = 1
    seed: int = 1234
    # "auto": before training, measure short steps and set model.mlp_impl and
    # model.checkpoint_layers to fit memory_budget_gb at the highest tokens/s (planner.py)
    activation_checkpointing: str = "manual"
    memory_budget_gb: float | None = None  # GiB; None: the GPU's memory less 5 %
    plan_impls: list[str] | None = None  # what the planner tries; None: every impl that runs
    # with activation_checkpointing "auto": also pick data.micro_batch_size among the divisors
    # of global_batch_size (sequences per optimizer step), accumulating the rest
    auto_micro_batch_size: bool = False
    global_batch_size: int | None = None


@dataclass
class WandbConfig:
    project: str = "swiglu-train"
    group: str | None = None
    name: str | None = None


@dataclass
class PretrainConfig:
    """The defaults are the ``tiny`` config: a minute or two on two CPU cores."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    output_dir: str = "runs/pretrain"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def resolve_config_path(name_or_path: str) -> Path:
    """A YAML path, or the name of a packaged config (``tiny``, ``125m``, ``1b``, ``3b``,
    ``tiny_moe``, ``moe_1b``)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    named = CONFIG_DIR / f"{name_or_path}.yaml"
    if named.is_file():
        return named
    known = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")) if CONFIG_DIR.is_dir() else []
    raise FileNotFoundError(f"config {name_or_path!r} not found; named configs: {known}")


def load_config(name_or_path: str | None) -> PretrainConfig:
    if name_or_path is None:
        return PretrainConfig()
    path = resolve_config_path(name_or_path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from e
    return _build(PretrainConfig, raw, str(path))


# Lower bounds of the numbers a run divides by, counts or loops over; a config that breaks one
# would fail deep in torch or Lightning (a ZeroDivisionError, an endless run), if at all.
AT_LEAST = {
    "model": {"vocab_size": 1, "hidden_size": 1, "ffn_hidden_size": 1, "num_layers": 1,
              "num_heads": 1, "max_seq_length": 1},
    "data": {"seq_length": 1, "micro_batch_size": 1, "val_batches": 0, "val_fraction": 0.0},
    "optim": {"warmup_steps": 0, "weight_decay": 0.0, "min_lr_ratio": 0.0},
    "train": {"max_steps": 1, "accumulate_grad_batches": 1, "val_check_interval": 1,
              "checkpoint_every": 1, "log_every_n_steps": 1},
}  # fmt: skip


def check_ranges(cfg: PretrainConfig) -> None:
    """The final config (YAML and command-line flags together) against AT_LEAST."""
    for part, bounds in AT_LEAST.items():
        for key, low in bounds.items():
            value = getattr(getattr(cfg, part), key)
            if value < low:
                raise ValueError(f"{part}.{key} must be at least {low}, got {value}")
    check_devices(cfg.train.devices)
    check_accelerator(cfg.train.accelerator)
    if not cfg.optim.lr > 0 or not cfg.data.val_fraction < 1 or not cfg.optim.min_lr_ratio <= 1:
        raise ValueError(
            f"need optim.lr > 0, data.val_fraction < 1 and optim.min_lr_ratio <= 1; got "
            f"{cfg.optim.lr}, {cfg.data.val_fraction}, {cfg.optim.min_lr_ratio}"
        )


def check_accelerator(name: str) -> None:
    """train.accelerator as Lightning names them; a wrong one, or a GPU where there is none,
    fails inside the Trainer, once the run's W&B run and output dir exist."""
    import torch
    from lightning.pytorch.accelerators import AcceleratorRegistry

    names = ["auto", "gpu", *AcceleratorRegistry.available_accelerators()]
    if name not in names:
        raise ValueError(f"train.accelerator must be one of {', '.join(names)}; got {name!r}")
    if name in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ValueError(f"train.accelerator={name!r}, but this machine has no CUDA GPU; use cpu")


def check_devices(devices: int | str) -> None:
    """train.devices as Lightning takes it: 0, "abc" or, without CUDA, -1 or GPU ids fail inside
    the Trainer with a MisconfigurationException or TypeError traceback."""
    import torch

    if isinstance(devices, int) and devices > 1 and not torch.cuda.is_available():
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        if devices > (cores or 1):  # each device is a training process on a CPU
            raise ValueError(
                f"train.devices={devices} would start {devices} training processes on this "
                f"machine's {cores} CPU cores (no CUDA); use at most {cores}"
            )
    if devices == "auto" or (isinstance(devices, int) and devices >= 1):
        return
    if torch.cuda.is_available():
        ids = str(devices).split(",")
        if str(devices).strip() == "-1" or all(i.strip().isdigit() for i in ids):
            return
    gpu = ", -1 (all GPUs) or GPU ids like 0,1" if torch.cuda.is_available() else ""
    raise ValueError(f"train.devices must be auto or a count of at least 1{gpu}; got {devices!r}")


def _build(cls, values: dict[str, Any], where: str):
    """Instantiate a config dataclass from a mapping, refusing keys it does not have and values
    not of their field's type (YAML reads "192" as a string, 3e-3 as one too)."""
    if not isinstance(values, dict):
        raise ValueError(f"{where}: expected a mapping for {cls.__name__}, got {values!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(
            f"{where}: unknown keys {unknown} for {cls.__name__}; valid: {sorted(fields)}"
        )
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in values.items():
        nested = fields[key].default_factory
        if dataclasses.is_dataclass(nested):
            kwargs[key] = _build(nested, value, f"{where}:{key}")
            continue
        if not _is(value, hints[key]):
            raise ValueError(f"{where}:{key} must be {_name(hints[key])}, got {value!r}")
        kwargs[key] = tuple(value) if isinstance(value, list) and key == "betas" else value
    return cls(**kwargs)


def _is(value: object, hint: object) -> bool:
    """Whether a YAML value fits a field's annotation (an int serves a float; a bool, neither)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_is(value, a) for a in args)
    if origin in (tuple, list):
        if not isinstance(value, tuple | list):
            return False
        items = args if origin is tuple else [args[0]] * len(value)
        return len(items) == len(value) and all(map(_is, value, items))
    if hint is type(None):
        return value is None
    if hint in (int, float):
        number = (int,) if hint is int else (int, float)
        return isinstance(value, number) and not isinstance(value, bool)
    return isinstance(value, hint) if isinstance(hint, type) else True


def _name(hint: object) -> str:
    plain = typing.get_origin(hint) is None and hasattr(hint, "__name__")
    return hint.__name__ if plain else str(hint).replace("typing.", "")
