"""Loss-curve A/B of training runs against a baseline's seed-to-seed spread: issue 19's test
of the FP8-saved preactivation (drop_h+fp8) against bf16 drop_h.

    python benchmarks/plot_loss_ab.py SUMMARY.json... --last 100 --smooth 50 \\
        --json fp8_loss_ab.json --md fp8_loss_ab.md --plot fp8_loss_ab.png

SUMMARY.json are ``swiglu-train pretrain --summary-json`` files of one config and step count.
A run's arm is its impl, ``+fp8`` where it saved its preactivation in FP8 (``drop_h``,
``drop_h+fp8``), ``_float8_RECIPE`` where its GEMMs ran on torchao's FP8 recipe
(``drop_h_float8_tensorwise``; ``normal_float8_tensorwise`` is torchao's own MLP). The
baseline arm (``--baseline``) needs two seeds at least, and every other
arm ran at the baseline's seeds. A run's final loss is the mean training loss of its last
``--last`` steps (one step's loss is one batch's, too noisy to compare). The baseline's spread
is [min, max] of its final losses; each other run lies within it, or its gap is reported:
signed distance outside (positive: above the spread, a worse loss), and in spread widths. Per
seed, a run's final loss minus the baseline's at the same seed (same init and data order) is
reported too. The plot: the curves smoothed by a trailing mean over ``--smooth`` steps, their
last stretch with the baseline's spread shaded, and each arm minus the baseline per seed.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from swiglu_train.files import atomic_write, write_json_atomic, write_png_atomic
from swiglu_train.layers.registry import impl_label

KEYS = ("mlp_impl", "saved_fp8", "seed", "steps", "losses")


def load(paths: list[str]) -> list[dict]:
    """One record per summary: arm, seed, the losses by step, and what else it reported.
    A summary without the keys the A/B needs, or a second run of an arm at one seed, is
    refused by name."""
    runs, seen = [], {}
    for path in paths:
        try:
            summary = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: not a readable summary JSON ({e})") from e
        missing = [k for k in KEYS if k not in summary]
        if missing:
            raise ValueError(
                f"{path}: no {', '.join(missing)}; pass `swiglu-train pretrain --summary-json` "
                "files (saved_fp8 and seed are recorded since issue 19's A/B)"
            )
        steps = sorted(int(s) for s in summary["losses"])
        run = {
            "arm": impl_label(summary["mlp_impl"], summary["saved_fp8"], summary.get("float8")),
            "seed": summary["seed"],
            "source": str(path),
            "steps": summary["steps"],
            "losses": np.array([summary["losses"][str(s)] for s in steps], dtype=np.float64),
            "loss_steps": np.array(steps),
            "val_loss": summary.get("val_loss"),
            "tokens_per_s": summary.get("tokens_per_s"),
        }
        key = (run["arm"], run["seed"])
        if key in seen:
            raise ValueError(f"{path}: a second {key[0]} run at seed {key[1]} ({seen[key]})")
        seen[key] = path
        runs.append(run)
    counts = {(r["steps"], len(r["losses"])) for r in runs}
    if len(counts) > 1:
        raise ValueError(
            f"the runs trained different numbers of steps or logged different losses "
            f"({sorted(counts)} as (steps, losses)): their final losses are not comparable"
        )
    return runs


def final_loss(run: dict, last: int) -> float | None:
    """The mean training loss of the run's last ``last`` steps; None if it is not finite."""
    if len(run["losses"]) < last:
        raise ValueError(
            f"{run['source']}: {len(run['losses'])} losses logged, fewer than --last {last}"
        )
    value = float(run["losses"][-last:].mean())
    return value if math.isfinite(value) else None


