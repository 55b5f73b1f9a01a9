"""Megatron runs at several parallel layouts on the same data: loss agreement, tokens/s and
per-GPU memory.

    python3 benchmarks/compare_tp.py RUN.json... --commit SHA --json out.json --md out.md

RUN.json are recipes/pretrain_megatron.py --summary-json files, several impls at several
layouts (TP=1, TP=4, TP=2 x DP=2, ...). Per impl: the loss difference between layouts at step
0 (zero when the runs start from one model: the recipe's --cpu-init on GPU) and the largest and
median over their common steps (bf16 TP runs differ by reduction order, so this is the noise to
report, not a pass/fail), tokens/s, and the per-GPU after-forward and peak MiB at each layout.
Runs of one impl must share a global batch (micro-batch x micro-batches x DP), or their losses
are not the same quantity. Per layout: the saving of the impls that drop h (drop_h,
drop_h_quack) over normal after forward, against the analytic n_layers·M·(F/tp)·bytes, since
each rank holds an h of [M, F/tp] per micro-batch. ``--plot`` draws the loss curves, one panel
per impl.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from swiglu_train.files import atomic_write, write_json_atomic, write_png_atomic

DROPS_H = ("drop_h", "drop_h_quack")  # keep preact only: h [M, F/tp] is not saved


def layout(run: dict) -> tuple[int, int]:
    """(TP, DP) of a run; summaries from before the recipe recorded DP ran at DP=1."""
    return run["tp"], run.get("dp", 1)


def label(tp: int, dp: int) -> str:
    return f"TP{tp}" if dp == 1 else f"TP{tp}xDP{dp}"


def global_batch(run: dict) -> int:
    dp = layout(run)[1]
    return run["shape"]["micro_batch_size"] * run.get("num_microbatches", 1) * dp


def load(paths: list[str]) -> dict[tuple[str, str], dict]:
    """Summaries by (impl, layout label); the same pair twice is an error, not a silent pick."""
    runs: dict[tuple[str, str], dict] = {}
    for path in paths:
        run = json.loads(Path(path).read_text())
        key = (run["mlp_impl"], label(*layout(run)))
        if key in runs:
            raise ValueError(f"{path}: a second run of {key[0]} at {key[1]}")
        runs[key] = run
    return runs


def layouts_of(runs: dict[tuple[str, str], dict], impl: str) -> list[str]:
    """The layout labels ``impl`` ran at, by (TP, DP)."""
    return [label(*t) for t in sorted(layout(r) for (i, _), r in runs.items() if i == impl)]


def loss_agreement(runs: dict[tuple[str, str], dict]) -> dict[str, dict]:
    """Per impl run at two or more layouts: |Δloss| at step 0 (None when a run starts later),
    the max |Δloss| (and relative) and the median over their common steps, tokens/s and memory."""
    out = {}
    for impl in sorted({impl for impl, _ in runs}):
        names = layouts_of(runs, impl)
        if len(names) < 2:
            continue
        batches = {name: global_batch(runs[impl, name]) for name in names}
        if len(set(batches.values())) > 1:
            raise ValueError(
                f"{impl}: the runs' global batches differ ({batches}: micro-batch x "
                "micro-batches x DP), so their losses are not comparable; give each layout "
                "the same global batch"
            )
        curves = [runs[impl, name]["losses"] for name in names]
        steps = sorted(set.intersection(*(set(c) for c in curves)), key=int)
        if not steps:
            raise ValueError(f"{impl}: the runs share no step")
        diffs = [max(c[s] for c in curves) - min(c[s] for c in curves) for s in steps]
        rel = [d / abs(curves[0][s]) for d, s in zip(diffs, steps, strict=True)]
        # The median too: on mock data the loss falls near zero and spikes, so one step's
        # difference can be most of the loss while the curves track each other.
        out[impl] = {
            "layouts": names,
            "global_batch": batches[names[0]],
            "same_init": all(runs[impl, name].get("cpu_init", False) for name in names),
            "steps": len(steps),
            "step0_abs_loss_diff": diffs[0] if steps[0] == "0" else None,  # resumed: none
            "max_abs_loss_diff": max(diffs),
            "max_rel_loss_diff": max(rel),
            "median_abs_loss_diff": statistics.median(diffs),
            **{
                key: {name: runs[impl, name].get(key) for name in names}
                for key in ("tokens_per_s", "after_forward_MiB", "peak_MiB")
            },
        }
    return out


def h_saving(runs: dict[tuple[str, str], dict], bytes_per_element: int) -> dict[str, dict]:
    """Per impl that drops h and per layout where normal ran too: its after-forward saving over
    normal, measured (CUDA's allocator), in saved tensors (exact bytes), and analytic."""
    out: dict[str, dict] = {}
    for impl in DROPS_H:
        for name in layouts_of(runs, impl):
            if ("normal", name) not in runs:
                continue
            normal, ours = runs["normal", name], runs[impl, name]
            if normal["shape"] != ours["shape"]:
                raise ValueError(f"{name}: normal and {impl} ran different shapes")
            shape, tp = normal["shape"], normal["tp"]
            tokens = shape["seq_length"] * shape["micro_batch_size"]
            h_bytes = tokens * shape["ffn_hidden_size"] // tp * bytes_per_element
            analytic = shape["num_layers"] * h_bytes / 2**20
            measured = None  # the allocator's figure: CUDA only
            if normal["after_forward_MiB"] is not None and ours["after_forward_MiB"] is not None:
                measured = normal["after_forward_MiB"] - ours["after_forward_MiB"]
            out.setdefault(impl, {})[name] = {
                "measured_MiB": measured,
                "saved_for_backward_MiB": normal["saved_MiB"] - ours["saved_MiB"],  # exact
                "analytic_MiB": analytic,
                "rel_diff": None if measured is None else measured / analytic - 1,
            }
    return out


def to_markdown(result: dict) -> str:
    lines = [f"### {result['title']}", "", f"{result['gpu']}, commit {result['commit']}: "
             f"`{result['command']}`", "", "| impl | layouts | one init | steps | Δloss at "
             "step 0 | median Δloss | max Δloss | max rel | tokens/s | after-fwd MiB per GPU | "
             "peak MiB per GPU |", "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for impl, r in result["loss_agreement"].items():
        lines.append(
            f"| {impl} | {', '.join(r['layouts'])} | {'yes' if r['same_init'] else 'no'} | "
            f"{r['steps']} | {_num(r['step0_abs_loss_diff'], '.4g')} | "
            f"{r['median_abs_loss_diff']:.4g} | {r['max_abs_loss_diff']:.4g} | "
            f"{r['max_rel_loss_diff']:.3g} | {_per_layout(r['tokens_per_s'], '.0f')} | "
            f"{_per_layout(r['after_forward_MiB'])} | {_per_layout(r['peak_MiB'])} |"
        )
    lines += ["", "| impl | layout | saves after fwd over normal (MiB) | in saved tensors | "
              "analytic | rel diff |", "|---|---|---|---|---|---|"]  # fmt: skip
    for impl, by_layout in result["h_saving"].items():
        for name, r in by_layout.items():
            rel = "—" if r["rel_diff"] is None else f"{r['rel_diff']:+.2%}"
            lines.append(
                f"| {impl} | {name} | {_num(r['measured_MiB'])} | "
                f"{r['saved_for_backward_MiB']:.1f} | {r['analytic_MiB']:.1f} | {rel} |"
            )
    return "\n".join(lines) + "\n"


def plot_losses(runs: dict[tuple[str, str], dict], path: Path) -> None:
    """Loss against step, one panel per impl, one line per layout (log scale: the curves
    fall by orders of magnitude on mock data)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    impls = sorted({impl for impl, _ in runs})
    fig = Figure(figsize=(5 * len(impls), 4), layout="constrained")
    FigureCanvasAgg(fig)
    for ax, impl in zip(fig.subplots(1, len(impls), squeeze=False)[0], impls, strict=True):
        for name in layouts_of(runs, impl):
            losses = runs[impl, name]["losses"]
            steps = sorted(losses, key=int)
            ax.plot([int(s) for s in steps], [losses[s] for s in steps], label=name)
        ax.set(title=impl, xlabel="step", ylabel="loss", yscale="log")
        ax.grid(alpha=0.3)
        ax.legend()
    write_png_atomic(path, fig, dpi=110)


def _num(value: float | None, spec: str = ".1f") -> str:
    return "—" if value is None else format(value, spec)


def _per_layout(values: dict[str, float | None], spec: str = ".1f") -> str:
    return ", ".join(f"{name}: {_num(v, spec)}" for name, v in values.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="--summary-json files of the Megatron recipe")
    parser.add_argument("--bytes-per-element", type=int, default=2, help="2 for bf16 runs")
    parser.add_argument("--title", default="Megatron layouts against TP=1")
    parser.add_argument("--command", default=None, help="the command that produced the runs")
    parser.add_argument("--commit", default=None)
    parser.add_argument("--gpu", default=None, help="for summaries that do not name their device")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--md", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, help="a PNG of the loss curves")
    args = parser.parse_args()
    runs = load(args.runs)
    result = {
        "title": args.title,
        "command": args.command,
        "commit": args.commit,
        "gpu": args.gpu or ", ".join(sorted({run.get("device", "?") for run in runs.values()})),
        "loss_agreement": loss_agreement(runs),
        "h_saving": h_saving(runs, args.bytes_per_element),
        "runs": [runs[key] for key in sorted(runs)],
    }
    markdown = to_markdown(result)
    print(markdown)
    if args.json is not None:
        write_json_atomic(args.json, result)
    if args.md is not None:
        with atomic_write(args.md) as f:
            f.write(markdown)
    if args.plot is not None:
        plot_losses(runs, args.plot)


if __name__ == "__main__":
    main()
