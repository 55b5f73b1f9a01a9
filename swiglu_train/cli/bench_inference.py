"""``swiglu-train bench-inference``: the gated projection and the whole MLP, forward only, in
CUDA graphs, and the no-grad path's dispatch table fitted from them (logic in
``bench/inference*.py``)."""

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


def _inference_figure(result: dict) -> object:
    from swiglu_train.bench.inference.plot import plot_inference

    return plot_inference(result)


@app.command("bench-inference")
def bench_inference(
    models: Annotated[
        str, typer.Option(help="Qwen-2.5 MLP sizes (0.5b,7b,32b,72b) or DxF, comma-separated")
    ] = "0.5b,7b,32b,72b",
    m: Annotated[str, typer.Option("--m", help="token counts M, comma-separated")] = (
        "1,16,128,512,2048,4096"
    ),
    samples: Annotated[int, typer.Option(min=1, help="paired samples (use >= 30)")] = 30,
    variants: Annotated[
        str | None,
        typer.Option(help="only these variants, comma-separated (eager references always run)"),
    ] = None,
    dtype: Annotated[str, typer.Option(help="bf16, fp16 or fp32")] = "bf16",
    device: Annotated[str, typer.Option(help="cuda, or cpu for a smoke run")] = "cuda",
    seed: int = 0,
    commit: Annotated[str | None, typer.Option(help="commit to record if git is absent")] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
    md_path: Annotated[Path | None, typer.Option("--md", help="write the tables here")] = None,
    dispatch_path: Annotated[
        Path | None,
        typer.Option("--dispatch-table", help="write the no-grad path's dispatch table here"),
    ] = None,
    plot_path: Annotated[
        Path | None, typer.Option("--plot", help="write the figure here (PNG; the plot extra)")
    ] = None,
    judge_path: Annotated[
        Path | None,
        typer.Option("--judge-table", help="judge this dispatch table on the run (out of sample)"),
    ] = None,
    merge: Annotated[
        list[Path] | None,
        typer.Option(help="merge these --json results (runs split by model) instead of running"),
    ] = None,
    more_merge: Annotated[
        list[Path] | None,
        typer.Argument(
            metavar="MERGE",
            help="more files for --merge, so --merge a.json b.json reads both",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Time the gated projection and the whole MLP, forward only, in CUDA graphs.

    Ship the --dispatch-table file as swiglu_train/ops/inference_dispatch_<gpu>.json.
    """
    from swiglu_train.bench.inference.dispatch import dispatch_table, judge_table, merge_results
    from swiglu_train.bench.inference.run import (
        InferenceBenchConfig,
        parse_model,
        run_inference_bench,
        to_markdown,
    )
    from swiglu_train.bench.inference.variants import TABLES
    from swiglu_train.bench.results import DTYPES

    if more_merge and not merge:
        raise typer.BadParameter(f"unexpected arguments {[str(p) for p in more_merge]}")
    merge = [*(merge or []), *(more_merge or [])]
    model_names = [v for v in models.split(",") if v]
    try:
        for name in model_names:
            parse_model(name)
        ms = [int(v) for v in m.split(",") if v]
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    if not ms or min(ms) < 1:
        raise typer.BadParameter("--m takes positive integers")
    names = None if variants is None else [v for v in variants.split(",") if v]
    known = {n for table in TABLES.values() for n in table}
    if names is not None and set(names) - known:
        unknown = sorted(set(names) - known)
        raise typer.BadParameter(f"unknown variants {unknown}; choose from {sorted(known)}")
    if dtype not in DTYPES:
        raise typer.BadParameter(f"dtype must be one of {list(DTYPES)}")
    if not merge:  # merging reads result files: it runs anywhere
        require_device(device)
    if judge_path is not None and not judge_path.is_file():  # read after the run
        raise typer.BadParameter(f"{judge_path} is not a file", param_hint="'--judge-table'")
    for path, option in (
        (json_path, "'--json'"),
        (md_path, "'--md'"),
        (dispatch_path, "'--dispatch-table'"),
        (plot_path, "'--plot'"),
    ):
        check_output(path, option)
    if plot_path is not None:
        require("matplotlib")  # before the run, not after it
    if samples < 30:
        console.print(f"[yellow]{samples} samples: results are not claimable (need >= 30)")
    if merge:
        try:
            result = merge_results([json.loads(path.read_text()) for path in merge])
        except (OSError, ValueError, KeyError) as e:
            raise typer.BadParameter(f"--merge: {e}") from e
    else:
        cfg = InferenceBenchConfig(model_names, ms, samples, names, dtype, device, seed)
        with progress_bars() as progress:
            result = run_inference_bench(cfg, progress)
        result["commit"] = commit or result["commit"]
        result["command"] = invocation()
    if judge_path is not None:
        try:
            table = json.loads(judge_path.read_text())
            result["dispatch_judged_out_of_sample"] = judge_table(result, table, str(judge_path))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise typer.BadParameter(f"--judge-table: {e}") from e
    write_results(result, to_markdown(result), json_path, md_path, plot_path, _inference_figure)
    if dispatch_path is not None:
        source = "swiglu-train bench-inference" + (f", {json_path.name}" if json_path else "")
        write_json_atomic(dispatch_path, dispatch_table(result, source))
        console.print(f"wrote {escape(str(dispatch_path))}")
