"""The ``swiglu-train`` command line; importing the command modules registers them on ``app``."""

from swiglu_train.cli import bench, checkpoints, grid, hf, info, train, tune  # noqa: F401
from swiglu_train.cli.app import app

__all__ = ["app"]
