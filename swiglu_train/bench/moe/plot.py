"""``bench-moe``'s figure: each variant's step over the floor, and the memory it holds, per point.

Three panels share the points along x (model and routing): the step over the grouped-GEMM
floor, the after-forward memory and the backward peak (both in MiB on a log axis, since the
shapes' activations span decades). One line per variant with its own colour, marker and dash.
Drawn on an Agg canvas of its own (never pyplot), so no global backend changes.
"""

from __future__ import annotations

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

MARKERS = "osD^v<>phX"
DASHES = ("-", "--", "-.", ":")
Y_CUT = 4.0  # a variant past this many floors (the loop at many experts) leaves the axis
PANELS = (
    ("full_over_floor", "step ÷ grouped-GEMM floor", False),
    ("after_forward_MiB", "after forward, MiB", True),
    ("peak_MiB", "backward peak, MiB", True),
)


def plot_moe(result: dict) -> Figure:
    meta = result["meta"]
    points = [(p["model"], p["routing"]) for p in result["points"]]
    rows = {(r["model"], r["routing"], r["variant"]): r for r in result["rows"]}
    variants = [v for v in meta["variants"] if any((*p, v) in rows for p in points)]
    fig = Figure(figsize=(max(8.0, 0.8 * len(points) + 3), 10), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(PANELS), 1, sharex=True)
    for ax, (key, label, log) in zip(axes, PANELS, strict=True):
        shown = []
        for i, variant in enumerate(variants):
            line = [
                (x, rows[(*p, variant)][key])
                for x, p in enumerate(points)
                if (*p, variant) in rows and rows[(*p, variant)].get(key) is not None
            ]
            if line:
                style = {"marker": MARKERS[i % len(MARKERS)], "linestyle": DASHES[i % len(DASHES)]}
                ax.plot(*zip(*line, strict=True), label=variant, color=f"C{i % 10}", **style)
                shown += [y for _, y in line]
        if log:
            ax.set_yscale("log")
        else:
            ax.axhline(1.0, color="black", linewidth=0.8)
            if shown and min(shown) < Y_CUT < max(shown):
                ax.set_ylim(0, Y_CUT)
                label += f" (cut at {Y_CUT:g})"
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xticks(
        range(len(points)),
        [f"{model}\n{routing}" for model, routing in points],
        rotation=30,
        ha="right",
        fontsize="small",
    )
    fig.suptitle(
        f"Routed SwiGLU experts, T = {meta['tokens']}: {meta['dtype']}, {meta['device_name']}, "
        f"commit {str(meta['commit'])[:12]}"
    )
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=5)
    return fig
