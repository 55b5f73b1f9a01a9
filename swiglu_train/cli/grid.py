"""``swiglu-train bench-grid``: every impl and peer at the MLP shapes of public models, in
chunks that merge, with impl="auto" judged there (logic in ``bench/grid/run.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from swiglu_train.cli.app import (
    app,
    check_output,
    console,
    invocation,
    progress_bars,
    require_device,
)
from swiglu_train.cli.bench_results import write_results
from swiglu_train.extras import require
from swiglu_train.files import write_json_atomic


def _grid_figure(result: dict) -> object:
    from swiglu_train.bench.grid.plot import plot_grid

    return plot_grid(result)


@app.command("bench-grid")
def bench_grid(
    models: Annotated[
        str | None,
        typer.Option(help="listed models, comma-separated (default: all; see --list-models)"),
    ] = None,
    shapes: Annotated[
        str | None, typer.Option(help="(D, F) pairs as DxF, comma-separated, instead of --models")
    ] = None,
    m: Annotated[str, typer.Option("--m", help="token counts M, comma-separated")] = (
        "4096,8000,16384"
    ),
    variants: Annotated[str | None, typer.Option(help="comma-separated (default: all)")] = None,
    samples: Annotated[int, typer.Option(min=1, help="paired samples per point (use >= 30)")] = 30,
    warmup: Annotated[int, typer.Option(min=1, help="steps per variant before timing")] = 2,
    chunk: Annotated[
        str, typer.Option(help="I/N: run the I-th of N chunks, balanced by estimated time")
    ] = "1/1",
    prewarm_workers: Annotated[
        int,
        typer.Option(
            min=0,
            help="compile the chunk's points first in N spawned processes, so the timing pass "
            "finds quack's, Triton's and inductor's disk caches warm (8 suits the 16-core H200 "
            "box; 0: compile while timing)",
        ),
    ] = 0,
    pretune: Annotated[
        bool,
        typer.Option(
            help="before timing each point, time the quack impls' GEMMs on each library "
            "(swiglu-train pretune) and run them on the fastest; recorded per point",
        ),
    ] = False,
    dry_run: Annotated[
        bool, typer.Option(help="print every chunk's points and estimated seconds; run nothing")
    ] = False,
    list_models: Annotated[bool, typer.Option(help="print the model list and exit")] = False,
    dtype: Annotated[str, typer.Option(help="bf16, fp16 or fp32")] = "bf16",
    device: Annotated[str, typer.Option(help="cuda, or cpu for a smoke run")] = "cuda",
    seed: int = 0,
    commit: Annotated[str | None, typer.Option(help="commit to record if git is absent")] = None,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="write results here (after every point)")
    ] = None,
    md_path: Annotated[Path | None, typer.Option("--md", help="write the tables here")] = None,
    plot_path: Annotated[
        Path | None, typer.Option("--plot", help="write the figure here (PNG; the plot extra)")
    ] = None,
    merge: Annotated[
        list[Path] | None,
        typer.Option(help="merge these --json chunks (same GPU, dtype, commit) instead of running"),
    ] = None,
    auto_model: Annotated[
        Path | None,
        typer.Option(
            help="fit the cost model impl='auto' reads from the result's rows and write it here "
            "(CUDA results only; ship it as swiglu_train/layers/auto_<gpu family>.json)"
        ),
    ] = None,
    calibrate: Annotated[
        bool,
        typer.Option(
            help="fit that model and write it to this machine's cache (auto_<gpu family>.json "
            "beside pretune's GEMM cache), where impl='auto' looks before the shipped models; "
            "without --variants, times our impls only (the peers are not fitted)"
        ),
    ] = False,
    more_merge: Annotated[
        list[Path] | None,
        typer.Argument(
            metavar="MERGE",
            help="more files for --merge: --merge a.json b.json",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Every impl and peer against the six-GEMM floor at the MLP shapes of public models.

    Also judges impl="auto" there: the picks made during the run, the shipped cost model's
    (or, with --auto-model or --calibrate, the one fitted here), and leave-one-family-out
    models fitted from the grid.
    """
    from swiglu_train.bench.grid.crossover import parse_m, parse_shapes
    from swiglu_train.bench.grid.models import MODELS, grid_shapes, select_models, shapes_for
    from swiglu_train.bench.grid.plan import GRID_VARIANTS, GridConfig, parse_chunk
    from swiglu_train.bench.grid.report import to_markdown
    from swiglu_train.bench.grid.run import merge_results
    from swiglu_train.bench.mlp.variants import BUILDERS
    from swiglu_train.bench.results import DTYPES
    from swiglu_train.layers.auto import calibration_dir
    from swiglu_train.layers.registry import MLP_IMPLS

    if list_models:
        for model in MODELS:
            console.print(f"{model.name}: D={model.d} F={model.f} ({model.family}, {model.repo})")
        return
    if more_merge and not merge:
        raise typer.BadParameter(f"unexpected arguments {[str(p) for p in more_merge]}")
    merge = [*(merge or []), *(more_merge or [])]
    outputs = [(json_path, "'--json'"), (md_path, "'--md'"), (plot_path, "'--plot'")]
    for path, option in [*outputs, (auto_model, "'--auto-model'")]:
        check_output(path, option)
    if calibrate and auto_model is not None:
        raise typer.BadParameter("give --auto-model or --calibrate, not both")
    fit = "'--calibrate'" if calibrate else "'--auto-model'" if auto_model is not None else None
    if calibrate:
        check_output(calibration_dir(), fit, directory=True)
    if fit is not None and not merge and device != "cuda":
        raise typer.BadParameter(
            "an auto model is fitted from CUDA readings: run with --device cuda", param_hint=fit
        )
    if plot_path is not None:
        require("matplotlib")  # one line naming the extra, before the grid's minutes
    if merge:
        parts = {}
        for path in merge:
            try:
                parts[str(path)] = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                raise typer.BadParameter(f"{path}: {e}", param_hint="'--merge'") from e
        try:
            result = merge_results(parts)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="'--merge'") from e
    else:
        default = MLP_IMPLS if calibrate else GRID_VARIANTS
        names = list(default) if variants is None else [v for v in variants.split(",") if v]
        unknown = sorted(set(names) - set(BUILDERS))
        if unknown or not names:
            raise typer.BadParameter(
                f"unknown variants {unknown}; choose from {list(BUILDERS)}"
                if unknown
                else "no variants given",
                param_hint="'--variants'",
            )
        if dtype not in DTYPES:
            raise typer.BadParameter(f"dtype must be one of {list(DTYPES)}")
        if models is not None and shapes is not None:
            raise typer.BadParameter("give --models or --shapes, not both")
        try:
            if shapes is not None:
                grid = shapes_for(parse_shapes(shapes))
            elif models is not None:
                grid = select_models([n.strip() for n in models.split(",") if n.strip()])
            else:
                grid = grid_shapes()
            cfg = GridConfig(grid, parse_m(m), names, samples, warmup, dtype, device, seed, commit)
            cfg.chunk, cfg.command = parse_chunk(chunk), invocation()
            cfg.prewarm_workers, cfg.pretune = prewarm_workers, pretune
            cfg.chunks()  # a chunk count above the number of points is refused here
        except ValueError as e:
            raise typer.BadParameter(str(e)) from e
        if dry_run:
            _print_plan(cfg)
            return
        require_device(device)
        if samples < 30:
            console.print(f"[yellow]{samples} samples: results are not claimable (need >= 30)")
        result = _run_grid(cfg, json_path)
    fit_error = None
    if fit is not None:
        try:
            _write_auto_model(result, auto_model)
        except ValueError as e:  # the measurements are written all the same
            fit_error = typer.BadParameter(str(e), param_hint=fit)
    write_results(result, to_markdown(result), json_path, md_path, plot_path, _grid_figure)
    if fit_error is not None:
        raise fit_error


