"""The gated GEMM's tile rule (gated_tiles.TileRule) judged on a config sweep, leave one shape out.

    python benchmarks/fit_gated_tile_rule.py --sweep SWEEP.json [--judge OTHER.json ...]
        [--sms 132] --json OUT.json [--md OUT.md]

Runs on CPU, from sweep_gated_configs.py's timings. For each (K, F) of the sweep the rule's
constants (min_fill, stream_n, stream_stages) are fitted on the other shapes alone, by grid
search for the least summed log(picked / best), and the fitted rule picks that shape's tiles:
per point, the pick's time over the best config's and over the autotuner's pick. A pick the
sweep did not time counts as its slowest config, flagged. The constants fitted on every shape
are checked against the shipped ones; ``--judge`` sweeps (other runs) are judged under them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
from pathlib import Path

from swiglu_train.bench.results import git_commit, write_result
from swiglu_train.kernels.gated_tiles import RULE, TileRule

FILLS = [round(0.3 + 0.05 * i, 2) for i in range(15)]  # 0.30 .. 1.00
GRID = [
    TileRule(min_fill=fill, stream_n=n, stream_stages=stages)
    for n, stages, fill in itertools.product((32, 64, 128), (2, 3, 4, 5, 6), FILLS)
]


def label(tile: dict) -> str:
    """The sweep's name for a config: 16x32x128s4w2, a trailing p for a persistent grid."""
    blocks = f"{tile['BLOCK_M']}x{tile['BLOCK_N']}x{tile['BLOCK_K']}"
    return f"{blocks}s{tile['num_stages']}w{tile['num_warps']}{'p' if tile['PERSISTENT'] else ''}"


def points(sweep: dict) -> list[dict]:
    """Per row: the configs' times over the best one, and the autotuner's pick over the best."""
    out = []
    for r in sweep["rows"]:
        timed = {n: v for n, v in r["over_gemm_only"].items() if n != "autotuned"}
        best = min(timed.values())
        over = {n: v / best for n, v in timed.items()}
        auto = (
            r["over_gemm_only"]["autotuned"] / best if "autotuned" in r["over_gemm_only"] else None
        )
        out.append({"M": r["M"], "K": r["K"], "F": r["F"], "over_best": over,
                    "best": min(timed, key=timed.get), "autotuned": r.get("autotuned"),
                    "autotuned_over_best": auto})  # fmt: skip
    return out


def judge(rule: TileRule, p: dict, sms: int) -> tuple[str, float, bool]:
    """The rule's pick at a point, its time over the best, and whether the sweep timed it."""
    pick = label(rule.tile(p["M"], p["K"], p["F"], sms))
    timed = pick in p["over_best"]
    return pick, p["over_best"][pick] if timed else max(p["over_best"].values()), timed


