"""``swiglu-train impls``: what each impl keeps for backward, whether it runs here, and what
``impl="auto"`` would pick for a shape on this machine; with ``--experts``, the same for the
routed experts (``ParExperts``), with the MiB each keeps at the shape."""

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
# The routed experts', R = T·k rows (router weights on the output, as Mixtral's and Qwen's)
EXPERTS_SAVED = {
    "normal": "gathered x [R, D], preact [R, 2F], h [R, F], expert outputs [R, D]",
    "drop_h": "preact [R, 2F] and the routing plan; x's rows regathered, h recomputed",
    "drop_h_quack": "preact [R, 2F] and the routing plan; rows gathered inside quack's GEMMs",
}
EXPERTS_FP8_SAVED = "the preactivation's e4m3 copy (1x128 blocks, bf16 scales) and the plan"


@app.command()
def impls(
    hidden_size: Annotated[
        int | None, typer.Option(min=1, help="D, to ask what auto picks")
    ] = None,
    ffn_hidden_size: Annotated[
        int | None, typer.Option(min=1, help="F, to ask what auto picks")
    ] = None,
    tokens: Annotated[int | None, typer.Option(min=1, help="tokens per micro-batch (M)")] = None,
    experts: Annotated[
        int | None, typer.Option(min=1, help="E routed experts: list the experts' impls too")
    ] = None,
    top_k: Annotated[int, typer.Option(min=1, help="experts per token (k), with --experts")] = 1,
) -> None:
    """Which impls run on this machine, what each saves, and auto's pick for a shape."""
    if experts is not None and top_k > experts:
        raise typer.BadParameter(f"{top_k} > --experts {experts}", param_hint="'--top-k'")
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
    else:
        choice = resolve_auto(tokens, hidden_size, ffn_hidden_size, device)
        console.print(f"auto -> [bold]{choice.impl}[/] ({escape(choice.reason)})")
    if experts is not None:
        _print_experts(experts, top_k, hidden_size, ffn_hidden_size, tokens, kernels)


def experts_rows(
    experts: int, top_k: int, hidden: int | None, ffn: int | None, tokens: int | None, kernels: str
) -> list[dict]:
    """Per routed-experts impl (and FP8-saved form): its name, whether it runs here (else
    why), what it saves, and the MiB it keeps for backward in bf16 where D, F and T are given
    (``ops.experts.saved_activation_bytes``: the figure its tests assert)."""
    import torch

    from swiglu_train.layers.registry import FP8_LABEL
    from swiglu_train.ops.experts import IMPLS, saved_activation_bytes
    from swiglu_train.ops.experts_quack import experts_quack_unavailable_reason

    rows = []
    for impl in IMPLS:
        why = experts_quack_unavailable_reason(hidden, ffn) if impl == "drop_h_quack" else None
        for saved_fp8 in (False, True) if impl != "normal" else (False,):
            mib = None
            if None not in (hidden, ffn, tokens):
                size = saved_activation_bytes(
                    impl, saved_fp8, "output", tokens, hidden, ffn, top_k, experts, torch.bfloat16
                )
                mib = size / 2**20
            rows.append({
                "impl": impl + (FP8_LABEL if saved_fp8 else ""),
                "runs": why is None,
                "why_not": why,
                "kernels": "quack" if impl == "drop_h_quack" else kernels,
                "saved": EXPERTS_FP8_SAVED if saved_fp8 else EXPERTS_SAVED[impl],
                "MiB": mib,
            })  # fmt: skip
    return rows


def _print_experts(experts, top_k, hidden, ffn, tokens, kernels) -> None:
    from swiglu_train.layers.experts import experts_auto

    rows = experts_rows(experts, top_k, hidden, ffn, tokens, kernels)
    table = Table(title=f"routed experts (ParExperts): E={experts}, k={top_k}, R = T·k rows")
    shown = rows[0]["MiB"] is not None
    columns = ("impl", "runs here", "saved for backward", *(("MiB (bf16)",) if shown else ()))
    for column in columns:
        table.add_column(column)
    for r in rows:
        runs = f"yes ({r['kernels']})" if r["runs"] else f"[red]no[/]: {escape(r['why_not'])}"
        mib = (f"{r['MiB']:.1f}",) if shown else ()
        table.add_row(r["impl"], runs, r["saved"], *mib)
    console.print(table)
    if not shown:
        console.print("--hidden-size, --ffn-hidden-size and --tokens show the MiB each keeps")
    impl, why = experts_auto(hidden, ffn, "output")
    console.print(f"experts auto -> [bold]{impl}[/] ({escape(why)})")
