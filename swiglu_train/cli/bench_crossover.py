"""``swiglu-train bench-crossover``: where each impl wins, by time and memory, over a grid of
(M, D, F), and the lookup table impl="auto" ships (logic in ``bench/crossover.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markdown import Markdown
from rich.markup import escape

from swiglu_train.cli.app import (
    app,
    check_output,
    console,
    invocation,
    progress_bars,
    require_device,
)
from swiglu_train.cli.bench_results import check_results_path
from swiglu_train.files import atomic_write, write_json_atomic


@app.command("bench-crossover")
def bench_crossover(
    m: Annotated[str, typer.Option("--m", help="token counts M, comma-separated")] = (
        "2048,4096,8192,16384"
    ),
    shapes: Annotated[str, typer.Option(help="(D, F) pairs as DxF, comma-separated")] = (
        "2048x5632,4096x11008,3584x14336,5120x13824,8192x28672"
    ),
    samples: Annotated[int, typer.Option(min=1, help="paired samples per point (use >= 30)")] = 30,
    warmup: Annotated[int, typer.Option(min=1, help="steps per case before timing")] = 2,
    dtype: Annotated[str, typer.Option(help="bf16, fp16 or fp32")] = "bf16",
    device: Annotated[str, typer.Option(help="cuda, or cpu for a smoke run")] = "cuda",
    seed: int = 0,
    commit: Annotated[str | None, typer.Option(help="commit to record if git is absent")] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
    table: Annotated[
        Path | None,
        typer.Option(help="write the lookup table for impl='auto' here (CUDA only)"),
    ] = None,
) -> None:
    """Where each impl wins, by time and memory, over a grid of (M, D, F).

    normal, drop_h and save_factors, and the quack impls where quack runs. Ship the --table file
    as swiglu_train/layers/crossover_<gpu family>.json.
    """
    from swiglu_train.bench.crossover import (
        CrossoverConfig,
        lookup_table,
        parse_m,
        parse_shapes,
        run_crossover,
        to_markdown,
    )
    from swiglu_train.bench.mlp import DTYPES, git_commit

    try:
        grid_m, grid_shapes = parse_m(m), parse_shapes(shapes)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    if dtype not in DTYPES:
        raise typer.BadParameter(f"dtype must be one of {list(DTYPES)}")
    if table is not None and device != "cuda":
        raise typer.BadParameter("--table needs allocator readings: run with --device cuda")
    if table is not None and not (commit or git_commit()):
        raise typer.BadParameter("--table records the commit measured; pass --commit (no git)")
    require_device(device)
    check_results_path(json_path, (".md",))
    check_output(table, "'--table'")
    if samples < 30:
        console.print(f"[yellow]{samples} samples: results are not claimable (need >= 30)")
    cfg = CrossoverConfig(grid_m, grid_shapes, samples, warmup, dtype, device, seed, commit)
    with progress_bars() as progress:
        result = run_crossover(cfg, progress)
    result["meta"]["command"] = invocation()
    markdown = to_markdown(result)
    console.print(Markdown(markdown))
    if json_path is not None:
        write_json_atomic(json_path, result)
        with atomic_write(json_path.with_suffix(".md")) as f:
            f.write(markdown)
        console.print(f"wrote {escape(str(json_path))} (.md)")
    if table is not None:
        write_json_atomic(table, lookup_table(result))
        console.print(f"wrote {escape(str(table))}")
