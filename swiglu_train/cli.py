"""The ``swiglu-train`` command line."""

from __future__ import annotations

import json
import os
import shlex
import sys
import tempfile
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
    os.replace(f.name, path)


@app.command()
def bench(
    shape: Annotated[str, typer.Option(help="M,D,F,O (tokens, model, ffn, output)")] = (
        "11136,3584,14336,3584"
    ),
    dtype: Annotated[str, typer.Option(help="bf16, fp16 or fp32")] = "bf16",
    variants: Annotated[
        str, typer.Option(help="comma-separated: eager,compile,normal,drop_h,liger,fla,quack")
    ] = "eager,compile,normal,drop_h,liger,fla,quack",
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
    with Progress(console=console, transient=True) as bar:

        def progress(label: str, total: int):
            task = bar.add_task(label, total=total)
            return lambda: bar.advance(task)

        result = run_bench(cfg, progress)
    result["meta"]["command"] = shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])
    markdown = to_markdown(result)
    console.print(Markdown(markdown))
    for name, reason in result["skipped"].items():
        console.print(f"[yellow]skipped {name}: {reason}")
    if json_path is not None:
        write_json_atomic(json_path, result)
        json_path.with_suffix(".md").write_text(markdown)
        console.print(f"wrote {json_path}")
