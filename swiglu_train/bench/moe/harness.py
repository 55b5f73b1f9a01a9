"""``bench-moe``'s measurement: at each (shape, routing) point, every variant paired with the
grouped-GEMM floor in one process, on one set of inputs.

A point's inputs are built once: the expert weights, x, the routing, the router weights (fp32,
requiring grad, applied to the expert output) and grad_y. A variant's step is its forward and
``y.backward(grad_y)``, filling the grads of x, the router weights and the expert weights.
Every variant's y and gradients are checked against the loop over dense experts; the expert
weights' gradients on a sample of experts (the hot one first), so that a point never holds a
second copy of 22.5 GB of gradients. A variant that cannot be built (not installed, an impl not
offered) or fails (a peer's error, out of memory) is recorded with why, and the point goes on.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from swiglu_train.bench.moe.floor import floor_case
from swiglu_train.bench.moe.routing import ROUTINGS, group_sizes, make_routing
from swiglu_train.bench.moe.shapes import MoEShape
from swiglu_train.bench.moe.variants import OUR_OPTIONS, REFERENCE, SIDES, builder
from swiglu_train.bench.moe.weights import ExpertWeights, NotOffered, Variant
from swiglu_train.bench.results import DTYPES, environment
from swiglu_train.bench.timing import (
    PEAK_DEFINITION,
    PHASES,
    TIMING_DEFINITION,
    Case,
    Clock,
    kernel_timeline,
    memory_mib,
    paired_samples,
    run_once,
    step_waits_on_gpu,
)
from swiglu_train.ops.experts_peak import MODELLED_IMPLS, backward_peak_bytes

Progress = Callable[[str, int], Callable[[], None]]
TOLERANCE = {"bf16": 2e-2, "fp16": 5e-3, "fp32": 1e-4}  # relative error (norm), each output
# The gradients of a variant that keeps its preactivation in e4m3 (3 mantissa bits): y is
# exact, every gradient reads the rounded preactivation.
FP8_TOLERANCE = 5e-2
CHECKED_EXPERTS = 8
OUTPUTS = ("y", "grad_x", "grad_router", "grad_fc1", "grad_fc2")
PACKAGES = ("torchtitan", "transformers", "liger-kernel", "sonicmoe", "quack-kernels",
            "nvidia-cutlass-dsl")  # fmt: skip
AFTER_FORWARD_DEFINITION = (
    "allocated after forward minus allocated before it: what the step keeps for backward, "
    "and y; inputs, weights, routing and grad_y excluded"
)


@dataclass
class MoEConfig:
    shapes: Sequence[MoEShape]
    routings: Sequence[str] = ROUTINGS
    tokens: int = 8192
    variants: Sequence[str] = tuple(SIDES["output"])
    samples: int = 30
    warmup: int = 3
    dtype: str = "bf16"
    device: str = "cuda"
    seed: int = 0
    timeline: bool = False  # each variant's kernels and idle gaps, one step, in the point
    prewarm_workers: int = 0  # processes that compile the models' variants before timing
    extra: dict = field(default_factory=dict)
    router_weights_on: str = "output"  # or "input", as Llama-4 (variants.SIDES)

    def points(self) -> list[tuple[MoEShape, str]]:
        return [(shape, routing) for shape in self.shapes for routing in self.routings]


@dataclass
class Inputs:
    weights: ExpertWeights
    x: torch.Tensor
    indices: torch.Tensor
    router: torch.Tensor
    grad_y: torch.Tensor

    @classmethod
    def build(cls, cfg: MoEConfig, shape: MoEShape, routing: str) -> Inputs:
        dtype, device = DTYPES[cfg.dtype], torch.device(cfg.device)
        weights = ExpertWeights.random(shape.e, shape.d, shape.f, dtype, device, cfg.seed)
        indices, router = make_routing(routing, cfg.tokens, shape.e, shape.k, cfg.seed, device)
        gen = torch.Generator(device).manual_seed(cfg.seed + 1)
        x, grad_y = (
            torch.randn(cfg.tokens, shape.d, generator=gen, device=device, dtype=dtype)
            for _ in range(2)
        )
        return cls(weights, x.requires_grad_(), indices, router.requires_grad_(), grad_y)


def variant_case(name: str, variant: Variant, inputs: Inputs) -> Case:
    grads = [inputs.x, inputs.router, inputs.weights.fc1, inputs.weights.fc2, *variant.params]

    def reset() -> None:
        for t in grads:
            t.grad = None

    return Case(
        name,
        lambda: variant.run(inputs.x, inputs.indices, inputs.router),
        lambda y: y.backward(inputs.grad_y),
        reset,
    )


def built_case(cfg: MoEConfig, name: str, inputs: Inputs, shape: MoEShape) -> tuple[Variant, Case]:
    """Variant ``name`` on the run's router side over the point's inputs, and its step."""
    variant = builder(name, cfg.router_weights_on)(inputs.weights, shape.k)
    return variant, variant_case(name, variant, inputs)


def warm_up(case: Case, steps: int, device: torch.device) -> float:
    """Run ``steps`` untimed steps (the first compiles and autotunes); when the first ended
    (``time.perf_counter()``)."""
    run_once(case, Clock(device, queued=False))
    first_ended = time.perf_counter()
    for _ in range(steps - 1):
        run_once(case, Clock(device, queued=False))
    return first_ended


def checked_experts(experts: int) -> torch.Tensor:
    """The experts whose weight gradients are compared: the hot one (0) and evenly spaced."""
    return torch.linspace(0, experts - 1, min(experts, CHECKED_EXPERTS)).round().long()


def step_outputs(case: Case, variant: Variant, inputs: Inputs) -> dict[str, torch.Tensor | None]:
    """One step's y and gradients (the expert weights' on the checked experts only)."""
    case.reset()
    y = case.forward()
    case.backward(y)
    fc1, fc2 = variant.weight_grads()
    picked = checked_experts(inputs.weights.fc1.shape[0]).to(inputs.x.device)
    sample = [None if g is None else g.index_select(0, picked) for g in (fc1, fc2)]
    values = [y.detach(), inputs.x.grad, inputs.router.grad, *sample]
    case.reset()
    return dict(zip(OUTPUTS, values, strict=True))


def errors(outputs: dict, reference: dict, tolerance: float) -> dict:
    """Relative error (norm) of each output against the reference's, y's largest absolute
    error, and whether every output is within ``tolerance``."""
    result: dict = {}
    for key in OUTPUTS:
        a, b = outputs[key], reference[key]
        rel = None if a is None or b is None else _rel(a, b)
        result[f"{key}_rel_err"] = rel
    result["y_max_abs_err"] = (outputs["y"].double() - reference["y"].double()).abs().max().item()
    rels = [result[f"{key}_rel_err"] for key in OUTPUTS]
    result["ok"] = all(r is not None and r <= tolerance for r in rels)
    return result


def tolerance(cfg: MoEConfig, variant: str) -> float:
    base = TOLERANCE[cfg.dtype]
    return max(base, FP8_TOLERANCE) if variant.endswith("+fp8") else base


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def skip_reason(e: BaseException) -> str:
    """One line: "not offered" where the variant computes the other side's function, "not
    installed" where a package itself is missing, else "failed" (a module missing inside a
    package, as SonicMoE's from quack 0.6.5, is a version clash)."""
    if isinstance(e, NotOffered):
        return f"not offered: {e}"
    missing = isinstance(e, ModuleNotFoundError) and "." not in (e.name or ".")
    kind = "not installed" if missing else "failed"
    return f"{kind}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")


