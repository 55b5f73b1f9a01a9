"""End-to-end training-step benchmark: whole steps, configurations interleaved in rounds.

    python scripts/bench_e2e.py lightning --config 1b --seq-length 4096 --micro-batch-size 8 \
        --global-batch-size 32 --impls normal,drop_h,drop_h_quack,save_factors_quack \
        --checkpoint-layers 0,4,8,12,16 --budgets-gb 60,80,100 --planner --rounds 3 \
        --json e2e.json --md e2e.md --plot e2e.png
    python scripts/bench_e2e.py megatron --impls stock,stock_eager,normal,drop_h --rounds 3 \
        --json m.json --md m.md -- --num-layers 8 --hidden-size 2048 ...   (recipe arguments)

Lightning: every round visits the impls in a fresh random order, builds each one's model once
on the device, and runs each checkpointed-blocks count of the grid, in random order, for
``--warmup`` steps and then ``--steps`` timed ones: whole optimizer steps of the pretraining
module through the planner's own measurer (swiglu_train/integrations/lightning/planner.py),
so the figures are the ones it decides from. A step is ``--global-batch-size`` sequences
(default: one micro-batch), accumulated in micro-batches (forward, backward), then clipping
and AdamW once; tokens/s counts the global batch's tokens over that step, timed as the
measurer does (its first micro-batch, one accumulating one standing for the rest, and the
optimizer step). Per configuration: tokens/s, the optimizer step's time, after-forward and
peak MiB as min/median/max over rounds, and MFU where the GPU's peak is known. For each
``--budgets-gb``, each impl's best configuration of the grid that fits (its best plan), and
with ``--planner`` the planner's own pick (its short steps, its bisection, at the same
batching) set against the grid. The plot: tokens/s against memory budget, per impl. On CUDA
the memory is the allocator's peak; on the CPU the planner's estimate.

Megatron: each round runs recipes/pretrain_megatron.py once per impl, in a fresh random
order, each a process of its own (``--launcher``), and reads its summary: tokens/s is the
median over the steps after ``--warmup``, and the warm-up steps' own rates are kept, since
compilation (stock's torch.compile'd bias-SwiGLU) lands there.
"""

from __future__ import annotations

import json
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Annotated

import torch
import typer

from swiglu_train.bench.mlp import git_commit
from swiglu_train.files import atomic_write, write_json_atomic
from swiglu_train.integrations.lightning.config import load_config
from swiglu_train.integrations.lightning.planner import (
    ALLOCATOR,
    ESTIMATE,
    Steps,
    candidates,
    measurer,
)
from swiglu_train.memory.plan import NoPlanFits, accumulation, choose_plan, search

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "pretrain_megatron.py"
# Dense bf16 tensor-core peaks (the SXM datasheets), for MFU; other devices get none.
PEAK_FLOPS = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}
app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


def spread(values: list[float | None]) -> dict | None:
    """min/median/max of the measured values; None when none was measured (out of memory)."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def rows(points: list[dict], keys: tuple[str, ...]) -> list[dict]:
    """One row per configuration (the ``keys`` of its points), its figures' spreads."""
    out = {}
    for p in points:
        out.setdefault(tuple(p[k] for k in keys), []).append(p)
    return [
        {k: v for k, v in zip(keys, key, strict=True)}
        | {
            "rounds": len(mine),
            "out_of_memory": sum(p["peak_MiB"] is None for p in mine),
            **{
                f: spread([p.get(f) for p in mine])  # optimizer_s: absent in older runs
                for f in ("tokens_per_s", "optimizer_s", "after_forward_MiB", "peak_MiB")
            },
        }
        for key, mine in out.items()
    ]


def best_per_impl(table: list[dict], budget_MiB: float) -> dict[str, dict]:
    """Each impl's fastest configuration (median tokens/s) whose largest peak fits."""
    best: dict[str, dict] = {}
    for r in table:
        if r["peak_MiB"] is None or r["out_of_memory"] or r["peak_MiB"]["max"] > budget_MiB:
            continue
        mine = best.get(r["impl"])
        if mine is None or r["tokens_per_s"]["median"] > mine["tokens_per_s"]["median"]:
            best[r["impl"]] = r
    return best


