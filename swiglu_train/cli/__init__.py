"""The ``swiglu-train`` command line; importing the command modules registers them on ``app``,
and ``--help`` lists the commands in the order they are imported here."""

# isort: off
from swiglu_train.cli import bench_mlp, bench_inference, bench_memory, bench_crossover  # noqa: F401
from swiglu_train.cli import bench_moe  # noqa: F401
from swiglu_train.cli import checkpoints, grid, hf, info, train, tune  # noqa: F401

# isort: on
from swiglu_train.cli.app import app

__all__ = ["app"]