def compare(runs: list[dict], baseline: str, last: int) -> dict:
    """Final losses per arm and seed, the baseline's spread, and where each other run lies."""
    arms = sorted({r["arm"] for r in runs} - {baseline})
    base = {r["seed"]: r for r in runs if r["arm"] == baseline}
    if len(base) < 2:
        found = sorted({r["arm"] for r in runs})
        raise ValueError(
            f"the baseline {baseline!r} needs runs at two seeds at least for a spread; got "
            f"{len(base)} (arms: {', '.join(found)})"
        )
    if not arms:
        raise ValueError(f"no run other than the baseline {baseline!r} to compare")
    finals = {(r["arm"], r["seed"]): final_loss(r, last) for r in runs}
    if any(finals[baseline, seed] is None for seed in base):
        raise ValueError(f"a baseline run's final loss is not finite: {finals}")
    low = min(finals[baseline, seed] for seed in base)
    high = max(finals[baseline, seed] for seed in base)
    out = {
        "baseline": {
            "arm": baseline,
            "final_loss": {str(s): finals[baseline, s] for s in sorted(base)},
            "spread": {"low": low, "high": high, "width": high - low},
        },
        "arms": {},
    }
    for arm in arms:
        mine = {r["seed"]: r for r in runs if r["arm"] == arm}
        strays = sorted(set(mine) - set(base))
        if strays:
            raise ValueError(
                f"{arm} ran at seeds {strays}, where the baseline {baseline!r} did not: pair "
                "every run with a baseline run of its seed"
            )
        rows = {}
        for seed in sorted(mine):
            value = finals[arm, seed]
            if value is None:
                rows[str(seed)] = {"final_loss": None, "within_spread": False, "finite": False}
                continue
            outside = value - high if value > high else value - low if value < low else 0.0
            rows[str(seed)] = {
                "final_loss": value,
                "within_spread": outside == 0.0,
                "outside_by": outside,
                "outside_by_widths": outside / (high - low) if high > low else None,
                "minus_baseline_same_seed": value - finals[baseline, seed],
                "finite": True,
            }
        out["arms"][arm] = {
            "runs": rows,
            "all_within_spread": all(row["within_spread"] for row in rows.values()),
        }
    return out


