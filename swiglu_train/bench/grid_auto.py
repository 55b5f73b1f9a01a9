"""``impl="auto"`` judged on the model grid: its pick at each point against the fastest impl.

Two kinds of table are judged. The shipped one (``layers/crossover_<gpu>.json``, what ParMLP
read in the run): each point says whether its (D, F) is among the table's shapes, since only a
point off the table is out of sample. And tables fitted from the grid itself with one family
left out (leave-one-family-out): every shape of that family, one it shares with another family
included, is absent from the table that picks for it, so each pick is out of sample.

A pick passes when its paired ratio to the floor is within ``TIE_TOLERANCE`` (1 %) of the
fastest impl measured at the point. Auto picks among our impls, so peers (quack's mlp_func,
Liger, torch.compile, FLA) are not "the fastest" here. The rule's own pick there (the least
after-forward memory among impls within 1 % of the fastest) is reported beside it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from swiglu_train.bench.crossover import lookup_table
from swiglu_train.layers.auto import (
    TIE_TOLERANCE,
    CrossoverTable,
    ImplStats,
    choose,
    resolve,
)
from swiglu_train.layers.registry import MLP_IMPLS

Dims = tuple[int, int, int]  # (M, D, F)


def impl_stats(rows: Sequence[dict]) -> dict[Dims, dict[str, ImplStats]]:
    """Per point, the measured stats of our impls (what auto chooses among)."""
    stats: dict[Dims, dict[str, ImplStats]] = {}
    for r in rows:
        if r["variant"] in MLP_IMPLS:
            entry = ImplStats(r["ms"], r["ratio_to_floor"], r["after_forward_MiB"])
            stats.setdefault((r["M"], r["D"], r["F"]), {})[r["variant"]] = entry
    return stats


def judge(pick: str, impls: Mapping[str, ImplStats]) -> dict:
    """``pick`` at one point: its ratio over the fastest impl's, whether that is within the
    tolerance, and what the rule picks from these measurements."""
    fastest = min(impls, key=lambda n: impls[n].ratio_to_floor)
    best = impls[fastest].ratio_to_floor
    rule, _ = choose(impls)
    picked = impls.get(pick)
    return {
        "pick": pick,
        "pick_ratio": None if picked is None else picked.ratio_to_floor,
        "fastest": fastest,
        "fastest_ratio": best,
        "pick_over_fastest": None if picked is None else picked.ratio_to_floor / best,
        "within_tolerance": picked is not None
        and picked.ratio_to_floor <= best * (1 + TIE_TOLERANCE),
        "rule_pick": rule,
        "pick_is_rule": pick == rule,
        "pick_after_forward_MiB": None if picked is None else picked.after_forward_MiB,
        "rule_after_forward_MiB": impls[rule].after_forward_MiB,
    }


def lofo_table(result: dict, family: str) -> CrossoverTable | None:
    """A crossover table fitted from the grid's points, minus every shape ``family`` has
    (None when no other shape is left to fit it from)."""
    held_out = held_out_shapes(result, family)
    rows = [
        {**r, "impl": r["variant"]}
        for r in result["rows"]
        if r["variant"] in MLP_IMPLS and (r["D"], r["F"]) not in held_out
    ]
    if not rows:
        return None
    meta = result["meta"]
    source = {k: meta[k] for k in ("gpu_family", "device_name", "commit", "dtype")}
    source["command"] = f"bench-grid, leave out {family}"
    return CrossoverTable.from_dict(lookup_table({"meta": source, "rows": rows}))


def held_out_shapes(result: dict, family: str) -> set[tuple[int, int]]:
    return {(p["D"], p["F"]) for p in result["points"] if family in p["families"]}


def evaluate_auto(result: dict) -> dict:
    """The shipped table's picks (with in-sample flags) and the leave-one-family-out picks,
    judged at every measured point; off CUDA, a reason instead (no memory readings)."""
    meta, stats = result["meta"], impl_stats(result["rows"])
    readings = [s.after_forward_MiB for impls in stats.values() for s in impls.values()]
    if meta["gpu_family"] is None or not readings or None in readings:
        return {"skipped": "needs a CUDA run: the rule breaks ties by allocator readings"}
    shipped = _shipped(result, stats)
    out_of_sample = [e for e in shipped if e["shape_in_table"] is False]
    lofo = _lofo(result, stats)
    judged = [e for family in lofo for e in family.get("points", [])]
    return {
        "tolerance": TIE_TOLERANCE,
        "shipped": shipped,
        "shipped_summary": summary(shipped),
        "shipped_out_of_sample_summary": summary(out_of_sample),
        "lofo": lofo,
        "lofo_summary": summary(judged),
    }


def _shipped(result: dict, stats: Mapping[Dims, Mapping[str, ImplStats]]) -> list[dict]:
    table = result["meta"]["auto_table"]
    points = None if table is None else {tuple(p) for p in table["points"]}
    shapes = None if points is None else {(d, f) for _, d, f in points}
    entries = []
    for p in result["points"]:
        dims = (p["M"], p["D"], p["F"])
        if dims not in stats:
            continue
        entry = {"M": p["M"], "D": p["D"], "F": p["F"], "models": p["models"]}
        entry["shape_in_table"] = None if shapes is None else (p["D"], p["F"]) in shapes
        entry["point_in_table"] = None if points is None else dims in points
        entry |= judge(p["auto"]["impl"], stats[dims]) | {"reason": p["auto"]["reason"]}
        entries.append(entry)
    return entries


def _lofo(result: dict, stats: Mapping[Dims, Mapping[str, ImplStats]]) -> list[dict]:
    meta = result["meta"]
    families = dict.fromkeys(f for p in result["points"] for f in p["families"])
    evaluations = []
    for family in families:
        held_out = held_out_shapes(result, family)
        entry: dict = {"family": family, "held_out_shapes": sorted(map(list, held_out))}
        table = lofo_table(result, family)
        if table is None:
            evaluations.append(entry | {"skipped": "no other shape to fit a table from"})
            continue
        entry["table_shapes"] = sorted({(p.D, p.F) for p in table.points})
        entry["points"] = []
        for p in result["points"]:
            dims = (p["M"], p["D"], p["F"])
            if (p["D"], p["F"]) not in held_out or dims not in stats:
                continue
            auto = resolve(
                p["M"], p["D"], p["F"], meta["device_name"], table,
                output_size=p["D"], quack=meta["quack_available"],
            )  # fmt: skip
            judged = judge(auto.impl, stats[dims]) | {"reason": auto.reason}
            entry["points"].append({"M": p["M"], "D": p["D"], "F": p["F"], **judged})
        evaluations.append(entry)
    return evaluations


def summary(entries: Sequence[dict]) -> dict:
    """How many picks were within tolerance, how many matched the rule, and the worst one."""
    judged = [e for e in entries if e["pick_over_fastest"] is not None]
    worst = max(judged, key=lambda e: e["pick_over_fastest"], default=None)
    return {
        "picks": len(entries),
        "within_tolerance": sum(e["within_tolerance"] for e in entries),
        "rule_picks": sum(e["pick_is_rule"] for e in entries),
        "worst": None
        if worst is None
        else {k: worst[k] for k in ("M", "D", "F", "pick", "fastest", "pick_over_fastest")},
    }
