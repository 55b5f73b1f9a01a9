"""The inference benchmark: the gated projection and the whole MLP, from decode to prefill M.

Timing. Each variant is captured in a CUDA graph that calls it ``reps`` times, cycling over
copies of the weights so that they stream from HBM, as in a model whose layers do not share
weights, rather than sitting in L2. Host overhead is thus excluded for every variant alike. A
sample replays every variant's graph once, in a fresh random order (paired), timed with CUDA
events (``bench.timing``); per-call medians over samples, ratios taken per sample before the
median. On CPU (smoke runs, tests) a plain loop stands in for the graph.

Correctness. Each variant's output is compared with its table's eager reference; one whose
norm-relative error exceeds REL_ERR_LIMIT is reported as rejected and never timed.

Dispatch. :func:`fit_dispatch` turns the rows into the table that ``ops.dispatch`` reads: the
fastest dispatch candidate at each measured shape and M (``--dispatch-table`` writes it).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

from swiglu_train.bench.inference import variants as iv
from swiglu_train.bench.inference.dispatch import NEAR_TIE, fit_dispatch, judge_dispatch
from swiglu_train.bench.results import DTYPES, git_commit
from swiglu_train.bench.timing import Case, Clock, paired_samples
from swiglu_train.ops import inference

QWEN_MLP = {"0.5b": (896, 4864), "7b": (3584, 18944), "32b": (5120, 27648), "72b": (8192, 29568)}
M_GRID = (1, 16, 128, 512, 2048, 4096)
REL_ERR_LIMIT = {"bf16": 1e-2, "fp16": 2e-3, "fp32": 1e-4}  # a few roundings of the output
TARGET_REPLAY_MS = 2.0  # enough calls per graph that event resolution does not matter
MAX_REPS = 128
MAX_WEIGHT_COPIES = 8


@dataclass
class InferenceBenchConfig:
    models: Sequence[str] = tuple(QWEN_MLP)
    ms: Sequence[int] = M_GRID
    samples: int = 30
    variants: Sequence[str] | None = None  # None: all; the eager references always run
    dtype: str = "bf16"
    device: str = "cuda"
    seed: int = 0


def parse_model(name: str) -> tuple[int, int]:
    """(D, F) of a Qwen-2.5 size ("7b") or of a literal "DxF" ("896x4864")."""
    if name in QWEN_MLP:
        return QWEN_MLP[name]
    # [0-9], not \d: int() reads digits of any script (as the dispatch table's keys say)
    match = re.fullmatch(r"([1-9][0-9]*)x([1-9][0-9]*)", name)
    if not match:
        raise ValueError(
            f"unknown model {name!r}: use one of {list(QWEN_MLP)} or DxF with D, F positive"
        )
    return int(match[1]), int(match[2])


def weight_copies(d: int, f: int, dtype: torch.dtype, device: torch.device) -> list[iv.Weights]:
    """Enough identical copies that cycling through them overflows twice the L2 (one on CPU)."""
    first = iv.Weights.random(d, f, dtype, str(device))
    if device.type != "cuda":
        return [first]
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    layer_bytes = (first.fc1.numel() + first.fc2.numel()) * first.fc1.element_size()
    n = min(MAX_WEIGHT_COPIES, math.ceil(2 * l2 / layer_bytes))
    return [first] + [iv.Weights(first.fc1.clone(), first.fc2.clone()) for _ in range(n - 1)]


def choose_reps(ms_per_call: float, copies: int) -> int:
    """Calls per graph: a multiple of the copies, lasting about TARGET_REPLAY_MS."""
    rounds = math.ceil(TARGET_REPLAY_MS / max(ms_per_call * copies, 1e-6))
    return copies * max(1, min(rounds, MAX_REPS // copies))


def capture(call: Callable[[int], object], reps: int, device: torch.device) -> Callable[[], None]:
    """One replayable run of ``call(0) .. call(reps - 1)``: a CUDA graph, or a loop on CPU."""
    if device.type != "cuda":

        def loop() -> None:
            for i in range(reps):
                call(i)

        return loop
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # lazy initialisations (cuBLAS workspaces) before capture
        call(0)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            call(i)
    return graph.replay


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def call_ms(fn: Callable[[], object], device: torch.device, calls: int = 3) -> float:
    clock = Clock(device)
    clock.sync()
    start = clock.mark()
    for _ in range(calls):
        fn()
    end = clock.mark()
    clock.sync()
    return clock.ms(start, end) / calls


def measure(
    table: str,
    model: str,
    m: int,
    variants: dict[str, iv.Variant],
    copies: list[iv.Weights],
    cfg: InferenceBenchConfig,
    skipped: dict[str, str],
) -> dict:
    """One row: check, capture and time every variant of ``table`` at this shape."""
    device, w = torch.device(cfg.device), copies[0]
    x = torch.randn(m, w.fc1.shape[1], device=device, dtype=DTYPES[cfg.dtype])
    reference_name = iv.EAGER[table][0]
    expected = variants[reference_name](x, w)
    reps = 1  # CPU: a smoke run, where interpreted kernels are 1000x slower than eager
    if device.type == "cuda":
        reps = choose_reps(call_ms(lambda: variants[reference_name](x, w), device), len(copies))
    errors, replays, skipped = {}, {}, dict(skipped)
    for name, fn in variants.items():
        if name == "fused_mlp" and m > iv.FUSED_MLP_MAX_BENCH_M:
            skipped[name] = f"M > {iv.FUSED_MLP_MAX_BENCH_M}: not the fused kernel's regime"
            continue
        try:
            out = fn(x, w)  # first call compiles and autotunes
            if name not in iv.FLOORS:
                errors[name] = rel_err(out, expected)
                if not errors[name] <= REL_ERR_LIMIT[cfg.dtype]:
                    skipped[name] = f"rejected: rel err {errors[name]:.3g} vs {reference_name}"
                    continue
            replays[name] = capture(lambda i, fn=fn: fn(x, copies[i % len(copies)]), reps, device)
        except Exception as e:  # a broken peer is reported, not allowed to sink the run
            skipped[name] = f"failed: {type(e).__name__}: {e}"
    cases = [Case(n, r, lambda _: None, lambda: None) for n, r in replays.items()]
    times = paired_samples(cases, cfg.samples, device, cfg.seed)
    per_call = {name: t["fwd"] / reps for name, t in times.items()}
    row = build_row(table, model, m, w.fc1.shape[1], w.ffn, per_call, errors, skipped)
    row.update(reps=reps, weight_copies=len(copies))
    if table == "mlp":
        row["ours_path"] = inference.inference_path(x, w.fc1, w.fc2, None)
    else:
        row["ours_path"] = inference.projection_path(x, w.fc1, None)
    return row


def build_row(
    table: str,
    model: str,
    m: int,
    d: int,
    f: int,
    times: dict[str, np.ndarray],
    errors: dict[str, float],
    skipped: dict[str, str],
) -> dict:
    """Medians per variant, and paired ratios: ``X_speedup_vs_eager`` = eager / X per sample,
    with eager the faster (by median) of the table's eager variants; ``ours_over_gemm_only``."""
    row: dict = {"table": table, "model": model, "M": m, "K": d, "N": f}
    medians = {name: float(np.median(t)) for name, t in times.items()}
    row.update({f"{name}_ms": v for name, v in medians.items()})
    row.update({f"{name}_rel_err": e for name, e in errors.items()})
    timed_eager = [n for n in iv.EAGER[table] if n in times]
    if not timed_eager:
        raise RuntimeError(f"{table} {model} M={m}: the eager reference did not run: {skipped}")
    eager = min(timed_eager, key=medians.get)
    row["eager_ms"], row["eager_variant"] = medians[eager], eager
    for name, t in times.items():
        if name not in iv.EAGER[table]:
            row[f"{name}_speedup_vs_eager"] = float(np.median(times[eager] / t))
    if "ours" in times and "gemm_only" in times:
        row["ours_over_gemm_only"] = float(np.median(times["ours"] / times["gemm_only"]))
    row["skipped"] = skipped
    return row


