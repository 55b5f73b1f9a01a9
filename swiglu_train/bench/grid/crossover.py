"""The crossover table: where each impl wins, by time and by memory, over a grid of (M, D, F).

Every point is one ParMLP layer (O = D) measured with the harness of ``bench/mlp/run.py``:
paired samples in random order against the six-GEMM floor of the same shape, medians,
allocator readings, GPU and host time per step. Winners are marked by the rule auto is judged
by (``layers/auto_rule.py``); ``layers/auto_fit.py`` fits auto's cost model from the rows, as
from the model grid's.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from swiglu_train.bench.mlp.run import BenchConfig, measure_layer, one_layer_config
from swiglu_train.bench.results import environment
from swiglu_train.bench.timing import PEAK_DEFINITION
from swiglu_train.layers.auto import gpu_family
from swiglu_train.layers.auto_rule import TIE_TOLERANCE, ImplStats, measured_pick
from swiglu_train.layers.registry import PORTABLE_IMPLS, QUACK_IMPLS
from swiglu_train.ops.quack_mlp import quack_available


def default_impls() -> tuple[str, ...]:
    """Every impl that runs here: the quack impls join where quack runs."""
    return (*PORTABLE_IMPLS, *sorted(QUACK_IMPLS)) if quack_available() else PORTABLE_IMPLS


Point = tuple[int, int, int]  # (M, D, F)
Progress = Callable[[str, int], Callable[[], None]]


@dataclass
class CrossoverConfig:
    m: Sequence[int]
    shapes: Sequence[tuple[int, int]]  # (D, F) pairs
    samples: int = 30
    warmup: int = 2
    dtype: str = "bf16"
    device: str = "cuda"
    seed: int = 0
    commit: str | None = None
    impls: Sequence[str] = field(default_factory=default_impls)

    def points(self) -> list[Point]:
        """Shape-major, so the largest (D, F) runs last, after everything else is on record."""
        return [(m, d, f) for d, f in self.shapes for m in self.m]

    def bench_config(self, point: Point) -> BenchConfig:
        return one_layer_config(point, self.impls, self)


def parse_m(value: str) -> tuple[int, ...]:
    """``"2048,4096"`` -> (2048, 4096); a ValueError says what is wrong."""
    try:
        ms = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"--m {value!r}: expected comma-separated integers") from None
    if not ms or min(ms) < 1:
        raise ValueError(f"--m {value!r}: expected positive token counts")
    return ms


def parse_shapes(value: str) -> tuple[tuple[int, int], ...]:
    """``"2048x5632,4096x11008"`` -> ((2048, 5632), (4096, 11008))."""
    shapes = []
    for item in (v.strip() for v in value.split(",") if v.strip()):
        parts = item.lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--shapes: {item!r} is not DxF with positive integers")
        shapes.append((int(parts[0]), int(parts[1])))
    if not shapes:
        raise ValueError("--shapes: give at least one DxF pair")
    return tuple(shapes)


def point_rows(point: Point, measured: Sequence[dict]) -> list[dict]:
    """Crossover rows of one point from ``measure_layer``'s rows (the floor's first)."""
    m, d, f = point
    floor = next(r for r in measured if r["variant"] == "floor")
    rows = [
        {
            "M": m,
            "D": d,
            "F": f,
            "impl": r["variant"],
            "ms": r["full_ms"],
            "ratio_to_floor": r["full_over_floor"],
            "gpu_ms": r["gpu_ms"],
            "host_ms": r["host_ms"],
            "floor_ms": floor["full_ms"],
            "after_forward_MiB": r["after_forward_MiB"],
            "peak_MiB": r["peak_MiB"],
            "rel_err_vs_reference": r["rel_err_vs_reference"],
        }
        for r in measured
        if r["variant"] != "floor"
    ]
    mark_winners(rows)
    return rows


def mark_winners(rows: list[dict]) -> None:
    """Flag, within one point, the fastest impl, the least after-forward memory, and the
    measured rule's choice (``auto_rule``). Off CUDA there is no memory reading: nothing
    is least, and the rule's choice is the fastest."""
    fastest = min(rows, key=lambda r: r["ratio_to_floor"])["impl"]
    if all(r["after_forward_MiB"] is not None for r in rows):
        least = min(rows, key=lambda r: r["after_forward_MiB"])["impl"]
        chosen = measured_pick({r["impl"]: _stats(r) for r in rows})
    else:
        least, chosen = None, fastest
    for r in rows:
        r["fastest"], r["least_memory"] = r["impl"] == fastest, r["impl"] == least
        r["rule_choice"] = r["impl"] == chosen