def _write_auto_model(result: dict, path: Path | None) -> None:
    """Fit auto's model from ``result``, write it (atomically) to ``path``, or with None to
    this machine's calibration for the result's GPU family, and judge it as the one to ship;
    a result it cannot be fitted from raises ValueError."""
    from swiglu_train.bench.grid.auto import evaluate_auto
    from swiglu_train.layers.auto import calibration_path
    from swiglu_train.layers.auto_fit import fit_auto_model
    from swiglu_train.layers.auto_model import AutoModel

    fitted = fit_auto_model(result, invocation())
    calibrated = path is None
    path = calibration_path(fitted["gpu_family"]) if calibrated else path
    write_json_atomic(path, fitted)
    reads = f": impl='auto' on {fitted['gpu_family']} GPUs here reads it" if calibrated else ""
    console.print(f"wrote {escape(str(path))}{escape(reads)}")
    result["auto_eval"] = evaluate_auto(result, (AutoModel.from_dict(fitted, str(path)), path.name))


def _run_grid(cfg, json_path: Path | None) -> dict:
    """Run the grid with progress bars and a line per point; the JSON is rewritten after every
    point, so a run stopped at a device call's limit keeps the points it finished."""
    from swiglu_train.bench.grid.run import run_grid

    total = len(cfg.points())
    warmed = 0

    def on_prewarm(outcome) -> None:
        nonlocal warmed
        warmed += 1
        console.print(f"[pre-warm {warmed}/{total}] {outcome.describe()}", markup=False)

    def on_point(result: dict) -> None:
        done = len(result["points"]) + len(result["skipped_points"])
        last = (result["points"] or [None])[-1]
        if last is not None:
            console.print(
                f"[{done}/{total}] M={last['M']} D={last['D']} F={last['F']} "
                f"({', '.join(last['models'])}): {last['elapsed_s']:.0f} s "
                f"(estimated {last['estimated_s']:.0f} s), auto: {last['auto']['impl']}"
            )
        if json_path is not None:
            write_json_atomic(json_path, result)

    with progress_bars() as progress:
        return run_grid(cfg, progress, on_point, on_prewarm)


def _print_plan(cfg) -> None:
    """Every chunk of ``cfg``'s grid: its points and estimated seconds on an H200 in bf16
    (the pre-warm's included: it runs in the same call, before the timing)."""
    for i, points in enumerate(cfg.chunks(), start=1):
        mark = " <- this chunk" if i == cfg.chunk[0] else ""
        console.print(
            f"chunk {i}/{cfg.chunk[1]}: {len(points)} points, ~{cfg.chunk_s(points):.0f} s{mark}"
        )
        if cfg.prewarm_workers:
            console.print(
                f"  pre-warm on {cfg.prewarm_workers} workers: ~{cfg.prewarm_s(points):.0f} s"
            )
        for p, compiles in cfg.compiling(points):
            console.print(
                f"  M={p.m} D={p.shape.d} F={p.shape.f} ({p.shape.label}): "
                f"~{cfg.estimate_s(p, compiles):.0f} s"
            )
