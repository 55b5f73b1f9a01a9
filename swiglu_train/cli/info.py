"""``swiglu-train impls``: what each impl keeps for backward, whether it runs here, and what
``impl="auto"`` would pick for a shape on this machine."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from swiglu_train.cli.app import app, console

SAVED = {  # besides x and the weights, from forward to backward
    "normal": "preact [M, 2F], h [M, F]",
    "drop_h": "preact [M, 2F]; h recomputed in the backward kernel",
    "save_factors": "factors [M, 2F], h [M, F]; fc1 packed",
    "drop_h_quack": "preact [M, 2F]; h recomputed in quack's grad_h GEMM epilogue",
    "save_factors_quack": "factors [M, 2F], h [M, F]; fc1 packed (chunk 1), both epilogues fused",
}


@app.command()
def impls(
    hidden_size: Annotated[
        int | None, typer.Option(min=1, help="D, to ask what auto picks")
    ] = None,
    ffn_hidden_size: Annotated[
        int | None, typer.Option(min=1, help="F, to ask what auto picks")
    ] = None,
    tokens: Annotated[int | None, typer.Option(min=1, help="tokens per micro-batch (M)")] = None,
) -> None:
    """Which impls run on this machine, what each saves, and auto's pick for a shape."""
    import torch

    from swiglu_train.kernels.runtime import triton_runs_on
    from swiglu_train.layers.auto import resolve_auto
    from swiglu_train.layers.registry import MLP_IMPLS, QUACK_IMPLS
    from swiglu_train.ops.quack_mlp import quack_unavailable_reason

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kernels = "Triton kernels" if triton_runs_on(device) else "plain torch math"
    quack_reason = quack_unavailable_reason()
    table = Table(title=f"swiglu-train impls on {device.type}")
    for column in ("impl", "runs here", "saved for backward"):
        table.add_column(column)
    for name in MLP_IMPLS:
        if name in QUACK_IMPLS:
            runs = "yes (quack)" if quack_reason is None else f"[red]no[/]: {escape(quack_reason)}"
        else:
            runs = f"yes ({kernels})"
        table.add_row(name, runs, SAVED[name])
    console.print(table)
    if hidden_size is None or ffn_hidden_size is None:
        console.print("--hidden-size and --ffn-hidden-size (and --tokens) show auto's pick")
        return
    choice = resolve_auto(tokens, hidden_size, ffn_hidden_size, device)
    console.print(f"auto -> [bold]{choice.impl}[/] ({escape(choice.reason)})")