def final_losses(result: dict) -> dict[tuple[str, str], float | None]:
    """{(arm, seed): final loss} of every run in ``compare``'s result."""
    baseline = result["baseline"]
    out = {(baseline["arm"], seed): v for seed, v in baseline["final_loss"].items()}
    for arm, data in result["arms"].items():
        out |= {(arm, seed): row["final_loss"] for seed, row in data["runs"].items()}
    return out


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over ``window`` steps (over the steps so far, before the first window)."""
    sums = np.cumsum(np.insert(values, 0, 0.0))
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    return (sums[ends] - sums[starts]) / (ends - starts)


def plot(runs: list[dict], result: dict, window: int, last: int, title: str):
    """(a) the smoothed curves, (b) their last stretch with the baseline's spread shaded and
    each run's final loss marked, (c) each arm minus the baseline at the same seed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    baseline = result["baseline"]["arm"]
    arms = [baseline, *result["arms"]]
    seeds = sorted({r["seed"] for r in runs})
    dashes = dict(zip(seeds, ["-", "--", ":", "-."] * len(seeds), strict=False))
    fig = Figure(figsize=(17, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(title)
    full, tail, diff = fig.subplots(1, 3)
    finals = final_losses(result)
    start = max(len(runs[0]["losses"]) - 3 * last, 0)  # the tail: three final windows
    for run in sorted(runs, key=lambda r: (arms.index(r["arm"]), r["seed"])):
        color = f"C{arms.index(run['arm'])}"
        # The baseline wide and underneath, the others narrow on top: equal curves stay visible.
        width = 2.8 if run["arm"] == baseline else 1.3
        style = {"color": color, "linestyle": dashes[run["seed"]], "linewidth": width}
        label = f"{run['arm']} seed {run['seed']}"
        curve = smooth(run["losses"], window)
        full.plot(run["loss_steps"], curve, label=label, **style)
        tail.plot(run["loss_steps"][start:], curve[start:], label=label, **style)
        value = finals[run["arm"], str(run["seed"])]
        if value is not None:
            dot = {"marker": "o", "markersize": 10, "markerfacecolor": "none"}
            if run["arm"] != baseline:
                dot = {"marker": "x", "markersize": 8, "markeredgewidth": 2}
            tail.plot(run["loss_steps"][-1], value, color=color, linestyle="none", **dot)
        if run["arm"] != baseline:
            pair = next(r for r in runs if r["arm"] == baseline and r["seed"] == run["seed"])
            gap = smooth(run["losses"] - pair["losses"], window)
            diff.plot(run["loss_steps"], gap, label=f"{label} minus {baseline}", **style)
    base = sorted((r for r in runs if r["arm"] == baseline), key=lambda r: r["seed"])
    seed_gap = smooth(base[1]["losses"] - base[0]["losses"], window)
    diff.plot(base[0]["loss_steps"], seed_gap, color="0.55", linewidth=1.2,
              label=f"{baseline} seed {base[1]['seed']} minus seed {base[0]['seed']}")  # fmt: skip
    spread = result["baseline"]["spread"]
    tail.axhspan(spread["low"], spread["high"], color="C0", alpha=0.15,
                 label=f"{baseline} spread of final losses")  # fmt: skip
    full.set(title=f"(a) training loss, trailing mean of {window} steps")
    tail.set(title=f"(b) last {len(runs[0]['losses']) - start} steps; marks: mean of last {last}")
    diff.set(title="(c) difference at the same seed (same init and data)")
    diff.axhline(0.0, color="black", linewidth=0.8)
    for ax, ylabel in ((full, "loss"), (tail, "loss"), (diff, "loss difference")):
        ax.set(xlabel="step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return fig


def to_markdown(result: dict) -> str:
    spread = result["baseline"]["spread"]
    lines = [
        f"### {result['title']}",
        "",
        f"{result['steps']} steps; final loss = mean training loss of the last "
        f"{result['last_steps']} steps. {result['baseline']['arm']}'s seed-to-seed spread: "
        f"{spread['low']:.4f} to {spread['high']:.4f} (width {spread['width']:.4f}).",
        "",
        "| arm | seed | final loss | within the spread | outside by | minus baseline, same seed |",
        "|---|---|---|---|---|---|",
    ]
    for seed, value in result["baseline"]["final_loss"].items():
        lines.append(f"| {result['baseline']['arm']} | {seed} | {value:.4f} | — | — | — |")
    for arm, data in result["arms"].items():
        for seed, row in data["runs"].items():
            if not row["finite"]:
                lines.append(f"| {arm} | {seed} | not finite | no | — | — |")
                continue
            lines.append(
                f"| {arm} | {seed} | {row['final_loss']:.4f} | "
                f"{'yes' if row['within_spread'] else 'no'} | {row['outside_by']:+.3g} | "
                f"{row['minus_baseline_same_seed']:+.3g} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="`swiglu-train pretrain --summary-json` files")
    parser.add_argument("--baseline", default="drop_h", help="the arm whose seeds give the spread")
    parser.add_argument("--last", type=int, default=100, help="steps a final loss averages")
    parser.add_argument("--smooth", type=int, default=50, help="steps of the plot's running mean")
    parser.add_argument("--title", default="Loss curves: FP8-saved preactivation vs bf16 drop_h")
    parser.add_argument("--command", default=None, help="the command that made the runs")
    parser.add_argument("--commit", default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--md", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, help="a PNG of the curves")
    args = parser.parse_args(argv)
    if args.last < 1 or args.smooth < 1:
        parser.error(f"--last and --smooth must be at least 1, got {args.last}, {args.smooth}")
    try:
        runs = load(args.runs)
        result = {
            "title": args.title,
            "command": args.command,
            "commit": args.commit,
            "steps": runs[0]["steps"],
            "last_steps": args.last,
            "smooth_steps": args.smooth,
            **compare(runs, args.baseline, args.last),
            "runs": [
                {k: r[k] for k in ("arm", "seed", "source", "val_loss", "tokens_per_s")}
                for r in runs
            ],
        }
    except ValueError as e:
        parser.error(str(e))
    markdown = to_markdown(result)
    print(markdown)
    figure = None
    if args.plot is not None:  # drawn before any file is written: a failed plot writes none
        figure = plot(runs, result, args.smooth, args.last, args.title)
    if args.json is not None:
        write_json_atomic(args.json, result)
    if args.md is not None:
        with atomic_write(args.md) as f:
            f.write(markdown)
    if figure is not None:
        write_png_atomic(args.plot, figure, dpi=120)
    return result


if __name__ == "__main__":
    main()
