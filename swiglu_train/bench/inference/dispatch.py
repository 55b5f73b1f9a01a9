"""The no-grad dispatch table from inference-bench rows: fit, merged over split runs, judged.

``fit_dispatch`` picks, per shape and M, the fastest candidate path (``iv.CANDIDATES``), or
among near-ties the one with the fewest kernel launches;
``dispatch_table`` is the file ``ops.dispatch`` reads; ``merge_results`` joins runs split by
model (each within a device call's limit) and refits; ``judge_dispatch`` says what the table's
choices buy over eager, ``torch.compile`` and the GEMMs alone. That judgement is in-sample
(the table was fit on the same rows), so it is the best the table can do on those shapes;
a fresh run of ``ours`` with the table shipped is the out-of-sample check.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from swiglu_train.bench.inference import variants as iv
from swiglu_train.ops import dispatch

# Candidates within this of the fastest median are tied: at 0.5B's 8-16 us calls two runs put
# fused_mlp 1.3 % ahead of gated + cuBLAS, then 4 % behind (inference_oos_h200.json). The tie
# goes to fewer launches, which also cost host time wherever a model runs without CUDA graphs.
NEAR_TIE = 1.02


def fit_dispatch(rows: Sequence[dict]) -> dict[str, dict[str, dict[str, dict]]]:
    """Per "DxF", per table, per measured M: the fastest dispatch candidate by median ms, its ms,
    and the runner-up with ``runner_up_ratio`` = its ms over the winner's (the margin, below 1
    where a near-tie went to the slower median; None with one candidate). Candidates within
    NEAR_TIE of the fastest are tied, and the tie goes to the fewest kernel launches
    (``iv.LAUNCHES``), then the first candidate. Candidates that were not timed (not
    importable, rejected, failed) are not eligible; an M where none was timed gets no entry.
    A "quack" winner also records its ``fallback``, what this rule picks without quack (not
    the runner-up: quack's near-ties can leave out a path that ties the fallback); with no
    other timed, quack is not eligible (a machine without quack would have no path)."""
    shapes: dict[str, dict[str, dict[str, dict]]] = {}
    for r in sorted(rows, key=lambda r: (r["K"], r["N"], r["table"], r["M"])):
        candidates = iv.CANDIDATES[r["table"]].items()
        timed = {path: r[f"{name}_ms"] for path, name in candidates if f"{name}_ms" in r}
        if not set(timed) - {dispatch.QUACK}:  # nothing timed, or nothing to fall back to
            continue
        launches = iv.LAUNCHES[r["table"]]
        best, *others = _ranked(timed, launches)
        entry = {"path": best, "ms": _sig(timed[best]), "runner_up": None, "runner_up_ratio": None}
        if others:
            entry.update(runner_up=others[0], runner_up_ratio=_sig(timed[others[0]] / timed[best]))
        if best == dispatch.QUACK:
            entry["fallback"] = _ranked({p: timed[p] for p in others}, launches)[0]
        by_table = shapes.setdefault(f"{r['K']}x{r['N']}", {})
        by_table.setdefault(r["table"], {})[str(r["M"])] = entry
    return shapes


def _ranked(timed: dict[str, float], launches: dict[str, int]) -> list[str]:
    """Paths best first: the near-ties of the fastest by launches, then the rest by ms."""
    fastest = min(timed.values())

    def rank(path: str) -> tuple:
        tied = timed[path] <= NEAR_TIE * fastest
        return (not tied, launches[path] if tied else 0, timed[path])

    return sorted(timed, key=rank)


def dispatch_table(result: dict, source: str) -> dict:
    """The file ``ops.dispatch`` reads, validated before return; ship it as
    swiglu_train/ops/inference_dispatch_<gpu>.json."""
    table = {
        "schema": dispatch.SCHEMA,
        "gpu": result["gpu"],
        "commit": result["commit"],
        "dtype": result["meta"]["dtype"],
        "source": source,
        "command": result.get("command"),
        "shapes": result["dispatch"],
    }
    dispatch.DispatchTable.from_dict(table, "built from the inference run")
    return table


def _sig(value: float) -> float:
    """Four significant digits: enough to rank, short enough to read."""
    return float(f"{value:.4g}")


def merge_results(parts: Sequence[dict]) -> dict:
    """One result from runs split over models (each within a device call's time limit): rows
    concatenated and the dispatch refit over all of them. Parts must come from one GPU, dtype
    and commit, and no (table, model, M), nor (table, D, F, M) under two model names, may be
    measured twice: a merge never picks a sample."""
    if not parts:
        raise ValueError("nothing to merge")
    for i, part in enumerate(parts):
        _check_result(part, f"run {i + 1} of {len(parts)}")
    for key, get in (("gpu", lambda p: p["gpu"]), ("dtype", lambda p: p["meta"]["dtype"]),
                     ("commit", lambda p: p["commit"])):  # fmt: skip
        values = {get(p) for p in parts}
        if len(values) > 1:
            raise ValueError(f"cannot merge runs of different {key}s: {sorted(map(str, values))}")
    rows, seen, models = [], set(), {}
    for part in parts:
        for r in part["rows"]:
            key = (r["table"], r["model"], r["M"])
            if key in seen:
                raise ValueError(f"{key} is measured by more than one run")
            seen.add(key)
            shape = (r["table"], r["K"], r["N"], r["M"])  # "0.5b" and "896x4864" are one shape
            if models.setdefault(shape, r["model"]) != r["model"]:
                raise ValueError(
                    f"{r['table']} {r['K']}x{r['N']} at M={r['M']} is measured twice, as "
                    f"{models[shape]!r} and {r['model']!r}: the refit would keep only one of them"
                )
            rows.append(r)
    return {
        "gpu": parts[0]["gpu"],
        "commit": parts[0]["commit"],
        "meta": {**parts[0]["meta"], "parts": [p["meta"] for p in parts]},
        "command": " && ".join(str(p.get("command")) for p in parts),
        "rows": rows,
        "dispatch": (fitted := fit_dispatch(rows)),
        "dispatch_judged_in_sample": judge_dispatch(rows, fitted),
    }


def _check_result(part: object, where: str) -> None:
    """A ``bench-inference --json`` result, or a ValueError naming the run and what is off
    (a dispatch table or any other JSON passed by mistake would fail deep in the refit)."""
    problem = None
    if not isinstance(part, dict):
        problem = f"expected a bench-inference --json result (an object), got {type(part).__name__}"
    elif missing := sorted({"gpu", "commit", "meta", "rows"} - set(part)):
        problem = f"not a bench-inference --json result: missing keys {missing}"
    elif not isinstance(part["meta"], dict) or "dtype" not in part["meta"]:
        problem = "its meta has no dtype"
    elif not isinstance(part["rows"], list):
        problem = "its rows are not a list"
    else:
        for j, r in enumerate(part["rows"]):
            sizes_ok = isinstance(r, dict) and all(
                isinstance(r.get(k), int) and not isinstance(r.get(k), bool) and r[k] >= 1
                for k in ("M", "K", "N")
            )
            if not sizes_ok or r.get("table") not in iv.TABLES or "model" not in r:
                problem = (
                    f"rows[{j}] is not a bench row (table in {list(iv.TABLES)}, model, "
                    "and positive M, K, N)"
                )
                break
    if problem is not None:
        raise ValueError(f"{where}: {problem}")


def judge_dispatch(rows: Sequence[dict], fitted: dict, annotate: bool = True) -> dict[str, dict]:
    """Per table: the fitted choice's geometric-mean speedup over eager (paired medians), its
    worst ratio to the GEMMs alone, and the shapes where it is slower than the faster of eager
    and torch.compile (by medians). With ``annotate`` rows gain ``dispatched_*`` fields."""
    judged: dict[str, dict] = {}
    for r in rows:
        entry = fitted.get(f"{r['K']}x{r['N']}", {}).get(r["table"], {}).get(str(r["M"]))
        if entry is None:
            continue
        variant = iv.CANDIDATES[r["table"]][entry["path"]]
        where = f"{r['model']} M={r['M']}"
        if f"{variant}_ms" not in r:  # out of sample: the pick was skipped or failed in this run
            raise ValueError(
                f"the table picks {entry['path']} for {r['table']} {r['K']}x{r['N']} at {where}, "
                "which this run did not time"
            )
        ms = r[f"{variant}_ms"]
        baseline = min(r[k] for k in ("eager_ms", "compile_ms") if k in r)
        speedup = r[f"{variant}_speedup_vs_eager"]
        if annotate:
            r.update(dispatched_path=entry["path"], dispatched_ms=ms,
                     dispatched_speedup_vs_eager=speedup,
                     dispatched_over_best_baseline=ms / baseline)  # fmt: skip
        j = judged.setdefault(r["table"], {"rows": 0, "log_speedup": 0.0, "slower": []})
        j["rows"] += 1
        j["log_speedup"] += math.log(speedup)
        if ms > baseline:
            j["slower"].append(f"{where}: {ms / baseline:.3f}x")
        if "gemm_only_ms" in r:
            over_gemm = ms / r["gemm_only_ms"]
            if annotate:
                r["dispatched_over_gemm_only"] = over_gemm
            if over_gemm > j.get("max_over_gemm_only", 0.0):
                j["max_over_gemm_only"] = _sig(over_gemm)
                j["max_over_gemm_only_at"] = where
    for j in judged.values():
        j["geomean_speedup_vs_eager"] = _sig(math.exp(j.pop("log_speedup") / j["rows"]))
        j["slower_than_eager_and_compile"] = j.pop("slower")
    return judged


def judge_table(result: dict, table: dict, source: str) -> dict:
    """A shipped dispatch table judged on another run's rows (out of sample): every row takes
    the path ``ops.dispatch`` would give it with this table (the nearest measured shape and M,
    a quack entry's fallback where this run did not time quack), so a run at other shapes or
    M is judged too, rather than only at (shape, M) pairs the table has an entry for."""
    parsed = dispatch.DispatchTable.from_dict(table, source)
    if table["gpu"] != result["gpu"] or table["dtype"] != result["meta"]["dtype"]:
        raise ValueError(
            f"{source} was fit on {table['gpu']} {table['dtype']}; this run is "
            f"{result['gpu']} {result['meta']['dtype']}"
        )
    picks: dict[str, dict[str, dict[str, dict]]] = {}
    with dispatch.use_table(parsed):
        for r in result["rows"]:
            quack = f"{iv.CANDIDATES[r['table']][dispatch.QUACK]}_ms" in r
            path = dispatch.choose(r["table"], r["K"], r["N"], r["M"], lambda q=quack: q)
            by_m = picks.setdefault(f"{r['K']}x{r['N']}", {}).setdefault(r["table"], {})
            by_m[str(r["M"])] = {"path": path}
    judged = judge_dispatch(result["rows"], picks, annotate=False)
    return {"table": source, "table_commit": table["commit"], "judged": judged}