def free(device: torch.device) -> None:
    """Give back what a failed variant held, so the point's other variants have it."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def release(device: torch.device) -> None:
    """Free a finished point and its compiled graphs: each point compiles its own static
    shapes (dynamo would fall back to eager past its recompile limit)."""
    torch._dynamo.reset()
    free(device)


def measure_point(
    cfg: MoEConfig, shape: MoEShape, routing: str, progress: Progress
) -> tuple[dict, list[dict], dict[str, str]]:
    """(the point's record, its rows (the floor's first), the variants skipped and why)."""
    device = torch.device(cfg.device)
    inputs = Inputs.build(cfg, shape, routing)
    sizes = group_sizes(inputs.indices, shape.e)
    prepare_s: dict[str, float] = {}  # each variant's build, warm-up and check: its compiles
    first_step_s: dict[str, float] = {}  # of which its first step's (compiles, autotuning)
    point = {
        "model": shape.name,
        "repo": shape.repo,
        "D": shape.d,
        "F": shape.f,
        "E": shape.e,
        "k": shape.k,
        "T": cfg.tokens,
        "routing": routing,
        "rows_per_expert": {
            "min": int(sizes.min()),
            "max": int(sizes.max()),
            "mean": cfg.tokens * shape.k / shape.e,
            "empty_experts": int((sizes == 0).sum()),
        },
        "prepare_s": prepare_s,
        "first_step_s": first_step_s,
    }
    began = time.perf_counter()
    reference_variant, reference_case = built_case(cfg, REFERENCE, inputs, shape)
    reference = step_outputs(reference_case, reference_variant, inputs)
    point["reference_s"] = round(time.perf_counter() - began, 2)  # the loop's step, checked once
    cases, checks, skipped = [], {}, {}
    tick = progress(f"{shape.name} {routing}: build, warm-up, check", len(cfg.variants))
    for name in cfg.variants:
        began = time.perf_counter()
        try:
            variant, case = built_case(cfg, name, inputs, shape)
            first_step_s[name] = round(warm_up(case, cfg.warmup, device) - began, 2)
            checks[name] = errors(
                step_outputs(case, variant, inputs), reference, tolerance(cfg, name)
            )
            cases.append(case)
        except Exception as e:  # a peer that cannot run is recorded, not allowed to sink the run
            skipped[name] = skip_reason(e)
        if name in skipped:  # its tensors go back once the traceback holding them is gone
            variant = case = None
            free(device)
        prepare_s[name] = round(time.perf_counter() - began, 2)
        tick()
    del reference
    floor = floor_case(inputs.x, inputs.indices, inputs.weights.fc1, inputs.weights.fc2,
                       inputs.grad_y, cfg.seed)  # fmt: skip
    for _ in range(cfg.warmup):
        run_once(floor, Clock(device, queued=False))
    memory = {c.name: memory_mib(c, device) for c in cases}
    # The loop's, HF's and Liger's steps read their group sizes on the host: they are timed from
    # an idle GPU, where their host time counts as it does in training; the rest queued, as the
    # dense benchmarks time every step.
    for case in (floor, *cases):
        case.waits_on_gpu = step_waits_on_gpu(case)
    if cfg.timeline and device.type == "cuda":
        point["timeline"] = {c.name: kernel_timeline(c) for c in (floor, *cases)}
    tick = progress(f"{shape.name} {routing}: paired samples", cfg.samples)
    times = paired_samples([floor, *cases], cfg.samples, device, cfg.seed, tick)
    rows = [_row(point, "floor", times, (None, None), {}, floor.waits_on_gpu)]
    rows += [
        _row(point, c.name, times, memory[c.name], checks[c.name], c.waits_on_gpu)
        | peak_model(c.name, shape, cfg)
        for c in cases
    ]
    return point, rows, skipped


def peak_model(name: str, shape: MoEShape, cfg: MoEConfig) -> dict:
    """``{"peak_model_MiB": ...}`` for a drop_h variant: the size model's backward peak
    (``ops.experts_peak``) beside the measured one, which shows where the model stops holding."""
    options = OUR_OPTIONS.get(name, {})
    # the input side's weight gradient adds buffers the model does not count
    if options.get("impl") not in MODELLED_IMPLS or cfg.router_weights_on != "output":
        return {}
    peak = backward_peak_bytes(
        options["impl"], options.get("saved_fp8", False), options.get("gathered_wgrad", False),
        True, cfg.tokens, shape.d, shape.f, shape.k, shape.e, DTYPES[cfg.dtype],
    )  # fmt: skip
    return {"peak_model_MiB": peak / 2**20}


def _row(point: dict, name: str, times: dict, memory: tuple, check: dict, waits: bool) -> dict:
    t, floor = times[name], times["floor"]
    row: dict = {"model": point["model"], "routing": point["routing"], "variant": name}
    row["waits_on_gpu"] = waits  # timed from an idle GPU: its step reads GPU values on the host
    for phase in PHASES:
        row[f"{phase}_ms"] = float(np.median(t[phase]))
        row[f"{phase}_over_floor"] = float(np.median(t[phase] / floor[phase]))
    row["full_p20_ms"], row["full_p80_ms"] = (float(q) for q in np.quantile(t["full"], [0.2, 0.8]))
    row["after_forward_MiB"], row["peak_MiB"] = memory
    return row | check


def run_moe(
    cfg: MoEConfig, progress: Progress, on_point: Callable[[dict], None] = lambda _: None
) -> dict:
    """Every point of ``cfg``; ``on_point(result so far)`` after each (the CLI rewrites the
    JSON there, so a run stopped at a device call's limit keeps the points it finished)."""
    device = torch.device(cfg.device)
    result = {"meta": meta(cfg, device), "points": [], "rows": [], "skipped": []}
    for shape, routing in cfg.points():
        try:
            point, rows, skipped = measure_point(cfg, shape, routing, progress)
        except torch.OutOfMemoryError as e:
            point, rows, skipped = None, [], {"*": skip_reason(e)}
        release(device)
        if point is not None:
            result["points"].append(point)
            result["rows"] += rows
        result["skipped"] += [
            {"model": shape.name, "routing": routing, "variant": name, "reason": reason}
            for name, reason in skipped.items()
        ]
        on_point(result)
    return result


def meta(cfg: MoEConfig, device: torch.device) -> dict:
    """What a result was measured with and where: the run's settings, the GPU, the commit and
    the versions of torch and of every peer installed."""
    env = environment(device, cfg.extra.get("commit"))
    for package in PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            env["versions"][package] = importlib.metadata.version(package)
    return {
        "command": cfg.extra.get("command", ""),
        "tokens": cfg.tokens,
        "routings": list(cfg.routings),
        "variants": list(cfg.variants),
        "dtype": cfg.dtype,
        "samples": cfg.samples,
        "warmup": cfg.warmup,
        "seed": cfg.seed,
        **env,
        "reference": REFERENCE,
        "tolerance": {"+fp8": tolerance(cfg, "+fp8"), "others": tolerance(cfg, "")},
        "checked_experts": CHECKED_EXPERTS,
        "prewarm": cfg.extra.get("prewarm"),  # the pre-warm's record, or None without one
        "router_weights_on": cfg.router_weights_on,
        "router_weights": "fp32 [T, k], softmax of random logits, applied to the expert "
        + cfg.router_weights_on,
        "after_forward_definition": AFTER_FORWARD_DEFINITION,
        "peak_definition": PEAK_DEFINITION,
        "clock": TIMING_DEFINITION + "; a row's waits_on_gpu says which clock timed it",
    }
