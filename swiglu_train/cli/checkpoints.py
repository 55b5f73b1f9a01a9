"""Sharded checkpoints (``pretrain --strategy fsdp2``) on the command line: ``consolidate``
writes one as a single file; export-hf and convert read one through :func:`read_sharded`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from swiglu_train.cli.app import app, check_output, console
from swiglu_train.files import atomic_write


def read_sharded(path: Path, trust: bool, hint: str) -> dict | None:
    """The sharded checkpoint at ``path`` as one checkpoint dict (single-device format); None
    where ``path`` is none, for the caller's torch.load. Reading one unpickles, so it takes
    ``--trust``."""
    from swiglu_train.integrations.lightning.sharded_checkpoint import (
        TRUST,
        consolidate,
        is_sharded,
    )

    if not is_sharded(path):
        return None
    if not trust:
        raise typer.BadParameter(f"{path} {TRUST}", param_hint=hint)
    try:
        return consolidate(path, hint)
    except ValueError as e:  # no or a damaged meta.pt, a damaged shard
        raise typer.BadParameter(str(e)) from e


@app.command()
def consolidate(
    src: Annotated[
        Path, typer.Argument(help="a sharded checkpoint directory (pretrain --strategy fsdp2)")
    ],
    dst: Annotated[Path, typer.Argument(help="the .ckpt file to write (atomically)")],
    trust: Annotated[
        bool, typer.Option(help="unpickle its index and metadata (trusted checkpoints)")
    ] = False,
) -> None:
    """Write a sharded checkpoint as one file, as a single-device run saves it: --resume with
    any strategy, load_from_checkpoint and every command that takes a .ckpt read it."""
    import torch

    check_output(dst, "DST")
    ckpt = read_sharded(src, trust, "SRC")
    if ckpt is None:
        raise typer.BadParameter(
            f"{src} is no sharded checkpoint (a directory holding a .metadata index)",
            param_hint="SRC",
        )
    with atomic_write(dst, "wb") as f:
        torch.save(ckpt, f)
    step = ckpt.get("global_step")
    console.print(f"wrote {escape(str(dst))} (step {step}) from {escape(str(src))}")
