"""``swiglu-train bench-memory``: the stack table, saved-for-backward bytes and after-forward and
peak MiB per impl and depth (logic in ``bench/memory/stack.py``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer
from rich.markdown import Markdown
from rich.markup import escape

from swiglu_train.cli.app import (
    app,
    console,
    invocation,
    parse_ints,
    parse_shape,
    progress_bars,
    require_device,
)
from swiglu_train.cli.bench_results import check_results_path
from swiglu_train.extras import require
from swiglu_train.files import atomic_write, json_bytes, png_bytes

SEED_SHAPE = "11136,3584,14336,3584"  # seed 000's Qwen-7B-like [M, D, F, O]
# bench-memory's default off CUDA: saved bytes are exact at any size and scale with M and F,
# and the seed shape takes minutes per row on a CPU. This one takes seconds.
CPU_SHAPE = "1024,512,1408,512"


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

    from swiglu_train.bench.memory import stack as memory_stack
    from swiglu_train.bench.results import DTYPES, provenance
    from swiglu_train.layers import get_impl
    from swiglu_train.layers.registry import FP8_LABEL

    impls = [i for i in mlp_impl.split(",") if i]
    if not impls:
        raise typer.BadParameter("no impls given", param_hint="'--mlp-impl'")
    for impl in impls:
        get_impl(impl.removesuffix(FP8_LABEL), impl.endswith(FP8_LABEL))  # names the valid ones
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
            **provenance(torch.device(device), None),  # the GPU's name, versions, commit
        }
        # Everything is rendered in memory before any file is touched, then each is written
        # atomically: a failed render (the plot) leaves the previous run's three files as they
        # were, never a new JSON and table beside an old PNG.
        payload = {"meta": meta, "results": rows, "overhead": overhead}
        outputs = {
            json_path: json_bytes(payload),
            json_path.with_suffix(".md"): markdown.encode(),
            json_path.with_suffix(".png"): png_bytes(memory_stack.plot(rows), dpi=120),
        }
        for path, content in outputs.items():
            with atomic_write(path, "wb") as f:
                f.write(content)
        console.print(f"wrote {escape(str(json_path))} (.md, .png)")
