"""drop_h_quack's row-GEMM tile rule (experts_quack.COOPERATIVE_MIN_DEPTH) judged on a config
sweep, leave one model out.

    python benchmarks/fit_moe_gemm_rule.py --sweep SWEEP.json --json OUT.json [--md OUT.md]

Runs on CPU, from sweep_moe_gemm_configs.py's timings. The rule gives a row GEMM (varlen_m:
fc1, fc2, grad_h, grad_xg) quack's cooperative 128 x 256 tile when it contracts over at least
a bound K, quack's default below. For each model of the sweep the bound is fitted on the other
models alone (the one of least summed log(picked / best), among the midpoints between swept K),
and the fitted rule picks that model's tiles: per point, the pick's time over the best config's
and over the default's. The shipped bound is judged on every point as well.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

from swiglu_train.bench.results import git_commit, write_result
from swiglu_train.ops.experts_quack import COOPERATIVE_MIN_DEPTH

ROW_GEMMS = ("fc1", "fc2", "grad_h", "grad_xg")
COOPERATIVE = "128x256-coop-2x1-static"
TWIN = "torch"  # the sweep's label for the torch._grouped_mm twin


def points(sweep: dict) -> list[dict]:
    """Per row GEMM of each (model, routing): its K and every config's time over the default."""
    default = sweep["default"]
    grouped: dict[tuple, dict] = defaultdict(lambda: {"configs": {}})
    for row in sweep["rows"]:
        if row["gemm"] not in ROW_GEMMS or row.get("failed") or row.get("over_default") is None:
            continue
        if row["config"] == TWIN:  # torch's GEMM on pre-gathered rows: not a quack config
            continue
        point = grouped[(row["model"], row["routing"], row["gemm"])]
        point |= {"model": row["model"], "routing": row["routing"], "gemm": row["gemm"]}
        point["K"] = row["K"]
        label = "default" if row["config"] == default else row["config"]
        point["configs"][label] = row["over_default"]
    return [
        p for p in grouped.values() if "default" in p["configs"] and COOPERATIVE in p["configs"]
    ]


def pick(point: dict, bound: float) -> str:
    return COOPERATIVE if point["K"] >= bound else "default"


def judged(point: dict, bound: float) -> dict:
    """The pick at ``bound`` over the best config's time and over the default's."""
    times = point["configs"]
    chosen = pick(point, bound)
    return {
        "model": point["model"], "routing": point["routing"], "gemm": point["gemm"],
        "K": point["K"], "pick": chosen, "bound": bound,
        "over_best": times[chosen] / min(times.values()), "over_default": times[chosen],
    }  # fmt: skip


def candidates(pts: list[dict]) -> list[float]:
    """Midpoints between the swept K, and one bound below and above them all."""
    ks = sorted({p["K"] for p in pts})
    return [ks[0] / 2, *((a + b) / 2 for a, b in itertools.pairwise(ks)), ks[-1] * 2]


def fit(pts: list[dict]) -> float:
    """The candidate bound of least summed log(picked / best); ties go to the lower bound."""
    return min(candidates(pts), key=lambda b: sum(math.log(judged(p, b)["over_best"]) for p in pts))


def summary(rows: list[dict]) -> dict:
    best, default = [r["over_best"] for r in rows], [r["over_default"] for r in rows]
    return {
        "points": len(rows),
        "median_over_best": statistics.median(best), "max_over_best": max(best),
        "median_over_default": statistics.median(default), "max_over_default": max(default),
    }  # fmt: skip


def evaluate(sweep: dict) -> dict:
    pts = points(sweep)
    held_out = []
    for model in sorted({p["model"] for p in pts}):
        bound = fit([p for p in pts if p["model"] != model])
        held_out += [judged(p, bound) for p in pts if p["model"] == model]
    shipped = [judged(p, COOPERATIVE_MIN_DEPTH) for p in pts]
    return {
        "sweep": {"gpu": sweep["gpu"], "commit": sweep["commit"], "command": sweep["command"]},
        "shipped_bound": COOPERATIVE_MIN_DEPTH,
        "bound_fitted_on_all": fit(pts),
        "leave_one_model_out": {"rows": held_out, "summary": summary(held_out)},
        "shipped": {"rows": shipped, "summary": summary(shipped)},
    }


def num(x: float) -> str:
    return f"{x:.3f}"


def to_markdown(result: dict) -> str:
    sweep = result["sweep"]
    lines = [
        f"### drop_h_quack's row-GEMM tile rule on {sweep['gpu']} (sweep {sweep['commit']})",
        "",
        f"Cooperative 128 x 256 from K >= the bound, quack's default below. Shipped bound "
        f"{result['shipped_bound']}; fitted on every point: {result['bound_fitted_on_all']:g}.",
        "",
        "| model | routing | gemm | K | bound (fitted without the model) | pick | ÷ best | "
        "÷ default |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["leave_one_model_out"]["rows"]:
        lines.append(
            f"| {r['model']} | {r['routing']} | {r['gemm']} | {r['K']} | {r['bound']:g} | "
            f"{r['pick']} | {num(r['over_best'])} | {num(r['over_default'])} |"
        )
    for name, key in (("leave one model out", "leave_one_model_out"), ("shipped", "shipped")):
        s = result[key]["summary"]
        lines.append(
            f"\n{name}: {s['points']} points, median {num(s['median_over_best'])}x the best "
            f"config (worst {num(s['max_over_best'])}x), median {num(s['median_over_default'])}x "
            f"the default (worst {num(s['max_over_default'])}x)."
        )
    lines.append(f"\nCommand: `{result['command']}`\n")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", required=True, help="sweep_moe_gemm_configs.py JSON")
    parser.add_argument("--json", required=True)
    parser.add_argument("--md")
    args = parser.parse_args()
    result = evaluate(json.loads(Path(args.sweep).read_text()))
    script = f"benchmarks/{Path(__file__).name}"
    result = write_result(
        script, {"commit": git_commit()} | result, args.json, args.md, to_markdown
    )
    s = result["leave_one_model_out"]["summary"]
    print(
        f"leave one model out: median {num(s['median_over_best'])}x best, worst "
        f"{num(s['max_over_best'])}x; median {num(s['median_over_default'])}x the default"
    )


if __name__ == "__main__":
    main()