def _stats(row: dict) -> ImplStats:
    return ImplStats(row["ratio_to_floor"], row["after_forward_MiB"])


def run_crossover(cfg: CrossoverConfig, progress: Progress) -> dict:
    """Measure every point; a point or impl that fails (out of memory) is skipped on record."""
    device = torch.device(cfg.device)
    start = time.perf_counter()
    rows: list[dict] = []
    skipped: list[dict] = []
    tick = progress("crossover points", len(cfg.points()))
    for point in cfg.points():
        measured: list[dict] = []
        failed: dict[str | None, str] = {}
        try:
            measured, failed, _ = measure_layer(cfg.bench_config(point), _quiet)
        except torch.OutOfMemoryError as e:
            failed = {None: f"failed: OutOfMemoryError: {e}"}  # the whole point
        _release(device)  # the next shape starts from an empty cache, not a fragmented one
        tick()
        skipped += [_skip(point, impl, why) for impl, why in failed.items()]
        if len(measured) > 1:  # the floor and at least one impl
            rows += point_rows(point, measured)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    meta = {
        **environment(device, cfg.commit),
        "gpu_family": gpu_family(name) if name else None,
        "dtype": cfg.dtype,
        "samples": cfg.samples,
        "warmup": cfg.warmup,
        "seed": cfg.seed,
        "m": list(cfg.m),
        "shapes": [list(s) for s in cfg.shapes],
        "impls": list(cfg.impls),
        "peak_definition": PEAK_DEFINITION,
        "winner_rule": "fastest by median paired ratio to the floor; among impls within "
        f"{TIE_TOLERANCE:.0%} of it, least after-forward memory (layers/auto_rule.py)",
        "elapsed_s": round(time.perf_counter() - start, 1),
    }
    return {"meta": meta, "rows": rows, "skipped": skipped}


def _quiet(label: str, total: int) -> Callable[[], None]:
    return lambda: None


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _skip(point: Point, impl: str | None, why: str) -> dict:
    m, d, f = point
    return {"M": m, "D": d, "F": f, "impl": impl, "reason": why.splitlines()[0]}


def _by_point(rows: Sequence[dict]) -> dict[Point, dict[str, dict]]:
    points: dict[Point, dict[str, dict]] = {}
    for r in rows:
        points.setdefault((r["M"], r["D"], r["F"]), {})[r["impl"]] = r
    return points


def to_markdown(result: dict) -> str:
    """One line per point: each impl's ratio to the floor and after-forward MiB, the winners."""
    names = result["meta"]["impls"]
    lines = [
        f"| M | D | F | floor ms | {' | '.join(names)} | fastest | least memory | rule's pick |",
        "|---" * (7 + len(names)) + "|",
    ]
    for (m, d, f), impls in _by_point(result["rows"]).items():
        cells = [_cell(impls.get(name)) for name in names]
        winner = {
            flag: next((n for n, r in impls.items() if r[flag]), "—")
            for flag in ("fastest", "least_memory", "rule_choice")
        }
        floor_ms = next(iter(impls.values()))["floor_ms"]
        lines.append(
            f"| {m} | {d} | {f} | {floor_ms:.3f} | {' | '.join(cells)} | {winner['fastest']} "
            f"| {winner['least_memory']} | {winner['rule_choice']} |"
        )
    if result["skipped"]:
        lines.append("")
    for s in result["skipped"]:
        what = s["impl"] or "every impl"
        lines.append(f"- skipped M={s['M']} D={s['D']} F={s['F']}, {what}: {s['reason']}")
    return "\n".join(lines) + "\n"


def _cell(row: dict | None) -> str:
    if row is None:
        return "—"
    memory = row["after_forward_MiB"]
    return f"{row['ratio_to_floor']:.3f}x" + ("" if memory is None else f", {memory:.0f} MiB")