def flops_per_token(cfg, seq: int) -> float:
    """Model FLOPs of a training step per token (PaLM's 6N + 12·L·D·S; recompute not counted):
    N the matmul weights (blocks and head; the embedding is a lookup)."""
    d, f, layers = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_layers
    weights = layers * (4 * d * d + 3 * d * f) + d * cfg.vocab_size
    return 6 * weights + 12 * layers * d * seq


def peak_flops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def parse_list(value: str, cast=str) -> list:
    return [cast(v) for v in value.split(",") if v.strip()]


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
    rounds: Annotated[int, typer.Option(min=1)] = 3,
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
    cfg = load_config(config)
    if seq_length is not None:
        cfg.data.seq_length = seq_length
        cfg.model.max_seq_length = max(cfg.model.max_seq_length, seq_length)
    if micro_batch_size is not None:
        cfg.data.micro_batch_size = micro_batch_size
    if global_batch_size is not None:
        try:
            cfg.train.accumulate_grad_batches = accumulation(
                global_batch_size, cfg.data.micro_batch_size
            )
        except ValueError as e:
            raise ValueError(f"--global-batch-size {global_batch_size}: {e}") from None
    cfg.train.plan_impls = parse_list(impls) if impls else None
    names = candidates(cfg)
    layers = cfg.model.num_layers
    grid = (
        list(range(layers + 1))
        if checkpoint_layers == "all"
        else parse_list(checkpoint_layers, int)
    )
    if not grid or not all(0 <= n <= layers for n in grid):
        raise typer.BadParameter(f"counts from 0 to {layers}", param_hint="--checkpoint-layers")
    settings = {"config": config, "seq_length": cfg.data.seq_length, "grid": grid,
                "micro_batch_size": cfg.data.micro_batch_size, "impls": names,
                "accumulate_grad_batches": cfg.train.accumulate_grad_batches,
                "warmup_steps": warmup, "timed_steps": steps, "device": device_name()}  # fmt: skip
    points = prior_points(json_path, settings) if append else []
    first = 1 + max((p["round"] for p in points), default=-1)
    order = random.Random(seed + first)
    measure = measurer(cfg, Steps(warmup, steps), log=print)
    for r in range(first, first + rounds):
        for impl in order.sample(names, len(names)):
            for n in order.sample(grid, len(grid)):
                p = measure(impl, n)
                points.append(
                    {
                        "round": r,
                        "impl": impl,
                        "checkpoint_layers": n,
                        "peak_MiB": p.peak_MiB,
                        "tokens_per_s": p.tokens_per_s,
                        "optimizer_s": p.optimizer_s,
                        "after_forward_MiB": p.after_forward_MiB,
                    }
                )
    table = rows(points, ("impl", "checkpoint_layers"))
    flops, peak = flops_per_token(cfg.model, cfg.data.seq_length), peak_flops()
    for r in table:
        rate = r["tokens_per_s"]
        r["mfu"] = rate["median"] * flops / peak if rate and peak else None
    budgets = parse_budgets(budgets_gb, table)
    plans = [_budget(b, table, names, layers, cfg, planner) for b in budgets]
    result = settings | {
        "command": shlex.join(["python", *sys.argv]),
        "commit": git_commit() or commit,
        "memory": ALLOCATOR if torch.cuda.is_available() else ESTIMATE,
        "model": {
            k: getattr(cfg.model, k)
            for k in ("hidden_size", "ffn_hidden_size", "num_layers", "num_heads")
        },
        "precision": measure_precision(cfg),
        "rounds": first + rounds,
        "flops_per_token": flops,
        "peak_flops": peak,
        "rows": table,
        "budgets": plans,
        "points": points,
    }
    _write(result, json_path, md, plot, lightning_markdown, plot_budgets)


APPEND_HELP = "add rounds to --json's, made with the same settings (a run split across calls)"


