"""The pretraining config: YAML files over defaults that need no file at all.

The named configs (``tiny``, ``125m``, ``1b``) ship inside the package, so an installed wheel
has them too, not only a source checkout.
"""

from __future__ import annotations

import dataclasses
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
    devices: int | str = 1
    strategy: str = "auto"
    accumulate_grad_batches: int = 1
    gradient_clip_val: float = 1.0
    val_check_interval: int = 50
    checkpoint_every: int = 50
    log_every_n_steps: int = 1
    seed: int = 1234


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
    """A YAML path, or the name of a packaged config (``tiny``, ``125m``, ``1b``)."""
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
    raw = yaml.safe_load(path.read_text()) or {}
    return _build(PretrainConfig, raw, str(path))


def _build(cls, values: dict[str, Any], where: str):
    """Instantiate a config dataclass from a mapping, refusing keys it does not have."""
    if not isinstance(values, dict):
        raise TypeError(f"{where}: expected a mapping for {cls.__name__}, got {values!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(
            f"{where}: unknown keys {unknown} for {cls.__name__}; valid: {sorted(fields)}"
        )
    kwargs = {}
    for key, value in values.items():
        nested = fields[key].default_factory
        if dataclasses.is_dataclass(nested):
            kwargs[key] = _build(nested, value, f"{where}:{key}")
        else:
            kwargs[key] = tuple(value) if isinstance(value, list) and key == "betas" else value
    return cls(**kwargs)
