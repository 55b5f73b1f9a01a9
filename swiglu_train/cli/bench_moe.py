"""``swiglu-train bench-moe``: routed SwiGLU experts (ParExperts' impls and the peers) against
the grouped-GEMM floor at the expert shapes of public MoE models (logic in ``bench/moe/``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from swiglu_train.cli.app import app, console, invocation, progress_bars, require_device
from swiglu_train.cli.bench_results import check_results_path, write_results
from swiglu_train.extras import require
from swiglu_train.files import atomic_write, write_json_atomic

if TYPE_CHECKING:
    from swiglu_train.bench.moe.harness import MoEConfig


def _figure(result: dict) -> object:
    from swiglu_train.bench.moe.plot import plot_moe

    return plot_moe(result)


def _names(value: str, option: str, known: list[str]) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        what = f"unknown {unknown}" if unknown else "none given"
        raise typer.BadParameter(f"{what}; choose from {', '.join(known)}", param_hint=option)
    return list(dict.fromkeys(names))


@app.command("bench-moe")
def bench_moe(
    models: Annotated[
        str | None,
        typer.Option(help="listed models, comma-separated (default: all; see --list-models)"),
    ] = None,
    shapes: Annotated[
        str | None, typer.Option(help="custom D,F,E,K shapes separated by ';', not --models")
    ] = None,
    routing: Annotated[str, typer.Option(help="balanced, skewed or both")] = "balanced,skewed",
    tokens: Annotated[int, typer.Option(min=1, help="tokens T per step")] = 8192,
    variants: Annotated[str | None, typer.Option(help="comma-separated (default: all)")] = None,
    samples: Annotated[int, typer.Option(min=1, help="paired samples per point (use >= 30)")] = 30,
    warmup: Annotated[int, typer.Option(min=1, help="steps per variant before timing")] = 3,
    dtype: Annotated[str, typer.Option(help="bf16, fp16 or fp32")] = "bf16",
    device: Annotated[str, typer.Option(help="cuda, or cpu for a smoke run")] = "cuda",
    seed: int = 0,
    timeline: Annotated[
        bool,
        typer.Option(help="record each variant's kernels and the GPU's idle gaps (CUDA only)"),
    ] = False,
    prewarm_workers: Annotated[
        int,
        typer.Option(
            min=0,
            help="compile each model's variants in this many worker processes first, several "
            "models at once, within the GPU's free memory (0: each in the timing pass)",
        ),
    ] = 0,
    commit: Annotated[str | None, typer.Option(help="commit to record if git is absent")] = None,
    out: Annotated[
        Path | None,
        typer.Option(help="write the JSON and .md here (after every point), the .png beside them"),
    ] = None,
    merge: Annotated[
        list[Path] | None,
        typer.Option(help="merge these results (same GPU, dtype, tokens) instead of running"),
    ] = None,
    list_models: Annotated[bool, typer.Option(help="print the model list and exit")] = False,
    router_weights_on: Annotated[
        str,
        typer.Option(
            help="output (Mixtral, Qwen, DeepSeek) or input (Llama-4): where the "
            "router weight scales each expert; each side races the variants it offers"
        ),
    ] = "output",
) -> None:
    """Every ParExperts impl and peer, paired with the six grouped GEMMs of the step.

    SonicMoE needs a quack other than the project's, so it runs in a process of its own;
    --merge joins that run's JSON to the main run's.
    """
    from swiglu_train.bench.moe.harness import MoEConfig
    from swiglu_train.bench.moe.report import merge_results, to_markdown
    from swiglu_train.bench.moe.routing import ROUTINGS
    from swiglu_train.bench.moe.shapes import MODELS, parse_shapes, select_models
    from swiglu_train.bench.moe.variants import SIDES, VARIANTS
    from swiglu_train.bench.results import DTYPES

    if list_models:
        for m in MODELS:
            note = f"; {m.note}" if m.note else ""
            console.print(f"{m.name}: D={m.d} F={m.f} E={m.e} k={m.k} ({m.repo}{note})")
        return
    check_results_path(out, (".md", ".png"))
    if out is not None:
        require("matplotlib")  # for the .png: before the run, not after it
    if merge:
        try:
            result = merge_results([json.loads(path.read_text()) for path in merge])
        except (OSError, ValueError, KeyError) as e:
            raise typer.BadParameter(str(e), param_hint="'--merge'") from e
    else:
        if dtype not in DTYPES:
            raise typer.BadParameter(f"choose from {list(DTYPES)}", param_hint="'--dtype'")
        if models is not None and shapes is not None:
            raise typer.BadParameter("give --models or --shapes, not both")
        try:
            chosen = parse_shapes(shapes) if shapes else None
            if chosen is None:
                names = models.split(",") if models else [m.name for m in MODELS]
                chosen = select_models([n.strip() for n in names if n.strip()])
        except ValueError as e:
            raise typer.BadParameter(str(e)) from e
        routings = _names(routing, "'--routing'", list(ROUTINGS))
        if router_weights_on not in SIDES:
            hint = "'--router-weights-on'"
            raise typer.BadParameter(f"choose from {list(SIDES)}", param_hint=hint)
        side = SIDES[router_weights_on]
        names = _names(variants or ",".join(side), "'--variants'", list(VARIANTS))
        require_device(device)
        if samples < 30:
            console.print(f"[yellow]{samples} samples: results are not claimable (need >= 30)")
        cfg = MoEConfig(
            chosen, routings, tokens, names, samples, warmup, dtype, device, seed, timeline,
            prewarm_workers, router_weights_on=router_weights_on,
        )  # fmt: skip
        cfg.extra = {"commit": commit, "command": invocation()}
        result = _run(cfg, out)
    siblings = (None, None) if out is None else (out.with_suffix(".md"), out.with_suffix(".png"))
    write_results(result, to_markdown(result), out, *siblings, _figure)


def _prewarm(cfg: MoEConfig) -> dict:
    """The pre-warm, a line per model as its worker finishes; its record."""
    from swiglu_train.bench.moe.prewarm import prewarm_moe

    models, warmed = len(set(cfg.shapes)), 0

    def on_point(outcome) -> None:
        nonlocal warmed
        warmed += 1
        console.print(f"[pre-warm {warmed}/{models}] {outcome.describe()}", markup=False)

    return prewarm_moe(cfg, on_point)


def _run(cfg: MoEConfig, out: Path | None) -> dict:
    """The run with progress bars and a line per point; the JSON and the markdown rewritten
    after each."""
    from swiglu_train.bench.moe.harness import run_moe
    from swiglu_train.bench.moe.report import to_markdown

    points, began = cfg.points(), time.perf_counter()
    done = 0
    if cfg.prewarm_workers:
        cfg.extra["prewarm"] = _prewarm(cfg)

    def on_point(result: dict) -> None:
        nonlocal done
        shape, routing = points[done]
        key = (shape.name, routing)
        done += 1
        ratios = ", ".join(
            f"{r['variant']} {r['full_over_floor']:.2f}"
            for r in result["rows"]
            if (r["model"], r["routing"]) == key and r["variant"] != "floor"
        )
        point = next((p for p in result["points"] if (p["model"], p["routing"]) == key), None)
        slowest = max(point["prepare_s"].items(), key=lambda item: item[1]) if point else None
        first = point["first_step_s"].get(slowest[0]) if slowest else None
        console.print(
            f"[{done}/{len(points)}] {shape.name} {routing} ({time.perf_counter() - began:.0f} s"
            + (f"; slowest to prepare {slowest[0]}, {slowest[1]:.0f} s" if slowest else "")
            + (f" ({first:.0f} s its first step)" if first is not None else "")
            + (f"; reference {point['reference_s']:.0f} s" if point else "")
            + "): "
            + (f"step ÷ floor {ratios}" if ratios else "nothing measured (see the skips)"),
            markup=False,
        )
        if out is not None:  # a run cut at a device call's limit keeps its tables too
            write_json_atomic(out, result)
            with atomic_write(out.with_suffix(".md")) as f:
                f.write(to_markdown(result))

    with progress_bars() as progress:
        result = run_moe(cfg, progress, on_point)
    for s in result["skipped"]:
        console.print(f"[yellow]skipped {s['model']} {s['routing']} {s['variant']}: "
                      f"{escape(s['reason'])}")  # fmt: skip
    return result
