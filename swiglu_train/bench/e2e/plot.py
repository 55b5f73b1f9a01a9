"""The Lightning end-to-end run as a figure: tokens/s against memory budget, per impl."""

from __future__ import annotations

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from swiglu_train.bench.e2e.lightning import best_per_impl
from swiglu_train.bench.e2e.report import machine_labels


def plot_budgets(result: dict) -> Figure:
    """tokens/s against memory budget per impl: at each budget, the impl's best measured
    configuration that fits (a staircase); the planner's picks as stars."""
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
    machines = len(machine_labels(result["points"]))
    ax.set_title(
        f"{result['config']}, seq {result['seq_length']}, micro-batch "
        f"{result['micro_batch_size']}, {result['device']}: tokens/s at a memory "
        "budget (each impl's best checkpointed-blocks count that fits)"
        + (f"; points from {machines} machines: the markdown says which" if machines > 1 else ""),
        fontsize="medium",
        wrap=True,
    )
    ax.grid(alpha=0.3)
    ax.legend()
    return fig