def run_inference_bench(
    cfg: InferenceBenchConfig, progress: Callable[[str, int], Callable[[], None]]
) -> dict:
    """Both tables over the model x M grid; ``progress(label, total)`` returns a tick."""
    device, dtype = torch.device(cfg.device), DTYPES[cfg.dtype]
    models = {name: parse_model(name) for name in cfg.models}
    torch.manual_seed(cfg.seed)
    started, rows = time.perf_counter(), []
    tick = progress("inference bench", len(models) * len(iv.TABLES) * len(cfg.ms))
    dynamo = torch._dynamo.config.patch(
        recompile_limit=len(cfg.ms) + 2, fail_on_recompile_limit_hit=True
    )  # one compiled graph per M: never fall back to eager silently
    with torch.inference_mode(), dynamo:
        for model, (d, f) in models.items():
            torch._dynamo.reset()  # each model compiles afresh, within the limit
            copies = weight_copies(d, f, dtype, device)
            for table in iv.TABLES:
                variants, skipped = build_variants(table, cfg.variants)
                for m in cfg.ms:
                    rows.append(measure(table, model, m, variants, copies, cfg, skipped))
                    tick()
            del copies
    return {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "commit": git_commit(),
        "meta": _meta(cfg, time.perf_counter() - started),
        "rows": rows,
        "dispatch": (fitted := fit_dispatch(rows)),
        "dispatch_judged_in_sample": judge_dispatch(rows, fitted),
    }