def prior_points(json_path: Path | None, settings: dict) -> list[dict]:
    """The points of an earlier run in ``json_path`` with these settings, to add rounds to."""
    if json_path is None or not json_path.is_file():
        return []
    earlier = json.loads(json_path.read_text())
    differ = {k: (earlier.get(k), v) for k, v in settings.items() if earlier.get(k) != v}
    if differ:
        raise ValueError(f"--append: {json_path} was made with other settings: {differ}")
    return earlier["points"]


def parse_budgets(value: str, table: list[dict]) -> list[float]:
    """MiB: a list of GiB, or ``auto:K``: K budgets evenly between the smallest and the
    largest peak of the grid (whole MiB), where impls need different checkpointing."""
    if not value.startswith("auto:"):
        return [gb * 1024 for gb in parse_list(value, float)]
    peaks = [r["peak_MiB"]["max"] for r in table if r["peak_MiB"]]
    k, low, high = int(value.removeprefix("auto:")), min(peaks), max(peaks)
    return [float(round(low + (high - low) * (i + 1) / (k + 1))) for i in range(k)]


def measure_precision(cfg) -> str:
    from swiglu_train.integrations.lightning.pretrain import resolve_precision

    return resolve_precision(cfg.train.precision)


def _budget(budget_MiB, table, names, layers, cfg, planner: bool) -> dict:
    best = best_per_impl(table, budget_MiB)
    out = {
        "budget_GiB": budget_MiB / 1024,
        "best_per_impl": {
            i: {
                "checkpoint_layers": r["checkpoint_layers"],
                "tokens_per_s": r["tokens_per_s"]["median"],
                "peak_MiB": r["peak_MiB"]["max"],
            }
            for i, r in best.items()
        },
    }
    top = max(best.values(), key=lambda r: r["tokens_per_s"]["median"], default=None)
    out["best"] = (
        None
        if top is None
        else {"impl": top["impl"], "checkpoint_layers": top["checkpoint_layers"]}
    )
    if "normal" in best and top is not None:
        drop = [r for i, r in best.items() if i.startswith("drop_h")]
        if drop:
            ratio = max(r["tokens_per_s"]["median"] for r in drop)
            out["best_drop_h_vs_normal"] = ratio / best["normal"]["tokens_per_s"]["median"]
    if planner:
        out["planner"] = _planner(budget_MiB, table, names, layers, cfg, top)
    return out


def _planner(budget_MiB, table, names, layers, cfg, top) -> dict:
    """The planner's own short steps and bisection at this budget, its pick set against the
    grid's median tokens/s for that configuration (None when the grid lacks it)."""
    print(f"planner at {budget_MiB / 1024:g} GiB")
    probes = search(names, layers, budget_MiB, measurer(cfg, Steps(), log=print))
    try:
        plan = choose_plan(probes, budget_MiB, layers)
    except NoPlanFits as e:
        return {"error": str(e), "probes": len(probes)}
    grid = {(r["impl"], r["checkpoint_layers"]): r for r in table}
    same = grid.get((plan.impl, plan.checkpoint_layers))
    ratio = None
    if same is not None and top is not None and same["tokens_per_s"]:
        ratio = same["tokens_per_s"]["median"] / top["tokens_per_s"]["median"]
    return {
        "impl": plan.impl,
        "checkpoint_layers": plan.checkpoint_layers,
        "why": plan.why,
        "probes": len(probes),
        "pick_tokens_per_s": plan.tokens_per_s,  # the planner's own short measurement
        "pick_vs_best_in_grid": ratio,  # the grid's median for its pick, if the grid has it
    }


def _fmt(s: dict | None, digits: int = 0) -> str:
    if s is None:
        return "—"
    return f"{s['median']:,.{digits}f} [{s['min']:,.{digits}f}, {s['max']:,.{digits}f}]"


def _ms(s: dict | None) -> dict | None:
    return None if s is None else {k: v * 1e3 for k, v in s.items()}


