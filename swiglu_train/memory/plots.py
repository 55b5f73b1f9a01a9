"""Side-by-side memory curves of several runs, and a self-contained PNG + HTML report.

Figures are drawn on an Agg canvas of their own, never through pyplot, so importing this module
changes no global backend and works on machines without a display.
"""

from __future__ import annotations

import html
import io
from pathlib import Path

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from swiglu_train.files import atomic_write, png_bytes
from swiglu_train.memory.runs import (
    MAIN_KEYS,
    MemoryRun,
    depth_curve,
    layer_values,
)

_COLUMN_NAMES = {
    "memory/saved_MiB": "saved",
    "memory/after_forward_MiB": "after fwd",
    "memory/forward_peak_MiB": "fwd peak",
    "memory/backward_peak_MiB": "bwd peak",
    "memory/peak_MiB": "peak",
    "memory/allocated_MiB": "allocated",
}
_DEPTH_NAMES = {"allocated_MiB": "allocated", "cumulative_saved_MiB": "cumulative saved"}
_MARKERS = "osD^vP*Xph"


def distinct_styles(n: int) -> list[dict]:
    """Line styles for ``n`` series that stay apart where their values are equal (normal's and
    save_factors' after-forward memory, say): one color and hollow marker shape per series,
    markers and line widths shrinking with each series drawn, so the one drawn over another
    leaves the other's wider line and larger marker showing around it."""
    return [
        {
            "color": f"C{i % 10}",
            "marker": _MARKERS[i % len(_MARKERS)],
            "markersize": max(10 - 2 * i, 4),
            "markerfacecolor": "none",
            "linewidth": max(3.5 - 0.75 * i, 1.0),
        }
        for i in range(n)
    ]


def _markevery(points: int, i: int) -> tuple[int, int]:
    """About a dozen markers on a long series, staggered per series so they do not coincide."""
    every = max(points // 12, 1)
    return (i % every, every)


def plot_comparison(runs: list[MemoryRun]) -> Figure:
    """(a) memory per step, (b) along layer depth, (c) saved bytes per layer, one color per run."""
    fig = Figure(figsize=(17, 5), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle("Activation memory by run: " + ", ".join(run.label for run in runs))
    per_step, depth, per_layer = fig.subplots(1, 3)
    styles = distinct_styles(len(runs))
    _plot_steps(per_step, runs, styles)
    _plot_depth(depth, runs, styles)
    _plot_layer_bars(per_layer, runs, [style["color"] for style in styles])
    for ax in (per_step, depth, per_layer):
        ax.set_ylabel("MiB")
        ax.set_ylim(bottom=min(0.0, ax.get_ylim()[0]))  # differences read true against zero
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
    return fig


def _plot_steps(ax, runs: list[MemoryRun], styles: list[dict]) -> None:
    """Allocator figures where the run has them (CUDA), else exact bytes saved for backward;
    solid after forward, dashed peak."""
    for i, (run, style) in enumerate(zip(runs, styles, strict=True)):
        cuda = [k for k in ("memory/after_forward_MiB", "memory/peak_MiB") if run.has(k)]
        for key, dashes in zip(cuda or ["memory/saved_MiB"], ("-", "--"), strict=False):
            values = run.series.get(key, [])
            points = [(s, v) for s, v in zip(run.steps, values, strict=False) if v is not None]
            if points:
                steps, mib = zip(*points, strict=True)
                label = f"{run.label} {_COLUMN_NAMES[key]}"
                every = _markevery(len(points), i)
                ax.plot(steps, mib, linestyle=dashes, markevery=every, label=label, **style)
    ax.set(title="(a) per step", xlabel="step")


def _plot_depth(ax, runs: list[MemoryRun], styles: list[dict]) -> None:
    for run, style in zip(runs, styles, strict=True):
        layers, values, field = depth_curve(run)
        if field is not None:
            ax.plot(layers, values, label=f"{run.label} {_DEPTH_NAMES[field]}", **style)
    ax.set(title="(b) along layer depth, last step", xlabel="layer")


def _plot_layer_bars(ax, runs: list[MemoryRun], colors: list[str]) -> None:
    width = 0.8 / max(len(runs), 1)
    for n, (run, color) in enumerate(zip(runs, colors, strict=True)):
        layers, values = layer_values(run, "saved_MiB")
        offset = (n - (len(runs) - 1) / 2) * width
        if layers:
            ax.bar([i + offset for i in layers], values, width, color=color, label=run.label)
    ax.set(title="(c) saved for backward per layer, last step", xlabel="layer")


def figure_bytes(fig: Figure, fmt: str) -> bytes:
    """The figure rendered as ``fmt`` (png, svg); SVG keeps text as text so pages stay small."""
    if fmt == "png":
        return png_bytes(fig, dpi=120)
    buffer = io.BytesIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        fig.savefig(buffer, format=fmt, dpi=120, metadata={"Date": None})
    return buffer.getvalue()


def summary_rows(runs: list[MemoryRun]) -> tuple[list[str], list[list[str]]]:
    """(header, rows): latest value of each main key any run logged; max peak on CUDA runs."""
    keys = [k for k in MAIN_KEYS if any(r.has(k) for r in runs)]
    with_peak = "memory/peak_MiB" in keys
    header = ["run", "impl", "device", "last step", *(_COLUMN_NAMES[k] for k in keys)]
    header += ["max peak"] if with_peak else []
    rows = []
    for run in runs:
        values = [run.last(k) for k in keys]
        if with_peak:
            peaks = [v for v in run.series.get("memory/peak_MiB", []) if v is not None]
            values.append(max(peaks, default=None))
        cells = [run.label, run.impl or "", run.config.get("device", ""), str(run.steps[-1])]
        rows.append(cells + ["" if v is None else f"{v:.1f}" for v in values])
    return header, rows


def summary_table_html(runs: list[MemoryRun]) -> str:
    header, rows = summary_rows(runs)
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; }}
svg {{ max-width: 100%; height: auto; }}
table {{ border-collapse: collapse; }}
th, td {{ border: 1px solid #ccc; padding: 4px 10px; text-align: right; }}
th:nth-child(-n+3), td:nth-child(-n+3) {{ text-align: left; }}
</style></head>
<body>
<h1>{title}</h1>
{svg}
<h2>Summary</h2>
{table}
<p>MiB = 2<sup>20</sup> bytes. Each column is the latest value the run logged;
max peak is over all steps. Allocator figures (peaks, allocated) exist on CUDA runs only.</p>
</body></html>
"""


def write_report(runs: list[MemoryRun], out_png: Path) -> tuple[Path, Path]:
    """Write ``out_png`` and a same-stem ``.html`` page with the figure inline as SVG."""
    out_png = Path(out_png)
    if out_png.suffix.lower() != ".png":
        raise ValueError(f"the report path must end in .png, got {out_png}")
    if not runs:
        raise ValueError("no runs to compare")
    fig = plot_comparison(runs)
    svg = figure_bytes(fig, "svg").decode()
    title = "Activation memory: " + " vs ".join(run.label for run in runs)
    page = _PAGE.format(
        title=html.escape(title), svg=svg[svg.index("<svg") :], table=summary_table_html(runs)
    )
    out_html = out_png.with_suffix(".html")
    for path, data in ((out_png, figure_bytes(fig, "png")), (out_html, page.encode())):
        with atomic_write(path, "wb") as f:
            f.write(data)
    return out_png, out_html