def fit(train: list[dict], sms: int) -> TileRule:
    """The grid's rule with the least summed log(pick / best). The shapes left in may not
    decide a constant (only a small shape's decode feels the stage cap): each constant is
    then the middle of its tied values, never an end chosen by grid order."""
    loss = {r: sum(math.log(judge(r, p, sms)[1]) for p in train) for r in GRID}
    least = min(loss.values())
    tied = [r for r in GRID if loss[r] <= least + 1e-12]

    def middle(values: list) -> object:
        values = sorted(set(values))
        return values[(len(values) - 1) // 2]

    n = middle([r.stream_n for r in tied])
    stages = middle([r.stream_stages for r in tied if r.stream_n == n])
    fills = [r.min_fill for r in tied if (r.stream_n, r.stream_stages) == (n, stages)]
    return TileRule(middle(fills), n, stages) if fills else tied[0]


def rule_dict(rule: TileRule) -> dict:
    return {"min_fill": rule.min_fill, "stream_n": rule.stream_n,
            "stream_stages": rule.stream_stages}  # fmt: skip


def row(rule: TileRule, p: dict, sms: int) -> dict:
    pick, over, timed = judge(rule, p, sms)
    auto = p["autotuned_over_best"] if timed else None
    over = over if timed else None
    return {"M": p["M"], "K": p["K"], "F": p["F"], "rule": rule_dict(rule), "pick": pick,
            "timed": timed, "pick_over_best": None if over is None else round(over, 4),
            "best": p["best"],
            "autotuned": p["autotuned"],
            "autotuned_over_best": None if auto is None else round(auto, 4),
            "pick_over_autotuned": None if auto is None else round(over / auto, 4),
            "table_over_rule": None if over is None else round(1 / over, 4)}  # fmt: skip


def summary(rows: list[dict]) -> dict:
    """Over the timed picks; an untimed one is counted, not guessed."""
    timed = [r for r in rows if r["timed"]]
    over = [r["pick_over_best"] for r in timed]
    vs_auto = [r["pick_over_autotuned"] for r in timed if r["pick_over_autotuned"] is not None]
    return {"points": len(rows), "untimed_picks": sum(not r["timed"] for r in rows),
            "median_over_best": round(statistics.median(over), 4),
            "max_over_best": round(max(over), 4),
            "within_2pct": sum(o <= 1.02 for o in over),
            "median_over_autotuned": round(statistics.median(vs_auto), 4) if vs_auto else None,
            "geomean_over_autotuned": round(math.exp(statistics.fmean(map(math.log, vs_auto))), 4)
            if vs_auto else None}  # fmt: skip


def rerun_spread(a: dict, b: dict) -> dict:
    """How far two runs disagree on one config at one point (each timed over cuBLAS in its
    own run): the noise a table's in-sample edge over the rule must clear."""
    rows_b = {(r["M"], r["K"], r["F"]): r["over_gemm_only"] for r in b["rows"]}
    gaps = []
    for r in a["rows"]:
        other = rows_b.get((r["M"], r["K"], r["F"]), {})
        gaps += [abs(math.log(v / other[n])) for n, v in r["over_gemm_only"].items()
                 if n in other and n != "autotuned"]  # fmt: skip
    if not gaps:
        return {"configs": 0}
    return {"configs": len(gaps), "median": round(math.expm1(statistics.median(gaps)), 4),
            "max": round(math.expm1(max(gaps)), 4)}  # fmt: skip


def evaluate(sweep: dict, judged: list[dict], sms: int) -> dict:
    pts = points(sweep)
    shapes = sorted({(p["K"], p["F"]) for p in pts})
    loso = []
    for shape in shapes:
        rule = fit([p for p in pts if (p["K"], p["F"]) != shape], sms)
        loso += [row(rule, p, sms) for p in pts if (p["K"], p["F"]) == shape]
    full = fit(pts, sms)
    others = [{"sweep": s["commit"], "rows": [row(RULE, p, sms) for p in points(s)]}
              for s in judged]  # fmt: skip
    for o, s in zip(others, judged, strict=True):
        o["summary"] = summary(o["rows"]) | {"rerun_spread": rerun_spread(sweep, s)}
    return {"sms": sms, "sweep": {k: sweep[k] for k in ("gpu", "commit", "command")},
            "leave_one_shape_out": {"rows": loso, "summary": summary(loso)},
            "fitted_on_all": rule_dict(full), "shipped": rule_dict(RULE),
            "shipped_in_sample": summary([row(RULE, p, sms) for p in pts]),
            "judged": others}  # fmt: skip


def num(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def to_markdown(result: dict) -> str:
    s = result["leave_one_shape_out"]["summary"]
    lines = [f"### Gated GEMM tile rule, leave one shape out ({result['sweep']['gpu']}, "
             f"{result['sms']} SMs, sweep {result['sweep']['commit']})", "",
             f"`{result['command']}`", "",
             f"{s['points']} points: the pick runs {num(s['median_over_best'])}x the best config "
             f"(median; worst {num(s['max_over_best'])}x, {s['within_2pct']} within 2 %), "
             f"{num(s['median_over_autotuned'])}x the autotuner's pick (median; geomean "
             f"{num(s['geomean_over_autotuned'])}x). Untimed picks: {s['untimed_picks']}.", "",
             f"Fitted on all shapes: {result['fitted_on_all']}; shipped: {result['shipped']}; "
             f"shipped, in sample: median {num(result['shipped_in_sample']['median_over_best'])}x "
             f"the best, worst {num(result['shipped_in_sample']['max_over_best'])}x.", "",
             "| M | K | F | rule fitted without (K, F) | pick | ÷ best | best | "
             "autotuned ÷ best | pick ÷ autotuned |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in result["leave_one_shape_out"]["rows"]:
        fitted = ", ".join(f"{k} {v}" for k, v in r["rule"].items())
        pick = r["pick"] if r["timed"] else f"{r['pick']} (untimed)"
        lines.append(f"| {r['M']} | {r['K']} | {r['F']} | {fitted} | {pick} | "
                     f"{num(r['pick_over_best'])} | {r['best']} | "
                     f"{num(r['autotuned_over_best'])} | "
                     f"{num(r['pick_over_autotuned'])} |")  # fmt: skip
    for o in result["judged"]:
        s, spread = o["summary"], o["summary"]["rerun_spread"]
        lines += ["", f"Sweep {o['sweep']} under the shipped rule: {s['points']} points, "
                  f"{s['untimed_picks']} picks untimed; the timed ones run "
                  f"{num(s['median_over_best'])}x the best (median; worst "
                  f"{num(s['max_over_best'])}x), {num(s['median_over_autotuned'])}x the "
                  f"autotuner's pick. The two runs disagree on one config at one point by "
                  f"{spread.get('median')} (median), up to {spread.get('max')}, over "
                  f"{spread['configs']} configs timed in both.", "",
                  "| M | K | F | pick | ÷ best | best | autotuned ÷ best |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in o["rows"]:
            pick = r["pick"] if r["timed"] else f"{r['pick']} (untimed)"
            lines.append(f"| {r['M']} | {r['K']} | {r['F']} | {pick} | "
                         f"{num(r['pick_over_best'])} | {r['best']} | "
                         f"{num(r['autotuned_over_best'])} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", required=True, help="sweep_gated_configs.py JSON to fit on")
    parser.add_argument("--judge", nargs="*", default=[], help="other sweeps, judged only")
    parser.add_argument("--sms", type=int, default=132, help="the swept GPU's SM count")
    parser.add_argument("--json", required=True)
    parser.add_argument("--md")
    args = parser.parse_args()
    judged = [json.loads(Path(p).read_text()) for p in args.judge]
    result = evaluate(json.loads(Path(args.sweep).read_text()), judged, args.sms)
    script = f"benchmarks/{Path(__file__).name}"
    result = write_result(
        script, {"commit": git_commit()} | result, args.json, args.md, to_markdown
    )
    s = result["leave_one_shape_out"]["summary"]
    print(
        f"leave one shape out: median {num(s['median_over_best'])}x best, worst "
        f"{num(s['max_over_best'])}x, {num(s['median_over_autotuned'])}x autotuned (median)"
    )


if __name__ == "__main__":
    main()
