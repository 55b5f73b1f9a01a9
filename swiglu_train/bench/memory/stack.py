"""The seed's stack table, measured by the memory profiler: saved bytes on any device, and
after-forward and peak MiB on CUDA, for stacks of ParMLP layers of each impl.

Also measures what the profiler itself costs per step, paired against unprofiled steps.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from swiglu_train.bench.timing import Case, paired_samples
from swiglu_train.layers import ParMLP
from swiglu_train.layers.registry import FP8_LABEL
from swiglu_train.memory import MemoryProfiler
from swiglu_train.memory.profiler import NOT_MEASURED


def build_stack(impl: str, layers: int, shape: Sequence[int], dtype, device) -> nn.Sequential:
    name, fp8 = impl.removesuffix(FP8_LABEL), impl.endswith(FP8_LABEL)  # "drop_h+fp8"
    _, d, f, o = shape
    if layers > 1 and o != d:
        raise ValueError(f"a stack of {layers} layers needs O == D, got shape {tuple(shape)}")
    return nn.Sequential(
        *[
            ParMLP(d, f, o, impl=name, saved_fp8=fp8, device=device, dtype=dtype)
            for _ in range(layers)
        ]
    )


def _step(model: nn.Module, x: torch.Tensor, grad_y: torch.Tensor, profiler=None) -> None:
    for p in (x, *model.parameters()):
        p.grad = None
    if profiler is None:
        model(x).backward(grad_y)
        return
    with profiler.step(len(profiler.records)) as p:
        y = model(x)
        p.forward_done()
        y.backward(grad_y)


def stack_row(impl: str, layers: int, shape: Sequence[int], dtype, device) -> dict:
    """One table row; the profiled step follows a warm-up step (autotuning, cuBLAS handles)."""
    model = build_stack(impl, layers, shape, dtype, device)
    x = torch.randn(shape[0], shape[1], dtype=dtype, device=device, requires_grad=True)
    grad_y = torch.randn(shape[0], shape[3], dtype=dtype, device=device)
    _step(model, x, grad_y)
    profiler = MemoryProfiler(model, per_layer=True)
    _step(model, x, grad_y, profiler)
    record = profiler.records[-1]
    row = {
        "impl": impl,
        "layers": layers,
        "saved_for_backward_bytes": record.saved_bytes,
        "after_forward_MiB": record.after_forward_MiB,
        "forward_peak_MiB": record.forward_peak_MiB,
        "backward_peak_MiB": record.backward_peak_MiB,
        "peak_MiB": record.peak_MiB,
        "per_layer_saved_bytes": [layer.saved_bytes for layer in record.layers],
    }
    del model, x, grad_y, profiler
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return row


def profiler_overhead(
    impl: str, layers: int, shape: Sequence[int], dtype, device, samples: int
) -> dict:
    """Median step time with no profiler, with totals only, and with per-layer curves."""
    model = build_stack(impl, layers, shape, dtype, device)
    x = torch.randn(shape[0], shape[1], dtype=dtype, device=device, requires_grad=True)
    grad_y = torch.randn(shape[0], shape[3], dtype=dtype, device=device)
    profilers = {
        "off": None,
        "totals": MemoryProfiler(model, per_layer=False),
        "per_layer": MemoryProfiler(model, per_layer=True),
    }
    cases = [
        Case(name, lambda prof=prof: _step(model, x, grad_y, prof), lambda _: None, lambda: None)
        for name, prof in profilers.items()
    ]
    for case in cases:
        case.forward()  # warm-up
    times = paired_samples(cases, samples, torch.device(device))
    off = times["off"]["fwd"]  # the whole step runs inside the timed "forward" callable
    return {
        "impl": impl,
        "layers": layers,
        "samples": samples,
        "step_ms": float(np.median(off)),
        "totals_overhead": float(np.median(times["totals"]["fwd"] / off) - 1),
        "per_layer_overhead": float(np.median(times["per_layer"]["fwd"] / off) - 1),
    }


def to_markdown(rows: list[dict]) -> str:
    lines = [
        "| impl | layers | saved for backward MiB | after-fwd MiB | peak MiB |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        mem = ["—" if r[k] is None else f"{r[k]:.1f}" for k in ("after_forward_MiB", "peak_MiB")]
        saved = r["saved_for_backward_bytes"] / 2**20
        lines.append(f"| {r['impl']} | {r['layers']} | {saved:.1f} | {mem[0]} | {mem[1]} |")
    if any(r["after_forward_MiB"] is None for r in rows):
        lines += ["", NOT_MEASURED]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict]):
    """After-forward and peak MiB (saved bytes off CUDA) against depth, one line per impl, each
    in its own marker and width: impls of equal memory (normal and save_factors after forward)
    would otherwise draw one line over the other."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    from swiglu_train.memory.plots import distinct_styles

    on_cuda = rows[0]["after_forward_MiB"] is not None
    panels = ["after_forward_MiB", "peak_MiB"] if on_cuda else ["saved_for_backward_bytes"]
    titles = {
        "after_forward_MiB": "after forward (CUDA allocator)",
        "peak_MiB": "peak over forward and backward (CUDA allocator)",
        "saved_for_backward_bytes": "saved for backward (exact, any device)",
    }
    fig = Figure(figsize=(5.5 * len(panels), 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle("Activation memory of a ParMLP stack by depth")
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    for ax, key in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels, strict=True):
        for impl, style in zip(impls, distinct_styles(len(impls)), strict=True):
            mine = [r for r in rows if r["impl"] == impl]
            scale = 2**20 if key.endswith("bytes") else 1
            values = [r[key] / scale for r in mine]
            ax.plot([r["layers"] for r in mine], values, label=impl, **style)
        ax.set(title=titles[key], xlabel="layers", ylabel="MiB")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend()
    return fig
