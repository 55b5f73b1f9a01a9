"""The ``swiglu-train`` command line."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markdown import Markdown
from rich.progress import Progress

app = typer.Typer(help="SwiGLU MLP layers that give pretraining its activation memory back.")
console = Console()


@app.callback()
def main() -> None:
    """swiglu-train: ParMLP impls, benchmarks and recipes."""


def _parse_shape(value: str) -> tuple[int, int, int, int]:
    parts = [int(v) for v in value.split(",")]
    if len(parts) != 4 or min(parts) < 1:
        raise typer.BadParameter("expected four positive integers M,D,F,O")
    return tuple(parts)  # type: ignore[return-value]


def write_json_atomic(path: Path, payload: dict) -> None:
    """Write through a temporary file and rename, so a crash never leaves half a result."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
    os.chmod(f.name, 0o644)  # temporary files are created private; results are for sharing
    os.replace(f.name, path)


def _invocation() -> str:
    """The command line as typed, for result files (``python -m`` shows up as its module)."""
    program = Path(sys.argv[0]).name
    if program == "__main__.py":
        program = "python -m swiglu_train"
    return " ".join([program, shlex.join(sys.argv[1:])])


@contextlib.contextmanager
def _progress() -> Iterator[Callable[[str, int], Callable[[], None]]]:
    """A rich progress bar factory: ``progress(label, total)`` returns the task's tick."""
    with Progress(console=console, transient=True) as bar:

        def progress(label: str, total: int) -> Callable[[], None]:
            task = bar.add_task(label, total=total)
            return lambda: bar.advance(task)

        yield progress


@app.command()
def bench(
    shape: Annotated[str, typer.Option(help="M,D,F,O (tokens, model, ffn, output)")] = (
        "11136,3584,14336,3584"
    ),
    dtype: Annotated[str, typer.Option(help="bf16, fp16 or fp32")] = "bf16",
    variants: Annotated[
        str,
        typer.Option(
            help="comma-separated: eager,compile,normal,drop_h,drop_h_fused,save_factors,"
            "liger,fla,quack"
        ),
    ] = "eager,compile,normal,drop_h,drop_h_fused,save_factors,liger,fla,quack",
    samples: Annotated[int, typer.Option(min=1, help="paired samples (use >= 30)")] = 40,
    warmup: Annotated[int, typer.Option(min=1)] = 3,
    stack_layers: Annotated[int, typer.Option(help="layers in the stack table; 0 skips")] = 4,
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
    if unknown:
        raise typer.BadParameter(f"unknown variants {unknown}; choose from {list(BUILDERS)}")
    if dtype not in DTYPES:
        raise typer.BadParameter(f"dtype must be one of {list(DTYPES)}")
    if samples < 30:
        console.print(f"[yellow]{samples} samples: results are not claimable (need >= 30)")
    cfg = BenchConfig(
        shape=_parse_shape(shape),
        dtype=dtype,
        variants=names,
        samples=samples,
        warmup=warmup,
        stack_layers=stack_layers,
        device=device,
        seed=seed,
        extra={"commit": commit},
    )
    with _progress() as progress:
        result = run_bench(cfg, progress)
    result["meta"]["command"] = _invocation()
    markdown = to_markdown(result)
    console.print(Markdown(markdown))
    for name, reason in result["skipped"].items():
        console.print(f"[yellow]skipped {name}: {reason}")
    if json_path is not None:
        write_json_atomic(json_path, result)
        json_path.with_suffix(".md").write_text(markdown)
        console.print(f"wrote {json_path}")


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
) -> None:
    """Time the gated projection and the whole MLP, forward only, in CUDA graphs."""
    from swiglu_train.bench.inference import (
        InferenceBenchConfig,
        parse_model,
        run_inference_bench,
        to_markdown,
    )
    from swiglu_train.bench.inference_variants import TABLES
    from swiglu_train.bench.mlp import DTYPES

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
    if samples < 30:
        console.print(f"[yellow]{samples} samples: results are not claimable (need >= 30)")
    cfg = InferenceBenchConfig(model_names, ms, samples, names, dtype, device, seed)
    with _progress() as progress:
        result = run_inference_bench(cfg, progress)
    result["commit"] = commit or result["commit"]
    result["command"] = _invocation()
    markdown = to_markdown(result)
    console.print(Markdown(markdown))
    if json_path is not None:
        write_json_atomic(json_path, result)
        console.print(f"wrote {json_path}")
    if md_path is not None:
        md_path.parent.mkdir(parents=True, exist_ok=True)
        md_path.write_text(markdown)
        console.print(f"wrote {md_path}")


