"""Training-side commands: pretrain, convert, compare-memory."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from swiglu_train.cli.app import (
    app,
    check_output,
    console,
)
from swiglu_train.cli.torch_files import damaged, load_error
from swiglu_train.extras import require
from swiglu_train.files import atomic_write, write_json_atomic

# Errors of a write: one that names no file is taken to be a write under the run's output_dir.
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


@contextlib.contextmanager
def naming_output_dir(path: str | Path) -> Iterator[None]:
    """Raise a write error that names no file again, naming the run's output directory, where
    the run writes its checkpoints, CSVs and W&B files: Lightning writes checkpoints through
    fsspec, whose ENOSPC names none, and the CLI's one line would not say where."""
    try:
        yield
    except OSError as e:
        if e.filename is not None or e.errno not in WRITE_ERRNOS:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from e


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
    check_output(out, "'--out'")
    check_output(out.with_suffix(".html"), "'--out'")
    try:
        loaded = load_runs(runs)
    except (FileNotFoundError, ValueError) as e:
        raise typer.BadParameter(str(e), param_hint="RUN") from e
    try:
        for path in write_report(loaded, out):
            console.print(f"wrote {escape(str(path))}")
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--out") from e
    if wandb_workspace is None:
        return
    import wandb

    from swiglu_train.memory.workspace import build_workspace

    try:
        build_workspace(wandb_workspace, loaded).save()
    except (wandb.errors.Error, OSError) as e:
        where = escape(wandb_workspace)
        console.print(f"[red]could not save the W&B workspace to {where}: {escape(str(e))}")
        console.print("The PNG and HTML are written; log in (`wandb login`) with network to save.")
        raise typer.Exit(1) from e


def positive_int(text: str) -> bool:
    """Whether ``text`` is a count of at least 1, as digits (no sign, no point)."""
    return text.isdigit() and int(text) >= 1