def build_variants(
    table: str, names: Sequence[str] | None
) -> tuple[dict[str, iv.Variant], dict[str, str]]:
    """The table's variants (its eager references always), and the peers that did not import."""
    variants, skipped = {}, {}
    for name, build in iv.TABLES[table].items():
        if names is not None and name not in names and name not in iv.EAGER[table]:
            continue
        try:
            variants[name] = build()
        except ImportError as e:
            skipped[name] = f"not importable: {e}"
    return variants, skipped


def _meta(cfg: InferenceBenchConfig, elapsed_s: float) -> dict:
    versions = {}
    for pkg in ("torch", "triton", "liger-kernel", "quack-kernels"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[pkg] = importlib.metadata.version(pkg)
    return {
        **asdict(cfg),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": versions,
        "compile": f"torch.compile(mode={iv.COMPILE_MODE!r}, dynamic=False), one graph per M",
        "timing": "CUDA graph of `reps` calls over `weight_copies` weight copies, replayed once "
        "per sample in random order; per-call medians",
        "rel_err_limit": REL_ERR_LIMIT[cfg.dtype],
        "elapsed_s": round(elapsed_s, 1),
    }


def to_markdown(result: dict) -> str:
    """Both tables (ms per call, the faster eager variant bold), skip reasons, the dispatch."""
    lines = []
    for table, title in (("gated", "fc1 + SwiGLU -> h"), ("mlp", "whole MLP")):
        rows = [r for r in result["rows"] if r["table"] == table]
        if not rows:
            continue
        names = [n for n in iv.TABLES[table] if any(f"{n}_ms" in r for r in rows)]
        extra = ["eager ÷ ours", "ours ÷ gemm_only", "ours path"]
        lines += [f"### {title} (ms per call)", ""]
        lines += ["| " + " | ".join(["model", "M", *names, *extra]) + " |"]
        lines += ["|" + "---|" * (2 + len(names) + len(extra))]
        for r in rows:
            cells = [r["model"], str(r["M"])]
            for n in names:
                cell = _num(r.get(f"{n}_ms"))
                cells.append(f"**{cell}**" if n == r["eager_variant"] else cell)
            cells += [_num(r.get("ours_speedup_vs_eager")), _num(r.get("ours_over_gemm_only"))]
            cells.append(r.get("ours_path", "—"))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    reasons: dict[tuple[str, str, str], int] = {}
    for r in result["rows"]:
        for name, reason in r["skipped"].items():
            key = (r["table"], name, reason)
            reasons[key] = reasons.get(key, 0) + 1
    lines += [f"- {t}/{n} skipped at {c} shape(s): {why}" for (t, n, why), c in reasons.items()]
    if result.get("dispatch"):
        lines += ["", "Dispatch: the chosen candidate at each M, the fastest or, within "
                  f"{NEAR_TIE:.2f}x of it, the one with fewest launches (runner-up: its ms over "
                  "the chosen one's)"]  # fmt: skip
    for shape, by_table in result.get("dispatch", {}).items():
        for table, by_m in by_table.items():
            picks = [f"{m} {e['path']}{_margin(e)}" for m, e in by_m.items()]
            lines.append(f"- {shape} {table}: " + ", ".join(picks))
    judged = result.get("dispatch_judged_in_sample", {})
    if judged:
        lines += ["", "The table's choices, judged on the rows it was fit on (in-sample):"]
        lines += _judged_lines(judged)
    outside = result.get("dispatch_judged_out_of_sample")
    if outside:
        lines += ["", f"The table {outside['table']} (fit at {outside['table_commit']}), judged "
                  "on this run's rows (out of sample):"]  # fmt: skip
        lines += _judged_lines(outside["judged"])
    return "\n".join(lines) + "\n"


def _judged_lines(judged: dict) -> list[str]:
    lines = []
    for table, j in judged.items():
        slower = ", ".join(j["slower_than_eager_and_compile"]) or "none"
        gemm = ""
        if "max_over_gemm_only" in j:
            gemm = f" at most {j['max_over_gemm_only']:.3f}x the GEMMs alone"
            gemm += f" ({j['max_over_gemm_only_at']});"
        lines.append(
            f"- {table}: {j['rows']} rows; geomean {j['geomean_speedup_vs_eager']:.3f}x over "
            f"eager;{gemm} slower than the faster of eager and compile at: {slower}"
        )
    return lines


def _margin(entry: dict) -> str:
    if entry["runner_up"] is None:
        return ""
    return f" ({entry['runner_up']}: {entry['runner_up_ratio']:.2f}x)"


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:.4g}"
