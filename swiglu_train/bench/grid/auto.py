"""``impl="auto"`` judged on the model grid: its pick at each point against the fastest impl.

Three sets of picks are judged:
- **picked during the run**: what ParMLP resolved to on the GPU while the grid ran, from
  whatever auto read then (``meta.auto_table`` records it); each point says whether its (D, F)
  was among the shapes that file was fitted or measured at;
- **the shipped model** (``layers/auto_<family>.json`` of this package, which may be newer than
  the run): each point says whether it is among the model's fitted points (in sample);
- **leave one family out** (LOFO): for each family, a model fitted from the grid without any
  shape of that family (one it shares with another family included), predicting that family's
  points, so every pick is out of sample.

The shipped and LOFO models are judged twice where the run had quack: with every impl, and as
on a machine without quack (the portable impls alone, against the fastest of them).

A pick passes when its paired ratio to the floor is within ``TIE_TOLERANCE`` (1 %) of the
fastest impl measured at the point among those auto could pick. Peers (quack's mlp_func, Liger,
torch.compile, FLA) are not "the fastest" here. The measured rule's own pick (the least
after-forward memory among impls within 1 % of the fastest) is reported beside it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

from swiglu_train.layers.auto import PREDICTED_TIE, model_filename, packaged_model, resolve
from swiglu_train.layers.auto_fit import fit_auto_model
from swiglu_train.layers.auto_model import AutoModel
from swiglu_train.layers.auto_rule import TIE_TOLERANCE, ImplStats, measured_pick
from swiglu_train.layers.registry import MLP_IMPLS, PORTABLE_IMPLS

Dims = tuple[int, int, int]  # (M, D, F)
IMPL_SETS = {"with_quack": MLP_IMPLS, "without_quack": PORTABLE_IMPLS}


def impl_stats(rows: Sequence[dict]) -> dict[Dims, dict[str, ImplStats]]:
    """Per point, the measured stats of our impls (what auto chooses among)."""
    stats: dict[Dims, dict[str, ImplStats]] = {}
    for r in rows:
        if r["variant"] in MLP_IMPLS:
            entry = ImplStats(r["ratio_to_floor"], r["after_forward_MiB"])
            stats.setdefault((r["M"], r["D"], r["F"]), {})[r["variant"]] = entry
    return stats


def judge(pick: str, impls: Mapping[str, ImplStats]) -> dict:
    """``pick`` at one point among ``impls``: its ratio over the fastest impl's, whether that is
    within the tolerance, and what the measured rule picks there."""
    fastest = min(impls, key=lambda n: impls[n].ratio_to_floor)
    best = impls[fastest].ratio_to_floor
    rule = measured_pick(impls)
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


def held_out_shapes(result: dict, family: str) -> set[tuple[int, int]]:
    return {(p["D"], p["F"]) for p in result["points"] if family in p["families"]}


def lofo_model(result: dict, family: str) -> AutoModel:
    """A model fitted from the grid's rows minus every shape ``family`` has; a ValueError
    says why none can be fitted (no other shape, too few D)."""
    held_out = held_out_shapes(result, family)
    rows = [r for r in result["rows"] if (r["D"], r["F"]) not in held_out]
    fitted = fit_auto_model({"meta": result["meta"], "rows": rows}, f"leave out {family}")
    return AutoModel.from_dict(fitted, f"fitted without {family}")


def evaluate_auto(result: dict, judged: tuple[AutoModel, str] | None = None) -> dict:
    """The picks made during the run, the shipped model's and the LOFO models', judged at
    every measured point; off CUDA, a reason instead (no memory or GPU-time readings).
    ``judged``: (model, file name) to judge as the shipped one instead of this package's (the
    model ``bench-grid --auto-model`` has just fitted, to be shipped)."""
    meta, stats = result["meta"], impl_stats(result["rows"])
    if not stats:
        return {"skipped": f"no impl of ours was timed (only {meta['variants']}): nothing to pick"}
    readings = [s.after_forward_MiB for impls in stats.values() for s in impls.values()]
    if meta["gpu_family"] is None or not readings or None in readings:
        return {"skipped": "needs a CUDA run: the model is fitted from allocator readings"}
    sets = [
        name
        for name, impls in IMPL_SETS.items()
        if (name == "without_quack" or meta["quack_available"])
        and set(impls) & set(meta["variants"])  # a run of a few variants judges what it timed
    ]
    during = _during_run(result, stats)
    out = {
        "tolerance": TIE_TOLERANCE,
        "predicted_tie": PREDICTED_TIE,
        "impl_sets": sets,
        "during_run": during,
        "during_run_summary": summary(during),
        "during_run_out_of_sample_summary": summary([e for e in during if e["in_sample"] is False]),
    }
    family = meta["gpu_family"]
    model, file = judged or (packaged_model(family), model_filename(family))
    if model is None:
        out["shipped"] = {"skipped": f"no model shipped for GPU family {meta['gpu_family']!r}"}
    else:
        in_sample = set(model.points)
        out["shipped"] = {
            "file": file,
            "commit": model.commit,
            "device_name": model.device_name,
            "command": model.command,
            "points": {
                s: _picks(result, stats, model, IMPL_SETS[s], lambda dims: dims in in_sample)
                for s in sets
            },
        }
        out["shipped"]["summary"] = {s: summary(out["shipped"]["points"][s]) for s in sets}
        out["shipped"]["out_of_sample_summary"] = {
            s: summary([e for e in out["shipped"]["points"][s] if not e["in_sample"]]) for s in sets
        }
    out["lofo"] = _lofo(result, stats, sets)
    out["lofo_summary"] = {
        s: summary([e for family in out["lofo"] for e in family.get("points", {}).get(s, [])])
        for s in sets
    }
    return out


def _during_run(result: dict, stats: Mapping[Dims, Mapping[str, ImplStats]]) -> list[dict]:
    table = result["meta"]["auto_table"]
    shapes = None if table is None else {(d, f) for _, d, f in table["points"]}
    entries = []
    for p in result["points"]:
        dims = (p["M"], p["D"], p["F"])
        if dims not in stats:
            continue
        entry = {"M": p["M"], "D": p["D"], "F": p["F"], "models": p["models"]}
        entry["in_sample"] = None if shapes is None else (p["D"], p["F"]) in shapes
        entry |= judge(p["auto"]["impl"], stats[dims]) | {"reason": p["auto"]["reason"]}
        entries.append(entry)
    return entries


def _picks(
    result: dict,
    stats: Mapping[Dims, Mapping[str, ImplStats]],
    model: AutoModel,
    impls: Collection[str],
    in_sample: Callable[[Dims], bool],
    shapes: Collection[tuple[int, int]] | None = None,
) -> list[dict]:
    """``model``'s pick at every measured point (of ``shapes`` when given) among ``impls``,
    judged against the fastest of them; ``in_sample(dims)`` flags the model's own points."""
    quack = any(n not in PORTABLE_IMPLS for n in impls)
    entries = []
    for p in result["points"]:
        dims = (p["M"], p["D"], p["F"])
        if dims not in stats or (shapes is not None and (p["D"], p["F"]) not in shapes):
            continue
        measured = {n: s for n, s in stats[dims].items() if n in impls}
        auto = resolve(
            p["M"], p["D"], p["F"], result["meta"]["device_name"], model,
            output_size=p["D"], quack=quack,
        )  # fmt: skip
        low, high = model.d_range
        predicted = model.predict(*dims).get(auto.impl) if low <= p["D"] <= high else None
        entry = {"M": p["M"], "D": p["D"], "F": p["F"], "models": p["models"]}
        entry["in_sample"] = in_sample(dims)
        entry["predicted_ratio"] = None if predicted is None else predicted.ratio
        entries.append(entry | judge(auto.impl, measured) | {"reason": auto.reason})
    return entries


def _lofo(
    result: dict, stats: Mapping[Dims, Mapping[str, ImplStats]], sets: Sequence[str]
) -> list[dict]:
    families = dict.fromkeys(f for p in result["points"] for f in p["families"])
    evaluations = []
    for family in families:
        held_out = held_out_shapes(result, family)
        entry: dict = {"family": family, "held_out_shapes": sorted(map(list, held_out))}
        try:
            model = lofo_model(result, family)
        except ValueError as e:
            evaluations.append(entry | {"skipped": f"no model to fit: {e}"})
            continue
        entry["model_shapes"] = sorted({(d, f) for _, d, f in model.points})
        entry["points"] = {
            s: _picks(result, stats, model, IMPL_SETS[s], lambda _: False, held_out) for s in sets
        }
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