@app.command("bench-memory")
def bench_memory(
    layers: Annotated[str, typer.Option(help="stack depths, comma-separated")] = "1,2,4,8",
    mlp_impl: Annotated[str, typer.Option(help="impls, comma-separated")] = "normal,drop_h",
    shape: Annotated[str, typer.Option(help="M,D,F,O")] = "11136,3584,14336,3584",
    device: Annotated[str, typer.Option(help="cpu (saved bytes only) or cuda")] = "cuda",
    dtype: Annotated[str, typer.Option(help="bf16, fp16 or fp32")] = "bf16",
    overhead_samples: Annotated[
        int, typer.Option(help="also time the profiler's own cost over this many paired steps")
    ] = 0,
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
) -> None:
    """The stack table: saved-for-backward bytes, after-forward and peak MiB per impl and depth."""
    from swiglu_train.bench import memory_stack
    from swiglu_train.bench.mlp import DTYPES
    from swiglu_train.layers import get_impl

    impls = [i for i in mlp_impl.split(",") if i]
    for impl in impls:
        get_impl(impl)  # a clear error listing the valid impls
    if dtype not in DTYPES:
        raise typer.BadParameter(f"dtype must be one of {list(DTYPES)}")
    depths = [int(v) for v in layers.split(",") if v]
    dims, torch_dtype = _parse_shape(shape), DTYPES[dtype]
    rows = []
    with _progress() as progress:
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
            "command": _invocation(),
            "shape": dims,
            "dtype": dtype,
            "device": device,
        }
        write_json_atomic(json_path, {"meta": meta, "results": rows, "overhead": overhead})
        json_path.with_suffix(".md").write_text(markdown)
        memory_stack.plot(rows).savefig(json_path.with_suffix(".png"), dpi=120)
        console.print(f"wrote {json_path} (.md, .png)")


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
    """Where normal, drop_h and save_factors win, by time and memory, over a grid of (M, D, F).

    Ship the --table file as swiglu_train/layers/crossover_<gpu family>.json.
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
    if samples < 30:
        console.print(f"[yellow]{samples} samples: results are not claimable (need >= 30)")
    cfg = CrossoverConfig(grid_m, grid_shapes, samples, warmup, dtype, device, seed, commit)
    with _progress() as progress:
        result = run_crossover(cfg, progress)
    result["meta"]["command"] = _invocation()
    markdown = to_markdown(result)
    console.print(Markdown(markdown))
    if json_path is not None:
        write_json_atomic(json_path, result)
        json_path.with_suffix(".md").write_text(markdown)
        console.print(f"wrote {json_path} (.md)")
    if table is not None:
        write_json_atomic(table, lookup_table(result))
        console.print(f"wrote {table}")


@app.command()
def compare_memory(
    runs: Annotated[
        list[str],
        typer.Argument(
            metavar="RUN", help="W&B run dir, .wandb file or memory.csv; LABEL=PATH names it"
        ),
    ],
    out: Annotated[Path, typer.Option(help="PNG to write; an HTML report goes next to it")],
    wandb_workspace: Annotated[
        str | None,
        typer.Option(metavar="ENTITY/PROJECT", help="also save a W&B workspace of these panels"),
    ] = None,
) -> None:
    """Compare the activation memory of runs per step and along depth: PNG + HTML report."""
    from swiglu_train.memory.plots import write_report
    from swiglu_train.memory.runs import load_runs

    if wandb_workspace is not None:
        from swiglu_train.memory.workspace import parse_entity_project

        try:
            parse_entity_project(wandb_workspace)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--wandb-workspace") from e
    try:
        loaded = load_runs(runs)
    except (FileNotFoundError, ValueError) as e:
        raise typer.BadParameter(str(e), param_hint="RUN") from e
    try:
        for path in write_report(loaded, out):
            console.print(f"wrote {path}")
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--out") from e
    if wandb_workspace is None:
        return
    import wandb

    from swiglu_train.memory.workspace import build_workspace

    try:
        build_workspace(wandb_workspace, loaded).save()
    except (wandb.errors.Error, OSError) as e:
        console.print(f"[red]could not save the W&B workspace to {wandb_workspace}: {e}")
        console.print("The PNG and HTML are written; log in (`wandb login`) with network to save.")
        raise typer.Exit(1) from e


@app.command()
def pretrain(
    config: Annotated[
        str | None, typer.Option(help="a YAML path, or tiny / 125m / 1b from configs/")
    ] = None,
    mlp_impl: Annotated[
        str | None, typer.Option(help="normal, drop_h, save_factors, or auto (from the table)")
    ] = None,
    data: Annotated[
        list[str] | None,
        typer.Option(help="text files or globs, .jsonl, or a Megatron .bin/.idx prefix"),
    ] = None,
    max_steps: Annotated[int | None, typer.Option()] = None,
    micro_batch_size: Annotated[int | None, typer.Option()] = None,
    devices: Annotated[str | None, typer.Option(help="e.g. 1, 2 or auto")] = None,
    strategy: Annotated[str | None, typer.Option(help="auto, ddp or fsdp")] = None,
    precision: Annotated[str | None, typer.Option(help="auto, bf16-mixed, 32-true")] = None,
    wandb_project: Annotated[str | None, typer.Option()] = None,
    wandb_group: Annotated[str | None, typer.Option()] = None,
    wandb_name: Annotated[str | None, typer.Option()] = None,
    output_dir: Annotated[str | None, typer.Option(help="checkpoints, W&B run, CSVs")] = None,
    resume: Annotated[str | None, typer.Option(help="a .ckpt path, or 'last'")] = None,
    summary_json: Annotated[Path | None, typer.Option(help="write the run summary here")] = None,
) -> None:
    """Pretrain a Llama-style model with ParMLP on local text (the stdlib by default)."""
    from rich.table import Table

    from swiglu_train.integrations.lightning.config import load_config
    from swiglu_train.integrations.lightning.pretrain import run_pretrain

    cfg = load_config(config)
    overrides = [
        (cfg.model, "mlp_impl", mlp_impl),
        (cfg.data, "data", data),
        (cfg.data, "micro_batch_size", micro_batch_size),
        (cfg.train, "max_steps", max_steps),
        (cfg.train, "devices", int(devices) if devices and devices.isdigit() else devices),
        (cfg.train, "strategy", strategy),
        (cfg.train, "precision", precision),
        (cfg.wandb, "project", wandb_project),
        (cfg.wandb, "group", wandb_group),
        (cfg.wandb, "name", wandb_name),
        (cfg, "output_dir", output_dir),
    ]
    for section, key, value in overrides:
        if value is not None:
            setattr(section, key, value)
    summary = run_pretrain(cfg, resume=resume)
    table = Table(title=f"pretrain summary ({summary['mlp_impl']})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in (
        "steps",
        "initial_loss",
        "final_loss",
        "val_loss",
        "tokens_per_s",
        "saved_MiB",
        "after_forward_MiB",
        "peak_MiB",
    ):
        value = summary[key]
        table.add_row(key, "—" if value is None else f"{value:,.4g}")
    console.print(table)
    if summary_json is not None:
        write_json_atomic(summary_json, summary)
        console.print(f"wrote {summary_json}")


@app.command()
def convert(
    src: Annotated[Path, typer.Argument(help="input .ckpt or .pt")],
    dst: Annotated[Path, typer.Argument(help="output path (written atomically)")],
    to: Annotated[str, typer.Option(help="packed, canonical, or hf (gate/up/down_proj)")],
    chunk: Annotated[int | None, typer.Option(help="chunk of the packed layout")] = None,
    assume_layout: Annotated[
        str | None,
        typer.Option(help="layout of unstamped fc1 weights: canonical, packed:C, or hf"),
    ] = None,
    trust: Annotated[bool, typer.Option(help="unpickle arbitrary objects (trusted files)")] = False,
) -> None:
    """Convert ParMLP fc1 weights, and their optimizer state, between layouts."""
    import torch
    from rich.table import Table

    from swiglu_train.layers.layout import CANONICAL, Layout
    from swiglu_train.packing import convert_checkpoint, from_hf, to_hf

    if to not in ("packed", "canonical", "hf"):
        raise typer.BadParameter("--to must be packed, canonical or hf")
    try:
        ckpt = torch.load(src, map_location="cpu", weights_only=not trust)
    except FileNotFoundError:
        raise typer.BadParameter(f"{src} does not exist") from None
    except Exception as e:  # weights_only refuses arbitrary pickled objects
        raise typer.BadParameter(f"cannot load {src} safely ({e}); pass --trust if you do") from e
    state = ckpt.get("state_dict", ckpt)
    stamped = any(k.endswith("_extra_state") for k in state)
    if not stamped and assume_layout is None:
        raise typer.BadParameter(
            f"{src} carries no fc1 layout stamp; say what it is with --assume-layout "
            "(canonical, packed:C or hf)"
        )
    report = []
    if assume_layout == "hf":
        ckpt = from_hf(ckpt, report)
        assume = CANONICAL
    elif assume_layout and assume_layout.startswith("packed:"):
        assume = Layout("packed", int(assume_layout.split(":", 1)[1]))
    elif assume_layout in (None, "canonical"):
        assume = CANONICAL
    else:
        raise typer.BadParameter(
            f"--assume-layout {assume_layout!r}: use canonical, packed:C or hf"
        )
    if to == "hf" and "state_dict" in ckpt:
        raise typer.BadParameter("--to hf takes a bare state_dict (no optimizer state)")
    try:
        if to == "hf":
            if assume != CANONICAL:
                ckpt = convert_checkpoint(ckpt, to="canonical", assume_layout=assume)
            out = to_hf(ckpt, report)
        else:
            out = convert_checkpoint(ckpt, to=to, chunk=chunk, assume_layout=assume, report=report)
    except ValueError as e:  # a layout the input cannot take, named by the converter
        raise typer.BadParameter(str(e)) from e
    dst.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=dst.parent, delete=False, suffix=".tmp") as f:
        torch.save(out, f)
    os.chmod(f.name, 0o644)
    os.replace(f.name, dst)
    table = Table(title=f"{src} -> {dst}")
    for column in ("ParMLP", "from", "to", "optimizer states moved"):
        table.add_column(column)
    for r in report:
        table.add_row(r.prefix.rstrip(".") or "(root)", r.source, r.target, str(r.optimizer_states))
    console.print(table)
