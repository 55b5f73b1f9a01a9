"""The MLP benchmark: every variant against the six-cuBLAS-GEMM floor, paired in one process.

The floor is the six GEMMs any SwiGLU MLP step must run (fc1, fc2; grad_h, grad_W2, grad_x,
grad_W1) on preallocated operands, with no activation at all. A variant's ``full_over_floor``
is the median over samples of its step time divided by the floor's time in the same sample.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

import numpy as np
import torch

from swiglu_train.bench.mlp.variants import BUILDERS, LayerWeights
from swiglu_train.bench.results import DTYPES, environment
from swiglu_train.bench.timing import (
    PEAK_DEFINITION,
    PHASES,
    Case,
    Clock,
    memory_mib,
    paired_samples,
    run_once,
)

TARGET_SHAPE = (11136, 3584, 14336, 3584)  # seed 000's [M, D, F, O]


@dataclass
class BenchConfig:
    shape: tuple[int, int, int, int] = TARGET_SHAPE
    dtype: str = "bf16"
    variants: Sequence[str] = tuple(BUILDERS)
    samples: int = 40
    warmup: int = 3
    stack_layers: int = 4
    device: str = "cuda"
    seed: int = 0
    extra: dict = field(default_factory=dict)


class SweepSettings(Protocol):
    """What a sweep over shapes (the model grid, the crossover table) sets for every point."""

    samples: int
    warmup: int
    dtype: str
    device: str
    seed: int


def one_layer_config(
    dims: tuple[int, int, int], variants: Sequence[str], sweep: SweepSettings
) -> BenchConfig:
    """One layer (no stack) at (M, D, F) with O = D, as a sweep measures each of its points."""
    m, d, f = dims
    return BenchConfig(
        shape=(m, d, f, d),
        dtype=sweep.dtype,
        variants=tuple(variants),
        samples=sweep.samples,
        warmup=sweep.warmup,
        stack_layers=0,
        device=sweep.device,
        seed=sweep.seed,
    )


def layer_inputs(cfg: BenchConfig, layers: int):
    """Random weights for ``layers`` layers, x and grad_y at ``cfg.shape``: every variant of a
    run (and the grid's pre-warm workers) steps on the same values."""
    m, d, f, o = cfg.shape
    dtype, device = DTYPES[cfg.dtype], cfg.device
    weights = [LayerWeights.random(d, f, o, dtype, device) for _ in range(layers)]
    x = torch.randn(m, d, dtype=dtype, device=device, requires_grad=True)
    grad_y = torch.randn(m, o, dtype=dtype, device=device)
    return weights, x, grad_y


def layer_case(name: str, weights: list[LayerWeights], x: torch.Tensor, grad_y) -> Case:
    """A stack of one variant's layers over shared weights (one layer for the main table)."""
    layers = [BUILDERS[name](w) for w in weights]
    own = [p for layer in layers if isinstance(layer, torch.nn.Module) for p in layer.parameters()]
    params = list(
        {id(p): p for p in [x, *(p for w in weights for p in w.parameters()), *own]}.values()
    )

    def forward() -> torch.Tensor:
        y = x
        for layer in layers:
            y = layer(y)
        return y

    def reset() -> None:
        for p in params:
            p.grad = None

    return Case(name, forward, lambda y: y.backward(grad_y), reset)


def floor_case(w: LayerWeights, x: torch.Tensor, grad_y: torch.Tensor) -> Case:
    """The six GEMMs of one MLP step, with the operand layouts autograd uses."""
    x, w1, w2 = x.detach(), w.fc1.detach(), w.fc2.detach()
    h = torch.randn(x.shape[0], w2.shape[1], dtype=x.dtype, device=x.device)
    grad_preact = torch.randn(x.shape[0], w1.shape[0], dtype=x.dtype, device=x.device)

    def forward() -> tuple:
        return x @ w1.t(), h @ w2.t()

    def backward(_: object) -> None:
        grad_y @ w2, grad_y.t() @ h, grad_preact @ w1, grad_preact.t() @ x

    return Case("floor", forward, backward, lambda: None)


def _grads(case: Case, weights: list[LayerWeights], x: torch.Tensor) -> list:
    """y and the grads to compare; fc1's is None where a variant keeps its own (packed) copy."""
    case.reset()
    y = case.forward()
    case.backward(y)
    return [y.detach(), x.grad, weights[0].fc2.grad, weights[0].fc1.grad]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def available_cases(names: Sequence[str], weights, x, grad_y) -> tuple[list[Case], dict[str, str]]:
    """A case per variant that imports here, and why each other one was skipped."""
    cases, skipped = [], {}
    for name in names:
        try:
            cases.append(layer_case(name, weights, x, grad_y))
        except ImportError as e:
            skipped[name] = f"not importable: {e}"
    return cases, skipped


def measure_layer(
    cfg: BenchConfig, progress: Callable[[str, int], Callable[[], None]]
) -> tuple[list[dict], dict[str, str], str | None]:
    """One layer at ``cfg.shape``: the floor's row then each working variant's, the variants
    skipped (with why), and the variant the errors are relative to."""
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    weights, x, grad_y = layer_inputs(cfg, 1)
    cases, skipped = available_cases(cfg.variants, weights, x, grad_y)
    floor = floor_case(weights[0], x, grad_y)

    tick = progress("warm-up and correctness", len(cases))
    reference, errors, working = None, {}, []
    for case in cases:
        try:
            for _ in range(cfg.warmup):  # compiles, autotunes
                run_once(case, Clock(device))
            grads = _grads(case, weights, x)
        except Exception as e:  # a broken peer is reported, not allowed to sink the run
            skipped[case.name] = f"failed: {type(e).__name__}: {e}"
            continue
        finally:
            tick()
        reference = reference or grads
        pairs = zip(grads, reference, strict=True)
        errors[case.name] = max(_rel_err(a, b) for a, b in pairs if a is not None and b is not None)
        working.append(case)
    cases = working
    for _ in range(cfg.warmup):
        run_once(floor, Clock(device))

    memory = {c.name: memory_mib(c, device) for c in cases}
    tick = progress("paired samples", cfg.samples)
    times = paired_samples([floor, *cases], cfg.samples, device, cfg.seed, tick)

    rows = [_row("floor", times, None, (None, None))]
    rows += [_row(c.name, times, errors[c.name], memory[c.name]) for c in cases]
    return rows, skipped, cases[0].name if cases else None


def run_bench(cfg: BenchConfig, progress: Callable[[str, int], Callable[[], None]]) -> dict:
    """Run the single-layer table and the stack table; ``progress(label, total)`` -> tick."""
    rows, skipped, reference = measure_layer(cfg, progress)
    device = torch.device(cfg.device)
    meta = _meta(cfg, device, reference_variant=reference)
    stack = _stack_table(cfg, device, progress, rows) if cfg.stack_layers else []
    return {
        "meta": meta,
        "results": rows,
        "stack": stack,
        "skipped": skipped,
    }


def _row(name: str, times: dict, error: float | None, mem: tuple) -> dict:
    t, floor = times[name], times["floor"]
    row: dict = {"variant": name}
    for phase in PHASES:
        row[f"{phase}_ms"] = float(np.median(t[phase]))
        row[f"{phase}_over_floor"] = float(np.median(t[phase] / floor[phase]))
    row["full_p20_ms"], row["full_p80_ms"] = (float(q) for q in np.quantile(t["full"], [0.2, 0.8]))
    row["after_forward_MiB"], row["peak_MiB"] = mem
    row["rel_err_vs_reference"] = error
    return row


def _stack_table(cfg: BenchConfig, device: torch.device, progress, measured) -> list[dict]:
    if cfg.shape[1] != cfg.shape[3]:
        return []  # a stack needs O == D
    torch.manual_seed(cfg.seed)
    weights, x, grad_y = layer_inputs(cfg, cfg.stack_layers)
    names = [r["variant"] for r in measured if r["variant"] != "floor"]
    cases, _ = available_cases(names, weights, x, grad_y)
    tick = progress(f"{cfg.stack_layers}-layer stack memory", len(cases))
    rows = []
    for case in cases:
        for _ in range(max(cfg.warmup, 1)):
            run_once(case, Clock(device))
        after, peak = memory_mib(case, device)
        rows.append(
            {
                "variant": case.name,
                "layers": cfg.stack_layers,
                "after_forward_MiB": after,
                "peak_MiB": peak,
            }
        )
        tick()
    return rows


def _meta(cfg: BenchConfig, device: torch.device, reference_variant: str | None) -> dict:
    return {
        **{k: v for k, v in asdict(cfg).items() if k != "extra"},
        "variants": list(cfg.variants),
        **environment(device, cfg.extra.get("commit")),
        "rel_err_reference": reference_variant,
        "peak_definition": PEAK_DEFINITION,
    }


def to_markdown(result: dict) -> str:
    """The README tables: one row per variant, then the stack table."""
    lines = [
        "| variant | fwd ms | bwd ms | host ms | step ms | step ÷ floor | after-fwd MiB "
        "| peak MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["results"]:
        lines.append(
            f"| {r['variant']} | {r['fwd_ms']:.3f} | {r['bwd_ms']:.3f} | {r['host_ms']:.3f} "
            f"| {r['full_ms']:.3f} | {r['full_over_floor']:.3f} | {_mib(r['after_forward_MiB'])} "
            f"| {_mib(r['peak_MiB'])} |"
        )
    if result["stack"]:
        lines += ["", "| variant | layers | after-fwd MiB | peak MiB |", "|---|---|---|---|"]
        for r in result["stack"]:
            lines.append(
                f"| {r['variant']} | {r['layers']} | {_mib(r['after_forward_MiB'])} "
                f"| {_mib(r['peak_MiB'])} |"
            )
    return "\n".join(lines) + "\n"


def _mib(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"
