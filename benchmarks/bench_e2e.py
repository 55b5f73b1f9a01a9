"""End-to-end training-step benchmark: whole steps, configurations interleaved in rounds.

    python benchmarks/bench_e2e.py lightning --config 1b --seq-length 4096 --micro-batch-size 8 \
        --global-batch-size 32 --impls normal,drop_h,drop_h_quack,save_factors_quack \
        --checkpoint-layers 0,4,8,12,16 --budgets-gb 60,80,100 --planner --rounds 3 \
        --json e2e.json --md e2e.md --plot e2e.png
    python benchmarks/bench_e2e.py megatron --impls stock,stock_eager,normal,drop_h --rounds 3 \
        --json m.json --md m.md -- --num-layers 8 --hidden-size 2048 ...   (recipe arguments)

Lightning (swiglu_train/bench/e2e/lightning.py): impl x checkpointed blocks, whole optimizer
steps through the planner's own measurer, ``--warmup`` then ``--steps`` timed steps of
``--global-batch-size`` sequences (default: one micro-batch); tokens/s, the optimizer step's
time, after-forward and peak MiB as min/median/max over rounds, and MFU where the GPU's peak is
known. For each ``--budgets-gb``, each impl's best configuration of the grid that fits (its
best plan), and with ``--planner`` the planner's own pick (its short steps, its bisection, at
the same batching) set against the grid. The plot: tokens/s against memory budget, per impl.

Megatron (swiglu_train/bench/e2e/megatron.py): each round runs recipes/pretrain_megatron.py once
per impl, each a process of its own (``--launcher``); tokens/s is the median over the steps
after ``--warmup``, and the warm-up steps' own rates are kept.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer

from swiglu_train.bench.e2e.lightning import configure, lightning_settings, run_lightning
from swiglu_train.bench.e2e.megatron import megatron_settings, run_megatron
from swiglu_train.bench.e2e.report import lightning_markdown, megatron_markdown
from swiglu_train.bench.e2e.rounds import parse_list, point_writer, prior_points, write_result
from swiglu_train.integrations.lightning.planner import candidates

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "pretrain_megatron.py"
ROUNDS_0_HELP = "0 with --append --planner: the planner and its plans in the earlier rounds"
APPEND_HELP = "add rounds to --json's, made with the same settings (a run split across calls)"
app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


def command_line() -> str:
    return shlex.join(["python", *sys.argv])


def _budget_figure(result: dict) -> object:
    from swiglu_train.bench.e2e.plot import plot_budgets  # matplotlib: only for --plot

    return plot_budgets(result)


@app.command()
def lightning(
    config: Annotated[str, typer.Option(help="a packaged config or YAML path")] = "1b",
    seq_length: Annotated[int | None, typer.Option(help="default: the config's")] = None,
    micro_batch_size: Annotated[int | None, typer.Option()] = None,
    global_batch_size: Annotated[
        int | None,
        typer.Option(help="sequences per optimizer step, accumulated (default: one micro-batch)"),
    ] = None,
    impls: Annotated[str | None, typer.Option(help="default: every impl that runs here")] = None,
    checkpoint_layers: Annotated[str, typer.Option(help="N,N,... or 'all'")] = "all",
    budgets_gb: Annotated[
        str,
        typer.Option(
            help="GiB,GiB,... or auto:K (K between the grid's peaks): best plan per impl at each"
        ),
    ] = "",
    planner: Annotated[bool, typer.Option(help="also run the planner at each budget")] = False,
    rounds: Annotated[int, typer.Option(min=0, help=ROUNDS_0_HELP)] = 3,
    warmup: Annotated[int, typer.Option(min=0)] = 2,
    steps: Annotated[int, typer.Option(min=1)] = 5,
    seed: Annotated[int, typer.Option(help="of the visiting order")] = 0,
    commit: Annotated[str | None, typer.Option(help="recorded if git is absent")] = None,
    json_path: Annotated[Path | None, typer.Option("--json")] = None,
    append: Annotated[bool, typer.Option(help=APPEND_HELP)] = False,
    md: Annotated[Path | None, typer.Option()] = None,
    plot: Annotated[Path | None, typer.Option()] = None,
) -> None:
    """Lightning Llama: impl x checkpointed blocks, in rounds; best plan per budget."""
    cfg = configure(config, seq_length, micro_batch_size, global_batch_size, impls)
    names = candidates(cfg)
    layers = cfg.model.num_layers
    grid = (
        list(range(layers + 1))
        if checkpoint_layers == "all"
        else parse_list(checkpoint_layers, int)
    )
    if not grid or not all(0 <= n <= layers for n in grid):
        raise typer.BadParameter(f"counts from 0 to {layers}", param_hint="--checkpoint-layers")
    settings = lightning_settings(config, cfg, names, grid, warmup, steps)
    points = prior_points(json_path, settings) if append else []
    if rounds == 0 and not (points and planner):
        raise ValueError(
            "--rounds 0 measures only the planner's plans, in an earlier run's rounds: give "
            "--planner and --append with that run's --json"
        )
    result = run_lightning(
        cfg,
        settings,
        points,
        rounds=rounds,
        seed=seed,
        budgets_gb=budgets_gb,
        planner=planner,
        command=command_line(),
        commit=commit,
        on_point=point_writer(json_path, settings),
    )
    write_result(result, json_path, md, plot, lightning_markdown, _budget_figure)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def megatron(
    ctx: typer.Context,
    impls: Annotated[str, typer.Option()] = "stock,stock_eager,normal,drop_h",
    rounds: Annotated[int, typer.Option(min=1)] = 3,
    warmup: Annotated[int, typer.Option(min=0)] = 5,
    steps: Annotated[int, typer.Option(min=1)] = 20,
    launcher: Annotated[
        str, typer.Option(help="command that runs the recipe (its path included)")
    ] = f"torchrun --standalone --nproc-per-node 1 {RECIPE}",
    seed: Annotated[int, typer.Option(help="of the visiting order")] = 0,
    commit: Annotated[str | None, typer.Option()] = None,
    json_path: Annotated[Path | None, typer.Option("--json")] = None,
    append: Annotated[bool, typer.Option(help=APPEND_HELP)] = False,
    md: Annotated[Path | None, typer.Option()] = None,
    profile_impls: Annotated[
        str, typer.Option(help="impls whose first run also profiles a step (kernels, host)")
    ] = "",
    profile_dir: Annotated[
        Path, typer.Option(help="where those profiles go: profile_megatron_IMPL.json")
    ] = Path("."),
    sample_host: Annotated[
        Path | None,
        typer.Option(help="folder: every run under py-spy, its stacks there, top frames in JSON"),
    ] = None,
    sample_native: Annotated[
        bool, typer.Option(help="with --sample-host: C and C++ frames too (py-spy --native)")
    ] = False,
) -> None:
    """Megatron recipe: impls interleaved in rounds, one process each; the rest of the
    command line after ``--`` goes to the recipe."""
    settings = megatron_settings(parse_list(impls), list(ctx.args), warmup, steps)
    profiled = parse_list(profile_impls) if profile_impls else []
    if not set(profiled) <= set(settings["impls"]):
        raise ValueError(f"--profile-impls {profile_impls}: each must be one of --impls {impls}")
    profiles = {i: profile_dir / f"profile_megatron_{i}.json" for i in profiled}
    if sample_native and sample_host is None:
        raise ValueError("--sample-native samples with --sample-host DIR only: name the folder")
    points = prior_points(json_path, settings) if append else []
    result = run_megatron(
        settings,
        points,
        launcher=launcher,
        rounds=rounds,
        seed=seed,
        command=command_line(),
        commit=commit,
        profiles=profiles,
        host_samples=sample_host,
        native_samples=sample_native,
        on_point=point_writer(json_path, settings),
    )
    write_result(result, json_path, md, None, megatron_markdown, None)


if __name__ == "__main__":
    app()
