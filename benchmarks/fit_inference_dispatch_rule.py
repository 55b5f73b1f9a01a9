"""A bandwidth rule for the no-grad dispatch against the measured table, leave one model out.

    python benchmarks/fit_inference_dispatch_rule.py --results RUN.json [--judge OTHER.json ...]
        [--ridge 186] --json OUT.json [--md OUT.md]

Runs on CPU, from ``swiglu-train bench-inference`` results (each row times every candidate path
of one kind, "gated" for h alone or "mlp" for the whole MLP, at one (model, M)). The rule:

  fused_mlp   up to ``fused_max_m`` rows (mlp only; 0: never);
  gated       up to ``small_m_per_ridge`` x the ridge: the step is bound by reading W1 (and
              W2), which the gated GEMM's 16-row streaming tiles do near HBM speed;
  quack       beyond, where MMA efficiency decides and quack's GEMM is the best we have;
  cublas      beyond, where quack cannot serve (the fallback).

The ridge is the GPU's GEMM FLOP/s over its HBM bytes/s: the M at which a bf16 GEMM's FLOPs take
as long as reading its weights (2 FLOPs and 2 bytes per weight per row). D and F do not enter:
no measured choice depends on them beyond noise (see the report). For each model the rule's two
constants are fitted on the other models alone (grid search for the least summed log(chosen /
best), ties to the middle of the tied values); so is the table (``ops.dispatch``'s nearest-shape
lookup over the other models' entries). Per point: the chosen path's time over the best path's,
with quack and without it (then the best of the other paths; a table's entry's fallback).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from swiglu_train.bench.inference.variants import CANDIDATES
from swiglu_train.bench.results import git_commit, write_result
from swiglu_train.ops import dispatch

# H200: auto_h200.json's six-GEMM floor (799.55 TFLOP/s) over a 4 GiB device copy (4.30 TB/s,
# benchmarks/results/activation/activation_bandwidth_h200.json)
H200_RIDGE = 799.55 / 4.30
PER_RIDGE = [round(0.02 * 1.1**i, 4) for i in range(50)]  # 0.02 .. 2.1: M 4 .. 390 on the H200
FUSED_MAX_M = (0, 1, 16)
MEDIAN_BAR, WORST_BAR = 1.02, 1.05  # what the rule must meet, out of sample, to replace the table


@dataclass(frozen=True)
class Rule:
    """The candidate rule; ``small_m_per_ridge`` x ridge is the last M the gated GEMM takes."""

    small_m_per_ridge: float
    fused_max_m: int

    def choose(self, kind: str, m: int, ridge: float, quack: bool) -> str:
        if kind == "mlp" and m <= self.fused_max_m:
            return "fused_mlp"
        if m <= self.small_m_per_ridge * ridge:
            return "gated"
        return "quack" if quack else "cublas"


def points(result: dict) -> list[dict]:
    """Per row: kind, model, M, D, F and each candidate path's ms."""
    out = []
    for r in result["rows"]:
        ms = {p: r[f"{n}_ms"] for p, n in CANDIDATES[r["table"]].items() if r.get(f"{n}_ms")}
        out.append({"kind": r["table"], "model": r["model"], "M": r["M"], "D": r["K"],
                    "F": r["N"], "ms": ms})  # fmt: skip
    return out


def over_best(p: dict, path: str, quack: bool) -> float:
    """The path's time over the best path's, with quack raced or not."""
    timed = {k: v for k, v in p["ms"].items() if quack or k != dispatch.QUACK}
    return timed[path] / min(timed.values())


def table_choice(table: dict, quack: bool) -> Callable[[dict], str]:
    """The shipped lookup (nearest shape in log D, log F, nearest M in log M) over ``table``."""

    def choose(p: dict) -> str:
        with dispatch.use_table(table):
            return dispatch.choose(p["kind"], p["D"], p["F"], p["M"], lambda: quack)

    return choose


def default_choice(quack: bool) -> Callable[[dict], str]:
    """The rules that apply where no table entry exists (dispatch.default_path; no quack)."""
    return lambda p: dispatch.default_path(p["kind"], p["M"])


def rule_choice(rule: Rule, ridge: float, quack: bool) -> Callable[[dict], str]:
    return lambda p: rule.choose(p["kind"], p["M"], ridge, quack)


def loss(choose: Callable[[dict], str], pts: list[dict], quack: bool) -> float:
    return sum(math.log(over_best(p, choose(p), quack)) for p in pts)