@app.command()
def pretrain(
    config: Annotated[
        str | None,
        typer.Option(
            help="a YAML path, or a packaged config: tiny, 125m, 1b or 3b; MoE: tiny_moe, moe_1b"
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            help="train a Hugging Face or LitGPT architecture instead: hf:PATH/config.json (or "
            "a packaged one: hf:moe_1b, hf:tiny_moe) or litgpt:NAME (random init, nothing "
            "downloaded; its MLPs patched to --mlp-impl)"
        ),
    ] = None,
    mlp_impl: Annotated[
        str | None,
        typer.Option(
            help="an impl (swiglu-train impls lists them), or auto (from the table); routed "
            "experts run normal, drop_h or drop_h_quack, and take drop_h (drop_h_quack) for the "
            "others; stock (with --model): the host's own MLPs and experts, unpatched"
        ),
    ] = None,
    experts_implementation: Annotated[
        str | None,
        typer.Option(
            metavar="eager|grouped_mm|batched_mm",
            help="with --mlp-impl stock and an HF MoE --model: transformers' experts code "
            "(default: its own, grouped_mm where the model supports it)",
        ),
    ] = None,
    mlp_chunk: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="save_factors' fc1 pack chunk: rows per gate/up block, dividing the ffn size "
            "(default: the largest power of two up to 128 dividing it); refused with an impl "
            "that does not pack, or with save_factors_quack (chunk 1) unless 1",
        ),
    ] = None,
    saved_fp8: Annotated[
        bool | None,
        typer.Option(
            "--saved-fp8/--no-saved-fp8",
            help="drop_h only: keep the preactivation saved for backward in FP8 (e4m3, one "
            "scale per 128 columns), about half its bytes; weights and checkpoints unchanged",
        ),
    ] = None,
    float8: Annotated[
        str | None,
        typer.Option(
            metavar="tensorwise|rowwise",
            help="train the linears in FP8 through torchao's Float8Linear with this scaling "
            "recipe, the lm head in bf16; --mlp-impl drop_h (its own six FP8 GEMMs, h never "
            "kept) or normal (torchao's MLP), on a GPU of compute capability 8.9+ "
            "(docs/fp8-training.md)",
        ),
    ] = None,
    compile_blocks: Annotated[
        bool | None,
        typer.Option(
            "--compile/--no-compile",
            help="torch.compile each transformer block (default: on with --float8, whose "
            "casts are slow unfused, off without)",
        ),
    ] = None,
    checkpoint_layers: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="activation-checkpoint the first N transformer blocks: each keeps only its "
            "input for backward and runs its forward again there",
        ),
    ] = None,
    activation_checkpointing: Annotated[
        str | None,
        typer.Option(
            metavar="auto|manual",
            help="auto: first measure short steps and pick the MLP impl and --checkpoint-layers "
            "that fit --memory-budget-gb at the highest tokens/s (docs/planner.md); manual "
            "(default): --checkpoint-layers as given",
        ),
    ] = None,
    memory_budget_gb: Annotated[
        float | None,
        typer.Option(help="the planner's memory budget, GiB (default: the GPU's less 5 %)"),
    ] = None,
    plan_impls: Annotated[
        str | None,
        typer.Option(
            help="comma-separated impls the planner tries, drop_h+fp8 among them (default: "
            "every impl that runs here; --mlp-impl alone pins one)"
        ),
    ] = None,
    data: Annotated[
        list[str] | None,
        typer.Option(help="text files or globs, .jsonl, or a Megatron .bin/.idx prefix"),
    ] = None,
    max_steps: Annotated[int | None, typer.Option(min=1)] = None,
    micro_batch_size: Annotated[
        str | None,
        typer.Option(
            metavar="N|auto",
            help="sequences per step; auto: the planner picks it among the divisors of "
            "--global-batch-size (needs --activation-checkpointing auto)",
        ),
    ] = None,
    global_batch_size: Annotated[
        int | None,
        typer.Option(min=1, help="sequences per optimizer step, for --micro-batch-size auto"),
    ] = None,
    accelerator: Annotated[
        str | None, typer.Option(help="auto (a GPU where there is one), cpu or gpu")
    ] = None,
    devices: Annotated[str | None, typer.Option(help="e.g. 1, 2 or auto")] = None,
    strategy: Annotated[
        str | None,
        typer.Option(
            help="auto, ddp, fsdp (Lightning's FSDP1, CUDA only) or fsdp2 (torch's fully_shard "
            "per block over every device; checkpoints are sharded directories: docs/scale.md)"
        ),
    ] = None,
    precision: Annotated[
        str | None, typer.Option(help="auto, bf16-mixed, bf16-true, 32-true")
    ] = None,
    wandb_project: Annotated[str | None, typer.Option()] = None,
    wandb_group: Annotated[str | None, typer.Option()] = None,
    wandb_name: Annotated[str | None, typer.Option()] = None,
    output_dir: Annotated[str | None, typer.Option(help="checkpoints, W&B run, CSVs")] = None,
    resume: Annotated[str | None, typer.Option(help="a .ckpt path, or 'last'")] = None,
    init_from: Annotated[
        str | None,
        typer.Option(
            help="start a new run from a checkpoint's weights (import-hf's, say), in its shape"
        ),
    ] = None,
    summary_json: Annotated[Path | None, typer.Option(help="write the run summary here")] = None,
) -> None:
    """Pretrain a Llama-style model with ParMLP on local text (the stdlib by default)."""
    from rich.table import Table

    require("lightning", "wandb")  # a missing one: one line naming its extra, before any work
    if float8 is not None:
        require("torchao")
    from swiglu_train.integrations.lightning.config import load_config
    from swiglu_train.integrations.lightning.pretrain import run_pretrain
    from swiglu_train.memory.profiler import NOT_MEASURED

    auto_micro = micro_batch_size == "auto"
    if micro_batch_size is not None and not auto_micro and not positive_int(micro_batch_size):
        raise typer.BadParameter(f"must be a positive integer or auto, got {micro_batch_size!r}",
                                 param_hint="'--micro-batch-size'")  # fmt: skip
    micro = int(micro_batch_size) if micro_batch_size is not None and not auto_micro else None
    cfg = load_config(config)
    if model is not None:  # first: its sizes replace the config's; --mlp-* then apply to it
        cfg.model = dataclasses.replace(cfg.model, source=model)
    overrides = [
        (cfg.model, "mlp_impl", mlp_impl),
        (cfg.model, "experts_implementation", experts_implementation),
        (cfg.model, "mlp_chunk", mlp_chunk),
        (cfg.model, "saved_fp8", saved_fp8),
        (cfg.model, "float8", float8),
        (cfg.model, "compile_blocks", compile_blocks),
        (cfg.model, "checkpoint_layers", checkpoint_layers),
        (cfg.train, "activation_checkpointing", activation_checkpointing),
        (cfg.train, "memory_budget_gb", memory_budget_gb),
        (cfg.train, "plan_impls", plan_impls.split(",") if plan_impls is not None else None),
        (cfg.data, "data", data),
        (cfg.data, "micro_batch_size", micro),
        (cfg.train, "auto_micro_batch_size", auto_micro or None),
        (cfg.train, "global_batch_size", global_batch_size),
        (cfg.train, "max_steps", max_steps),
        (cfg.train, "accelerator", accelerator),
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
    if cfg.train.activation_checkpointing == "auto" and mlp_impl and plan_impls is None:
        fp8 = "+fp8" if cfg.model.saved_fp8 else ""  # the impl named is the one to plan
        cfg.train.plan_impls = [f"{mlp_impl}{fp8}"]
    check_output(cfg.output_dir, "'--output-dir' (or output_dir in the config)", directory=True)
    check_output(summary_json, "'--summary-json'")
    with naming_output_dir(cfg.output_dir):
        summary = run_pretrain(cfg, resume=resume, init_from=init_from)
    if summary is None:  # a DDP rank other than 0: rank 0 reports the run
        return
    ran = ", ".join(filter(None, (summary["mlp_impl"], summary["experts_implementation"])))
    table = Table(title=f"pretrain summary ({ran})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in (
        "steps",
        "initial_loss",
        "final_loss",
        "val_loss",
        "tokens_per_s",
        "checkpoint_layers",
        "saved_MiB",
        "after_forward_MiB",
        "peak_MiB",
    ):
        value = summary[key]
        table.add_row(key, "—" if value is None else f"{value:,.4g}")
    console.print(table)
    if summary["after_forward_MiB"] is None:
        console.print(NOT_MEASURED, markup=False)
    print_outputs(summary)
    if summary_json is not None:
        write_json_atomic(summary_json, summary)
        console.print(f"wrote {escape(str(summary_json))}")


def print_outputs(summary: dict) -> None:
    """Where the run's files went, one per line (never wrapped, so a path can be copied)."""
    run = summary["wandb_run_dir"]
    online = summary["wandb_url"]
    lines = [
        f"checkpoints: {summary['checkpoint_dir']} (continue the run with --resume last)",
        f"memory per step: {summary['memory_csv']}",
        f"W&B run: {online} ({run})" if online else
        f"W&B run (offline): {run} (`wandb sync {run}` uploads it)",
    ]  # fmt: skip
    for line in lines:
        console.print(line, markup=False, highlight=False)


@app.command()
def convert(
    src: Annotated[
        Path,
        typer.Argument(
            help="input: a Lightning .ckpt (or a sharded one's directory), or a .pt holding a "
            "bare state_dict"
        ),
    ],
    dst: Annotated[Path, typer.Argument(help="output path (written atomically)")],
    to: Annotated[
        str,
        typer.Option(
            help="packed, canonical, or hf (MLP keys as gate/up/down_proj, weights only; "
            "export-hf writes a pretrain checkpoint's whole model for transformers)"
        ),
    ],
    chunk: Annotated[
        int | None, typer.Option(help="chunk of the packed layout (default 128)")
    ] = None,
    assume_layout: Annotated[
        str | None,
        typer.Option(
            help="layout of fc1 weights the file does not record: canonical, packed:C, or hf; "
            "a layout the file records must agree"
        ),
    ] = None,
    trust: Annotated[bool, typer.Option(help="unpickle arbitrary objects (trusted files)")] = False,
) -> None:
    """Convert ParMLP fc1 weights, and their optimizer state, between layouts.

    A Lightning checkpoint's hyper-parameters are made to name an impl and chunk of the new
    layout (model.mlp_impl: kept if it builds it, else drop_h for canonical, save_factors for
    packed; model.mlp_chunk: the new chunk, cleared for canonical), so that
    load_from_checkpoint, and pretrain --resume with those settings, build a model that takes it.
    """
    import torch
    from rich.table import Table

    from swiglu_train.cli.checkpoints import read_sharded
    from swiglu_train.layers.layout import CANONICAL, Layout
    from swiglu_train.packing import (
        convert_checkpoint,
        from_hf,
        hparams_chunk,
        hparams_impl,
        records_layout,
        to_hf,
    )

    if to not in ("packed", "canonical", "hf"):
        raise typer.BadParameter("--to must be packed, canonical or hf")
    if chunk is not None and chunk < 1:
        raise typer.BadParameter(
            f"must be a positive number of rows, got {chunk}", param_hint="--chunk"
        )
    if chunk is not None and to != "packed":
        raise typer.BadParameter("applies to --to packed only", param_hint="--chunk")
    assume = None  # None: the layout the checkpoint records
    if assume_layout == "canonical":
        assume = CANONICAL
    elif assume_layout and assume_layout.startswith("packed:"):
        try:
            assume = Layout("packed", int(assume_layout.split(":", 1)[1]))
        except ValueError as e:
            raise typer.BadParameter(f"{assume_layout!r}: {e}", param_hint="--assume-layout") from e
    elif assume_layout not in (None, "hf"):
        raise typer.BadParameter(
            f"--assume-layout {assume_layout!r}: use canonical, packed:C or hf"
        )
    check_output(dst, "DST")  # os.replace would fail only after the whole conversion
    try:
        ckpt = read_sharded(src, trust, "SRC")
        if ckpt is None:
            ckpt = torch.load(src, map_location="cpu", weights_only=not trust)
    except FileNotFoundError:
        raise typer.BadParameter(f"{src} does not exist") from None
    except OSError as e:  # unreadable (a directory, permissions), or torch seeking past the
        damage = damaged(src, e)  # end of a file cut short (EINVAL)
        if damage is None:  # the CLI's one line, naming the file
            raise OSError(e.errno, e.strerror or str(e), e.filename or str(src)) from e
        raise typer.BadParameter(damage) from e
    except Exception as e:  # not a checkpoint, a refused pickle, an empty or damaged file
        raise typer.BadParameter(load_error(src, e, trust)) from e
    if not isinstance(ckpt, dict):
        raise typer.BadParameter(f"{src} holds a {type(ckpt).__name__}, not a checkpoint dict")
    if assume_layout is None and not records_layout(ckpt):
        raise typer.BadParameter(
            f"{src} does not record its fc1 layout; say what it is with --assume-layout "
            "(canonical, packed:C or hf)"
        )
    report = []
    try:
        if assume_layout == "hf":
            ckpt = from_hf(ckpt, report)
        if to == "hf":
            out = to_hf(ckpt, report, assume_layout=assume)
        else:
            out = convert_checkpoint(ckpt, to=to, chunk=chunk, assume_layout=assume, report=report)
    except ValueError as e:  # a layout the input cannot take, named by the converter
        raise typer.BadParameter(f"{src}: {e}") from e
    with atomic_write(dst, "wb") as f:
        torch.save(out, f)
    table = Table(title=escape(f"{src} -> {dst}"))
    for column in ("ParMLP", "from", "to", "optimizer states moved"):
        table.add_column(column)
    for r in report:
        prefix = escape(r.prefix.rstrip(".")) or "(root)"
        table.add_row(prefix, r.source, r.target, str(r.optimizer_states))
    console.print(table)
    if to == "hf" and hparams_impl(ckpt) is not None:  # a pretrain checkpoint: a whole model
        whole = f"swiglu-train export-hf {src} DIR"
        console.print(f"{escape(str(dst))} renames the MLP keys only; `{escape(whole)}` writes "
                      "the whole model for transformers")  # fmt: skip
    if to == "hf" or hparams_impl(out) is None:  # no saved init args to build a model from
        return
    for key, read in (("mlp_impl", hparams_impl), ("mlp_chunk", hparams_chunk)):
        if read(out) != read(ckpt):
            console.print(f"hyper_parameters model.{key}: {read(ckpt)} -> {read(out)} "
                          "(fits the new layout)")  # fmt: skip
