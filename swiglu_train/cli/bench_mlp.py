"""``swiglu-train bench``: each MLP variant's fwd/bwd/full time and memory against the six-GEMM
floor (logic in ``bench/mlp/run.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markdown import Markdown
from rich.markup import escape

from swiglu_train.cli.app import (
    app,
    console,
    invocation,
    parse_shape,
    progress_bars,
    require_device,
)
from swiglu_train.cli.bench_results import check_results_path
from swiglu_train.files import atomic_write, write_json_atomic


@app.command()
def bench(
    shape: Annotated[str, typer.Option(help="M,D,F,O (tokens, model, ffn, output)")] = (
        "11136,3584,14336,3584"
    ),
    dtype: Annotated[str, typer.Option(help="bf16, fp16 or fp32")] = "bf16",
    variants: Annotated[
        str,
        typer.Option(
            help="comma-separated: eager,compile,normal,drop_h,drop_h_fused,drop_h_quack,"
            "save_factors,save_factors_fused,save_factors_quack,liger,fla,quack; "
            "drop_h+fp8 and drop_h_quack+fp8 (the FP8-saved preactivation); and "
            "quack_tuned (quack autotuned: minutes of warm-up)"
        ),
    ] = (
        "eager,compile,normal,drop_h,drop_h_fused,drop_h_quack,save_factors,save_factors_fused,"
        "save_factors_quack,liger,fla,quack"
    ),
    samples: Annotated[int, typer.Option(min=1, help="paired samples (use >= 30)")] = 40,
    warmup: Annotated[int, typer.Option(min=1)] = 3,
    stack_layers: Annotated[
        int, typer.Option(min=0, help="layers in the stack table; 0 skips")
    ] = 4,
    device: Annotated[str, typer.Option(help="cuda, or cpu for a smoke run")] = "cuda",
    seed: int = 0,
    commit: Annotated[str | None, typer.Option(help="commit to record if git is absent")] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
) -> None:
    """Time fwd/bwd/full and read memory for each MLP variant against the six-GEMM floor."""
    from swiglu_train.bench.mlp.run import BenchConfig, run_bench, to_markdown
    from swiglu_train.bench.mlp.variants import BUILDERS
    from swiglu_train.bench.results import DTYPES

    names = [v for v in variants.split(",") if v]
    unknown = sorted(set(names) - set(BUILDERS))
    if unknown or not names:
        raise typer.BadParameter(
            f"unknown variants {unknown}; choose from {list(BUILDERS)}"
            if unknown
            else f"no variants given; choose from {list(BUILDERS)}",
            param_hint="'--variants'",
        )
    if dtype not in DTYPES:
        raise typer.BadParameter(f"dtype must be one of {list(DTYPES)}")
    require_device(device)
    check_results_path(json_path, (".md",))
    if samples < 30:
        console.print(f"[yellow]{samples} samples: results are not claimable (need >= 30)")
    cfg = BenchConfig(
        shape=parse_shape(shape),
        dtype=dtype,
        variants=names,
        samples=samples,
        warmup=warmup,
        stack_layers=stack_layers,
        device=device,
        seed=seed,
        extra={"commit": commit},
    )
    with progress_bars() as progress:
        result = run_bench(cfg, progress)
    result["meta"]["command"] = invocation()
    markdown = to_markdown(result)
    console.print(Markdown(markdown))
    for name, reason in result["skipped"].items():
        console.print(f"[yellow]skipped {name}: {escape(reason)}")
    if json_path is not None:
        write_json_atomic(json_path, result)
        with atomic_write(json_path.with_suffix(".md")) as f:
            f.write(markdown)
        console.print(f"wrote {escape(str(json_path))}")
