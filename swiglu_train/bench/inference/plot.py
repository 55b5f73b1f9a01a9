"""The inference benchmark as one figure: where each path wins, against the GEMMs alone.

One panel per (table, model): time per call over the GEMMs-only time of the same shape, against
M. A line under 1.0 beats cuBLAS's GEMMs without any activation. The axis stops at Y_MAX, where
the contest is; lines leaving it (quack at decode sizes, the fused MLP beyond its regime) are
off by more than that. Drawn on an Agg canvas of its
own (never pyplot), so no global backend changes and no display is needed.
"""

from __future__ import annotations

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from swiglu_train.bench.inference import variants as iv

Y_MAX = 1.6
TITLES = {"gated": "fc1 + SwiGLU", "mlp": "whole MLP"}
# (column, label, style): the baselines, the peer, then ours; candidates thin and dashed.
LINES = [
    ("eager_ms", "eager (faster variant)", {"color": "0.4", "marker": "o"}),
    ("compile_ms", "torch.compile", {"color": "C0", "marker": "s"}),
    ("quack_ms", "quack", {"color": "C2", "marker": "^"}),
    (
        "dispatched_ms",
        "ours (the table's choice, in-sample)",
        {"color": "C3", "marker": "o", "linewidth": 2.5},
    ),
]
CANDIDATE_COLORS = {"fused_mlp": "C4", "gated": "C5", "cublas": "C6", "quack": "C8"}  # per path
CANDIDATE_STYLE = {"linestyle": "--", "linewidth": 1, "alpha": 0.7}


def plot_inference(result: dict) -> Figure:
    """A grid of panels, rows the tables and columns the models, in the run's order."""
    rows = result["rows"]
    tables = [t for t in TITLES if any(r["table"] == t for r in rows)]
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig = Figure(figsize=(4 * len(models), 3.4 * len(tables)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(tables), len(models), squeeze=False, sharex=True)
    for i, table in enumerate(tables):
        for j, model in enumerate(models):
            mine = sorted(
                (r for r in rows if r["table"] == table and r["model"] == model),
                key=lambda r: r["M"],
            )
            _panel(axes[i][j], table, mine)
            axes[i][j].set_title(f"{TITLES[table]}, {model}", fontsize="medium")
    for ax in axes[-1]:
        ax.set_xlabel("M (tokens)")
    for row in axes:
        row[0].set_ylabel(f"time ÷ GEMMs alone (axis cut at {Y_MAX})")
    legend = {}  # every line once, from whichever panel has it
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)
    fig.legend(legend.values(), legend.keys(), loc="outside lower center", ncols=4)
    return fig


def _panel(ax, table: str, rows: list[dict]) -> None:
    lines = [*LINES]
    lines += [
        (
            f"{variant}_ms",
            f"candidate: {path}",
            {**CANDIDATE_STYLE, "color": CANDIDATE_COLORS[path]},
        )
        for path, variant in iv.CANDIDATES[table].items()
    ]
    for column, label, style in lines:
        points = [
            (r["M"], r[column] / r["gemm_only_ms"])
            for r in rows
            if column in r and "gemm_only_ms" in r
        ]
        if points:
            ax.plot(*zip(*points, strict=True), label=label, **style)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylim(0.8, Y_MAX)
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