def fit(train: list[dict], ridge: float) -> Rule:
    """The grid's rule with the least summed log(chosen / best), with quack and without; each
    constant the middle of its tied values (the measured Ms bracket a crossover, never pin it)."""
    losses = {
        Rule(c, f): sum(loss(rule_choice(Rule(c, f), ridge, q), train, q) for q in (True, False))
        for c in PER_RIDGE
        for f in FUSED_MAX_M
    }
    least = min(losses.values())
    tied = [r for r, v in losses.items() if v <= least + 1e-9]
    fused_values = sorted({r.fused_max_m for r in tied})
    fused = fused_values[(len(fused_values) - 1) // 2]
    per_ridge = [r.small_m_per_ridge for r in tied if r.fused_max_m == fused]
    return Rule(round(math.sqrt(min(per_ridge) * max(per_ridge)), 4), fused)


def table_of(result: dict, models: set[str]) -> dict:
    """The run's dispatch table restricted to the shapes of ``models``."""
    shapes = {f"{p['D']}x{p['F']}" for p in points(result) if p["model"] in models}
    header = {k: result[k] for k in ("gpu", "commit")} | {
        "schema": dispatch.SCHEMA,
        "dtype": "bf16",
    }
    return header | {"shapes": {s: e for s, e in result["dispatch"].items() if s in shapes}}


def judged(pts: list[dict], choose_by: Callable[[bool], Callable[[dict], str]]) -> list[dict]:
    rows = []
    for p in pts:
        row = {"kind": p["kind"], "model": p["model"], "M": p["M"]}
        for quack, tag in ((True, ""), (False, "_no_quack")):
            path = choose_by(quack)(p)
            row[f"path{tag}"] = path
            row[f"over_best{tag}"] = round(over_best(p, path, quack), 4)
        rows.append(row)
    return rows


def summary(rows: list[dict]) -> dict:
    out = {"points": len(rows)}
    for tag in ("", "_no_quack"):
        over = [r[f"over_best{tag}"] for r in rows]
        worst = max(rows, key=lambda r: r[f"over_best{tag}"])
        out |= {f"median{tag}": round(statistics.median(over), 4),
                f"geomean{tag}": round(math.exp(statistics.fmean(map(math.log, over))), 4),
                f"max{tag}": max(over), f"max_at{tag}": f"{worst['kind']} {worst['model']} "
                f"M={worst['M']}", f"within_2pct{tag}": sum(o <= 1.02 for o in over)}  # fmt: skip
    return out


def rerun_spread(a: dict, b: dict) -> dict:
    """How far two runs disagree on one path at one point: the noise a choice must clear."""
    other = {(p["kind"], p["model"], p["M"]): p["ms"] for p in points(b)}
    gaps = [abs(math.log(v / other[k][n])) for p in points(a)
            if (k := (p["kind"], p["model"], p["M"])) in other
            for n, v in p["ms"].items() if n in other[k]]  # fmt: skip
    if not gaps:
        return {"paths": 0}
    return {"paths": len(gaps), "median": round(math.expm1(statistics.median(gaps)), 4),
            "max": round(math.expm1(max(gaps)), 4)}  # fmt: skip


def evaluate(result: dict, others: list[dict], ridge: float) -> dict:
    pts = points(result)
    models = sorted(
        {p["model"] for p in pts}, key=lambda m: min(p["D"] for p in pts if p["model"] == m)
    )
    rule_rows, table_rows, fitted = [], [], {}
    for model in models:
        train = [p for p in pts if p["model"] != model]
        test = [p for p in pts if p["model"] == model]
        rule = fit(train, ridge)
        fitted[model] = asdict(rule)
        rule_rows += judged(test, lambda q, rule=rule: rule_choice(rule, ridge, q))
        table = table_of(result, set(models) - {model})
        table_rows += judged(test, lambda q, table=table: table_choice(table, q))
    full = fit(pts, ridge)
    table = table_of(result, set(models))
    judge = []
    for o in others:
        opts = points(o)
        judge.append(
            {
                "run": o["commit"],
                "rerun_spread": rerun_spread(result, o),
                "rule": summary(judged(opts, lambda q: rule_choice(full, ridge, q))),
                "table": summary(judged(opts, lambda q: table_choice(table, q))),
            }
        )
    in_sample = {"rule": summary(judged(pts, lambda q: rule_choice(full, ridge, q))),
                 "table": summary(judged(pts, lambda q: table_choice(table, q))),
                 "defaults": summary(judged(pts, default_choice))}  # fmt: skip
    s = summary(rule_rows)
    ships = all(
        s[f"median{t}"] <= MEDIAN_BAR and s[f"max{t}"] <= WORST_BAR for t in ("", "_no_quack")
    )
    run = {k: result[k] for k in ("gpu", "commit", "command")}
    return {"ridge": round(ridge, 1), "ships": ships, "run": run,
            "fitted_on_all": asdict(full), "fitted_without": fitted,
            "leave_one_model_out": {"rule": {"rows": rule_rows, "summary": summary(rule_rows)},
                                    "table": {"rows": table_rows, "summary": summary(table_rows)}},
            "in_sample": in_sample, "judged": judge}  # fmt: skip


def num(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def line(name: str, s: dict) -> str:
    return (f"| {name} | {s['points']} | {num(s['median'])} | {num(s['geomean'])} | "
            f"{num(s['max'])} ({s['max_at']}) | {s['within_2pct']} | {num(s['median_no_quack'])} | "
            f"{num(s['max_no_quack'])} ({s['max_at_no_quack']}) |")  # fmt: skip


def to_markdown(result: dict) -> str:
    lomo = result["leave_one_model_out"]
    head = (
        "| choice | points | median ÷ best | geomean | worst | within 2 % | "
        "median ÷ best, no quack | worst, no quack |",
        "|---|---|---|---|---|---|---|---|",
    )
    lines = [f"### Inference dispatch: bandwidth rule vs measured table ({result['run']['gpu']}, "
             f"ridge {result['ridge']} rows, run {result['run']['commit']})", "",
             f"`{result['command']}`", "",
             f"Fitted on all models: {result['fitted_on_all']}; without each model: "
             f"{result['fitted_without']}.", "", "Leave one model out:", "", *head,
             line("rule", lomo["rule"]["summary"]), line("table (nearest other shape)",
             lomo["table"]["summary"]), "", "In sample:", "", *head]  # fmt: skip
    lines += [line(name, s) for name, s in result["in_sample"].items()]
    verdict = "yes" if result["ships"] else "no"
    lines += ["", f"Ships in place of the table: {verdict} (the bar: leave one model out,"
              f" median within {MEDIAN_BAR}x and no point past {WORST_BAR}x the "
              "best, with quack and without)."]  # fmt: skip
    for j in result["judged"]:
        spread = j["rerun_spread"]
        fitted_on = result["run"]["commit"]
        lines += ["", f"Run {j['run']} judged under the choices fitted on {fitted_on} "
                  f"(the two runs disagree on one path at one point by {spread.get('median')} "
                  f"median, up to {spread.get('max')}, over {spread['paths']} paths):", "", *head,
                  line("rule", j["rule"]), line("table", j["table"])]  # fmt: skip
    lines += [
        "",
        "Per point, leave one model out (path chosen, its time ÷ the best; no quack):",
        "",
        "| kind | model | M | rule | ÷ best | table | ÷ best | rule, no quack | ÷ best | "
        "table, no quack | ÷ best |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r, t in zip(lomo["rule"]["rows"], lomo["table"]["rows"], strict=True):
        lines.append(f"| {r['kind']} | {r['model']} | {r['M']} | {r['path']} | "
                     f"{num(r['over_best'])} | {t['path']} | {num(t['over_best'])} | "
                     f"{r['path_no_quack']} | {num(r['over_best_no_quack'])} | "
                     f"{t['path_no_quack']} | {num(t['over_best_no_quack'])} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", required=True, help="bench-inference JSON to fit on")
    parser.add_argument("--judge", nargs="*", default=[], help="other runs, judged only")
    parser.add_argument("--ridge", type=float, default=H200_RIDGE,
                        help="the measured GPU's GEMM FLOP/s over HBM bytes/s")  # fmt: skip
    parser.add_argument("--json", required=True)
    parser.add_argument("--md")
    args = parser.parse_args()
    others = [json.loads(Path(p).read_text()) for p in args.judge]
    result = evaluate(json.loads(Path(args.results).read_text()), others, args.ridge)
    script = f"benchmarks/{Path(__file__).name}"
    result = write_result(
        script, {"commit": git_commit()} | result, args.json, args.md, to_markdown
    )
    lomo = result["leave_one_model_out"]
    for name in ("rule", "table"):
        s = lomo[name]["summary"]
        print(f"leave one model out, {name}: median {num(s['median'])}x best, worst "
              f"{num(s['max'])}x ({s['max_at']}); no quack: median {num(s['median_no_quack'])}x, "
              f"worst {num(s['max_no_quack'])}x ({s['max_at_no_quack']})")  # fmt: skip


if __name__ == "__main__":
    main()
