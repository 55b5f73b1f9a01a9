"""The model grid as one figure: each variant's ratio to the floor across the grid's shapes.

One panel per M, the shapes along x (smallest D·F first), one line per impl or peer with its
own colour, marker and dash, and auto's pick as a black star on the line it picked. Drawn on an
Agg canvas of its own (never pyplot), so no global backend changes and no display is needed.
"""

from __future__ import annotations

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

Y_CUT = 1.6  # a line past this (a peer far off the floor) leaves the axis, not the contest
MARKERS = "osD^v<>phX"
DASHES = ("-", "--", "-.", ":")


def plot_grid(result: dict) -> Figure:
    meta, points = result["meta"], result["points"]
    shapes = list(dict.fromkeys((p["D"], p["F"]) for p in points))
    models = {(p["D"], p["F"]): p["models"] for p in points}
    ms = sorted({p["M"] for p in points})
    ratios = {(r["M"], r["D"], r["F"], r["variant"]): r["ratio_to_floor"] for r in result["rows"]}
    fig = Figure(figsize=(max(7.0, 0.9 * len(shapes) + 3), 3.2 * len(ms) + 1), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(ms), 1, squeeze=False, sharex=True)[:, 0]
    for ax, m in zip(axes, ms, strict=True):
        shown = []
        for i, variant in enumerate(meta["variants"]):
            line = [
                (x, ratios[(m, d, f, variant)])
                for x, (d, f) in enumerate(shapes)
                if (m, d, f, variant) in ratios
            ]
            if line:
                style = {"marker": MARKERS[i % len(MARKERS)], "linestyle": DASHES[i % len(DASHES)]}
                ax.plot(*zip(*line, strict=True), label=variant, color=f"C{i % 10}", **style)
                shown += [y for _, y in line]
        picks = [
            (shapes.index((p["D"], p["F"])), ratios[(m, p["D"], p["F"], p["auto"]["impl"])])
            for p in points
            if p["M"] == m and (m, p["D"], p["F"], p["auto"]["impl"]) in ratios
        ]
        if picks:
            ax.plot(*zip(*picks, strict=True), "*", color="black", markersize=13,
                    label="auto's pick", zorder=5)  # fmt: skip
        ax.axhline(1.0, color="black", linewidth=0.8)
        label = "step ÷ six-GEMM floor"
        if shown and min(shown) < Y_CUT < max(shown):
            ax.set_ylim(top=Y_CUT)
            label += f" (cut at {Y_CUT})"
        ax.set_ylabel(label)
        ax.set_title(f"M = {m} tokens", fontsize="medium")
        ax.grid(alpha=0.3)
    axes[-1].set_xticks(
        range(len(shapes)),
        [_tick(d, f, models[(d, f)]) for d, f in shapes],
        rotation=30,
        ha="right",
        fontsize="small",
    )
    axes[-1].set_xlabel("MLP shape DxF (models)")
    fig.suptitle(
        f"SwiGLU MLP training step over public-model shapes: {meta['dtype']}, "
        f"{meta['device_name']}, commit {meta['commit']}"
    )
    legend = {}  # every line once, from whichever panel has it
    for ax in axes:
        for handle, text in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(text, handle)
    fig.legend(legend.values(), legend.keys(), loc="outside lower center", ncols=5)
    return fig


def _tick(d: int, f: int, models: list[str]) -> str:
    """``DxF`` over its first model (+ how many more); a custom shape is named by DxF alone."""
    if models == [f"{d}x{f}"]:
        return models[0]
    return f"{d}x{f}\n{models[0]}" + (f" +{len(models) - 1}" if len(models) > 1 else "")
