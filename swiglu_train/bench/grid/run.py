"""The model-grid benchmark: the paired MLP harness over the MLP shapes of public models.

At each point (M, D, F), one layer (O = D) of every impl and peer runs against the six-GEMM
floor of the same shape with ``bench/mlp/run.py``'s ``measure_layer`` (paired samples in random
order, medians, allocator readings), and ``impl="auto"``'s pick there is recorded: the impl
``ParMLP(impl="auto", tokens_hint=M)`` resolves to on this GPU. With ``prewarm_workers``, the
points are first compiled in that many worker processes (``prewarm``). The quack impls'
GEMMs run on their default libraries, or, with ``pretune``, on what pretune measured at each
point just before (``grid/pretune.py``); either way from a cache of the grid's own. A grid too
long for one device call runs in chunks (``plan``) that ``merge_results`` joins; ``auto``
judges auto's picks on the whole, and ``layers/auto_fit.py`` fits auto's model from it.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from swiglu_train.bench.grid.auto import evaluate_auto
from swiglu_train.bench.grid.plan import Dims, GridConfig, GridPoint
from swiglu_train.bench.grid.pretune import (
    DEFAULTS,
    PRETUNED,
    pretune_point,
    private_cache,
    warm_point_and_gemms,
    why_not,
)
from swiglu_train.bench.grid.prewarm import grid_jobs, release, warm_point
from swiglu_train.bench.mlp.run import measure_layer
from swiglu_train.bench.prewarm import Warmed, prewarm
from swiglu_train.bench.results import DTYPES, environment
from swiglu_train.bench.timing import PEAK_DEFINITION
from swiglu_train.layers.auto import find_model_file, gpu_family, resolve_auto
from swiglu_train.ops.quack_mlp import quack_available

RATIO_DEFINITION = (
    "median over paired samples of (variant's fwd+bwd step time / the six-GEMM floor's in the "
    "same sample); step time = max(GPU time queued, host time), see 'timing'; one layer, O = D"
)
# Keys every chunk of one merged grid must share: a merge never mixes GPUs, dtypes, code, or
# auto models (auto's picks were resolved from the one the run shipped; the key keeps the name
# of the crossover tables that came before, so older results merge alike).
SAME_KEYS = (
    *("device_name", "dtype", "commit", "samples", "warmup", "versions", "timing"),
    *("variants", "quack_available", "auto_table", "gemm_choices"),
)
Progress = Callable[[str, int], Callable[[], None]]


def run_grid(
    cfg: GridConfig,
    progress: Progress,
    on_point: Callable[[dict], None] = lambda _: None,
    on_prewarm: Callable[[Warmed], None] = lambda _: None,
) -> dict:
    """Measure the chunk's points; ``on_point(result so far)`` after each, and after the
    pre-warm (the CLI writes the JSON there, so a call killed at its limit keeps what
    finished); ``on_prewarm`` sees each pre-warmed point. A point or variant that fails (out
    of memory, a peer that cannot run) is skipped on record."""
    with private_cache():
        return _run(cfg, progress, on_point, on_prewarm)


def _run(cfg: GridConfig, progress: Progress, on_point, on_prewarm) -> dict:
    device = torch.device(cfg.device)
    start = time.perf_counter()
    points = cfg.points()
    result = {"meta": _meta(cfg, device, points), "points": [], "rows": [], "skipped_points": []}
    pretuning = result["meta"]["gemm_choices"] == PRETUNED
    if cfg.prewarm_workers:
        tick = progress("pre-warm", len(points))

        def warmed(outcome: Warmed) -> None:
            tick()
            on_prewarm(outcome)

        configs = [cfg.bench_config(p) for p in points]
        task = warm_point_and_gemms if pretuning else warm_point
        result["meta"]["prewarm"] |= prewarm(grid_jobs(configs), cfg.prewarm_workers, task, warmed)
        result["meta"]["elapsed_s"] = round(time.perf_counter() - start, 1)
        on_point(result)
    tick = progress("grid points", len(points))  # one bar: a point's own bars would pile up
    for point, compiles in cfg.compiling(points):
        began = time.perf_counter()
        m, d, f = point.dims
        try:
            pretuned, pretune_error = _pretune(cfg, point) if pretuning else (None, None)
            measured, skipped, reference = measure_layer(cfg.bench_config(point), _quiet)
        except torch.OutOfMemoryError as e:
            measured, skipped, reference = [], {}, None
            result["skipped_points"].append(
                {"M": m, "D": d, "F": f, "reason": f"OutOfMemoryError: {e}".splitlines()[0]}
            )
        release(device)
        tick()
        if measured:
            result["rows"] += point_rows(point, measured)
            auto = resolve_auto(m, d, f, cfg.device, output_size=d)  # what ParMLP resolves
            result["points"].append(
                {
                    "M": m,
                    "D": d,
                    "F": f,
                    "models": list(point.shape.models),
                    "families": list(point.shape.families),
                    "auto": dataclasses.asdict(auto),
                    "skipped": skipped,
                    "rel_err_reference": reference,
                    "pretuned": pretuned,  # each GEMM's timings and library, or None
                    "pretune_error": pretune_error,  # why not, where pretune itself failed
                    "elapsed_s": round(time.perf_counter() - began, 1),
                    "estimated_s": round(cfg.estimate_s(point, compiles), 1),
                }
            )
        result["meta"]["elapsed_s"] = round(time.perf_counter() - start, 1)
        on_point(result)
    result["meta"]["complete"] = True
    result["auto_eval"] = evaluate_auto(result)
    return result


def _pretune(cfg: GridConfig, point: GridPoint) -> tuple[list[dict] | None, str | None]:
    """(each GEMM's pretune record, None), or (None, the error) where pretune failed: the
    point is then timed on the defaults, and says so, rather than ending the grid."""
    try:
        return pretune_point(point.dims, cfg.variants, DTYPES[cfg.dtype]), None
    except torch.OutOfMemoryError:
        raise  # the point is skipped on record, as any out-of-memory point
    except Exception as e:
        return None, f"{type(e).__name__}: {e}".splitlines()[0]


def point_rows(point: GridPoint, measured: Sequence[dict]) -> list[dict]:
    """One row per variant from ``measure_layer``'s rows (the floor's first)."""
    m, d, f = point.dims
    floor = measured[0]
    return [
        {
            "M": m,
            "D": d,
            "F": f,
            "variant": r["variant"],
            "ms": r["full_ms"],
            "ratio_to_floor": r["full_over_floor"],
            "fwd_ms": r["fwd_ms"],
            "bwd_ms": r["bwd_ms"],
            "gpu_ms": r["gpu_ms"],
            "host_ms": r["host_ms"],
            "full_p20_ms": r["full_p20_ms"],
            "full_p80_ms": r["full_p80_ms"],
            "floor_ms": floor["full_ms"],
            "after_forward_MiB": r["after_forward_MiB"],
            "peak_MiB": r["peak_MiB"],
            "rel_err_vs_reference": r["rel_err_vs_reference"],
        }
        for r in measured[1:]
    ]


def _meta(cfg: GridConfig, device: torch.device, points: Sequence[GridPoint]) -> dict:
    env = environment(device, cfg.commit)
    not_pretuned = why_not(cfg.variants, cfg.device) if cfg.pretune else None
    cuda = device.type == "cuda"
    family = gpu_family(env["device_name"]) if cuda else None
    return {
        **env,
        "gpu_family": family,
        "dtype": cfg.dtype,
        "samples": cfg.samples,
        "warmup": cfg.warmup,
        "seed": cfg.seed,
        "m": list(cfg.m),
        "variants": list(cfg.variants),
        "shapes": [
            {"D": s.d, "F": s.f, "models": list(s.models), "families": list(s.families)}
            for s in cfg.shapes
        ],
        "command": cfg.command,
        "chunk": f"{cfg.chunk[0]}/{cfg.chunk[1]}",
        "planned_points": [list(p.dims) for p in points],
        "estimated_s": round(cfg.chunk_s(points)),
        # the processes that compiled the points before timing (their wall seconds are part of
        # meta's elapsed_s; each point's elapsed_s is its timing alone)
        "prewarm": {
            "workers": cfg.prewarm_workers,
            "estimated_s": round(cfg.prewarm_s(points)),
            "elapsed_s": 0.0,
        },
        "quack_available": cuda and quack_available(),
        "gemm_choices": PRETUNED if cfg.pretune and not not_pretuned else DEFAULTS,
        "pretune_skipped": not_pretuned,  # --pretune asked, and why it could not run
        "auto_table": _model_summary(family),
        "ratio_definition": RATIO_DEFINITION,
        "peak_definition": PEAK_DEFINITION,
        "complete": False,
        "elapsed_s": 0.0,
    }


def _model_summary(family: str | None) -> dict | None:
    """Which auto model ParMLP read here (calibrated on this machine, else shipped), and its
    fitted points (for the in-sample flags)."""
    found = find_model_file(family) if family else None
    if found is None:
        return None
    model, file = found
    return {
        "file": file,
        "commit": model.commit,
        "device_name": model.device_name,
        "dtype": model.dtype,
        "points": [list(p) for p in model.points],
    }


def _quiet(label: str, total: int) -> Callable[[], None]:
    return lambda: None


def merge_results(parts: Mapping[str, dict]) -> dict:
    """One result from chunks (``source -> result``) of one grid: they must share the GPU,
    dtype, commit, versions, variants and auto model, and no point may be in two of them. A
    merged result given alone comes back as it is, with auto judged again."""
    if not parts:
        raise ValueError("nothing to merge")
    for source, part in parts.items():
        _check_part(part, source)
    if len(parts) == 1 and next(iter(parts.values()))["meta"]["chunk"] == "merged":
        # a merged result alone: its record stays as it is, and auto is judged again (the
        # shipped model may be newer than the run)
        merged = {k: v for k, v in next(iter(parts.values())).items() if k != "auto_eval"}
        merged["auto_eval"] = evaluate_auto(merged)
        return merged
    for key in SAME_KEYS:
        values = {
            source: json.dumps(p["meta"].get(key), sort_keys=True) for source, p in parts.items()
        }
        if len(set(values.values())) > 1:
            seen = "; ".join(f"{s}: {v}" for s, v in values.items())
            raise ValueError(f"cannot merge chunks measured with a different {key} ({seen})")
    owner: dict[Dims, str] = {}
    for source, part in parts.items():
        for p in (*part["points"], *part["skipped_points"]):
            dims = (p["M"], p["D"], p["F"])
            if dims in owner:
                raise ValueError(
                    f"point M={dims[0]} D={dims[1]} F={dims[2]} is measured in both "
                    f"{owner[dims]} and {source}: a merge never picks between samples"
                )
            owner[dims] = source

    def order(p: dict) -> tuple:
        return _order(p["M"], p["D"], p["F"])

    chunks = list(parts.values())
    planned = [tuple(p) for c in chunks for p in c["meta"]["planned_points"]]
    shapes = {(s["D"], s["F"]): s for c in chunks for s in c["meta"]["shapes"]}
    meta = {
        **{k: v for k, v in chunks[0]["meta"].items() if k != "prewarm"},  # per chunk below
        "command": " && ".join(str(c["meta"].get("command")) for c in chunks),
        "chunk": "merged",
        "chunks": [
            {
                "source": source,
                **{
                    k: c["meta"].get(k)
                    for k in ("chunk", "command", "date", "elapsed_s", "prewarm")
                },
                "complete": c["meta"]["complete"],
            }
            for source, c in parts.items()
        ],
        "m": sorted({m for c in chunks for m in c["meta"]["m"]}),
        "shapes": sorted(shapes.values(), key=lambda s: _order(0, s["D"], s["F"])),
        "planned_points": [list(p) for p in sorted(set(planned), key=lambda p: _order(*p))],
        "estimated_s": sum(c["meta"]["estimated_s"] for c in chunks),
        "elapsed_s": round(sum(c["meta"]["elapsed_s"] for c in chunks), 1),
        "complete": all(c["meta"]["complete"] for c in chunks),
    }
    merged = {
        "meta": meta,
        "points": sorted((p for c in chunks for p in c["points"]), key=order),
        "rows": sorted((r for c in chunks for r in c["rows"]), key=order),
        "skipped_points": sorted((p for c in chunks for p in c["skipped_points"]), key=order),
    }
    merged["auto_eval"] = evaluate_auto(merged)
    return merged


def _order(m: int, d: int, f: int) -> tuple:
    """The grid's order: shape-major, smallest D·F first (as ``grid_shapes``), then M."""
    return d * f, d, f, m


def missing_points(result: dict) -> list[Dims]:
    """Planned points with no record: a chunk stopped before them (its limit, a crash)."""
    done = {(p["M"], p["D"], p["F"]) for p in (*result["points"], *result["skipped_points"])}
    return [tuple(p) for p in result["meta"]["planned_points"] if tuple(p) not in done]


def _check_part(part: object, source: str) -> None:
    """A ``bench-grid --json`` result, or a ValueError naming the file and what is off."""
    if not isinstance(part, dict):
        raise ValueError(
            f"{source}: expected a bench-grid --json result, got {type(part).__name__}"
        )
    missing = sorted({"meta", "points", "rows", "skipped_points"} - set(part))
    if missing:
        raise ValueError(f"{source}: not a bench-grid --json result: missing keys {missing}")
    # gemm_choices is recorded since bench-grid --pretune; older results ran the defaults
    needed = {*SAME_KEYS, "chunk", "planned_points", "shapes", "m", "complete"} - {"gemm_choices"}
    needed |= {"elapsed_s", "estimated_s"}
    missing = sorted(needed - set(part["meta"]))
    if missing:
        raise ValueError(f"{source}: not a bench-grid --json result: meta lacks {missing}")
