"""``swiglu-train bench-crossover``: where each impl wins, by time and memory, over a grid of
(M, D, F), and impl="auto"'s cost model fitted from it (logic in ``bench/grid/crossover.py`` and
``layers/auto_fit.py``)."""

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
    auto_model: Annotated[
        Path | None,
        typer.Option(
            help="fit the cost model impl='auto' reads from the rows and write it here (CUDA only)"
        ),
    ] = None,
) -> None:
    """Where each impl wins, by time and memory, over a grid of (M, D, F).

    normal, drop_h and save_factors, and the quack impls where quack runs. The --auto-model
    file has the format bench-grid --auto-model writes; ship it as
    swiglu_train/layers/auto_<gpu family>.json.
    """
    from swiglu_train.bench.grid.crossover import (
        CrossoverConfig,
        parse_m,
        parse_shapes,
        run_crossover,
        to_markdown,
    )
    from swiglu_train.bench.results import DTYPES, git_commit
    from swiglu_train.layers.auto_fit import fit_auto_model

    try:
        grid_m, grid_shapes = parse_m(m), parse_shapes(shapes)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    if dtype not in DTYPES:
        raise typer.BadParameter(f"dtype must be one of {list(DTYPES)}")
    if auto_model is not None and device != "cuda":
        raise typer.BadParameter(
            "--auto-model is fitted from CUDA readings (GPU and host time, allocator memory): "
            "run with --device cuda"
        )
    if auto_model is not None and not (commit or git_commit()):
        raise typer.BadParameter("--auto-model records the commit measured; pass --commit (no git)")
    require_device(device)
    check_results_path(json_path, (".md",))
    check_output(auto_model, "'--auto-model'")
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
    if auto_model is not None:
        write_json_atomic(auto_model, fit_auto_model(result, invocation()))
        console.print(f"wrote {escape(str(auto_model))}")