def lightning_markdown(result: dict) -> str:
    a = result.get("accumulate_grad_batches", 1)  # older runs: one micro-batch a step
    batch = f" x {a} per optimizer step" if a > 1 else ""
    head = (
        f"### Lightning e2e: {result['config']} at seq {result['seq_length']}, micro-batch "
        f"{result['micro_batch_size']}{batch}, {result['precision']}, {result['device']}\n\n"
        f"{result['rounds']} rounds interleaved, {result['warmup_steps']} warm-up + "
        f"{result['timed_steps']} timed steps each; median [min, max] over rounds; memory: "
        f"{result['memory']}. Commit {result['commit']}; `{result['command']}`\n\n"
    )
    lines = [
        "| impl | checkpointed | tokens/s | MFU | optimizer ms | after-fwd MiB | peak MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(result["rows"], key=lambda r: (r["impl"], r["checkpoint_layers"])):
        mfu = "—" if r["mfu"] is None else f"{r['mfu']:.1%}"
        lines.append(
            f"| {r['impl']} | {r['checkpoint_layers']} | {_fmt(r['tokens_per_s'])} | "
            f"{mfu} | {_fmt(_ms(r.get('optimizer_s')), 1)} | {_fmt(r['after_forward_MiB'])} | "
            f"{_fmt(r['peak_MiB'])} |"
        )
    for b in result["budgets"]:
        lines += [
            "",
            f"Budget {b['budget_GiB']:g} GiB, best plan per impl: "
            + "; ".join(
                f"{i} {v['checkpoint_layers']} blocks {v['tokens_per_s']:,.0f} tokens/s"
                for i, v in b["best_per_impl"].items()
            )
            or "none fits",
        ]
        if "best_drop_h_vs_normal" in b:
            lines.append(f"best drop_h* ÷ best normal: {b['best_drop_h_vs_normal']:.3f}")
        if "planner" in b:
            lines.append(f"planner: {json.dumps(b['planner'])}")
    return head + "\n".join(lines) + "\n"


def plot_budgets(result: dict):
    """tokens/s against memory budget per impl: at each budget, the impl's best measured
    configuration that fits (a staircase); the planner's picks as stars."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    table = result["rows"]
    peaks = sorted({r["peak_MiB"]["max"] for r in table if r["peak_MiB"]})
    right = max([*peaks, *(b["budget_GiB"] * 1024 for b in result["budgets"])], default=0) / 1024
    for i, impl in enumerate(dict.fromkeys(r["impl"] for r in table)):
        xs, ys = [], []
        for peak in peaks:
            best = best_per_impl([r for r in table if r["impl"] == impl], peak).get(impl)
            if best is not None:
                xs.append(peak / 1024)
                ys.append(best["tokens_per_s"]["median"])
        if xs:  # the last level holds for any larger budget
            ax.step([*xs, right], [*ys, ys[-1]], where="post", color=f"C{i}", label=impl)
            ax.plot(xs, ys, "o", color=f"C{i}")
    label = "planner's pick"
    for b in result["budgets"]:
        ax.axvline(b["budget_GiB"], color="grey", linewidth=0.8, linestyle=":")
        pick = b.get("planner", {})
        row = next(
            (
                r
                for r in table
                if (r["impl"], r["checkpoint_layers"])
                == (pick.get("impl"), pick.get("checkpoint_layers"))
            ),
            None,
        )
        if row is not None and row["tokens_per_s"]:
            y = row["tokens_per_s"]["median"]
            ax.plot(b["budget_GiB"], y, "*", color="black", markersize=13, zorder=5, label=label)
            label = None
    ax.set_xlabel(f"memory budget, GiB ({result['memory']})")
    ax.set_ylabel("tokens/s (median over rounds)")
    ax.set_title(
        f"{result['config']}, seq {result['seq_length']}, micro-batch "
        f"{result['micro_batch_size']}, {result['device']}: tokens/s at a memory "
        "budget (each impl's best checkpointed-blocks count that fits)",
        fontsize="medium",
        wrap=True,
    )
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


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
) -> None:
    """Megatron recipe: impls interleaved in rounds, one process each; the rest of the
    command line after ``--`` goes to the recipe."""
    names, extra = parse_list(impls), list(ctx.args)
    settings = {"impls": names, "recipe_args": extra, "warmup_steps": warmup,
                "timed_steps": steps, "device": device_name()}  # fmt: skip
    points = prior_points(json_path, settings) if append else []
    first = 1 + max((p["round"] for p in points), default=-1)
    order = random.Random(seed + first)
    with tempfile.TemporaryDirectory() as scratch:
        for r in range(first, first + rounds):
            for impl in order.sample(names, len(names)):
                summary = Path(scratch) / f"{impl}_{r}.json"
                command = [
                    *shlex.split(launcher),
                    "--mlp-impl",
                    impl,
                    "--max-steps",
                    str(warmup + steps),
                    "--warmup-steps",
                    str(warmup),
                    "--summary-json",
                    str(summary),
                    "--output-dir",
                    str(Path(scratch) / "runs"),
                    *extra,
                ]
                done = subprocess.run(command, capture_output=True, text=True)
                if done.returncode:
                    raise RuntimeError(f"{shlex.join(command)} failed:\n{done.stderr[-3000:]}")
                s = json.loads(summary.read_text())
                rates = s["step_tokens_per_s"]
                print(f"round {r} {impl}: {s['tokens_per_s']:,.0f} tokens/s")
                points.append(
                    {
                        "round": r,
                        "impl": impl,
                        "tokens_per_s": s["tokens_per_s"],
                        "warmup_tokens_per_s": rates[: s["warmup_steps"]],
                        "after_forward_MiB": s["after_forward_MiB"],
                        "peak_MiB": s["peak_MiB"],
                        "final_loss": s["final_loss"],
                    }
                )
    result = settings | {
        "command": shlex.join(["python", *sys.argv]),
        "commit": git_commit() or commit,
        "rounds": first + rounds,
        "rows": megatron_rows(points),
        "points": points,
    }
    _write(result, json_path, md, None, megatron_markdown, None)


def megatron_rows(points: list[dict]) -> list[dict]:
    """Per impl: the spreads, the ratio to stock's tokens/s paired per round, and the median
    rate of each warm-up step (where compilation and autotuning show)."""
    table = rows(points, ("impl",))
    base = {p["round"]: p["tokens_per_s"] for p in points if p["impl"] == "stock"}
    for r in table:
        mine = [p for p in points if p["impl"] == r["impl"]]
        r["vs_stock"] = spread([p["tokens_per_s"] / base[p["round"]] for p in mine
                                if p["round"] in base])  # fmt: skip
        warm = [p["warmup_tokens_per_s"] for p in mine]
        r["warmup_tokens_per_s_median"] = [statistics.median(s) for s in zip(*warm, strict=False)]
    return table


def megatron_markdown(result: dict) -> str:
    lines = [
        f"### Megatron recipe e2e, {result['device']}: `{' '.join(result['recipe_args'])}`",
        "",
        f"{result['rounds']} rounds interleaved, {result['warmup_steps']} warm-up + "
        f"{result['timed_steps']} timed steps per run; median [min, max] over rounds. "
        f"Commit {result['commit']}; `{result['command']}`",
        "",
        "| impl | tokens/s | ÷ stock (paired) | after-fwd MiB | peak MiB | warm-up tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        warm = ", ".join(f"{v:,.0f}" for v in r["warmup_tokens_per_s_median"])
        lines.append(
            f"| {r['impl']} | {_fmt(r['tokens_per_s'])} | {_fmt(r['vs_stock'], 3)} | "
            f"{_fmt(r['after_forward_MiB'])} | {_fmt(r['peak_MiB'])} | {warm} |"
        )
    return "\n".join(lines) + "\n"


def _write(result, json_path, md, plot, markdown, draw) -> None:
    if json_path is not None:
        write_json_atomic(json_path, result)
    text = markdown(result)
    print(text)
    if md is not None:
        with atomic_write(md) as f:
            f.write(text)
    if plot is not None and draw is not None:
        with atomic_write(plot, "wb") as f:
            draw(result).savefig(f, format="png", dpi=120)


if __name__ == "__main__":
    app()
