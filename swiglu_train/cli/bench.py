"""Benchmark commands: bench, bench-inference, bench-memory, bench-crossover (bench-grid is in
cli/grid.py), and the output writing they share."""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable
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
    parse_ints,
    parse_shape,
    progress_bars,
    require_device,
)
from swiglu_train.extras import require
from swiglu_train.files import atomic_write, write_json_atomic

SEED_SHAPE = "11136,3584,14336,3584"  # seed 000's Qwen-7B-like [M, D, F, O]
# bench-memory's default off CUDA: saved bytes are exact at any size and scale with M and F,
# and the seed shape takes minutes per row on a CPU. This one takes seconds.
CPU_SHAPE = "1024,512,1408,512"


def check_results_path(json_path: Path | None, siblings: tuple[str, ...]) -> None:
    """--json and the files written beside it (its name with these suffixes) must be writable and
    distinct: ``--json r.md`` would have the table overwrite the JSON."""
    if json_path is None:
        return
    if json_path.suffix in siblings:
        raise typer.BadParameter(
            f"{json_path}: the {'/'.join(siblings)} written beside it would replace it; "
            "give a .json path",
            param_hint="'--json'",
        )
    for path in (json_path, *(json_path.with_suffix(suffix) for suffix in siblings)):
        check_output(path, "'--json'")


def write_results(
    result: dict,
    markdown: str,
    json_path: Path | None,
    md_path: Path | None,
    plot_path: Path | None,
    plot: Callable[[dict], object],
) -> None:
    """Print the tables, then write each output asked for, atomically, naming it. ``plot``
    imports matplotlib (the plot extra) only when a plot is asked for."""
    console.print(Markdown(markdown))
    if json_path is not None:
        write_json_atomic(json_path, result)
        console.print(f"wrote {escape(str(json_path))}")
    if md_path is not None:
        with atomic_write(md_path) as f:
            f.write(markdown)
        console.print(f"wrote {escape(str(md_path))}")
    if plot_path is not None:
        with atomic_write(plot_path, "wb") as f:
            plot(result).savefig(f, format="png", dpi=110)
        console.print(f"wrote {escape(str(plot_path))}")


def _inference_figure(result: dict) -> object:
    from swiglu_train.bench.inference_plot import plot_inference

    return plot_inference(result)


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
            "save_factors,save_factors_fused,save_factors_quack,liger,fla,quack, and "
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
    from swiglu_train.bench.mlp import DTYPES, BenchConfig, run_bench, to_markdown
    from swiglu_train.bench.variants import BUILDERS

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
    from swiglu_train.bench.inference import (
        InferenceBenchConfig,
        parse_model,
        run_inference_bench,
        to_markdown,
    )
    from swiglu_train.bench.inference_dispatch import dispatch_table, judge_table, merge_results
    from swiglu_train.bench.inference_variants import TABLES
    from swiglu_train.bench.mlp import DTYPES

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


@app.command("bench-memory")
def bench_memory(
    layers: Annotated[str, typer.Option(help="stack depths, comma-separated")] = "1,2,4,8",
    mlp_impl: Annotated[str, typer.Option(help="impls, comma-separated")] = "normal,drop_h",
    shape: Annotated[
        str | None,
        typer.Option(help=f"M,D,F,O [default: {SEED_SHAPE} on CUDA, {CPU_SHAPE} on CPU]"),
    ] = None,
    device: Annotated[str, typer.Option(help="cpu (saved bytes only) or cuda")] = "cuda",
    dtype: Annotated[str, typer.Option(help="bf16, fp16 or fp32")] = "bf16",
    overhead_samples: Annotated[
        int,
        typer.Option(min=0, help="also time the profiler's own cost over this many paired steps"),
    ] = 0,
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
) -> None:
    """The stack table: saved-for-backward bytes, after-forward and peak MiB per impl and depth."""
    import torch

    from swiglu_train.bench import memory_stack
    from swiglu_train.bench.mlp import DTYPES
    from swiglu_train.layers import get_impl

    impls = [i for i in mlp_impl.split(",") if i]
    if not impls:
        raise typer.BadParameter("no impls given", param_hint="'--mlp-impl'")
    for impl in impls:
        get_impl(impl)  # a clear error listing the valid impls
    if dtype not in DTYPES:
        raise typer.BadParameter(f"dtype must be one of {list(DTYPES)}")
    require_device(device)
    depths = parse_ints(layers, "'--layers'")
    check_results_path(json_path, (".md", ".png"))
    if json_path is not None:
        require("matplotlib")  # for the .png: before the run, not after it
    on_cpu = torch.device(device).type == "cpu"
    if shape is None:
        shape = CPU_SHAPE if on_cpu else SEED_SHAPE
        if on_cpu:
            console.print(f"shape {shape} (M,D,F,O), CPU-sized; --shape {SEED_SHAPE} is the seed's")
    dims, torch_dtype = parse_shape(shape), DTYPES[dtype]
    if on_cpu and math.prod(dims[:3]) > 8 * math.prod(parse_shape(CPU_SHAPE)[:3]):
        console.print(f"[yellow]shape {shape} on CPU: each row can take minutes")
    rows = []
    with progress_bars() as progress:
        tick = progress("stack memory", len(impls) * len(depths))
        for impl in impls:
            for depth in depths:
                rows.append(memory_stack.stack_row(impl, depth, dims, torch_dtype, device))
                tick()
        overhead = [
            memory_stack.profiler_overhead(
                impl, max(depths), dims, torch_dtype, device, overhead_samples
            )
            for impl in (impls if overhead_samples else [])
        ]
    markdown = memory_stack.to_markdown(rows)
    console.print(Markdown(markdown))
    for o in overhead:
        console.print(
            f"profiler overhead ({o['impl']}, {o['layers']} layers, {o['step_ms']:.2f} ms/step): "
            f"totals {o['totals_overhead']:+.2%}, per-layer {o['per_layer_overhead']:+.2%}"
        )
    if json_path is not None:
        meta = {
            "command": invocation(),
            "shape": dims,
            "dtype": dtype,
            "device": device,
        }
        # Everything is rendered in memory before any file is touched, then each is written
        # atomically: a failed render (the plot) leaves the previous run's three files as they
        # were, never a new JSON and table beside an old PNG.
        payload = {"meta": meta, "results": rows, "overhead": overhead}
        png = io.BytesIO()
        memory_stack.plot(rows).savefig(png, format="png", dpi=120)
        outputs = {
            json_path: json.dumps(payload, indent=2).encode() + b"\n",
            json_path.with_suffix(".md"): markdown.encode(),
            json_path.with_suffix(".png"): png.getvalue(),
        }
        for path, content in outputs.items():
            with atomic_write(path, "wb") as f:
                f.write(content)
        console.print(f"wrote {escape(str(json_path))} (.md, .png)")


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
