"""Megatron TP=2 against TP=1 on the same data: loss agreement and per-GPU memory.

    python3 scripts/compare_tp.py RUN.json... --commit SHA --json out.json --md out.md

RUN.json are recipes/pretrain_megatron.py --summary-json files, several impls at several TP
sizes. Per impl: the loss difference between TP sizes at step 0 (zero when the runs start from
one model: the recipe's --cpu-init on GPU) and the largest over their common steps (bf16 TP runs
differ by reduction order, so this is the noise to report, not a pass/fail), and the per-GPU
after-forward MiB at each TP. Per TP size: drop_h's after-forward saving over normal against
the analytic n_layers·M·(F/tp)·bytes, since each rank holds an h of [M, F/tp]. ``--plot`` draws
the loss curves, one panel per impl.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from swiglu_train.files import atomic_write, write_json_atomic


def load(paths: list[str]) -> dict[tuple[str, int], dict]:
    """Summaries by (impl, tp); the same pair twice is an error, not a silent pick."""
    runs: dict[tuple[str, int], dict] = {}
    for path in paths:
        run = json.loads(Path(path).read_text())
        key = (run["mlp_impl"], run["tp"])
        if key in runs:
            raise ValueError(f"{path}: a second run of {key[0]} at TP={key[1]}")
        runs[key] = run
    return runs


def loss_agreement(runs: dict[tuple[str, int], dict]) -> dict[str, dict]:
    """Per impl run at two or more TP sizes: |Δloss| at step 0 (None when a run starts later)
    and the max |Δloss| (and relative) over their common steps."""
    out = {}
    for impl in sorted({impl for impl, _ in runs}):
        sizes = sorted(tp for i, tp in runs if i == impl)
        if len(sizes) < 2:
            continue
        curves = [runs[impl, tp]["losses"] for tp in sizes]
        steps = sorted(set.intersection(*(set(c) for c in curves)), key=int)
        if not steps:
            raise ValueError(f"{impl}: the TP runs share no step")
        diffs = [max(c[s] for c in curves) - min(c[s] for c in curves) for s in steps]
        rel = [d / abs(curves[0][s]) for d, s in zip(diffs, steps, strict=True)]
        # The median too: on mock data the loss falls near zero and spikes, so one step's
        # difference can be most of the loss while the curves track each other.
        out[impl] = {
            "tp_sizes": sizes,
            "same_init": all(runs[impl, tp].get("cpu_init", False) for tp in sizes),
            "steps": len(steps),
            "step0_abs_loss_diff": diffs[0] if steps[0] == "0" else None,  # resumed: none
            "max_abs_loss_diff": max(diffs),
            "max_rel_loss_diff": max(rel),
            "median_abs_loss_diff": statistics.median(diffs),
            "after_forward_MiB": {str(tp): runs[impl, tp]["after_forward_MiB"] for tp in sizes},
        }
    return out


def drop_h_saving(runs: dict[tuple[str, int], dict], bytes_per_element: int) -> dict[str, dict]:
    """Per TP size with both normal and drop_h: measured vs analytic after-forward saving."""
    out = {}
    for tp in sorted({tp for _, tp in runs}):
        if ("normal", tp) not in runs or ("drop_h", tp) not in runs:
            continue
        normal, drop_h = runs["normal", tp], runs["drop_h", tp]
        if normal["shape"] != drop_h["shape"]:
            raise ValueError(f"TP={tp}: normal and drop_h ran different shapes")
        shape = normal["shape"]
        tokens = shape["seq_length"] * shape["micro_batch_size"]
        h_bytes = tokens * shape["ffn_hidden_size"] // tp * bytes_per_element
        analytic = shape["num_layers"] * h_bytes / 2**20
        measured = None  # the allocator's figure: CUDA only
        if normal["after_forward_MiB"] is not None and drop_h["after_forward_MiB"] is not None:
            measured = normal["after_forward_MiB"] - drop_h["after_forward_MiB"]
        out[str(tp)] = {
            "measured_MiB": measured,
            "saved_for_backward_MiB": normal["saved_MiB"] - drop_h["saved_MiB"],  # exact bytes
            "analytic_MiB": analytic,
            "rel_diff": None if measured is None else measured / analytic - 1,
        }
    return out


def to_markdown(result: dict) -> str:
    lines = [f"### {result['title']}", "", f"{result['gpu']}, commit {result['commit']}: "
             f"`{result['command']}`", "", "| impl | TP sizes | one init | steps | Δloss at "
             "step 0 | median Δloss | max Δloss | max rel | after-fwd MiB per GPU |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for impl, r in result["loss_agreement"].items():
        mem = ", ".join(f"TP{tp}: {_num(v)}" for tp, v in r["after_forward_MiB"].items())
        lines.append(
            f"| {impl} | {r['tp_sizes']} | {'yes' if r['same_init'] else 'no'} | {r['steps']} | "
            f"{_num(r['step0_abs_loss_diff'], '.4g')} | {r['median_abs_loss_diff']:.4g} | "
            f"{r['max_abs_loss_diff']:.4g} | "
            f"{r['max_rel_loss_diff']:.3g} | {mem} |"
        )
    lines += ["", "| TP | drop_h saves after fwd (MiB) | in saved tensors | analytic | rel diff |",
              "|---|---|---|---|---|"]  # fmt: skip
    for tp, r in result["drop_h_saving"].items():
        rel = "—" if r["rel_diff"] is None else f"{r['rel_diff']:+.2%}"
        lines.append(
            f"| {tp} | {_num(r['measured_MiB'])} | {r['saved_for_backward_MiB']:.1f} | "
            f"{r['analytic_MiB']:.1f} | {rel} |"
        )
    return "\n".join(lines) + "\n"


def plot_losses(runs: dict[tuple[str, int], dict], path: Path) -> None:
    """Loss against step, one panel per impl, one line per TP size (log scale: the curves
    fall by orders of magnitude on mock data)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    impls = sorted({impl for impl, _ in runs})
    fig = Figure(figsize=(5 * len(impls), 4), layout="constrained")
    FigureCanvasAgg(fig)
    for ax, impl in zip(fig.subplots(1, len(impls), squeeze=False)[0], impls, strict=True):
        for tp in sorted(tp for i, tp in runs if i == impl):
            losses = runs[impl, tp]["losses"]
            steps = sorted(losses, key=int)
            ax.plot([int(s) for s in steps], [losses[s] for s in steps], label=f"TP={tp}")
        ax.set(title=impl, xlabel="step", ylabel="loss", yscale="log")
        ax.grid(alpha=0.3)
        ax.legend()
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)


def _num(value: float | None, spec: str = ".1f") -> str:
    return "—" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="--summary-json files of the Megatron recipe")
    parser.add_argument("--bytes-per-element", type=int, default=2, help="2 for bf16 runs")
    parser.add_argument("--title", default="Megatron TP=2 against TP=1")
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
        "drop_h_saving": drop_h_saving(runs, args.bytes_per_element),
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
