"""``swiglu-train pretune``: measure quack against cuBLAS on the quack impls' plain GEMMs at a
model's shapes before a run, and cache the faster one for training to read."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from swiglu_train.cli.app import app, console, parse_ints, progress_bars

DTYPES = ("bf16", "fp16")


def pretune_shapes(
    config: str | None,
    hidden_size: int | None,
    ffn_hidden_size: int | None,
    tokens: str | None,
    output_size: int | None,
) -> list[tuple[int, int, int, int]]:
    """The (M, D, F, O) to time: from the options, or from a pretrain config's model and
    micro-batch x sequence length, which options given beside it override."""
    if config is not None:
        from swiglu_train.integrations.lightning.config import load_config

        try:
            cfg = load_config(config)
        except (FileNotFoundError, ValueError) as e:
            raise typer.BadParameter(str(e), param_hint="'--config'") from None
        hidden_size = hidden_size or cfg.model.hidden_size
        ffn_hidden_size = ffn_hidden_size or cfg.model.ffn_hidden_size
        tokens = tokens or str(cfg.data.micro_batch_size * cfg.data.seq_length)
    if hidden_size is None or ffn_hidden_size is None or tokens is None:
        raise typer.BadParameter(
            "give --config (a pretrain config), or --hidden-size, --ffn-hidden-size and --tokens"
        )
    out = output_size or hidden_size
    return [(m, hidden_size, ffn_hidden_size, out) for m in parse_ints(tokens, "'--tokens'")]


@app.command()
def pretune(
    config: Annotated[
        str | None,
        typer.Option(help="a pretrain config (name or YAML): D, F and M from its model and data"),
    ] = None,
    hidden_size: Annotated[int | None, typer.Option(min=1, help="D, the model width")] = None,
    ffn_hidden_size: Annotated[
        int | None, typer.Option(min=1, help="F, per tensor-parallel rank")
    ] = None,
    tokens: Annotated[
        str | None,
        typer.Option(help="M, tokens per micro-batch (batch x sequence), comma-separated"),
    ] = None,
    output_size: Annotated[
        int | None, typer.Option(min=1, help="fc2's output size O (default: D)")
    ] = None,
    impls: Annotated[
        str, typer.Option(help="comma-separated: drop_h_quack, save_factors_quack")
    ] = "drop_h_quack,save_factors_quack",
    dtype: Annotated[str, typer.Option(help="bf16 or fp16, as the model trains")] = "bf16",
    samples: Annotated[int, typer.Option(min=30, help="paired samples per GEMM")] = 30,
) -> None:
    """Time quack and cuBLAS on each plain GEMM the quack impls run at these shapes (this GPU),
    and cache the faster: training then reads the choice and never times anything itself."""
    import torch

    from swiglu_train.bench.pretune.measure import planned
    from swiglu_train.bench.pretune.measure import pretune as measure
    from swiglu_train.ops.gemm_choice import IMPL_GEMMS, cache_path
    from swiglu_train.ops.quack_mlp import quack_unavailable_reason

    names = [n for n in impls.split(",") if n]
    unknown = sorted(set(names) - set(IMPL_GEMMS))
    if unknown or not names:
        raise typer.BadParameter(
            f"choose from {sorted(IMPL_GEMMS)}, got {impls!r}", param_hint="'--impls'"
        )
    if dtype not in DTYPES:
        raise typer.BadParameter(f"one of {list(DTYPES)}, got {dtype!r}", param_hint="'--dtype'")
    shapes = pretune_shapes(config, hidden_size, ffn_hidden_size, tokens, output_size)
    reason = quack_unavailable_reason()
    if reason is not None:
        raise typer.BadParameter(f"the quack impls cannot run here: {reason}")
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    with progress_bars() as progress:
        tick = progress("timing quack (static, dynamic) and cuBLAS", len(planned(shapes, names)))
        rows = measure(shapes, names, torch_dtype, samples, tick)
    table = Table(title=f"{torch.cuda.get_device_name()}, {dtype}, {samples} paired samples")
    columns = ("GEMM", "[m, k] @ [k, n]", "quack ms", "quack dynamic ms", "cuBLAS ms", "runs on")
    for column in columns:
        table.add_column(column)
    for r in rows:
        table.add_row(
            r.gemm, f"[{r.m}, {r.k}] @ [{r.k}, {r.n}]", f"{r.quack_ms:.3f}",
            "—" if r.quack_dynamic_ms is None else f"{r.quack_dynamic_ms:.3f}",
            f"{r.cublas_ms:.3f}", r.backend,
        )  # fmt: skip
    for r in rows:
        for library, error in r.failed.items():
            console.print(f"{r.gemm} [{r.m}, {r.k}] @ [{r.k}, {r.n}]: {library} failed, left "
                          f"out: {escape(error)}")  # fmt: skip
    console.print(table)
    console.print(f"cached in {escape(str(cache_path()))}")
